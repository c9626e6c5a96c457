"""Autograd-aware collectives with explicit (possibly uneven) split sizes, and a communication counter.

Every collective here has its dual as backward (all-to-all <-> all-to-all with the split sizes swapped,
all-gather <-> reduce-scatter or slice, halo send <-> halo-gradient return), takes ``group=None`` for the
default group, and reports the bytes it sends to every :func:`count_comm` counter that is open, so tests
and benchmarks can compare communication with the analytic minimum.

Shape comments use ``W`` for the group size and ``r`` for this rank's index in the group. As in
torch.distributed, ``group=None`` means the default (world) group; a degree-1 mesh axis (``None`` from
:meth:`hfpatch.distributed.runtime.ParallelMesh.group`) must not be passed here: callers skip the collective.

A collective that fails because another rank failed, exited or timed out (gloo/NCCL timeouts, closed
connections) raises :class:`hfpatch.distributed.runtime.CollectiveError` naming the op and the group, with
the backend's error as its cause. Point-to-point waits on gloo are bounded by the group's timeout
(:func:`hfpatch.distributed.runtime.wait_timeout`).

``torch.compile``: each differentiable collective is one ``torch.library`` custom op (``hfpatch::all_to_all``,
``hfpatch::all_gather``, ``hfpatch::reduce_scatter``, ``hfpatch::all_reduce_mean``) with a fake (shape) function
and its dual registered as its autograd formula, the group passed by name. A compiled graph calls each one as a
single node, with no graph break; it runs the same Python as in eager mode, so the peer-failure errors, the
bounded waits and the byte counts of :func:`count_comm` hold in compiled code too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import runtime
from .collectives_common import (
    CommCounter,
    ProcessGroup,
    _all_to_all_single,
    _await_release,
    _check_sizes,
    _global,
    _rank,
    _record,
    _size,
    _use_counts,
    _wait,
    count_comm,
    even_sizes,
    group_name,
    resolve_group,
)

__all__ = [
    "CommCounter",
    "PendingP2P",
    "all_gather",
    "all_reduce_sum",
    "all_to_all",
    "count_comm",
    "even_sizes",
    "halo_exchange",
    "reduce_scatter",
    "ring_shift",
    "start_p2p",
]


# ----------------------------------------------------------------------------------------------- all-to-all
def _all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group,
    scatter_sizes: list[int],
    gather_sizes: list[int],
) -> torch.Tensor:
    world, me = _size(group), _rank(group)
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
    _all_to_all_single("all_to_all", recv, send, recv_numel, send_numel, group)
    _record("all_to_all", (send.numel() - send_numel[me]) * x.element_size())
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
    shape[scatter_dim] = scatter_sizes[_rank(resolve_group(group))]
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
    world = _size(group)
    scatter_dim %= x.dim()
    gather_dim %= x.dim()
    if scatter_sizes is None:
        if x.shape[scatter_dim] % world:
            raise ValueError(
                f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} does not divide over {world} ranks; "
                "pass scatter_sizes for an uneven split"
            )
        scatter_sizes = [x.shape[scatter_dim] // world] * world
    scatter_sizes = _check_sizes("scatter_sizes", scatter_sizes, world, x.shape[scatter_dim])
    gather_sizes = _check_sizes("gather_sizes", gather_sizes or [x.shape[gather_dim]] * world, world)
    if gather_sizes[_rank(group)] != x.shape[gather_dim]:
        raise ValueError(
            f"gather_sizes[{_rank(group)}]={gather_sizes[_rank(group)]} != local size {x.shape[gather_dim]}"
        )
    if world == 1:
        return x
    if torch.compiler.is_compiling():
        return _all_to_all_op(x, scatter_dim, gather_dim, group_name(group), scatter_sizes, gather_sizes)
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, scatter_sizes, gather_sizes)


# ----------------------------------------------------------------------------------------------- all-gather
def _gather(x: torch.Tensor, dim: int, group, sizes: list[int]) -> torch.Tensor:
    world = _size(group)
    flat = x.contiguous().reshape(-1)
    send = flat.repeat(world)  # one copy per destination: all_to_all_single handles uneven sizes
    shapes = []
    for s in sizes:
        shape = list(x.shape)
        shape[dim] = s
        shapes.append(shape)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    recv = x.new_empty(sum(numels))
    _all_to_all_single("all_gather", recv, send, numels, [flat.numel()] * world, group)
    _record("all_gather", (world - 1) * flat.numel() * x.element_size())
    return torch.cat([c.view(s) for c, s in zip(recv.split(numels), shapes)], dim=dim)


def _reduce_scatter(grad: torch.Tensor, dim: int, group, sizes: list[int]) -> torch.Tensor:
    # Sum over ranks of each rank's slice: an all-to-all of the slices followed by a local sum.
    world, me = _size(group), _rank(group)
    pieces = [p.contiguous().reshape(-1) for p in grad.split(sizes, dim=dim)]
    send = torch.cat(pieces)
    recv = grad.new_empty(pieces[me].numel() * world)
    _all_to_all_single(
        "reduce_scatter", recv, send, [pieces[me].numel()] * world, [p.numel() for p in pieces], group
    )
    _record("reduce_scatter", (send.numel() - pieces[me].numel()) * grad.element_size())
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
    world = _size(group)
    send = x.contiguous()
    recv = x.new_empty(world * send.numel())
    before = _use_counts((recv, send))
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    try:
        gather_single(recv, send.reshape(-1), group=group)
    except RuntimeError as exc:
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error("all_gather", group, exc) from exc
    _await_release((recv, send), before)
    _record("all_gather", (world - 1) * send.numel() * x.element_size())
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
    me = _rank(group)
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
    shape[dim] = sizes[_rank(resolve_group(group))]
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
    world = _size(group)
    dim %= x.dim()
    sizes = _check_sizes("sizes", sizes or [x.shape[dim]] * world, world)
    if sizes[_rank(group)] != x.shape[dim]:
        raise ValueError(
            f"sizes[{_rank(group)}]={sizes[_rank(group)]} != local size {x.shape[dim]} along dim {dim}"
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
    world = _size(group)
    dim %= x.dim()
    sizes = _check_sizes("sizes", sizes or even_sizes(x.shape[dim], world), world, x.shape[dim])
    if world == 1:
        return x
    return _reduce_scatter(x, dim, group, sizes)


# ----------------------------------------------------------------------------------------------- all-reduce
def all_reduce_sum(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group``, a new tensor (counted as ``"all_reduce"``). Not
    differentiable; for a few scalars computed outside autograd (a loss value, a temperature's gradient)."""
    out = x.contiguous().clone()
    world = _size(group)
    try:
        dist.all_reduce(out, group=group)
    except RuntimeError as exc:
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error("all_reduce", group, exc) from exc
    _record("all_reduce", 2 * (world - 1) * out.numel() * out.element_size() // world)
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
    out = x.contiguous().clone()
    world = _size(pg)
    try:
        dist.all_reduce(out, group=pg)
    except RuntimeError as exc:
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error("all_reduce", pg, exc) from exc
    # A ring all-reduce sends 2 (W - 1) / W of the tensor per rank.
    _record("all_reduce", 2 * (world - 1) * out.numel() * out.element_size() // world)
    return out.div_(world)


# ----------------------------------------------------------------------------------------------- P2P
def _staged(t: torch.Tensor, group) -> bool:
    """Whether ``t`` must go through host memory: gloo sends and receives raw host pointers (its collectives copy
    CUDA tensors to pinned memory themselves, its point-to-point ops do not)."""
    return t.device.type != "cpu" and dist.get_backend(group) == "gloo"


class PendingP2P:
    """Point-to-point sends and receives in flight, started by :func:`start_p2p`.

    :meth:`wait` finishes them (bounded on gloo by the group's timeout), copies receives that went through host
    memory (CUDA tensors over gloo) into their destinations, lets gloo drop its references to the buffers, and
    raises :class:`~hfpatch.distributed.runtime.CollectiveError` when a peer failed, exited or timed out. The
    receive destinations may be read only after :meth:`wait`; waiting twice is a no-op.
    """

    def __init__(self, works, op: str, group, buffers, before, staged) -> None:
        self._works = works
        self._op = op
        self._group = group
        self._buffers = buffers
        self._before = before
        self._staged = staged

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has run."""
        return self._works is None

    def wait(self) -> None:
        """Finish every send and receive; receives are then readable in their destinations."""
        if self._works is None:
            return
        works, self._works = self._works, None
        _wait(works, self._op, self._group, self._buffers, self._before)
        for host, destination in self._staged:
            destination.copy_(host)
        self._buffers = self._staged = ()


def start_p2p(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: ProcessGroup | None,
    op: str,
) -> PendingP2P:
    """Start sending and receiving contiguous tensors to/from ranks of ``group`` (``(tensor, group rank)`` pairs).

    One batch (``dist.batch_isend_irecv``: a single grouped launch on NCCL). Every rank must post the matching
    operations in the same order (messages between two ranks are matched in posting order). Zero-size tensors
    are skipped (both sides know the sizes). Bytes sent are counted under ``op`` (:func:`count_comm`). CUDA
    tensors over gloo go through host memory (gloo's point-to-point ops read host pointers only): what
    multi-rank tests on one GPU need, never a fast path.

    Not differentiable; the autograd functions built on it (Ulysses' exchange, halo exchange, Ring attention)
    define their own backward.
    """
    # Fresh aliases: the backend's references to them are the only ones besides ours, so the wait can tell when
    # it released the buffers (the caller's own references to its tensors may change while the op runs).
    sends = [(t.view(t.shape), p) for t, p in sends if t.numel()]
    recvs = [(t.view(t.shape), p) for t, p in recvs if t.numel()]
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    wire_sends, wire_recvs = [], []
    for t, peer in sends:
        wire_sends.append((t.cpu() if _staged(t, group) else t, peer))
    for t, peer in recvs:
        if _staged(t, group):
            host = torch.empty(t.shape, dtype=t.dtype)
            staged.append((host, t))
            t = host
        wire_recvs.append((t, peer))
    ops = [dist.P2POp(dist.isend, t, _global(group, peer), group) for t, peer in wire_sends]
    ops += [dist.P2POp(dist.irecv, t, _global(group, peer), group) for t, peer in wire_recvs]
    buffers = [t for t, _ in (*wire_sends, *wire_recvs)]
    before = _use_counts(buffers)
    works: list[dist.Work] = []
    if ops:
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            if not runtime.is_peer_failure(exc):
                raise
            raise runtime.collective_error(f"{op} send/recv", group, exc) from exc
    del ops
    _record(op, sum(t.numel() * t.element_size() for t, _ in sends))
    return PendingP2P(works, f"{op} send/recv", group, buffers, before, staged)


def _p2p(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group, op: str
) -> None:
    start_p2p(sends, recvs, group, op).wait()


def ring_shift(
    tensors: Sequence[torch.Tensor], group: ProcessGroup | None = None
) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Start sending ``tensors`` to the next rank and receiving the previous rank's (same shapes).

    Not differentiable: ring attention passes K/V blocks with it inside its own autograd function. Returns
    ``(received, wait)``; compute on the current block, then call ``wait()`` before reading ``received``,
    so communication overlaps computation. ``wait()`` raises
    :class:`~hfpatch.distributed.runtime.CollectiveError` when a neighbour failed, exited or timed out.
    """
    world, me = _size(group), _rank(group)
    if world == 1:
        return [t for t in tensors], lambda: None
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    sends = [(t.contiguous(), (me + 1) % world) for t in tensors]
    pending = start_p2p(sends, [(r, (me - 1) % world) for r in received], group, "ring")
    del sends
    return received, pending.wait  # wait also frees the send buffers


# ----------------------------------------------------------------------------------------------- halo
def _halo_forward(
    x: torch.Tensor, dim: int, before: int, after: int, group
) -> tuple[torch.Tensor, torch.Tensor]:
    world, me = _size(group), _rank(group)
    length = x.shape[dim]
    sends, recvs = [], []
    top_shape, bottom_shape = list(x.shape), list(x.shape)
    top_shape[dim], bottom_shape[dim] = (before if me > 0 else 0), (after if me < world - 1 else 0)
    top = x.new_empty(top_shape)
    bottom = x.new_empty(bottom_shape)
    if me > 0 and after:  # my first rows are the previous rank's "after" halo
        sends.append((x.narrow(dim, 0, after).contiguous(), me - 1))
    if me < world - 1 and before:  # my last rows are the next rank's "before" halo
        sends.append((x.narrow(dim, length - before, before).contiguous(), me + 1))
    if top.numel():
        recvs.append((top, me - 1))
    if bottom.numel():
        recvs.append((bottom, me + 1))
    _p2p(sends, recvs, group, "halo")
    return top, bottom


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, before, after, group):
        ctx.args = (dim, before, after, group, x.shape[dim])
        top, bottom = _halo_forward(x, dim, before, after, group)
        return torch.cat([top, x, bottom], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        dim, before, after, group, length = ctx.args
        world, me = _size(group), _rank(group)
        n_top = before if me > 0 else 0
        n_bottom = after if me < world - 1 else 0
        g_top = grad.narrow(dim, 0, n_top).contiguous()
        g_x = grad.narrow(dim, n_top, length).clone()
        g_bottom = grad.narrow(dim, n_top + length, n_bottom).contiguous()
        # Halo gradients go back to their owners: my top halo came from the previous rank's last rows.
        sends, recvs = [], []
        if n_top:
            sends.append((g_top, me - 1))
        if n_bottom:
            sends.append((g_bottom, me + 1))
        from_next_shape, from_prev_shape = list(grad.shape), list(grad.shape)
        from_next_shape[dim] = after if me > 0 else 0  # the previous rank's bottom halo = my first rows
        from_prev_shape[dim] = before if me < world - 1 else 0
        g_first = grad.new_empty(from_next_shape)
        g_last = grad.new_empty(from_prev_shape)
        if g_first.numel():
            recvs.append((g_first, me - 1))
        if g_last.numel():
            recvs.append((g_last, me + 1))
        _p2p(sends, recvs, group, "halo")
        if g_first.shape[dim]:
            g_x.narrow(dim, 0, g_first.shape[dim]).add_(g_first)
        if g_last.shape[dim]:
            g_x.narrow(dim, length - g_last.shape[dim], g_last.shape[dim]).add_(g_last)
        return g_x, None, None, None, None


def halo_exchange(
    x: torch.Tensor,
    dim: int,
    before: int,
    after: int,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Extend the local shard with its neighbours' boundary rows along ``dim``; differentiable.

    Rank ``r`` receives the last ``before`` rows of rank ``r-1`` and the first ``after`` rows of rank
    ``r+1`` and returns ``cat([those_before, x, those_after], dim)``. At the global borders nothing is
    added (the caller pads there as the unsharded op would). Backward returns the halo gradients to their
    owners, who add them to their boundary rows. Shards may be uneven but must hold at least
    ``max(before, after)`` rows.

    Pass ``sizes`` (every rank's shard length along ``dim``) to have every rank check every shard, so a
    too-short shard raises the same error on all ranks instead of on its owner only.

    Bytes sent per rank (interior): ``(before + after) * (x.numel() / x.shape[dim]) * x.element_size()``.
    """
    world = _size(group)
    dim %= x.dim()
    if before < 0 or after < 0:
        raise ValueError(f"halo sizes must be >= 0, got before={before}, after={after}")
    if world == 1 or (before == 0 and after == 0):
        return x
    shortest = min(_check_sizes("sizes", sizes, world)) if sizes is not None else x.shape[dim]
    if shortest < max(before, after):
        raise ValueError(
            f"halo_exchange: a shard has {shortest} rows along dim {dim} but a halo of "
            f"{max(before, after)} rows is needed; use fewer ranks or a larger input"
        )
    return _HaloExchange.apply(x, dim, before, after, group)
