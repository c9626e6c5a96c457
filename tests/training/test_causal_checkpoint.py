"""causal_checkpoint on a toy causal model: exact against the one-shot sweep, recompute counts, RNG/autocast
replay, memory bounded over segments, errors.

The toy is a two-layer causal convolution over time (kernel 3, each layer caching its last two input frames,
as Wan's causal convolutions do) with trainable weights. Tolerances: fp32 results differ from the one-shot
sweep only by the order parameter-gradient shares are summed in, so they are compared within
``reassociation_tol`` of the one-shot sweep's own rounding noise (the same sweep in fp64).
"""

from __future__ import annotations

import pytest
import torch

from hfpatch.testing.memory import track_memory
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64
from hfpatch.training.causal_checkpoint import Segment, causal_checkpoint, snapshot_stride

CHANNELS = 6


class CausalConvNet(torch.nn.Module):
    """``[B, C, T]`` -> ``[B, C, T]``: two causal convolutions (kernel 3 over time) with a SiLU between."""

    def __init__(self, seed: int = 0, dropout: float = 0.0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.convs = torch.nn.ModuleList(torch.nn.Conv1d(CHANNELS, CHANNELS, 3) for _ in range(2))
        for conv in self.convs:
            conv.weight.data = torch.randn(conv.weight.shape, generator=gen) * 0.4
            conv.bias.data = torch.randn(conv.bias.shape, generator=gen) * 0.1
        self.dropout = dropout
        self.calls: list[tuple[int, bool, torch.dtype]] = []  # (segment, grad enabled, matmul dtype)

    def step(self, k: int, cache: list | None, x: torch.Tensor) -> tuple[torch.Tensor, list]:
        """One segment: each conv sees its cached last two input frames (zeros at the start) then ``x``."""
        cache = [None] * len(self.convs) if cache is None else cache
        for i, conv in enumerate(self.convs):
            past = x.new_zeros(x.shape[0], CHANNELS, 2) if cache[i] is None else cache[i]
            full = torch.cat([past, x], 2)
            cache[i] = full[:, :, -2:].clone()
            x = conv(full)
            if i == 0:
                x = torch.nn.functional.silu(x)
                if self.dropout:
                    keep = (torch.rand(x.shape, dtype=torch.float32) >= self.dropout).to(x.dtype)
                    x = x * keep / (1 - self.dropout)
        self.calls.append((k, torch.is_grad_enabled(), x.dtype))
        return x, cache


def _segments(items: int, frames: int, per_segment: int) -> list[Segment]:
    """Each item is its own sequence (fresh at its first segment)."""
    return [
        Segment((slice(i, i + 1), slice(None), slice(t, t + per_segment)), fresh=t == 0)
        for i in range(items)
        for t in range(0, frames, per_segment)
    ]


def _one_shot(net: CausalConvNet, x: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor]:
    """The same sweep with autograd through everything (what the checkpointed sweep must equal)."""
    outputs, cache = [], None
    for k, segment in enumerate(segments):
        y, cache = net.step(k, None if segment.fresh else cache, x[segment.index])
        outputs.append(y)
    return outputs


def _loss(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (y * weights).sum()


def _grads(net: torch.nn.Module, x: torch.Tensor, loss_of) -> tuple[torch.Tensor, torch.Tensor, list]:
    net.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(True)
    loss = loss_of(leaf)
    loss.backward()
    return loss.detach(), leaf.grad, [p.grad.clone() for p in net.parameters()]


def _assert_close(actual, expected, exact, what: str) -> None:
    for a, e, x, name in zip(actual[:2], expected[:2], exact[:2], ("loss", "input grad")):
        tol = reassociation_tol(rounding_noise(e, x))
        assert rel_error(a, e) <= tol, (what, name, rel_error(a, e), tol)
    for i, (a, e, x) in enumerate(zip(actual[2], expected[2], exact[2])):
        tol = reassociation_tol(rounding_noise(e, x))
        assert rel_error(a, e) <= tol, (what, f"param {i}", rel_error(a, e), tol)


def _cases(items: int = 2, frames: int = 11, per_segment: int = 2):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(items, CHANNELS, frames, generator=gen)
    weights = torch.randn(items, CHANNELS, frames, generator=gen)
    return x, weights, _segments(items, frames, per_segment)


@pytest.mark.parametrize("snapshot_every", [1, 2, "auto", 100])
@pytest.mark.parametrize("reduce", ["sum", "cat"])
def test_causal_checkpoint_equals_one_shot_sweep(reduce, snapshot_every):
    net = CausalConvNet()
    items = 2 if reduce == "sum" else 1  # "cat" concatenates one sequence
    x, weights, segments = _cases(items=items)

    def one_shot(net):
        def loss_of(leaf):
            outputs = _one_shot(net, leaf, segments)
            return sum(_loss(y, weights[s.index].to(y.dtype)) for y, s in zip(outputs, segments))

        return loss_of

    def checkpointed(leaf):
        if reduce == "cat":
            y = causal_checkpoint(net.step, leaf, segments, list(net.parameters()), reduce="cat", dim=2,
                                  snapshot_every=snapshot_every)  # fmt: skip
            return _loss(y, weights)

        def step(k, cache, x_k):  # a partial loss per segment, as the pixel loss does
            y, cache = net.step(k, cache, x_k)
            return _loss(y, weights[segments[k].index]), cache

        return causal_checkpoint(step, leaf, segments, list(net.parameters()), snapshot_every=snapshot_every)

    expected = _grads(net, x, one_shot(net))
    net64 = to_fp64(net)
    exact = _grads(net64, x.double(), one_shot(net64))
    _assert_close(_grads(net, x, checkpointed), expected, exact, f"{reduce} every {snapshot_every}")


@pytest.mark.parametrize(("snapshot_every", "extra"), [(1, 0), (3, 12 - 4), ("auto", 12 - 3)])
def test_causal_checkpoint_recompute_count(snapshot_every, extra):
    # 12 segments: forward runs each once without grad; backward rebuilds the caches of each block from its
    # snapshot (the block's segments but its last, without grad) and recomputes every segment with grad once.
    net = CausalConvNet()
    x, weights, segments = _cases(items=1, frames=12, per_segment=1)
    leaf = x.clone().requires_grad_(True)
    y = causal_checkpoint(net.step, leaf, segments, list(net.parameters()), reduce="cat", dim=2,
                          snapshot_every=snapshot_every)  # fmt: skip
    assert net.calls == [(k, False, torch.float32) for k in range(12)]
    net.calls.clear()
    _loss(y, weights).backward()
    with_grad = [k for k, grad, _ in net.calls if grad]
    assert with_grad == list(range(11, -1, -1)), "one recompute per segment, newest first"
    assert len(net.calls) - 12 == extra


def test_causal_checkpoint_replays_rng():
    # Dropout draws: the recompute must see the forward's draws; the one-shot sweep from the same seed draws
    # the same masks in the same order.
    net = CausalConvNet(dropout=0.3)
    x, weights, segments = _cases(items=1, frames=9, per_segment=3)

    def one_shot(leaf):
        return _loss(torch.cat(_one_shot(net, leaf, segments), 2), weights)

    def checkpointed(leaf):
        y = causal_checkpoint(net.step, leaf, segments, list(net.parameters()), reduce="cat", dim=2)
        return _loss(y, weights)

    torch.manual_seed(7)
    expected = _grads(net, x, one_shot)
    after_one_shot = torch.rand(1)
    net64 = to_fp64(net)
    torch.manual_seed(7)
    exact = _grads(
        net64, x.double(), lambda leaf: _loss(torch.cat(_one_shot(net64, leaf, segments), 2), weights)
    )
    torch.manual_seed(7)
    got = _grads(net, x, checkpointed)
    assert torch.equal(torch.rand(1), after_one_shot), "the global RNG advances as in the one-shot sweep"
    _assert_close(got, expected, exact, "dropout")


def test_causal_checkpoint_recompute_under_forward_autocast():
    net = CausalConvNet()
    x, weights, segments = _cases(items=1, frames=6, per_segment=2)
    leaf = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = causal_checkpoint(net.step, leaf, segments, list(net.parameters()), reduce="cat", dim=2)
    _loss(y.float(), weights).backward()  # outside autocast, as usual
    assert {dtype for _, _, dtype in net.calls} == {torch.bfloat16}, net.calls


def test_causal_checkpoint_memory_grows_as_sqrt_of_segments():
    # A model whose cache is large next to everything else (as a VAE's: two frames of each conv's wide
    # input), a cheap graph: the step's peak is the caches held. Keeping them all (snapshot_every=1) grows
    # with the segments K; "auto" holds about 2 sqrt(K) (block snapshots + one block's rebuilt caches).
    weight = torch.tensor(0.5, requires_grad=True)

    def step(k, cache, x_k):  # x_k: [1, 1, 1, W] -> a 64-channel frame, a kernel-3 causal conv over time
        wide = x_k.expand(-1, 64, -1, -1) * weight
        past = torch.zeros_like(wide).expand(-1, -1, 2, -1) if cache is None else cache[0]
        full = torch.cat([past, wide], 2)
        y = full[:, :, 2:] + full[:, :, 1:-1] * full[:, :, :-2]
        return y.square().sum(), [full[:, :, -2:].clone()]  # a copy, as Wan caches: not a view of `full`

    def peak(frames: int, snapshot_every) -> int:
        x = torch.randn(1, 1, frames, 1024).requires_grad_(True)
        segments = [Segment((slice(None), slice(None), slice(t, t + 1)), fresh=t == 0) for t in range(frames)]
        with track_memory() as memory:
            causal_checkpoint(step, x, segments, [weight], snapshot_every=snapshot_every).backward()
        return memory.peak_bytes

    every = {k: peak(k, 1) for k in (16, 64)}
    auto = {k: peak(k, "auto") for k in (16, 64)}
    cache, frame = 64 * 2 * 1024 * 4, 1024 * 4  # bytes of one cache, of one input frame (its gradient)
    # From 16 to 64 segments the peak grows by the extra caches held and the input gradient's 48 frames:
    # all caches, 15 -> 63; auto, (K/s - 1) block snapshots + s rebuilt in a block: 3 + 4 -> 7 + 8.
    assert abs((every[64] - every[16] - 48 * frame) / cache - 48) < 0.5, every
    assert abs((auto[64] - auto[16] - 48 * frame) / cache - 8) < 0.5, auto


def test_snapshot_stride():
    assert [snapshot_stride(k) for k in (1, 2, 4, 9, 10, 81)] == [1, 2, 2, 3, 4, 9]
    assert snapshot_stride(10, 1) == 1
    for bad in (0, -1, 1.5, True, "sqrt"):
        with pytest.raises(ValueError, match="snapshot_every"):
            snapshot_stride(4, bad)


def test_causal_checkpoint_bad_arguments_raise():
    net = CausalConvNet()
    x, _, segments = _cases(items=2)
    with pytest.raises(ValueError, match="first must be fresh"):
        causal_checkpoint(net.step, x, [Segment((slice(None),))])
    with pytest.raises(ValueError, match="at least one segment"):
        causal_checkpoint(net.step, x, [])
    with pytest.raises(ValueError, match="reduce must be"):
        causal_checkpoint(net.step, x, segments, reduce="mean")
    with pytest.raises(ValueError, match="one sequence"):
        causal_checkpoint(net.step, x, segments, reduce="cat", dim=2)  # two items: two sequences


def test_causal_checkpoint_double_backward_refused():
    net = CausalConvNet()
    x, weights, segments = _cases(items=1)
    leaf = x.clone().requires_grad_(True)
    y = causal_checkpoint(net.step, leaf, segments, list(net.parameters()), reduce="cat", dim=2)
    (grad,) = torch.autograd.grad(_loss(y, weights), leaf, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad.sum().backward()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_causal_checkpoint_error_leaves_nothing_alive(where):
    # An error (out of memory, say) in the middle of the sweep. While it is handled, its traceback holds the
    # frames of the sweep and of ``step``: no cache, snapshot or partial gradient the sweep made is alive
    # then (only the gradient arriving at the sweep, which torch's own frames hold); once it is dropped,
    # nothing at all.
    net = CausalConvNet()
    x, weights, segments = _cases(items=1, frames=12, per_segment=1)
    leaf = x.clone().requires_grad_(True)
    seen = []

    def step(k, cache, x_k):
        seen.append(torch.is_grad_enabled())
        if (where == "forward" and k == 7) or (where == "backward" and seen.count(True) == 3):
            raise MemoryError("injected")
        return net.step(k, cache, x_k)

    with track_memory() as memory:
        if where == "backward":
            loss = _loss(
                causal_checkpoint(step, leaf, segments, list(net.parameters()), reduce="cat", dim=2), weights
            )
            before = memory.live_bytes  # the loss and the sweep's snapshots
        with pytest.raises(MemoryError, match="injected") as excinfo:
            if where == "forward":
                causal_checkpoint(step, leaf, segments, list(net.parameters()), reduce="cat", dim=2)
            else:
                loss.backward()
        arriving = 0 if where == "forward" else x.nbytes + 4  # dL/dy and dL/dloss, held by torch's frames
        loss_bytes = 0 if where == "forward" else loss.untyped_storage().nbytes()
        assert excinfo.value is not None  # the traceback is held while we look
        assert memory.live_bytes - loss_bytes <= arriving, (memory.live_bytes, loss_bytes)
        del excinfo
        assert memory.live_bytes == loss_bytes
    if where == "backward":
        assert before > loss_bytes  # there were snapshots to release
