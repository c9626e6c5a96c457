"""``hfpatch.attention.masked``: sequence-parallel attention under a mask vs SDPA on the whole sequence.

fp64 throughout, so the only difference from ``F.scaled_dot_product_attention`` is summation order (tiles and
ring steps merged by their log-sum-exp): 1e-12 bounds it with a wide margin for these sizes, while a wrong
row, key or mask entry is off by O(1). Masks are causal, random (with rows that see no key at all, as a
left-padded sequence's padding does: SDPA returns zeros there), per sample (``B`` masks) and block-diagonal
(packed samples); heads are grouped (4 query / 2 key-value heads), and sequence lengths leave end padding
at every world size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfpatch.attention.layout import sp_index
from hfpatch.attention.masked import CausalMask, DenseMask, kv_repeats, masked_usp_attention
from hfpatch.patches.decoder import shard_tokens

TOL = 1e-12


def _inputs(batch: int, length: int, heads: int, kv_heads: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, length, kv_heads, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, length, kv_heads, 8, generator=gen, dtype=torch.float64)
    return q, k, v


def _mask(kind: str, batch: int, length: int, seed: int) -> torch.Tensor | None:
    """``[B or 1, 1, S, S]`` bool (``None``: causal)."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if kind == "causal":
        return None
    if kind == "random":  # causal and random, with rows that see nothing
        m = causal & (
            torch.rand(batch, 1, length, length, generator=torch.Generator().manual_seed(seed)) > 0.3
        )
        m[0, 0, 2] = False
        return m
    if kind == "left_padded":  # 3 padding keys at the start of sample 0
        m = causal.expand(batch, 1, length, length).clone()
        m[0, :, :, :3] = False
        return m
    if kind == "packed":  # samples of 5, 4 and the rest
        doc = torch.tensor([0] * 5 + [1] * 4 + [2] * (length - 9))
        return (causal & (doc[:, None] == doc[None, :]))[None, None]
    raise ValueError(kind)


def _reference(q, k, v, mask):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def _grads(out, weight, *inputs):
    return torch.autograd.grad((out * weight).sum(), inputs)


@pytest.mark.parametrize("backend", ["auto", "math"])
@pytest.mark.parametrize("kind", ["causal", "random", "left_padded", "packed"])
@pytest.mark.parametrize("tile", [3, 5, 64])
def test_masked_attention_one_rank_matches_sdpa_forward_and_backward(backend, kind, tile):
    q, k, v = (t.requires_grad_() for t in _inputs(2, 13, 4, 2, seed=0))
    mask = _mask(kind, 2, 13, seed=1)
    tiles = CausalMask() if mask is None else DenseMask(mask)
    out = masked_usp_attention(
        q, k, v, mask=tiles, ulysses_group=None, ring_group=None, tile=tile, backend=backend
    )
    ref = _reference(q, k, v, mask)
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
    assert (out - ref).abs().max() <= TOL
    for got, want in zip(_grads(out, weight, q, k, v), _grads(ref, weight, q, k, v)):
        assert (got - want).abs().max() <= TOL
    if kind == "random":  # the row with no key: zero output, no gradient through it
        assert out[0, 2].abs().max() == 0


def test_kv_repeats_keep_each_query_head_with_its_key_value_head():
    """Whatever the split, query head h must find key/value head h // group on its rank."""
    for heads, kv_heads in [(8, 2), (8, 8), (4, 2), (12, 4), (6, 3), (4, 1)]:
        for ulysses in range(1, heads + 1):
            f = kv_repeats(heads, kv_heads, ulysses)
            group, expanded = heads // kv_heads, kv_heads * f
            from hfpatch.attention.layout import head_sizes

            q_sizes, kv_sizes = head_sizes(heads, ulysses), head_sizes(expanded, ulysses)
            q_start = kv_start = 0
            for qn, kvn in zip(q_sizes, kv_sizes):
                for h in range(q_start, q_start + qn):
                    owner = h // (group // f)  # the expanded key/value head of query head h
                    assert kv_start <= owner < kv_start + kvn, (heads, kv_heads, ulysses, h)
                q_start, kv_start = q_start + qn, kv_start + kvn


# ----------------------------------------------------------------------------------------------- ranks
def masked_cases(cases: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], tuple[float, float]]:
    """Per ``(mask kind, ulysses, ring)``: max errors of this rank's output shard and of its input gradients."""
    from hfpatch import ParallelConfig
    from hfpatch.distributed.runtime import get_mesh

    world, results = dist.get_world_size(), {}
    length = 4 * world + 1  # never divisible by the world: the last shard is padded
    for kind, ulysses, ring in cases:
        mesh = get_mesh(ParallelConfig(ulysses=ulysses, ring=ring))
        index = sp_index(mesh.local_rank("ring"), mesh.local_rank("ulysses"), ulysses)
        q, k, v = (t.requires_grad_() for t in _inputs(2, length, 4, 2, seed=3))
        mask = _mask(kind, 2, length, seed=4)
        ref = _reference(q, k, v, mask)
        weight = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(5))
        ref_grads = _grads(ref, weight, q, k, v)
        local = [shard_tokens(t.detach(), 1, world, index).requires_grad_() for t in (q, k, v)]
        out = masked_usp_attention(
            *local,
            mask=CausalMask() if mask is None else DenseMask(mask),
            ulysses_group=mesh.group("ulysses"),
            ring_group=mesh.group("ring"),
            valid_len=length,
            tile=3,
        )
        valid = max(0, min(out.shape[1], length - index * out.shape[1]))
        expected = shard_tokens(ref.detach(), 1, world, index)
        out_error = (out - expected)[:, :valid].abs().max().item()
        grads = _grads(out, shard_tokens(weight, 1, world, index), *local)
        # Sum-of-losses convention: each rank's shard gets exactly its slice of the full gradient.
        grad_error = max(
            (g - shard_tokens(r, 1, world, index))[:, :valid].abs().max().item()
            for g, r in zip(grads, ref_grads)
        )
        results[(kind, ulysses, ring)] = (out_error, grad_error)
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_masked_attention_ulysses_ring_and_both_match_sdpa(rank_pool, world):
    configs = [(world, 1), (1, world)] + ([(2, 2)] if world == 4 else [])
    cases = [(kind, u, r) for kind in ("causal", "random", "left_padded", "packed") for u, r in configs]
    for rank, result in enumerate(rank_pool(world).run(masked_cases, cases)):
        for case, (out_error, grad_error) in result.items():
            assert out_error <= TOL and grad_error <= TOL, (rank, case, out_error, grad_error)
