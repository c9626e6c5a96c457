"""Feed a patched model's ranks the right data: one batch per data-parallel replica, the same within it.

The ranks of one sequence-parallel (or CFG, or split-VAE) group compute ONE result together, each from its
own copy of the inputs, so they must load the same batch and draw the same noise and timesteps. A loader
sharded over every rank (``DistributedSampler()`` with its defaults, ``accelerator.prepare(loader)``)
gives them different batches, which the same-input guard reports as
:class:`hfpatch.InputMismatchError`. Shard over the ``data`` axis only instead:

* :func:`prepare_accelerator` -- the accelerate recipe in one call: :func:`data_parallel_loaders` and a
  :class:`StepRNG` registered for ``save_state``/``load_state``, returned for ``with rng:``.
* :func:`data_parallel_loaders` -- for accelerate scripts (and the transformers ``Trainer``): makes
  ``accelerator.prepare(loader)`` shard over the data axis only, so the script keeps its loader in
  ``prepare`` with accelerate's step arithmetic, end-of-epoch accumulation and ``skip_first_batches``; a
  shuffled loader's order is agreed from rank 0 and checkpointed (``save_state`` half-way through an epoch,
  ``load_state``, and the resumed run loads what the uninterrupted one loads). Logged in the patch, undone by
  ``patch.remove()``.
* :func:`data_parallel_sampler` -- for plain torchrun/DDP loops: a ``DistributedSampler`` with
  ``num_replicas`` / ``rank`` set to the data axis (``patch.num_data_ranks`` / ``patch.data_rank``); call
  ``sampler.set_epoch(epoch)`` as with any ``DistributedSampler``.
* :class:`StepRNG` -- ``with rng:`` around each micro-step seeds torch's global RNGs (CPU and CUDA), Python's
  ``random`` and NumPy's from ``(seed, n, data_rank)``, ``n`` counting the blocks: EVERY random draw of the
  step made inside it (the VAE posterior sample, noise, timesteps, caption dropout, dropout layers, draws
  inside diffusers' helpers that take no generator) is identical within a group, different across replicas,
  micro-steps and epochs, untouched by what the main process alone drew before (validation), and, with the
  counter checkpointed (``accelerator.register_for_checkpointing``, or your own checkpoint dict), the same
  after a resume.
* :func:`step_rng` / :func:`step_generator` -- the same seeding with the index ``n`` given by hand; an index
  used twice in a process is an error (an ``enumerate(loader)`` index restarts every epoch).

Why not accelerate's ``ParallelismConfig``: its data-loader sharding does give the ranks of a ``cp`` (or
``tp``) group the same batches (``prepare_data_loader`` divides ``process_index`` by ``tp * cp`` and shards
over ``dp_replicate * dp_shard``), which is what :func:`data_parallel_loaders` does for hfpatch's data axis.
But accelerate 1.15 ties ``cp_size > 1`` to its own context parallelism: it refuses to start without an FSDP2
plugin, switches the run to FSDP, hooks torch's experimental ``context_parallel`` attention into
``prepare``, and refuses ``dp_replicate x cp`` without ``dp_shard`` (so DDP over replicas of a
sequence-parallel model cannot be written); ``sp_size`` is DeepSpeed's (ALST) only. None of them says
"these ranks share one sample through hfpatch" under DDP, so hfpatch passes its data axis to accelerate's
``prepare_data_loader`` itself.

RNG after ``accelerator.load_state``: accelerate saves and restores each process's global RNG states
(``random_states_<i>.pkl``), so a script that draws noise from the global RNG gets back what each process
had. That is only right if the states were identical within every group at save time and nothing
rank-dependent consumed them (``set_seed(..., device_specific=True)``, a shuffled loader per rank, dropout
on some ranks only, validation on the main process). Seeding every micro-step from a checkpointed counter
needs none of that.

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
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..core.config import ParallelConfig
from ..core.patch import Patch, get_patch
from ..core.ranks import data_coordinates, data_position, world_size
from ..core.wrappers import unwrap_model
from .replica_steps import count_data_replicas

__all__ = [
    "StepRNG",
    "data_coordinates",
    "data_parallel_loaders",
    "data_parallel_position",
    "data_parallel_sampler",
    "prepare_accelerator",
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
    """A ``DistributedSampler`` over the data axis of ``patch_or_model``: one shard per replica, for a DDP loop.

    Pass it as ``DataLoader(dataset, sampler=..., batch_size=per_replica_batch)`` in a plain torchrun/DDP loop
    and call ``sampler.set_epoch(epoch)`` at the start of each epoch, as with any ``DistributedSampler``: the
    order is a function of ``(seed, epoch)``, so a run resumed at its saved epoch loads what the uninterrupted
    run loads. Without ``set_epoch`` each pass moves to the next epoch, counted from 0 in each process (a
    resumed run would reshuffle like epoch 0). With ``None`` it shards over every process, as plain DDP does.
    In an accelerate script keep the stock loader in ``accelerator.prepare`` and call
    :func:`data_parallel_loaders` instead (``prepare`` would shard this one again over every process).

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


class _ReplicaShuffle(torch.utils.data.RandomSampler):
    """A ``RandomSampler`` whose permutation every rank agrees on and whose epoch ``save_state`` can resume.

    :func:`data_parallel_loaders` puts it in place of a loader's ``RandomSampler`` (``shuffle=True``). It draws
    what the stock sampler draws, agreed from global rank 0 (accelerate's ``synchronize_rng_state``):

    * without a generator (one replica: accelerate leaves the loader as it is) a seed from the global torch RNG
      at each epoch, as ``RandomSampler`` does: the order of the stock script on one process, even after rank 0
      alone drew from the global RNG (validation);
    * with one (the loader's ``generator=``, or the one accelerate gives a sampler it shards over several
      replicas) the next permutation from it, as accelerate's synchronised generator does.

    It records the generator state each epoch starts from, so a checkpoint taken in the middle of an epoch
    resumes that epoch's order (the loader or ``accelerator.skip_first_batches`` of it), and one taken after
    an epoch resumes with the next. (accelerate 1.15 restores neither the order of an epoch saved half-way
    nor, over several processes, its synchronised generator: a resumed multi-process run reshuffles like its
    first epoch.)
    """

    def __init__(self, sampler: torch.utils.data.RandomSampler) -> None:
        super().__init__(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=sampler.generator,
        )
        self._start: torch.Tensor | None = None  # generator state of the epoch that began last
        self._replay: torch.Tensor | None = None  # loaded by load_state_dict: the epoch in progress at saving
        self._resumed_rng: torch.Tensor | None = None  # the global CPU RNG state load_state restored

    def __iter__(self) -> Iterator[int]:
        generator = self.generator
        if self._replay is not None:
            if generator is None:
                generator = torch.Generator()
            generator.set_state(self._replay)
            self._replay = None
            if self._resumed_rng is not None:
                _undo_iterator_seed(self._resumed_rng)
                self._resumed_rng = None
        else:
            if generator is None:  # the stock draw of RandomSampler (same RNG, same amount)
                generator = torch.Generator().manual_seed(
                    int(torch.empty((), dtype=torch.int64).random_().item())
                )
            if world_size() > 1:
                from accelerate.utils import RNGType, synchronize_rng_state

                synchronize_rng_state(RNGType.GENERATOR, generator)  # rank 0's: one order in every group
        self._start = generator.get_state()
        own, self.generator = self.generator, generator
        try:
            indices = list(super().__iter__())  # what torch's RandomSampler yields from this generator
        finally:
            self.generator = own
        yield from indices

    def state_dict(self, in_progress: bool) -> dict[str, Any]:
        """The state to resume from: the epoch's start when ``in_progress``, and the generator as it is now."""
        return {
            "epoch_start": self._start if in_progress else None,
            "generator": None if self.generator is None else self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["generator"] is not None:
            if self.generator is None:
                raise ValueError(
                    "hfpatch: this checkpoint's loader shuffled with a generator, this loader has none: prepare "
                    "the same DataLoader (and the same number of replicas) as the run that saved it"
                )
            self.generator.set_state(state["generator"])
        self._replay = state["epoch_start"]
        # accelerate's load_state restores the RNG states before it loads registered objects.
        self._resumed_rng = None if self._replay is None else torch.get_rng_state()


def _undo_iterator_seed(restored: torch.Tensor) -> None:
    """Take back the worker base seed a DataLoader iterator drew from the global RNG since ``load_state``.

    torch's DataLoader draws one int64 from the global CPU RNG each time an iterator is made (the seed of its
    workers), unless the loader has a ``generator``. The uninterrupted run drew that of the epoch in progress
    before it saved; the resumed run draws it again for the loader it resumes the epoch with, which would
    leave every later global draw (validation without a seed, the next epochs' shuffles) one step off.
    Only that draw is undone: if the global RNG moved in any other way since ``load_state``, nothing is.
    """
    probe = torch.Generator()
    probe.set_state(restored)
    torch.empty((), dtype=torch.int64).random_(generator=probe)
    if torch.equal(torch.get_rng_state(), probe.get_state()):
        torch.set_rng_state(restored)


def _replica_shuffle(loader: Any, depth: int = 0) -> _ReplicaShuffle | None:
    """The :class:`_ReplicaShuffle` a (prepared, skipping, sharded) loader draws from, if any."""
    for name in ("batch_sampler", "sampler"):
        inner = getattr(loader, name, None)
        if isinstance(inner, _ReplicaShuffle):
            return inner
        if inner is not None and inner is not loader and depth < 4:
            found = _replica_shuffle(inner, depth + 1)
            if found is not None:
                return found
    return None


class _LoaderStates:
    """The shuffle state of the loaders :func:`data_parallel_loaders` prepared, for ``save_state``/``load_state``.

    Registered with ``accelerator.register_for_checkpointing``. An epoch is in progress at saving when the
    loader being iterated draws from the sampler and has not reached its last batch (accelerate's
    ``GradientState``); then the resumed run replays that epoch's order, else it goes on with the next.
    """

    def __init__(self, gradient_state: Any) -> None:
        self.gradient_state = gradient_state
        self.samplers: list[_ReplicaShuffle] = []
        self._loaded: list[dict[str, Any]] = []

    def add(self, sampler: _ReplicaShuffle) -> None:
        if len(self.samplers) < len(self._loaded):  # load_state ran before this loader was prepared
            sampler.load_state_dict(self._loaded[len(self.samplers)])
        self.samplers.append(sampler)

    def state_dict(self) -> dict[str, Any]:
        state = self.gradient_state
        active = None
        if state.in_dataloader and not state.end_of_dataloader:
            active = _replica_shuffle(state.active_dataloader)
        return {"samplers": [s.state_dict(in_progress=s is active) for s in self.samplers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = list(state["samplers"])
        if len(self.samplers) > len(self._loaded):
            raise ValueError(
                f"hfpatch: the checkpoint holds the shuffle state of {len(self._loaded)} loader(s), this run "
                f"prepared {len(self.samplers)}: prepare the same loaders as the run that saved it"
            )
        for sampler, saved in zip(self.samplers, self._loaded):
            sampler.load_state_dict(saved)


def data_parallel_loaders(accelerator: Any, patch: Any) -> None:
    """Make ``accelerator.prepare`` shard data loaders over the data axis of ``patch`` (one shard per replica).

    accelerate shards a prepared loader over every process; the ranks of a sequence-parallel group must load
    the same batches instead. After this call, ``accelerator.prepare(loader)`` (and the transformers
    ``Trainer``'s ``get_train_dataloader``/``get_eval_dataloader``, which call it) shards over
    ``patch.num_data_ranks`` replicas with index ``patch.data_rank``, with every other setting of the
    accelerator (batch splitting, seedable sampler, device placement, RNG synchronisation) unchanged. So the
    script keeps its own loader in ``prepare``, and with it accelerate's step arithmetic (``len(loader)`` per
    replica), the accumulation window that closes at the end of each epoch, and ``skip_first_batches``.

    A shuffled loader (``shuffle=True``: a ``RandomSampler``; not under ``use_seedable_sampler``, whose order
    is a function of the seed and epoch already) draws each epoch's order as the stock sampler would, agreed
    from global rank 0, and that order is part of the checkpoint: the shuffle state is registered with
    ``accelerator.register_for_checkpointing``, so after ``load_state`` an epoch saved half-way resumes in its
    own order and the next epochs follow as in the uninterrupted run. Other samplers keep their own order (if
    it differs between the ranks of a group, the same-input guard says so at the first forward). Call it
    before ``accelerator.prepare``
    and, in a resumed run, before ``load_state`` (the same calls in the same order, as for any registered
    object). Everything is logged in ``patch``: ``patch.remove()`` restores the accelerator and the loaders'
    samplers. ::

        patch = hfpatch.apply(transformer, parallel=accelerator.num_processes)
        hfpatch.data_parallel_loaders(accelerator, patch)                # before accelerator.prepare
        transformer, optimizer, loader = accelerator.prepare(transformer, optimizer, loader)

    Args:
        accelerator: An ``accelerate.Accelerator`` (``trainer.accelerator``).
        patch: The :class:`hfpatch.Patch` of the patched model.

    Raises:
        TypeError: ``patch`` is not a :class:`hfpatch.Patch`.
    """
    from accelerate.data_loader import prepare_data_loader

    if not isinstance(patch, Patch):
        raise TypeError(
            f"data_parallel_loaders needs the Patch that hfpatch.apply returned, got {type(patch).__name__}; "
            "without a patch, keep accelerator.prepare as it is (every process its own replica)"
        )
    data_rank, replicas = data_parallel_position(patch)
    prepare = accelerator.prepare_data_loader
    states = _LoaderStates(accelerator.gradient_state)
    accelerator.register_for_checkpointing(states)
    patch.on_remove(accelerator, "register_for_checkpointing", lambda: _unregister(accelerator, states))

    def prepare_replica_loader(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return prepare(data_loader, device_placement, slice_fn_for_dispatch)
        if device_placement is None:
            device_placement = accelerator.device_placement
        batch_sampler = getattr(data_loader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None)
        if type(sampler) is torch.utils.data.RandomSampler and not accelerator.use_seedable_sampler:
            shuffle = _ReplicaShuffle(sampler)
            patch.set_attr(batch_sampler, "sampler", shuffle, keep_when_disabled=True)
            states.add(shuffle)
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

    patch.set_attr(accelerator, "prepare_data_loader", prepare_replica_loader, keep_when_disabled=True)


def prepare_accelerator(accelerator: Any, patch: Any, seed: int | None = None) -> StepRNG:
    """The accelerate side of the training recipe: loaders over the data axis, a checkpointed :class:`StepRNG`.

    :func:`data_parallel_loaders` (``accelerator.prepare`` shards loaders over the data replicas of ``patch``;
    a shuffled loader's order is agreed from rank 0 and checkpointed), then a :class:`StepRNG` for ``seed`` and
    this process's data replica, registered with ``accelerator.register_for_checkpointing`` and returned.
    Call it after ``hfpatch.apply`` and before ``accelerator.prepare`` and ``accelerator.load_state``, and
    wrap each micro-step in the returned object::

        patch = hfpatch.apply(transformer, parallel=accelerator.num_processes)    # after add_adapter
        rng = hfpatch.prepare_accelerator(accelerator, patch, seed=args.seed)     # before accelerator.prepare
        ...
        with accelerator.accumulate(models_to_accumulate), rng:                 # each micro-step

    The script's learning-rate schedule stays the stock one (:mod:`hfpatch.distributed.replica_steps`: until
    ``prepare``, ``accelerator.num_processes`` counts data replicas; a scheduler prepared then steps once per
    replica). ``patch.remove()`` undoes it all. Collective only with ``seed=None``: call it on every rank.

    Args:
        accelerator: The script's ``accelerate.Accelerator``.
        patch: The :class:`hfpatch.Patch` of the patched model.
        seed: The run's seed (``args.seed``); ``None``: one from rank 0, saved with the checkpoints.

    Returns:
        The :class:`StepRNG` to enter once per micro-step.

    Raises:
        TypeError: ``patch`` is not a :class:`hfpatch.Patch`.

    >>> import torch, hfpatch
    >>> from accelerate import Accelerator
    >>> from hfpatch.testing import tiny_wan_transformer
    >>> accelerator = Accelerator(cpu=True)
    >>> patch = hfpatch.apply(tiny_wan_transformer())           # one process: a plan of one rank
    >>> rng = hfpatch.prepare_accelerator(accelerator, patch, seed=0)
    >>> loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(3)), shuffle=True))
    >>> draws = []
    >>> for epoch in range(2):
    ...     for batch in loader:
    ...         with rng:
    ...             draws.append(torch.rand(1).item())
    >>> len(draws), len(set(draws)), rng.step                   # new draws at every micro-step
    (6, 6, 6)
    >>> sorted(int(b) for b in loader)                          # each epoch: every sample once
    [0, 1, 2]
    >>> patch.remove()
    """
    data_parallel_loaders(accelerator, patch)
    count_data_replicas(accelerator, patch, data_parallel_position(patch)[1])
    rng = StepRNG(seed, patch)
    accelerator.register_for_checkpointing(rng)
    patch.on_remove(accelerator, "register_for_checkpointing", lambda: _unregister(accelerator, rng))
    return rng


def _unregister(accelerator: Any, obj: Any) -> None:
    objects = getattr(accelerator, "_custom_objects", [])
    if any(o is obj for o in objects):
        objects[:] = [o for o in objects if o is not obj]


def step_seed(seed: int, step: int, data_rank: int = 0) -> int:
    """A 63-bit seed for ``(seed, step, data_rank)``: a pure function, so it survives checkpoints and resumes.

    >>> from hfpatch.distributed.data import step_seed
    >>> step_seed(42, 0) == step_seed(42, 0), step_seed(42, 0) == step_seed(42, 1)
    (True, False)
    """
    digest = hashlib.blake2b(f"hfpatch/{seed}/{step}/{data_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextmanager
def _seeded(value: int) -> Iterator[int]:
    """Every global RNG (torch CPU and initialised CUDA devices, ``random``, NumPy) seeded with ``value`` inside."""
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


class StepRNG:
    """Every random draw of a training loop, one ``with`` block per micro-step, never the same twice.

    Inside ``with rng:`` torch's CPU RNG and the RNG of every initialised CUDA device, Python's ``random`` and
    NumPy's global RNG start from :func:`step_seed` of ``(seed, n, data replica)``, where ``n`` counts the blocks
    this object has entered (0, 1, 2, ... over every epoch); on exit they are restored. So the ranks of a
    sequence-parallel group draw the same VAE posterior sample, noise, timesteps, caption dropout and dropout
    masks of replicated tensors (dropout inside a sequence-parallel forward, where each rank holds a shard, is
    refused), each data replica its own, no two micro-steps (or epochs) alike, and a draw made on some ranks only
    (validation on the main process) changes nothing inside the next block. Draws need no ``generator=`` and
    follow the device they are made on (``torch.randn_like``, ``torch.rand(..., device=device)``).

    The counter and the seed are the object's state (``state_dict``/``load_state_dict``): registered with
    ``accelerator.register_for_checkpointing`` (:func:`prepare_accelerator` does it), ``save_state`` and
    ``load_state`` carry it and a resumed run makes the draws of the uninterrupted one; in a plain loop, save
    ``rng.state_dict()`` with your checkpoint. The ``n``-th block draws what ``step_rng(seed, n, patch)``
    draws. In a DDP loop (an accelerate script: :func:`prepare_accelerator`)::

        rng = hfpatch.StepRNG(seed, patch)
        for epoch in range(first_epoch, num_epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                with rng:                                        # every random draw of the micro-step
                    loss = training_loss(batch)
                ...

    Args:
        seed: The run's seed; ``None`` draws one on global rank 0 and shares it with every rank (a handshake
            over the default process group; checkpointed like the counter).
        patch_or_model: The patch (or patched model, also wrapped) whose data replica this process is in;
            ``None``: every process its own replica.
        data_rank: The data replica to draw for, instead of this process's (a one-process reference that
            emulates several replicas).

    Raises:
        RuntimeError: A ``with`` block entered inside another block of the same object.

    >>> import torch
    >>> from hfpatch.distributed.data import StepRNG
    >>> rng = StepRNG(0)
    >>> draws = []
    >>> for epoch in range(3):
    ...     for batch in [0]:                          # one sample: one micro-step per epoch
    ...         with rng:
    ...             draws.append(torch.rand(1).item())
    >>> len(set(draws)), rng.step                      # a new draw at every micro-step
    (3, 3)
    >>> resumed = StepRNG(0)
    >>> resumed.load_state_dict({"seed": 0, "step": 2})
    >>> with resumed:
    ...     resumed_draw = torch.rand(1).item()
    >>> resumed_draw == draws[2]                       # as in the uninterrupted run
    True
    """

    def __init__(
        self,
        seed: int | None = None,
        patch_or_model: Any = None,
        *,
        data_rank: int | None = None,
    ) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"StepRNG: seed must be an int or None, got {type(seed).__name__} {seed!r}")
        if data_rank is None:
            data_rank = data_parallel_position(patch_or_model)[0]
        self.data_rank = data_rank
        self.seed = _shared_seed() if seed is None else seed
        self._step = 0
        self._inside: Any = None

    @property
    def step(self) -> int:
        """The number of blocks entered so far: the index the next block draws from."""
        return self._step

    def __enter__(self) -> int:
        if self._inside is not None:
            raise RuntimeError(
                f"StepRNG: a `with rng:` block (index {self._step - 1}) is already open; one block per "
                "micro-step, not nested"
            )
        value = step_seed(self.seed, self._step, self.data_rank)
        self._step += 1
        self._inside = _seeded(value)
        return self._inside.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        inside, self._inside = self._inside, None
        return inside.__exit__(*exc)

    def state_dict(self) -> dict[str, int]:
        """``{"seed", "step"}``: what a resumed run needs to make the next draws (the data replica is per process)."""
        return {"seed": self.seed, "step": self._step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict` (accelerate's ``load_state`` calls it for a registered object)."""
        if set(state) != {"seed", "step"} or not all(isinstance(state[k], int) for k in state):
            raise ValueError(f"StepRNG.load_state_dict: expected {{'seed': int, 'step': int}}, got {state!r}")
        if self._inside is not None:
            raise RuntimeError("StepRNG.load_state_dict inside a `with rng:` block")
        self.seed, self._step = state["seed"], state["step"]

    def __repr__(self) -> str:
        return f"StepRNG(seed={self.seed}, step={self._step}, data_rank={self.data_rank})"


def _shared_seed() -> int:
    """A fresh 63-bit seed from global rank 0, the same on every rank (a bounded handshake over the store)."""
    value = int.from_bytes(os.urandom(8), "little") >> 1
    if world_size() == 1:
        return value
    from .runtime import exchange

    return int(exchange("step_rng_seed", {"seed": value}, what="hfpatch.StepRNG(seed=None)")[0]["seed"])


#: ``(seed, step, data_rank)`` of every :func:`step_rng` / :func:`step_generator` call in this process.
_USED_STEPS: set[tuple[int, int, int]] = set()


def _claim(seed: int, step: int, data_rank: int, replay: bool, what: str) -> None:
    """Record that ``(seed, step, data_rank)`` drew; a second use without ``replay`` is an error."""
    key = (seed, step, data_rank)
    if key in _USED_STEPS and not replay:
        raise ValueError(
            f"hfpatch.{what}(seed={seed}, step={step}) already drew for data replica {data_rank} in this process: "
            "the same index makes the same draws (noise, timesteps, VAE sample) again. A `step` from "
            "`enumerate(loader)` restarts at 0 every epoch, and `global_step` is shared by the micro-steps of "
            "one optimizer step. Use `rng = hfpatch.prepare_accelerator(accelerator, patch, seed)` (or "
            "`hfpatch.StepRNG(seed, patch)` in a plain loop) and `with rng:` around each micro-step: it counts "
            "the blocks itself and is checkpointed. Pass "
            "replay=True to repeat a step's draws on purpose"
        )
    _USED_STEPS.add(key)


def step_generator(
    seed: int,
    step: int,
    patch_or_model: Any = None,
    device: str | torch.device = "cpu",
    *,
    replay: bool = False,
) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded for this step and this process's data replica.

    Draw each step's noise and timesteps from it (``torch.randn(..., generator=g)``): every rank of a
    sequence-parallel group draws the same values, each data replica its own, and a run resumed at
    ``step`` draws what the uninterrupted run drew, without relying on restored RNG states. ``step`` must
    be unique in the run (one index per micro-step, over every epoch): a second call with the same index
    raises ``ValueError`` unless ``replay=True``; :class:`StepRNG` keeps the count for you.

    >>> import torch
    >>> from hfpatch.distributed.data import step_generator
    >>> a = torch.randn(3, generator=step_generator(11, 7))
    >>> torch.equal(a, torch.randn(3, generator=step_generator(11, 7, replay=True)))
    True
    """
    data_rank = data_parallel_position(patch_or_model)[0]
    _claim(seed, step, data_rank, replay, "step_generator")
    return torch.Generator(device=device).manual_seed(step_seed(seed, step, data_rank))


@contextmanager
def step_rng(
    seed: int,
    step: int,
    patch_or_model: Any = None,
    *,
    data_rank: int | None = None,
    replay: bool = False,
) -> Iterator[int]:
    """Seed every global RNG from ``(seed, step, data replica)`` inside the block; restore them after.

    The block of :class:`StepRNG` with the index given by hand; prefer :class:`StepRNG`, which counts the
    micro-steps itself and is checkpointed. ``step`` must be unique in the run (one per micro-step, over
    every epoch): the second block with the same ``(seed, step, data replica)`` in a process raises
    ``ValueError`` instead of repeating the draws, unless ``replay=True``. Yields the seed.

    Args:
        seed, step: The run's seed and the (micro-)step's index.
        patch_or_model: The patch (or patched model, also wrapped) whose data replica this process is in;
            ``None``: every process its own replica.
        data_rank: The data replica to seed for, instead of this process's (a one-process reference that
            emulates several replicas).
        replay: Repeat the draws of an index used before (on purpose).

    Raises:
        ValueError: ``(seed, step, data replica)`` already drew in this process and ``replay`` is false.

    >>> import torch
    >>> from hfpatch.distributed.data import step_rng
    >>> with step_rng(12, 7):
    ...     a = torch.randn(3)
    >>> with step_rng(12, 7, replay=True):
    ...     torch.equal(a, torch.randn(3))
    True
    """
    if data_rank is None:
        data_rank = data_parallel_position(patch_or_model)[0]
    _claim(seed, step, data_rank, replay, "step_rng")
    with _seeded(step_seed(seed, step, data_rank)) as value:
        yield value


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random
