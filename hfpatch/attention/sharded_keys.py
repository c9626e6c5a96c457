"""Attention of replicated queries over keys/values sharded across ranks (a cross-attention *to* the shards).

LTX-2's video-to-audio attention: the audio tokens (few, replicated on every rank) attend to the video tokens
(sharded). Each rank attends with every query to its own key block (padding, at the global end, truncated:
:func:`~hfpatch.attention.layout.valid_prefix`), the ranks exchange the small per-block ``(out, lse)`` and every
rank merges all blocks in the same order (:mod:`hfpatch.attention.merge`), so the output is exact and bitwise
identical on every rank. Nothing of the keys travels: bytes sent per rank are ``(N - 1)`` query-sized blocks.

Backward (a custom :class:`torch.autograd.Function`): the ranks' output gradients are summed (all-reduce of a
query-sized tensor) and each rank recomputes its own block's contribution from the merged ``out``/``lse``.
Gradient convention as :func:`hfpatch.attention.usp.usp_attention`: the objective is the SUM of the ranks'
losses; the sharded key/value gradients are exact shard gradients, the replicated query's are this rank's
share (they sum over the group to the full gradient).

>>> import torch
>>> q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
>>> out = sharded_keys_attention(q, k, v, group=None, valid_len=5)
>>> ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
>>> bool(torch.allclose(out, ref.transpose(1, 2), atol=1e-6))
True
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.collectives import all_gather
from .layout import group_rank, group_size, valid_prefix
from .local import accum_dtype, local_attention, local_attention_backward
from .merge import merge_blocks

__all__ = ["sharded_keys_attention"]

Tensor = torch.Tensor


def _h(x: Tensor) -> Tensor:
    return x.transpose(1, 2)


def _block(q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    """``(out_bhsd, lse_bhs)`` of the queries over this rank's real keys (none: zeros and ``-inf``)."""
    if k.shape[1] == 0:
        out = torch.zeros_like(_h(q))
        return out, torch.full(out.shape[:3], float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
    return local_attention(_h(q), _h(k), _h(v), scale, backend)


class _ShardedKeysAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, real, scale, backend):
        k, v = key[:, :real], value[:, :real]
        out, lse = _block(query, k, v, scale, backend)
        world = group_size(group)
        if world > 1:
            outs = all_gather(out.unsqueeze(0).contiguous(), 0, group)
            lses = all_gather(lse.unsqueeze(0).contiguous(), 0, group)
            out, lse = merge_blocks(zip(outs.unbind(0), lses.unbind(0)))
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.args = (group, real, scale, backend)
        return _h(out).contiguous()

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out, lse = ctx.saved_tensors
        group, real, scale, backend = ctx.args
        dout = _h(dout).contiguous()
        if group_size(group) > 1:  # every rank's share of the output gradient: the full one
            dist.all_reduce(dout, group=group)
        dq = torch.zeros_like(query)
        dk, dv = torch.zeros_like(key), torch.zeros_like(value)
        if real:
            k, v = key[:, :real], value[:, :real]
            dq_h, dk_h, dv_h = local_attention_backward(
                dout, _h(query), _h(k), _h(v), out, lse, scale, backend
            )
            dq.copy_(_h(dq_h))
            dk[:, :real] = _h(dk_h)
            dv[:, :real] = _h(dv_h)
        return dq, dk, dv, None, None, None, None


def sharded_keys_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: dist.ProcessGroup | None,
    valid_len: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Softmax attention of replicated ``query`` over the keys/values sharded over ``group``; exact.

    Args:
        query: ``[B, S_q, H, D]``, the same on every rank of ``group``.
        key, value: ``[B, S_local, H, D]``, this rank's shard (shard index = rank in ``group``; the global
            sequence is the shards in order, padded at the end).
        group: The process group the keys are sharded over (``None``: one rank).
        valid_len: Real keys in the global sequence; keys at positions ``>= valid_len`` are masked.
        scale: Softmax scale (default ``D ** -0.5``).
        backend: Local kernel (:mod:`hfpatch.attention.local`).

    Returns:
        ``[B, S_q, H, D]``, identical on every rank.
    """
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4 or query.shape[::2] != key.shape[::2]:
        raise ValueError(
            f"sharded_keys_attention takes [B, S, H, D] tensors with the same B, H, D; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    local = key.shape[1]
    real = valid_prefix(group_rank(group) * local, local, valid_len)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _ShardedKeysAttention.apply(query, key, value, group, real, scale, backend)
