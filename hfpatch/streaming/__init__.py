"""Streaming KV-cache video for Wan: cache, block-causal patch options, streaming VAE decode, pipeline, training.

Patch a transformer with ``hfpatch.apply(transformer, streaming=StreamingConfig(...))`` (see
:mod:`hfpatch.patches.wan_streaming`), then stream with :class:`StreamingWanPipeline` or train with
:class:`StreamingTrainingModel`.
"""

from .kv_cache import CrossAttentionCache, StreamingConfig, StreamingKVCache, visible_frames
from .pipeline import StreamingOutput, StreamingWanPipeline, recache, warp_denoising_steps
from .vae import StreamingWanDecoder

__all__ = [
    "CrossAttentionCache",
    "StreamingConfig",
    "StreamingKVCache",
    "StreamingOutput",
    "StreamingWanPipeline",
    "StreamingWanDecoder",
    "recache",
    "visible_frames",
    "warp_denoising_steps",
]
