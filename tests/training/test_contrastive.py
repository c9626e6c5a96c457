"""Row-blocked contrastive losses (``hfpatch.training.contrastive``) against their unchunked forms.

Reference = the textbook loss on the whole ``B x N`` matrix through autograd (sentence-transformers' MNRL and
GIST, OpenCLIP's ClipLoss and SigLipLoss, re-typed below). The row-blocked losses compute the same sums in
another grouping (a block's logsumexp, gradients summed over blocks and, cross-rank, over ranks), so:

* fp32: within ``reassociation_tol`` of the reference's own rounding noise, measured as the fp32 reference
  against the same reference in fp64 (same inputs and temperatures);
* fp64: the same computation with ``eps(fp64)`` instead of ``eps(fp32)``: the fp32 tolerance scaled by the ratio
  of the two epsilons (rounding error scales with the unit roundoff; the floor stays 8 ulps of fp64). An
  algorithmic difference hidden by fp32 noise (a wrong mask, a missing term) cannot hide there.

Errors are relative to the largest magnitude of each compared tensor (value, each input's gradient, each
temperature's gradient). Batch sizes leave a ragged last block (``B % block != 0``). Cross-rank cases run many
per spawn at world 2 and 3 with uneven rows per rank; the local gradient is ``W`` times the rank's rows of the
global gradient (DDP averages), the temperature's gradient the global one on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfpatch.distributed.collectives import count_comm
from hfpatch.testing.memory import track_memory
from hfpatch.testing.tolerance import FLOOR_ULPS, NOISE_FACTOR, eps, reassociation_tol, rel_error
from hfpatch.training.contrastive import (
    DEFAULT_BLOCK_BYTES,
    CLIPLoss,
    GISTLoss,
    InfoNCELoss,
    SigLIPLoss,
    takes_local_embeddings,
)

# -- references: the whole matrix through autograd ------------------------------------------------------


def _n(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1)


def ref_infonce(q, d, *negs, scale, directions=("query_to_doc",), partition_mode="joint", normalize=True):
    """sentence-transformers' MultipleNegativesRankingLoss.compute_loss_from_embeddings, one process."""
    if normalize:
        q, d, negs = _n(q), _n(d), [_n(x) for x in negs]
    docs = torch.cat([d, *negs])
    b = len(q)
    eye = torch.eye(b, dtype=torch.bool)
    sims = {"query_to_doc": q @ docs.T * scale}
    if "query_to_query" in directions:
        sims["query_to_query"] = (q @ q.T * scale).masked_fill(eye, -math.inf)
    if "doc_to_query" in directions:
        sims["doc_to_query"] = d @ q.T * scale
    if "doc_to_doc" in directions:
        sims["doc_to_doc"] = (d @ docs.T * scale).masked_fill(eye.repeat(1, 1 + len(negs)), -math.inf)
    positive = sims["query_to_doc"].diagonal()
    if partition_mode == "joint":
        log_z = torch.cat(list(sims.values()), 1).logsumexp(1)
    else:
        log_z = sum(s.logsumexp(1) for s in sims.values()) / len(sims)
    return (log_z - positive).mean()


def ref_clip(images, texts, logit_scale):
    """OpenCLIP's ClipLoss on normalized features with scale exp(logit_scale)."""
    logits = logit_scale.exp() * _n(images) @ _n(texts).T
    labels = torch.arange(len(images))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def ref_siglip(images, texts, logit_scale, logit_bias):
    """OpenCLIP's SigLipLoss (one process): -sum log sigmoid(z * logits) / B."""
    logits = logit_scale.exp() * _n(images) @ _n(texts).T + logit_bias
    labels = 2 * torch.eye(len(images), dtype=logits.dtype) - 1
    return -F.logsigmoid(labels * logits).sum() / len(images)


def ref_gist(
    a, p, *negs, guide, temperature, margin_strategy="absolute", margin=0.0, anchors=True, positives=True
):
    """sentence-transformers' GISTEmbedLoss (one process; any number of negatives)."""
    a, p, negs = _n(a), _n(p), [_n(x) for x in negs]
    ga, gp, gn = _n(guide[0]), _n(guide[1]), [_n(x) for x in guide[2:]]
    pair = (ga @ gp.T).diagonal().view(-1, 1)
    threshold = pair - margin if margin_strategy == "absolute" else pair - pair.abs() * margin
    keep = torch.eye(len(a), dtype=torch.bool)

    def masked(guided, sims, protect=None):
        mask = guided > threshold
        return sims.masked_fill(mask & ~protect if protect is not None else mask, -math.inf)

    scores = [masked(ga @ gp.T, a @ p.T, keep)]
    if anchors:
        scores.append(masked(ga @ ga.T, a @ a.T))
    if positives:
        scores.append(masked(gp @ gp.T, p @ p.T))
    if negs:
        scores.append(masked(ga @ torch.cat(gn).T, a @ torch.cat(negs).T))
    return F.cross_entropy(torch.cat(scores, 1) / temperature, torch.arange(len(a)))


# -- the cases: (name, inputs, batch, width, build) -----------------------------------------------------
# build(dtype, block) -> (loss_fn(*xs, **kw), ref_fn(*xs), [temperature tensors whose gradients are compared])


def _guides(n: int, batch: int, dtype: torch.dtype, width: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(batch, width, generator=gen).to(dtype) for _ in range(n)]


def _mnrl(directions, partition_mode="joint"):
    def build(dtype, block, batch, n):
        loss = InfoNCELoss(20.0, directions=directions, partition_mode=partition_mode, block_size=block)
        ref = lambda *x: ref_infonce(*x, scale=20.0, directions=directions, partition_mode=partition_mode)  # noqa: E731
        return loss, ref, []

    return build


def _learned_dot(dtype, block, batch, n):
    scale = torch.nn.Parameter(torch.tensor(0.7).to(dtype))  # a caller's tensor: used as it is
    directions = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    loss = InfoNCELoss(scale, directions=directions, block_size=block, normalize=False)
    ref = lambda *x: ref_infonce(*x, scale=scale, directions=directions, normalize=False)  # noqa: E731
    return loss, ref, [scale]


def _clip(dtype, block, batch, n):
    loss = CLIPLoss(block_size=block).to(dtype)
    return loss, (lambda i, t: ref_clip(i, t, loss.logit_scale)), [loss.logit_scale]


def _siglip(dtype, block, batch, n):
    loss = SigLIPLoss(block_size=block).to(dtype)
    with torch.no_grad():
        loss.logit_bias.fill_(-2.0)  # SigLIP's -10 leaves every pair's gradient tiny at random init
    return (
        loss,
        (lambda x, y: ref_siglip(x, y, loss.logit_scale, loss.logit_bias)),
        [loss.logit_scale, loss.logit_bias],
    )


def _gist(margin_strategy, margin, anchors=True, positives=True):
    def build(dtype, block, batch, n):
        loss = GISTLoss(
            0.05,
            margin_strategy=margin_strategy,
            margin=margin,
            contrast_anchors=anchors,
            contrast_positives=positives,
            block_size=block,
        )
        guide = _guides(n, batch, dtype)
        ref = lambda *x: ref_gist(  # noqa: E731
            *x,
            guide=guide,
            temperature=0.05,
            margin_strategy=margin_strategy,
            margin=margin,
            anchors=anchors,
            positives=positives,
        )
        return _with_guide(loss, guide), ref, []

    return build


class _with_guide:
    """A GIST loss with its guide embeddings bound (the guide of the global batch is sliced per rank)."""

    gathers_across_ranks = True

    def __init__(self, loss, guide):
        self.loss, self.guide, self.rows = loss, guide, slice(None)

    def __call__(self, *x, **kw):
        return self.loss(*x, guide=[g[self.rows] for g in self.guide], **kw)


CASES = {
    "mnrl": (2, 7, 5, _mnrl(("query_to_doc",))),
    "mnrl_hard_negatives": (4, 10, 5, _mnrl(("query_to_doc",))),
    "mnrl_symmetric": (3, 9, 6, _mnrl(("query_to_doc", "doc_to_query"), "per_direction")),
    "gte_joint_learned_dot": (3, 7, 4, _learned_dot),
    "clip": (2, 11, 6, _clip),
    "siglip": (2, 10, 6, _siglip),
    "gist_absolute": (3, 8, 4, _gist("absolute", 0.05)),
    "gist_relative": (2, 7, 4, _gist("relative", 0.1, positives=False)),
}
BLOCK = 3  # ragged: 7, 8, 10, 11 rows leave 1 or 2; 9 rows with block 4 (below) leave 1


def _inputs(name: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    n, batch, width, _ = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return [torch.randn(batch, width, generator=gen).to(dtype) for _ in range(n)]


def _run(fn, xs, params, **kw) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Value, input gradients and temperature gradients of ``fn(*xs)``."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    for p in params:
        p.grad = None
    value = fn(*leaves, **kw)
    value.backward()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return value.detach(), [x.grad for x in leaves], grads


def _errors(got, ref) -> list[float]:
    value, grads, scalars = got
    ref_value, ref_grads, ref_scalars = ref
    return [rel_error(value, ref_value)] + [
        rel_error(g, r) for g, r in zip([*grads, *scalars], [*ref_grads, *ref_scalars], strict=True)
    ]


def _reference(name: str, block: int = BLOCK):
    """(fp32 reference result, its noise against fp64, the fp64 reference result)."""
    n, batch, _, build = CASES[name]
    _, ref32, params32 = build(torch.float32, block, batch, n)
    _, ref64, params64 = build(torch.float64, block, batch, n)
    with torch.no_grad():
        for p32, p64 in zip(params32, params64):
            p64.copy_(p32.double())
    r32 = _run(ref32, _inputs(name), params32)
    r64 = _run(ref64, _inputs(name, torch.float64), params64)
    return r32, max(_errors(r32, r64)), r64


@pytest.mark.parametrize("name", list(CASES))
def test_row_blocked_loss_equals_unchunked_value_and_gradients(name):
    n, batch, _, build = CASES[name]
    block = 4 if batch == 9 else BLOCK
    assert batch % block, "a ragged last block"
    ref32, noise, ref64 = _reference(name, block)
    tol = reassociation_tol(noise)
    loss32, _, params32 = build(torch.float32, block, batch, n)
    got32 = _run(loss32, _inputs(name), params32)
    errors32 = _errors(got32, ref32)
    # fp64: the same reassociation with eps(fp64) in place of eps(fp32) (see the module docstring)
    tol64 = max(tol * eps(torch.float64) / eps(torch.float32), FLOOR_ULPS * eps(torch.float64))
    loss64, _, params64 = build(torch.float64, block, batch, n)
    got64 = _run(loss64, _inputs(name, torch.float64), params64)
    errors64 = _errors(got64, ref64)
    print(
        f"{name}: fp32 max error {max(errors32):.2e} (tol {tol:.2e}); fp64 {max(errors64):.2e} (tol {tol64:.2e})"
    )
    assert max(errors32) <= tol, errors32
    assert max(errors64) <= tol64, errors64
    assert len(got32[2]) == len(params32) and all(g.abs().max() > 0 for g in got32[2]), "temperature grads"


def test_no_grad_evaluation_gives_the_value_only():
    xs = _inputs("clip")
    loss = CLIPLoss(block_size=BLOCK)
    with torch.no_grad():
        value = loss(*xs)
    reference = ref_clip(*xs, loss.logit_scale.detach())
    assert not value.requires_grad and rel_error(value, reference) <= reassociation_tol(_reference("clip")[1])


def test_default_block_follows_the_memory_budget():
    loss = InfoNCELoss()
    # One direction, B = 32768 candidates, D = 768, fp32: a row holds its 32768 logits, the log-sum-exp's
    # temporary of them and 2 x 768 gradient entries (268,288 B). CLIP: two directions' logits, one temporary.
    assert loss.block_rows(2, 32768, 768) == DEFAULT_BLOCK_BYTES // (4 * (2 * 32768 + 2 * 768)) == 1000
    assert CLIPLoss().block_rows(2, 32768, 768) == DEFAULT_BLOCK_BYTES // (4 * (3 * 32768 + 3 * 768)) == 667
    assert InfoNCELoss(block_size=5).block_rows(2, 32768, 768) == 5
    assert InfoNCELoss(block_bytes=1).block_rows(2, 32768, 768) == 1, "at least one row"


def _loss_stage_peak(loss, batch: int, width: int = 16, n: int = 2) -> int:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(batch, width, generator=gen).requires_grad_() for _ in range(n)]
    with track_memory() as mem:
        loss(*xs).backward()
    return mem.peak_bytes


@pytest.mark.parametrize(
    "make", [lambda **kw: CLIPLoss(**kw), lambda **kw: SigLIPLoss(**kw)], ids=["clip", "siglip"]
)
def test_loss_stage_memory_is_budget_plus_linear_in_batch(make):
    """Peak live bytes of forward + backward at B = 2048: the block budget plus O(B x D) embeddings and
    gradients (the unchunked loss holds B^2 logits, softmax and their gradients: 16 MiB each here)."""
    batch, width = 2048, 16
    linear = 24 * batch * width * 4  # normalized copies, gathered columns, gradients of every input: < 24
    budget = 2**20
    peak = _loss_stage_peak(make(block_bytes=budget), batch, width)
    small = _loss_stage_peak(make(block_size=8), batch, width)
    print(f"peak {peak / 2**20:.2f} MiB with a 1 MiB budget, {small / 2**20:.2f} MiB at block 8")
    assert peak <= budget + linear
    assert small <= 8 * (4 * 3 * batch + 64 * width) + linear
    assert peak >= budget / 2, "the budget is used, not undershot"
    unchunked = _loss_stage_peak(make(block_size=batch), batch, width)
    assert unchunked >= 2 * batch * batch * 4, (
        "one block of every row holds the B x B matrix (the test's bound bites)"
    )


def test_bad_inputs_raise_clear_errors():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(
        ValueError, match=r"pairs row i of every input, but the inputs have batch sizes \[4, 5\]"
    ):
        CLIPLoss()(x, torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"different widths \[8, 6\]"):
        InfoNCELoss()(x, torch.randn(4, 6))
    with pytest.raises(
        ValueError, match=r"logit_scale must be a scalar \(shape \(\) or \(1,\)\), got .* \(2,\)"
    ):
        CLIPLoss(logit_scale=torch.zeros(2))
    with pytest.raises(ValueError, match="scale must be a scalar"):
        InfoNCELoss(torch.ones(1, 1))
    with pytest.raises(ValueError, match="logit_bias must be a scalar"):
        SigLIPLoss(logit_bias=torch.zeros(3))
    with pytest.raises(ValueError, match="takes 2 embedding inputs .* got 3"):
        SigLIPLoss()(x, y, y)
    with pytest.raises(ValueError, match="takes at least 2 embedding inputs .* got 1"):
        InfoNCELoss()(x)
    with pytest.raises(ValueError, match=r"embedding input 1 is 3-D; expected a \[batch, dim\]"):
        InfoNCELoss()(x, y[None])
    with pytest.raises(ValueError, match="must be floating-point"):
        InfoNCELoss()(x.long(), y.long())
    with pytest.raises(ValueError, match="needs guide="):
        GISTLoss()(x, y)
    with pytest.raises(ValueError, match="takes no guide embeddings"):
        CLIPLoss()(x, y, guide=[x, y])
    with pytest.raises(ValueError, match=r"batch sizes \[4, 4\] \(guides \[4, 3\]\)"):
        GISTLoss()(x, y, guide=[x, y[:3]])
    with pytest.raises(ValueError, match="block_size must be a positive number of rows"):
        InfoNCELoss(block_size=0)
    with pytest.raises(ValueError, match="give block_size or block_bytes, not both"):
        InfoNCELoss(block_size=2, block_bytes=10)
    with pytest.raises(ValueError, match="partition_mode='per_direction' needs every direction"):
        InfoNCELoss(directions=("query_to_doc", "doc_to_doc"), partition_mode="per_direction")


def test_takes_local_embeddings_and_double_backward_is_refused():
    assert takes_local_embeddings(CLIPLoss()) and not takes_local_embeddings(ref_clip)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="no double backward"):  # not a silently wrong second derivative
        torch.autograd.grad(InfoNCELoss()(x, x.flip(0)), x, create_graph=True)
    loss = InfoNCELoss()(x, x.flip(0))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="back-propagated twice"):  # its kept gradients were handed over
        loss.backward()


# -- cross-rank: world 2 and 3 ---------------------------------------------------------------------------


def _cross_rank_cases(sizes: list[int], names: list[str], bad: list[str]) -> dict:
    """On every rank: each named case on this rank's rows of the global batch (``sizes[r]`` rows on rank
    ``r``, rank-major), with the bytes sent per collective; then each bad-input case's error message."""
    rank = dist.get_rank()
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out = {}
    for name in names:
        n, batch, width, build = CASES[name]
        loss, _, params = build(torch.float32, 2, sum(sizes), n)
        if isinstance(loss, _with_guide):
            loss.rows = rows
        xs = [x[rows] for x in _global_inputs(name, sum(sizes))]
        with count_comm() as comm:
            result = _run(loss, xs, params, cross_rank=True)
        out[name] = (result, dict(comm.by_op), dict(comm.calls))
    errors = {}
    for case in bad:
        x = torch.randn(sizes[rank], 8)
        try:
            if case == "towers_differ_on_one_rank":
                CLIPLoss()(x, torch.randn(sizes[rank] + rank, 8), cross_rank=True)
            elif case == "widths_differ_between_ranks":
                CLIPLoss()(x[:, : 8 - rank], x[:, : 8 - rank], cross_rank=True)
            elif case == "inputs_differ_between_ranks":
                InfoNCELoss()(*[x] * (2 + rank), cross_rank=True)
            elif case == "settings_differ_between_ranks":
                InfoNCELoss(20.0 if rank else 10.0, directions=("query_to_doc", "doc_to_query")[: 1 + rank])(
                    x, x, cross_rank=True
                )
            elif case == "grad_on_some_ranks":
                with torch.set_grad_enabled(rank == 0):
                    CLIPLoss()(x, x, cross_rank=True)
            errors[case] = None
        except ValueError as exc:
            errors[case] = str(exc)
    out["errors"] = errors
    return out


def _global_inputs(name: str, batch: int) -> list[torch.Tensor]:
    n, _, width, _ = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return [torch.randn(batch, width, generator=gen) for _ in range(n)]


BAD = [
    "towers_differ_on_one_rank",
    "widths_differ_between_ranks",
    "inputs_differ_between_ranks",
    "settings_differ_between_ranks",
    "grad_on_some_ranks",
]


@pytest.mark.parametrize("sizes", [[5, 4], [4, 1, 6]], ids=["world2", "world3"])
def test_cross_rank_negatives_equal_one_process_on_the_global_batch(rank_pool, sizes):
    names = list(CASES)
    world, total = len(sizes), sum(sizes)
    per_rank = rank_pool(world).run(_cross_rank_cases, sizes, names, BAD)
    for name in names:
        n, _, width, build = CASES[name]
        ref_fn, params = build(torch.float32, 2, total, n)[1:]
        ref_fn64, params64 = build(torch.float64, 2, total, n)[1:]
        with torch.no_grad():
            for p, p64 in zip(params, params64):
                p64.copy_(p.double())
        xs = _global_inputs(name, total)
        ref = _run(ref_fn, xs, params)
        noise = max(_errors(ref, _run(ref_fn64, [x.double() for x in xs], params64)))
        # + the W x and / W of the gradient convention (one rounding each for W = 3)
        tol = reassociation_tol(noise) + (2 * eps() if world == 3 else 0)
        for rank, out in enumerate(per_rank):
            (value, grads, scalars), by_op, calls = out[name]
            rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
            local = [g / world for g in grads]  # the rank's rows of dL/dx, times W for DDP's average
            errors = [rel_error(value, ref[0])]
            errors += [rel_error(g, r[rows], scale=r.abs().max().item()) for g, r in zip(local, ref[1])]
            errors += [rel_error(s, r) for s, r in zip(scalars, ref[2])]
            print(f"{name} rank {rank}/{world}: max error {max(errors):.2e} (tol {tol:.2e})")
            assert max(errors) <= tol, (name, rank, errors)
            # Communication: metadata + one gather of the candidates (and GIST's guides), one reduce-scatter of
            # their gradients, one all-reduce of the value and the learned temperatures' gradients; bytes = the
            # analytic minimum (a rank sends its rows to W - 1 ranks, and every other rank's gradient rows).
            loss = build(torch.float32, 2, total, n)[0]
            loss = getattr(loss, "loss", loss)
            gathered = len(loss._gathered(n)) * width + (
                len(loss._gathered(n)) * 3 if name.startswith("gist") else 0
            )
            meta = (world - 1) * 8 * (6 + 3 * 32)
            assert calls == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}, (name, calls)
            assert by_op["all_gather"] == meta + (world - 1) * sizes[rank] * gathered * 4, name
            assert by_op["reduce_scatter"] == (total - sizes[rank]) * len(loss._gathered(n)) * width * 4, name
            assert by_op["all_reduce"] == 2 * (world - 1) * (1 + len(params)) * 4 // world, name
    for case in BAD:
        messages = [out["errors"][case] for out in per_rank]
        print(f"{case}: {messages[0]}")
        assert messages[0] is not None and all(m == messages[0] for m in messages), (case, messages)
    errors = per_rank[0]["errors"]
    first = sizes[1]
    assert f"batch sizes [{first}, {first + 1}] on rank 1" in errors["towers_differ_on_one_rank"]
    assert "different widths [8, 7" in errors["widths_differ_between_ranks"]
    assert "disagree on their numbers of embedding inputs: [2, 3" in errors["inputs_differ_between_ranks"]
    assert "different loss settings" in errors["settings_differ_between_ranks"]
    assert "some ranks compute gradients and others do not" in errors["grad_on_some_ranks"]


# -- numerics at scale 100: confidently classified rows ---------------------------------------------------


def plain_infonce(q, d, *negs, scale, per_direction=False):
    """InfoNCE through torch's max-subtracted ``cross_entropy`` (``ref_infonce`` differentiates
    ``logsumexp``, whose gradient is ``exp(logit - lse)``: not the plain softmax's precision)."""
    q, d, negs = _n(q), _n(d), [_n(x) for x in negs]
    labels = torch.arange(len(q))
    value = F.cross_entropy(q @ torch.cat([d, *negs]).T * scale, labels)
    return (value + F.cross_entropy(d @ q.T * scale, labels)) / 2 if per_direction else value


def _clip_100(dtype):
    return lambda i, t: ref_clip(i, t, torch.tensor(math.log(100.0), dtype=dtype))


def _siglip_100(dtype):
    scale, bias = torch.tensor(math.log(100.0), dtype=dtype), torch.tensor(-10.0, dtype=dtype)
    return lambda i, t: ref_siglip(i, t, scale, bias)


SCALE_100 = {  # name: (inputs, build(dtype) -> (row-blocked loss, plain loss)), every logit scale 100
    "infonce_hard_negatives": (
        3,
        lambda dt: (InfoNCELoss(100.0, block_size=3), lambda *x: plain_infonce(*x, scale=100.0)),
    ),
    "infonce_symmetric": (
        2,
        lambda dt: (
            InfoNCELoss(
                100.0,
                directions=("query_to_doc", "doc_to_query"),
                partition_mode="per_direction",
                block_size=3,
            ),
            lambda *x: plain_infonce(*x, scale=100.0, per_direction=True),
        ),
    ),
    "clip": (2, lambda dt: (CLIPLoss(math.log(100.0), block_size=3).to(dt), _clip_100(dt))),
    "gist": (
        3,  # the guide: each input's first 4 features (a guide that agrees on the pairs, masks a few others)
        lambda dt: (
            lambda *x, **kw: GISTLoss(0.01, block_size=3)(*x, guide=[t[:, :4] for t in x], **kw),
            lambda *x: ref_gist(*x, guide=[t[:, :4] for t in x], temperature=0.01),
        ),
    ),
    "siglip": (2, lambda dt: (SigLIPLoss(math.log(100.0), -10.0, block_size=3).to(dt), _siglip_100(dt))),
}


def _confident_inputs(n: int, batch: int, seed: int) -> list[torch.Tensor]:
    """Pairs close to each other (hard negatives less so) around a direction common to the batch: at scale 100
    most rows put 0.99-0.9999999 of their softmax on the positive, so a row's gradient is a small difference."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, 16, generator=gen) + torch.randn(1, 16, generator=gen)
    return [base + (0.5 if k < 2 else 1.0) * torch.randn(batch, 16, generator=gen) for k in range(n)]


SEEDS_100 = range(4)


def _scale_100_cases(sizes: list[int]) -> dict:
    """On every rank (one process: a world of one): each scale-100 loss's input gradients of this rank's rows."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out = {}
    for name, (n, build) in SCALE_100.items():
        loss = build(torch.float32)[0]
        for seed in SEEDS_100:
            xs = [x[rows] for x in _confident_inputs(n, sum(sizes), seed)]
            out[name, seed] = [g / world for g in _run(loss, xs, [], cross_rank=world > 1)[1]]
    return out


@pytest.mark.parametrize("sizes", [[13], [7, 6]], ids=["one_process", "world2"])
def test_scale_100_gradients_of_each_ranks_rows_are_as_exact_as_the_plain_softmax(rank_pool, sizes):
    """fp32 error (against fp64) of each rank's own rows' input gradients, relative to those rows' largest
    gradient, at most ``NOISE_FACTOR`` x the plain loss's (torch's max-subtracted softmax on the whole matrix)
    on the same rows: worst over the inputs and seeds of each loss. (A block's softmax as ``exp(logit - lse)``
    rounds ``lse`` ~ 100 to fp32: ~1e-6 absolute on every probability, the whole of a confident row's
    gradient; it measured 35-58x the plain softmax's error at world 2 and up to 74x in one process.)"""
    per_rank = (
        rank_pool(len(sizes)).run(_scale_100_cases, sizes) if len(sizes) > 1 else [_scale_100_cases(sizes)]
    )
    ratios = {}
    for name, (n, build) in SCALE_100.items():
        plain32, plain64 = build(torch.float32)[1], build(torch.float64)[1]
        worst, worst_plain = 0.0, 0.0
        for seed in SEEDS_100:
            xs = _confident_inputs(n, sum(sizes), seed)
            exact = _run(plain64, [x.double() for x in xs], [])[1]
            plain = _run(plain32, xs, [])[1]
            for rank, out in enumerate(per_rank):
                rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
                for got, p, r in zip(out[name, seed], plain, exact, strict=True):
                    scale = r[rows].abs().max().item()
                    worst = max(worst, rel_error(got, r[rows], scale))
                    worst_plain = max(worst_plain, rel_error(p[rows], r[rows], scale))
        print(
            f"{name} {sizes}: row-blocked {worst:.2e}, plain {worst_plain:.2e} ({worst / worst_plain:.1f}x)"
        )
        ratios[name] = worst / worst_plain
    assert max(ratios.values()) <= NOISE_FACTOR, ratios


# -- usable from GradCache (one process and cross-rank under DDP) and GradCacheTrainer ----------------------


def _towers(dtype: torch.dtype = torch.float32) -> list[torch.nn.Module]:
    torch.manual_seed(3)
    towers = [
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 6)) for _ in "it"
    ]
    return [t.to(dtype) for t in towers]


def _tower_inputs(batch: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(batch, 8, generator=gen).to(dtype) for _ in "it"]


def _plain_step(kind: str, towers, xs, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The unchunked reference: both towers on the whole batch, the textbook loss, one backward."""
    loss = (CLIPLoss() if kind == "clip" else SigLIPLoss()).to(dtype)
    reps = [t(x) for t, x in zip(towers, xs)]
    if kind == "clip":
        value = ref_clip(*reps, loss.logit_scale)
    else:
        value = ref_siglip(*reps, loss.logit_scale, loss.logit_bias)
    value.backward()
    return _named_grads(towers, loss) | {"loss": value.detach()}


def _named_grads(towers, loss) -> dict[str, torch.Tensor]:
    grads = {f"{k}.{n}": p.grad.clone() for k, t in enumerate(towers) for n, p in t.named_parameters()}
    grads |= {n: p.grad.clone() for n, p in loss.named_parameters()}
    for module in (*towers, loss):
        module.zero_grad(set_to_none=True)
    return grads


def _gradcache_step(kind: str, towers, xs, **kw) -> dict[str, torch.Tensor]:
    from hfpatch.training import GradCache

    loss = CLIPLoss(block_size=3) if kind == "clip" else SigLIPLoss(block_size=3)
    value = GradCache(towers, loss, 2, **kw).step(*xs)  # chunks of 2: the last one ragged for odd batches
    return _named_grads([getattr(t, "module", t) for t in towers], loss) | {"loss": value}


def _step_noise(kind: str, batch: int) -> tuple[dict[str, torch.Tensor], float]:
    ref = _plain_step(kind, _towers(), _tower_inputs(batch))
    exact = _plain_step(kind, _towers(torch.float64), _tower_inputs(batch, torch.float64), torch.float64)
    return ref, max(rel_error(ref[n], exact[n]) for n in ref)


def _max_error(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys(), got.keys() ^ ref.keys()
    return max(rel_error(got[n], ref[n]) for n in ref)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_gradcache_with_row_blocked_loss_matches_plain_step(kind):
    ref, noise = _step_noise(kind, 7)
    error = _max_error(_gradcache_step(kind, _towers(), _tower_inputs(7)), ref)
    print(
        f"{kind}: GradCache + row-blocked loss vs plain step: {error:.2e} (tol {reassociation_tol(noise):.2e})"
    )
    assert error <= reassociation_tol(noise)


def _ddp_gradcache_case(sizes: list[int], kinds: list[str]) -> list[dict]:
    """Rank r trains on rows [sum(sizes[:r]), ...) through DDP towers and a row-blocked loss with cross-rank
    negatives (the loss's own temperature outside DDP: its gradient must be the global one on every rank)."""
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out = []
    for kind in kinds:
        towers = [DistributedDataParallel(t) for t in _towers()]
        xs = [x[rows] for x in _tower_inputs(sum(sizes))]
        out.append(_gradcache_step(kind, towers, xs, cross_rank=True))
    return out


@pytest.mark.parametrize("sizes", [[3, 4], [4, 1, 3]], ids=["world2", "world3"])
def test_gradcache_cross_rank_ddp_with_row_blocked_loss_matches_one_process(rank_pool, sizes):
    kinds = ["clip", "siglip"]
    per_rank = rank_pool(len(sizes)).run(_ddp_gradcache_case, sizes, kinds)
    for k, kind in enumerate(kinds):
        ref, noise = _step_noise(kind, sum(sizes))
        tol = reassociation_tol(noise) + 2 * eps()  # + DDP's average over the ranks (a sum and a division)
        for rank, results in enumerate(per_rank):
            error = _max_error(results[k], ref)
            print(f"{kind} rank {rank}/{len(sizes)}: {error:.2e} (tol {tol:.2e})")
            assert error <= tol


def test_gradcache_trainer_with_row_blocked_loss_matches_plain_step(tmp_path):
    from transformers import TrainingArguments

    from hfpatch.testing import tiny_bert
    from hfpatch.training import GradCacheTrainer
    from hfpatch.training.pooling import default_rep

    gen = torch.Generator().manual_seed(5)
    batch = {k: {"input_ids": torch.randint(1, 64, (7, 6), generator=gen)} for k in ("query", "positive")}
    loss = InfoNCELoss(
        directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction", block_size=3
    )

    def reference(model):
        reps = [default_rep(model(**batch[k]), batch[k]) for k in ("query", "positive")]
        ref_infonce(
            *reps, scale=20.0, directions=loss.directions, partition_mode=loss.partition_mode
        ).backward()
        return _named_grads([model], torch.nn.Module())

    ref = reference(tiny_bert())
    exact = reference(tiny_bert().double())
    scale = max(g.abs().max().item() for g in ref.values())  # BERT: some parameters' gradients are ~0
    noise = max(rel_error(ref[n], exact[n], scale) for n in ref)
    args = TrainingArguments(str(tmp_path), remove_unused_columns=False, report_to="none", use_cpu=True)
    trainer = GradCacheTrainer(model=tiny_bert(), args=args, loss_fn=loss, chunk_size=2)
    trainer.training_step(trainer.model, batch)
    got = _named_grads([trainer.model], torch.nn.Module())
    assert got.keys() == ref.keys()
    error = max(rel_error(got[n], ref[n], scale) for n in ref)
    print(f"GradCacheTrainer + InfoNCELoss: {error:.2e} (tol {reassociation_tol(noise):.2e})")
    assert error <= reassociation_tol(noise)
