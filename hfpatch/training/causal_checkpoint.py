"""Activation checkpointing along time for causal models that carry a cache from one segment to the next.

A causal video VAE (Wan's) decodes a video latent frame by latent frame; each causal convolution keeps the
last frames of its input in a cache, so segment ``k`` depends on segment ``k - 1`` only through that cache.
Back-propagating through the whole video holds every frame's graph (the memory grows with the frames). Here
the forward keeps no graph at all, only some of the caches, and the backward sweeps the segments in reverse::

    forward   c_0 = empty;  (y_k, c_{k+1}) = step_k(c_k, x_k)            no graph; keep c_k for some k
    backward  for k = K-1 .. 0:  rebuild c_k;  recompute step_k with grad from (c_k, x_k);
              back-propagate (dL/dy_k, dL/dc_{k+1})  ->  (dL/dc_k, dL/dx_k, dL/dtheta_k)

Why this is exact: the loss depends on ``c_{k+1}`` only through the segments after ``k``, so when segment
``k`` is reached its outgoing cache's gradient ``dL/dc_{k+1}`` is complete (segment ``k + 1`` produced it),
and the chain rule through ``step_k`` gives the full gradients of ``c_k``, ``x_k`` and segment ``k``'s share
of the parameter gradient; parameter gradients are the sum of the segments' shares. The recompute runs the
same operations on the same values as the forward (RNG and autocast state replayed), so it rebuilds the graph
the one-shot computation would have built for that segment; only the order in which the shares are summed
differs (floating-point reassociation).

Memory: one segment's graph plus the kept caches. ``snapshot_every=1`` keeps the cache entering every segment
(no extra compute: forward + recompute + backward, as ``torch.utils.checkpoint`` costs); ``"auto"`` keeps every
``ceil(sqrt(K))``-th one, and the backward rebuilds the caches of one block of segments at a time from its
block's snapshot (one more no-grad forward of most segments; caches held grow as ``2 sqrt(K)``, not ``K``).

>>> import torch
>>> from hfpatch.training.causal_checkpoint import Segment, causal_checkpoint
>>> w = torch.tensor(0.5, requires_grad=True)
>>> def step(k, cache, x):                       # y_t = x_t + w * y_{t-1}: a causal recurrence over time
...     prev = torch.zeros(()) if cache is None else cache[0]
...     ys = []
...     for t in range(x.shape[0]):
...         prev = x[t] + w * prev
...         ys.append(prev)
...     return torch.stack(ys), [prev]
>>> x = torch.randn(12, requires_grad=True)
>>> segments = [Segment((slice(t, t + 3),), fresh=t == 0) for t in range(0, 12, 3)]
>>> y = causal_checkpoint(step, x, segments, [w], reduce="cat", dim=0)
>>> (y ** 2).sum().backward()
>>> gx, gw = x.grad.clone(), w.grad.clone()
>>> x.grad = w.grad = None
>>> (step(0, None, x)[0] ** 2).sum().backward()   # one-shot
>>> torch.allclose(gx, x.grad), torch.allclose(gw, w.grad)
(True, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.autograd.function import once_differentiable

__all__ = ["Segment", "causal_checkpoint", "snapshot_stride"]

#: A cache: a list of tensors (and of the markers some models keep, such as ``None`` or ``"Rep"``).
Cache = list[Any]
#: ``step(k, cache, x_k) -> (y_k, cache_out)``; ``cache`` is ``None`` for a segment that starts a sequence.
Step = Callable[[int, Cache | None, torch.Tensor], tuple[torch.Tensor, Cache]]


@dataclass(frozen=True)
class Segment:
    """One step of the sweep.

    Attributes:
        index: What the segment reads of the input: ``x[index]`` (e.g. ``(slice(items), slice(None),
            slice(frames))``).
        fresh: The segment starts a new sequence (a new video): it gets no cache and the previous segment's
            cache gets no gradient from it.
    """

    index: tuple[slice, ...]
    fresh: bool = False


def snapshot_stride(segments: int, snapshot_every: int | Literal["auto"] = "auto") -> int:
    """Segments between two caches kept by the forward: ``snapshot_every``, or ``ceil(sqrt(segments))``.

    >>> [snapshot_stride(k) for k in (1, 4, 5, 16, 21)]
    [1, 2, 3, 4, 5]
    """
    if snapshot_every == "auto":
        return max(1, math.ceil(math.sqrt(segments)))
    if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1:
        raise ValueError(f"snapshot_every must be an int >= 1 or 'auto', got {snapshot_every!r}")
    return snapshot_every


def causal_checkpoint(
    step: Step,
    x: torch.Tensor,
    segments: Sequence[Segment],
    params: Sequence[torch.Tensor] = (),
    *,
    reduce: Literal["sum", "cat"] = "sum",
    dim: int = 0,
    snapshot_every: int | Literal["auto"] = "auto",
) -> torch.Tensor:
    """Run ``step`` over ``segments`` carrying its cache, with the memory of one segment's graph.

    Args:
        step: ``step(k, cache, x_k) -> (y_k, cache_out)`` for segment ``k`` reading ``x_k = x[segments[k].index]``;
            ``cache`` is ``None`` when the segment is ``fresh``, else the previous segment's ``cache_out`` (a list
            it may replace entries of, never modify in place). Must be deterministic given the RNG state (it is
            run again in backward) and may depend on ``x_k``, its cache and ``params`` only (anything else it
            closes over gets no gradient).
        x: The input (latents, video), read segment by segment.
        segments: The sweep, in order; the first one must be ``fresh``.
        params: Tensors ``step`` uses that need gradients (trainable weights), returned through autograd.
        reduce: ``"sum"``: the result is the sum of the ``y_k`` (e.g. partial loss sums); ``"cat"``: their
            concatenation along ``dim`` (then the segments must form one sequence, in order along ``dim``).
        dim: See ``reduce``.
        snapshot_every: Keep the cache entering every ``snapshot_every``-th segment in forward (see the module
            docstring); ``"auto"``: ``ceil(sqrt(len(segments)))``.

    Returns:
        The reduced result, differentiable w.r.t. ``x`` and ``params`` (not twice: double backward raises).
    """
    if not segments or not segments[0].fresh:
        raise ValueError("causal_checkpoint needs at least one segment, and the first must be fresh")
    if reduce not in ("sum", "cat"):
        raise ValueError(f"reduce must be 'sum' or 'cat', got {reduce!r}")
    if reduce == "cat" and any(s.fresh for s in segments[1:]):
        raise ValueError("reduce='cat' concatenates one sequence: only the first segment may be fresh")
    stride = snapshot_stride(len(segments), snapshot_every)
    trained = [p for p in params if p.requires_grad]
    plan = _Plan(step, tuple(segments), stride, reduce, dim, len(trained))
    return _CausalCheckpoint.apply(plan, x, *trained)


@dataclass(frozen=True)
class _Plan:
    step: Step
    segments: tuple[Segment, ...]
    stride: int
    reduce: str
    dim: int
    num_params: int

    def blocks(self) -> list[range]:
        """Ranges of segments whose entering cache is rebuilt from one snapshot (the forward keeps their starts)."""
        k = len(self.segments)
        return [range(start, min(start + self.stride, k)) for start in range(0, k, self.stride)]


@dataclass
class _Replay:
    """What re-running a segment needs besides its cache: the RNG and autocast state of its first run."""

    cpu_rng: torch.Tensor
    device_rng: tuple[list[int], list[torch.Tensor]]
    autocast: list[tuple[str, dict[str, Any]]]

    @staticmethod
    def capture(device: torch.device) -> _Replay:
        devices = (
            [device.index if device.index is not None else torch.cuda.current_device()]
            if (device.type == "cuda")
            else []
        )
        states = [torch.cuda.get_rng_state(d) for d in devices]
        autocast = [
            (kind, {"enabled": torch.is_autocast_enabled(kind), "dtype": torch.get_autocast_dtype(kind)})
            for kind in dict.fromkeys((device.type, "cpu"))
        ]
        return _Replay(torch.get_rng_state(), (devices, states), autocast)

    @contextmanager
    def restored(self) -> Iterator[None]:
        devices, states = self.device_rng
        with torch.random.fork_rng(devices=devices), ExitStack() as stack:
            torch.set_rng_state(self.cpu_rng)
            for d, state in zip(devices, states):
                torch.cuda.set_rng_state(state, d)
            for kind, kwargs in self.autocast:
                stack.enter_context(torch.autocast(kind, **kwargs))
            yield


class _CausalCheckpoint(torch.autograd.Function):
    """The sweep as one autograd node: forward without a graph, reverse sweep with recompute in backward."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        replays: list[_Replay] = []
        snapshots: dict[int, Cache | None] = {}
        outputs: list[torch.Tensor] = []
        starts = {b.start for b in plan.blocks()}
        cache: Cache | None = None
        given: Cache | None = None
        try:
            for k, segment in enumerate(plan.segments):
                if segment.fresh:
                    cache = None
                if k in starts:
                    snapshots[k] = None if cache is None else list(cache)
                replays.append(_Replay.capture(x.device))
                given = None if cache is None else list(cache)
                y, cache = plan.step(k, given, x[segment.index])
                outputs.append(y.detach())
        except BaseException:
            # Nothing the sweep made stays alive while the error (and its traceback, which holds the frames
            # of this call and of ``step``) is handled: the cache handed to ``step`` is emptied too.
            _release(given, cache, snapshots, outputs, replays)
            cache = given = y = None
            raise
        cache = None
        ctx.plan, ctx.replays, ctx.snapshots = plan, replays, snapshots
        ctx.sizes = [y.shape[plan.dim] for y in outputs] if plan.reduce == "cat" else None
        ctx.save_for_backward(x, *params)
        if plan.reduce == "sum":
            return torch.stack(outputs).sum(0) if len(outputs) > 1 else outputs[0]
        return torch.cat(outputs, plan.dim)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        x, *params = ctx.saved_tensors
        want_x = ctx.needs_input_grad[1]
        grad_x = torch.zeros_like(x) if want_x else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        grad_ys = [grad] * len(plan.segments) if plan.reduce == "sum" else grad.split(ctx.sizes, plan.dim)
        # dL/d(each entry of the cache leaving the segment being processed), None where it has no gradient.
        carried: list[torch.Tensor | None] = []
        entering: list[Cache | None] = []
        leaves: Cache = []
        given: Cache | None = None
        try:
            for block in reversed(plan.blocks()):
                entering = _rebuild(ctx, block, x)  # the cache entering each segment of the block
                ctx.snapshots.pop(block.start)
                for k in reversed(block):
                    segment = plan.segments[k]
                    leaves = [_leaf(t) for t in entering.pop() or ()]
                    x_k = x[segment.index].detach().requires_grad_(want_x)
                    given = None if segment.fresh else list(leaves)
                    with torch.enable_grad(), ctx.replays[k].restored():
                        y, cache_out = plan.step(k, given, x_k)
                    roots = [(y, grad_ys[k])] + [
                        (out, g)
                        for out, g in zip(cache_out, carried)
                        if g is not None and isinstance(out, torch.Tensor) and out.requires_grad
                    ]
                    del y, cache_out
                    wrt_cache = [t for t in leaves if _is_leaf(t)]
                    wrt = ([x_k] if want_x else []) + wrt_cache + params
                    got = _grad(roots, wrt)
                    del roots
                    given = (
                        None  # ``step`` may return the list it was given, filled with this segment's cache
                    )
                    if want_x and got[0] is not None:
                        grad_x[segment.index] += got[0]
                    got = got[1:] if want_x else got
                    by_leaf = dict(zip(map(id, wrt_cache), got[: len(wrt_cache)]))
                    carried = [by_leaf.get(id(t)) for t in leaves]
                    for i, g in enumerate(got[len(wrt_cache) :]):
                        if g is not None:
                            grad_params[i] = g if grad_params[i] is None else grad_params[i].add_(g)
                    del wrt, wrt_cache, got, by_leaf
        except BaseException:
            # As in forward: nothing made here stays alive while the error is handled.
            _release(given, entering, leaves, carried, grad_params)
            grad = grad_x = grad_ys = x_k = y = cache_out = roots = g = None  # noqa: F841
            raise
        finally:
            ctx.snapshots = ctx.replays = None
        return (None, grad_x, *grad_params)


def _release(*containers: Any) -> None:
    """Empty the lists/dicts given (``None`` skipped): their tensors are freed even while a traceback holds
    the frames that refer to the containers."""
    for c in containers:
        if c is not None:
            c.clear()


def _is_leaf(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value


def _grad(
    roots: list[tuple[torch.Tensor, torch.Tensor]], wrt: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Gradients of ``wrt`` given (output, its gradient) pairs; ``None`` where unused."""
    roots = [(r, g) for r, g in roots if r.requires_grad]
    if not roots or not wrt:
        return [None] * len(wrt)
    return list(torch.autograd.grad([r for r, _ in roots], wrt, [g for _, g in roots], allow_unused=True))


def _rebuild(ctx: Any, block: range, x: torch.Tensor) -> list[Cache | None]:
    """The cache entering each segment of ``block``, re-running the block (no graph) from its snapshot."""
    plan: _Plan = ctx.plan
    cache = ctx.snapshots[block.start]
    entering: list[Cache | None] = []
    given: Cache | None = None
    try:
        with torch.no_grad():
            for k in block:
                if plan.segments[k].fresh:
                    cache = None
                entering.append(cache)
                if k == block[-1]:
                    break
                given = None if cache is None else list(cache)
                with ctx.replays[k].restored():
                    _, cache = plan.step(k, given, x[plan.segments[k].index])
    except BaseException:
        _release(given, cache, entering)
        raise
    return entering
