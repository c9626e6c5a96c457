"""The attention processors of :mod:`hfpatch.streaming.transformer`: what one patched transformer call hands its
processors (the frame positions, the KV cache's buffers and the slots a block may see, this rank's part under a
sequence-parallel split), the self-attention processor that writes and reads the cache (or attends block by
block without one) and the cross-attention processor with the prompt's keys/values computed once per prompt.
:mod:`hfpatch.streaming.transformer` installs them and re-exports their names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..patches.wan_attention import wan_self_attention_qkv
from .kv_cache import StreamingConfig, StreamingKVCache, weights_version
from .sequence_parallel import (
    ShardedCall,
    StreamShard,
    cached_self_attention,
    chunk_self_attention,
    cross_attention,
    shard_text,
)


@dataclass
class StreamingCall:
    """What the processors of one transformer call need (set by the patched ``forward``).

    Only tensors, lists of tensors and per-stream constants: a compiled forward reads nothing from here that
    changes from block to block except tensor values (no frame offset, no cache object).
    """

    tokens_per_frame: int
    positions: torch.Tensor  # [frames] absolute frame index of each input frame (rotary positions)
    # Cache mode: the cache (its first call allocates the buffers from layer 0's keys), its per-layer buffers
    # [B, cache_frames * tokens_per_frame, H, D] and the token positions this call writes there.
    cache: StreamingKVCache | None = None
    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    write_index: torch.Tensor | None = None
    # One block: the whole buffer is attended, the slots the block may not see masked ([1, 1, 1, L] bool;
    # None when every slot is visible). A recache chunk: the earlier visible tokens, read in frame order.
    key_mask: torch.Tensor | None = None
    read_index: torch.Tensor | None = None
    # Cache mode without autograd: every layer's text keys/values ([B, T, H, D]), computed once per prompt.
    cross: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # No-cache mode: per query block, (first token, end token, key token positions within the input).
    blocks: list[tuple[int, int, torch.Tensor]] | None = None
    # Under a sequence-parallel split: this rank's tokens and what its attention reads and writes.
    sp: ShardedCall | None = None


class StreamingCallState:
    """The call in flight; shared by the patched methods and processors of one transformer.

    ``shard``: this rank's place in a sequence-parallel split (``None``: one process); ``check_inputs``: run the
    same-input check of the split at every call; ``modules``: the submodules whose ``forward`` the split wraps
    (a call checks that they are still the model's).
    """

    def __init__(self, shard: StreamShard | None = None, check_inputs: bool = True) -> None:
        self.call: StreamingCall | None = None
        self.shard = shard
        self.check_inputs = check_inputs
        self.modules: dict[str, torch.nn.Module] = {}

    def current(self) -> StreamingCall:
        if self.call is None:
            raise RuntimeError(
                "a streaming-patched Wan attention module was called outside the transformer's forward; "
                "call the transformer (it supplies frame positions and the cache)"
            )
        return self.call


def _attend(
    q_bshd: torch.Tensor, k_bshd: torch.Tensor, v_bshd: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q_bshd.transpose(1, 2), k_bshd.transpose(1, 2), v_bshd.transpose(1, 2), attn_mask=key_mask
    )
    return out.transpose(1, 2)


class StreamingSelfAttnProcessor:
    """Block-causal self-attention: per query block, attend to the frames :func:`visible_frames` allows.

    In cache mode the block's own keys/values are written into the cache (detached) and the block attends to
    the whole cache buffer, the slots it may not see masked out (no mask once every cached frame is visible:
    the steady state of a window): the same shapes for every block, read in place with no gather. A recache
    chunk reads the earlier visible frames and attends to them and itself. Without a cache, every block of
    the input attends within the input.
    """

    def __init__(self, state: StreamingCallState, config: StreamingConfig, layer: int) -> None:
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

        if call.sp is not None:
            shard = self.state.shard
            if call.sp.mask is not None:
                out = chunk_self_attention(shard, call.sp, q, k, v)
            else:
                out = cached_self_attention(
                    shard, call.sp, call.cache, self.layer, q, k, v, call.tokens_per_frame
                )
        elif call.write_index is None:
            out = self._block_causal(call, q, k, v)
        else:
            keys, values = self._buffers(call, k)
            if call.read_index is not None:
                out = self._chunk(call, keys, values, q, k, v)
            else:
                out = self._block(call, keys, values, q, k, v)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))

    def _buffers(self, call: StreamingCall, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if call.keys is None:  # the cache's first call (eager): allocate from layer 0's keys
            if self.layer == 0:
                call.cache.ensure_allocated(k, call.tokens_per_frame)
                call.keys, call.values = call.cache.keys, call.cache.values
        keys, values = call.keys[self.layer], call.values[self.layer]
        if keys.dtype != k.dtype:
            raise ValueError(
                f"this StreamingKVCache holds {keys.dtype} keys, the transformer now computes {k.dtype} ones (an "
                "autocast or dtype change in the middle of a stream); use one cache per dtype (or a new cache)"
            )
        return keys, values

    def _block(self, call, keys, values, q, k, v) -> torch.Tensor:
        """One block over the whole buffer (static shapes): write this block's slots, attend to every visible one."""
        keys.index_copy_(1, call.write_index, k.detach())
        values.index_copy_(1, call.write_index, v.detach())
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            # Gradients reach this block's keys/values, not the cached ones: an out-of-place copy carries them.
            keys = keys.index_copy(1, call.write_index, k)
            values = values.index_copy(1, call.write_index, v)
        return _attend(q, keys, values, call.key_mask)

    def _chunk(self, call, keys, values, q, k, v) -> torch.Tensor:
        """A recache chunk: the earlier visible frames (frame order) and the chunk itself, then written back."""
        k_all = torch.cat([keys.index_select(1, call.read_index), k], dim=1)
        v_all = torch.cat([values.index_select(1, call.read_index), v], dim=1)
        keys.index_copy_(1, call.write_index, k.detach())
        values.index_copy_(1, call.write_index, v.detach())
        return _attend(q, k_all, v_all)

    def _block_causal(
        self, call: StreamingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        outs = [
            _attend(q[:, start:end], k.index_select(1, index), v.index_select(1, index))
            for start, end, index in call.blocks
        ]
        return torch.cat(outs, dim=1)


def _text_keys_values(
    attn: Any, text: torch.Tensor, shard: StreamShard | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention keys/values ``[B, T, H, D]`` of the embedded text, as the stock ``WanAttnProcessor``;
    under a split, this rank's part of them (:func:`~hfpatch.streaming.sequence_parallel.shard_text`)."""
    key = attn.norm_k(attn.to_k(text)).unflatten(2, (attn.heads, -1))
    value = attn.to_v(text).unflatten(2, (attn.heads, -1))
    if shard is not None:
        key, value = shard_text(key, shard), shard_text(value, shard)
    return key, value


class StreamingCrossAttnProcessor:
    """Text cross-attention whose keys/values are cached per prompt tensor (under ``torch.no_grad`` only).

    The patched ``forward`` fills the cache for a new prompt before the call (every layer at once, from the
    text embedding the stock forward computes the same way) and the processors read it. A cached entry serves
    a call only while the prompt tensor is the same object with the same storage and version counter and the
    weights are unchanged (:meth:`~hfpatch.streaming.kv_cache.CrossAttentionCache.matches`), so a prompt
    edited in place is recomputed.

    Under autograd (or without a cache) the keys/values are computed in the call, so gradients reach
    ``to_k``/``to_v`` on every call.
    """

    def __init__(self, state: StreamingCallState, layer: int) -> None:
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
        if call.cross is not None:
            k, v = call.cross[self.layer]
        else:
            k, v = _text_keys_values(attn, encoder_hidden_states, self.state.shard)
        if call.sp is not None:
            out = cross_attention(self.state.shard, q, k, v, encoder_hidden_states.shape[1])
        else:
            out = _attend(q, k, v)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def cached_text(
    model: Any, cache: StreamingKVCache, prompt: torch.Tensor, shard: StreamShard | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's text keys/values for ``prompt`` (this rank's part under a split): the cached ones while
    they match, else computed now."""
    weights = weights_version(model)
    if not all(entry.matches(prompt, weights) for entry in cache.cross):
        text = model.condition_embedder.text_embedder(prompt)  # what the stock forward hands the blocks
        for block, entry in zip(model.blocks, cache.cross):
            with _whole_weights(block):
                entry.store(*_text_keys_values(block.attn2, text, shard), prompt, weights)
    return [(entry.key, entry.value) for entry in cache.cross]


@contextlib.contextmanager
def _whole_weights(block: torch.nn.Module) -> Iterator[None]:
    """The block's weights whole while inside: an FSDP2 unit (``shard_weights=True``) holds only its shard
    outside its own forward, so work done on its layers before the call (the text keys/values) gathers them
    with FSDP2's own ``unshard``/``reshard`` (a collective: every rank of the shard group fills the text cache
    at the same call, the prompt being the same on all of them)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(block, FSDPModule):
        yield
        return
    block.unshard()
    try:
        yield
    finally:
        block.reshard()
