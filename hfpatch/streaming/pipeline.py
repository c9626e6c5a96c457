"""Streaming long-video generation with a block-causal Wan transformer (Self-Forcing / LongLive inference).

:class:`StreamingWanPipeline` is built from a stock ``WanPipeline`` (its transformer, VAE and scheduler
config) and generates ``num_frame_per_block`` latent frames at a time:

1. each block starts from noise and is denoised with the few steps of ``denoising_step_list``; every
   step attends to the cached keys/values of earlier frames (flow matching: ``x0 = x_t - sigma * v``,
   then re-noised to the next step's sigma with fresh noise, as Self-Forcing does);
2. a *context pass* runs the clean block (re-noised to ``context_noise``) once more and writes its keys
   and values into the cache, so later blocks see clean context;
3. the block's latents go through :class:`StreamingWanDecoder` and the new pixel frames are yielded.

A prompt schedule ``[(block, prompt_embeds), ...]`` switches prompts at block boundaries. At a switch
the cache is reset and the last frames are re-encoded under the new prompt (:func:`recache`, LongLive's
recache), so the new prompt's cross-attention shapes the context without a visual cut.

Distilled streaming models run without classifier-free guidance; this pipeline has no CFG (it would need
a second cache per branch).

>>> import torch
>>> from hfpatch.streaming import StreamingConfig, StreamingWanPipeline
>>> from hfpatch.testing import tiny_wan_pipe, wan_prompt_embeds
>>> stream = StreamingWanPipeline.from_pipe(tiny_wan_pipe(), StreamingConfig(num_frame_per_block=2, local_attn_size=4))
>>> chunks = list(stream.stream(wan_prompt_embeds(), num_blocks=3, height=32, width=32,
...                             denoising_step_list=(1000, 500), generator=torch.Generator().manual_seed(0)))
>>> [tuple(c.frames.shape) for c in chunks]   # 1 + 4 * (6 - 1) = 21 pixel frames in all
[(1, 5, 3, 32, 32), (1, 8, 3, 32, 32), (1, 8, 3, 32, 32)]
>>> stream.remove()
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .kv_cache import StreamingConfig, StreamingKVCache
from .vae import StreamingWanDecoder

__all__ = ["StreamingOutput", "StreamingWanPipeline", "recache", "warp_denoising_steps"]

PromptSchedule = torch.Tensor | Sequence[tuple[int, torch.Tensor]]


@dataclass
class StreamingOutput:
    """One generated block.

    Attributes:
        block_index: Index of the block in the video.
        frame_offset: Absolute index of its first latent frame.
        latents: Clean latents ``[B, C, num_frame_per_block, h, w]``.
        frames: Decoded pixel frames ``[B, f, 3, H, W]`` in ``[0, 1]`` (``None`` for ``output_type="latent"``).
        prompt_index: Which entry of the prompt schedule produced it.
    """

    block_index: int
    frame_offset: int
    latents: torch.Tensor
    frames: torch.Tensor | None
    prompt_index: int


def warp_denoising_steps(
    steps: Sequence[float], shift: float, num_train_timesteps: int = 1000
) -> list[float]:
    """Shift timesteps like ``FlowMatchEulerDiscreteScheduler(shift=...)`` (Self-Forcing's ``warp_denoising_step``).

    >>> warp_denoising_steps([1000, 750, 500, 250], shift=5.0)
    [1000.0, 937.5, 833.33..., 625.0]
    """
    out = []
    for t in steps:
        s = t / num_train_timesteps
        out.append(num_train_timesteps * shift * s / (1 + (shift - 1) * s))
    return out


def _renoise(
    x0: torch.Tensor, t: float, generator: torch.Generator | None, num_train_timesteps: int
) -> torch.Tensor:
    """Flow-matching forward process ``(1 - sigma) x0 + sigma * noise`` at timestep ``t``."""
    if t == 0:
        return x0
    sigma = t / num_train_timesteps
    noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    return (1 - sigma) * x0 + sigma * noise


@torch.no_grad()
def recache(
    transformer: Any,
    cache: StreamingKVCache,
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    frame_offset: int,
    context_timestep: float = 0.0,
) -> None:
    """Rebuild ``cache`` from scratch over ``latents`` (frames ``[frame_offset, ...)``) under ``prompt_embeds``.

    The cache is reset (self- and cross-attention) and the frames are written block by block at context
    timestep, as LongLive does after a prompt switch. The stream restarts at ``frame_offset``, so the
    first ``sink_size`` recached frames become the new sink.
    """
    cache.reset()
    timestep = torch.full((latents.shape[0],), float(context_timestep), device=latents.device)
    transformer(latents, timestep, prompt_embeds, kv_cache=cache, frame_offset=frame_offset)


def _schedule(prompts: PromptSchedule) -> list[tuple[int, torch.Tensor]]:
    if isinstance(prompts, torch.Tensor):
        return [(0, prompts)]
    schedule = sorted((int(b), p) for b, p in prompts)
    if not schedule or schedule[0][0] != 0:
        raise ValueError(f"a prompt schedule must start at block 0, got starts {[b for b, _ in schedule]}")
    if len({b for b, _ in schedule}) != len(schedule):
        raise ValueError(
            f"a prompt schedule has one prompt per start block, got starts {[b for b, _ in schedule]}"
        )
    return schedule


class StreamingWanPipeline:
    """Block-by-block Wan video generation with a KV cache, streaming VAE decode and prompt switching.

    Args:
        transformer: A ``WanTransformer3DModel`` patched with ``streaming=config`` (see :meth:`from_pipe`).
        vae: The ``AutoencoderKLWan`` of the pipeline.
        config: The :class:`StreamingConfig` the transformer was patched with.
        num_train_timesteps: Scale of the timesteps (1000 for Wan).
        patch: The patch to undo in :meth:`remove` (set by :meth:`from_pipe`).
    """

    def __init__(
        self,
        transformer: Any,
        vae: Any,
        config: StreamingConfig,
        num_train_timesteps: int = 1000,
        patch: Any = None,
    ) -> None:
        self.transformer, self.vae, self.config = transformer, vae, config
        self.num_train_timesteps = num_train_timesteps
        self.patch = patch
        self.cache: StreamingKVCache | None = None  # the cache of the stream in progress (for inspection)

    @classmethod
    def from_pipe(cls, pipe: Any, config: StreamingConfig) -> StreamingWanPipeline:
        """Patch ``pipe.transformer`` for streaming and wrap it with ``pipe.vae``; undo with :meth:`remove`."""
        import hfpatch

        if getattr(pipe, "transformer_2", None) is not None:
            raise ValueError(
                "StreamingWanPipeline supports one transformer; this WanPipeline has transformer_2"
            )
        patch = hfpatch.apply(pipe.transformer, streaming=config)
        return cls(pipe.transformer, pipe.vae, config, pipe.scheduler.config.num_train_timesteps, patch)

    def remove(self) -> None:
        """Restore the stock transformer."""
        if self.patch is not None:
            self.patch.remove()

    def _denoise_block(
        self,
        x: torch.Tensor,
        prompt: torch.Tensor,
        offset: int,
        steps: Sequence[float],
        generator: torch.Generator | None,
        context: torch.Tensor | None,
        context_noise: float,
    ) -> torch.Tensor:
        """Few-step denoising of one block; ``context`` (uncached reference mode) holds all earlier frames."""
        batch, n = x.shape[0], x.shape[2]
        for i, t in enumerate(steps):
            if context is None:
                v = self.transformer(
                    x, torch.full((batch,), float(t)), prompt, kv_cache=self.cache, frame_offset=offset
                ).sample
            else:
                ts = torch.cat(
                    [
                        torch.full((batch, context.shape[2]), float(context_noise)),
                        torch.full((batch, n), float(t)),
                    ],
                    dim=1,
                )
                v = self.transformer(
                    torch.cat([context, x], 2), ts, prompt, frame_offset=offset - context.shape[2]
                ).sample[:, :, -n:]
            x0 = x - (t / self.num_train_timesteps) * v
            if i + 1 < len(steps):
                x = _renoise(x0, steps[i + 1], generator, self.num_train_timesteps)
        return x0

    @torch.no_grad()
    def stream(
        self,
        prompt_embeds: PromptSchedule,
        num_blocks: int,
        height: int,
        width: int,
        denoising_step_list: Sequence[float] = (1000.0, 750.0, 500.0, 250.0),
        context_noise: float = 0.0,
        generator: torch.Generator | None = None,
        output_type: str = "pt",
        use_cache: bool = True,
    ) -> Iterator[StreamingOutput]:
        """Generate ``num_blocks`` blocks, yielding each as soon as it is decoded.

        Args:
            prompt_embeds: Text embeddings ``[B, T, text_dim]``, or a schedule ``[(start_block, embeds), ...]``
                starting at block 0; at each later start the cache is rebuilt under the new prompt.
            num_blocks: Blocks of ``num_frame_per_block`` latent frames to generate.
            height, width: Pixel size (multiples of the VAE factor times the patch size).
            denoising_step_list: Timesteps (0..1000, descending) of the few-step sampler; warp them with
                :func:`warp_denoising_steps` for models trained with a shifted schedule.
            context_noise: Timestep of the context pass that writes a finished block into the cache.
            generator: Random generator for the initial and re-noising noise (CPU).
            output_type: ``"pt"`` (decoded frames) or ``"latent"`` (no decode).
            use_cache: ``False`` recomputes every earlier frame at every step instead of reading the cache
                (a reference for tests and benchmarks: same result, cost growing with the video).

        Yields:
            :class:`StreamingOutput` per block.
        """
        schedule = _schedule(prompt_embeds)
        if not use_cache and len(schedule) > 1:
            raise ValueError(
                "use_cache=False is a reference for a single prompt; prompt switches need the cache"
            )
        if output_type not in ("pt", "latent"):
            raise ValueError(f"output_type must be 'pt' or 'latent', got {output_type!r}")
        n = self.config.num_frame_per_block
        vae_cfg = self.vae.config
        p_h = self.transformer.config.patch_size[1]
        scale = vae_cfg.scale_factor_spatial
        if height % (scale * p_h) or width % (scale * p_h):
            raise ValueError(f"height and width must be multiples of {scale * p_h}, got {height}x{width}")
        batch = schedule[0][1].shape[0]
        shape = (batch, self.transformer.config.in_channels, n, height // scale, width // scale)
        dtype = self.transformer.dtype
        mean = torch.tensor(vae_cfg.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae_cfg.latents_std).view(1, -1, 1, 1, 1)

        self.cache = StreamingKVCache(self.config, len(self.transformer.blocks))
        decoder = StreamingWanDecoder(self.vae) if output_type == "pt" else None
        # Context inputs of earlier blocks: the last cache_frames for recache, or all of them without a cache.
        history: list[torch.Tensor] = []
        keep = None if not use_cache else max(1, self.config.cache_frames // n)
        prompt_index = 0
        for block in range(num_blocks):
            offset = block * n
            if prompt_index + 1 < len(schedule) and schedule[prompt_index + 1][0] == block:
                prompt_index += 1
                self._recache(history, schedule[prompt_index][1], offset, context_noise)
            prompt = schedule[prompt_index][1]
            noise = torch.randn(shape, generator=generator).to(self.transformer.device, dtype)
            context = None if use_cache or not history else torch.cat(history, 2)
            x0 = self._denoise_block(
                noise, prompt, offset, denoising_step_list, generator, context, context_noise
            )
            context_input = _renoise(x0, context_noise, generator, self.num_train_timesteps)
            if use_cache:
                self.transformer(
                    context_input,
                    torch.full((batch,), float(context_noise)),
                    prompt,
                    kv_cache=self.cache,
                    frame_offset=offset,
                )
            history.append(context_input)
            if keep is not None:
                history = history[-keep:]
            frames = None
            if decoder is not None:
                z = x0.to(self.vae.dtype) * std.to(x0) + mean.to(x0)
                frames = (decoder.decode(z) / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
            yield StreamingOutput(block, offset, x0, frames, prompt_index)

    def _recache(
        self, history: list[torch.Tensor], prompt: torch.Tensor, offset: int, context_noise: float
    ) -> None:
        """Rebuild the cache under ``prompt`` from the last frames, so the next block sees sink + window."""
        n = self.config.num_frame_per_block
        # The next block sees at most cache_frames - n earlier frames: recache that many (whole blocks).
        blocks = min(len(history), (self.config.cache_frames - n) // n)
        if blocks == 0:
            self.cache.reset()
            return
        frames = torch.cat(history[-blocks:], 2)
        recache(self.transformer, self.cache, frames, prompt, offset - blocks * n, context_noise)

    def __call__(
        self, prompt_embeds: PromptSchedule, num_blocks: int, height: int, width: int, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Generate the whole video; returns ``(latents [B, C, F, h, w], frames [B, f, 3, H, W] or None)``."""
        outs = list(self.stream(prompt_embeds, num_blocks, height, width, **kwargs))
        latents = torch.cat([o.latents for o in outs], 2)
        frames = None if outs[0].frames is None else torch.cat([o.frames for o in outs], 1)
        return latents, frames
