"""Run a function on N local gloo ranks and collect each rank's result.

Built on ``torch.multiprocessing`` and ``torch.distributed``; no launcher of its own. A fresh rank costs seconds
(importing torch, diffusers and transformers: about 6 s of CPU each on a 2-core machine), so ranks are forked from
the standard library's forkserver, which imports them once (``PRELOAD``); :class:`RankPool` keeps N initialised
ranks alive and runs many functions on them; :func:`run_ranks` is the one-shot form.

Functions must be importable by the children (module-level functions of an importable module).

>>> from hfpatch.testing.runner import run_ranks
>>> import operator
>>> run_ranks(2, operator.add, 1, 2)
[3, 3]
"""

from __future__ import annotations

import gc
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

__all__ = ["RankError", "RankPool", "run_ranks", "spread"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Modules the forkserver imports once before it forks any rank (a module that fails to import is skipped by
#: the server and imported by each rank as it needs it).
PRELOAD = ("torch", "torch.distributed", "diffusers", "transformers", "accelerate", "peft", "hfpatch")


class RankError(RuntimeError):
    """A function raised on one or more ranks; carries the remote traceback of each failing rank."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        first = min(failures)
        super().__init__(
            f"rank{'s' if len(failures) > 1 else ''} {sorted(failures)} failed; rank {first}:\n{failures[first]}"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_start_method() -> str:
    # Where CUDA exists, the forkserver's preload asks torch.cuda for the device count (diffusers, accelerate and
    # transformers do at import), which marks every fork of it unable to use CUDA ("Cannot re-initialize CUDA in
    # forked subprocess", seen on an H200): ranks there are spawned.
    if torch.cuda.is_available():
        return "spawn"
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    threads: int,
    environ: dict[str, str],
    tasks: Any,
    results: Any,
) -> None:
    # The heap inherited from the forkserver (torch, diffusers, transformers: millions of objects) out of the
    # garbage collector's walks: each full collection would read and write every inherited object's header,
    # copying nearly every inherited page (copy-on-write). Measured on the 2-core machine, the whole suite: user
    # CPU 29.9 -> 26.9 min, system 10.8 -> 9.4 min. (Python's gc docs recommend freezing before fork; freezing
    # first thing after it, before any collection, keeps the same pages untouched.)
    gc.freeze()
    # A forked rank inherits the forkserver's environment, frozen when the server started: take the caller's,
    # as a spawned rank would.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        HFPATCH_TIMEOUT_S=str(timeout_s),
        # Libraries size their thread pools from it when it is unset: accelerate's PartialState on CPU
        # calls torch.set_num_threads(physical cores / LOCAL_WORLD_SIZE), i.e. all cores in every rank.
        OMP_NUM_THREADS=str(threads),
    )
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    torch.set_num_threads(threads)
    # tqdm's default write lock holds a multiprocessing semaphore that only a finalizer unlinks, which os._exit
    # below skips ("leaked semaphore objects" at the parent's exit); a rank's bars need a thread lock only.
    tqdm.set_lock(threading.RLock())
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        # Each task starts with the pool's thread count, whatever an earlier task (or a library it called) set:
        # results that a test expects bit-identical to its own process's depend on it (a reduction split over
        # threads sums in another order), and so does the speed of oversubscribed ranks.
        torch.set_num_threads(threads)
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    from hfpatch.distributed.liveness import stop_heartbeat

    stop_heartbeat()  # rank 0 hosts the store and may exit first
    dist.destroy_process_group()
    # Every result is in the parent already: skip the interpreter's teardown of a heap of models and modules
    # (about 10 s per pool on a 2-core machine).
    results.close()
    results.join_thread()
    os._exit(0)


class RankPool:
    """N spawned processes with an initialised gloo process group, reused across calls.

    Args:
        world_size: Number of ranks.
        timeout_s: Collective timeout inside the ranks and the longest a call may take.
        threads: torch intra-op threads per rank (1 avoids oversubscribing small CI machines), set again
            before every call: a call that changes it (accelerate's ``PartialState`` on CPU does) leaves no
            trace in the next.
        start_method: ``"forkserver"`` (the default where the platform has it and CUDA does not: ranks forked
            from a server that imported ``PRELOAD`` once) or ``"spawn"`` (each rank imports everything itself;
            the default where CUDA is available, since a fork of a process that queried CUDA cannot use it).

    After a failure or a timeout the ranks are torn down (a rank may be stuck in a collective) and the
    next :meth:`run` starts fresh ones.
    """

    def __init__(
        self, world_size: int, timeout_s: float = 120.0, threads: int = 1, start_method: str | None = None
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        method = start_method or _default_start_method()
        if method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.start_method = method
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.threads = threads
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Only the first call in a process takes effect (the server then runs until the process exits).
            ctx.set_forkserver_preload(list(PRELOAD))
        port = _free_port()
        environ = dict(os.environ)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    port,
                    self.timeout_s,
                    self.threads,
                    environ,
                    self._tasks[r],
                    self._results,
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(startup=True)

    def _collect(self, startup: bool = False) -> list[Any]:
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + self.timeout_s + (120 if startup else 0)
        while len(out) + len(failures) < self.world_size:
            if failures:
                # One rank failed: give the others a moment to report, then tear down (they may be blocked).
                deadline = min(deadline, time.monotonic() + 2.0)
            try:
                rank, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(self._procs)
                    if not p.is_alive() and r not in out and r not in failures
                ]
                for r in dead:
                    failures[r] = f"rank {r} exited with code {self._procs[r].exitcode} without reporting"
                if time.monotonic() > deadline:
                    self.close(force=True)
                    if failures:
                        raise RankError(failures) from None
                    missing = sorted(set(range(self.world_size)) - set(out))
                    raise TimeoutError(
                        f"ranks {missing} did not finish within {self.timeout_s:.0f}s"
                    ) from None
                continue
            if ok:
                out[rank] = value
            else:
                failures[rank] = value
        if failures:
            self.close(force=True)
            raise RankError(failures)
        return [out[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank.

        Raises:
            RankError: ``fn`` raised on some rank (its traceback is in the message).
            TimeoutError: No result within ``timeout_s``.
        """
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect()

    def close(self, force: bool = False) -> None:
        """Stop the ranks (politely, or by terminating them when ``force``)."""
        if not self._procs:
            return
        started = [p for p in self._procs if p.pid is not None]  # a failed start leaves some unstarted
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in started:
                p.join(timeout=10)
        for p in started:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs, self._tasks, self._results = [], [], None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Spawn ``world_size`` gloo ranks, run ``fn(*args, **kwargs)`` on each, return the results by rank.

    Raises:
        RankError: ``fn`` raised on some rank; the error names the rank and carries its traceback. The
            other ranks are terminated, so a failure never leaves the caller hanging.
    """
    with RankPool(world_size, timeout_s=timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)


def spread(keys: Sequence[K], compute: Callable[[K], V], group: Any = None) -> dict[K, V]:
    """Inside a rank: ``{key: compute(key)}`` for every key, each computed on ONE rank and shared with all.

    For values every rank needs that involve no collective, such as the unpatched model's outputs a test compares
    with: keys are dealt round-robin (in the order given, duplicates dropped), each rank computes its own, and
    ``all_gather_object`` shares them, so the group does the work once instead of once per rank (on a 2-core machine
    running 4 ranks, a quarter of it). ``compute`` must be deterministic across processes (seeded models, one
    thread), which is what makes a value computed on another rank the one this rank would have computed.
    """
    import torch.distributed as dist

    unique = list(dict.fromkeys(keys))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = {key: compute(key) for index, key in enumerate(unique) if index % world == rank}
    parts: list[dict[K, V] | None] = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    shared = {key: value for part in parts for key, value in part.items()}
    return {key: shared[key] for key in unique}  # in the order given
