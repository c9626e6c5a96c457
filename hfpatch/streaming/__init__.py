"""Streaming KV-cache video for Wan: cache, block-causal patch options, streaming VAE decode, pipeline, training.

Patch a transformer with ``hfpatch.apply(transformer, streaming=StreamingConfig(...))`` (see
:mod:`hfpatch.streaming.transformer`), then stream with :class:`StreamingWanPipeline` or train with
:class:`StreamingTrainingModel`.
"""

from .convert import convert_diffusers_to_native, convert_native_to_diffusers
from .kv_cache import CrossAttentionCache, StreamingConfig, StreamingKVCache, visible_frames
from .pipeline import StreamingOutput, StreamingWanPipeline, recache, warp_denoising_steps
from .training import ChunkInfo, StreamingTrainingModel
from .vae import StreamingWanDecoder

__all__ = [
    "ChunkInfo",
    "CrossAttentionCache",
    "StreamingConfig",
    "StreamingKVCache",
    "StreamingOutput",
    "StreamingTrainingModel",
    "StreamingWanPipeline",
    "StreamingWanDecoder",
    "convert_diffusers_to_native",
    "convert_native_to_diffusers",
    "recache",
    "visible_frames",
    "warp_denoising_steps",
]
