"""Ulysses resharding: sequence-sharded <-> head-sharded, with uneven head splits.

Before attention, an all-to-all over the Ulysses group turns ``[B, S_local, H, D]`` (this rank's sequence
shard, all heads) into ``[B, u * S_local, H_r, D]`` (the Ulysses group's contiguous sequence block, this
rank's ``H_r = head_sizes(H, u)[r]`` heads); after attention the inverse all-to-all restores the layout.
Head counts that do not divide ``u`` are split unevenly (``[2, 2, 1, 1]`` for 6 heads over 4 ranks): every
head is still computed by exactly one rank, so the result is exact; the cost is load imbalance.

Replicated joint tokens need no communication on the way in (each rank slices its heads); their output
heads are all-gathered at the end. Under the sum-of-losses gradient convention (see
:mod:`hfpatch.attention.usp`) the adjoint of that all-gather is a reduce-scatter and the
adjoint of the slice is zero-padding, so no gradient is lost or double counted.

Bytes sent per rank and all-to-all: ``(u - 1) / u`` of the local tensor when ``u`` divides the heads (the
analytic minimum; with uneven heads the ranks' shares differ, the total is the same).

Both reshardings copy each element once (:mod:`hfpatch.attention.exchange`: pieces packed on one side, received
in place on the other); :func:`hfpatch.attention.exchange.start_sequence_to_heads` starts one and returns a handle,
so the caller computes while it travels. In compiled code they are the ``hfpatch::all_to_all`` custom op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.collectives import all_gather, all_to_all
from .exchange.geometry import head_geometry
from .exchange.overlap import start_sequence_to_heads
from .exchange.plans import out_plans
from .exchange.to_sequence import finish_out, start_out
from .layout import group_rank, group_size, head_sizes

__all__ = ["gather_joint_heads", "heads_to_sequence", "sequence_to_heads", "slice_joint_heads"]

Tensor = torch.Tensor


def sequence_to_heads(x_bshd: Tensor, group: dist.ProcessGroup | None, heads: int) -> Tensor:
    """``[B, S_local, H, D]`` -> ``[B, u * S_local, H_r, D]``, contiguous (identity when ``group`` is ``None``)."""
    if group is None:
        return x_bshd
    if group_size(group) == 1 or torch.compiler.is_compiling():
        sizes = head_sizes(heads, group_size(group))
        return all_to_all(x_bshd, scatter_dim=2, gather_dim=1, group=group, scatter_sizes=sizes)
    return start_sequence_to_heads(x_bshd, group, heads).wait()


def heads_to_sequence(x_bshd: Tensor, group: dist.ProcessGroup | None, heads: int) -> Tensor:
    """``[B, u * S_local, H_r, D]`` -> ``[B, S_local, H, D]``: the inverse of :func:`sequence_to_heads`."""
    if group is None:
        return x_bshd
    if group_size(group) == 1 or torch.compiler.is_compiling():
        sizes = head_sizes(heads, group_size(group))
        return all_to_all(x_bshd, scatter_dim=1, gather_dim=2, group=group, gather_sizes=sizes)
    geo = head_geometry(x_bshd, group, heads)
    plan = out_plans(geo, image_rows=x_bshd.shape[1], joined_sources=False)[0]
    return finish_out([plan], [start_out(plan, [x_bshd], None)], [x_bshd])


def slice_joint_heads(x_bshd: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """This rank's heads of a replicated ``[B, S_txt, H, D]`` tensor (a view; no communication)."""
    if group is None:
        return x_bshd
    sizes = head_sizes(x_bshd.shape[2], group_size(group))
    me = group_rank(group)
    return x_bshd.narrow(2, sum(sizes[:me]), sizes[me])


def gather_joint_heads(x_bshd: Tensor, group: dist.ProcessGroup | None, heads: int) -> Tensor:
    """All heads of the joint output, identical on every rank.

    Backward: reduce-scatter of the ranks' gradient shares (see the module docstring).
    """
    if group is None:
        return x_bshd
    sizes = head_sizes(heads, group_size(group))
    return all_gather(x_bshd, dim=2, group=group, sizes=sizes, backward="reduce_scatter")
