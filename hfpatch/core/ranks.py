"""Where this process sits: the launched world, its rank, its data-parallel replica under a plan.

Reads torch.distributed's default process group, or the launcher's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) before one exists; initialises and communicates nothing. Process groups,
meshes and collectives are :mod:`hfpatch.distributed`'s (which re-exports these functions); they live here so
that :class:`hfpatch.Patch` (``patch.data_rank``) needs nothing above the core.

>>> from hfpatch import ParallelConfig
>>> from hfpatch.core.ranks import data_coordinates, data_position
>>> [data_coordinates(r, 8, ParallelConfig(data=2, ulysses=4)) for r in (0, 3, 4, 7)]
[(0, 2), (0, 2), (1, 2), (1, 2)]
>>> data_position(None)  # one process
(0, 1)
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .config import ParallelConfig

__all__ = [
    "data_coordinates",
    "data_position",
    "launched_world_size",
    "node_size",
    "peer_access",
    "rank",
    "topology",
    "world_size",
]

#: The environment a launcher (torchrun, accelerate launch) sets on every rank.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def world_size() -> int:
    """World size of the default process group, 1 when torch.distributed is not initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """Rank in the default process group, 0 when torch.distributed is not initialised."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def node_size() -> int | None:
    """Ranks per node as torchrun announced them: ``LOCAL_WORLD_SIZE``, when ``GROUP_WORLD_SIZE`` nodes of it make
    ``WORLD_SIZE``; ``None`` when unknown. (accelerate on CPU writes ``LOCAL_WORLD_SIZE`` itself, 1 when no launcher
    set it, so it alone is not trusted: a wrong node size would change the plan.)

    >>> import os
    >>> node_size() is None or node_size() * int(os.environ["GROUP_WORLD_SIZE"]) == int(os.environ["WORLD_SIZE"])
    True
    """
    local, nodes, world = (
        os.environ.get(k, "") for k in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "WORLD_SIZE")
    )
    if not (local.isdigit() and nodes.isdigit() and world.isdigit()) or int(local) < 1:
        return None
    return int(local) if int(local) * int(nodes) == int(world) else None


def peer_access() -> bool | None:
    """Whether this node's GPUs reach each other directly (NVLink, or PCIe peer-to-peer); ``None`` on CPU, or
    when this process sees fewer than two GPUs (a launcher that gives each rank one device: it cannot tell).

    Consumer GPUs on PCIe often lack it: their all-to-all then goes through host memory, as slow as a link
    between nodes, and the planner keeps Ulysses off it (:func:`hfpatch.core.config.plan_parallel`).

    >>> import torch
    >>> peer_access() is None or torch.cuda.device_count() > 1
    True
    """
    if not torch.cuda.is_available():
        return None
    local = torch.cuda.device_count()
    if local < 2:
        return None
    # The devices this node's ranks take (LOCAL_RANK -> cuda:LOCAL_RANK).
    used = min(local, node_size() or local)
    return all(torch.cuda.can_device_access_peer(i, j) for i in range(used) for j in range(used) if i != j)


def topology() -> dict[str, Any]:
    """The planner's view of the machines, as keyword arguments of :func:`~hfpatch.core.config.resolve_parallel`:
    ``node_size`` (:func:`node_size`) and ``peer_access`` (:func:`peer_access`). Every rank of a node reads the
    same; nodes that differ plan differently and ``hfpatch.apply``'s handshake says so on every rank.

    >>> sorted(topology())
    ['node_size', 'peer_access']
    """
    return {"node_size": node_size(), "peer_access": peer_access()}


def launched_world_size() -> int:
    """World size the launcher announced (``WORLD_SIZE``), or the initialised one, or 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if all(v in os.environ for v in LAUNCH_VARS):
        return int(os.environ["WORLD_SIZE"])
    return 1


def data_coordinates(rank: int, world_size: int, plan: ParallelConfig | None) -> tuple[int, int]:
    """``(data_rank, num_data_ranks)`` of global ``rank`` in a world of ``world_size`` ranks under ``plan``.

    The ranks that compute one result together (``cfg * ring * ulysses`` consecutive ranks, the data axis
    outermost as in hfpatch's mesh; all ``vae`` ranks of a VAE-only plan) form one replica. A plan of one
    rank (``parallel=1``, or no patch: ``None``) makes every rank its own replica, as plain DDP does.

    >>> from hfpatch import ParallelConfig
    >>> data_coordinates(1, 2, ParallelConfig(ulysses=2)), data_coordinates(1, 2, None)
    ((0, 1), (1, 2))
    >>> data_coordinates(2, 4, ParallelConfig(vae=4))
    (0, 1)
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    together = 1 if plan is None or plan.world_size == 1 else plan.world_size // plan.data
    if world_size % together:
        raise ValueError(f"{plan} groups {together} ranks, which does not divide the world of {world_size}")
    return rank // together, world_size // together


def data_position(plan: ParallelConfig | None) -> tuple[int, int]:
    """``(data_rank, num_data_ranks)`` of this process under ``plan`` (``None``: every process its own replica)."""
    world = launched_world_size()
    if world_size() > 1 or world == 1:
        here = rank()
    else:  # launched, process group not initialised yet
        here = int(os.environ["RANK"])
    return data_coordinates(here, world, plan)
