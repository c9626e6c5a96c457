"""Point-to-point: sends and receives to and from ranks of a group in one batch (:func:`start_p2p`, finished by
:meth:`PendingP2P.wait`), and the ring shift built on them (:func:`ring_shift`: Ring attention's K/V blocks to
the next rank). Not differentiable: the autograd functions built on them define their own backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .. import runtime
from .counting import record_sent
from .groups import ProcessGroup, global_rank_of, rank_in, size_of
from .waits import use_counts, wait_works

__all__ = ["PendingP2P", "ring_shift", "start_p2p"]


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
        wait_works(works, self._op, self._group, self._buffers, self._before)
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
    ops = [dist.P2POp(dist.isend, t, global_rank_of(group, peer), group) for t, peer in wire_sends]
    ops += [dist.P2POp(dist.irecv, t, global_rank_of(group, peer), group) for t, peer in wire_recvs]
    buffers = [t for t, _ in (*wire_sends, *wire_recvs)]
    before = use_counts(buffers)
    works: list[dist.Work] = []
    if ops:
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            if not runtime.is_peer_failure(exc):
                raise
            raise runtime.collective_error(f"{op} send/recv", group, exc) from exc
    del ops
    record_sent(op, sum(t.numel() * t.element_size() for t, _ in sends))
    return PendingP2P(works, f"{op} send/recv", group, buffers, before, staged)


def ring_shift(
    tensors: Sequence[torch.Tensor], group: ProcessGroup | None = None
) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Start sending ``tensors`` to the next rank and receiving the previous rank's (same shapes).

    Not differentiable: ring attention passes K/V blocks with it inside its own autograd function. Returns
    ``(received, wait)``; compute on the current block, then call ``wait()`` before reading ``received``,
    so communication overlaps computation. ``wait()`` raises
    :class:`~hfpatch.distributed.runtime.CollectiveError` when a neighbour failed, exited or timed out.
    """
    world, me = size_of(group), rank_in(group)
    if world == 1:
        return [t for t in tensors], lambda: None
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    sends = [(t.contiguous(), (me + 1) % world) for t in tensors]
    pending = start_p2p(sends, [(r, (me - 1) % world) for r in received], group, "ring")
    del sends
    return received, pending.wait  # wait also frees the send buffers
