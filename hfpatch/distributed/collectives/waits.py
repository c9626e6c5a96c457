"""How a collective of :mod:`hfpatch.distributed.collectives` finishes: a peer's failure turned into
:class:`hfpatch.distributed.runtime.CollectiveError`, point-to-point waits bounded by the group's timeout on gloo,
and the backend's references to the buffers dropped before the caller goes on (:func:`await_release`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import runtime

__all__ = ["RELEASE_WAIT_S", "all_to_all_single", "await_release", "use_counts", "wait_works"]

# How long to wait for gloo's worker thread to drop a finished op's buffers: a bound that is never reached
# (over the attention, distributed and patch tests on 2 busy cores the longest wait was 3 ms).
RELEASE_WAIT_S = 1.0


def use_counts(buffers: Sequence[torch.Tensor]) -> list[int]:
    """Reference counts of ``buffers`` for :func:`await_release` (empty where it does not wait)."""
    if not buffers or buffers[0].device.type != "cpu" or torch.compiler.is_compiling():
        return []
    return [b._use_count() for b in buffers]


def await_release(buffers: Sequence[torch.Tensor], before: Sequence[int]) -> None:
    """Let the backend drop its references to ``buffers`` (CPU tensors only; at most ``RELEASE_WAIT_S``).

    gloo wakes the caller *before* its worker thread releases the finished work, which holds the send and
    receive buffers. On a busy CPU that thread may not run again for milliseconds while the caller allocates
    the next activations, so buffers the caller already dropped stay allocated: peak memory then depends on
    thread scheduling (a Ulysses layer kept its output exchange's two buffers through the MLP in one call of
    five). Sleeping (so the worker can run on this core) until the reference counts are back to what they
    were before the op (:func:`use_counts`) keeps the peak what the algorithm allocates; usually they already
    are. CUDA buffers are left to the caching allocator and stream semantics, compiled code to the compiler.
    """
    deadline = None
    while any(b._use_count() > n for b, n in zip(buffers, before)):
        now = time.monotonic()
        deadline = deadline or now + RELEASE_WAIT_S
        if now > deadline:  # the backend keeps them for its own reasons: only memory, never results
            return
        time.sleep(5e-5)


def all_to_all_single(op: str, recv: torch.Tensor, send: torch.Tensor, recv_sizes, send_sizes, group) -> None:
    """``dist.all_to_all_single`` whose peer failures raise :class:`~hfpatch.distributed.runtime.CollectiveError`
    (naming ``op``), the buffers released before it returns."""
    before = use_counts((recv, send))
    try:
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    except RuntimeError as exc:
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error(op, group, exc) from exc
    await_release((recv, send), before)


def wait_works(
    works: list[dist.Work],
    op: str,
    group,
    buffers: Sequence[torch.Tensor] = (),
    before: Sequence[int] = (),
) -> None:
    """Wait for point-to-point ``works`` (bounded on gloo); peer failures raise ``CollectiveError``.

    Empties ``works`` (finished works hold their buffers), then lets the backend release ``buffers`` (their
    use counts ``before`` the op given), see :func:`await_release`.
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
    await_release(buffers, before)
