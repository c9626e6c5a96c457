"""GradCache on a sequence-parallel Qwen3-VL: every chunk runs split over the ranks, the step equals the
unpatched full-batch step.

The two compose because each is exact on its own axis: GradCache cuts the batch into chunks of whole
samples (validated against their image/video grids) and replays each chunk with the cached embedding
gradient; sequence parallelism cuts each chunk's token sequence over the ranks and returns the full hidden
states, whose pooled embedding is what GradCache caches. Every rank runs the same chunks (the same-input
guard checks each one), the gather scales the gradient by the group size, and the mean over the group
(``all_reduce_gradients``, or DDP) is the full-batch gradient. Reference: the unpatched full-batch step;
tolerance ``reassociation_tol`` of that step's fp32-vs-fp64 noise, as in ``test_gradcache.py``.
"""

from __future__ import annotations

import torch
from gradcache_helpers import fp64_loss, grad_noise

import hfpatch
from hfpatch import ParallelConfig, all_reduce_gradients
from hfpatch.testing import qwen3_vl_inputs, tiny_qwen3_vl
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64
from hfpatch.training import GradCache
from hfpatch.training.pooling import default_rep
from hfpatch.training.trainer import info_nce

MEDIA = [
    [("image", (1, 4, 4))],
    [("image", (1, 2, 4)), ("image", (1, 2, 2))],
    [],
    [("video", (2, 2, 2))],
]


def _inputs() -> tuple[dict, dict]:
    return qwen3_vl_inputs([[]] * len(MEDIA), text_len=7, seed=2, padding="right"), qwen3_vl_inputs(
        MEDIA, text_len=5, seed=1
    )


def _full_batch(model: torch.nn.Module, inputs, loss_fn=info_nce) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(*[default_rep(model(**x), x) for x in inputs])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def gradcache_cases(
    configs: list[tuple[int, int]],
) -> dict[tuple[int, int], tuple[float, float, float, float]]:
    """Per (ulysses, ring): (loss error, loss tolerance, gradient error, gradient tolerance)."""
    model = tiny_qwen3_vl()
    ref_loss, ref = _full_batch(model, _inputs())
    exact_loss, exact = _full_batch(to_fp64(model), to_fp64(_inputs()), fp64_loss(info_nce))
    loss_tol = reassociation_tol(rounding_noise(ref_loss, exact_loss))
    grad_tol = reassociation_tol(grad_noise(ref, exact))
    scale = max(g.abs().max().item() for g in ref.values())
    results = {}
    for ulysses, ring in configs:
        model.zero_grad(set_to_none=True)
        with hfpatch.apply(model, parallel=ParallelConfig(ulysses=ulysses, ring=ring)):
            loss = GradCache(model, info_nce, 2).step(*_inputs())
            all_reduce_gradients(model)
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == ref.keys()
        diff = max((got[n] - ref[n]).abs().max().item() for n in ref)
        results[(ulysses, ring)] = (rel_error(loss, ref_loss), loss_tol, diff / scale, grad_tol)
    return results


def test_gradcache_chunks_run_sequence_parallel_and_match_the_full_batch(rank_pool):
    for rank, result in enumerate(rank_pool(2).run(gradcache_cases, [(2, 1), (1, 2)])):
        for config, (loss_error, loss_tol, grad_error, grad_tol) in result.items():
            assert loss_error <= loss_tol, (rank, config, loss_error, loss_tol)
            assert grad_error <= grad_tol, (rank, config, grad_error, grad_tol)
