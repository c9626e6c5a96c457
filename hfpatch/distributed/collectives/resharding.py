"""The all-to-all: reshard a tensor from one dimension split over the ranks to another (Ulysses' exchange of
sequence and heads), with uneven split sizes. Its backward is the all-to-all with the two dims swapped; compiled
graphs call it as the custom op ``hfpatch::all_to_all``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .counting import record_sent
from .groups import ProcessGroup, check_sizes, group_name, rank_in, resolve_group, size_of
from .waits import all_to_all_single

__all__ = ["all_to_all"]


def _all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group,
    scatter_sizes: list[int],
    gather_sizes: list[int],
) -> torch.Tensor:
    world, me = size_of(group), rank_in(group)
    # No list of pieces outlives the send buffer, and the send buffer is freed before the output is
    # assembled: at most two copies of x are alive at once (Ulysses reshards q, k, v and out this way).
    send = torch.cat([p.reshape(-1) for p in x.split(scatter_sizes, dim=scatter_dim)])
    row = x.numel() // max(x.shape[scatter_dim], 1)  # elements per index along scatter_dim
    send_numel = [s * row for s in scatter_sizes]
    # What rank i sends me: my scatter piece, with rank i's extent along the gather dim.
    recv_shapes = []
    for i in range(world):
        shape = list(x.shape)
        shape[scatter_dim] = scatter_sizes[me]
        shape[gather_dim] = gather_sizes[i]
        recv_shapes.append(shape)
    recv_numel = [int(torch.Size(s).numel()) for s in recv_shapes]
    recv = x.new_empty(sum(recv_numel))
    all_to_all_single("all_to_all", recv, send, recv_numel, send_numel, group)
    record_sent("all_to_all", (send.numel() - send_numel[me]) * x.element_size())
    del send
    chunks = [c.view(s) for c, s in zip(recv.split(recv_numel), recv_shapes)]
    return torch.cat(chunks, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, scatter_sizes, gather_sizes):
        ctx.args = (scatter_dim, gather_dim, group, scatter_sizes, gather_sizes)
        return _all_to_all(x, scatter_dim, gather_dim, group, scatter_sizes, gather_sizes)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim, group, scatter_sizes, gather_sizes = ctx.args
        # The adjoint of an all-to-all is the all-to-all with the roles of the two dims swapped.
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, group, gather_sizes, scatter_sizes), *(
            [None] * 5
        )


# The same collective as one custom op, for compiled graphs (module docstring). Eager code keeps the autograd
# function above: a TorchDispatchMode (memory trackers, kernel emulators) sees the ops a custom op runs inside
# only when they are dispatched one by one.
@torch.library.custom_op("hfpatch::all_to_all", mutates_args=())
def _all_to_all_op(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: str,
    scatter_sizes: list[int],
    gather_sizes: list[int],
) -> torch.Tensor:
    return _all_to_all(x, scatter_dim, gather_dim, resolve_group(group), scatter_sizes, gather_sizes)


@_all_to_all_op.register_fake
def _(x, scatter_dim, gather_dim, group, scatter_sizes, gather_sizes):
    shape = list(x.shape)
    shape[scatter_dim] = scatter_sizes[rank_in(resolve_group(group))]
    shape[gather_dim] = sum(gather_sizes)
    return x.new_empty(shape)


def _all_to_all_setup(ctx, inputs, output) -> None:
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group, ctx.scatter_sizes, ctx.gather_sizes = inputs


def _all_to_all_backward(ctx, grad):
    # The adjoint of an all-to-all is the all-to-all with the roles of the two dims swapped.
    grad = _all_to_all_op(
        grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group, ctx.gather_sizes, ctx.scatter_sizes
    )
    return grad, None, None, None, None, None


_all_to_all_op.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


def all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: ProcessGroup | None = None,
    scatter_sizes: Sequence[int] | None = None,
    gather_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Reshard: split ``x`` along ``scatter_dim`` over the ranks, concatenate what arrives along ``gather_dim``.

    Rank ``r`` keeps piece ``r`` of every rank's ``x`` (pieces sized ``scatter_sizes``) and concatenates them
    in rank order along ``gather_dim``. For Ulysses, ``x_bshd`` sequence-sharded becomes head-sharded with
    ``all_to_all(x, scatter_dim=2, gather_dim=1)`` and back with the dims swapped.

    Args:
        x: Local tensor; all dims but ``gather_dim`` equal on every rank.
        scatter_dim: Dim split over the ranks.
        gather_dim: Dim the received pieces are concatenated along.
        group: Process group (default: world).
        scatter_sizes: Piece sizes along ``scatter_dim`` (default: an even split, which must divide).
        gather_sizes: Every rank's ``x.shape[gather_dim]`` (default: all equal to this rank's).

    Returns:
        ``x`` resharded; differentiable (backward is the inverse all-to-all).
    """
    world = size_of(group)
    scatter_dim %= x.dim()
    gather_dim %= x.dim()
    if scatter_sizes is None:
        if x.shape[scatter_dim] % world:
            raise ValueError(
                f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} does not divide over {world} ranks; "
                "pass scatter_sizes for an uneven split"
            )
        scatter_sizes = [x.shape[scatter_dim] // world] * world
    scatter_sizes = check_sizes("scatter_sizes", scatter_sizes, world, x.shape[scatter_dim])
    gather_sizes = check_sizes("gather_sizes", gather_sizes or [x.shape[gather_dim]] * world, world)
    if gather_sizes[rank_in(group)] != x.shape[gather_dim]:
        raise ValueError(
            f"gather_sizes[{rank_in(group)}]={gather_sizes[rank_in(group)]} != local size {x.shape[gather_dim]}"
        )
    if world == 1:
        return x
    if torch.compiler.is_compiling():
        return _all_to_all_op(x, scatter_dim, gather_dim, group_name(group), scatter_sizes, gather_sizes)
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, scatter_sizes, gather_sizes)
