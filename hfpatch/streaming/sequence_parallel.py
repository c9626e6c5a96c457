"""Sequence parallelism of the streaming Wan transformer: each block's tokens split over ``ring x ulysses`` ranks.

``hfpatch.apply(transformer, parallel=N, streaming=StreamingConfig(...))`` splits every call of the streaming
transformer (:mod:`hfpatch.streaming.transformer`) over the ``sp`` ranks and gives every rank the full output.
This module holds the geometry (pure functions of the shapes and the rank) and the attention calls; the patch
wires them into the forward. The maths is :mod:`hfpatch.attention`'s (Ulysses all-to-all, Ring attention with
its online-softmax merge, tiled masked attention), no exchange of its own.

**Where the tokens go.** A call of ``F`` latent frames has ``F x tpf`` tokens (``tpf`` per frame). In cache mode
(a denoising step, a context pass or a prompt-switch re-encode) every *frame* is cut into ``N = ring x ulysses``
pieces of ``l = ceil(tpf / N)`` tokens (the last ones padded); sp rank ``p = ring_index x ulysses +
ulysses_index`` holds piece ``p`` of every frame (:func:`frame_layout`). After the Ulysses all-to-all a rank
holds, for its heads, the ``u x l`` tokens of every frame that its Ring index owns: its *ring block* of the
frame. That is what it caches, so the cache is sharded by head over Ulysses and by token over Ring and a rank
holds ``1/N`` of every cached frame (exactly, when ``N`` divides ``tpf`` and ``ulysses`` divides the heads):
sink and window slots, eviction and re-encodes are the one-process cache's
(:class:`~hfpatch.streaming.StreamingKVCache`), per frame. Without a cache (a training chunk under the block-causal mask) the tokens are
cut into ``N`` contiguous shards (:func:`contiguous_layout`, the layout of :mod:`hfpatch.attention.layout`) and
the mask is read tile by tile in global positions (:class:`BlockCausalMask`,
:func:`~hfpatch.attention.masked.masked_usp_attention`).

**Self-attention with the cache.** Ring degree 1 (Ulysses only): the rank has the call's whole sequence for its
heads, writes its keys/values into its slots and attends to its whole buffer with a key mask (the invisible
slots and the padding), as one process does for all heads. Ring degree ``r > 1``: each rank gathers the visible
keys of its ring block (every visible slot, real tokens first: :func:`ring_read_index`) and
:func:`~hfpatch.attention.ring.ring_attention` passes them round the ring, so the queries of each rank meet the
cached keys of every rank; the padding sits at the end of the last blocks, where ``valid_len`` masks it.

**Cross-attention.** The text keys/values are sharded like the cache: by head over Ulysses, by text token over
Ring (:func:`shard_text`); the queries are resharded by the same all-to-all and attend to the text blocks through
:func:`~hfpatch.attention.ring.ring_attention` (plain attention at ring degree 1). So the cross-attention cache is
``1/N`` per rank too, for one all-to-all of the queries and outputs (and, under Ring, the text blocks passed round).

**Gradients.** The output is gathered with a ``"slice"`` backward and its gradient scaled by ``N``
(:mod:`hfpatch.distributed.gradients`): the mean of the ranks' parameter gradients over the ``sp`` group
(DDP's, FSDP2's, :func:`hfpatch.all_reduce_gradients`) equals the one-process gradient, and inputs that require
grad get the full gradient on every rank.

**Bytes sent per rank** by one cached call of ``n`` frames (:func:`block_bytes`, counted by
:func:`hfpatch.distributed.collectives.count_comm`): per layer, four all-to-alls of ``(u - 1) / u`` of a
``[B, n l, H, D]`` tensor in self-attention and two in cross-attention; under Ring, the visible cache of the ring
block (``r - 1`` hops of keys and values) and the text blocks; then one all-gather of the output and the
same-input check.

>>> index, real = frame_layout(frames=2, tokens_per_frame=5, world=2, rank=1)  # 5 tokens a frame, l = 3
>>> index.tolist(), real.tolist()
([3, 4, 0, 8, 9, 5], [True, True, False, True, True, False])
>>> ring_block_tokens(tokens_per_frame=5, ulysses=1, ring=2)      # real tokens per frame of each ring block
[3, 2]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..attention.layout import head_sizes
from ..attention.masked import classify_tile, masked_usp_attention
from ..attention.ring import ring_attention
from ..attention.ulysses import heads_to_sequence, sequence_to_heads
from ..distributed.agreement import bytes_per_check
from ..distributed.collectives import all_gather
from ..distributed.gradients import grad_scaled_by_group
from .kv_cache import to_device

__all__ = [
    "BlockCausalMask",
    "StreamShard",
    "block_bytes",
    "contiguous_layout",
    "frame_layout",
    "ring_block_tokens",
    "ring_read_index",
    "shard_text",
]

Tensor = torch.Tensor


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------- geometry
def frame_layout(frames: int, tokens_per_frame: int, world: int, rank: int) -> tuple[Tensor, Tensor]:
    """This rank's tokens when every frame is cut into ``world`` pieces: ``(call token index, real?)`` each.

    Piece ``rank`` of frame ``f`` is tokens ``[rank * l, (rank + 1) * l)`` of the frame, ``l = ceil(tpf /
    world)``; a position past the frame is padding and repeats the frame's first token (its output is dropped,
    its key never attended). Frame-major: ``frames x l`` entries (CPU tensors, long and bool).
    """
    piece = _ceil(tokens_per_frame, world)
    within = rank * piece + torch.arange(piece)
    real = within < tokens_per_frame
    index = torch.arange(frames)[:, None] * tokens_per_frame + torch.where(real, within, 0)
    return index.flatten(), real.expand(frames, piece).flatten()


def contiguous_layout(frames: int, tokens_per_frame: int, world: int, rank: int) -> tuple[Tensor, Tensor]:
    """This rank's tokens in the contiguous layout of :mod:`hfpatch.attention.layout` (the call's tokens padded
    at the end to a multiple of ``world``, shard ``rank`` of them); padding repeats token 0.

    >>> [t.tolist() for t in contiguous_layout(frames=1, tokens_per_frame=5, world=2, rank=1)]
    [[3, 4, 0], [True, True, False]]
    """
    total = frames * tokens_per_frame
    length = _ceil(total, world)
    positions = torch.arange(rank * length, (rank + 1) * length)
    real = positions < total
    return torch.where(real, positions, 0), real


def ring_block_tokens(tokens_per_frame: int, ulysses: int, ring: int) -> list[int]:
    """Real tokens per frame in each ring block (``u x l`` slots a frame, the padding in the last blocks).

    Non-increasing, and only the first short block is partly real: the padding of the blocks read in ring order
    is at the end of the sequence, what ``valid_len`` of :func:`~hfpatch.attention.ring.ring_attention` masks.
    """
    block = ulysses * _ceil(tokens_per_frame, ulysses * ring)
    return [max(0, min(block, tokens_per_frame - i * block)) for i in range(ring)]


def ring_read_index(slots: list[int], block: int, real: int) -> Tensor:
    """Buffer positions of the keys a ring block contributes: the ``real`` first positions of each of ``slots``
    (``block`` positions a slot), then padding (position 0) up to ``len(slots) x block``.

    >>> ring_read_index([2, 0], block=3, real=2).tolist()
    [6, 7, 0, 1, 0, 0]
    """
    index = (torch.tensor(slots, dtype=torch.long)[:, None] * block + torch.arange(real)).flatten()
    return torch.cat([index, index.new_zeros(len(slots) * block - index.numel())])


def shard_text(x_bthd: Tensor, shard: StreamShard) -> Tensor:
    """This rank's part of replicated text keys/values ``[B, T, H, D]``: its Ulysses heads, its Ring block of
    the text tokens (padded at the end to a multiple of the ring degree). A copy: the full tensor can be freed.

    Differentiable: the gradient of a slice of a replicated tensor is this rank's share; the shares of the
    ``sp`` ranks add up to the full gradient.
    """
    start, count = shard.heads(x_bthd.shape[2])
    x = x_bthd.narrow(2, start, count)
    if shard.ring > 1:
        length = _ceil(x.shape[1], shard.ring)
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, length * shard.ring - x.shape[1]))
        x = x.narrow(1, shard.ring_index * length, length)
    return x.contiguous()


@dataclass(frozen=True)
class StreamShard:
    """This rank's place in the ``ring x ulysses`` split of a streaming transformer (one per patch).

    Attributes:
        group: The ``sp`` process group (ring x ulysses, Ulysses innermost).
        ulysses_group, ring_group: ``None`` for degree 1.
        ulysses, ring: The degrees.
        rank: Index in ``group``: ``ring_index * ulysses + ulysses_index``.
    """

    group: Any
    ulysses_group: Any
    ring_group: Any
    ulysses: int
    ring: int
    rank: int

    @classmethod
    def from_mesh(cls, mesh: Any) -> StreamShard:
        return cls(
            mesh.group("sp"),
            mesh.group("ulysses"),
            mesh.group("ring"),
            mesh.size("ulysses"),
            mesh.size("ring"),
            dist.get_rank(mesh.group("sp")),
        )

    @property
    def world(self) -> int:
        return self.ulysses * self.ring

    @property
    def ring_index(self) -> int:
        return self.rank // self.ulysses

    @property
    def ulysses_index(self) -> int:
        return self.rank % self.ulysses

    def heads(self, heads: int) -> tuple[int, int]:
        """``(first head, heads)`` this rank computes of ``heads`` (uneven splits allowed)."""
        sizes = head_sizes(heads, self.ulysses)
        return sum(sizes[: self.ulysses_index]), sizes[self.ulysses_index]

    def slot_tokens(self, tokens_per_frame: int) -> int:
        """Cache positions per frame on this rank: its ring block (``u x l``, padding included)."""
        return self.ulysses * _ceil(tokens_per_frame, self.world)

    def describe(self, tokens_per_frame: int) -> str:
        """What a cache filled by this rank holds (a cache of another split or frame size is refused)."""
        return (
            f"sp rank {self.rank} of {self.world} (ulysses={self.ulysses}, ring={self.ring}) of frames of "
            f"{tokens_per_frame} tokens"
        )

    # ------------------------------------------------------------------------------------------- calls
    def cache_call(
        self,
        frames: int,
        tokens_per_frame: int,
        write_slots: list[int],
        visible_slots: list[int],
        cache_frames: int,
        device: torch.device,
    ) -> ShardedCall:
        """The geometry of a cached call: frame layout, where its keys go, which keys it reads."""
        call = self._call(frame_layout, frames, tokens_per_frame, device)
        piece, block = _ceil(tokens_per_frame, self.world), self.slot_tokens(tokens_per_frame)
        # After the all-to-all: Ulysses rank j's tokens, frame-major: (j, frame, t) -> slot * block + j * l + t.
        write = (
            torch.arange(self.ulysses)[:, None, None] * piece
            + torch.tensor(write_slots)[None, :, None] * block
            + torch.arange(piece)
        )
        call.write_index = to_device(write.flatten(), device)
        real = ring_block_tokens(tokens_per_frame, self.ulysses, self.ring)
        visible = sorted(set(visible_slots))
        if self.ring == 1:
            if len(visible) < cache_frames or real[0] < block:
                mask = torch.zeros(cache_frames, block, dtype=torch.bool)
                mask[visible, : real[0]] = True
                call.key_mask = to_device(mask.view(1, 1, 1, -1), device)
        else:
            call.read_index = to_device(ring_read_index(visible, block, real[self.ring_index]), device)
            call.read_valid = len(visible) * sum(real)
        return call

    def chunk_call(
        self, frames: int, tokens_per_frame: int, visible: Tensor, device: torch.device
    ) -> ShardedCall:
        """The geometry of a call without a cache: contiguous shards, the block-causal frame mask ``visible``
        (``[frames, frames]`` bool, query frame x key frame)."""
        call = self._call(contiguous_layout, frames, tokens_per_frame, device)
        call.mask = BlockCausalMask(visible.to(device), tokens_per_frame)
        call.valid_len = frames * tokens_per_frame
        return call

    def _call(self, layout: Any, frames: int, tokens_per_frame: int, device: torch.device) -> ShardedCall:
        layouts = [layout(frames, tokens_per_frame, self.world, p) for p in range(self.world)]
        index = layouts[self.rank][0]
        # Where each call token sits in the all-gathered sequence (rank-major, each rank's tokens in order).
        tokens, real = torch.stack([i for i, _ in layouts]), torch.stack([r for _, r in layouts])
        gathered = torch.empty(frames * tokens_per_frame, dtype=torch.long)
        gathered[tokens[real]] = torch.arange(tokens.numel()).view_as(tokens)[real]
        return ShardedCall(
            local_index=to_device(index, device),
            local_frames=to_device(index // tokens_per_frame, device),
            gather_index=to_device(gathered, device),
        )

    # ------------------------------------------------------------------------------------------- tensors
    def gather(self, local_bsc: Tensor, call: ShardedCall) -> Tensor:
        """The full call sequence ``[B, F x tpf, C]`` from every rank's tokens, identical on every rank.

        Backward: this rank's slice of ``N`` times the gradient (every rank computes the same loss)."""
        full = all_gather(local_bsc.contiguous(), 1, self.group, backward="slice")
        return grad_scaled_by_group(full.index_select(1, call.gather_index), self.group)


class BlockCausalMask:
    """The block-causal visibility of a training chunk as a :class:`~hfpatch.attention.masked.TileMask`.

    Args:
        visible: ``[frames, frames]`` bool, ``visible[q, k]``: query frame ``q`` sees key frame ``k``
            (:func:`~hfpatch.streaming.visible_frames` per block).
        tokens_per_frame: Tokens of a frame; global position ``s`` is in frame ``s // tokens_per_frame``.

    >>> m = BlockCausalMask(torch.tensor([[True, False], [True, True]]), tokens_per_frame=2)
    >>> m.tile(0, 2, 2, 2), m.tile(2, 2, 0, 4), m.tile(0, 4, 0, 4).int().tolist()  # frame 0 sees only itself
    (False, True, [[[[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]]])
    """

    def __init__(self, visible: Tensor, tokens_per_frame: int) -> None:
        self.visible, self.tokens_per_frame = visible, tokens_per_frame

    def tile(self, q_start: int, q_len: int, k_start: int, k_len: int) -> bool | Tensor:
        device = self.visible.device
        q = torch.arange(q_start, q_start + q_len, device=device) // self.tokens_per_frame
        k = torch.arange(k_start, k_start + k_len, device=device) // self.tokens_per_frame
        return classify_tile(self.visible[q][:, k][None, None])


@dataclass
class ShardedCall:
    """The per-call geometry of one rank (set by the patched forward, read by its processors).

    Attributes:
        local_index: ``[S_local]`` call-token index of each of this rank's tokens (padding repeats a real one).
        local_frames: ``[S_local]`` frame of each (per-frame timesteps).
        gather_index: ``[F x tpf]`` position of each call token in the all-gathered sequence.
        write_index: Cache mode: buffer positions of the tokens after the Ulysses all-to-all.
        key_mask: Cache mode at ring degree 1: ``[1, 1, 1, L]`` over the buffer (``None``: every key visible).
        read_index, read_valid: Cache mode under Ring: the keys this rank's ring block contributes (real ones
            first) and the real keys of the whole ring sequence.
        mask, valid_len: Without a cache: the block-causal tiles and the call's token count.
    """

    local_index: Tensor
    local_frames: Tensor
    gather_index: Tensor
    write_index: Tensor | None = None
    key_mask: Tensor | None = None
    read_index: Tensor | None = None
    read_valid: int | None = None
    mask: BlockCausalMask | None = None
    valid_len: int | None = None


# ----------------------------------------------------------------------------------------------- attention
def _attend(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None = None) -> Tensor:
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask
    )
    return out.transpose(1, 2)


def chunk_self_attention(shard: StreamShard, call: ShardedCall, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Block-causal self-attention of a chunk without a cache (contiguous shards ``[B, S_local, H, D]``)."""
    return masked_usp_attention(
        q, k, v, mask=call.mask, ulysses_group=shard.ulysses_group, ring_group=shard.ring_group,
        valid_len=call.valid_len,
    )  # fmt: skip


def cached_self_attention(
    shard: StreamShard,
    call: ShardedCall,
    cache: Any,
    layer: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tokens_per_frame: int,
) -> Tensor:
    """Self-attention of a cached call: write this call's keys/values into this rank's slots, attend to the
    visible ones of every rank (see the module docstring). ``q``/``k``/``v`` and the result: ``[B, S_local, H,
    D]`` in the frame layout."""
    heads = q.shape[2]
    q, k, v = (sequence_to_heads(t, shard.ulysses_group, heads) for t in (q, k, v))
    if cache.keys is None:  # the cache's first call: allocate from layer 0's keys (this rank's shard)
        if layer != 0:
            raise RuntimeError("a streaming cache must be allocated by the first transformer block")
        cache.ensure_allocated(
            k, shard.slot_tokens(tokens_per_frame), tokens_per_frame, shard.describe(tokens_per_frame)
        )
    keys, values = cache.keys[layer], cache.values[layer]
    if keys.dtype != k.dtype:
        raise ValueError(
            f"this StreamingKVCache holds {keys.dtype} keys, the transformer now computes {k.dtype} ones (an "
            "autocast or dtype change in the middle of a stream); use one cache per dtype (or a new cache)"
        )
    keys.index_copy_(1, call.write_index, k.detach())
    values.index_copy_(1, call.write_index, v.detach())
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        # Gradients reach this call's keys/values, not the cached ones: an out-of-place copy carries them.
        keys = keys.index_copy(1, call.write_index, k)
        values = values.index_copy(1, call.write_index, v)
    if shard.ring == 1:
        out = _attend(q, keys, values, call.key_mask)
    else:
        keys, values = keys.index_select(1, call.read_index), values.index_select(1, call.read_index)
        out, _ = ring_attention(q, keys, values, group=shard.ring_group, valid_len=call.read_valid)
    return heads_to_sequence(out.type_as(q), shard.ulysses_group, heads)


def cross_attention(shard: StreamShard, q: Tensor, k: Tensor, v: Tensor, text_len: int) -> Tensor:
    """Cross-attention of this rank's queries ``[B, S_local, H, D]`` to its text shard (:func:`shard_text`)."""
    heads = q.shape[2]
    q = sequence_to_heads(q, shard.ulysses_group, heads)
    if shard.ring == 1:
        out = _attend(q, k, v)
    else:
        out, _ = ring_attention(q, k, v, group=shard.ring_group, valid_len=text_len)
    return heads_to_sequence(out.type_as(q), shard.ulysses_group, heads)


# ----------------------------------------------------------------------------------------------- bytes
def block_bytes(
    *,
    batch: int,
    frames: int,
    tokens_per_frame: int,
    heads: int,
    head_dim: int,
    layers: int,
    text_tokens: int,
    visible_frames: int,
    out_channels: int,
    ulysses: int,
    ring: int,
    rank: int = 0,
    itemsize: int = 4,
) -> dict[str, int]:
    """Bytes sp rank ``rank`` sends in one cached call of ``frames`` frames under inference, by collective
    (the keys of :class:`~hfpatch.distributed.collectives.CommCounter`'s ``by_op``).

    ``visible_frames``: frames the call attends to (cached visible ones and its own); ``out_channels``: channels
    of ``proj_out`` per token (``out_channels x patch volume``). The all-to-alls send ``(u - 1) / u`` of each
    tensor when ``u`` divides the heads (otherwise each rank its own share), the Ring hops ``r - 1`` blocks.

    >>> block_bytes(batch=1, frames=2, tokens_per_frame=4, heads=4, head_dim=8, layers=2, text_tokens=6,
    ...             visible_frames=6, out_channels=16, ulysses=2, ring=1)["all_to_all"]
    3072
    """
    world = ulysses * ring
    piece = _ceil(tokens_per_frame, world)
    local = batch * frames * piece  # tokens of this rank in the call
    sizes = head_sizes(heads, ulysses)
    j = rank % ulysses
    kept = sizes[j]
    # One all-to-all in (sequence -> heads) sends every head but its own of the local tokens; back (heads ->
    # sequence) the same pieces in reverse: its heads of the other ranks' tokens.
    to_heads = local * (heads - kept) * head_dim * itemsize
    to_sequence = (ulysses - 1) * local * kept * head_dim * itemsize
    out = {}
    if ulysses > 1:
        out["all_to_all"] = layers * (3 * to_heads + to_sequence + to_heads + to_sequence)
    if ring > 1:
        block = ulysses * piece  # cache positions per frame on one rank
        text_block = _ceil(text_tokens, ring)
        per_layer = 2 * batch * kept * head_dim * itemsize * (visible_frames * block + text_block)
        out["ring"] = layers * (ring - 1) * per_layer
    out["all_gather"] = (world - 1) * local * out_channels * itemsize
    out["guard"] = bytes_per_check(world)
    return out
