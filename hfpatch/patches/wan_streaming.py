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

Parallelism: none for the transformer yet. ``validate`` refuses any data, cfg, ring or ulysses degree above 1
(the pipeline's data/CFG wrapper cannot split ``frame_offset``/``kv_cache`` calls, and one cache serves one
guidance branch); only the VAE may split (``ParallelConfig(vae=N)``). For data-parallel training, wrap the
patched transformer in DDP/FSDP yourself.

What is patched (all reversible by ``patch.remove()``): the processors of every ``blocks[i].attn1`` and
``attn2``, and the ``forward`` of ``rope``, ``condition_embedder`` and the transformer itself.

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..core.config import ParallelConfig
from ..core.patch import Patch
from ..core.registry import PatchFamily
from ..streaming.kv_cache import StreamingConfig, StreamingKVCache, visible_frames, weights_version
from ._wan_common import wan_self_attention_qkv

__all__ = ["StreamingConfig", "WanStreamingPatch"]


@dataclass
class _Call:
    """What the processors of one transformer call need (set by the patched ``forward``)."""

    frame_offset: int
    tokens_per_frame: int
    prompt: torch.Tensor  # the encoder_hidden_states given to forward (cross-attention cache key)
    cache: StreamingKVCache | None
    weights: int | None = None  # weights_version(transformer) in cache mode (cross-attention cache key)
    # Cache mode: token positions in the cache buffers to read (earlier visible frames) and to write.
    read_index: torch.Tensor | None = None
    write_index: torch.Tensor | None = None
    # No-cache mode: per query block, (first token, end token, key token positions within the input).
    blocks: list[tuple[int, int, torch.Tensor]] | None = None


def _token_index(frames: list[int], tokens_per_frame: int, device: torch.device) -> torch.Tensor:
    """Token positions of whole frames (frame ``f`` covers ``[f * tokens_per_frame, (f + 1) * tokens_per_frame)``)."""
    frame = torch.tensor(frames, dtype=torch.long)[:, None]
    return (frame * tokens_per_frame + torch.arange(tokens_per_frame)).flatten().to(device)


class _CallState:
    """The call in flight; shared by the patched methods and processors of one transformer."""

    def __init__(self) -> None:
        self.call: _Call | None = None

    def current(self) -> _Call:
        if self.call is None:
            raise RuntimeError(
                "a streaming-patched Wan attention module was called outside the transformer's forward; "
                "call the transformer (it supplies frame positions and the cache)"
            )
        return self.call


def _attend(q_bshd: torch.Tensor, k_bshd: torch.Tensor, v_bshd: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q_bshd.transpose(1, 2), k_bshd.transpose(1, 2), v_bshd.transpose(1, 2)
    )
    return out.transpose(1, 2)


class StreamingSelfAttnProcessor:
    """Block-causal self-attention: per query block, attend to the frames :func:`visible_frames` allows.

    In cache mode the earlier visible frames come from the cache and the block's own keys/values are
    written back (detached); without a cache, every block of the input attends within the input.
    """

    def __init__(self, state: _CallState, config: StreamingConfig, layer: int) -> None:
        self.state, self.config, self.layer = state, config, layer

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        call = self.state.current()
        q, k, v = wan_self_attention_qkv(attn, hidden_states, rotary_emb)

        if call.cache is not None:
            out = self._cached(call, q, k, v)
        else:
            out = self._block_causal(call, q, k, v)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))

    def _cached(self, call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = call.cache
        if self.layer == 0:
            cache.ensure_allocated(k, call.tokens_per_frame)
        keys, values = cache.keys[self.layer], cache.values[self.layer]
        k_all = torch.cat([keys.index_select(1, call.read_index), k], dim=1)
        v_all = torch.cat([values.index_select(1, call.read_index), v], dim=1)
        keys.index_copy_(1, call.write_index, k.detach())
        values.index_copy_(1, call.write_index, v.detach())
        return _attend(q, k_all, v_all)

    def _block_causal(self, call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = [
            _attend(q[:, start:end], k.index_select(1, index), v.index_select(1, index))
            for start, end, index in call.blocks
        ]
        return torch.cat(outs, dim=1)


class StreamingCrossAttnProcessor:
    """Text cross-attention whose keys/values are cached per prompt tensor (under ``torch.no_grad`` only).

    A cached entry is reused only while the prompt tensor is the same object with the same storage and
    version counter (:meth:`~hfpatch.streaming.kv_cache.CrossAttentionCache.matches`), so a prompt edited in
    place is recomputed.

    Under autograd the keys/values are recomputed, so gradients reach ``to_k``/``to_v`` on every call.
    """

    def __init__(self, state: _CallState, layer: int) -> None:
        self.state, self.layer = state, layer

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        call = self.state.current()
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        entry = call.cache.cross[self.layer] if call.cache is not None else None
        if entry is not None and not torch.is_grad_enabled() and entry.matches(call.prompt, call.weights):
            k, v = entry.key, entry.value
        else:
            k = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1))
            v = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            if entry is not None and not torch.is_grad_enabled():
                entry.store(k, v, call.prompt, call.weights)
        out = _attend(q, k, v).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def _rope_forward(state: _CallState, rope: Any) -> Callable:
    """``rope.forward`` at absolute frame positions ``frame_offset + i``, computed on the fly (no max length).

    Same frequencies and layout as ``WanRotaryPosEmbed.forward``; the height/width parts come from its table.
    """
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p_t, p_h, p_w = rope.patch_size
        frames, height, width = (
            hidden_states.shape[2] // p_t,
            hidden_states.shape[3] // p_h,
            hidden_states.shape[4] // p_w,
        )
        offset = state.current().frame_offset
        positions = torch.arange(offset, offset + frames, device=rope.freqs_cos.device)
        # The dtype recipe of WanRotaryPosEmbed.__init__, so positions inside its table give identical values.
        dtype = torch.float32 if torch.backends.mps.is_available() else torch.float64
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
        return tables[0], tables[1]

    return forward


def _condition_forward(state: _CallState, original: Callable) -> Callable:
    """``condition_embedder.forward`` computing per-token timestep embeddings once per frame."""

    def forward(timestep, encoder_hidden_states, encoder_hidden_states_image=None, timestep_seq_len=None):
        if timestep_seq_len is None:
            return original(timestep, encoder_hidden_states, encoder_hidden_states_image)
        tpf = state.current().tokens_per_frame
        per_frame = timestep.view(-1, timestep_seq_len)[:, ::tpf].flatten()
        temb, proj, text, image = original(
            per_frame,
            encoder_hidden_states,
            encoder_hidden_states_image,
            timestep_seq_len=timestep_seq_len // tpf,
        )
        return temb.repeat_interleave(tpf, dim=1), proj.repeat_interleave(tpf, dim=1), text, image

    return forward


def _transformer_forward(
    state: _CallState, config: StreamingConfig, model: Any, original: Callable
) -> Callable:
    """The transformer ``forward`` with ``frame_offset``, ``kv_cache`` and ``recache`` (cache mode runs block by
    block, a recache as one chunk)."""

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

        if kv_cache is not None and frames > n and not recache:
            # Block-causal: a block never depends on later blocks, so running block by block is exact.
            outs = []
            for s in range(0, frames, n):
                ts = timestep[:, s : s + n] if timestep.ndim == 2 else timestep
                outs.append(
                    forward(
                        hidden_states[:, :, s : s + n],
                        ts,
                        encoder_hidden_states,
                        encoder_hidden_states_image,
                        False,
                        attention_kwargs,
                        frame_offset=frame_offset + s,
                        kv_cache=kv_cache,
                    )[0]
                )
            output = torch.cat(outs, dim=2)
            return (output,) if not return_dict else _output(output)

        _, p_h, p_w = model.config.patch_size  # the temporal patch size is 1 (checked in validate)
        tokens_per_frame = (height // p_h) * (width // p_w)
        if timestep.ndim == 2:
            timestep = timestep.repeat_interleave(tokens_per_frame, dim=1)  # the stock per-token path
        call = _Call(frame_offset, tokens_per_frame, encoder_hidden_states, kv_cache)
        device = hidden_states.device
        if kv_cache is not None:
            call.weights = weights_version(model)
            plan = kv_cache.plan_chunk if recache else kv_cache.plan_block
            read, write = plan(frame_offset, frames)
            call.read_index = _token_index(read, tokens_per_frame, device)
            call.write_index = _token_index(write, tokens_per_frame, device)
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
            result = original(
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


def _output(sample: torch.Tensor) -> Any:
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)


class WanStreamingPatch(PatchFamily):
    """Block-causal streaming (KV cache with window + sink, rope frame offset) for ``WanTransformer3DModel``.

    Option ``streaming``: a :class:`StreamingConfig`, or ``None`` (default) to leave the model alone.
    """

    name = "wan_streaming"
    options = {"streaming": None}
    role = "transformer"

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        streaming = options["streaming"]
        if streaming is None:
            return
        if not isinstance(streaming, StreamingConfig):
            raise TypeError(
                f"streaming must be an hfpatch.streaming.StreamingConfig or None, got {type(streaming).__name__}"
            )
        if config.data * config.cfg * config.pipefusion * config.sequence_parallel > 1:
            # The pipeline's data/CFG wrapper splits the stock forward arguments only (no frame_offset or
            # kv_cache), and a cache serves one guidance branch of one batch: no transformer parallelism yet.
            raise ValueError(
                f"streaming with a parallel transformer is not supported yet (got data={config.data}, "
                f"cfg={config.cfg}, pipefusion={config.pipefusion}, ring={config.ring}, ulysses={config.ulysses}); apply streaming with "
                "parallel=1 (or split only the VAE, ParallelConfig(vae=N)). For data-parallel training, "
                "wrap the streaming transformer in torch DDP/FSDP yourself and give each rank its own batch"
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
        state = _CallState()
        for i, block in enumerate(target.blocks):
            patch.swap_processor(block.attn1, StreamingSelfAttnProcessor(state, config, i))
            patch.swap_processor(block.attn2, StreamingCrossAttnProcessor(state, i))
        patch.set_attr(target.rope, "forward", _rope_forward(state, target.rope))
        patch.wrap_method(target.condition_embedder, "forward", lambda orig: _condition_forward(state, orig))
        patch.wrap_method(target, "forward", lambda orig: _transformer_forward(state, config, target, orig))
