"""Bounded waits: a rank that raises, exits or stalls makes every other rank raise hfpatch's ``CollectiveError``
within ``HFPATCH_TIMEOUT_S`` plus a margin, whoever initialised the process group, and ``patch.remove()``
afterwards restores the unpatched model exactly. ``hfpatch.apply`` on some ranks only raises a clear error on
the ranks that called it, within the timeout.

Scenarios (every combination): a rank that raises inside a transformer block and stays alive, one that exits
there (``os._exit``), one that sleeps there for longer than the timeout; at world 2 (``ulysses=2``), at world 4
with ``ParallelConfig(ring=2, ulysses=2)`` (a Wan transformer: all-to-all and ring P2P) and with a ``WanPipeline``
under ``ParallelConfig(cfg=2, ulysses=2)``; with the default process group initialised by hfpatch (a torchrun
environment, no init in user code) and by user code (``init_process_group("gloo")`` with torch's default
30-minute timeout, which hfpatch must leave as it is). Plus ``apply`` on some ranks only, both ways: rank 1
absent, and rank 0 absent (it hosts the store the others connect to first).

Each scenario runs in fresh processes (a gloo group that timed out cannot be used again), forked from one
forkserver that imported torch/diffusers/hfpatch and built the tiny models and their unpatched outputs once,
so a rank starts in well under a second; all scenarios run at once and the module takes about one timeout
plus start-up. That forkserver belongs to a helper process spawned for this module: a process has one
forkserver, and the suite's rank pools (:class:`hfpatch.testing.runner.RankPool`) already run theirs, which
preloads the libraries but not these models.

Timing: every surviving rank measures from the start of the call that fails (the forward, the pipeline call or
``apply``) to the moment it catches the error, and must raise within ``TIMEOUT_S + MARGIN_S`` = 10 s + 15 s.
The margin covers, on a loaded 2-core machine running ~60 rank processes at once: the compute before the
failing collective (the faulty rank may be descheduled for seconds before it reaches the fault), a rank blocked
in a later collective on a peer that is itself blocked, gloo's multi-step collectives (each step waits at most
the timeout, so a peer that arrives late and then stalls can cost up to twice the timeout) and scheduling noise.
A rank that raises or sleeps makes its peers raise by the timeout (some survivor's backend error is a timeout,
and none raises before ``0.5 * TIMEOUT_S``: a survivor freed by another survivor's timeout may have started its
call a little later); a rank that exits makes its direct peers raise at once (closed
connection) and the others by the timeout. Measured on the 2-core machine (printed by the fixture with ``-s``):
10.0-10.4 s for every timeout path, 0.1-0.3 s for the direct peers of an exited rank; ``apply`` on some ranks
only raises within ``TIMEOUT_S + APPLY_MARGIN_S`` (5 s): 10.7-10.8 s with a user-initialised group (handshake),
11.5-12.4 s with hfpatch initialising it (rank 0 absent: the other ranks poll its port, bounded, before torch's
store client connects; rank 1 absent: rank 0's store waits the timeout for it). Before issue 33 the rank-0-absent
case took about three timeouts (torch's store client retries a refused connection with the whole timeout per
try). On the CI machine, with the ranks of all 22 scenarios started at once, the same paths took 14.7-16.4 s
(they waited the timeout, then got the CPU late), so these 4 scenarios run in a batch of their own after the
others. All 22 scenarios in ~40 s of wall time, and ~12 s more for the second batch.

What hfpatch cannot bound: the faulty rank itself. A rank that sleeps or loops in local computation cannot be
interrupted from outside; its peers raise, and it raises ``CollectiveError`` at its next collective (the peers'
connections are closed by then, or it times out). Here the sleeping rank is terminated once the others reported.
In the CFG pipeline, a rank whose transformer call raised does not raise its own error at once: the CFG wrapper
defers it to the uncond call (so that its cfg peer, which returned from the cond call without communicating,
is not left waiting), whose same-input check times out while the cond call's Ulysses peer still waits for
this rank; the rank then raises its own deferred error, with the ``CollectiveError`` as its context.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from functools import cache
from typing import Any

import pytest
import torch
from pipe_helpers import wan_pipe_call

from hfpatch.testing.runner import RankPool

TIMEOUT_S = 10.0
MARGIN_S = 15.0
SLEEP_S = 6 * TIMEOUT_S  # the stalled rank: far longer than the timeout (terminated after the others report)
FAULTY_RANK = 1  # not rank 0, which hosts the TCPStore
_WARM_ENV = "_HFPATCH_FAULTS_FORKSERVER"  # set while the forkserver starts: it builds the models at import

TOPOLOGIES = {
    "world2_ulysses2": (2, dict(ulysses=2)),
    "world4_ring2_ulysses2": (4, dict(ring=2, ulysses=2)),
    "world4_cfg2_ulysses2_pipeline": (4, dict(cfg=2, ulysses=2)),
}
FAULTS = ("raise", "exit", "sleep")
PROCESS_GROUPS = ("hfpatch", "user")
#: ``apply`` on some ranks only: the rank that never calls it. Rank 0 hosts the store hfpatch's process group
#: meets at (``MASTER_PORT``), so its absence is a case of its own (issue 33: torch's store client retries a
#: refused connection with the whole timeout per try, 42 s for a 15 s timeout).
ABSENT = {"apply_on_rank0_only": FAULTY_RANK, "apply_without_rank0": 0}
#: ``apply`` on some ranks only raises within the timeout plus this (it waits, it computes nothing).
APPLY_MARGIN_S = 5.0
SCENARIOS = [(t, f, g) for t in TOPOLOGIES for f in FAULTS for g in PROCESS_GROUPS] + [
    ("world2_ulysses2", fault, g) for fault in ABSENT for g in PROCESS_GROUPS
]


def _scenario_id(scenario: tuple[str, str, str]) -> str:
    return "-".join(scenario)


# ----------------------------------------------------------------------------------------------- models
def _transformer_call(model: Any) -> torch.Tensor:
    from hfpatch.testing import wan_prompt_embeds

    x = torch.randn(1, 4, 2, 8, 8, generator=torch.Generator().manual_seed(3))  # 32 tokens: 8 per rank
    with torch.no_grad():
        return model(x, torch.tensor([500]), wan_prompt_embeds(1, 6)).sample


def _objects(target: Any) -> dict[str, Any]:
    """Every object a patch may touch: the target's modules (a pipeline's components' modules too)."""
    if isinstance(target, torch.nn.Module):
        return dict(target.named_modules())
    out: dict[str, Any] = {"<pipeline>": target}
    for name, component in target.components.items():
        if isinstance(component, torch.nn.Module):
            out.update({f"{name}.{n}": m for n, m in component.named_modules()})
    return out


def _snapshot(target: Any) -> dict[tuple, Any]:
    """The objects held in every ``vars()`` (processors, forwards, hooks...), and in the dicts among them."""
    snap: dict[tuple, Any] = {}
    for name, obj in _objects(target).items():
        for key, value in vars(obj).items():
            snap[(name, key)] = value
            if isinstance(value, dict):
                for inner, item in value.items():
                    snap[(name, key, inner)] = item
    return snap


def _differences(before: dict[tuple, Any], after: dict[tuple, Any], volatile: set[tuple]) -> list[str]:
    keys = (before.keys() | after.keys()) - volatile
    return sorted(str(k) for k in keys if k not in before or k not in after or before[k] is not after[k])


def _changed(before: dict[tuple, Any], after: dict[tuple, Any]) -> set[tuple]:
    return {k for k in before.keys() | after.keys() if before.get(k, before) is not after.get(k, after)}


@cache
def _models() -> dict[str, tuple[Any, Any, torch.Tensor, set[tuple]]]:
    """Per topology: (target, call, unpatched output, keys an unpatched call itself changes).

    The changing keys: what differs between two unpatched calls (per-call caches of modules), and on a
    pipeline object the state its ``__call__`` sets (a failed call leaves other values there).
    """
    from hfpatch.testing import tiny_wan_pipe, tiny_wan_transformer

    torch.set_num_threads(1)
    out = {}
    for topology in TOPOLOGIES:
        pipeline = topology.endswith("pipeline")
        target = tiny_wan_pipe() if pipeline else tiny_wan_transformer()
        call = wan_pipe_call if pipeline else _transformer_call
        fresh = _snapshot(target)
        reference = call(target)
        first = _snapshot(target)
        assert torch.equal(call(target), reference)  # deterministic: the check after remove() can be exact
        volatile = _changed(first, _snapshot(target)) | {
            k for k in _changed(fresh, first) if k[0] == "<pipeline>"
        }
        out[topology] = (target, call, reference, volatile)
    return out


if os.environ.get(_WARM_ENV) == "1":  # imported by the forkserver: build everything once for all ranks
    import gc

    _models()
    gc.freeze()  # the children's garbage collections skip (and so do not copy) everything built so far


# ----------------------------------------------------------------------------------------------- one rank
def _blocks(target: Any) -> Any:
    return target.blocks if isinstance(target, torch.nn.Module) else target.transformer.blocks


def _fault_hook(fault: str, rank: int):
    def hook(_module: Any, _args: Any) -> None:
        if fault == "raise":
            raise RuntimeError(f"injected failure on rank {rank}")
        if fault == "exit":
            os._exit(17)
        if fault == "sleep":
            time.sleep(SLEEP_S)
            # Woken after the test's window (the peers reported long ago; a busy machine can take longer than
            # SLEEP_S to run every scenario): a hung rank has nothing to report, so it leaves without a word.
            os._exit(18)

    return hook


def _user_timeout_s() -> float | None:
    """The timeout of the default (user's) gloo group, read back from its backend."""
    import torch.distributed as dist

    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except Exception:
        return None


def _rank_main(scenario: tuple[str, str, str], rank: int, port: int, results: Any, release: Any) -> None:
    topology, fault, pg = scenario
    world, degrees = TOPOLOGIES[topology]
    os.environ.update(
        HFPATCH_TIMEOUT_S=str(TIMEOUT_S),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    report: dict[str, Any] = {"rank": rank, "faulty": rank == ABSENT.get(fault, FAULTY_RANK)}
    entered = time.monotonic()
    try:
        import torch.distributed as dist

        import hfpatch
        from hfpatch.distributed.runtime import CollectiveError

        torch.set_num_threads(1)
        target, call, reference, volatile = _models()[topology]
        if pg == "user":
            dist.init_process_group("gloo", rank=rank, world_size=world)  # torch's default timeout
        before = _snapshot(target)
        patch = None
        start = time.monotonic()
        try:
            if fault in ABSENT:
                if rank == ABSENT[fault]:  # takes no part: only waits to be released
                    _report_and_wait(results, (scenario, rank, report | {"error_type": None}), release)
                patch = hfpatch.apply(target, parallel=hfpatch.ParallelConfig(**degrees))
                call(target)
            else:
                patch = hfpatch.apply(target, parallel=hfpatch.ParallelConfig(**degrees))
                report["user_timeout_s"] = _user_timeout_s() if pg == "user" else None
                handle = None
                if rank == FAULTY_RANK:
                    handle = _blocks(target)[1].register_forward_pre_hook(_fault_hook(fault, rank))
                start = time.monotonic()
                report["setup_s"] = start - entered
                try:
                    call(target)
                finally:
                    if handle is not None:
                        handle.remove()
            report["error_type"] = None
        except Exception as exc:
            report.update(
                elapsed=time.monotonic() - start,
                error_type=type(exc).__name__,
                collective_error=isinstance(exc, CollectiveError),
                message=str(exc),
                cause=repr(exc.__cause__),
            )
        if patch is not None:
            patch.remove()
        report["differences"] = _differences(before, _snapshot(target), volatile)
        report["same_output"] = bool(torch.equal(call(target), reference))  # unpatched, local again
    except BaseException:
        report["crash"] = traceback.format_exc()
    _report_and_wait(results, (scenario, rank, report), release)


def _report_and_wait(results: Any, item: tuple, release: Any) -> None:
    """Send ``item``, stay alive (and connected) until every rank of the scenario reported, then exit."""
    results.put(item)
    results.close()
    results.join_thread()  # the report is written and the queue's lock released before this process can exit
    release.wait(4 * SLEEP_S)
    os._exit(0)


# ----------------------------------------------------------------------------------------------- driver
def _expected_reporters(scenario: tuple[str, str, str]) -> set[int]:
    world = TOPOLOGIES[scenario[0]][0]
    ranks = set(range(world))
    return ranks - {FAULTY_RANK} if scenario[1] in ("exit", "sleep") else ranks


def _forkserver_context() -> Any:
    """The forkserver context; the server (started here unless it runs already) preloads the heavy part once.

    The server imports this module by name (Python 3.11's forkserver ignores the parent's ``sys.path``, hence
    ``PYTHONPATH``) with the warm-up switch set, so it builds the models before it forks any rank.
    """
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "hfpatch", __name__])
    here = os.path.dirname(os.path.abspath(__file__))
    saved = {k: os.environ.get(k) for k in (_WARM_ENV, "PYTHONPATH")}
    os.environ[_WARM_ENV] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(  # this folder, and tests/ for pipe_helpers
        [here, os.path.dirname(here), *([saved["PYTHONPATH"]] if saved["PYTHONPATH"] else [])]
    )
    try:
        forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return ctx


def _master_ports(count: int) -> list[int]:
    """``count`` free ports below the ephemeral range, which gloo's and the stores' own sockets draw from (a
    port taken from that range may be grabbed by one of them before this scenario's rank 0 listens on it)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:
        low = 32768
    candidates = list(range(max(1024, low - 12000), low))
    random.Random(os.getpid()).shuffle(candidates)
    ports: list[int] = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free ports below {low}")


def _run_all(scenarios: list[tuple[str, str, str]]) -> tuple[dict[tuple, dict[int, dict]], str]:
    ctx = _forkserver_context()
    results = ctx.Queue()
    ports = _master_ports(len(scenarios))
    procs: dict[tuple, list[Any]] = {}
    releases = {}
    for scenario, port in zip(scenarios, ports):
        releases[scenario] = ctx.Event()
        procs[scenario] = [
            ctx.Process(target=_rank_main, args=(scenario, r, port, results, releases[scenario]), daemon=True)
            for r in range(TOPOLOGIES[scenario[0]][0])
        ]
    started = time.monotonic()
    for ps in procs.values():
        for p in ps:
            p.start()
    reports: dict[tuple, dict[int, dict]] = {s: {} for s in scenarios}
    pending = set(scenarios)
    deadline = time.monotonic() + 240
    try:
        while pending and time.monotonic() < deadline:
            try:
                scenario, rank, report = results.get(timeout=1.0)
            except Exception:  # queue.Empty: drop scenarios whose ranks all died without reporting
                pending -= {sc for sc in pending if not any(p.is_alive() for p in procs[sc])}
                continue
            reports[scenario][rank] = report
            if _expected_reporters(scenario) <= reports[scenario].keys():
                pending.discard(scenario)
                releases[scenario].set()
    finally:
        for scenario in scenarios:
            releases[scenario].set()
        grace = time.monotonic() + 3.0
        everyone = [p for ps in procs.values() for p in ps]
        for p in everyone:
            p.join(timeout=max(0.0, grace - time.monotonic()))
        for p in everyone:
            if p.is_alive():  # the sleeping ranks
                p.terminate()
                p.join(timeout=5)
    lines = [
        f"all {len(scenarios)} scenarios done in {time.monotonic() - started:.1f}s (timeout {TIMEOUT_S:g}s)"
    ]
    for scenario in scenarios:
        times = {
            r: f"{rep['error_type']} after {rep['elapsed']:.1f}s (setup {rep.get('setup_s', 0):.1f}s)"
            for r, rep in sorted(reports[scenario].items())
            if "elapsed" in rep
        }
        lines.append(f"  {_scenario_id(scenario)}: {times}")
    return reports, "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def late_rank_at_the_default_interval() -> Iterator[Future]:
    """The 33 s case of the late-rank test (the default 30 s notice interval) on a pool of its own, started with the
    module: its ranks only wait, so the wait overlaps the fault scenarios' (which wait for their timeouts)."""
    pool = RankPool(2, timeout_s=300)
    with ThreadPoolExecutor(1) as runner:
        future = runner.submit(pool.run, _late_rank_case, None, 33.0)
        try:
            yield future
        finally:
            future.exception(timeout=400)  # done (its test reads it), or failed: the pool closes either way
            pool.close()


@pytest.fixture(scope="module")
def fault_reports() -> dict[tuple, dict[int, dict]]:
    if sys.platform != "linux":
        pytest.skip("forkserver ranks: Linux only")
    # ``apply`` on some ranks only is timed against a tighter bound (the timeout + APPLY_MARGIN_S): its ranks run
    # in a batch of their own, after the 18 collective faults (54 processes) whose load delayed them by 6 s on CI.
    absent = [s for s in SCENARIOS if s[1] in ABSENT]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as helper:
        (reports, summary), (absent_reports, absent_summary) = helper.map(
            _run_all, [[s for s in SCENARIOS if s not in absent], absent]
        )
    print(summary, absent_summary, sep="\n")
    return reports | absent_reports


# ----------------------------------------------------------------------------------------------- checks
@pytest.mark.parametrize("scenario", SCENARIOS, ids=_scenario_id)
def test_every_other_rank_raises_within_the_timeout(fault_reports, scenario):
    topology, fault, pg = scenario
    reports = fault_reports[scenario]
    assert _expected_reporters(scenario) <= reports.keys(), f"ranks reported: {sorted(reports)}"
    for rank, report in reports.items():
        assert "crash" not in report, report["crash"]
        if report["faulty"]:
            if fault in ABSENT:
                assert report["error_type"] is None
            elif topology.endswith("pipeline"):
                # The CFG wrapper defers a cond-call error on cfg rank 0 to the uncond call, whose same-input
                # check (over every rank) times out while the cond call's Ulysses peer still waits for this
                # rank: the faulty rank raises its own error then (within the timeout), not hfpatch's.
                assert report["error_type"] == "RuntimeError" and "injected failure" in report["message"], (
                    report
                )
                assert report["elapsed"] <= TIMEOUT_S + MARGIN_S, report
            else:  # its own error, not hfpatch's
                assert report["error_type"] == "RuntimeError" and "injected failure" in report["message"], (
                    report
                )
            continue
        where = f"rank {rank}: {report.get('message')}"
        assert report["collective_error"], where
        message = report["message"]
        assert report["elapsed"] <= TIMEOUT_S + MARGIN_S, where
        if fault in ("raise", "sleep", *ABSENT):
            assert report["elapsed"] >= 0.5 * TIMEOUT_S, where  # ended by the timeout, not by another error
        if fault in ABSENT:
            assert report["elapsed"] <= TIMEOUT_S + APPLY_MARGIN_S, where
            assert f"HFPATCH_TIMEOUT_S={TIMEOUT_S:g}s" in message, where
            if pg == "user":  # the handshake names the missing rank
                assert "hfpatch.apply handshake" in message and f"ranks [{ABSENT[fault]}]" in message, where
            else:  # hfpatch initialises the process group: rank 1 never joins
                assert "could not initialise the default process group" in message, where
        else:
            assert "group of global ranks" in message, where  # names the axis group it was waiting in
            assert f"HFPATCH_TIMEOUT_S={TIMEOUT_S:g}s" in message, where
        if pg == "user" and fault not in ABSENT:
            assert report["user_timeout_s"] == 1800.0  # the user's default group keeps its own timeout
        # Issue 48: the heartbeat names a rank whose process is gone, and only such a rank.
        named = re.findall(
            r"Ranks? ([\d, ]+) of the (?:group|job, outside this group,) shows? no heartbeat", message
        )
        assert named in ([], [str(FAULTY_RANK)]) and (not named or fault == "exit"), where
    if fault == "exit":  # some survivor failed in a group with the exited rank and named it
        assert any(
            f"Rank {FAULTY_RANK} of the group shows no heartbeat" in r.get("message", "")
            for r in reports.values()
        )
    if fault in ("raise", "sleep", *ABSENT):
        # Some rank's wait ended by the timeout (the others may then see its closed connections).
        causes = [r.get("cause", "").lower() for r in reports.values()]
        assert any("timed out" in c or "timeout" in c for c in causes), causes


@pytest.mark.parametrize("scenario", SCENARIOS, ids=_scenario_id)
def test_remove_after_the_error_restores_the_unpatched_model(fault_reports, scenario):
    for rank, report in fault_reports[scenario].items():
        if "differences" not in report:  # the absent rank of apply_on_rank0_only
            continue
        assert report["differences"] == [], (rank, report["differences"][:10])
        assert report["same_output"], rank


# ----------------------------------------------------------------------------------------------- pieces
def _group_timeouts() -> dict[str, Any]:
    import torch.distributed as dist

    from hfpatch import ParallelConfig
    from hfpatch.distributed import runtime

    def timeout_s(group: Any) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    saved = os.environ["HFPATCH_TIMEOUT_S"]
    os.environ["HFPATCH_TIMEOUT_S"] = "123"  # differs from the pool's default group (its HFPATCH_TIMEOUT_S)
    try:
        ring = runtime.get_mesh(ParallelConfig(ring=2))
        ulysses = runtime.get_mesh(ParallelConfig(ulysses=2))  # spans the world: still a group of hfpatch's
    finally:
        os.environ["HFPATCH_TIMEOUT_S"] = saved
    return {
        **{axis: timeout_s(ring.group(axis)) for axis in ("ring", "sp", "vae", "world")},
        "ulysses": timeout_s(ulysses.group("ulysses")),
        "default": timeout_s(dist.group.WORLD),
        "uses_default": any(
            g is dist.group.WORLD for m in (ring, ulysses) for g in m.groups.values() if g is not None
        ),
        "ring_named": runtime.describe_group(ring.group("ring")),
        "world_named": runtime.describe_group(ring.group("world")),
    }


def test_every_mesh_group_carries_the_timeout_and_the_default_group_keeps_its_own(rank_pool):
    for result in rank_pool(2).run(_group_timeouts):
        assert {k: result[k] for k in ("ring", "sp", "vae", "world", "ulysses")} == dict.fromkeys(
            ("ring", "sp", "vae", "world", "ulysses"), 123.0
        )
        assert result["default"] == 300.0 and not result["uses_default"]  # the pool's own timeout, untouched
        assert result["ring_named"] == "ring group of global ranks [0, 1]"
        assert result["world_named"] == "hfpatch world group of global ranks [0, 1]"


def test_peer_failures_are_told_from_other_errors():
    from hfpatch.distributed.runtime import CollectiveError, is_peer_failure

    gloo = "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation to complete"
    for text in (
        gloo,
        "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500",
        "Read error [127.0.0.1]:4721: Connection reset by peer",
        "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?",
        "NCCL communicator was aborted on rank 1.",
    ):
        assert is_peer_failure(RuntimeError(text)), text
    for exc in (
        RuntimeError("Tensors must be contiguous"),
        RuntimeError(
            "The server socket has failed to listen ... EADDRINUSE, message: address already in use"
        ),
        ValueError("Timed out"),  # not raised by a backend
        CollectiveError("x", op="all_to_all", group="g", timeout=None),  # already explained
    ):
        assert not is_peer_failure(exc), exc
    import pickle
    from datetime import timedelta

    error = pickle.loads(
        pickle.dumps(CollectiveError("m", op="all_to_all", group="g", timeout=timedelta(seconds=3)))
    )
    assert (str(error), error.op, error.group, error.timeout) == (
        "m",
        "all_to_all",
        "g",
        timedelta(seconds=3),
    )


# ----------------------------------------------------------------------------------------------- notices
def _late_rank_case(interval: str | None, late_s: float) -> dict[str, Any]:
    """Rank 0 makes a patched call while rank 1 is elsewhere for ``late_s`` (then makes it too): the notices
    each rank logged, with their time from the start of its call, and whether the call then ran right."""
    import logging

    import torch.distributed as dist

    import hfpatch
    from hfpatch.testing import tiny_wan_transformer

    saved = os.environ.pop("HFPATCH_WAIT_NOTICE_S", None)
    if interval is not None:
        os.environ["HFPATCH_WAIT_NOTICE_S"] = interval
    notices: list[tuple[float, str]] = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append((time.monotonic(), record.getMessage()))
    logger = logging.getLogger("hfpatch.distributed.waiting")
    logger.addHandler(handler)
    try:
        model = tiny_wan_transformer()
        reference = _transformer_call(model)
        with hfpatch.apply(model, parallel=hfpatch.ParallelConfig(ulysses=2)):
            dist.barrier()
            if dist.get_rank() == 1:
                time.sleep(late_s)  # waiting elsewhere (data loading, a barrier of its own)
            start = time.monotonic()
            out = _transformer_call(model)
    finally:
        logger.removeHandler(handler)
        os.environ.pop("HFPATCH_WAIT_NOTICE_S", None)
        if saved is not None:
            os.environ["HFPATCH_WAIT_NOTICE_S"] = saved
    return {
        "notices": [(t - start, message) for t, message in notices],
        "max abs diff": (out - reference).abs().max().item(),
    }


def test_a_call_waiting_for_a_late_rank_says_which_rank_and_which_call(
    rank_pool, late_rank_at_the_default_interval
):
    """Issue 45: a patched call made on rank 0 while rank 1 is elsewhere waited HFPATCH_TIMEOUT_S in silence.

    Now the waiting rank logs a notice every HFPATCH_WAIT_NOTICE_S (here 1 s; rank 1 is 3.2 s late) naming the
    missing rank, the call and the group; the late rank, which waits for nobody, logs none. At the default
    interval (30 s; rank 1 is 33 s late) the first notice comes within 35 s of the call, and only one.
    A notice is due one grace (a quarter of the interval, at most 1 s) after each multiple of the interval:
    at 1.25 s and 2.25 s here, 31 s by default; the bounds leave seconds for a loaded machine.
    """
    cases = {
        "1": lambda: rank_pool(2).run(_late_rank_case, "1", 3.2),
        None: late_rank_at_the_default_interval.result,
    }
    for interval, expected, first_by in (("1", 2, 3.0), (None, 1, 35.0)):
        rank0, rank1 = cases[interval]()
        assert rank1["notices"] == [], rank1["notices"]
        notices = rank0["notices"]
        assert len(notices) >= expected, (interval, notices)
        assert notices[0][0] <= first_by, (interval, notices)
        for _, message in notices:
            assert message.startswith("hfpatch: rank 0 has waited"), message
            assert "for rank 1, which has not reached it" in message, message
            assert "the same-input check of WanTransformer3DModel.forward" in message, message
            assert "ulysses group of global ranks [0, 1]" in message, message
            assert "HFPATCH_TIMEOUT_S=300s" in message and "HFPATCH_WAIT_NOTICE_S" in message, message
        if interval is None:
            assert len(notices) == 1 and notices[0][0] >= 30.0, notices  # not before the interval
        # The call then computes with every rank, as when no rank is late (Ulysses vs one process).
        assert rank0["max abs diff"] < 1e-5 and rank1["max abs diff"] < 1e-5, (rank0, rank1)
