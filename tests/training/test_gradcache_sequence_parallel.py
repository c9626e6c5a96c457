"""GradCache on a sequence-parallel decoder: every chunk runs split over the ranks, the step equals the
unpatched full-batch step. Qwen3-VL (images and a video, right-padded queries) and a Gemma 3 text embedding model
(``Gemma3TextModel``: sliding-window layers with a window shorter than one shard, left padding, last-token and
mean pooling; causal, and bidirectional as EmbeddingGemma runs it).

The two compose because each is exact on its own axis: GradCache cuts the batch into chunks of whole
samples (validated against their image/video grids) and replays each chunk with the cached embedding
gradient; sequence parallelism cuts each chunk's token sequence over the ranks and returns the full hidden
states, whose pooled embedding is what GradCache caches. Every rank runs the same chunks (the same-input
guard checks each one), the gather scales the gradient by the group size, and the mean over the group
(``all_reduce_gradients``, or DDP) is the full-batch gradient. Each model runs at world 2 as Ulysses (contiguous
shards) and as Ring (the zigzag order). Reference: the unpatched full-batch step; tolerance ``reassociation_tol``
of that step's fp32-vs-fp64 noise, as in ``test_gradcache.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gradcache_helpers import fp64_loss, grad_noise

import hfpatch
from hfpatch import ParallelConfig, all_reduce_gradients
from hfpatch.testing import qwen3_vl_inputs, tiny_qwen3_vl
from hfpatch.testing.decoders import tiny_decoder
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64
from hfpatch.training import GradCache
from hfpatch.training.pooling import default_rep
from hfpatch.training.trainer import info_nce

#: The worlds-2 plans every model runs: Ulysses (contiguous shards) and Ring (zigzag order, sp_order="auto").
CONFIGS = [(2, 1), (1, 2)]

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


#: Gemma 3's sliding window: under one shard at world 2 (the 9- and 13-token rows give 5 and 7 tokens per rank
#: contiguous, 6 and 8 zigzag), so a window crosses shard boundaries and no shard lies within one window.
GEMMA_WINDOW = 3


def _left_padded(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Token ids 1-99 (pad id 0) and the mask of rows of ``lengths`` tokens, left-padded to the longest."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(1, 100, (n,), generator=gen)
        mask[i, width - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _gemma_inputs() -> tuple[dict, dict]:
    """Queries and documents of 4 rows, every chunk of 2 with left padding (0-3 tokens queries, 1-6 documents)."""
    return _left_padded([9, 6, 8, 9], seed=2), _left_padded([13, 10, 7, 12], seed=1)


def _full_batch(
    model: torch.nn.Module, inputs, loss_fn=info_nce, pooling: str = "last"
) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(*[default_rep(model(**x), x, pooling) for x in inputs])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(
    model: torch.nn.Module, inputs: Callable[[], tuple], configs: list[tuple[int, int]], pooling: str = "last"
) -> dict[tuple[int, int], tuple[float, float, float, float]]:
    """Per (ulysses, ring): (loss error, loss tolerance, gradient error, gradient tolerance) of a sequence-parallel
    GradCache step (chunks of 2) against the unpatched full-batch step."""
    ref_loss, ref = _full_batch(model, inputs(), pooling=pooling)
    exact_loss, exact = _full_batch(to_fp64(model), to_fp64(inputs()), fp64_loss(info_nce), pooling)
    loss_tol = reassociation_tol(rounding_noise(ref_loss, exact_loss))
    grad_tol = reassociation_tol(grad_noise(ref, exact))
    scale = max(g.abs().max().item() for g in ref.values())
    results = {}
    for ulysses, ring in configs:
        model.zero_grad(set_to_none=True)
        with hfpatch.apply(model, parallel=ParallelConfig(ulysses=ulysses, ring=ring)):
            loss = GradCache(model, info_nce, 2, pooling=pooling).step(*inputs())
            all_reduce_gradients(model)
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == ref.keys()
        diff = max((got[n] - ref[n]).abs().max().item() for n in ref)
        results[(ulysses, ring)] = (rel_error(loss, ref_loss), loss_tol, diff / scale, grad_tol)
    return results


def gradcache_cases(
    configs: list[tuple[int, int]],
) -> dict[tuple[int, int], tuple[float, float, float, float]]:
    """Qwen3-VL, per (ulysses, ring): (loss error, loss tolerance, gradient error, gradient tolerance)."""
    return _compare(tiny_qwen3_vl(), _inputs, configs)


#: Gemma 3 text embedding models: (name, use_bidirectional_attention, pooling). EmbeddingGemma is a
#: Gemma3TextModel with bidirectional attention (its sliding layers see the window on both sides), mean-pooled.
GEMMA_EMBEDDERS = [("causal", False, "last"), ("causal", False, "mean"), ("bidirectional", True, "mean")]


def gemma_gradcache_cases(
    configs: list[tuple[int, int]],
) -> dict[tuple[str, str, int, int], tuple[float, float, float, float]]:
    """Gemma 3 embedders, per (attention, pooling, ulysses, ring): as :func:`gradcache_cases`."""
    results = {}
    for name, bidirectional, pooling in GEMMA_EMBEDDERS:
        model = tiny_decoder(
            "gemma3", sliding_window=GEMMA_WINDOW, use_bidirectional_attention=bidirectional
        ).model
        assert type(model).__name__ == "Gemma3TextModel"
        for config, result in _compare(model, _gemma_inputs, configs, pooling).items():
            results[(name, pooling, *config)] = result
    return results


def test_gradcache_chunks_run_sequence_parallel_and_match_the_full_batch(rank_pool):
    for rank, result in enumerate(rank_pool(2).run(gradcache_cases, CONFIGS)):
        for config, (loss_error, loss_tol, grad_error, grad_tol) in result.items():
            assert loss_error <= loss_tol, (rank, config, loss_error, loss_tol)
            assert grad_error <= grad_tol, (rank, config, grad_error, grad_tol)


def test_gradcache_on_a_sequence_parallel_gemma3_embedder_matches_the_full_batch(rank_pool):
    results = rank_pool(2).run(gemma_gradcache_cases, CONFIGS)
    for rank, result in enumerate(results):
        assert len(result) == len(GEMMA_EMBEDDERS) * len(CONFIGS), (rank, sorted(result))
        for case, (loss_error, loss_tol, grad_error, grad_tol) in result.items():
            assert loss_error <= loss_tol, (rank, case, loss_error, loss_tol)
            assert grad_error <= grad_tol, (rank, case, grad_error, grad_tol)
