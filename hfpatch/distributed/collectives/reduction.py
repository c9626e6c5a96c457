"""The all-reduce: the sum or the mean of a tensor over the ranks of a group, a new tensor, outside autograd (the
mean is the backward of :func:`hfpatch.distributed.gradients.grad_averaged_over_group`; compiled graphs call it
as the custom op ``hfpatch::all_reduce_mean``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import runtime
from .counting import record_sent
from .groups import ProcessGroup, group_name, resolve_group, size_of

__all__ = ["all_reduce_mean", "all_reduce_sum"]


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group``, a new tensor (counted as ``"all_reduce"``). Not
    differentiable; for a few scalars computed outside autograd (a loss value, a temperature's gradient)."""
    out = x.contiguous().clone()
    world = size_of(group)
    try:
        dist.all_reduce(out, group=group)
    except RuntimeError as exc:
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error("all_reduce", group, exc) from exc
    # A ring all-reduce sends 2 (W - 1) / W of the tensor per rank.
    record_sent("all_reduce", 2 * (world - 1) * out.numel() * out.element_size() // world)
    return out


def all_reduce_mean(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The mean of ``x`` over the ranks of ``group``, a new tensor (one custom op in compiled code).

    Not differentiable (it is the backward of :func:`hfpatch.distributed.gradients.grad_averaged_over_group`).
    """
    if torch.compiler.is_compiling():
        return _all_reduce_mean_op(x, group_name(group))
    return _all_reduce_mean(x, group)


@torch.library.custom_op("hfpatch::all_reduce_mean", mutates_args=())
def _all_reduce_mean_op(x: torch.Tensor, group: str) -> torch.Tensor:
    return _all_reduce_mean(x, resolve_group(group))


@_all_reduce_mean_op.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_mean(x: torch.Tensor, pg: ProcessGroup | None) -> torch.Tensor:
    return all_reduce_sum(x, pg).div_(size_of(pg))
