"""hfpatch: make stock Hugging Face models scale across GPUs and fit in memory by patching them in place.

>>> import hfpatch
>>> from hfpatch.testing import tiny_autoencoder_kl
>>> vae = tiny_autoencoder_kl()
>>> patch = hfpatch.apply(vae)          # one process: nothing to split, still a live, removable patch
>>> patch.plan
ParallelConfig(data=1, cfg=1, ring=1, ulysses=1, vae=1)
>>> patch.remove()

``import hfpatch`` itself imports no torch: the public names load on first access, so the ``hfpatch``
command (``--help``, ``--version``) starts in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from .api import ApplyMismatchError, apply
    from .core.config import ModelFacts, ParallelConfig
    from .core.patch import Patch, PatchError, get_patch
    from .core.registry import LikeRegistration, PatchFamily
    from .distributed.agreement import InputMismatchError, WeightMismatchError
    from .distributed.data import (
        StepRNG,
        data_parallel_loaders,
        data_parallel_sampler,
        prepare_accelerator,
        step_generator,
        step_rng,
    )
    from .distributed.gradients import all_reduce_gradients, register_ddp_hook
    from .distributed.runtime import CollectiveError
    from .loading import LoadError, from_pretrained

__version__ = "0.1.0"

# Public name -> the submodule that defines it, imported on first access (PEP 562).
_LAZY = {
    "apply": ".api",
    "get_patch": ".core.patch",
    "ModelFacts": ".core.config",
    "ParallelConfig": ".core.config",
    "Patch": ".core.patch",
    "PatchError": ".core.patch",
    "PatchFamily": ".core.registry",
    "all_reduce_gradients": ".distributed.gradients",
    "register_ddp_hook": ".distributed.gradients",
    "data_parallel_loaders": ".distributed.data",
    "data_parallel_sampler": ".distributed.data",
    "StepRNG": ".distributed.data",
    "prepare_accelerator": ".distributed.data",
    "step_generator": ".distributed.data",
    "step_rng": ".distributed.data",
    "InputMismatchError": ".distributed.agreement",
    "WeightMismatchError": ".distributed.agreement",
    "CollectiveError": ".distributed.runtime",
    "ApplyMismatchError": ".api",
    "from_pretrained": ".loading",
    "LoadError": ".loading",
}


def register_patch(class_key: str, family: type[PatchFamily] | str) -> None:
    """Register a patch family for a class (``"diffusers.MyTransformer"``); see :class:`PatchFamily`."""
    from .patches import default_registry

    default_registry().register(class_key, family)


def register_like(cls: type, like: type) -> LikeRegistration:
    """Patch ``cls``, a copy of the supported class ``like`` in another package (a trainer's own
    ``WanTransformer3DModel``), as ``like``; checks that both take the same arguments. Returns a handle whose
    ``remove()`` undoes it (also a context manager). See :func:`hfpatch.core.registry.register_like`.

    >>> import hfpatch, torch
    >>> from diffusers import WanTransformer3DModel
    >>> class NotACopy(torch.nn.Module):
    ...     def forward(self, x): ...
    >>> try:
    ...     hfpatch.register_like(NotACopy, WanTransformer3DModel)
    ... except ValueError as error:
    ...     print(str(error).split(": ", 1)[1])
    forward takes (self, x), WanTransformer3DModel.forward (self, hidden_states, timestep, ...); __init__ takes ...
    """
    from .core.registry import register_like as register
    from .patches import default_registry

    return register(cls, like, default_registry())


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "ApplyMismatchError",
    "CollectiveError",
    "InputMismatchError",
    "LoadError",
    "ModelFacts",
    "ParallelConfig",
    "Patch",
    "PatchError",
    "PatchFamily",
    "StepRNG",
    "WeightMismatchError",
    "__version__",
    "all_reduce_gradients",
    "apply",
    "data_parallel_loaders",
    "data_parallel_sampler",
    "from_pretrained",
    "get_patch",
    "prepare_accelerator",
    "register_ddp_hook",
    "register_like",
    "register_patch",
    "step_generator",
    "step_rng",
]
