"""Training features bigger than a patch: bounded-memory pixel loss, video VAE checkpointed over time, GradCache
and its row-blocked contrastive losses (InfoNCE/MNRL, CLIP, GIST, SigLIP).

Importing this package imports torch only (no diffusers/transformers); ``GradCacheTrainer`` imports
transformers, so it loads on first access; so do ``GradCacheLoss`` and ``tiny_sentence_transformer``
(:mod:`hfpatch.training.sentence_transformers`, which needs sentence-transformers).
"""

from .contrastive import CLIPLoss, ContrastiveLoss, GISTLoss, InfoNCELoss, SigLIPLoss
from .gradcache import GradCache, RngState, is_sentence_transformer, split_inputs
from .pixel_loss import chunked_pixel_loss
from .pooling import pool
from .video_vae import checkpointed_decode, checkpointed_encode
from .vlm_split import VisionTokenSpec, split_vlm_inputs

__all__ = [
    "CLIPLoss",
    "ContrastiveLoss",
    "GISTLoss",
    "GradCache",
    "GradCacheLoss",
    "GradCacheTrainer",
    "InfoNCELoss",
    "RngState",
    "SigLIPLoss",
    "VisionTokenSpec",
    "checkpointed_decode",
    "checkpointed_encode",
    "chunked_pixel_loss",
    "is_sentence_transformer",
    "pool",
    "split_inputs",
    "split_vlm_inputs",
    "tiny_sentence_transformer",
]


def __getattr__(name: str):
    if name == "GradCacheTrainer":
        from .trainer import GradCacheTrainer

        return GradCacheTrainer
    if name in ("GradCacheLoss", "tiny_sentence_transformer"):
        from . import sentence_transformers

        return getattr(sentence_transformers, name)
    raise AttributeError(f"module 'hfpatch.training' has no attribute {name!r}")
