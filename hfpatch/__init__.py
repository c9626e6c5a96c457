"""hfpatch: make stock Hugging Face models scale across GPUs and fit in memory by patching them in place.

>>> import hfpatch
>>> from hfpatch.testing import tiny_autoencoder_kl
>>> vae = tiny_autoencoder_kl()
>>> patch = hfpatch.apply(vae)          # one process: nothing to split, still a live, removable patch
>>> patch.plan
ParallelConfig(data=1, cfg=1, ring=1, ulysses=1, vae=1)
>>> patch.remove()
"""

from .core.apply import apply, get_patch
from .core.config import ModelFacts, ParallelConfig
from .core.patch import Patch, PatchError
from .core.registry import PatchFamily, default_registry
from .distributed.gradients import all_reduce_gradients

__version__ = "0.1.0"


def register_patch(class_key: str, family: type[PatchFamily] | str) -> None:
    """Register a patch family for a class (``"diffusers.MyTransformer"``); see :class:`PatchFamily`."""
    default_registry().register(class_key, family)


__all__ = [
    "ModelFacts",
    "ParallelConfig",
    "Patch",
    "PatchError",
    "PatchFamily",
    "__version__",
    "all_reduce_gradients",
    "apply",
    "get_patch",
    "register_patch",
]
