"""The all-gather and its dual, the reduce-scatter: every rank's shard concatenated along a dimension (uneven
sizes, or a sequence padded at its end cut to its valid length), and every rank's slice of a sum over the ranks.
The all-gather's backward is a slice (the same loss on every rank) or a reduce-scatter (one loss per rank);
compiled graphs call them as the custom ops ``hfpatch::all_gather`` and ``hfpatch::reduce_scatter``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import runtime
from .counting import record_sent
from .groups import ProcessGroup, check_sizes, even_sizes, group_name, rank_in, resolve_group, size_of
from .waits import all_to_all_single, await_release, use_counts

__all__ = ["all_gather", "reduce_scatter"]


def _gather(x: torch.Tensor, dim: int, group, sizes: list[int]) -> torch.Tensor:
    world = size_of(group)
    flat = x.contiguous().reshape(-1)
    send = flat.repeat(world)  # one copy per destination: all_to_all_single handles uneven sizes
    shapes = []
    for s in sizes:
        shape = list(x.shape)
        shape[dim] = s
        shapes.append(shape)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    recv = x.new_empty(sum(numels))
    all_to_all_single("all_gather", recv, send, numels, [flat.numel()] * world, group)
    record_sent("all_gather", (world - 1) * flat.numel() * x.element_size())
    return torch.cat([c.view(s) for c, s in zip(recv.split(numels), shapes)], dim=dim)


def _reduce_scatter(grad: torch.Tensor, dim: int, group, sizes: list[int]) -> torch.Tensor:
    # Sum over ranks of each rank's slice: an all-to-all of the slices followed by a local sum.
    world, me = size_of(group), rank_in(group)
    pieces = [p.contiguous().reshape(-1) for p in grad.split(sizes, dim=dim)]
    send = torch.cat(pieces)
    recv = grad.new_empty(pieces[me].numel() * world)
    all_to_all_single(
        "reduce_scatter", recv, send, [pieces[me].numel()] * world, [p.numel() for p in pieces], group
    )
    record_sent("reduce_scatter", (send.numel() - pieces[me].numel()) * grad.element_size())
    shape = list(grad.shape)
    shape[dim] = sizes[me]
    return recv.view(world, *shape).sum(0)


def _gather_sequence(x: torch.Tensor, dim: int, group, valid: int) -> torch.Tensor:
    """Every rank's equal shard of a sequence padded at its end, concatenated along ``dim`` and cut to ``valid``.

    The result is contiguous (what the unpadded tensor would be) and holds no padding: the shards are received
    into one buffer (``all_gather_single``: nothing is copied per destination), and either that buffer is the
    result (nothing before ``dim`` but size-1 dims: the shards lie one after the other) or one ``cat`` of each
    shard's valid rows writes it. Bytes sent: ``N - 1`` local shards, as :func:`_gather`.
    """
    world = size_of(group)
    send = x.contiguous()
    recv = x.new_empty(world * send.numel())
    before = use_counts((recv, send))
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    try:
        gather_single(recv, send.reshape(-1), group=group)
    except RuntimeError as exc:
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error("all_gather", group, exc) from exc
    await_release((recv, send), before)
    record_sent("all_gather", (world - 1) * send.numel() * x.element_size())
    local = x.shape[dim]
    if math.prod(x.shape[:dim]) == 1:
        full = list(x.shape)
        full[dim] = world * local
        return recv.view(full).narrow(dim, 0, valid)
    shards = recv.view(world, *x.shape)
    keep = [max(0, min(local, valid - p * local)) for p in range(world)]
    return torch.cat([shards[p].narrow(dim, 0, n) for p, n in enumerate(keep) if n], dim=dim)


def _gather_any(x: torch.Tensor, dim: int, group, sizes: list[int], valid: int | None) -> torch.Tensor:
    return _gather(x, dim, group, sizes) if valid is None else _gather_sequence(x, dim, group, valid)


def _slice_of(grad: torch.Tensor, dim: int, group, sizes: list[int], valid: int | None) -> torch.Tensor:
    """This rank's part of the gathered tensor's gradient (zeros for its padding cut off by ``valid``)."""
    me = rank_in(group)
    start = sum(sizes[:me])
    kept = sizes[me] if valid is None else max(0, min(sizes[me], valid - start))
    part = grad.narrow(dim, start, kept).contiguous()
    if kept == sizes[me]:
        return part
    pad = list(grad.shape)
    pad[dim] = sizes[me] - kept
    return torch.cat([part, grad.new_zeros(pad)], dim=dim)


def _padded_back(grad: torch.Tensor, dim: int, sizes: list[int], valid: int | None) -> torch.Tensor:
    """The gradient of the whole concatenation: ``grad`` with zeros for the padding ``valid`` cut off."""
    if valid is None or valid == sum(sizes):
        return grad.contiguous()
    pad = list(grad.shape)
    pad[dim] = sum(sizes) - valid
    return torch.cat([grad, grad.new_zeros(pad)], dim=dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes, backward, valid):
        ctx.args = (dim, group, sizes, backward, valid)
        return _gather_any(x, dim, group, sizes, valid)

    @staticmethod
    def backward(ctx, grad):
        dim, group, sizes, backward, valid = ctx.args
        if backward == "slice":
            return _slice_of(grad, dim, group, sizes, valid), None, None, None, None, None
        full = _padded_back(grad, dim, sizes, valid)
        return _reduce_scatter(full, dim, group, sizes), None, None, None, None, None


@torch.library.custom_op("hfpatch::all_gather", mutates_args=())
def _all_gather_op(
    x: torch.Tensor, dim: int, group: str, sizes: list[int], backward: str, valid: int | None = None
) -> torch.Tensor:
    return _gather_any(x, dim, resolve_group(group), sizes, valid)


@_all_gather_op.register_fake
def _(x, dim, group, sizes, backward, valid=None):
    shape = list(x.shape)
    shape[dim] = sum(sizes) if valid is None else valid
    return x.new_empty(shape)


def _all_gather_setup(ctx, inputs, output) -> None:
    _, ctx.dim, ctx.group, ctx.sizes, ctx.backward, ctx.valid = inputs


def _all_gather_backward(ctx, grad):
    if ctx.backward == "slice":
        return (
            _slice_of(grad, ctx.dim, resolve_group(ctx.group), ctx.sizes, ctx.valid),
            None,
            None,
            None,
            None,
            None,
        )
    full = _padded_back(grad, ctx.dim, ctx.sizes, ctx.valid)
    return _reduce_scatter_op(full, ctx.dim, ctx.group, ctx.sizes), None, None, None, None, None


_all_gather_op.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)


@torch.library.custom_op("hfpatch::reduce_scatter", mutates_args=())
def _reduce_scatter_op(grad: torch.Tensor, dim: int, group: str, sizes: list[int]) -> torch.Tensor:
    return _reduce_scatter(grad, dim, resolve_group(group), sizes)


@_reduce_scatter_op.register_fake
def _(grad, dim, group, sizes):
    shape = list(grad.shape)
    shape[dim] = sizes[rank_in(resolve_group(group))]
    return grad.new_empty(shape)


def all_gather(
    x: torch.Tensor,
    dim: int,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    backward: str = "slice",
    valid: int | None = None,
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (uneven ``sizes`` allowed); differentiable.

    Args:
        x: Local shard.
        dim: Dim to concatenate along.
        group: Process group (default: world).
        sizes: Every rank's ``x.shape[dim]`` (default: all equal).
        backward: ``"slice"`` when every rank computes the *same* loss from the gathered tensor (replicated
            downstream; the gradient of the local shard is its slice of the gradient, no communication), or
            ``"reduce_scatter"`` when ranks compute different losses whose sum is the objective.
        valid: Keep only the first ``valid`` elements of the concatenation along ``dim``: the shards (equal
            ``sizes``) are a sequence zero-padded at its end (:mod:`hfpatch.attention.layout`) and the padding is
            never copied into the result, which is contiguous like the unpadded tensor. Its gradient is zero.

    Returns:
        The full tensor, identical on every rank.

    >>> import torch
    >>> all_gather(torch.ones(2, 3), dim=1, valid=2).shape  # one rank: the shard, cut to its valid part
    torch.Size([2, 2])
    """
    if backward not in ("slice", "reduce_scatter"):
        raise ValueError(f"backward must be 'slice' or 'reduce_scatter', got {backward!r}")
    world = size_of(group)
    dim %= x.dim()
    sizes = check_sizes("sizes", sizes or [x.shape[dim]] * world, world)
    if sizes[rank_in(group)] != x.shape[dim]:
        raise ValueError(
            f"sizes[{rank_in(group)}]={sizes[rank_in(group)]} != local size {x.shape[dim]} along dim {dim}"
        )
    if valid is not None and (len(set(sizes)) > 1 or not 0 < valid <= sum(sizes)):
        raise ValueError(f"valid={valid} needs equal sizes adding up to at least it, got sizes={sizes}")
    if world == 1:
        return x if valid is None or valid == x.shape[dim] else x.narrow(dim, 0, valid).contiguous()
    if torch.compiler.is_compiling():
        return _all_gather_op(x, dim, group_name(group), sizes, backward, valid)
    return _AllGather.apply(x, dim, group, sizes, backward, valid)


def reduce_scatter(
    x: torch.Tensor, dim: int, group: ProcessGroup | None = None, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """The sum over ranks of every rank's ``x``, each rank keeping its own slice along ``dim`` (uneven
    ``sizes`` allowed): the dual of :func:`all_gather`, for gradients computed outside autograd. Not
    differentiable.

    Args:
        x: This rank's full-size tensor (``sum(sizes)`` along ``dim``), e.g. its partial gradient of a
            gathered tensor.
        dim: Dim the slices are cut along.
        group: Process group (default: world).
        sizes: Every rank's slice length along ``dim`` (default: equal).

    Returns:
        This rank's slice summed over the ranks (``x`` itself in one process).
    """
    world = size_of(group)
    dim %= x.dim()
    sizes = check_sizes("sizes", sizes or even_sizes(x.shape[dim], world), world, x.shape[dim])
    if world == 1:
        return x
    return _reduce_scatter(x, dim, group, sizes)
