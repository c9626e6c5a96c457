"""Sequence-parallel attention under a mask (causal, padded keys, packed samples): Ulysses x Ring over tiles.

A decoder LLM attends under a mask: causal, plus padded keys (left or right padding), plus packed samples
that must not see each other, plus whatever else its mask builder composes. When the sequence is cut into
shards, the mask has to be read with GLOBAL positions: the rank holding tokens 4096-8191 must still let
token 5000 see token 12 and not token 6000. This module takes the mask as a :class:`TileMask`, an object that
answers, for any rectangle of global query and key positions, "every pair attends" (``True``), "no pair
does" (``False``) or which pairs do (a bool tensor); it never needs the ``S x S`` mask at once.

1. Ulysses (:mod:`hfpatch.attention.ulysses`): an all-to-all turns this rank's sequence shard (all heads)
   into the Ulysses group's contiguous block (a subset of heads). Grouped-query attention: the key/value
   heads are repeated only as far as the split needs (:func:`kv_repeats`), so every rank's query heads
   find their key/value heads locally.
2. Ring (:mod:`hfpatch.attention.ring`'s scheme): key/value blocks travel rank to rank; each rank attends
   its query block to each key block, cut into ``tile x tile`` tiles. A tile the mask rules out entirely
   is skipped (causal attention skips the blocks above the diagonal, about half the work), a tile fully
   allowed runs the registered kernel (:mod:`hfpatch.attention.local`), a partial tile runs a masked
   kernel (CPU: the fused flash kernel with an additive mask; elsewhere: explicit matmuls, bounded by the
   tile). Tiles are merged by their log-sum-exp (:mod:`hfpatch.attention.merge`), so the result equals
   attention over the whole sequence up to float reassociation.
3. The inverse all-to-all.

Rows whose every key is masked (a left-padded sequence's padding) return zeros, as PyTorch's SDPA does,
and get no gradient. Positions ``>= valid_len`` are the end padding of the layout
(:mod:`hfpatch.attention.layout`): they are neither computed as queries (their output is zero) nor seen as
keys.

The backward is a custom :class:`torch.autograd.Function` that recomputes tile by tile from the saved
output and log-sum-exp (nothing ``O(S^2)`` is saved); key/value gradients travel round the ring with their
blocks, as in :func:`hfpatch.attention.ring.ring_attention`. Gradients follow the sum-of-losses convention
of :func:`hfpatch.attention.usp.usp_attention` (patched models scale them, see
:mod:`hfpatch.distributed.gradients`).

Bytes sent per rank (``u`` Ulysses, ``r`` Ring, a rank's shard of ``L`` tokens, ``H``/``H_kv`` heads of
``D`` after :func:`kv_repeats`): forward ``(u - 1) / u * L * (2 H + 2 H_kv) * D`` elements for the
all-to-alls and ``(r - 1) * u * L * 2 H_kv / u * D`` for the ring; backward the same all-to-alls, the ring's
``(r - 1)`` key/value blocks plus ``r`` gradient blocks.

>>> import torch
>>> q, k, v = torch.randn(1, 7, 4, 8), torch.randn(1, 7, 2, 8), torch.randn(1, 7, 2, 8)   # GQA: 4 / 2 heads
>>> out = masked_usp_attention(q, k, v, mask=CausalMask(), ulysses_group=None, ring_group=None, tile=3)
>>> ref = torch.nn.functional.scaled_dot_product_attention(
...     q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
>>> bool(torch.allclose(out, ref.transpose(1, 2), atol=1e-6))
True
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ..distributed.collectives import ring_shift
from .layout import group_rank, group_size, valid_prefix
from .local import accum_dtype, local_attention, local_attention_backward, math_backward
from .merge import merge_attention
from .ulysses import heads_to_sequence, sequence_to_heads

__all__ = [
    "CausalMask",
    "DenseMask",
    "TileMask",
    "classify_tile",
    "kv_repeats",
    "masked_usp_attention",
    "ring_work",
]

Tensor = torch.Tensor
#: Default tile edge (tokens): bounds a partial tile's mask and, off CPU, its explicit score matrix.
DEFAULT_TILE = 1024
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------- masks
class TileMask(Protocol):
    """The mask of one attention call, read one rectangle of GLOBAL positions at a time.

    ``tile(q_start, q_len, k_start, k_len)`` returns ``True`` (every query of
    ``[q_start, q_start + q_len)`` attends to every key of ``[k_start, k_start + k_len)``), ``False``
    (none does) or a bool tensor ``[B or 1, 1, q_len, k_len]`` (``True``: attends). Positions are those of
    the unpadded sequence; the caller never asks about positions ``>= valid_len``.
    """

    def tile(self, q_start: int, q_len: int, k_start: int, k_len: int) -> bool | Tensor: ...


def classify_tile(mask: Tensor) -> bool | Tensor:
    """``False`` if no entry of the bool ``mask`` is set, ``True`` if all are, else ``mask`` itself.

    >>> classify_tile(torch.zeros(1, 1, 2, 2, dtype=torch.bool)), classify_tile(torch.ones(1, 1, 2, 2) > 0)
    (False, True)
    """
    if not bool(mask.any()):
        return False
    if bool(mask.all()):
        return True
    return mask


@dataclass(frozen=True)
class CausalMask:
    """Plain causal attention (query ``i`` sees keys ``<= i``): tiles are classified without evaluating a mask.

    >>> m = CausalMask()
    >>> m.tile(0, 4, 4, 4), m.tile(4, 4, 0, 4), m.tile(2, 2, 2, 2).int().tolist()
    (False, True, [[[[1, 0], [1, 1]]]])
    """

    device: torch.device | str | None = None

    def tile(self, q_start: int, q_len: int, k_start: int, k_len: int) -> bool | Tensor:
        if k_start > q_start + q_len - 1:
            return False
        if k_start + k_len - 1 <= q_start:
            return True
        q = torch.arange(q_start, q_start + q_len, device=self.device)
        k = torch.arange(k_start, k_start + k_len, device=self.device)
        return (k[None, :] <= q[:, None])[None, None]


@dataclass(frozen=True)
class DenseMask:
    """A materialised bool mask ``[B or 1, 1, S, S]`` (``True``: attends), read tile by tile (tests, small S)."""

    mask: Tensor

    def tile(self, q_start: int, q_len: int, k_start: int, k_len: int) -> bool | Tensor:
        return classify_tile(self.mask[..., q_start : q_start + q_len, k_start : k_start + k_len])


# ----------------------------------------------------------------------------------------------- heads
def kv_repeats(heads: int, kv_heads: int, ulysses: int) -> int:
    """How many times to repeat each key/value head before a Ulysses split of ``heads`` query heads.

    Grouped-query attention maps query head ``h`` to key/value head ``h // (heads // kv_heads)``. When
    ``ulysses`` divides ``heads``, each rank takes ``heads / ulysses`` consecutive query heads, and the key/
    value heads are repeated by the smallest factor ``f`` (a divisor of the group size) that makes
    ``kv_heads * f`` divisible by ``ulysses``: each rank then holds exactly the key/value heads of its query
    heads (no repeat at all when ``ulysses`` divides ``kv_heads``). Otherwise (uneven query heads) every
    query head gets its own copy (``f = heads // kv_heads``) and all three are split alike.

    >>> kv_repeats(8, 2, 2), kv_repeats(8, 2, 4), kv_repeats(8, 2, 8), kv_repeats(4, 2, 3), kv_repeats(4, 4, 4)
    (1, 2, 4, 2, 1)
    """
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    group = heads // kv_heads
    if ulysses == 1:
        return 1
    if heads % ulysses:
        return group
    return min(f for f in range(1, group + 1) if group % f == 0 and (kv_heads * f) % ulysses == 0)


# ----------------------------------------------------------------------------------------------- kernels
def _h(x: Tensor) -> Tensor:
    """The kernels' ``[B, H, S, D]`` view of a ``[B, S, H, D]`` tensor (no copy)."""
    return x.transpose(1, 2)


def _cpu_flash(q: Tensor, backend: str) -> bool:
    return q.device.type == "cpu" and backend in ("auto", "flash_cpu") and q.dtype in _CPU_FLASH_DTYPES


def _bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive mask: 0 where ``mask`` attends, ``-inf`` elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _tile_forward(q: Tensor, k: Tensor, v: Tensor, mask: bool | Tensor, scale: float, backend: str):
    """``(out_bhsd, lse_bhs)`` of one tile; rows with no allowed key get ``out = 0``, ``lse = -inf``."""
    if mask is True:
        return local_attention(q, k, v, scale, backend)
    acc = accum_dtype(q.dtype)
    if _cpu_flash(q, backend):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=_bias(mask, q.dtype), scale=scale
        )
        lse = lse.to(acc)
    else:
        scores = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), k.to(acc)).mul_(scale)
        scores.masked_fill_(~mask, float("-inf"))
        lse = scores.logsumexp(-1)
        probs = scores.sub_(lse.masked_fill(lse.isinf(), 0.0).unsqueeze(-1)).exp_()
        out = torch.einsum("bhqk,bhkd->bhqd", probs, v.to(acc)).to(q.dtype)
    rows = mask.any(-1)  # [B or 1, 1, q]
    if not bool(rows.all()):
        lse = lse.masked_fill(~rows, float("-inf"))
        out = out.masked_fill(~rows.unsqueeze(-1), 0.0)
    return out, lse


def _tile_backward(dout, q, k, v, out, lse, mask: bool | Tensor, scale: float, backend: str):
    """``(dq, dk, dv)`` of one tile given the merged ``out``/``lse`` (``+inf`` on rows with no key at all)."""
    if mask is True:
        return local_attention_backward(dout, q, k, v, out, lse, scale, backend)
    acc = accum_dtype(q.dtype)
    if _cpu_flash(q, backend):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(acc), 0.0, False, attn_mask=_bias(mask, q.dtype), scale=scale
        )
    return math_backward(dout, q, k, v, out, lse, scale, mask)


def _tiles(length: int, tile: int, segment: int | None = None) -> Iterator[tuple[int, int]]:
    """``(start, length)`` tiles of ``[0, length)``: at most ``tile`` tokens, never crossing a multiple of
    ``segment`` (a block starts at one: a mask's chunk edge, see :class:`hfpatch.attention.zigzag.ZigzagMask`)."""
    start = 0
    while start < length:
        end = min(start + tile, length)
        if segment:
            end = min(end, (start // segment + 1) * segment)
        yield start, end - start
        start = end


def _step_tiles(
    mask: TileMask, q_start: int, rows: int, k_start: int, keys: int, tile: int
) -> Iterator[tuple[int, int, list[tuple[int, int, bool | Tensor]]]]:
    """One Ring step's work: ``(k_at, k_len, [(q_at, q_len, tile mask), ...])`` per key tile, the tiles the
    mask rules out entirely left out (the forward, the backward and :func:`ring_work` read this one plan)."""
    segment = getattr(mask, "segment", None)
    q_tiles = list(_tiles(rows, tile, segment))
    for k_at, k_len in _tiles(keys, tile, segment):
        work = []
        for q_at, q_len in q_tiles:
            tile_mask = mask.tile(q_start + q_at, q_len, k_start + k_at, k_len)
            if tile_mask is not False:
                work.append((q_at, q_len, tile_mask))
        if work:
            yield k_at, k_len, work


def ring_work(
    mask: TileMask, world: int, block: int, valid_len: int | None = None, tile: int = DEFAULT_TILE
) -> list[int]:
    """Query-key pairs each ring rank's kernels compute under ``mask`` (a partial tile counts whole), from the
    plan the kernels run: the balance of causal Ring attention, counted without running it.

    ``block`` is the ring block (after the Ulysses all-to-all: ``ulysses x`` a rank's shard).

    >>> from hfpatch.attention.zigzag import ZigzagLayout, ZigzagMask
    >>> ring_work(CausalMask(), 4, 1024, tile=256)                 # contiguous: rank 3 does 4x rank 0's work
    [655360, 1703936, 2752512, 3801088]
    >>> ring_work(ZigzagMask(CausalMask(), ZigzagLayout(4096, 4)), 4, 1024, tile=256)
    [2228224, 2228224, 2228224, 2228224]
    """
    counts = []
    for me in range(world):
        rows = valid_prefix(me * block, block, valid_len)
        total = 0
        for step in range(world):
            source = (me - step) % world
            keys = valid_prefix(source * block, block, valid_len)
            for _, k_len, work in _step_tiles(mask, me * block, rows, source * block, keys, tile):
                total += k_len * sum(q_len for _, q_len, _ in work)
        counts.append(total)
    return counts


def _expand(x_bhsd: Tensor, group: int) -> Tensor:
    """Key/value heads repeated for their ``group`` query heads each (grouped-query attention)."""
    return x_bhsd if group == 1 else x_bhsd.repeat_interleave(group, dim=1)


def _fold(dx_bhsd: Tensor, group: int) -> Tensor:
    """The adjoint of :func:`_expand`: sum the gradients of each key/value head's copies."""
    if group == 1:
        return dx_bhsd
    b, h, s, d = dx_bhsd.shape
    return dx_bhsd.view(b, h // group, group, s, d).sum(2)


# ----------------------------------------------------------------------------------------------- ring
class _MaskedRing(torch.autograd.Function):
    """Ring attention over tiles under a :class:`TileMask`; ``[B, L, H, D]`` q, ``[B, L, H_kv, D]`` k/v."""

    @staticmethod
    def forward(ctx, q, k, v, mask, group, valid_len, scale, tile, backend):
        world, me, block = group_size(group), group_rank(group), q.shape[1]
        heads_per_kv = q.shape[2] // k.shape[2]
        acc = accum_dtype(q.dtype)
        q_start = me * block
        rows = valid_prefix(q_start, block, valid_len)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)  # [B, L, H, D] memory, merged through views
        lse = torch.full(_h(q).shape[:3], float("-inf"), dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        for step in range(world):
            source = (me - step) % world
            if step < world - 1:  # pass the block on while computing with it
                (k_next, v_next), wait = ring_shift([k_cur, v_cur], group)
            keys = valid_prefix(source * block, block, valid_len)
            for k_at, k_len, work in _step_tiles(mask, q_start, rows, source * block, keys, tile):
                k_tile = _expand(_h(k_cur[:, k_at : k_at + k_len]), heads_per_kv)
                v_tile = _expand(_h(v_cur[:, k_at : k_at + k_len]), heads_per_kv)
                for q_at, q_len, tile_mask in work:
                    part = _tile_forward(
                        _h(q[:, q_at : q_at + q_len]), k_tile, v_tile, tile_mask, scale, backend
                    )
                    span = slice(q_at, q_at + q_len)
                    _, merged = merge_attention(_h(out)[:, :, span], lse[:, :, span], *part)
                    lse[:, :, span] = merged
            if step < world - 1:
                wait()
                k_cur, v_cur = k_next, v_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (mask, group, valid_len, scale, tile, backend)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mask, group, valid_len, scale, tile, backend = ctx.args
        world, me, block = group_size(group), group_rank(group), q.shape[1]
        heads_per_kv = q.shape[2] // k.shape[2]
        acc = accum_dtype(q.dtype)
        q_start = me * block
        rows = valid_prefix(q_start, block, valid_len)
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows with no key: probabilities 0
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        dkv_cur = None  # (dk, dv) accumulators of the block held now; they travel with it
        wait_dkv = in_flight = None
        for step in range(world):
            source = (me - step) % world
            if step < world - 1:
                (k_next, v_next), wait_kv = ring_shift([k_cur, v_cur], group)
            grads = None
            keys = valid_prefix(source * block, block, valid_len)
            for k_at, k_len, work in _step_tiles(mask, q_start, rows, source * block, keys, tile):
                k_tile = _expand(_h(k_cur[:, k_at : k_at + k_len]), heads_per_kv)
                v_tile = _expand(_h(v_cur[:, k_at : k_at + k_len]), heads_per_kv)
                dk_tile = torch.zeros(k_tile.shape, dtype=acc, device=k.device)
                dv_tile = torch.zeros(v_tile.shape, dtype=acc, device=k.device)
                for q_at, q_len, tile_mask in work:
                    span = slice(q_at, q_at + q_len)
                    dq_t, dk_t, dv_t = _tile_backward(
                        _h(dout[:, span]), _h(q[:, span]), k_tile, v_tile, _h(out[:, span]), lse[:, :, span],
                        tile_mask, scale, backend,
                    )  # fmt: skip
                    _h(dq)[:, :, span].add_(dq_t)
                    dk_tile.add_(dk_t)
                    dv_tile.add_(dv_t)
                if grads is None:
                    grads = [torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(2)]
                _h(grads[0])[:, :, k_at : k_at + k_len].add_(_fold(dk_tile, heads_per_kv))
                _h(grads[1])[:, :, k_at : k_at + k_len].add_(_fold(dv_tile, heads_per_kv))
            if wait_dkv is not None:  # the accumulators of this block arrived while we computed
                wait_dkv()
                in_flight = None
            if dkv_cur is None:
                dkv_cur = [torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(2)]
            if grads is not None:
                dkv_cur[0].add_(grads[0])
                dkv_cur[1].add_(grads[1])
            if world > 1:  # pass the accumulators on; after r hops they are back at their owner
                in_flight = dkv_cur
                dkv_cur, wait_dkv = ring_shift(in_flight, group)
            if step < world - 1:
                wait_kv()
                k_cur, v_cur = k_next, v_next
        if wait_dkv is not None:
            wait_dkv()
            in_flight = None
        dk, dv = dkv_cur
        return (
            dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------- entry point
def _check(query: Tensor, key: Tensor, value: Tensor, valid_len: int, world: int, tile: int) -> None:
    """Shape checks; they depend only on local shapes, so every rank raises alike before any collective."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"masked_usp_attention: {name} must be a [B, S_local, H, D] tensor, got {got}")
    if key.shape != value.shape or key.shape[:2] != query.shape[:2] or key.shape[3] != query.shape[3]:
        raise ValueError(
            "masked_usp_attention: key and value must be [B, S_local, H_kv, D] with the query's B, S_local and D, "
            f"got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if query.shape[2] % key.shape[2]:
        raise ValueError(
            f"masked_usp_attention: {query.shape[2]} query heads are not a multiple of {key.shape[2]} key/value heads"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"masked_usp_attention: q/k/v dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}"
        )
    total = query.shape[1] * world
    if not (isinstance(valid_len, int) and 1 <= valid_len <= total and total - valid_len < world):
        raise ValueError(
            f"masked_usp_attention: valid_len must be the unpadded length of the sharded sequence, an int in "
            f"[{total - world + 1}, {total}] (S_local={query.shape[1]} x {world} ranks), got {valid_len!r}"
        )
    if not (isinstance(tile, int) and tile >= 1):
        raise ValueError(f"masked_usp_attention: tile must be a positive int, got {tile!r}")


def masked_usp_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: TileMask,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    valid_len: int | None = None,
    scale: float | None = None,
    tile: int = DEFAULT_TILE,
    backend: str = "auto",
) -> Tensor:
    """Exact softmax attention under ``mask`` over a sequence sharded across ``ring x ulysses`` ranks.

    Equals ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)`` on the full unpadded
    sequence (rows with no allowed key: zeros) up to float reassociation, forward and backward.

    Args:
        query: ``[B, S_local, H, D]``, this rank's shard (index ``ring_index * ulysses + ulysses_index`` of
            the layout in :mod:`hfpatch.attention.layout`).
        key, value: ``[B, S_local, H_kv, D]`` with ``H_kv`` dividing ``H`` (grouped-query attention).
        mask: A :class:`TileMask` in global positions (:class:`CausalMask`, :class:`DenseMask`, or a model's).
        ulysses_group, ring_group: Process groups, ``None`` for degree 1.
        valid_len: Real tokens of the global sequence (default: ``S_local x ranks``, no padding).
        scale: Softmax scale (default ``D ** -0.5``).
        tile: Tile edge in tokens (a partial tile's mask is ``[B, 1, tile, tile]``).
        backend: Local kernel for fully allowed tiles (:mod:`hfpatch.attention.local`).

    Returns:
        ``[B, S_local, H, D]``, this rank's shard of the output; differentiable.

    Raises:
        ValueError: Inconsistent shapes, dtypes, heads or ``valid_len`` (before any collective).
    """
    ulysses, ring = group_size(ulysses_group), group_size(ring_group)
    valid_len = query.shape[1] * ulysses * ring if valid_len is None else valid_len
    _check(query, key, value, valid_len, ulysses * ring, tile)
    heads, kv_heads = query.shape[2], key.shape[2]
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    if ulysses > 1:
        repeats = kv_repeats(heads, kv_heads, ulysses)
        if repeats > 1:
            key, value = key.repeat_interleave(repeats, dim=2), value.repeat_interleave(repeats, dim=2)
        query = sequence_to_heads(query, ulysses_group, heads)
        key = sequence_to_heads(key, ulysses_group, key.shape[2])
        value = sequence_to_heads(value, ulysses_group, value.shape[2])
    if ring_group is not None:
        key, value = key.contiguous(), value.contiguous()
    out = _MaskedRing.apply(query, key, value, mask, ring_group, valid_len, scale, tile, backend)
    return heads_to_sequence(out, ulysses_group, heads)
