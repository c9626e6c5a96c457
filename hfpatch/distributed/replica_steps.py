"""accelerate's step arithmetic per data replica: a training script's schedule under :func:`prepare_accelerator`.

accelerate counts training in processes: a script sizes its learning-rate scheduler in "process steps"
(diffusers' ``train_dreambooth_lora_*.py``: ``num_warmup_steps = lr_warmup_steps * accelerator.num_processes``,
``num_training_steps = epochs * accelerator.num_processes * ceil(ceil(len(loader) / num_processes) /
accumulation)`` or ``max_train_steps * num_processes``; ``--scale_lr`` multiplies by ``num_processes`` too) and
a prepared scheduler (``AcceleratedScheduler``) steps ``num_processes`` times per optimizer step. Both count
the processes that load different batches. Under hfpatch the ranks of one sequence-parallel group load the
same batch: the loader is sharded over the data replicas only, so with that arithmetic the schedule ran
``num_processes / num_data_replicas`` times too fast (issue 45: 1e-3, 6.7e-4, 3.3e-4, 0, 0, 0 instead of the
stock script's even decay).

:func:`count_data_replicas` (called by :func:`hfpatch.prepare_accelerator`) makes both counts per data replica:

* until the first ``accelerator.prepare`` call, ``accelerator.num_processes`` reads the number of data
  replicas, which is what the script's scheduler sizing (and ``--scale_lr``) means by it;
* a scheduler prepared in that call steps once per data replica at each optimizer step instead of once per
  process.

So warmup, ``--max_train_steps`` and the epoch-sized schedule are those of the stock script on one process
training on the same global batch. From ``prepare`` on, ``accelerator.num_processes`` is the number of
processes again (accelerate's checkpointing and collectives read it); the batch size a script logs after
``prepare`` (``train_batch_size * num_processes * accumulation``) then counts every process, and hfpatch logs
the real one. A scheduler prepared in a later ``prepare`` call was sized with the number of processes and keeps
accelerate's stepping. Nothing changes when every process is its own replica. ``patch.remove()`` undoes it all.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["count_data_replicas"]


def _replica_scheduler_class(base: type, replicas: int) -> type:
    """A subclass of accelerate's ``AcceleratedScheduler`` that steps once per data replica (not per process)."""

    class ReplicaScheduler(base):
        def step(self, *args: Any, **kwargs: Any) -> None:
            inner = self.scheduler
            before = inner.last_epoch
            split, self.split_batches = self.split_batches, True  # accelerate's own checks, one step
            try:
                super().step(*args, **kwargs)
            finally:
                self.split_batches = split
            if inner.last_epoch == before:  # no optimizer step (accumulating, or a skipped fp16 step)
                return
            for _ in range(replicas - 1):  # as accelerate steps per process, with its OneCycle guard
                if not hasattr(inner, "total_steps") or inner._step_count <= inner.total_steps:
                    inner.step(*args, **kwargs)

    ReplicaScheduler.__name__ = ReplicaScheduler.__qualname__ = f"{base.__name__}PerDataReplica"
    return ReplicaScheduler


def count_data_replicas(accelerator: Any, patch: Any, replicas: int) -> None:
    """Make ``accelerator`` count data replicas, not processes, for the script's schedule (module docstring).

    Logged in ``patch``; a no-op when every process is its own replica.
    """
    from accelerate.scheduler import AcceleratedScheduler

    processes = accelerator.num_processes
    if replicas == processes:
        return
    real = type(accelerator)
    counting = type(real.__name__, (real,), {"num_processes": property(lambda self: replicas)})
    counting.__module__, counting.__qualname__ = real.__module__, real.__qualname__
    state = {"open": True, "in_prepare": False}

    def close() -> None:
        if state["open"]:
            state["open"] = False
            if type(accelerator) is counting:
                accelerator.__class__ = real

    accelerator.__class__ = counting
    patch.on_remove(accelerator, "num_processes", close)
    prepare, prepare_scheduler = accelerator.prepare, accelerator.prepare_scheduler
    stepping = _replica_scheduler_class(AcceleratedScheduler, replicas)

    def prepare_per_replica(*args: Any, **kwargs: Any) -> Any:
        first = state["open"]
        close()
        state["in_prepare"] = first
        try:
            prepared = prepare(*args, **kwargs)
        finally:
            state["in_prepare"] = False
        if first and accelerator.is_main_process:
            _log_batch(accelerator, args, replicas, processes)
        return prepared

    def prepare_scheduler_per_replica(scheduler: Any) -> Any:
        prepared = prepare_scheduler(scheduler)
        if state["in_prepare"] and type(prepared) is AcceleratedScheduler and not prepared.split_batches:
            prepared.__class__ = stepping
        return prepared

    patch.set_attr(accelerator, "prepare", prepare_per_replica, keep_when_disabled=True)
    patch.set_attr(accelerator, "prepare_scheduler", prepare_scheduler_per_replica, keep_when_disabled=True)


def _log_batch(accelerator: Any, args: tuple, replicas: int, processes: int) -> None:
    """One line with the global batch of an optimizer step, which a script's log counts per process."""
    import torch

    loaders = [a for a in args if isinstance(a, torch.utils.data.DataLoader)]
    size = getattr(loaders[0], "batch_size", None) if loaders else None
    steps = accelerator.gradient_accumulation_steps
    total = (
        f"{size} x {replicas} x {steps} = {size * replicas * steps}"
        if size
        else f"batch x {replicas} x {steps}"
    )
    logger.info(
        "hfpatch: %d processes in %d data replica(s): an optimizer step trains on %s samples (per-replica batch "
        "x data replicas x accumulation; a log's `train_batch_size * accelerator.num_processes * "
        "gradient_accumulation_steps` counts every process). A scheduler prepared here steps once per data "
        "replica.",
        processes,
        replicas,
        total,
    )
