"""Per-rank activation memory and bytes sent of the USP-patched stock ``WanTransformer3DModel`` (gloo, fp32).

A small version of ``benchmarks/usp_transformer.py``: the stock Wan 2.1 transformer with 8 heads of 16
channels (hidden ``C = 128``), ``ffn_dim = 4 C`` and 2 layers on a ``[1, 4, 4, 16, 16]`` latent (256
tokens, so activations dwarf the replicated timestep and text tensors), inference under ``no_grad``. Every
rank measures the unpatched peak (``track_memory``; weights and inputs excluded) and the patched one.

Memory bound. In units of one full ``[B, S, C]`` fp32 tensor the unpatched peak is ``12.25``: the
patch-embedding output (1) and the rotary tables ``(cos, sin)`` (``2 D / C = 0.25``) are alive while a
block's working set (11: norms, q/k/v, attention output, the ``4 C`` MLP hidden and its GELU) peaks. The
patch cuts the sequence at the patch-embedding output and the rope output and keeps *copies* of the shards,
so the full tensors are freed at once and every unit is divided by ``N``: the per-rank peak is ``1/N`` of the
unpatched one. Measured by ``benchmarks/usp_transformer.py`` (4096 tokens): 0.500 at N = 2, 0.250-0.256 at
N = 4. ``SLACK`` = 0.02 covers what weighs more at 256 tokens and is not divided: the replicated timestep
projection, text embeddings and their cross-attention keys/values, Ring's K/V block in flight and merge
accumulator (USP 2x2 has the most). A full-size tensor kept alive (1 / 12.25 = 0.08, e.g. a shard that is a
view of the full embedding, or gathering before the output projection) fails.

Communication: bytes sent equal the analytic minimum exactly (no tolerance; both are integer counts of
fp32 elements): per self-attention call Ulysses sends ``4 (u - 1) / u`` of the local ``[B, S/N, H, D]``
tensor (q, k, v and the output resharded), Ring ``2 (r - 1)`` local tensors (K and V passed ``r - 1``
times), times the number of layers; the output gather sends ``N - 1`` local output shards;
cross-attention to the replicated text sends nothing; the same-input check sends one fixed-size table.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.distributed.agreement import bytes_per_check
from hfpatch.distributed.collectives import count_comm
from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.memory import track_memory
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

HEADS, HEAD_DIM, LAYERS, FFN_MULT = 8, 16, 2, 4
HIDDEN = HEADS * HEAD_DIM
LATENT = (1, 4, 4, 16, 16)  # patch (1, 2, 2) -> 4 * 8 * 8 = 256 tokens
PATCH_VOLUME, OUT_CHANNELS = 4, 4
TOKENS = 256
SLACK = 0.02  # see the module docstring
CONFIGS = {2: [(1, 2), (2, 1)], 4: [(1, 4), (4, 1), (2, 2)]}  # (ring, ulysses)


def _build() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = tiny_wan_transformer(
        num_heads=HEADS, head_dim=HEAD_DIM, num_layers=LAYERS, ffn_dim=FFN_MULT * HIDDEN
    )
    kwargs = dict(
        hidden_states=torch.randn(*LATENT, generator=torch.Generator().manual_seed(1)),
        timestep=torch.tensor([500]),
        encoder_hidden_states=wan_prompt_embeds(1, 16),
    )
    return model, kwargs


def _analytic(ring: int, ulysses: int) -> dict[str, int]:
    world = ring * ulysses
    local = TOKENS // world  # divides: no padding
    qkv = local * HIDDEN * 4  # one local [1, S/N, H, D] fp32 tensor
    counts = {
        "guard": bytes_per_check(world),  # the same-input check: one fixed-size table per call
        "all_to_all": LAYERS * 4 * (ulysses - 1) * qkv // ulysses,
        "ring": LAYERS * 2 * (ring - 1) * qkv,
        "all_gather": (world - 1) * local * OUT_CHANNELS * PATCH_VOLUME * 4,
    }
    return {op: n for op, n in counts.items() if n}


def memory_cases(configs: list[tuple[int, int]]) -> dict[tuple[int, int], dict[str, Any]]:
    """Per ``(ring, ulysses)``: patched peak over the unpatched one, bytes sent by op, relative error."""
    model, kwargs = _build()
    with torch.no_grad(), track_memory() as mem:
        reference = model(**kwargs).sample
    unpatched = mem.peak_bytes
    with torch.no_grad():  # sharding only reassociates fp32 sums: bound it by the model's own fp32 noise
        noise = rounding_noise(reference, to_fp64(model)(**to_fp64(kwargs)).sample)
    results = {}
    for ring, ulysses in configs:
        with hfpatch.apply(model, parallel=ParallelConfig(ring=ring, ulysses=ulysses)):
            with torch.no_grad(), count_comm() as comm, track_memory() as mem:
                out = model(**kwargs).sample
        results[(ring, ulysses)] = {
            "ratio": mem.peak_bytes / unpatched,
            "sent": {op: n for op, n in comm.by_op.items() if n},
            "error": rel_error(out, reference),
            "tol": reassociation_tol(noise),
        }
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_usp_memory_wan_peak_per_rank_and_bytes_sent_match_bound_and_analytic(rank_pool, world):
    per_rank = rank_pool(world).run(memory_cases, CONFIGS[world])
    bound = 1 / world + SLACK
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), result in results.items():
            case = f"rank {rank}, ring {ring} x ulysses {ulysses}"
            assert result["error"] <= result["tol"], (case, result["error"], result["tol"])
            assert result["ratio"] <= bound, (case, result["ratio"], bound)
            assert result["sent"] == _analytic(ring, ulysses), (case, result["sent"])
