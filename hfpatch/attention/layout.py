"""The sequence-parallel sharding layout, shared by the attention functions, the model patches and the tests.

Layout (one rule everywhere):

1. The global sequence of ``seq_len`` tokens is padded at the END to a multiple of ``N = ring * ulysses``
   (:func:`padded_len`); padded keys are masked by global position (``position >= valid_len``), padded
   queries produce finite values that the caller drops (:func:`unshard_sequence`).
2. It is cut into ``N`` equal contiguous shards of :func:`shard_len` tokens; shard ``p`` covers global
   positions ``[p * shard_len, (p + 1) * shard_len)`` (:func:`shard_positions`).
3. Shard ``p`` belongs to the rank whose sp index is ``p = ring_index * ulysses + ulysses_index``
   (:func:`sp_index`; Ulysses innermost, the rank order of the ``"sp"`` mesh axis in
   :mod:`hfpatch.distributed.runtime`).

So after the Ulysses all-to-all (sequence gathered within the Ulysses group, heads scattered) a rank holds
the contiguous block ``ring_index`` of ``ulysses * shard_len`` tokens, which is what Ring attention passes
around. Heads are split over the Ulysses group by :func:`head_sizes` (larger parts first; uneven is fine).

>>> import torch

>>> x = torch.arange(10).view(1, 10)                       # 10 tokens over N = 4 ranks
>>> padded_len(10, 4), shard_len(10, 4)
(12, 3)
>>> [shard_sequence(x, 1, 4, p).tolist() for p in range(4)]
[[[0, 1, 2]], [[3, 4, 5]], [[6, 7, 8]], [[9, 0, 0]]]
>>> unshard_sequence([shard_sequence(x, 1, 4, p) for p in range(4)], 1, 10).tolist()
[[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed.collectives import even_sizes

__all__ = [
    "group_rank",
    "group_size",
    "head_sizes",
    "pad_sequence",
    "padded_len",
    "shard_len",
    "shard_positions",
    "shard_sequence",
    "sp_index",
    "unshard_sequence",
    "valid_prefix",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group``; ``None`` stands for a degree-1 axis (size 1), never for the world."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in ``group``; 0 for ``None`` (a degree-1 axis)."""
    return 0 if group is None else dist.get_rank(group)


def padded_len(seq_len: int, world: int) -> int:
    """``seq_len`` rounded up to a multiple of ``world`` (pad tokens go at the end).

    >>> padded_len(10, 4), padded_len(12, 4)
    (12, 12)
    """
    if seq_len < 1 or world < 1:
        raise ValueError(
            f"padded_len needs seq_len >= 1 and world >= 1, got seq_len={seq_len}, world={world}"
        )
    return -(-seq_len // world) * world


def shard_len(seq_len: int, world: int) -> int:
    """Tokens per shard: ``padded_len(seq_len, world) // world`` (every shard has the same length)."""
    return padded_len(seq_len, world) // world


def sp_index(ring_index: int, ulysses_index: int, ulysses: int) -> int:
    """The shard a rank owns: ``ring_index * ulysses + ulysses_index`` (Ulysses innermost).

    >>> [sp_index(r, u, 2) for r in range(2) for u in range(2)]
    [0, 1, 2, 3]
    """
    return ring_index * ulysses + ulysses_index


def shard_positions(seq_len: int, world: int, index: int) -> torch.Tensor:
    """Global token positions held by shard ``index`` (positions ``>= seq_len`` are padding).

    >>> shard_positions(10, 4, 3).tolist()
    [9, 10, 11]
    """
    length = shard_len(seq_len, world)
    return torch.arange(index * length, (index + 1) * length)


def valid_prefix(block_start: int, block_len: int, valid_len: int | None) -> int:
    """How many leading tokens of the block at ``[block_start, block_start + block_len)`` are real.

    Padding sits at the end of the global sequence, so the real tokens of any block are a prefix of it;
    masking padded keys is truncating the key block to this prefix (exact, and cheaper than a mask).

    >>> valid_prefix(6, 3, 10), valid_prefix(9, 3, 10), valid_prefix(12, 3, 10), valid_prefix(0, 3, None)
    (3, 1, 0, 3)
    """
    if valid_len is None:
        return block_len
    return max(0, min(block_len, valid_len - block_start))


def head_sizes(heads: int, ulysses: int) -> list[int]:
    """Heads each Ulysses rank computes: an even split, larger parts first (``[2, 2, 1, 1]`` for 6 over 4).

    Uneven splits are exact (each head is computed by exactly one rank); ranks with fewer heads idle for
    part of the attention. With ``heads < ulysses`` some ranks get no head at all (still exact, but wasteful:
    use a Ring degree instead).

    >>> head_sizes(6, 4), head_sizes(8, 2)
    ([2, 2, 1, 1], [4, 4])
    """
    return even_sizes(heads, ulysses)


def pad_sequence(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """``x`` zero-padded at the end of ``dim`` to ``padded_len(x.shape[dim], world)`` (no copy if it divides)."""
    dim %= x.dim()
    extra = padded_len(x.shape[dim], world) - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pad)


def shard_sequence(x: torch.Tensor, dim: int, world: int, index: int) -> torch.Tensor:
    """Shard ``index`` of the full sequence ``x`` along ``dim`` after end-padding (a differentiable view/slice)."""
    if not 0 <= index < world:
        raise ValueError(f"shard index must be in [0, {world}), got {index}")
    dim %= x.dim()
    length = shard_len(x.shape[dim], world)
    return pad_sequence(x, dim, world).narrow(dim, index * length, length)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int, seq_len: int) -> torch.Tensor:
    """Concatenate all shards in sp order along ``dim`` and drop the end padding (inverse of sharding)."""
    return torch.cat(list(shards), dim=dim).narrow(dim, 0, seq_len)
