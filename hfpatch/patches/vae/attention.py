"""Attention over the rows of every rank of a height-split VAE: ring attention, queries local, keys/values passed.

A VAE's mid-block attends over the whole feature map of a frame (``H x W`` tokens) or of the whole video
(``T x H x W``, HunyuanVideo's with a frame-causal mask). Split by height, each rank holds the tokens of its
rows. :func:`sharded_attention` keeps the queries local and passes the key/value blocks round the ring
(:func:`hfpatch.attention.masked.masked_usp_attention` with a ring group): each rank holds its own block and
the one in flight, ``2/N`` of the keys and values at a time (gathering them would hold all of them on every
rank: the memory the split is there to divide). The result is exact softmax attention, merged block by block
with the log-sum-exp; the backward recomputes block by block, sending the key/value gradients home with their
blocks.

Ring attention needs equal blocks. Shards differ by one latent row at most, so every rank pads its rows to the
largest shard's (zeros, in the layout ``(frame, row, column)``), and the mask (:class:`ShardedRowsMask`, a
:class:`hfpatch.attention.masked.TileMask`) is a rule, read one tile at a time, never materialised: a key in a
padding row takes no part; with ``causal_frames`` a query of frame ``t`` sees the keys of frames ``<= t``
(HunyuanVideo's ``prepare_causal_attention_mask``, which the stock code builds as a ``(THW)^2`` tensor: 49-198
GiB at 720p for 129 frames). A tile without padding or causal boundary is a plain kernel call.

Bytes sent per rank: forward ``(N - 1)`` key/value blocks of ``T x max_rows x W`` tokens (``2 x C`` values
each); backward ``(N - 1)`` blocks and ``N`` gradient blocks (:func:`attention_bytes`).

>>> import torch
>>> from hfpatch.patches.vae.attention import ShardedRowsMask
>>> mask = ShardedRowsMask(sizes=(2, 1), frames=2, width=1, causal_frames=True)   # 2 ranks, rows 2 and 1
>>> mask.tile(0, 4, 4, 4).int().tolist()   # rank 0's queries (frame, row): keys of rank 1 (row 1 is padding)
[[[[1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0], [1, 0, 1, 0]]]]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...attention.masked import classify_tile, masked_usp_attention
from .state import VAEShardState

__all__ = ["ShardedRowsMask", "attention_bytes", "diffusers_attention", "sharded_attention"]


@dataclass(frozen=True)
class ShardedRowsMask:
    """The mask of attention over row shards padded to equal blocks, as a rule on global (padded) positions.

    Rank ``r``'s block holds ``frames x max(sizes) x width`` positions ordered ``(frame, row, column)``; rows
    ``>= sizes[r]`` are padding. A key attends iff its row is real and, with ``causal_frames``, its frame is
    not after the query's.
    """

    sizes: tuple[int, ...]
    frames: int
    width: int
    causal_frames: bool = False

    @property
    def rows(self) -> int:
        return max(self.sizes)

    @property
    def block(self) -> int:
        return self.frames * self.rows * self.width

    def _frame_and_valid(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + length)
        rank, local = pos // self.block, pos % self.block
        row = (local // self.width) % self.rows
        valid = row < torch.tensor(self.sizes)[rank]
        return local // (self.rows * self.width), valid

    def tile(self, q_start: int, q_len: int, k_start: int, k_len: int) -> bool | torch.Tensor:
        padded = any(s < self.rows for s in self.sizes)
        if not padded and not self.causal_frames:
            return True
        k_frame, k_valid = self._frame_and_valid(k_start, k_len)
        allowed = k_valid[None, :]
        if self.causal_frames:
            q_frame, _ = self._frame_and_valid(q_start, q_len)
            allowed = allowed & (k_frame[None, :] <= q_frame[:, None])
        else:
            allowed = allowed.expand(q_len, k_len)
        return classify_tile(allowed[None, None])


def _pad_rows(x: torch.Tensor, frames: int, rows: int, width: int, to_rows: int) -> torch.Tensor:
    """``[B, T*rows*W, H, D]`` -> ``[B, T*to_rows*W, H, D]`` with zero rows appended to every frame."""
    if rows == to_rows:
        return x.contiguous()
    b, _, heads, dim = x.shape
    x = x.view(b, frames, rows, width, heads, dim)
    return F.pad(x, (0, 0, 0, 0, 0, 0, 0, to_rows - rows)).view(b, frames * to_rows * width, heads, dim)


def sharded_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: VAEShardState,
    *,
    frames: int,
    rows: int,
    width: int,
    causal_frames: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention of this rank's tokens over the tokens of every rank of the VAE split (ring attention).

    Args:
        query, key, value: ``[B, frames * rows * width, heads, head_dim]``, this rank's tokens in the order
            ``(frame, row, column)`` (``rows``: this rank's rows of the feature map).
        state: The split's state (its group and every rank's rows).
        frames, rows, width: The local feature map's extents (per-frame attention: ``frames=1``, frames in ``B``).
        causal_frames: A query of frame ``t`` sees keys of frames ``<= t`` only.
        scale: Softmax scale (default ``head_dim ** -0.5``).

    Returns:
        ``[B, frames * rows * width, heads, head_dim]``: equal to attention over the unsplit map, up to float
        reassociation; differentiable (gradients under the VAE split's convention: every rank's output
        gradient covers its rows).
    """
    sizes = tuple(state.sizes(rows))
    most = max(sizes)
    q, k, v = (_pad_rows(t, frames, rows, width, most) for t in (query, key, value))
    mask = ShardedRowsMask(sizes, frames, width, causal_frames)
    out = masked_usp_attention(q, k, v, mask=mask, ulysses_group=None, ring_group=state.group, scale=scale)
    if rows == most:
        return out
    b, _, heads, dim = out.shape
    return out.view(b, frames, most, width, heads, dim)[:, :, :rows].reshape(query.shape)


def attention_bytes(
    rank: int, world: int, tokens_per_block: int, channels: int, itemsize: int, backward: bool
) -> int:
    """Bytes ``rank`` sends for one :func:`sharded_attention` call (the ring passes key and value blocks).

    ``tokens_per_block``: ``frames x max rows x width`` (blocks are padded alike), ``channels``: heads x head dim.
    Forward: ``N - 1`` key/value blocks; backward: ``N - 1`` key/value blocks and ``N`` gradient blocks.

    >>> attention_bytes(0, 2, tokens_per_block=10, channels=8, itemsize=4, backward=False)
    640
    """
    del rank  # every rank of the ring sends alike
    block = 2 * tokens_per_block * channels * itemsize
    return (world - 1) * block + ((world - 1) * block + world * block if backward else 0)


# ----------------------------------------------------------------------------------------------- diffusers glue
def diffusers_attention(
    attn: Any,
    hidden_states: torch.Tensor,
    state: VAEShardState,
    *,
    frames: int,
    rows: int,
    width: int,
    causal_frames: bool = False,
) -> torch.Tensor:
    """``AttnProcessor2_0`` of a diffusers ``Attention`` self-attention block over the split's rows.

    ``hidden_states``: ``[B, C, rows, W]`` (one frame per sample) or ``[B, frames * rows * W, C]``. The block's
    ``group_norm`` (patched to merge statistics over the ranks), projections, residual and output rescale run as
    in the stock processor; the attention itself is :func:`sharded_attention`. Blocks the checks of
    :func:`check_diffusers_attention` refuse never get here.
    """
    residual = hidden_states
    image = hidden_states.dim() == 4
    if image:
        b, c, h, w = hidden_states.shape
        hidden_states = hidden_states.view(b, c, h * w).transpose(1, 2)
    if attn.group_norm is not None:
        hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
    query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    b, tokens, inner = key.shape
    heads = attn.heads
    split = [t.view(b, tokens, heads, inner // heads) for t in (query, key, value)]
    out = sharded_attention(*split, state, frames=frames, rows=rows, width=width, causal_frames=causal_frames)
    out = out.reshape(b, tokens, inner).to(query.dtype)
    out = attn.to_out[1](attn.to_out[0](out))
    if image:
        out = out.transpose(-1, -2).reshape(residual.shape)
    if attn.residual_connection:
        out = out + residual
    return out / attn.rescale_output_factor


def check_diffusers_attention(path: str, attn: Any) -> None:
    """Raise ``TypeError`` unless ``attn`` is a plain self-attention block :func:`diffusers_attention` computes."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    if type(attn.processor) not in (AttnProcessor, AttnProcessor2_0):
        raise TypeError(
            f"{path}: attention processor {type(attn.processor).__name__} is not supported by the VAE split; "
            "use AttnProcessor2_0 (vae.set_default_attn_processor())"
        )
    unsupported = {
        "spatial norm": attn.spatial_norm is not None,
        "cross attention": bool(attn.norm_cross) or attn.is_cross_attention,
        "q/k norms": attn.norm_q is not None or attn.norm_k is not None,
        "a causal flag": bool(getattr(attn, "is_causal", False)),
        "a scale other than head_dim ** -0.5": abs(attn.scale - (attn.inner_dim // attn.heads) ** -0.5)
        > 1e-12,
    }
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise TypeError(f"{path}: attention with {', '.join(found)} is not supported by the VAE split")


def attention_forward(attn: Any, state: VAEShardState, causal_frames: bool = False) -> Callable:
    """``Attention.forward`` for a block called on ``[B, C, rows, W]`` maps (one frame per sample, e.g.
    Allegro's mid-block): sequence-parallel over the split's rows, stock outside a split call."""
    original = attn.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not state.sharding:
            return original(hidden_states, *args, **kwargs)
        if args or any(v is not None for v in kwargs.values()) or hidden_states.dim() != 4:
            raise ValueError(
                f"{state.name}: the split mid-block attention takes a [B, C, H, W] map and no mask or context"
            )
        _, _, rows, width = hidden_states.shape
        return diffusers_attention(
            attn, hidden_states, state, frames=1, rows=rows, width=width, causal_frames=causal_frames
        )

    return forward
