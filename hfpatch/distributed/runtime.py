"""Process-group setup and the parallel mesh, on plain torch.distributed.

hfpatch never starts processes: under ``torchrun`` (or accelerate's launchers) it initialises the default
process group from the environment the launcher set (NCCL on CUDA, gloo on CPU); otherwise it explains how
to launch. Groups for the named axes come from a :class:`torch.distributed.device_mesh.DeviceMesh`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.config import ParallelConfig

__all__ = [
    "AXES",
    "ParallelMesh",
    "default_timeout",
    "ensure_process_group",
    "get_mesh",
    "rank",
    "world_size",
]

#: Mesh axes, outermost first. Ulysses is innermost so its all-to-alls stay within a node.
AXES = ("data", "cfg", "ring", "ulysses")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_timeout() -> timedelta:
    """Collective timeout: ``HFPATCH_TIMEOUT_S`` seconds (default 600), so a failed rank cannot hang the rest."""
    return timedelta(seconds=float(os.environ.get("HFPATCH_TIMEOUT_S", "600")))


def world_size() -> int:
    """World size of the default process group, 1 when torch.distributed is not initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """Rank in the default process group, 0 when torch.distributed is not initialised."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def launched_world_size() -> int:
    """World size the launcher announced (``WORLD_SIZE``), or the initialised one, or 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if all(v in os.environ for v in _LAUNCH_VARS):
        return int(os.environ["WORLD_SIZE"])
    return 1


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
        dist.init_process_group(backend=backend, timeout=default_timeout())
    if dist.get_world_size() != required:
        raise ValueError(
            f"hfpatch was asked for {required} ranks but the world size is {dist.get_world_size()}; "
            f"pass parallel={dist.get_world_size()} or a ParallelConfig whose degrees multiply to it"
        )


@dataclass(eq=False)
class ParallelMesh:
    """Process groups for the axes of a :class:`ParallelConfig` (built once per shape and reused).

    Attributes:
        config: The degrees.
        device_mesh: The torch ``DeviceMesh`` with dims ``AXES`` (``None`` for a single rank).
        groups: Axis name -> ProcessGroup (``None`` when the axis has degree 1). ``"sp"`` is ring x ulysses,
            ``"vae"`` is every rank (when the VAE is split), ``"world"`` every rank of the plan.
    """

    config: ParallelConfig
    device_mesh: object | None
    groups: dict[str, object | None] = field(default_factory=dict)

    def group(self, axis: str):
        """The process group of ``axis`` (``"data"``, ``"cfg"``, ``"ring"``, ``"ulysses"``, ``"sp"``, ``"vae"``)."""
        if axis not in self.groups:
            raise KeyError(f"unknown mesh axis {axis!r}; known: {sorted(self.groups)}")
        return self.groups[axis]

    def size(self, axis: str) -> int:
        group = self.group(axis)
        return 1 if group is None else dist.get_world_size(group)

    def local_rank(self, axis: str) -> int:
        group = self.group(axis)
        return 0 if group is None else dist.get_rank(group)


# Process groups are expensive (gloo opens sockets), so meshes are built once per shape per process.
_MESHES: dict[tuple, ParallelMesh] = {}


def _reset_state() -> None:
    """Forget the cached meshes (tests, or before re-initialising torch.distributed in one process)."""
    _MESHES.clear()


def get_mesh(config: ParallelConfig) -> ParallelMesh:
    """The :class:`ParallelMesh` for ``config`` over the default process group (collective on first use)."""
    if config.world_size == 1:  # no parallelism: every rank runs the model on its own
        return ParallelMesh(config, None, {a: None for a in (*AXES, "sp", "vae", "world")})
    ensure_process_group(config.world_size)
    # Keyed by the default group too: after destroy/init_process_group (notebooks, relaunch) build anew.
    key = (
        id(dist.group.WORLD),
        dist.get_backend(),
        config.data,
        config.cfg,
        config.ring,
        config.ulysses,
        config.vae,
    )
    if key in _MESHES:
        return _MESHES[key]
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    groups: dict[str, object | None] = {}
    product = config.data * config.cfg * config.ring * config.ulysses
    if product > 1:
        shape = (config.data, config.cfg, config.ring, config.ulysses)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
        for axis in AXES:
            groups[axis] = mesh.get_group(axis) if getattr(config, axis) > 1 else None
        groups["sp"] = (  # DeviceMesh._flatten (torch >= 2.4): ring x ulysses in sp order, ulysses innermost
            mesh["ring", "ulysses"]._flatten("sp").get_group()
            if config.ring > 1 and config.ulysses > 1
            else (groups["ring"] or groups["ulysses"])
        )
    else:
        mesh = None
        groups.update({a: None for a in AXES})
        groups["sp"] = None
    groups["vae"] = dist.group.WORLD if config.vae > 1 else None
    groups["world"] = dist.group.WORLD  # every rank of the plan (same-input checks of a pipeline call)
    result = ParallelMesh(config, mesh, groups)
    _MESHES[key] = result
    return result
