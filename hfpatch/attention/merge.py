"""Online-softmax merge of attention blocks computed over disjoint key sets.

If ``(o_i, lse_i)`` is attention of the same queries over key block ``i``, attention over the union is

    lse = log(sum_i exp(lse_i)),   o = sum_i exp(lse_i - lse) * o_i

which is exact (only the summation order changes the rounding). A block with no keys has ``lse = -inf``
and weight 0. Accumulators are float32 whatever the block dtype.

>>> import torch
>>> from hfpatch.attention.local import local_attention
>>> q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
>>> out, lse = merge_blocks([local_attention(q, k[:, :2], v[:, :2]), local_attention(q, k[:, 2:], v[:, 2:])])
>>> ref, ref_lse = local_attention(q, k, v)
>>> bool(torch.allclose(out, ref, atol=1e-6)), bool(torch.allclose(lse, ref_lse, atol=1e-6))
(True, True)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["merge_attention", "merge_blocks"]

Tensor = torch.Tensor


def merge_attention(
    out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Fold one block ``(block_out_bshd, block_lse_bhs)`` into the running ``(out, lse)`` (float32).

    ``out=None`` starts a new accumulation. The running ``out`` is updated in place when it is already a
    float32 accumulator, so a ring of ``r`` blocks keeps one output buffer alive, not ``r``.
    """
    if out is None or lse is None:
        return block_out.float(), block_lse.float().clone()
    new_lse = torch.logaddexp(lse, block_lse)
    # Weights per (b, h, s), broadcast over the head dim of the bshd outputs.
    old_w = (lse - new_lse).exp_().transpose(1, 2).unsqueeze(-1)
    new_w = (block_lse - new_lse).exp_().transpose(1, 2).unsqueeze(-1)
    out = out.mul_(old_w) if out.dtype == torch.float32 else out.float() * old_w
    return out.add_(block_out.float() * new_w), new_lse


def merge_blocks(blocks: Iterable[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge ``(out, lse)`` blocks in the given order; returns float32 ``(out_bshd, lse_bhs)``."""
    out: Tensor | None = None
    lse: Tensor | None = None
    for block_out, block_lse in blocks:
        out, lse = merge_attention(out, lse, block_out, block_lse)
    if out is None or lse is None:
        raise ValueError("merge_blocks needs at least one (out, lse) block")
    return out, lse
