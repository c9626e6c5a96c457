"""Streaming training (LongLive): continue a long sequence chunk by chunk with a KV cache and a gradient mask.

:class:`StreamingTrainingModel` drives a streaming-patched ``WanTransformer3DModel`` (the student generator)
through one long video per sequence. Each call of :meth:`~StreamingTrainingModel.generate_next_chunk`

* picks ``f_new`` new frames in ``[min_new_frames, chunk_size]`` (whole blocks; the first chunk of a
  sequence is all new) and fills the rest of a fixed ``chunk_size`` chunk with the tail of the previous
  chunk (overlap), so the critic and the loss always see the same chunk length;
* generates the new frames block by block against the KV cache: the few-step sampler runs without a
  graph except at one randomly drawn *exit step* per block, whose prediction is the block's output;
  a context pass then writes the clean block into the cache (no graph);
* returns the chunk ``[B, C, chunk_size, h, w]`` and a :class:`ChunkInfo` whose ``gradient_mask``
  (``[B, chunk_size]``) marks the new frames: only they carry gradients (overlap frames and the cache
  are detached), so a loss masked with it trains exactly the frames generated in this step.

``requires_grad=False`` (the critic path) runs everything under ``torch.no_grad``. Random choices that
shape the computation (``f_new``, exit steps) are drawn from a generator seeded identically on every
rank and broadcast from rank 0 of ``group`` under ``torch.distributed``, so every rank runs the same
number of forwards (FSDP/DDP collectives stay in step). Noise comes from the caller's per-rank generator.

Differences from LongLive: no first-frame re-encode (text-to-video only) and no prompt switch during
training (the inference pipeline has it, see :class:`~hfpatch.streaming.StreamingWanPipeline`).

>>> import torch, hfpatch
>>> from hfpatch.streaming import StreamingConfig, StreamingTrainingModel
>>> from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
>>> model = tiny_wan_transformer()
>>> config = StreamingConfig(num_frame_per_block=2, local_attn_size=6)
>>> patch = hfpatch.apply(model, streaming=config)
>>> trainer = StreamingTrainingModel(model, config, chunk_size=6, min_new_frames=2, denoising_step_list=(1000, 500))
>>> trainer.setup_sequence(wan_prompt_embeds(), latent_shape=(4, 4, 4), max_length=14)
>>> chunk, info = trainer.generate_next_chunk(requires_grad=True, generator=torch.Generator().manual_seed(0))
>>> tuple(chunk.shape), info.gradient_mask.tolist(), chunk.requires_grad
((1, 4, 6, 4, 4), [[True, True, True, True, True, True]], True)
>>> chunk, info = trainer.generate_next_chunk(requires_grad=False, generator=torch.Generator().manual_seed(1))
>>> info.chunk_start_frame + chunk.shape[2] == trainer.current_length, chunk.requires_grad
(True, False)
>>> patch.remove()
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .kv_cache import StreamingConfig, StreamingKVCache
from .pipeline import Generators, randn_tensor, renoise

__all__ = ["ChunkInfo", "StreamingTrainingModel"]


@dataclass
class ChunkInfo:
    """What :meth:`StreamingTrainingModel.generate_next_chunk` produced.

    Attributes:
        chunk_start_frame: Absolute latent frame of ``chunk[:, :, 0]``.
        new_frames: Frames generated in this call (the last ``new_frames`` of the chunk).
        gradient_mask: ``[B, chunk_size]`` bool, True on the new frames (the only ones with gradients).
        exit_steps: Per generated block, the index in ``denoising_step_list`` whose prediction was kept.
        exit_timesteps: The corresponding timesteps (for losses that depend on the denoised range).
    """

    chunk_start_frame: int
    new_frames: int
    gradient_mask: torch.Tensor
    exit_steps: list[int]
    exit_timesteps: list[float]


class StreamingTrainingModel:
    """Chunked streaming generation for training a block-causal Wan generator (LongLive-style).

    Args:
        transformer: A ``WanTransformer3DModel`` patched with ``streaming=config``.
        config: The :class:`StreamingConfig` of the patch.
        chunk_size: Frames per training chunk (a multiple of ``num_frame_per_block``; LongLive uses 21).
        min_new_frames: Fewest new frames per later chunk (LongLive uses 18).
        denoising_step_list: Timesteps of the few-step sampler (descending).
        context_noise: Timestep of the context pass that writes a finished block into the cache.
        num_train_timesteps: Timestep scale (1000 for Wan).
        seed: Seed of the shared generator for structural random choices (same on every rank).
        group: Process group whose rank 0 broadcasts those choices (default: the world, when initialised).

    Raises:
        ValueError: If the chunk sizes are not whole blocks or out of range.
    """

    def __init__(
        self,
        transformer: Any,
        config: StreamingConfig,
        *,
        chunk_size: int = 21,
        min_new_frames: int = 18,
        denoising_step_list: Sequence[float] = (1000.0, 750.0, 500.0, 250.0),
        context_noise: float = 0.0,
        num_train_timesteps: int = 1000,
        seed: int = 0,
        group: Any = None,
    ) -> None:
        n = config.num_frame_per_block
        if chunk_size % n or min_new_frames % n:
            raise ValueError(
                f"chunk_size={chunk_size} and min_new_frames={min_new_frames} must be multiples of "
                f"num_frame_per_block={n} (whole blocks are generated)"
            )
        if not 0 < min_new_frames <= chunk_size:
            raise ValueError(f"min_new_frames must be in [1, chunk_size={chunk_size}], got {min_new_frames}")
        self.transformer, self.config = transformer, config
        self.chunk_size, self.min_new_frames = chunk_size, min_new_frames
        self.denoising_step_list = [float(t) for t in denoising_step_list]
        self.context_noise, self.num_train_timesteps = float(context_noise), num_train_timesteps
        self.group = group
        self._shared = torch.Generator().manual_seed(seed)
        self.cache = StreamingKVCache(config, len(transformer.blocks))
        self.prompt_embeds: torch.Tensor | None = None
        self.current_length = 0
        self.max_length = 0
        self.previous_frames: torch.Tensor | None = None

    # ------------------------------------------------------------------------------ shared random
    def shared_randint(self, low: int, high: int, size: int = 1) -> list[int]:
        """``size`` ints in ``[low, high)``, identical on every rank (drawn on all, broadcast from rank 0)."""
        values = torch.randint(low, high, (size,), generator=self._shared)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            device = (
                self.transformer.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
            )
            values = values.to(device)
            dist.broadcast(
                values, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
            )
        return values.cpu().tolist()

    # ---------------------------------------------------------------------------------- sequence
    def setup_sequence(
        self, prompt_embeds: torch.Tensor, latent_shape: tuple[int, int, int], max_length: int
    ) -> None:
        """Start a new sequence of at most ``max_length`` frames (reset the cache and overlap).

        Args:
            prompt_embeds: Text embeddings ``[B, T, text_dim]``.
            latent_shape: ``(channels, height, width)`` of a latent frame.
            max_length: Frames of this sequence (draw it with :meth:`shared_randint` to vary it across steps).
        """
        if max_length < self.chunk_size:
            raise ValueError(
                f"max_length={max_length} must hold at least one chunk ({self.chunk_size} frames)"
            )
        self.cache.reset()
        self.prompt_embeds, self.latent_shape, self.max_length = (
            prompt_embeds,
            tuple(latent_shape),
            max_length,
        )
        self.current_length = 0
        self.previous_frames = None

    @property
    def sequence_done(self) -> bool:
        """True when fewer than ``min_new_frames`` frames fit before ``max_length`` (start a new sequence)."""
        return self.prompt_embeds is None or self.current_length + self.min_new_frames > self.max_length

    def generate_next_chunk(
        self, requires_grad: bool, generator: Generators = None
    ) -> tuple[torch.Tensor, ChunkInfo]:
        """Generate the next chunk of the sequence; see the module docstring.

        Args:
            requires_grad: Generator path (graph at each block's exit step) or critic path (no graph).
            generator: Per-rank generator(s) for the noise, by diffusers' convention (``randn_tensor``): on the
                CPU or on the model's device, or a list of one per batch item.

        Returns:
            ``(chunk [B, C, chunk_size, h, w], ChunkInfo)``.
        """
        if self.sequence_done:
            raise ValueError(
                f"the sequence is done ({self.current_length} of max_length={self.max_length} frames, "
                f"min_new_frames={self.min_new_frames}); call setup_sequence() first"
            )
        n = self.config.num_frame_per_block
        if self.previous_frames is None:
            new = self.chunk_size
        else:
            room = min(self.chunk_size, self.max_length - self.current_length) // n
            new = self.shared_randint(self.min_new_frames // n, room + 1)[0] * n
        blocks = new // n
        exits = self.shared_randint(0, len(self.denoising_step_list), blocks)

        with torch.no_grad() if not requires_grad else nullcontext():
            outs = [
                self._generate_block(self.current_length + b * n, exits[b], requires_grad, generator)
                for b in range(blocks)
            ]
        new_frames = torch.cat(outs, dim=2)
        overlap = self.chunk_size - new
        parts = [self.previous_frames[:, :, self.previous_frames.shape[2] - overlap :]] if overlap else []
        chunk = torch.cat(parts + [new_frames], dim=2)
        mask = torch.zeros(chunk.shape[0], self.chunk_size, dtype=torch.bool, device=chunk.device)
        mask[:, overlap:] = True
        info = ChunkInfo(
            self.current_length - overlap, new, mask, exits, [self.denoising_step_list[e] for e in exits]
        )
        self.current_length += new
        self.previous_frames = chunk.detach()
        return chunk, info

    def _generate_block(
        self, offset: int, exit_step: int, requires_grad: bool, generator: Generators
    ) -> torch.Tensor:
        """Few-step denoising of one block; a graph only at ``exit_step``; then the context pass."""
        batch = self.prompt_embeds.shape[0]
        device, dtype = self.transformer.device, self.transformer.dtype
        shape = (batch, self.latent_shape[0], self.config.num_frame_per_block, *self.latent_shape[1:])
        x = randn_tensor(shape, generator, device, torch.float32).to(dtype)  # drawn as the pipeline draws it
        steps = self.denoising_step_list
        for i, t in enumerate(steps[: exit_step + 1]):
            grad = requires_grad and i == exit_step
            with torch.enable_grad() if grad else torch.no_grad():
                v = self.transformer(
                    x,
                    torch.full((batch,), t, device=device),
                    self.prompt_embeds,
                    kv_cache=self.cache,
                    frame_offset=offset,
                ).sample
                x0 = x - (t / self.num_train_timesteps) * v
            if i < exit_step:
                x = renoise(x0, steps[i + 1], generator, self.num_train_timesteps)
        with torch.no_grad():
            context = renoise(x0.detach(), self.context_noise, generator, self.num_train_timesteps)
            self.transformer(
                context,
                torch.full((batch,), self.context_noise, device=device),
                self.prompt_embeds,
                kv_cache=self.cache,
                frame_offset=offset,
            )
        return x0
