"""Streaming long-video generation with a block-causal Wan transformer (Self-Forcing / LongLive inference).

:class:`StreamingWanPipeline` is built from a stock ``WanPipeline`` (its transformer, VAE and scheduler
config) and generates ``num_frame_per_block`` latent frames at a time, as Self-Forcing's causal inference
(``pipeline/causal_inference.py``) and LongLive 1.0's interactive inference do:

1. each block starts from noise and is denoised with the few steps of ``denoising_step_list``; every
   step attends to the cached keys/values of earlier frames (flow matching: ``x0 = x_t - sigma * v``,
   then re-noised to the next step's sigma with fresh noise);
2. a *context pass* runs the clean ``x0`` once more, labelled with timestep ``context_noise`` (the input
   itself is not re-noised: only Self-Forcing's training rollout does that), and writes its keys and
   values into the cache, so later blocks see clean context;
3. the block's latents go through :class:`StreamingWanDecoder` and the new pixel frames are yielded.

A prompt schedule ``[(block, prompt_embeds), ...]`` switches prompts at block boundaries. At a switch the
recent frames are re-encoded under the new prompt in one forward (:func:`recache`, LongLive's
``_recache_after_switch``), so the new prompt's cross-attention shapes the context without a visual cut.
With ``global_sink=True`` (LongLive's released configs) the sink frames keep their keys from the first
prompt; with ``global_sink=False`` the cache restarts and the first re-encoded frames become the sink.

Distilled streaming models run without classifier-free guidance (the default); with ``guidance_scale > 1`` each
step runs a conditional and an unconditional branch, each with its own cache, one after the other or, under a
``cfg=2`` plan, on two halves of the ranks.

On several ranks (:meth:`StreamingWanPipeline.from_pipe` with ``parallel=``) every block's tokens are split over
the ranks, caches included (:mod:`hfpatch.streaming.sequence_parallel`), the VAE decode is split by height, and
every rank yields the same frames, equal to one process's for the same generator.

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
import torch.distributed as dist

from ..core.config import ModelFacts, ParallelConfig, resolve_parallel
from ..core.ranks import topology
from ..distributed.agreement import check_same_inputs
from ..distributed.collectives import all_gather
from .block_decode import InlineDecode as _InlineDecode  # noqa: F401  (reachable under its former name)
from .block_decode import SideStreamDecode as _SideStreamDecode  # noqa: F401  (reachable under its former name)
from .block_decode import decode_runner as _decode_runner
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


Generators = torch.Generator | list[torch.Generator] | None


def randn_tensor(shape: tuple[int, ...], generator: Generators, device: torch.device, dtype: torch.dtype):
    """Noise by diffusers' convention (``diffusers.utils.torch_utils.randn_tensor``): drawn on the generator's
    device (a CPU generator drives a CUDA model's noise) and moved to ``device``; a list seeds each batch item."""
    from diffusers.utils.torch_utils import randn_tensor as diffusers_randn_tensor

    device = torch.device(device)
    generators = generator if isinstance(generator, list) else [generator]
    if device.type == "cuda" and all(g is not None and g.device.type == "cpu" for g in generators):
        # The same draws on the CPU, then an asynchronous copy from pinned memory: a copy from pageable memory
        # first waits for every kernel queued on the stream, so the host would stall at every denoising step
        # instead of queueing the next one.
        noise = diffusers_randn_tensor(
            tuple(shape), generator=generator, device=torch.device("cpu"), dtype=dtype
        )
        return noise.pin_memory().to(device, non_blocking=True)
    return diffusers_randn_tensor(tuple(shape), generator=generator, device=device, dtype=dtype)


def renoise(x0: torch.Tensor, t: float, generator: Generators, num_train_timesteps: int) -> torch.Tensor:
    """Flow-matching forward process ``(1 - sigma) x0 + sigma * noise`` at timestep ``t``."""
    if t == 0:
        return x0
    sigma = t / num_train_timesteps
    noise = randn_tensor(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    return (1 - sigma) * x0 + sigma * noise


@torch.no_grad()
def recache(
    transformer: Any,
    cache: StreamingKVCache,
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    frame_offset: int,
    context_timestep: float = 0.0,
    *,
    global_sink: bool = True,
) -> None:
    """Re-encode the newest frames into ``cache`` under ``prompt_embeds``, as LongLive 1.0 does at a prompt switch.

    ``latents`` are the clean latents of the stream's newest frames ``[frame_offset, end)`` (LongLive passes
    its last ``local_attn_size`` frames; more are ignored). They run in one forward at ``context_timestep``,
    every frame attending to every other (no block-causal mask within the chunk), and their keys/values
    replace the cached ones; the cross-attention cache is dropped.

    * ``global_sink=True`` (LongLive's released inference configs): the cache keeps its sink frames, encoded
      under the earlier prompt. The frames of ``latents`` that the window holds (the newest
      ``local_attn_size - sink_size``; every non-sink frame with ``local_attn_size=-1``) are re-encoded,
      attending to the sink and to each other. Older frames of ``latents`` are not encoded: LongLive runs
      them as queries only and keeps no keys of theirs, so they change nothing.
    * ``global_sink=False``: the cache is cleared and the newest ``cache_frames`` frames of ``latents`` are
      encoded; the stream restarts at the first of them, so its first ``sink_size`` frames are the new sink.

    Raises:
        ValueError: If, with a global sink, ``latents`` do not end at the cache's newest frame.

    >>> import torch, hfpatch
    >>> from hfpatch.streaming import StreamingConfig, StreamingKVCache, recache
    >>> from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
    >>> model = tiny_wan_transformer()
    >>> config = StreamingConfig(num_frame_per_block=2, local_attn_size=6, sink_size=2)
    >>> patch = hfpatch.apply(model, streaming=config)
    >>> cache = StreamingKVCache(config, num_layers=len(model.blocks))
    >>> x = torch.randn(1, 4, 10, 4, 4)
    >>> with torch.no_grad():
    ...     for s in range(0, 10, 2):
    ...         _ = model(x[:, :, s:s + 2], torch.tensor([0]), wan_prompt_embeds(), kv_cache=cache, frame_offset=s)
    >>> sink = cache.keys[0][:, :2 * 4].clone()  # 2 sink frames x 4 tokens
    >>> recache(model, cache, x[:, :, 4:], wan_prompt_embeds(seed=2), frame_offset=4)  # frames 6..9 re-encoded
    >>> cache.frames(), torch.equal(cache.keys[0][:, :2 * 4], sink)
    ([0, 1, 6, 7, 8, 9], True)
    >>> recache(model, cache, x[:, :, 4:], wan_prompt_embeds(seed=2), frame_offset=4, global_sink=False)
    >>> cache.frames()   # the stream restarts at frame 4: frames 4 and 5 are the new sink
    [4, 5, 6, 7, 8, 9]
    >>> patch.remove()
    """
    config = cache.config
    end = frame_offset + latents.shape[2]
    cached = cache.frames()
    if global_sink and cached:
        if cached[-1] + 1 != end:
            raise ValueError(
                f"recache with a global sink re-encodes the newest frames: latents end at frame {end - 1}, "
                f"the cache at frame {cached[-1]}"
            )
        first = cache.start + config.sink_size  # the sink keeps its keys
        if config.local_attn_size != -1:  # LongLive keeps no keys of the frames older than the window
            first = max(first, end - (config.local_attn_size - config.sink_size))
        cache.reset_cross_attention()
    else:
        cache.reset()
        first = end - config.cache_frames
    first = max(first, frame_offset)
    if first >= end:
        return
    timestep = torch.full((latents.shape[0],), float(context_timestep), device=latents.device)
    transformer(
        latents[:, :, first - frame_offset :],
        timestep,
        prompt_embeds,
        kv_cache=cache,
        frame_offset=first,
        recache=True,
    )


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


def _stream_plan(parallel: int | ParallelConfig | None, transformer: Any) -> ParallelConfig:
    """The degrees of a stream on the launched world: an int plans Ulysses up to the head count and Ring for the
    rest (no CFG-parallel: guidance is a choice of :meth:`StreamingWanPipeline.stream`); an explicit
    ``ParallelConfig`` may set ``cfg=2``."""
    from ..distributed import runtime

    heads = transformer.config.num_attention_heads
    facts = ModelFacts(num_heads=heads, name="StreamingWanPipeline", pipeline=True)
    plan = resolve_parallel(parallel, runtime.launched_world_size(), facts, **topology())
    if plan.data > 1 or plan.pipefusion > 1:
        raise ValueError(
            f"StreamingWanPipeline splits one stream over its ranks (cfg, ring, ulysses, vae), got {plan}; for "
            "one stream per rank use parallel=1 on every rank"
        )
    return plan


def _transformer_plan(plan: ParallelConfig) -> int | ParallelConfig:
    """What the transformer is patched with: the sequence split, the CFG halves as replicas (its ``data``
    axis: each streams its own branch), or one process when nothing splits the tokens."""
    if plan.sequence_parallel == 1:
        return 1
    return ParallelConfig(data=plan.cfg, ring=plan.ring, ulysses=plan.ulysses, vae=plan.vae)


def _mesh_plan(plan: ParallelConfig) -> ParallelConfig:
    """The mesh whose ``data`` axis is the CFG group and whose ``world`` group checks a stream's inputs (the
    transformer's own mesh when it is split)."""
    return ParallelConfig(data=plan.cfg, ring=plan.ring, ulysses=plan.ulysses, vae=plan.vae)


class StreamingWanPipeline:
    """Block-by-block Wan video generation with a KV cache, streaming VAE decode and prompt switching.

    Args:
        transformer: A ``WanTransformer3DModel`` patched with ``streaming=config`` (see :meth:`from_pipe`).
        vae: The ``AutoencoderKLWan`` of the pipeline.
        config: The :class:`StreamingConfig` the transformer was patched with.
        num_train_timesteps: Scale of the timesteps (1000 for Wan).
        patch: The patch to undo in :meth:`remove` (set by :meth:`from_pipe`).
        plan: The parallel degrees of the stream (set by :meth:`from_pipe`; ``None``: one process, or a
            transformer split by the caller, whose calls check their own inputs).
        vae_patch: The VAE split to undo in :meth:`remove` (set by :meth:`from_pipe`).
    """

    def __init__(
        self,
        transformer: Any,
        vae: Any,
        config: StreamingConfig,
        num_train_timesteps: int = 1000,
        patch: Any = None,
        plan: ParallelConfig | None = None,
        vae_patch: Any = None,
    ) -> None:
        self.transformer, self.vae, self.config = transformer, vae, config
        self.num_train_timesteps = num_train_timesteps
        self.patch, self.vae_patch = patch, vae_patch
        self.plan = ParallelConfig() if plan is None else plan
        # The cache of the stream in progress (this rank's guidance branch under CFG-parallel; the conditional
        # branch otherwise), and the unconditional branch's under sequential CFG (for inspection).
        self.cache: StreamingKVCache | None = None
        self.uncond_cache: StreamingKVCache | None = None
        self._world_group = self._cfg_group = None
        if self.plan.world_size > 1:
            from ..distributed import runtime

            mesh = runtime.get_mesh(_mesh_plan(self.plan))
            self._world_group, self._cfg_group = mesh.group("world"), mesh.group("data")

    @classmethod
    def from_pipe(
        cls, pipe: Any, config: StreamingConfig, parallel: int | ParallelConfig | None = None
    ) -> StreamingWanPipeline:
        """Patch ``pipe.transformer`` for streaming (split over the ranks of ``parallel``, and ``pipe.vae`` with
        it) and wrap them; undo with :meth:`remove`.

        Args:
            pipe: A stock ``WanPipeline`` (one transformer).
            config: How the transformer streams.
            parallel: ``None`` (every rank of the launched world), an int number of ranks (Ulysses up to the
                head count, the rest Ring; no CFG-parallel) or a :class:`hfpatch.ParallelConfig` with ``cfg``
                (1, or 2 to run the guidance branches of :meth:`stream` on two halves of the ranks), ``ring``,
                ``ulysses`` and ``vae`` (the VAE split; ``vae=1`` decodes whole on every rank, overlapped with
                the transformer on CUDA). Every rank must call this, and then :meth:`stream`, with the same
                arguments.

        Raises:
            ValueError: Degrees that do not fit the world or the model (``data``/``pipefusion`` are refused), a
                pipeline with ``transformer_2``.
        """
        import hfpatch

        if getattr(pipe, "transformer_2", None) is not None:
            raise ValueError(
                "StreamingWanPipeline supports one transformer; this WanPipeline has transformer_2"
            )
        plan = _stream_plan(parallel, pipe.transformer)
        patch = hfpatch.apply(pipe.transformer, parallel=_transformer_plan(plan), streaming=config)
        vae_patch = None
        try:
            if plan.vae > 1:
                vae_patch = hfpatch.apply(pipe.vae, parallel=ParallelConfig(vae=plan.vae))
            return cls(
                pipe.transformer, pipe.vae, config, pipe.scheduler.config.num_train_timesteps, patch, plan,
                vae_patch,
            )  # fmt: skip
        except BaseException:
            if vae_patch is not None:
                vae_patch.remove()
            patch.remove()
            raise

    def remove(self) -> None:
        """Restore the stock transformer (and VAE)."""
        for patch in (self.vae_patch, self.patch):
            if patch is not None:
                patch.remove()

    # ------------------------------------------------------------------------------------------- branches
    @property
    def _cfg_rank(self) -> int:
        """This rank's guidance branch under CFG-parallel: 0 conditional, 1 unconditional."""
        return 0 if self._cfg_group is None else dist.get_rank(self._cfg_group)

    def _branch(
        self,
        x: torch.Tensor,
        t: float,
        prompt: torch.Tensor,
        cache: StreamingKVCache | None,
        offset: int,
        context: torch.Tensor | None,
        context_noise: float,
    ) -> torch.Tensor:
        """The transformer's velocity for one guidance branch (``context``: uncached reference mode)."""
        batch, n = x.shape[0], x.shape[2]
        if context is None:
            return self.transformer(
                x,
                torch.full((batch,), float(t), device=x.device),
                prompt,
                kv_cache=cache,
                frame_offset=offset,
            ).sample
        ts = torch.cat(
            [
                torch.full((batch, context.shape[2]), float(context_noise), device=x.device),
                torch.full((batch, n), float(t), device=x.device),
            ],
            dim=1,
        )
        return self.transformer(
            torch.cat([context, x], 2), ts, prompt, frame_offset=offset - context.shape[2]
        ).sample[:, :, -n:]

    def _velocity(
        self,
        x: torch.Tensor,
        t: float,
        prompt: torch.Tensor,
        negative: torch.Tensor | None,
        guidance: float | None,
        offset: int,
        context: torch.Tensor | None,
        context_noise: float,
    ) -> torch.Tensor:
        """The (guided) velocity: ``v_u + g (v_c - v_u)`` as diffusers' ``WanPipeline`` combines it."""
        args = (offset, context, context_noise)
        if guidance is None:
            return self._branch(x, t, prompt, self.cache, *args)
        if self._cfg_group is None:  # both branches here, one after the other
            cond = self._branch(x, t, prompt, self.cache, *args)
            uncond = self._branch(x, t, negative, self.uncond_cache, *args)
        else:  # this rank's branch; the other half of the ranks computes the other one
            mine = self._branch(x, t, negative if self._cfg_rank else prompt, self.cache, *args)
            cond, uncond = all_gather(mine.unsqueeze(0).contiguous(), 0, self._cfg_group).unbind(0)
        return uncond + guidance * (cond - uncond)

    def _denoise_block(
        self,
        x: torch.Tensor,
        prompt: torch.Tensor,
        negative: torch.Tensor | None,
        guidance: float | None,
        offset: int,
        steps: Sequence[float],
        generator: Generators,
        context: torch.Tensor | None,
        context_noise: float,
    ) -> torch.Tensor:
        """Few-step denoising of one block; ``context`` (uncached reference mode) holds all earlier frames."""
        for i, t in enumerate(steps):
            v = self._velocity(x, t, prompt, negative, guidance, offset, context, context_noise)
            x0 = x - (t / self.num_train_timesteps) * v
            if i + 1 < len(steps):
                x = renoise(x0, steps[i + 1], generator, self.num_train_timesteps)
        return x0

    def _context_pass(self, x0, prompt, negative, guidance, offset, context_noise) -> None:
        """Write the clean block into the cache of every branch this rank runs, at timestep ``context_noise``."""
        timestep = torch.full((x0.shape[0],), float(context_noise), device=x0.device)
        if guidance is None:
            branches = [(prompt, self.cache)]
        elif self._cfg_group is None:
            branches = [(prompt, self.cache), (negative, self.uncond_cache)]
        else:
            branches = [(negative if self._cfg_rank else prompt, self.cache)]
        for branch_prompt, cache in branches:
            self.transformer(x0, timestep, branch_prompt, kv_cache=cache, frame_offset=offset)

    # ------------------------------------------------------------------------------------------- stream
    @torch.no_grad()
    def stream(
        self,
        prompt_embeds: PromptSchedule,
        num_blocks: int,
        height: int,
        width: int,
        denoising_step_list: Sequence[float] = (1000.0, 750.0, 500.0, 250.0),
        context_noise: float = 0.0,
        generator: Generators = None,
        output_type: str = "pt",
        use_cache: bool = True,
        global_sink: bool = True,
        overlap_decode: bool = True,
        guidance_scale: float = 1.0,
        negative_prompt_embeds: torch.Tensor | None = None,
    ) -> Iterator[StreamingOutput]:
        """Generate ``num_blocks`` blocks, yielding each as soon as it is decoded.

        Args:
            prompt_embeds: Text embeddings ``[B, T, text_dim]``, or a schedule ``[(start_block, embeds), ...]``
                starting at block 0; at each later start the newest frames are re-encoded under the new prompt
                (:func:`recache`).
            num_blocks: Blocks of ``num_frame_per_block`` latent frames to generate.
            height, width: Pixel size (multiples of the VAE factor times the patch size).
            denoising_step_list: Timesteps (0..1000, descending) of the few-step sampler; warp them with
                :func:`warp_denoising_steps` for models trained with a shifted schedule.
            context_noise: Timestep given to the context pass that writes a finished block's clean latents into
                the cache, and to the re-encode at a prompt switch (0 in the released Self-Forcing and
                LongLive configs). The latents themselves are not re-noised, as in both references.
            generator: Random generator(s) for the initial and re-noising noise, by diffusers' convention: on
                the CPU or on the transformer's device (a CPU generator gives the same video on any device),
                or a list of one per batch item. On several ranks, seed every rank alike (checked).
            output_type: ``"pt"`` (decoded frames) or ``"latent"`` (no decode).
            use_cache: ``False`` recomputes every earlier frame at every step instead of reading the cache
                (a reference for tests and benchmarks: same result, cost growing with the video).
            global_sink: At a prompt switch, keep the sink frames encoded under the earlier prompt (``True``,
                LongLive 1.0's ``global_sink: true``) or restart the cache so that the first re-encoded frames
                become the sink (``False``). An inference option, like LongLive's, not part of
                :class:`StreamingConfig`: it changes only what a switch does, not how the model attends.
            overlap_decode: On CUDA, decode each block on a second CUDA stream while the transformer works on
                the next one: block ``k`` is yielded once block ``k + 1``'s transformer work is queued (frames
                in order, one block later than in line, the same values: the same kernels run). Elsewhere (CPU,
                or a VAE split over ranks, whose collectives stay on one stream) the decode runs in line.
            guidance_scale: Classifier-free guidance ``v_u + g (v_c - v_u)`` when above 1: every step runs the
                conditional and the unconditional branch, each with its own cache (the unconditional one keeps
                its frames at a prompt switch: its prompt does not change). Under a ``cfg=2`` plan the two
                halves of the ranks run one branch each and exchange their velocities. Distilled streaming
                models run without guidance (the default 1: one branch).
            negative_prompt_embeds: The unconditional branch's text embeddings ``[B, T', text_dim]`` (needed
                when ``guidance_scale > 1``).

        Yields:
            :class:`StreamingOutput` per block, in order.

        Raises:
            ValueError: Bad arguments (on every rank alike, before any collective).
            InputMismatchError: On several ranks, when the ranks were given different arguments (prompts,
                generator states, sizes...), raised on every rank before anything runs.
        """
        schedule = _schedule(prompt_embeds)
        if not use_cache and len(schedule) > 1:
            raise ValueError(
                "use_cache=False is a reference for a single prompt; prompt switches need the cache"
            )
        if output_type not in ("pt", "latent"):
            raise ValueError(f"output_type must be 'pt' or 'latent', got {output_type!r}")
        guidance = self._guidance(guidance_scale, negative_prompt_embeds, schedule[0][1])
        n = self.config.num_frame_per_block
        vae_cfg = self.vae.config
        p_h = self.transformer.config.patch_size[1]
        scale = vae_cfg.scale_factor_spatial
        if height % (scale * p_h) or width % (scale * p_h):
            raise ValueError(f"height and width must be multiples of {scale * p_h}, got {height}x{width}")
        if self._world_group is not None:
            # Every rank computes one stream together: the same prompts, sizes and noise (generator states).
            check_same_inputs(
                {
                    "prompt_embeds": {str(b): p for b, p in schedule},
                    "num_blocks": num_blocks,
                    "height": height,
                    "width": width,
                    "denoising_step_list": [float(t) for t in denoising_step_list],
                    "context_noise": context_noise,
                    "generator": generator,
                    "output_type": output_type,
                    "use_cache": use_cache,
                    "global_sink": global_sink,
                    "guidance_scale": guidance_scale,
                    "negative_prompt_embeds": negative_prompt_embeds,
                },  # fmt: skip
                self._world_group,
                what="StreamingWanPipeline.stream",
                hint="Seed the generator alike on every rank (torch.Generator().manual_seed(seed)).",
            )
        batch = schedule[0][1].shape[0]
        shape = (batch, self.transformer.config.in_channels, n, height // scale, width // scale)
        dtype = self.transformer.dtype
        # On the device once (as x0.to(...) would make them at every block), not copied from the host per block.
        device = self.transformer.device
        mean = torch.tensor(vae_cfg.latents_mean).view(1, -1, 1, 1, 1).to(device, dtype)
        std = torch.tensor(vae_cfg.latents_std).view(1, -1, 1, 1, 1).to(device, dtype)

        self.cache = self._fresh_cache(self.cache, batch, shape, dtype)
        sequential_cfg = guidance is not None and self._cfg_group is None
        self.uncond_cache = (
            self._fresh_cache(self.uncond_cache, batch, shape, dtype) if sequential_cfg else None
        )
        decode = None
        if output_type == "pt":
            decoder = StreamingWanDecoder(self.vae)
            runner = _decode_runner(device, overlap_decode and not decoder.split)
            decode = runner(decoder, self.vae.dtype, mean, std)
        # Clean latents of earlier blocks: enough for the last cache_frames (recache), all without a cache.
        history: list[torch.Tensor] = []
        keep = None if not use_cache else -(-self.config.cache_frames // n)
        prompt_index = 0
        pending: tuple[StreamingOutput, Any] | None = None  # a block whose decode runs on the side stream
        for block in range(num_blocks):
            offset = block * n
            if prompt_index + 1 < len(schedule) and schedule[prompt_index + 1][0] == block:
                prompt_index += 1
                if self._cfg_rank == 0:  # the unconditional branch's prompt does not change
                    self._recache(history, schedule[prompt_index][1], offset, context_noise, global_sink)
            prompt = schedule[prompt_index][1]
            # Drawn in float32 and cast, so that a bf16 model gets the fp32 model's noise.
            noise = randn_tensor(shape, generator, self.transformer.device, torch.float32).to(dtype)
            context = None if use_cache or not history else torch.cat(history, 2)
            x0 = self._denoise_block(
                noise, prompt, negative_prompt_embeds, guidance, offset, denoising_step_list, generator,
                context, context_noise,
            )  # fmt: skip
            job = decode.submit(x0) if decode is not None else None  # before the context pass: it may overlap
            if use_cache:  # the context pass: clean x0 at timestep context_noise
                self._context_pass(x0, prompt, negative_prompt_embeds, guidance, offset, context_noise)
            history.append(x0)
            if keep is not None:
                history = history[-keep:]
            out = StreamingOutput(block, offset, x0, None, prompt_index)
            if decode is None:
                yield out
            elif not decode.deferred:
                out.frames = decode.result(job)
                yield out
            else:  # the previous block, now that this block's work is queued behind its decode
                if pending is not None:
                    pending[0].frames = decode.result(pending[1])
                    yield pending[0]
                pending = (out, job)
        if pending is not None:
            pending[0].frames = decode.result(pending[1])
            yield pending[0]

    def _guidance(
        self, guidance_scale: float, negative: torch.Tensor | None, prompt: torch.Tensor
    ) -> float | None:
        """The guidance scale to combine with (``None``: one branch), after checking it fits the plan."""
        if not isinstance(guidance_scale, (int, float)) or isinstance(guidance_scale, bool):
            raise ValueError(f"guidance_scale must be a number, got {guidance_scale!r}")
        if guidance_scale <= 1:
            if self.plan.cfg > 1:
                raise ValueError(
                    f"this stream runs CFG-parallel (plan {self.plan}), so it needs guidance: pass "
                    "guidance_scale > 1 and negative_prompt_embeds, or build it with cfg=1"
                )
            return None
        if negative is None:
            raise ValueError("guidance_scale > 1 runs an unconditional branch: pass negative_prompt_embeds")
        if negative.shape[0] != prompt.shape[0] or negative.shape[2:] != prompt.shape[2:]:
            raise ValueError(
                f"negative_prompt_embeds must be [B={prompt.shape[0]}, T', {prompt.shape[2]}] like the prompt, "
                f"got {list(negative.shape)}"
            )
        return float(guidance_scale)

    def _fresh_cache(
        self, cache: StreamingKVCache | None, batch: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> StreamingKVCache:
        """An empty cache for a new stream: ``cache`` reset when it has the layout (same buffers, so a compiled
        or CUDA-graph forward keeps its addresses), else a new one."""
        if cache is not None and cache.config == self.config and cache.keys is not None:
            _, _, _, h, w = shape
            _, p_h, p_w = self.transformer.config.patch_size
            tokens = (h // p_h) * (w // p_w)
            buffer = cache.keys[0]
            layout = (buffer.shape[0], cache.frame_tokens, buffer.dtype, buffer.device)
            if layout == (batch, tokens, dtype, self.transformer.device):
                cache.reset()
                return cache
        return StreamingKVCache(self.config, len(self.transformer.blocks))

    def _recache(
        self,
        history: list[torch.Tensor],
        prompt: torch.Tensor,
        offset: int,
        context_noise: float,
        global_sink: bool,
    ) -> None:
        """Re-encode the newest frames (at most ``cache_frames``, LongLive's ``local_attn_size``) under ``prompt``."""
        if not history:
            self.cache.reset()
            return
        frames = torch.cat(history, 2)[:, :, -self.config.cache_frames :]
        recache(
            self.transformer,
            self.cache,
            frames,
            prompt,
            offset - frames.shape[2],
            context_noise,
            global_sink=global_sink,
        )

    def __call__(
        self, prompt_embeds: PromptSchedule, num_blocks: int, height: int, width: int, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Generate the whole video; returns ``(latents [B, C, F, h, w], frames [B, f, 3, H, W] or None)``."""
        outs = list(self.stream(prompt_embeds, num_blocks, height, width, **kwargs))
        latents = torch.cat([o.latents for o in outs], 2)
        frames = None if outs[0].frames is None else torch.cat([o.frames for o in outs], 1)
        return latents, frames
