"""Feed a patched model's ranks the right data: one batch per data-parallel replica, the same within it.

The ranks of one sequence-parallel (or CFG, or split-VAE) group compute ONE result together, each from its
own copy of the inputs, so they must load the same batch and draw the same noise and timesteps. A loader
sharded over every rank (``DistributedSampler()`` with its defaults, ``accelerator.prepare(loader)``)
gives them different batches, which the same-input guard reports as
:class:`hfpatch.InputMismatchError`. Shard over the ``data`` axis only instead:

* :func:`data_parallel_sampler` -- a ``DistributedSampler`` with ``num_replicas`` / ``rank`` set to the data
  axis (``patch.num_data_ranks`` / ``patch.data_rank``). Keep that DataLoader out of
  ``accelerator.prepare`` (prepare would shard it again over every process) and move batches to
  ``accelerator.device`` yourself.
* :func:`step_generator` -- a ``torch.Generator`` seeded from ``(seed, step, data_rank)`` for the noise and
  timesteps of each step: identical within a group, different across replicas, and identical after a
  resume whatever RNG state was restored.

Why not accelerate's mesh-aware sharding: accelerate 1.15 gives the ranks of one replica the same batches
only for the ``tp``/``cp`` dims of a ``ParallelismConfig`` device mesh, and those dims switch accelerate to
tensor parallelism (no DDP) or to FSDP2-only context parallelism; its ``sp`` dim is DeepSpeed-only. None
describes "these ranks share one sample through hfpatch", so hfpatch shards the loader itself.

RNG after ``accelerator.load_state``: accelerate saves and restores each process's global RNG states
(``random_states_<i>.pkl``), so a script that draws noise from the global RNG gets back what each process
had. That is only right if the states were identical within every group at save time and nothing
rank-dependent consumed them (``set_seed(..., device_specific=True)``, a shuffled loader per rank, dropout
on some ranks only). Seeding a generator per step from ``(seed, step, data_rank)`` needs none of that:
after a resume at step ``k`` the draws of step ``k`` are the ones an uninterrupted run makes.

>>> from hfpatch import ParallelConfig
>>> from hfpatch.distributed.data import data_coordinates, step_seed
>>> [data_coordinates(r, 8, ParallelConfig(data=2, ulysses=4)) for r in (0, 3, 4, 7)]
[(0, 2), (0, 2), (1, 2), (1, 2)]
>>> step_seed(0, 5, 1) == step_seed(0, 5, 1) != step_seed(0, 5, 0)
True
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from ..core.config import ParallelConfig
from . import runtime

__all__ = [
    "data_coordinates",
    "data_parallel_position",
    "data_parallel_sampler",
    "step_generator",
    "step_seed",
]


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


def _plan_of(patch_or_model: Any) -> ParallelConfig | None:
    from ..core.apply import get_patch
    from ..core.patch import Patch
    from ..core.wrappers import unwrap_model

    if patch_or_model is None:
        return None
    if isinstance(patch_or_model, Patch):
        return patch_or_model.plan
    patch = get_patch(unwrap_model(patch_or_model))  # a patched model, also inside DDP / torch.compile
    if patch is None:
        raise ValueError(
            f"{type(patch_or_model).__name__} is not patched by hfpatch.apply; pass its Patch, or None for "
            "plain data parallelism over every rank"
        )
    return patch.plan


def data_parallel_position(patch_or_model: Any = None) -> tuple[int, int]:
    """``(data_rank, num_data_ranks)`` of this process for a :class:`hfpatch.Patch` or a patched model.

    ``None`` (or an unpatched script): every process is its own replica. Reads the default process group,
    or the launcher's ``RANK``/``WORLD_SIZE`` before one exists; communicates nothing.

    >>> from hfpatch.distributed.data import data_parallel_position
    >>> data_parallel_position(None)  # one process
    (0, 1)
    """
    world = runtime.launched_world_size()
    if runtime.world_size() > 1 or world == 1:
        rank = runtime.rank()
    else:  # launched, process group not initialised yet
        rank = int(os.environ["RANK"])
    return data_coordinates(rank, world, _plan_of(patch_or_model))


def data_parallel_sampler(
    dataset: Any,
    patch_or_model: Any = None,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> torch.utils.data.DistributedSampler:
    """A ``DistributedSampler`` over the data axis of ``patch_or_model``: one shard per replica.

    Pass it as ``DataLoader(dataset, sampler=..., batch_size=per_replica_batch)``; call
    ``sampler.set_epoch(epoch)`` each epoch when shuffling. Keep that loader out of
    ``accelerator.prepare`` (it would re-shard over every process). With ``None`` it shards over every
    process, as plain DDP does.

    >>> from hfpatch.distributed.data import data_parallel_sampler
    >>> list(data_parallel_sampler(range(6), None, shuffle=False))  # one process: everything
    [0, 1, 2, 3, 4, 5]
    """
    data_rank, num_data_ranks = data_parallel_position(patch_or_model)
    return torch.utils.data.DistributedSampler(
        dataset, num_replicas=num_data_ranks, rank=data_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )


def step_seed(seed: int, step: int, data_rank: int = 0) -> int:
    """A 63-bit seed for ``(seed, step, data_rank)``: a pure function, so it survives checkpoints and resumes.

    >>> from hfpatch.distributed.data import step_seed
    >>> step_seed(42, 0) == step_seed(42, 0), step_seed(42, 0) == step_seed(42, 1)
    (True, False)
    """
    digest = hashlib.blake2b(f"hfpatch/{seed}/{step}/{data_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def step_generator(
    seed: int, step: int, patch_or_model: Any = None, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded for this step and this process's data replica.

    Draw each step's noise and timesteps from it (``torch.randn(..., generator=g)``): every rank of a
    sequence-parallel group draws the same values, each data replica its own, and a run resumed at
    ``step`` draws what the uninterrupted run drew, without relying on restored RNG states.

    >>> import torch
    >>> from hfpatch.distributed.data import step_generator
    >>> a = torch.randn(3, generator=step_generator(0, 7))
    >>> torch.equal(a, torch.randn(3, generator=step_generator(0, 7)))
    True
    """
    data_rank = data_parallel_position(patch_or_model)[0]
    return torch.Generator(device=device).manual_seed(step_seed(seed, step, data_rank))
