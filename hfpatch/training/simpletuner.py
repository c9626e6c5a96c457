"""SimpleTuner's context parallelism through hfpatch: its ``context_parallel_size`` trains exactly, on any device.

SimpleTuner (>= 4.10, Python >= 3.12) ships its own copies of the diffusers models and its own context-parallel
switch (``context_parallel_size``, ``context_parallel_comm_strategy``), which hands the model to diffusers'
``enable_parallelism``. Run its training through this module instead of its ``train.py`` and the same switch
runs hfpatch's sequence parallelism (hfpatch's plan for SimpleTuner's model class, Ulysses for ``"alltoall"``,
Ring for ``"allgather"``, DDP over the data replicas), with the same results as SimpleTuner on one process::

    CONFIG_BACKEND=json CONFIG_PATH=config/config.json \\
        torchrun --nproc-per-node 4 -m hfpatch.training.simpletuner       # or: accelerate launch -m ...

with ``"context_parallel_size": 2`` in ``config.json``: 4 processes, 2 data replicas x Ulysses 2. Nothing of
SimpleTuner is edited; :func:`patch_simpletuner` changes four names of its modules for this process (undone by
``remove()``):

* ``apply_standalone_context_parallel`` (the trainer calls it on the trained model before
  ``accelerator.prepare``) runs :func:`hfpatch.apply` with ``ParallelConfig(data=replicas, ulysses|ring=cp)``,
  after SimpleTuner's options that cannot be split exactly are refused by name, on every rank, before the first
  step (``lora_dropout`` > 0: each rank would draw a mask for its own shard; ``tread_config``: TREAD routes a
  random subset of the whole sequence);
* ``scale_standalone_context_parallel_loss`` returns the loss as it is: SimpleTuner multiplies it by the
  context-parallel size to undo DDP's mean over the whole world, which hfpatch's sequence split already
  accounts for (its gradients under DDP are the unpatched model's);
* ``ContextParallelBatchSynchronizer.synchronized_rng`` (around ``prepare_batch``, where the noise and the
  timesteps are drawn) gives every rank of a context-parallel group the RNG states of the group's first rank
  (torch's CPU and CUDA generators, Python's ``random``, NumPy's) instead of SimpleTuner's reseeding by step. The
  first rank samples the batches (SimpleTuner's ``fetch_batch``) and draws what one process would draw, from
  the stream one process would have: the same noise and timesteps as a one-process run, after a resume too
  (accelerate restores each process's RNG states; SimpleTuner's reseeding restarted its counter from the
  optimizer step, and differed from a one-process run, which does not reseed);
* ``Trainer.init_seed`` (``seed_for_each_device``) offsets the seed by the data replica instead of the process, so
  a replica's ranks start alike and replica ``r`` draws what rank ``r`` of SimpleTuner's data parallelism draws.

The model must be a class hfpatch has a plan for (``hfpatch.patches.TRAINER_DIT_CLASSES``: SimpleTuner's Wan, Flux
and LTX-Video); another is refused with the class and its module named. Validation is SimpleTuner's: its
context-parallel validation calls the model on every rank of a group, which runs it patched (tested with Wan).

>>> from hfpatch.training.simpletuner import patch_simpletuner   # needs SimpleTuner installed to call
>>> callable(patch_simpletuner)
True
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import random
import runpy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SimpleTunerPatch", "main", "patch_simpletuner", "refused_options"]

TRAINER = "simpletuner.helpers.training.trainer"
SYNC = "simpletuner.helpers.data_backend.runtime.context_parallel_sync"


def refused_options(config: Any) -> list[str]:
    """SimpleTuner options set in ``config`` that a sequence-split forward cannot reproduce, each with the reason.

    >>> from types import SimpleNamespace
    >>> refused_options(SimpleNamespace(lora_dropout=0.1, tread_config=None))[0].split(":")[0]
    'lora_dropout=0.1'
    """
    refused = []
    dropout = getattr(config, "lora_dropout", 0.0) or 0.0
    if float(dropout) > 0 and getattr(config, "model_type", "lora") == "lora":
        refused.append(
            f"lora_dropout={dropout}: each rank would draw the dropout mask of its own shard of the tokens, not its "
            "slice of one process's mask; set it to 0"
        )
    if getattr(config, "tread_config", None):
        refused.append(
            "tread_config: TREAD drops a random subset of the whole token sequence between blocks, which the ranks' "
            "shards cannot draw alike; train without it"
        )
    return refused


def _parallel_config(topology: Any) -> Any:
    from ..core.config import ParallelConfig

    cp = int(topology.cp_size)
    degree = {"ulysses": cp} if topology.strategy == "alltoall" else {"ring": cp}
    return ParallelConfig(data=int(topology.dp_replicate_size), **degree)


def _check_layout(topology: Any) -> None:
    """SimpleTuner's topology as hfpatch runs it: DDP over replicas of ``cp`` ranks filling the launched world. Both
    put the data replicas outermost (replica ``r`` is ranks ``r * cp ... r * cp + cp - 1``), so hfpatch's
    sequence-parallel groups are then SimpleTuner's context-parallel groups, the ranks that share a batch."""
    world = dist.get_world_size()
    if getattr(topology, "dp_shard_size", 1) != 1:
        raise ValueError(
            "hfpatch's SimpleTuner integration runs context parallelism with DDP over the replicas; FSDP sharding "
            f"(dp_shard_size={topology.dp_shard_size}) is SimpleTuner's own path: set fsdp_enable false"
        )
    if topology.dp_replicate_size * topology.cp_size != world:
        raise ValueError(
            f"context_parallel_size={topology.cp_size} x {topology.dp_replicate_size} replicas is not the "
            f"{world} processes launched"
        )


def _broadcast_trained_weights(module: torch.nn.Module) -> None:
    """Rank 0's trained parameters on every rank: what DDP does when ``accelerator.prepare`` wraps the model, done
    before :func:`hfpatch.apply` checks that the ranks hold the same weights (SimpleTuner seeds each replica apart,
    so a LoRA starts differently on each). The frozen weights come from the same files on every rank (the check
    compares them)."""
    # NCCL sends CUDA tensors only, and the model may still be on the CPU here.
    on_gpu = dist.get_backend() == "nccl"
    with torch.no_grad():
        for parameter in module.parameters():
            if not parameter.requires_grad:
                continue
            sent = parameter.data.cuda() if on_gpu and parameter.device.type != "cuda" else parameter.data
            dist.broadcast(sent, src=0)
            if sent is not parameter.data:
                parameter.data.copy_(sent)


def _apply(original: Any, handle: SimpleTunerPatch) -> Any:
    def apply_standalone_context_parallel(accelerator: Any, module: Any, topology: Any) -> bool:
        if module is None or topology is None or topology.cp_size <= 1:
            return original(accelerator, module, topology)
        from simpletuner.helpers.training.state_tracker import StateTracker  # type: ignore[import-not-found]

        import hfpatch

        refused = refused_options(StateTracker.get_args())
        if refused:
            raise ValueError(
                "hfpatch (SimpleTuner context_parallel_size="
                f"{topology.cp_size}): these options cannot be trained exactly with the tokens split over ranks: "
                + "; ".join(refused)
            )
        _check_layout(topology)
        _broadcast_trained_weights(module)
        patch = hfpatch.apply(module, parallel=_parallel_config(topology))
        handle.patches.append(patch)
        handle.names.set_attr(
            module, "_simpletuner_context_parallel_enabled", True
        )  # SimpleTuner's own marker
        # In SimpleTuner's log, as its own lines.
        logging.getLogger("SimpleTuner").info("hfpatch.apply: %r", patch)
        return True

    return apply_standalone_context_parallel


def _unscaled_loss(loss: torch.Tensor, topology: Any) -> torch.Tensor:
    """hfpatch's gradient under DDP is the unpatched model's: no context-parallel factor."""
    return loss


def _replica_init_seed(set_seed: Any) -> Any:
    """SimpleTuner's ``Trainer.init_seed`` (the same seeds skipped), with ``seed_for_each_device`` offsetting the seed
    by the data replica instead of the process (accelerate's ``set_seed(seed, device_specific=True)``)."""

    def init_seed(self: Any) -> None:
        seed = self.config.seed
        if seed is None or seed == 0:
            return
        offset = 0
        if self.config.seed_for_each_device:
            from simpletuner.helpers.data_backend.runtime.context_parallel_sync import (  # type: ignore[import-not-found]
                get_cp_info,
                get_model_replica_data_info,
            )

            info = get_cp_info(self.accelerator)
            offset = (
                get_model_replica_data_info(self.accelerator, info)[1]
                if info[0]
                else self.accelerator.process_index
            )
        set_seed(seed + offset)

    return init_seed


def _rng_states(device: torch.device) -> dict[str, Any]:
    import numpy

    states = {"torch": torch.get_rng_state(), "random": random.getstate(), "numpy": numpy.random.get_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_states(states: dict[str, Any], device: torch.device) -> None:
    import numpy

    torch.set_rng_state(states["torch"])
    random.setstate(states["random"])
    numpy.random.set_state(states["numpy"])
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


@contextlib.contextmanager
def _leader_rng(synchronizer: Any, base_seed: Any, step: int) -> Iterator[None]:
    """Every rank of the context-parallel group continues the group leader's RNG streams (see the module)."""
    synchronizer._ensure_initialized()
    enabled, group, _, _ = synchronizer._cp_info
    if not enabled:
        yield
        return
    device = getattr(synchronizer.accelerator, "device", torch.device("cpu"))
    leader = dist.get_global_rank(group, 0)
    payload = [_rng_states(device) if dist.get_rank() == leader else None]
    dist.broadcast_object_list(
        payload, src=leader, group=group, device=device if device.type == "cuda" else None
    )
    _set_rng_states(payload[0], device)
    yield


class SimpleTunerPatch:
    """What :func:`patch_simpletuner` returns: ``remove()`` (or leaving its ``with`` block) restores SimpleTuner's
    names, and removes the hfpatch patches the trainer applied (``patches``)."""

    def __init__(self) -> None:
        from ..core.patch import Patch

        self.names = Patch(name="simpletuner")
        self.patches: list[Any] = []

    def remove(self) -> None:
        while self.patches:
            self.patches.pop().remove()
        self.names.remove()

    def __enter__(self) -> SimpleTunerPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def patch_simpletuner() -> SimpleTunerPatch:
    """Make SimpleTuner's ``context_parallel_size`` run hfpatch's sequence parallelism in this process (see the
    module): call before SimpleTuner builds its ``Trainer``. :func:`main` calls it and runs SimpleTuner's
    ``train.py``.

    Raises ``ImportError`` naming the requirement when SimpleTuner is not installed.
    """
    try:
        trainer = importlib.import_module(TRAINER)
        sync = importlib.import_module(SYNC)
    except ImportError as error:
        raise ImportError(
            f"hfpatch.training.simpletuner needs SimpleTuner (pip install simpletuner, Python >= 3.12): {error}"
        ) from error
    handle = SimpleTunerPatch()
    names = handle.names
    names.set_attr(
        trainer,
        "apply_standalone_context_parallel",
        _apply(trainer.apply_standalone_context_parallel, handle),
    )
    names.set_attr(trainer, "scale_standalone_context_parallel_loss", _unscaled_loss)
    names.set_attr(trainer.Trainer, "init_seed", _replica_init_seed(trainer.set_seed))
    names.set_attr(sync.ContextParallelBatchSynchronizer, "synchronized_rng", _leader_rng)
    return handle


def main() -> None:
    """``python -m hfpatch.training.simpletuner``: SimpleTuner's ``train.py`` with :func:`patch_simpletuner`
    applied (configured as SimpleTuner is: ``CONFIG_BACKEND``, ``CONFIG_PATH``, ``ENV``)."""
    patch_simpletuner()
    runpy.run_module("simpletuner.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
