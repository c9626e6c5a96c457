"""Notices while a patched call waits for ranks that have not reached it.

A patched call made on some ranks only (under ``if rank == 0:``, or while another rank loads data or waits in a
``dist.barrier()``) waits in its first collective until ``HFPATCH_TIMEOUT_S`` (600 s by default), then raises
:class:`~hfpatch.distributed.runtime.CollectiveError`. Meanwhile :func:`all_gather_noticed` logs, every
``HFPATCH_WAIT_NOTICE_S`` seconds (default 30; ``0`` turns the notices off), on each rank still waiting, which
ranks of the group have not reached the call and which call it is.

How it knows, on plain torch.distributed: the collective runs as async work and the rank waits on it in slices
(``Work.wait(timeout)`` on gloo; polling ``Work.is_completed()`` on other backends, whose waits block the host
differently). A call that completes within :data:`GRACE_S` costs nothing more. A rank still waiting after
``GRACE_S`` posts the number of the call it waits in (its count of such calls over the group) to the default
group's store; at each notice the rank reads the others' posts, one ``GRACE_S`` after the notice time, so that
a rank not posted by then had not reached the call at the notice time (it would have posted within the grace).
The store is hosted by rank 0 or the launcher, outside any rank's Python thread, so a busy rank 0 answers.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["GRACE_S", "NOTICE_ENV", "all_gather_noticed", "notice_interval"]

logger = logging.getLogger(__name__)

#: The environment variable of the notice interval, in seconds (``0``: no notices).
NOTICE_ENV = "HFPATCH_WAIT_NOTICE_S"
#: A rank waiting longer than this posts that it waits (capped at a quarter of the interval).
GRACE_S = 1.0

# Group name -> how many noticed collectives this rank made over the group (the n-th meets the n-th).
_CALLS: dict[str, int] = {}


def notice_interval() -> float | None:
    """Seconds between two notices of a waiting rank: ``HFPATCH_WAIT_NOTICE_S`` (default 30; ``0``: None, off).

    >>> import os
    >>> os.environ.get("HFPATCH_WAIT_NOTICE_S") is not None or notice_interval() == 30.0
    True
    """
    text = os.environ.get(NOTICE_ENV, "30")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also rejects nan
        raise ValueError(f"{NOTICE_ENV} must be a number of seconds >= 0 (0: no notices), got {text!r}")
    return seconds or None


def _wait(work: Any, seconds: float, gloo: bool) -> bool:
    """Wait up to ``seconds`` for ``work``; True when it completed (its own error, if any, is raised)."""
    if gloo:
        try:
            work.wait(timedelta(seconds=max(seconds, 0.001)))
            return True
        except RuntimeError:
            if work.is_completed():  # the collective's own error (a peer failed or the group timed out)
                raise
            return False  # only this slice of the wait ended
    deadline = time.monotonic() + seconds
    pause = 0.0001
    while not work.is_completed():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.05)
    work.wait()  # orders the current stream after the collective (NCCL), raises its error
    return True


def _key(group: Any, rank: int) -> str:
    return f"hfpatch/waiting/{group.group_name}/{rank}"


def _missing(store: Any, group: Any, call: int) -> list[int]:
    """Global ranks of ``group`` that have not posted that they reached call number ``call``."""
    missing = []
    for rank in dist.get_process_group_ranks(group):
        key = _key(group, rank)
        if not store.check([key]) or int(store.get(key)) < call:
            missing.append(rank)
    return missing


def all_gather_noticed(gathered: list[Any], local: Any, group: Any, what: str) -> None:
    """``dist.all_gather(gathered, local, group=group)``, logging a notice every :func:`notice_interval`
    seconds while some ranks of ``group`` have not reached it (``what`` names the call in the notice).

    Errors are those of the collective (a peer failed, or the group's timeout passed); a store that cannot be
    reached only ends the notices.
    """
    interval = notice_interval()
    work = dist.all_gather(gathered, local, group=group, async_op=True)
    if interval is None:
        work.wait()
        return
    from .runtime import default_store, describe_group, group_timeout

    gloo = dist.get_backend(group) == "gloo"
    name = group.group_name
    _CALLS[name] = call = _CALLS.get(name, 0) + 1
    grace = min(GRACE_S, interval / 4)
    start = time.monotonic()
    if _wait(work, grace, gloo):
        return
    me = dist.get_rank()
    try:
        store = default_store()
        store.set(_key(group, me), str(call))
    except Exception:  # no store, or its host is gone: the collective reports the failure
        store = None
    notices = 0
    while True:
        notices += 1
        due = start + notices * interval + grace
        if _wait(work, due - time.monotonic(), gloo):
            return
        if store is None:
            continue
        try:
            missing = [r for r in _missing(store, group, call) if r != me]
        except Exception:
            store = None
            continue
        if not missing:  # every rank arrived since: the collective completes
            continue
        timeout = group_timeout(group)
        limit = f"HFPATCH_TIMEOUT_S={timeout.total_seconds():g}s" if timeout else "the group's timeout"
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        logger.warning(
            "hfpatch: rank %d has waited %g s in %s over the %s for %s, which %s not reached it. Every rank of "
            "the group must make each patched call: a call made on some ranks only (e.g. under `if rank == 0:`) "
            "waits here; run such a call under `with patch.disabled():` to compute it unpatched on its own. It "
            "raises CollectiveError after %s; this notice repeats every %g s (%s).",
            me,
            notices * interval,
            what,
            describe_group(group),
            who,
            "have" if len(missing) > 1 else "has",
            limit,
            interval,
            NOTICE_ENV,
        )
