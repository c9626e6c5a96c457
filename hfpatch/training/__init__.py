"""Training features bigger than a patch: bounded-memory pixel loss, GradCache.

Importing this package imports torch only (no diffusers/transformers); ``GradCacheTrainer`` imports
transformers, so it loads on first access.
"""

from .gradcache import GradCache, RngState, split_inputs
from .pixel_loss import chunked_pixel_loss
from .pooling import pool
from .vlm_split import VisionTokenSpec, split_vlm_inputs

__all__ = [
    "GradCache",
    "GradCacheTrainer",
    "RngState",
    "VisionTokenSpec",
    "chunked_pixel_loss",
    "pool",
    "split_inputs",
    "split_vlm_inputs",
]


def __getattr__(name: str):
    if name == "GradCacheTrainer":
        from .trainer import GradCacheTrainer

        return GradCacheTrainer
    raise AttributeError(f"module 'hfpatch.training' has no attribute {name!r}")
