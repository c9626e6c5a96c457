"""What every collective of :mod:`hfpatch.distributed.collectives` shares: the communication counter
(:func:`~hfpatch.distributed.collectives.count_comm`, and the record each collective adds to it), the group
helpers (sizes, ranks, the names by which the compiled custom ops pass a group), the bounded waits that turn a
peer's failure into :class:`hfpatch.distributed.runtime.CollectiveError`, and the checks of split sizes.
:mod:`hfpatch.distributed.collectives` re-exports its public names.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import runtime

ProcessGroup = dist.ProcessGroup


# ----------------------------------------------------------------------------------------------- counting
@dataclass
class CommCounter:
    """Bytes this rank sent, total and per collective kind (``"all_to_all"``, ``"halo"``, ...)."""

    bytes_sent: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.by_op[op] = self.by_op.get(op, 0) + nbytes
        self.calls[op] = self.calls.get(op, 0) + 1


_COUNTERS: contextvars.ContextVar[tuple[CommCounter, ...]] = contextvars.ContextVar(
    "hfpatch_comm", default=()
)


@contextmanager
def count_comm() -> Iterator[CommCounter]:
    """Count bytes sent by hfpatch collectives on this rank inside the block (nestable).

    >>> from hfpatch.distributed.collectives import count_comm
    >>> with count_comm() as counter:
    ...     pass
    >>> counter.bytes_sent
    0
    """
    counter = CommCounter()
    token = _COUNTERS.set(_COUNTERS.get() + (counter,))
    try:
        yield counter
    finally:
        _COUNTERS.reset(token)


def _record(op: str, nbytes: int) -> None:
    if torch.compiler.is_compiling():  # Dynamo cannot trace ContextVar.get; counting is a host-side aid
        return
    for counter in _COUNTERS.get():
        counter.add(op, nbytes)


# ----------------------------------------------------------------------------------------------- helpers
def _size(group: ProcessGroup | None) -> int:
    # One process without a default group is a world of one: nothing to communicate.
    return 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)


def _rank(group: ProcessGroup | None) -> int:
    return 0 if group is None and not dist.is_initialized() else dist.get_rank(group)


def _global(group: ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def group_name(group: ProcessGroup | None) -> str:
    """The name a custom op is given for ``group`` (``None``: the default group)."""
    return (dist.group.WORLD if group is None else group).group_name


def resolve_group(name: str) -> ProcessGroup:
    """The process group registered under ``name`` (:func:`group_name`)."""
    return dist.distributed_c10d._resolve_process_group(name)


# How long to wait for gloo's worker thread to drop a finished op's buffers: a bound that is never reached
# (over the attention, distributed and patch tests on 2 busy cores the longest wait was 3 ms).
RELEASE_WAIT_S = 1.0


def _use_counts(buffers: Sequence[torch.Tensor]) -> list[int]:
    """Reference counts of ``buffers`` for :func:`_await_release` (empty where it does not wait)."""
    if not buffers or buffers[0].device.type != "cpu" or torch.compiler.is_compiling():
        return []
    return [b._use_count() for b in buffers]


def _await_release(buffers: Sequence[torch.Tensor], before: Sequence[int]) -> None:
    """Let the backend drop its references to ``buffers`` (CPU tensors only; at most ``RELEASE_WAIT_S``).

    gloo wakes the caller *before* its worker thread releases the finished work, which holds the send and
    receive buffers. On a busy CPU that thread may not run again for milliseconds while the caller allocates
    the next activations, so buffers the caller already dropped stay allocated: peak memory then depends on
    thread scheduling (a Ulysses layer kept its output exchange's two buffers through the MLP in one call of
    five). Sleeping (so the worker can run on this core) until the reference counts are back to what they
    were before the op keeps the peak what the algorithm allocates; usually they already are. CUDA buffers
    are left to the caching allocator and stream semantics, compiled code to the compiler.
    """
    deadline = None
    while any(b._use_count() > n for b, n in zip(buffers, before)):
        now = time.monotonic()
        deadline = deadline or now + RELEASE_WAIT_S
        if now > deadline:  # the backend keeps them for its own reasons: only memory, never results
            return
        time.sleep(5e-5)


def _all_to_all_single(
    op: str, recv: torch.Tensor, send: torch.Tensor, recv_sizes, send_sizes, group
) -> None:
    """``dist.all_to_all_single`` whose peer failures raise :class:`~hfpatch.distributed.runtime.CollectiveError`."""
    before = _use_counts((recv, send))
    try:
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    except RuntimeError as exc:
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error(op, group, exc) from exc
    _await_release((recv, send), before)


def _wait(
    works: list[dist.Work],
    op: str,
    group,
    buffers: Sequence[torch.Tensor] = (),
    before: Sequence[int] = (),
) -> None:
    """Wait for point-to-point ``works`` (bounded on gloo); peer failures raise ``CollectiveError``.

    Empties ``works`` (finished works hold their buffers), then lets the backend release ``buffers`` (their
    use counts ``before`` the op given), see :func:`_await_release`.
    """
    if not works:
        return
    timeout = runtime.wait_timeout(group)
    try:
        while works:  # popped: a finished work holds its buffers
            work = works.pop()
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
            del work
    except RuntimeError as exc:
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error(op, group, exc) from exc
    _await_release(buffers, before)


def even_sizes(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` sizes that differ by at most one, larger ones first.

    >>> even_sizes(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _check_sizes(name: str, sizes: Sequence[int], world: int, total: int | None = None) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes):
        raise ValueError(f"{name} must list {world} non-negative sizes (one per rank), got {sizes}")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"{name}={sizes} must add up to the dimension size {total}")
    return sizes
