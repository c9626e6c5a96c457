"""Feed a patched model's ranks the right data: one batch per data-parallel replica, the same within it.

The ranks of one sequence-parallel (or CFG, or split-VAE) group compute ONE result together, each from its
own copy of the inputs, so they must load the same batch and draw the same noise and timesteps. A loader
sharded over every rank (``DistributedSampler()`` with its defaults, ``accelerator.prepare(loader)``)
gives them different batches, which the same-input guard reports as
:class:`hfpatch.InputMismatchError`. Shard over the ``data`` axis only instead:

* :func:`data_parallel_sampler` -- a ``DistributedSampler`` with ``num_replicas`` / ``rank`` set to the data
  axis (``patch.num_data_ranks`` / ``patch.data_rank``) that moves to the next epoch each time it is
  iterated (as accelerate's prepared loaders do). Keep that DataLoader out of ``accelerator.prepare``
  (prepare would shard it again over every process) and move batches to ``accelerator.device`` yourself.
* :func:`data_parallel_loaders` -- for code that prepares its loaders with accelerate (the transformers
  ``Trainer`` does, inside ``get_train_dataloader``): makes ``accelerator.prepare(loader)`` shard over the
  data axis only, so every rank of a group loads the same batches. Logged in the patch, undone by
  ``patch.remove()``.
* :func:`step_rng` -- a ``with`` block in which torch's global RNGs (CPU and CUDA), Python's ``random`` and
  NumPy's are seeded from ``(seed, step, data_rank)``: EVERY random draw of a training step made inside it
  (the VAE posterior sample, noise, timesteps, caption dropout, dropout layers, draws inside diffusers'
  helpers that take no generator) is identical within a group, different across replicas, identical after
  a resume, and untouched by what the main process alone drew before (validation). The states are
  restored on exit.
* :func:`step_generator` -- a ``torch.Generator`` seeded the same way, for code that passes generators
  explicitly. Keep it on the CPU and draw with diffusers' ``randn_tensor(shape, generator=g,
  device=device, dtype=dtype)``, which draws on the generator's device and moves the result, so the same
  line runs on CPU and CUDA.

Why not accelerate's mesh-aware sharding: accelerate 1.15 gives the ranks of one replica the same batches
only for the ``tp``/``cp`` dims of a ``ParallelismConfig`` device mesh, and those dims switch accelerate to
tensor parallelism (no DDP) or to FSDP2-only context parallelism; its ``sp`` dim is DeepSpeed-only. None
describes "these ranks share one sample through hfpatch", so hfpatch shards the loader itself.

RNG after ``accelerator.load_state``: accelerate saves and restores each process's global RNG states
(``random_states_<i>.pkl``), so a script that draws noise from the global RNG gets back what each process
had. That is only right if the states were identical within every group at save time and nothing
rank-dependent consumed them (``set_seed(..., device_specific=True)``, a shuffled loader per rank, dropout
on some ranks only, validation on the main process). Seeding every step from ``(seed, step, data_rank)``
needs none of that: after a resume at step ``k`` the draws of step ``k`` are the ones an uninterrupted run
makes.

>>> from hfpatch import ParallelConfig
>>> from hfpatch.distributed.data import data_coordinates, step_seed
>>> [data_coordinates(r, 8, ParallelConfig(data=2, ulysses=4)) for r in (0, 3, 4, 7)]
[(0, 2), (0, 2), (1, 2), (1, 2)]
>>> step_seed(0, 5, 1) == step_seed(0, 5, 1) != step_seed(0, 5, 0)
True
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..core.config import ParallelConfig
from ..core.patch import Patch, get_patch
from ..core.ranks import data_coordinates, data_position
from ..core.wrappers import unwrap_model

__all__ = [
    "data_coordinates",
    "data_parallel_loaders",
    "data_parallel_position",
    "data_parallel_sampler",
    "step_generator",
    "step_rng",
    "step_seed",
]


def _plan_of(patch_or_model: Any) -> ParallelConfig | None:
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
    return data_position(_plan_of(patch_or_model))


class _EpochAdvancingSampler(torch.utils.data.DistributedSampler):
    """A ``DistributedSampler`` that moves to the next epoch at each ``__iter__`` until ``set_epoch`` is called.

    Outside ``accelerator.prepare`` nothing calls ``set_epoch`` for the script (accelerate's prepared loaders
    do), and a stock ``DistributedSampler`` then repeats epoch 0's order forever. The count is per sampler
    object and identical on every rank, so the ranks of a group still load the same batches; a script that
    calls ``set_epoch`` itself takes over from then on.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._iterations = 0
        self._explicit_epoch = False

    def set_epoch(self, epoch: int) -> None:
        self._explicit_epoch = True
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if not self._explicit_epoch:
            self.epoch = self._iterations
            self._iterations += 1
        return super().__iter__()


def data_parallel_sampler(
    dataset: Any,
    patch_or_model: Any = None,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> torch.utils.data.DistributedSampler:
    """A ``DistributedSampler`` over the data axis of ``patch_or_model``: one shard per replica.

    Pass it as ``DataLoader(dataset, sampler=..., batch_size=per_replica_batch)``. Each pass over the loader
    is the next epoch (a new shuffle), as with accelerate's prepared loaders, unless the script calls
    ``sampler.set_epoch(epoch)`` itself. Keep that loader out of ``accelerator.prepare`` (it would re-shard
    over every process). With ``None`` it shards over every process, as plain DDP does.

    >>> from hfpatch.distributed.data import data_parallel_sampler
    >>> sampler = data_parallel_sampler(range(6), None, shuffle=False)
    >>> list(sampler)  # one process: everything
    [0, 1, 2, 3, 4, 5]
    >>> shuffled = data_parallel_sampler(range(6), None)
    >>> first, second = list(shuffled), list(shuffled)
    >>> first != second, sorted(first) == sorted(second)  # each pass a new epoch
    (True, True)
    """
    data_rank, num_data_ranks = data_parallel_position(patch_or_model)
    return _EpochAdvancingSampler(
        dataset, num_replicas=num_data_ranks, rank=data_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )


def data_parallel_loaders(accelerator: Any, patch: Any) -> None:
    """Make ``accelerator.prepare`` shard data loaders over the data axis of ``patch`` (one shard per replica).

    accelerate shards a prepared loader over every process; the ranks of a sequence-parallel group must load
    the same batches instead. After this call, ``accelerator.prepare(loader)`` (and the transformers
    ``Trainer``'s ``get_train_dataloader``/``get_eval_dataloader``, which call it) shards over
    ``patch.num_data_ranks`` replicas with index ``patch.data_rank``, with every other setting of the
    accelerator (batch splitting, seedable sampler, device placement, RNG synchronisation) unchanged. The
    change is an instance attribute logged in ``patch``: ``patch.remove()`` restores the accelerator.

        patch = hfpatch.apply(model, parallel=world_size)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        hfpatch.data_parallel_loaders(trainer.accelerator, patch)   # before trainer.train()

    Args:
        accelerator: An ``accelerate.Accelerator`` (``trainer.accelerator``).
        patch: The :class:`hfpatch.Patch` of the patched model.
    """
    from accelerate.data_loader import prepare_data_loader

    data_rank, replicas = data_parallel_position(patch)
    prepare = accelerator.prepare_data_loader

    def prepare_replica_loader(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return prepare(data_loader, device_placement, slice_fn_for_dispatch)
        if device_placement is None:
            device_placement = accelerator.device_placement
        prepared = prepare_data_loader(
            data_loader,
            accelerator.device,
            num_processes=replicas,
            process_index=data_rank,
            split_batches=accelerator.split_batches,
            put_on_device=device_placement,
            rng_types=list(accelerator.rng_types),
            dispatch_batches=accelerator.dispatch_batches,
            even_batches=accelerator.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(
            prepared
        )  # what Accelerator.prepare_data_loader records for save_state
        return prepared

    patch.set_attr(accelerator, "prepare_data_loader", prepare_replica_loader)


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


@contextmanager
def step_rng(
    seed: int, step: int, patch_or_model: Any = None, *, data_rank: int | None = None
) -> Iterator[int]:
    """Seed every global RNG from ``(seed, step, data replica)`` inside the block; restore them after.

    Wrap a training step's random draws (or the whole step) in it: torch's CPU RNG and the RNG of every
    initialised CUDA device, Python's ``random`` and NumPy's global RNG start from :func:`step_seed`. So the
    ranks of a sequence-parallel group draw the same VAE posterior sample, noise, timesteps, caption
    dropout and dropout masks, each data replica its own, a resumed run the same as an uninterrupted one,
    and a draw made on some ranks only (validation on the main process) changes nothing inside the next
    block. Draws need no ``generator=`` and follow the device they are made on (``torch.randn_like``,
    ``torch.rand(..., device=device)``). Yields the seed.

    Args:
        seed, step: The run's seed and the (micro-)step's index.
        patch_or_model: The patch (or patched model, also wrapped) whose data replica this process is in;
            ``None``: every process its own replica.
        data_rank: The data replica to seed for, instead of this process's (a one-process reference that
            emulates several replicas).

    >>> import torch
    >>> from hfpatch.distributed.data import step_rng
    >>> with step_rng(0, 7):
    ...     a = torch.randn(3)
    >>> with step_rng(0, 7):
    ...     torch.equal(a, torch.randn(3))
    True
    """
    if data_rank is None:
        data_rank = data_parallel_position(patch_or_model)[0]
    value = step_seed(seed, step, data_rank)
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    python_state = random.getstate()
    numpy_random = _numpy_random()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    try:
        with torch.random.fork_rng(devices=devices):
            # Not torch.manual_seed: with CUDA not yet initialised it queues a seeding that would outlive the block.
            torch.default_generator.manual_seed(value)
            for device in devices:
                torch.cuda.default_generators[device].manual_seed(value)
            random.seed(value)
            if numpy_random is not None:
                numpy_random.seed(value % 2**32)
            yield value
    finally:
        random.setstate(python_state)
        if numpy_random is not None:
            numpy_random.set_state(numpy_state)


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random
