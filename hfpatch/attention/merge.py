"""Online-softmax merge of attention blocks computed over disjoint key sets.

If ``(o_i, lse_i)`` is attention of the same queries over key block ``i``, attention over the union is

    lse = log(sum_i exp(lse_i)),   o = sum_i exp(lse_i - lse) * o_i

which is exact (only the summation order changes the rounding). Layouts: ``out_bhsd``, ``lse_bhs``.
Accumulators are float32 (float64 for float64 blocks) whatever the block dtype.

>>> import torch
>>> from hfpatch.attention.local import local_attention
>>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
>>> blocks = [local_attention(q, k[:, :, :2], v[:, :, :2]), local_attention(q, k[:, :, 2:], v[:, :, 2:])]
>>> out, lse = merge_blocks(blocks)
>>> ref, ref_lse = local_attention(q, k, v)
>>> bool(torch.allclose(out, ref, atol=1e-6)), bool(torch.allclose(lse, ref_lse, atol=1e-6))
(True, True)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .local import accum_dtype

__all__ = ["merge_attention", "merge_blocks"]

Tensor = torch.Tensor


def merge_attention(
    out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Fold one block ``(block_out_bhsd, block_lse_bhs)`` into the running ``(out, lse)``.

    ``out=None`` starts a new accumulation (in :func:`~hfpatch.attention.local.accum_dtype`). Memory:
    the running ``out`` is updated in place and ``block_out`` is *consumed* (it may be overwritten), so
    merging keeps one accumulator and one block alive, never a list of blocks.
    """
    acc = accum_dtype(block_out.dtype)
    if out is None or lse is None:
        return block_out.to(acc), block_lse.to(acc)
    block_lse = block_lse.to(acc)
    # The weights come from the lse *difference*: sigmoid(-d) and sigmoid(d) sum to 1 within a few eps. The
    # textbook exp(lse_i - new_lse) carries new_lse's rounding (half an ulp of |lse|: 3e-5 at |lse| ~ 650,
    # logits of a model without qk-norm) into both weights alike, scaling the whole output by 1 + eps * |lse|.
    # Equal lse (both -inf: no keys on either side) weigh 1/2 each instead of giving nan.
    # Ordered so that at most two lse-sized temporaries are alive at once, as with the textbook weights.
    diff = (block_lse - lse).masked_fill_(block_lse == lse, 0.0)
    out = out.mul_(diff.neg().sigmoid_().unsqueeze(-1))
    block = block_out.to(acc).mul_(diff.sigmoid_().unsqueeze(-1))
    del diff
    return out.add_(block), torch.logaddexp(lse, block_lse)


def merge_blocks(blocks: Iterable[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge ``(out, lse)`` blocks in the given order (consuming them); returns the accumulated ``(out, lse)``."""
    out: Tensor | None = None
    lse: Tensor | None = None
    for block_out, block_lse in blocks:
        out, lse = merge_attention(out, lse, block_out, block_lse)
    if out is None or lse is None:
        raise ValueError("merge_blocks needs at least one (out, lse) block")
    return out, lse
