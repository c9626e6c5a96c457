"""The geometry of one Ulysses exchange: which rows and which heads each rank of the group holds.

Before attention a rank holds ``[B, S_local, H, D]`` (its shard of the tokens, every head); after the
exchange ``[B, u * S_local, H_r, D]`` (the group's tokens, its own heads). Rank ``r`` of the ``u`` ranks
computes the heads ``starts[r] : starts[r] + sizes[r]`` (:func:`hfpatch.attention.layout.head_sizes`: an
even split, larger parts first); shard ``i`` of the group's tokens is rows ``i * local`` onwards, of which
the first ``real[i]`` are real tokens (padding sits at the global end:
:func:`hfpatch.attention.layout.valid_prefix`). Every plan of :mod:`hfpatch.attention.exchange.plans` is cut
out of one :class:`Geometry`.

>>> geo = Geometry.of(batch=1, local=3, dim=8, group=None, heads=6, valid_len=2, first_shard=0)
>>> geo.sizes, geo.starts, geo.real, geo.total
((6,), (0,), (2,), 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layout import group_rank, group_size, head_sizes, valid_prefix

Tensor = torch.Tensor


@dataclass(frozen=True)
class Geometry:
    """Who holds what in one Ulysses group: shapes, head split, real rows per shard."""

    group: dist.ProcessGroup
    world: int
    me: int
    heads: int
    sizes: tuple[int, ...]  # heads per rank
    starts: tuple[int, ...]  # first head of each rank
    local: int  # S_local: tokens per shard (padding included)
    real: tuple[int, ...]  # real (unpadded) tokens of each rank's shard
    batch: int
    dim: int

    @property
    def total(self) -> int:
        """Real tokens over the group (padding is at the end, so shard ``i``'s rows start at ``i * local``)."""
        return sum(self.real)

    @classmethod
    def of(
        cls, batch: int, local: int, dim: int, group, heads: int, valid_len: int | None, first_shard: int
    ) -> Geometry:
        """The geometry of ``batch`` samples of ``local`` tokens per shard over ``group`` (shards
        ``first_shard + i``; ``valid_len``: real tokens of the whole sequence, ``None`` for all)."""
        world, me = group_size(group), group_rank(group)
        sizes = head_sizes(heads, world)
        starts = [sum(sizes[:i]) for i in range(world)]
        real = [valid_prefix((first_shard + i) * local, local, valid_len) for i in range(world)]
        return cls(group, world, me, heads, tuple(sizes), tuple(starts), local, tuple(real), batch, dim)


def geometry(x: Tensor, group, heads: int, valid_len: int | None = None, first_shard: int = 0) -> Geometry:
    """The exchange geometry of ``x`` (``[B, S_local, H, D]``) over ``group`` (shards ``first_shard + i``)."""
    return Geometry.of(x.shape[0], x.shape[1], x.shape[3], group, heads, valid_len, first_shard)


def head_geometry(x: Tensor, group, heads: int, valid_len: int | None = None) -> Geometry:
    """The exchange geometry of a head-sharded ``x`` (``[B, u * S_local, H_r, D]``) over ``group``."""
    return Geometry.of(x.shape[0], x.shape[1] // group_size(group), x.shape[3], group, heads, valid_len, 0)


def width(heads: slice) -> int:
    """How many heads the slice ``heads`` covers."""
    return heads.stop - heads.start
