"""Which ranks are gone: a heartbeat each rank posts to the default group's store, read when a collective fails.

When a peer's process or its whole node is lost mid-call, gloo and NCCL tell the survivors only that a connection
closed or that the timeout passed. To name the lost ranks, each rank that builds hfpatch's groups starts a daemon
thread that bumps its counter in the default group's store (hosted by rank 0 or torchrun's agent) every
:data:`BEAT_S` seconds, through a connection of its own (a rank blocked in a collective or in a long
``store.wait`` still beats: the thread runs beside it). A rank about to raise
:class:`~hfpatch.distributed.runtime.CollectiveError` for a peer failure reads every rank's counter twice,
:data:`WINDOW_S` apart: a counter that did not move belongs to a rank whose process is gone (in the failed group, or
elsewhere in the job: a live peer of this group may be stuck on it in another group).

>>> silent_ranks(None, None) is None  # no process group: nothing to say
True
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["BEAT_S", "WINDOW_S", "ensure_heartbeat", "silent_ranks", "stop_heartbeat"]

#: Seconds between two beats of a rank.
BEAT_S = 0.5
#: Seconds between the two reads of the counters: several beats, so a rank descheduled for a moment still moves.
WINDOW_S = 2.5
_KEY = "hfpatch/heartbeat/{}"
# The store whose heartbeat this process runs (one per default group; a new group starts a new one).
_BEATING: dict[str, Any] = {}


def _beat(store: Any, key: str, stop: threading.Event, world: int) -> None:
    while not stop.is_set():
        if not (dist.is_initialized() and id(dist.group.WORLD) == world):
            return  # the group was destroyed here: its store may be gone (a beat would only log its failure)
        try:
            store.add(key, 1)
        except Exception:  # the store's host is gone, or the group was destroyed: nothing left to say
            return
        stop.wait(BEAT_S)


def ensure_heartbeat(store: Any) -> None:
    """Start this rank's heartbeat in the default group's ``store`` (once per group; a no-op without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    name = id(dist.group.WORLD)  # a new default group (destroy, then init again) gets a heartbeat of its own
    if _BEATING.get("group") == name and _BEATING["thread"].is_alive():
        return
    previous = _BEATING.get("stop")
    if previous is not None:
        previous.set()
    key = _KEY.format(dist.get_rank())
    try:
        own = store.clone()  # its own connection: a blocking wait of the main thread does not hold it up
        own.add(key, 1)  # the first beat before any collective, so a rank lost at once is seen
    except Exception:  # the store is already gone: the collectives that follow report it
        return
    stop = threading.Event()
    thread = threading.Thread(
        target=_beat, args=(own, key, stop, name), name="hfpatch-heartbeat", daemon=True
    )
    thread.start()
    _BEATING.update(group=name, stop=stop, thread=thread)


def stop_heartbeat() -> None:
    """Stop this rank's heartbeat (before ``destroy_process_group`` when rank 0 hosts the store and may exit
    first: a beat that finds the store gone makes torch log the failure)."""
    stop = _BEATING.pop("stop", None)
    if stop is not None:
        stop.set()
        _BEATING.pop("thread").join(timeout=2 * BEAT_S)
    _BEATING.pop("group", None)


def silent_ranks(group: Any, store: Any, window_s: float = WINDOW_S) -> list[int] | None:
    """Global ranks of ``group`` (the default group when ``None`` and one exists) whose heartbeat in the default
    group's ``store`` did not move in ``window_s`` seconds: their processes are gone. ``None`` when it cannot tell
    (no heartbeat here, or the store cannot be reached: its host, rank 0 or the launcher's agent, is gone too)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _BEATING.get("group") != id(dist.group.WORLD) or not _BEATING["thread"].is_alive():
        return None  # this rank does not beat in this group: the others may not either
    try:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        probe = store.clone()
        probe.set_timeout(timedelta(seconds=max(window_s, 1.0)))
        me = dist.get_rank()
        before = {r: probe.add(_KEY.format(r), 0) for r in ranks if r != me}
        time.sleep(window_s)
        after = {r: probe.add(_KEY.format(r), 0) for r in before}
    except Exception:
        return None
    return [r for r in before if after[r] == before[r]]
