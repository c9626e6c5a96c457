"""Process-group setup and the parallel mesh, on plain torch.distributed.

hfpatch never starts processes: under ``torchrun`` (or accelerate's launchers) it initialises the default
process group from the environment the launcher set (NCCL on CUDA, gloo on CPU); otherwise it explains how
to launch. Each axis of a plan gets its own process groups (:func:`axis_group`, reused by every plan that splits the
ranks the same way along that axis), wrapped in a :class:`torch.distributed.device_mesh.DeviceMesh`.

Bounded waits: every process group hfpatch communicates over is its own, created with
:func:`default_timeout` (``HFPATCH_TIMEOUT_S``), whoever initialised the default group (hfpatch from the
launcher's environment, the user's script or accelerate, whose default groups keep their own timeout and
are never used or changed by hfpatch). A rank that fails, exits or stalls therefore makes the others fail
within the timeout instead of torch's 30 minutes, and :class:`CollectiveError` says which collective over
which group failed. :func:`exchange` is the bounded rank-to-rank handshake ``hfpatch.apply`` runs over the
default group's store before creating any group.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.config import ParallelConfig
from ..core.ranks import LAUNCH_VARS as _LAUNCH_VARS
from ..core.ranks import launched_world_size, rank, world_size

__all__ = [
    "AXES",
    "CollectiveError",
    "ParallelMesh",
    "axis_group",
    "axis_ranks",
    "check_launch_agrees",
    "collective_error",
    "default_timeout",
    "describe_group",
    "ensure_process_group",
    "exchange",
    "get_mesh",
    "is_peer_failure",
    "launched_world_size",
    "rank",
    "wait_timeout",
    "world_size",
]

#: Mesh axes, outermost first. Ulysses is innermost so its all-to-alls stay within a node; PipeFusion's
#: point-to-point hand-offs (one patch of hidden states per stage boundary) sit between CFG and sequence parallel.
AXES = ("data", "cfg", "pipefusion", "ring", "ulysses")


def default_timeout() -> timedelta:
    """Collective timeout: ``HFPATCH_TIMEOUT_S`` seconds (default 600), so a failed rank cannot hang the rest."""
    text = os.environ.get("HFPATCH_TIMEOUT_S", "600")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:  # also rejects nan
        raise ValueError(f"HFPATCH_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return timedelta(seconds=seconds)


def _seconds(timeout: timedelta) -> str:
    return f"{timeout.total_seconds():g}"


# ----------------------------------------------------------------------------------------------- errors
class CollectiveError(RuntimeError):
    """A collective (or the handshake, or group creation) failed because another rank did not take part.

    Raised on the ranks that were left waiting: a peer raised, exited, or is slower than
    ``HFPATCH_TIMEOUT_S``. The message names the operation, the group and its timeout; the backend's own
    error is chained as ``__cause__``. The rank that failed first raises its own error, not this one.

    Attributes:
        op: What was running (``"all_to_all"``, ``"ring send/recv"``, ``"hfpatch.apply handshake"``, ...).
        group: The group in words (``"ulysses group of global ranks [0, 1]"``).
        timeout: The group's timeout.
    """

    def __init__(self, message: str, *, op: str = "", group: str = "", timeout: timedelta | None = None):
        super().__init__(message)
        self.op = op
        self.group = group
        self.timeout = timeout

    def __reduce__(self) -> tuple:  # picklable with its attributes (launchers ship errors between processes)
        return type(self), (str(self),), dict(self.__dict__)


# Error texts of gloo, NCCL and the c10d store when a peer is gone or late (the exception types vary with the
# backend and the torch version: RuntimeError, DistBackendError, DistNetworkError, DistStoreError).
_PEER_FAILURE = re.compile(
    r"timed out|timeout|connection (closed|reset|refused|was)|closed by peer|reset by peer|broken pipe|"
    r"failed to recv|remote (worker|server|process)|communicator was aborted|watchdog",
    re.IGNORECASE,
)


# ... and local causes that look alike (a store that cannot listen on MASTER_PORT): torch's error says it.
_LOCAL_FAILURE = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by a collective, a store or group creation) means another rank is gone or late."""
    if isinstance(exc, CollectiveError) or _LOCAL_FAILURE.search(str(exc)):
        return False  # already explained, or this rank's own problem
    store_or_network = tuple(
        getattr(dist, name) for name in ("DistStoreError", "DistNetworkError") if hasattr(dist, name)
    )
    if store_or_network and isinstance(exc, store_or_network):
        return True
    return isinstance(exc, RuntimeError) and bool(_PEER_FAILURE.search(str(exc)))


# Group name -> (description, timeout) of every group hfpatch created, for the error messages.
_GROUPS: dict[str, tuple[str, timedelta]] = {}


def register_group(group: Any, axis: str, timeout: timedelta) -> None:
    """Name a process group hfpatch created (``axis``: what it splits) with its timeout, for the messages of
    :class:`CollectiveError` and the waiting notices."""
    ranks = dist.get_process_group_ranks(group)
    _GROUPS[group.group_name] = (f"{axis} group of global ranks {ranks}", timeout)


def describe_group(group: Any) -> str:
    """``group`` in words: its hfpatch axis and global ranks (``"ulysses group of global ranks [0, 1]"``)."""
    if group is None or group is dist.group.WORLD:
        return f"default (world) process group of {dist.get_world_size()} ranks"
    known = _GROUPS.get(getattr(group, "group_name", None))
    if known is not None:
        return known[0]
    try:
        return f"process group of global ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # not a group this rank belongs to, or torch.distributed torn down
        return "process group"


def group_timeout(group: Any) -> timedelta | None:
    """The timeout hfpatch created ``group`` with (``None`` for ``None`` and for a group hfpatch did not create)."""
    known = _GROUPS.get(getattr(group, "group_name", None)) if group is not None else None
    return None if known is None else known[1]


def wait_timeout(group: Any) -> timedelta | None:
    """Timeout to pass to ``Work.wait`` for point-to-point work over ``group`` (``None``: the group's own).

    gloo point-to-point work ignores a timeout set on the group after its creation, so the waits bound it
    themselves (hfpatch's groups carry the timeout from creation; this also bounds the default group). NCCL
    is left to its watchdog: a timed ``wait`` would block the host until the GPU finished, losing overlap.
    """
    try:
        backend = dist.get_backend(group)
    except Exception:
        return None
    if backend != "gloo":
        return None
    return group_timeout(group) or default_timeout()


def collective_error(op: str, group: Any, exc: BaseException) -> CollectiveError:
    """The :class:`CollectiveError` for ``exc``, raised by ``op`` over ``group`` (``raise ... from exc``)."""
    where = describe_group(group)
    timeout = group_timeout(group)
    if timeout is None and (group is None or group is dist.group.WORLD):
        limit = "the default group's timeout"
    elif timeout is None:
        limit = "the group's timeout"
    else:
        limit = f"HFPATCH_TIMEOUT_S={_seconds(timeout)}s"
    me = dist.get_rank() if dist.is_initialized() else 0
    from .liveness import silent_ranks

    # Probe the whole job: a member of this group may wait here on a rank lost in another of its groups.
    silent = (silent_ranks(None, default_store()) if dist.is_initialized() else None) or []
    try:
        members = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except Exception:  # torn down meanwhile: say only that they are gone (never mask the error being raised)
        members = None
    if members is None:
        lost = _name_silent(silent, "of the job")
    else:
        lost = _name_silent([r for r in silent if r in members], "of the group")
        lost += _name_silent([r for r in silent if r not in members], "of the job, outside this group,")
    return CollectiveError(
        f"hfpatch: {op} over the {where} failed on rank {me}: another rank of the group failed, exited or "
        f"did not get there within {limit}.{lost} Every rank of the group must make each patched call: a call made "
        "on some ranks only (e.g. under `if rank == 0:`) waits here until the timeout; run such a call under "
        "`with patch.disabled():` to compute it unpatched on its own. Otherwise the rank that failed first "
        f"shows the cause in its own log; this rank only saw: {_first_line(exc)}",
        op=op,
        group=where,
        timeout=timeout,
    )


def _name_silent(ranks: list[int], where: str) -> str:
    if not ranks:
        return ""
    if len(ranks) == 1:
        return f" Rank {ranks[0]} {where} shows no heartbeat: its process is gone (a crash, an exit, a lost node)."
    return (
        f" Ranks {', '.join(map(str, ranks))} {where} show no heartbeat: their processes are gone (a crash, an exit, "
        "a lost node)."
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def check_launchable(required: int) -> None:
    """Raise ``RuntimeError`` saying how to launch if ``required > 1`` ranks cannot exist in this process.

    Initialises nothing: there must be a process group already, or the launcher's environment.
    """
    if required == 1 or (dist.is_available() and dist.is_initialized()):
        return
    missing = [v for v in _LAUNCH_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"hfpatch was asked for {required} ranks but torch.distributed is not initialised and the launcher "
            f"variables {', '.join(missing)} are not set. Launch every rank with "
            f"`torchrun --nproc-per-node {required} your_script.py` or `accelerate launch --multi_gpu "
            f"--num_processes {required} your_script.py` (without GPUs: `ACCELERATE_USE_CPU=true accelerate launch "
            f"--multi_gpu ...`; plain `accelerate launch --num_processes {required}` starts one process there), "
            "or call torch.distributed.init_process_group first."
        )


def check_launch_agrees() -> None:
    """Raise ``RuntimeError`` when the launcher started ``WORLD_SIZE > 1`` processes that do not see each other.

    Under ``torchrun`` or ``accelerate launch`` every process gets ``WORLD_SIZE``; a process group of another
    size, or accelerate state that counts another number of processes (on CPU, accelerate joins the processes
    only with ``ACCELERATE_USE_CPU=true`` or ``Accelerator(cpu=True)``: otherwise each one trains alone, as one
    process) would make every rank compute alone, silently. Initialises nothing.

    >>> import os
    >>> "WORLD_SIZE" in os.environ or check_launch_agrees() is None   # no launcher: nothing to compare
    True
    """
    text = os.environ.get("WORLD_SIZE", "")
    launched = int(text) if text.isdigit() else 0
    if launched <= 1:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != launched:
        raise RuntimeError(
            f"the launcher started WORLD_SIZE={launched} processes, but torch.distributed's default process group "
            f"has {dist.get_world_size()} rank(s): the ranks would not compute together. Initialise it with every "
            "process (torch.distributed.init_process_group() without rank/world_size reads the launcher's "
            "environment), or launch as many processes as the group has"
        )
    accelerate = sys.modules.get("accelerate.state")
    shared = getattr(getattr(accelerate, "PartialState", None), "_shared_state", None) or {}
    processes = shared.get("num_processes") if hasattr(shared, "get") else None
    if isinstance(processes, int) and processes != launched:
        import torch

        fix = (
            "set ACCELERATE_USE_CPU=true in the environment (or pass Accelerator(cpu=True)): without it accelerate "
            "on CPU runs each process on its own"
            if not torch.cuda.is_available()
            else "launch with `accelerate launch --multi_gpu` or torchrun, and create the Accelerator in every process"
        )
        raise RuntimeError(
            f"the launcher started WORLD_SIZE={launched} processes, but accelerate sees {processes} process(es) "
            f"(distributed_type {shared.get('distributed_type')}): every process would compute alone. To run them "
            f"together, {fix}"
        )


def ensure_process_group(required: int) -> None:
    """Make sure a default process group of ``required`` ranks exists.

    Initialises it from the torchrun environment when needed (NCCL when CUDA is available, gloo otherwise).

    Raises:
        RuntimeError: ``required > 1`` and there is neither a process group nor a launcher environment.
        ValueError: The existing world size differs from ``required``.
    """
    if required == 1 and not (dist.is_available() and dist.is_initialized()):
        return
    if not dist.is_available():
        raise RuntimeError(
            "torch.distributed is not available in this torch build; hfpatch needs it for parallel > 1"
        )
    if not dist.is_initialized():
        check_launchable(required)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = default_timeout()
        try:
            dist.init_process_group(
                backend=backend,
                store=_launcher_store(timeout),
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timeout,
            )
        except (RuntimeError, TimeoutError) as exc:
            if not (isinstance(exc, TimeoutError) or is_peer_failure(exc)):
                raise
            raise CollectiveError(
                f"hfpatch could not initialise the default process group of WORLD_SIZE={required} ranks "
                f"(RANK={os.environ.get('RANK')}, MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
                f"MASTER_PORT={os.environ.get('MASTER_PORT')}) within HFPATCH_TIMEOUT_S={_seconds(timeout)}s: "
                "not every rank got there (one failed or exited before, or called hfpatch.apply on some ranks "
                f"only), or the address is unreachable. This rank saw: {_first_line(exc)}",
                op="init_process_group",
                group=f"default process group of {required} ranks",
                timeout=timeout,
            ) from exc
    if dist.get_world_size() != required:
        raise ValueError(
            f"hfpatch was asked for {required} ranks but the world size is {dist.get_world_size()}; "
            f"pass parallel={dist.get_world_size()} or a ParallelConfig whose degrees multiply to it"
        )


def _launcher_store(timeout: timedelta) -> Any:
    """The rendezvous store of the launcher's environment, as ``init_process_group("env://")`` makes it, but
    connected within ``timeout`` in all (what ``init_process_group`` then wraps in ``PrefixStore("default_pg")``).

    torch's store client retries a refused connection with the whole timeout per try (``TCPStore``: up to about
    three times the timeout when the rank hosting the store never starts it, with a C++ stack trace per try),
    so a rank that is not the host first waits here, in bounded polls, until the host's port accepts.

    Raises:
        TimeoutError: The store's host did not listen within ``timeout``.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # torchrun's agent hosts the store
    deadline = time.monotonic() + timeout.total_seconds()
    if agent or rank != 0:
        while True:
            try:
                with socket.create_connection(
                    (host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))
                ):
                    break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"nothing listens at MASTER_ADDR:MASTER_PORT={host}:{port} (the store that rank 0 or the "
                        f"launcher hosts): {exc}"
                    ) from exc
                time.sleep(0.1)
    remaining = timedelta(seconds=max(0.1, deadline - time.monotonic()))
    if agent:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=remaining)
    else:
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=remaining, multi_tenant=True)
    store.set_timeout(timeout)
    return store


@dataclass(eq=False)
class ParallelMesh:
    """Process groups for the axes of a :class:`ParallelConfig` (built once per shape and reused).

    Attributes:
        config: The degrees.
        device_mesh: A torch ``DeviceMesh`` over the axes of degree > 1, named and ordered as in ``AXES``, on the
            groups below (``None`` when no axis of ``AXES`` is split).
        groups: Axis name -> ProcessGroup (``None`` when the axis has degree 1). ``"sp"`` is ring x ulysses,
            ``"pipefusion_sp"`` pipefusion x ring x ulysses (every rank of a PipeFusion pipeline),
            ``"vae"`` is every rank (when the VAE is split), ``"world"`` every rank of the plan (both hfpatch's
            own group of every rank, not the default group). Every group carries :func:`default_timeout`.
    """

    config: ParallelConfig
    device_mesh: object | None
    groups: dict[str, object | None] = field(default_factory=dict)

    def group(self, axis: str):
        """The process group of ``axis`` (``"data"``, ``"cfg"``, ``"pipefusion"``, ``"ring"``, ``"ulysses"``,
        ``"sp"``, ``"pipefusion_sp"``, ``"vae"``)."""
        if axis not in self.groups:
            raise KeyError(f"unknown mesh axis {axis!r}; known: {sorted(self.groups)}")
        return self.groups[axis]

    def size(self, axis: str) -> int:
        group = self.group(axis)
        return 1 if group is None else dist.get_world_size(group)

    def local_rank(self, axis: str) -> int:
        group = self.group(axis)
        return 0 if group is None else dist.get_rank(group)


# Process groups are expensive (gloo opens sockets and polls each group's from a thread of its own; NCCL holds a
# communicator's buffers on the GPU), so meshes are built once per shape per process, and a mesh of another shape
# reuses the group of an axis that splits the ranks the same way (a transformer's CFG 2 x Ulysses 2 and its
# pipeline's Ring 2 x Ulysses 2 share their Ulysses groups).
_MESHES: dict[tuple, ParallelMesh] = {}
# hfpatch's own group of every rank (the "vae" and "world" axes), one per default group and timeout.
_WORLD_GROUPS: dict[tuple, Any] = {}
# (default group, backend, timeout, axis name, every group's ranks) -> this rank's group.
_AXIS_GROUPS: dict[tuple, Any] = {}


def _reset_state() -> None:
    """Forget the cached meshes (tests, or before re-initialising torch.distributed in one process)."""
    _MESHES.clear()
    _WORLD_GROUPS.clear()
    _AXIS_GROUPS.clear()
    _GROUPS.clear()


def _world_key() -> tuple:
    # Keyed by the default group too: after destroy/init_process_group (notebooks, relaunch) build anew.
    return (id(dist.group.WORLD), dist.get_backend(), default_timeout())


def _world_group(key: tuple, timeout: timedelta) -> Any:
    """hfpatch's copy of the world group, with ``timeout`` (the user's default group is left untouched)."""
    if key not in _WORLD_GROUPS:
        group = dist.new_group(timeout=timeout)
        register_group(group, "hfpatch world", timeout)
        _WORLD_GROUPS[key] = group
    return _WORLD_GROUPS[key]


def axis_ranks(config: ParallelConfig, axes: tuple[str, ...]) -> list[list[int]]:
    """The global ranks of every group along ``axes``: ranks that differ only in their ``axes`` coordinates,
    in :data:`AXES` order (the last axis innermost); every rank of the plan in one group when ``axes`` is empty.

    >>> axis_ranks(ParallelConfig(cfg=2, ulysses=2), ("ulysses",))
    [[0, 1], [2, 3]]
    >>> axis_ranks(ParallelConfig(cfg=2, ring=2, ulysses=2), ("ring", "ulysses"))
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    if not axes:
        return [list(range(config.world_size))]
    shape = [getattr(config, axis) for axis in AXES]
    keep = [i for i, axis in enumerate(AXES) if axis in axes]
    rest = [i for i in range(len(AXES)) if i not in keep]
    size = math.prod(shape[i] for i in keep)
    return torch.arange(math.prod(shape)).view(shape).permute(*rest, *keep).reshape(-1, size).tolist()


def axis_group(name: str, ranks: list[list[int]]) -> Any:
    """This rank's group among the groups ``ranks`` (from :func:`axis_ranks`), created with :func:`default_timeout`
    and named ``name`` in error messages; the same group for the same name and ranks while the default group
    lives (creating one is a collective of every rank, so every rank must ask in the same order)."""
    world_key = _world_key()
    key = (*world_key, name, tuple(map(tuple, ranks)))
    if key not in _AXIS_GROUPS:
        timeout = world_key[2]
        group, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
        register_group(group, name, timeout)
        _AXIS_GROUPS[key] = group
    return _AXIS_GROUPS[key]


def get_mesh(config: ParallelConfig) -> ParallelMesh:
    """The :class:`ParallelMesh` for ``config`` over the default process group (collective on first use).

    Every group of the mesh is created by hfpatch with :func:`default_timeout` (read when the mesh is first
    built), also the groups spanning every rank: the default group is never used for hfpatch's collectives.

    Raises:
        CollectiveError: Creating the groups failed because a rank did not take part (within the timeout).
    """
    if config.world_size == 1:  # no parallelism: every rank runs the model on its own
        return ParallelMesh(config, None, {a: None for a in (*AXES, "sp", "pipefusion_sp", "vae", "world")})
    ensure_process_group(config.world_size)
    world_key = _world_key()
    timeout = world_key[2]
    key = (*world_key, config.data, config.cfg, config.pipefusion, config.ring, config.ulysses, config.vae)
    if key in _MESHES:
        return _MESHES[key]
    # Plans that differ in ``vae`` only (a transformer's vae=1, its pipeline's vae=N) share their groups.
    same_groups = next((m for k, m in _MESHES.items() if k[:-1] == key[:-1]), None)
    if same_groups is not None:
        world = same_groups.groups["world"]
        groups = {**same_groups.groups, "vae": world if config.vae > 1 else None}
        _MESHES[key] = ParallelMesh(config, same_groups.device_mesh, groups)
        return _MESHES[key]
    from .liveness import ensure_heartbeat

    ensure_heartbeat(
        default_store()
    )  # with the first groups of this default group: a rank lost later is named
    try:
        result = _build_mesh(config, world_key)
    except RuntimeError as exc:
        if not is_peer_failure(exc):
            raise
        raise CollectiveError(
            f"hfpatch: creating the process groups of {config} failed on rank {dist.get_rank()}: not every "
            f"rank took part within HFPATCH_TIMEOUT_S={_seconds(timeout)}s (a rank failed, exited or is late). "
            f"This rank saw: {_first_line(exc)}",
            op="process group creation",
            group=f"default process group of {dist.get_world_size()} ranks",
            timeout=timeout,
        ) from exc
    _MESHES[key] = result
    return result


def _build_mesh(config: ParallelConfig, world_key: tuple) -> ParallelMesh:
    from torch.distributed.device_mesh import DeviceMesh

    def group_of(axes: tuple[str, ...], name: str) -> Any:
        return axis_group(name, axis_ranks(config, axes))

    groups: dict[str, object | None] = {
        axis: group_of((axis,), axis) if getattr(config, axis) > 1 else None for axis in AXES
    }
    groups["sp"] = (  # ring x ulysses in sp order, ulysses innermost
        group_of(("ring", "ulysses"), "sp (ring x ulysses)")
        if config.ring > 1 and config.ulysses > 1
        else (groups["ring"] or groups["ulysses"])
    )
    staged = tuple(axis for axis in ("pipefusion", "ring", "ulysses") if getattr(config, axis) > 1)
    groups["pipefusion_sp"] = (  # PipeFusion x sequence parallel: every stage's sp ranks (same inputs)
        group_of(staged, "pipefusion x sp")
        if config.pipefusion > 1 and len(staged) > 1
        else groups["pipefusion"]
    )
    split = tuple(axis for axis in AXES if getattr(config, axis) > 1)
    mesh = None
    if split:  # a DeviceMesh over the split axes, on the groups above (wrapping them creates none)
        device_type = "cuda" if world_key[1] == "nccl" else "cpu"
        sizes = [getattr(config, axis) for axis in split]
        grid = torch.arange(math.prod(sizes)).view(sizes)
        mesh = DeviceMesh.from_group([groups[a] for a in split], device_type, grid, mesh_dim_names=split)
    world = _world_group(world_key, world_key[2])
    groups["vae"] = world if config.vae > 1 else None
    groups["world"] = world  # every rank of the plan (same-input checks of a pipeline call)
    return ParallelMesh(config, mesh, groups)


# ----------------------------------------------------------------------------------------------- handshake
def default_store() -> Any:
    """The default group's store (hosted by rank 0 or the launcher): where :func:`exchange` and the notices of
    :mod:`hfpatch.distributed.waiting` post."""
    return dist.distributed_c10d._get_default_store()


def exchange(tag: str, payload: dict[str, Any], *, what: str, hint: str = "") -> list[dict[str, Any]]:
    """Every rank's ``payload`` (JSON-able), by global rank: a bounded handshake over the default group's store.

    Needs no process group of hfpatch's, so it runs before any is created; the wait is bounded by
    :func:`default_timeout` whatever the default group's own timeout. The ``n``-th call with ``tag`` on one
    rank meets the ``n``-th call on the others (each rank counts its calls in the store itself, so a new
    default group starts from 1).

    Raises:
        CollectiveError: Not every rank posted within the timeout (``what`` names the call they must all
            make, ``hint`` adds to the message), or the store is gone (the rank that hosts it exited).
    """
    store = default_store()
    me, world = dist.get_rank(), dist.get_world_size()
    timeout = default_timeout()
    keys: list[str] = []
    try:
        n = store.add(f"hfpatch/{tag}/calls/{me}", 1)
        keys = [f"hfpatch/{tag}/{n}/{r}" for r in range(world)]
        store.set(keys[me], json.dumps(payload))
        store.wait(keys, timeout)
        return [json.loads(store.get(k)) for k in keys]
    except RuntimeError as exc:
        if not is_peer_failure(exc):
            raise
        missing: list[int] = []
        try:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
        except RuntimeError:  # the store itself is gone
            pass
        if missing:
            who = f"ranks {missing} of {world} did not call {what} within HFPATCH_TIMEOUT_S={_seconds(timeout)}s"
        else:
            who = (
                "the store (hosted by rank 0 or the launcher) became unreachable, so not every rank could be "
                f"heard from within HFPATCH_TIMEOUT_S={_seconds(timeout)}s"
            )
        raise CollectiveError(
            f"hfpatch: {what} handshake failed on rank {me}: {who}. Every rank must call {what} with the same "
            "arguments (a rank that failed or exited before it, or an `if rank == 0:` around it, leaves the "
            f"others here{hint}). This rank saw: {_first_line(exc)}",
            op=f"{what} handshake",
            group=f"default process group of {world} ranks",
            timeout=timeout,
        ) from exc
