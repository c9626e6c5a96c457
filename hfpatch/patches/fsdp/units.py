"""What ``shard_weights`` shards and over which ranks, pure: the FSDP units of a model (:func:`shard_units`), the
mesh axes of the groups (:func:`shard_axes`), and the byte counters of sharded parameters the tests and benchmarks
read (:func:`parameter_bytes`, :func:`gathered_parameter_bytes`, :class:`GatheredPeak`). The family that shards
is :mod:`hfpatch.patches.fsdp.sharding`.

>>> from hfpatch.patches.fsdp.units import shard_units
>>> from hfpatch.testing import tiny_wan_transformer
>>> [name for name, _ in shard_units(tiny_wan_transformer())]
['blocks.0', 'blocks.1']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ...core.config import ParallelConfig
from ...distributed import runtime
from ...distributed.stored import stored_tensors

__all__ = ["GatheredPeak", "gathered_parameter_bytes", "parameter_bytes", "shard_axes", "shard_units"]

_AXES = runtime.AXES
_ALIASES = {"sp": ("ring", "ulysses")}


# ----------------------------------------------------------------------------------------------- units
def _param_owners(model: torch.nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> the qualified names of the modules that register it (tied weights: several)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(name)
    return owners


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def shard_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The submodules of ``model`` that become their own FSDP unit, in module order (the rest is the root).

    The outermost modules whose class ``model`` names in ``_no_split_modules`` or ``_repeated_blocks``; for a
    model that names none, the elements of its ``nn.ModuleList`` s (outermost). A candidate whose parameters
    are also registered outside it (a tied embedding) is left to the root unit. Pure: nothing is changed.

    >>> from hfpatch.testing import tiny_t5_encoder
    >>> [name for name, _ in shard_units(tiny_t5_encoder())]   # `shared` is tied to encoder.embed_tokens
    ['encoder.block.0']
    """
    names = set(getattr(model, "_no_split_modules", None) or ()) | set(
        getattr(model, "_repeated_blocks", None) or ()
    )
    modules = [(n, m) for n, m in model.named_modules() if n]
    if names:
        matches = [(n, m) for n, m in modules if type(m).__name__ in names]
    else:
        matches = [
            (f"{n}.{i}", child)
            for n, m in modules
            if isinstance(m, torch.nn.ModuleList)
            for i, child in enumerate(m)
        ]
    owners = _param_owners(model)
    chosen: list[tuple[str, torch.nn.Module]] = []
    for name, module in matches:
        if any(_within(name, taken) for taken, _ in chosen):
            continue
        params = list(module.parameters())
        if not params:
            continue
        if any(not _within(owner, name) for p in params for owner in owners[id(p)]):
            continue  # tied to a module outside: FSDP needs the parameter in one unit
        chosen.append((name, module))
    return chosen


# ----------------------------------------------------------------------------------------------- measuring
def parameter_bytes(model: torch.nn.Module | Iterable[torch.Tensor]) -> int:
    """Bytes of parameter storage ``model`` (or the parameters given) holds on this rank now: the local shards
    (padding included) of sharded parameters, the full size of the others (a quantized weight's stored data and
    scales, its row shards under ``shard_weights``); each storage counted once, wherever it lives (in CPU memory
    under ``shard_weights_offload``).

    >>> import torch
    >>> parameter_bytes(torch.nn.Linear(4, 2))   # (8 + 2) fp32 values
    40
    """
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    for param in params:
        local = param.to_local() if isinstance(param, DTensor) else param
        for part in stored_tensors(local)[1]:  # a quantized weight: its data and scales
            storage = part.untyped_storage()
            if storage.data_ptr() in seen and storage.nbytes():
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def gathered_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the full (all-gathered) parameters ``model`` holds right now: the units FSDP2 has gathered
    for the block that runs (0 between calls: every unit is resharded after its forward). For a model that is
    not sharded, all of its parameters.

    >>> import torch
    >>> gathered_parameter_bytes(torch.nn.Linear(4, 2))
    40
    """
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if isinstance(param, DTensor):
            continue
        for part in stored_tensors(param)[1]:
            storage = part.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class GatheredPeak:
    """The most all-gathered parameter bytes (:func:`gathered_parameter_bytes`) ``model`` held at any module's
    entry or exit, from construction to :meth:`close`, which removes its hooks and returns that peak.

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> peak = GatheredPeak(model)
    >>> _ = model(torch.ones(1, 4))
    >>> peak.close()
    40
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.peak = model, 0
        self.handles = [m.register_forward_pre_hook(self._sample) for m in model.modules()]
        self.handles += [m.register_forward_hook(self._sample) for m in model.modules()]

    def _sample(self, *_: Any) -> None:
        self.peak = max(self.peak, gathered_parameter_bytes(self.model))

    def close(self) -> int:
        for handle in self.handles:
            handle.remove()
        return self.peak


# ----------------------------------------------------------------------------------------------- axes
def shard_axes(value: Any, config: ParallelConfig, *, name: str = "model") -> tuple[str, ...]:
    """The mesh axes (of :data:`hfpatch.distributed.runtime.AXES`, degree > 1) a model is sharded over.

    ``value`` is the ``shard_weights`` option: ``True`` (every axis), an axis name, ``"sp"`` (ring and
    ulysses) or a tuple of them. An empty result means every rank of the plan (a plan with no axis of degree
    > 1, e.g. a VAE-only ``ParallelConfig(vae=N)``: the model runs whole, in step, on every rank). Pure.

    Raises:
        ValueError: An unknown axis, PipeFusion, or a selection that leaves one rank per group.

    >>> from hfpatch import ParallelConfig
    >>> shard_axes(True, ParallelConfig(cfg=2, ulysses=2))
    ('cfg', 'ulysses')
    >>> shard_axes("sp", ParallelConfig(data=2, ring=2, ulysses=2))
    ('ring', 'ulysses')
    """
    if config.pipefusion > 1:
        raise ValueError(
            f"shard_weights cannot shard {name} under PipeFusion (pipefusion={config.pipefusion}): its stages run "
            "different blocks at different times, so no group of ranks gathers the same block together, and "
            "PipeFusion already keeps only its stage's blocks on each rank (pipefusion_release_weights). Use "
            "shard_weights with ulysses/ring/cfg/data, or PipeFusion without it"
        )
    active = [axis for axis in _AXES if getattr(config, axis) > 1]
    if value is True:
        if not active and config.world_size > 1:
            return ()  # a VAE-only plan: the model runs whole, in step, on every rank
        axes = active
    else:
        names = (value,) if isinstance(value, str) else value
        if not isinstance(names, tuple) or not names or not all(isinstance(n, str) for n in names):
            raise ValueError(
                "shard_weights must be False, True (every rank of the plan), a mesh axis name or a tuple of them "
                f"(from {', '.join(_AXES)}, or 'sp' for ring and ulysses); got {value!r}"
            )
        expanded = [axis for n in names for axis in _ALIASES.get(n, (n,))]
        unknown = [n for n in expanded if n not in _AXES]
        if unknown:
            raise ValueError(
                f"shard_weights names unknown mesh axis {unknown[0]!r}; known: {', '.join(_AXES)} and 'sp'"
            )
        axes = [axis for axis in _AXES if axis in expanded and getattr(config, axis) > 1]
    if not axes:
        raise ValueError(
            f"shard_weights={value!r} leaves one rank per group for {name} under {config} (the axes it names have "
            "degree 1): there is nothing to shard over. Use more ranks, other axes, or shard_weights=False"
        )
    return tuple(axes)
