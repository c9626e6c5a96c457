"""Block-causal streaming for the stock diffusers ``WanTransformer3DModel`` (Self-Forcing / CausVid / LongLive).

``hfpatch.apply(transformer, streaming=StreamingConfig(...))`` makes the transformer block-causal and adds
keyword arguments to its ``forward``:

* ``frame_offset``: absolute index of the first latent frame of ``hidden_states``. Rotary embeddings use
  absolute frame positions (computed on the fly, so there is no maximum length), and blocks are aligned
  to multiples of ``num_frame_per_block``.
* ``kv_cache``: a :class:`~hfpatch.streaming.StreamingKVCache`. Each block of the input attends to the
  cached keys/values of the frames it can see (sink + window) and writes its own; text keys/values of the
  cross-attention are cached per prompt tensor. Without a cache the whole input runs at once under the
  block-causal visibility rule (training on chunks).
* ``recache`` (with ``kv_cache``): re-encode ``hidden_states`` into the cache as one chunk, the prompt-switch
  pass of :func:`~hfpatch.streaming.recache`. Its frames attend to each other with no block-causal mask and to
  the cached frames visible from the chunk's end that it does not rewrite, overwrite their own slots, and need
  not be whole blocks (:meth:`~hfpatch.streaming.StreamingKVCache.plan_chunk`).

``timestep`` may be ``[B]`` (one timestep for every frame) or ``[B, num_frames]`` (per frame; Self-Forcing
denoises the frames of a chunk at different noise levels). Per-frame timesteps reuse the stock per-token
modulation path of Wan 2.2 (``timestep.ndim == 2``), with the time embedding computed once per frame.

Parallelism: ``parallel=N`` (or ``ParallelConfig(ring=, ulysses=)``) splits every call's tokens over the ``sp``
ranks, caches included, and gives every rank the full output (:mod:`hfpatch.streaming.sequence_parallel`); every
rank must pass the same arguments (checked at each call, with the state of the cache), and the sequence-parallel
family of the DiT (``dit_usp``) is replaced by this one. ``data=D`` adds replicas that each stream their own
sequence (the CFG branches of :class:`~hfpatch.streaming.StreamingWanPipeline`, or data-parallel training); cfg
and PipeFusion degrees are refused (the pipeline runs CFG-parallel itself). For data-parallel training without a
split, apply with ``parallel=1`` and wrap the patched transformer in DDP/FSDP yourself.

What is patched (all reversible by ``patch.remove()``): the processors of every ``blocks[i].attn1`` and
``attn2``, and the ``forward`` of ``rope``, ``condition_embedder`` and the transformer itself (under a split also
of ``patch_embedding``, which keeps this rank's tokens, and ``proj_out``, which gathers them).

>>> import torch, hfpatch
>>> from hfpatch.streaming import StreamingConfig
>>> from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
>>> model = tiny_wan_transformer()
>>> patch = hfpatch.apply(model, streaming=StreamingConfig(num_frame_per_block=2))
>>> out = model(torch.randn(1, 4, 4, 4, 4), torch.tensor([[900, 900, 10, 10]]), wan_prompt_embeds()).sample
>>> tuple(out.shape)
(1, 4, 4, 4, 4)
>>> patch.remove()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.compile import check_cuda_graphs, compiled_variant
from ..core.config import ModelFacts, ParallelConfig
from ..core.patch import Patch
from ..core.registry import PatchFamily
from ..distributed.agreement import check_same_inputs
from ..distributed.gradients import average_input_gradients
from .attention_processors import (
    StreamingCall,
    StreamingCallState,
    StreamingCrossAttnProcessor,
    StreamingSelfAttnProcessor,
    cached_text,
)
from .kv_cache import StreamingConfig, StreamingKVCache, to_device, visible_frames
from .sequence_parallel import (
    StreamShard,
)

__all__ = ["StreamingConfig", "WanStreamingPatch"]


def _token_index(frames: list[int], tokens_per_frame: int, device: torch.device) -> torch.Tensor:
    """Token positions of whole frames (frame ``f`` covers ``[f * tokens_per_frame, (f + 1) * tokens_per_frame)``)."""
    frame = torch.tensor(frames, dtype=torch.long)[:, None]
    return to_device((frame * tokens_per_frame + torch.arange(tokens_per_frame)).flatten(), device)


def _rope_forward(state: StreamingCallState, rope: Any) -> Callable:
    """``rope.forward`` at absolute frame positions ``frame_offset + i``, computed on the fly (no max length).

    Same frequencies and layout as ``WanRotaryPosEmbed.forward``; the height/width parts come from its table.
    The positions come as a tensor (:attr:`StreamingCall.positions`), so a compiled forward serves every block.
    """
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    # The dtype recipe of WanRotaryPosEmbed.__init__, so positions inside its table give identical values.
    dtype = torch.float32 if torch.backends.mps.is_available() else torch.float64

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p_t, p_h, p_w = rope.patch_size
        frames, height, width = (
            hidden_states.shape[2] // p_t,
            hidden_states.shape[3] // p_h,
            hidden_states.shape[4] // p_w,
        )
        positions = state.current().positions
        t_cos, t_sin = get_1d_rotary_pos_embed(
            rope.t_dim, positions, 10000.0, use_real=True, repeat_interleave_real=True, freqs_dtype=dtype
        )
        tables = []
        for t_part, table in ((t_cos, rope.freqs_cos), (t_sin, rope.freqs_sin)):
            _, h_part, w_part = table.split([rope.t_dim, rope.h_dim, rope.w_dim], dim=1)
            shape = (frames, height, width, -1)
            parts = [
                t_part.to(table).view(frames, 1, 1, -1).expand(shape),
                h_part[:height].view(1, height, 1, -1).expand(shape),
                w_part[:width].view(1, 1, width, -1).expand(shape),
            ]
            tables.append(torch.cat(parts, dim=-1).reshape(1, frames * height * width, 1, -1))
        sp = state.current().sp
        if sp is not None:  # this rank's tokens
            tables = [t.index_select(1, sp.local_index) for t in tables]
        return tables[0], tables[1]

    return forward


def _condition_forward(state: StreamingCallState, original: Callable) -> Callable:
    """``condition_embedder.forward`` computing per-token timestep embeddings once per frame."""

    def forward(timestep, encoder_hidden_states, encoder_hidden_states_image=None, timestep_seq_len=None):
        if timestep_seq_len is None:
            return original(timestep, encoder_hidden_states, encoder_hidden_states_image)
        call = state.current()
        tpf = call.tokens_per_frame
        per_frame = timestep.view(-1, timestep_seq_len)[:, ::tpf].flatten()
        temb, proj, text, image = original(
            per_frame,
            encoder_hidden_states,
            encoder_hidden_states_image,
            timestep_seq_len=timestep_seq_len // tpf,
        )
        if call.sp is not None:  # the embedding of each of this rank's tokens' frame
            frames = call.sp.local_frames
            return temb.index_select(1, frames), proj.index_select(1, frames), text, image
        return temb.repeat_interleave(tpf, dim=1), proj.repeat_interleave(tpf, dim=1), text, image

    return forward


def _local_tokens_forward(state: StreamingCallState, original: Callable) -> Callable:
    """``patch_embedding.forward`` keeping this rank's tokens, ``[B, C, S_local]`` (the stock forward flattens and
    transposes it into ``[B, S_local, C]``)."""

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        out = original(hidden_states)
        call = state.call
        if call is None or call.sp is None:
            return out
        return out.flatten(2).index_select(2, call.sp.local_index)

    return forward


def _gather_forward(state: StreamingCallState, original: Callable) -> Callable:
    """``proj_out.forward`` gathering every rank's tokens into the full sequence (identical on every rank)."""

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        out = original(hidden_states)
        call = state.call
        if call is None or call.sp is None:
            return out
        return state.shard.gather(out, call.sp)

    return forward


def _frame_visibility(config: StreamingConfig, frame_offset: int, frames: int) -> torch.Tensor:
    """``[frames, frames]`` bool: query frame ``q`` of the call sees key frame ``k`` (block-causal rule)."""
    n = config.num_frame_per_block
    visible = torch.zeros(frames, frames, dtype=torch.bool)
    for s in range(0, frames, n):
        seen = [f - frame_offset for f in visible_frames(config, frame_offset, frame_offset + s + n)]
        visible[s : s + n, seen] = True
    return visible


class _Runner:
    """Runs the stock forward for one call: eagerly, or through the compiled graph of the call's kind.

    Kinds (``StreamingConfig(compile=True)``): one block with the cache in its warm-up (a key mask) or steady
    (every slot visible, no mask), with or without autograd. Each kind has its own compiled copy of one small
    function (:func:`~hfpatch.core.compile.compiled_variant`), so each compiles once and none recompiles.
    """

    def __init__(self, config: StreamingConfig, original: Callable) -> None:
        self.config, self.original = config, original
        self.compiled: dict[str, Callable] = {}
        self.static: set[int] = set()  # data_ptr of the tensors marked static for CUDA graphs

    def kind(self, call: StreamingCall) -> str | None:
        if not self.config.compile or call.keys is None or call.read_index is not None:
            return None  # no cache, a recache chunk, or the cache's first (allocating) call: eager
        return ("warmup" if call.key_mask is not None else "steady") + (
            "_grad" if torch.is_grad_enabled() else ""
        )

    def __call__(self, call: StreamingCall, *args: Any) -> Any:
        kind = self.kind(call)
        if kind is None:
            return self.original(*args)
        fn = self.compiled.get(kind)
        if fn is None:
            original = self.original

            def block_forward(*args):
                return original(*args)

            fn = self.compiled[kind] = compiled_variant(
                block_forward, f"wan streaming {kind}", backend=self.config.compile_backend,
                cuda_graphs=self.config.cuda_graphs,
            )  # fmt: skip
        if not self.config.cuda_graphs:
            return fn(*args)
        # The cache and the text keys/values live at fixed addresses for the whole stream: captured graphs read
        # and write them in place instead of copying them in and out at every replay.
        for tensor in [*call.keys, *call.values, *(t for kv in call.cross or () for t in kv)]:
            if tensor.data_ptr() not in self.static:
                torch._dynamo.mark_static_address(tensor)
                self.static.add(tensor.data_ptr())
        torch.compiler.cudagraph_mark_step_begin()
        result = fn(*args)
        # A replay reuses its output memory: hand the caller a tensor of its own.
        if isinstance(result, tuple):
            return tuple(t.clone() for t in result)
        return type(result)(sample=result.sample.clone())


def _transformer_forward(
    state: StreamingCallState, config: StreamingConfig, model: Any, original: Callable
) -> Callable:
    """The transformer ``forward`` with ``frame_offset``, ``kv_cache`` and ``recache`` (cache mode runs block by
    block, a recache as one chunk); under a split, checked over the ranks first."""
    runner = _Runner(config, original)
    shard = state.shard

    def forward(
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
        *,
        frame_offset: int = 0,
        kv_cache: StreamingKVCache | None = None,
        recache: bool = False,
    ):
        if shard is not None and state.call is None:
            # First, before anything that could raise on some ranks only or communicate: the ranks split ONE
            # call, so they must be given the same arguments and hold the same cache state.
            named = {
                "hidden_states": hidden_states, "timestep": timestep,
                "encoder_hidden_states": encoder_hidden_states,
                "encoder_hidden_states_image": encoder_hidden_states_image, "return_dict": return_dict,
                "attention_kwargs": attention_kwargs, "frame_offset": frame_offset, "recache": recache,
                "kv_cache": None if kv_cache is None else torch.tensor([kv_cache.start or 0, *kv_cache.frames()]),
            }  # fmt: skip
            check_same_inputs(
                named,
                shard.group,
                what=f"{type(model).__name__}.forward (streaming)",
                enabled=state.check_inputs,
                hint="Under sequence parallelism every rank of a stream passes the same latents, timesteps, "
                "prompt and noise (seed the generators alike) and keeps the same cache.",
            )
            for name, module in state.modules.items():
                if getattr(model, name) is not module:
                    raise RuntimeError(
                        f"{type(model).__name__}.{name} was replaced after hfpatch.apply (e.g. by a LoRA "
                        "wrapper); the sequence split lives on the module it replaced. Load adapters before "
                        "hfpatch.apply, or patch.remove() and apply again."
                    )
            # A trained module upstream (a text encoder) then gets the full gradient on every rank.
            hidden_states, timestep, encoder_hidden_states = average_input_gradients(
                (hidden_states, timestep, encoder_hidden_states), shard.group
            )
        return run(
            hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image, return_dict,
            attention_kwargs, frame_offset, kv_cache, recache,
        )  # fmt: skip

    def run(
        hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image, return_dict,
        attention_kwargs, frame_offset, kv_cache, recache,
    ):  # fmt: skip
        batch, _, frames, height, width = hidden_states.shape
        n = config.num_frame_per_block
        if recache:
            if kv_cache is None:
                raise ValueError("recache=True re-encodes frames into a cache: pass kv_cache=")
            if frame_offset < 0:
                raise ValueError(f"frame_offset must be >= 0, got {frame_offset}")
        elif frame_offset < 0 or frame_offset % n or frames % n:
            raise ValueError(
                f"streaming Wan runs whole blocks of num_frame_per_block={n} latent frames: got frame_offset="
                f"{frame_offset} and {frames} frames; both must be multiples of {n}"
            )
        timestep = torch.as_tensor(timestep, device=hidden_states.device)
        if timestep.ndim == 0:
            timestep = timestep.expand(batch)
        if timestep.ndim == 2 and tuple(timestep.shape) != (batch, frames):
            raise ValueError(
                f"timestep must be [batch] or per frame [batch, num_frames] = [{batch}, {frames}], "
                f"got {list(timestep.shape)}"
            )
        if timestep.ndim > 2:
            raise ValueError(f"timestep must be [batch] or [batch, num_frames], got {list(timestep.shape)}")
        if model.gradient_checkpointing and torch.is_grad_enabled():
            raise ValueError(
                "the streaming patch does not support gradient checkpointing yet (the recomputation in backward "
                "runs outside the forward that carries frame positions and the cache); call "
                "transformer.disable_gradient_checkpointing() or run under torch.no_grad()"
            )
        if state.call is not None:
            raise RuntimeError(
                "the streaming Wan transformer is not re-entrant (a forward is already running)"
            )
        if config.cuda_graphs:
            check_cuda_graphs(hidden_states.device, "StreamingConfig")

        if kv_cache is not None and frames > n and not recache:
            # Block-causal: a block never depends on later blocks, so running block by block is exact.
            outs = []
            for s in range(0, frames, n):
                ts = timestep[:, s : s + n] if timestep.ndim == 2 else timestep
                outs.append(
                    run(
                        hidden_states[:, :, s : s + n],
                        ts,
                        encoder_hidden_states,
                        encoder_hidden_states_image,
                        False,
                        attention_kwargs,
                        frame_offset + s,
                        kv_cache,
                        False,
                    )[0]  # fmt: skip
                )
            output = torch.cat(outs, dim=2)
            return (output,) if not return_dict else _output(output)

        _, p_h, p_w = model.config.patch_size  # the temporal patch size is 1 (checked in validate)
        tokens_per_frame = (height // p_h) * (width // p_w)
        if timestep.ndim == 2:
            timestep = timestep.repeat_interleave(tokens_per_frame, dim=1)  # the stock per-token path
        device = hidden_states.device
        positions = torch.arange(frame_offset, frame_offset + frames, device=device)
        call = StreamingCall(tokens_per_frame, positions)
        if kv_cache is not None:
            if kv_cache.keys is not None:  # the dtype is checked by the processors (autocast decides it)
                if shard is None:
                    kv_cache.check_layout(batch, tokens_per_frame, *_heads(model))
                else:
                    heads, head_dim = _heads(model)
                    kv_cache.check_layout(
                        batch, shard.slot_tokens(tokens_per_frame), shard.heads(heads)[1], head_dim,
                        shard=shard.describe(tokens_per_frame),
                    )  # fmt: skip
            plan = kv_cache.plan_chunk if recache else kv_cache.plan_block
            read, write = plan(frame_offset, frames)
            call.cache, call.keys, call.values = kv_cache, kv_cache.keys, kv_cache.values
            if shard is not None:
                call.sp = shard.cache_call(
                    frames, tokens_per_frame, write, read + write, config.cache_frames, device
                )
            else:
                call.write_index = _token_index(write, tokens_per_frame, device)
                if recache:
                    call.read_index = _token_index(read, tokens_per_frame, device)
                else:
                    call.key_mask = kv_cache.key_mask(read + write, tokens_per_frame, device)
            if not torch.is_grad_enabled():
                call.cross = cached_text(model, kv_cache, encoder_hidden_states, shard)
        elif shard is not None:
            visible = _frame_visibility(config, frame_offset, frames)
            call.sp = shard.chunk_call(frames, tokens_per_frame, visible, device)
        else:
            call.blocks = [
                (
                    s * tokens_per_frame,
                    (s + n) * tokens_per_frame,
                    _token_index(
                        [
                            f - frame_offset
                            for f in visible_frames(config, frame_offset, frame_offset + s + n)
                        ],
                        tokens_per_frame,
                        device,
                    ),
                )
                for s in range(0, frames, n)
            ]
        state.call = call
        try:
            result = runner(
                call,
                hidden_states,
                timestep,
                encoder_hidden_states,
                encoder_hidden_states_image,
                return_dict,
                attention_kwargs,
            )
        except BaseException:
            if kv_cache is not None:
                kv_cache.invalidate(frame_offset, frames)  # some layers already wrote these slots
            raise
        finally:
            state.call = None
        if kv_cache is not None:
            kv_cache.commit(frame_offset, frames)
        return result

    return forward


def _heads(model: Any) -> tuple[int, int]:
    """(heads, head_dim) of the self-attention keys."""
    return model.config.num_attention_heads, model.config.attention_head_dim


def _output(sample: torch.Tensor) -> Any:
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)


class WanStreamingPatch(PatchFamily):
    """Block-causal streaming (KV cache with window + sink, rope frame offset) for ``WanTransformer3DModel``.

    Options: ``streaming``, a :class:`StreamingConfig`, or ``None`` (default) to leave the model alone;
    ``check_inputs`` (default ``True``), the same-input check of every call under a sequence-parallel split.
    With ``streaming`` set this family runs the sequence split itself and replaces the DiT family
    (``dit_usp``) of the transformer.
    """

    name = "wan_streaming"
    options = {"streaming": None, "check_inputs": True}
    role = "transformer"
    split_axis = "sp"

    def facts(self, target: Any) -> ModelFacts:
        return ModelFacts(num_heads=target.config.num_attention_heads, name=type(target).__name__)

    def supersedes(self, options: dict[str, Any]) -> frozenset[str]:
        return frozenset({"dit_usp"}) if options["streaming"] is not None else frozenset()

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        streaming = options["streaming"]
        if streaming is None:
            return
        if not isinstance(streaming, StreamingConfig):
            raise TypeError(
                f"streaming must be an hfpatch.streaming.StreamingConfig or None, got {type(streaming).__name__}"
            )
        if config.cfg > 1:
            raise ValueError(
                f"streaming splits a transformer's tokens (ring/ulysses), not its guidance branches (got cfg="
                f"{config.cfg}); StreamingWanPipeline runs CFG-parallel itself: "
                "StreamingWanPipeline.from_pipe(pipe, config, parallel=ParallelConfig(cfg=2, ...))"
            )
        if config.pipefusion > 1:
            raise ValueError(
                f"streaming does not run under PipeFusion (got pipefusion={config.pipefusion}); split the tokens "
                "with ring/ulysses instead"
            )
        if config.data > 1 and config.sequence_parallel == 1:
            raise ValueError(
                f"data={config.data} without ring/ulysses leaves nothing to split; apply streaming with parallel=1 "
                "and wrap the streaming transformer in torch DDP/FSDP yourself, giving each rank its own batch"
            )
        if config.sequence_parallel > 1 and streaming.compile:
            raise ValueError(
                "StreamingConfig(compile=True) compiles the one-process streaming forward; with ring/ulysses > 1 "
                "the streaming transformer runs eagerly (not yet compiled): set compile=False"
            )
        cfg = target.config
        if cfg.added_kv_proj_dim is not None or cfg.image_dim is not None:
            raise ValueError(
                "streaming supports text-to-video WanTransformer3DModel only (no image cross-attention); "
                f"got added_kv_proj_dim={cfg.added_kv_proj_dim}, image_dim={cfg.image_dim}"
            )
        if cfg.patch_size[0] != 1:
            raise ValueError(
                f"streaming needs a temporal patch size of 1, got patch_size={tuple(cfg.patch_size)}"
            )
        fused = [
            i
            for i, b in enumerate(target.blocks)
            if getattr(b.attn1, "fused_projections", False) or getattr(b.attn2, "fused_projections", False)
        ]
        if fused:
            raise ValueError(
                f"blocks {fused} have fused QKV projections; call transformer.unfuse_qkv_projections() "
                "before applying streaming"
            )

    def apply(self, target: Any, patch: Patch, mesh: Any, options: dict[str, Any]) -> None:
        config: StreamingConfig | None = options["streaming"]
        if config is None:
            return
        shard = StreamShard.from_mesh(mesh) if mesh.config.sequence_parallel > 1 else None
        state = StreamingCallState(shard, bool(options["check_inputs"]))
        if shard is not None:
            for name, wrap in (("patch_embedding", _local_tokens_forward), ("proj_out", _gather_forward)):
                module = getattr(target, name)
                patch.set_attr(module, "forward", wrap(state, module.forward))
                state.modules[name] = module
        for i, block in enumerate(target.blocks):
            patch.swap_processor(block.attn1, StreamingSelfAttnProcessor(state, config, i))
            patch.swap_processor(block.attn2, StreamingCrossAttnProcessor(state, i))
        patch.set_attr(target.rope, "forward", _rope_forward(state, target.rope))
        patch.wrap_method(target.condition_embedder, "forward", lambda orig: _condition_forward(state, orig))
        patch.wrap_method(target, "forward", lambda orig: _transformer_forward(state, config, target, orig))
