"""The passes over row blocks of :mod:`hfpatch.training.contrastive`, apart from the losses and the cross-rank
exchange: the pieces a row's logits are made of (:class:`Piece`), and the passes over blocks of rows that turn
them into the value of a softmax (InfoNCE, CLIP, GIST; :func:`softmax_rows`) or sigmoid (SigLIP;
:func:`sigmoid_rows`) loss and its gradients, without ever holding the whole similarity matrix, and the
autograd Function that runs a loss's pass in its forward and hands the kept gradients over in its backward
(:class:`BlockwiseLoss`). Plain torch; the design notes are in :mod:`hfpatch.training.contrastive`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["BlockwiseLoss", "Piece", "Rows", "scaled_by", "sigmoid_rows", "softmax_rows"]


# ----------------------------------------------------------------------------------------------- the maths
@dataclass(frozen=True)
class Piece:
    """One block of a row's logits: row ``i`` of input ``anchor`` against every row of the inputs ``candidates``
    (concatenated, global). ``group`` is the softmax partition it belongs to; ``positive``: column ``i`` (global
    index) is the row's positive, whose logit the loss subtracts (one such piece per group); ``mask_self``:
    column ``i`` is excluded (an anchor against its own input); ``mask_own``: column ``i`` of every candidate
    input is excluded (a row's own documents); ``guide``: GIST's false-negative mask from the guide's
    similarities (the positive kept)."""

    anchor: int
    candidates: tuple[int, ...]
    group: int = 0
    positive: bool = False
    mask_self: bool = False
    mask_own: bool = False
    guide: bool = False


@dataclass
class Rows:
    """Where this rank's rows sit in the global batch: ``offset`` of its first row, ``total`` rows globally."""

    offset: int
    total: int


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)  # no copy of a single input


def _row_slices(rows: int, block: int) -> list[slice]:
    return [slice(s, min(s + block, rows)) for s in range(0, rows, block)]


def softmax_rows(
    anchors: Sequence[torch.Tensor],
    columns: Sequence[torch.Tensor],
    pieces: Sequence[Piece],
    scale: torch.Tensor,
    where: Rows,
    block: int,
    grad: bool,
    guides: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None], list[torch.Tensor | None], torch.Tensor | None]:
    """Softmax losses in row blocks: ``sum_i sum_g (lse_g(i) - pos_g(i)) / (n_groups total)`` over this rank's
    rows, ``pos_g`` the logit of the pair in group ``g``'s positive piece (the same pair in every group).

    Args:
        anchors: Local rows of every input (``[b, D]``, normalized if the loss normalizes).
        columns: Every input's rows of the global batch (``[total, D]``; the same tensors in one process).
        pieces: The logit pieces of a row (see :class:`Piece`); each group has one positive piece.
        scale: The logits' scale (0-dim).
        where: This rank's rows in the global batch.
        block: Rows per block.
        grad: Also compute the gradients.
        guides: GIST: (local guide rows, global guide rows, per-row threshold ``[b]``).

    Returns:
        ``(partial loss, d anchors (local), d columns (global), d scale)``, the gradients of anchors and columns
        still to be multiplied by ``scale``; in one process (``columns`` are ``anchors``) every gradient is in
        d anchors and d columns is all ``None``. The gradients are ``None`` without ``grad``.
    """
    rows = anchors[0].shape[0]
    dtype, device = anchors[0].dtype, anchors[0].device
    n_groups = 1 + max(p.group for p in pieces)
    candidates = {p.candidates: _concat([columns[k] for k in p.candidates]) for p in pieces}
    guide_candidates = (
        {p.candidates: _concat([guides[1][k] for k in p.candidates]) for p in pieces if p.guide}
        if guides is not None
        else {}
    )
    # Gradients per input: of its local rows as anchors, of its global rows as candidates. In one process the
    # two are the same rows, so they share one buffer (``columns`` are ``anchors``).
    shared = all(c is a for c, a in zip(columns, anchors) if c is not None)
    d_anchor: list[torch.Tensor | None] = [None] * len(anchors)
    d_columns: list[torch.Tensor | None] = [None] * len(columns)
    if grad:
        for p in pieces:
            if d_anchor[p.anchor] is None:
                d_anchor[p.anchor] = torch.zeros_like(anchors[p.anchor])
            for k in p.candidates:
                if d_columns[k] is None:
                    if shared and d_anchor[k] is None:
                        d_anchor[k] = torch.zeros_like(anchors[k])
                    d_columns[k] = d_anchor[k] if shared else torch.zeros_like(columns[k])
    value = torch.zeros((), dtype=dtype, device=device)
    d_scale = torch.zeros((), dtype=dtype, device=device) if grad else None
    for rows_ in _row_slices(rows, block):
        b = rows_.stop - rows_.start
        arange = torch.arange(b, device=device)
        own = arange + (where.offset + rows_.start)  # global index of each row of the block
        logits = []
        for p in pieces:
            cand = candidates[p.candidates]
            piece = anchors[p.anchor][rows_] @ cand.T  # [b, N_p]
            piece.mul_(scale)
            if p.mask_self:
                piece[arange, own] = -math.inf
            if p.mask_own:
                for k in range(len(p.candidates)):
                    piece[arange, own + k * where.total] = -math.inf
            if p.guide:
                local_guides, _, threshold = guides
                similar = local_guides[p.anchor][rows_] @ guide_candidates[p.candidates].T
                mask = similar > threshold[rows_, None]
                del similar
                if p.positive:
                    mask[arange, own] = False
                piece.masked_fill_(mask, -math.inf)
                del mask
            logits.append(piece)
        # Each group's softmax relative to its row maximum m (as torch.softmax): exp(l - m) / s with
        # s = sum exp(l - m), lse = m + log s. Never exp(l - lse): at scale 100 |lse| is near 100, and
        # rounding lse to fp32 moves every probability by ~1e-6 absolute, the whole gradient of a confidently
        # classified row. l - m is exact near the maximum (Sterbenz), so the row's leader gets exactly 1 / s.
        maxima: list[torch.Tensor | None] = [None] * n_groups
        for p, piece in zip(pieces, logits):
            top = piece.amax(dim=1)
            maxima[p.group] = top if maxima[p.group] is None else torch.maximum(maxima[p.group], top)
        maxima = [m.nan_to_num(0.0, posinf=0.0, neginf=0.0) for m in maxima]  # a row of all -inf: lse -inf
        positive = [piece[arange, own] for p, piece in zip(pieces, logits) if p.positive]  # before the exp
        sums = [torch.zeros(b, dtype=dtype, device=device) for _ in range(n_groups)]
        for p, piece in zip(pieces, logits):
            sums[p.group] += piece.sub_(maxima[p.group][:, None]).exp_().sum(dim=1)  # in place: exp(l - m)
        group_lse = [m + s.log() for m, s in zip(maxima, sums)]
        # one positive per group (its pair's logit): sum_g (lse_g - pos_g) / n_groups
        value = value + (sum(group_lse) - sum(positive)).sum() / n_groups
        if not grad:
            continue
        for p, piece in zip(pieces, logits):
            # dL/dlogits = (softmax over the piece's group - onehot(positive)) / (n_groups total), in place
            piece.div_(sums[p.group][:, None]).mul_(1.0 / (n_groups * where.total))
            if p.positive:
                piece[arange, own] -= 1.0 / (n_groups * where.total)
            anchor = anchors[p.anchor][rows_]
            grad_rows = piece @ candidates[p.candidates]  # [b, D] = G c (times scale: dL/d anchor)
            d_scale += (anchor * grad_rows).sum()  # sum_ij G_ij a_i . c_j = dL/d scale
            d_anchor[p.anchor][rows_] += grad_rows
            for j, k in enumerate(p.candidates):  # G^T a, per candidate input's columns
                d_columns[k].addmm_(piece[:, j * where.total : (j + 1) * where.total].T, anchor)
        del logits, piece
    if shared:
        d_columns = [None] * len(columns)  # all in d_anchor
    return value / where.total, d_anchor, d_columns, d_scale


def sigmoid_rows(
    images: torch.Tensor,
    texts: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    where: Rows,
    block: int,
    grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """SigLIP in row blocks: ``sum_ij softplus(-z_ij (t x_i . y_j + b)) / total`` over this rank's image rows
    ``i`` and every text ``j``; ``z_ij = 1`` for the pair (``j`` = the global index of ``i``), -1 otherwise.

    Returns ``(partial loss, d images (local, unscaled: times t), d texts (global, unscaled), dt, db)``.
    """
    rows = images.shape[0]
    dtype, device = images.dtype, images.device
    value = torch.zeros((), dtype=dtype, device=device)
    d_images = torch.zeros_like(images) if grad else None
    d_texts = torch.zeros_like(texts) if grad else None
    d_scale = torch.zeros((), dtype=dtype, device=device) if grad else None
    d_bias = torch.zeros((), dtype=dtype, device=device) if grad else None
    for rows_ in _row_slices(rows, block):
        b = rows_.stop - rows_.start
        arange = torch.arange(b, device=device)
        own = arange + (where.offset + rows_.start)
        x = images[rows_]
        u = x @ texts.T  # [b, total]
        u.mul_(scale).add_(bias)
        u[arange, own] *= -1  # u = -z * logit
        value = value + nn.functional.softplus(u).sum()  # -log sigmoid(z * logit) = softplus(-z * logit)
        if not grad:
            continue
        g = u.sigmoid_()  # dL/dlogit = -z sigmoid(-z logit)
        g[arange, own] *= -1
        g.mul_(1.0 / where.total)
        d_bias += g.sum()
        grad_rows = g @ texts
        d_scale += (x * grad_rows).sum()
        d_images[rows_] += grad_rows
        d_texts.addmm_(g.T, x)
        del u, g
    return value / where.total, d_images, d_texts, d_scale, d_bias


class BlockwiseLoss(torch.autograd.Function):
    """Value and gradients of a :class:`~hfpatch.training.contrastive.base.ContrastiveLoss` in one pass over
    the row blocks (its forward); the backward scales the gradients kept by the incoming one."""

    @staticmethod
    def forward(ctx, loss, group, world, n_scalars, n_reps, grad, *tensors):
        """The loss value; the gradients of the scalars and embeddings (``tensors``) are kept on ``ctx``."""
        scalars, reps, guides = (
            tensors[:n_scalars],
            tensors[n_scalars : n_scalars + n_reps],
            tensors[n_scalars + n_reps :],
        )
        value, d_reps, d_scalars = loss._compute(list(scalars), list(reps), list(guides), group, world, grad)
        ctx.grads = (d_scalars, d_reps)
        ctx.dtypes = [t.dtype for t in tensors[: n_scalars + n_reps]]
        ctx.n_guides = len(guides)
        return value

    @staticmethod
    def backward(ctx, grad_out):
        """The kept gradients times ``grad_out`` (no double backward)."""
        if torch.is_grad_enabled():  # create_graph=True: the kept gradients have no graph of their own
            raise RuntimeError(
                "the row-blocked contrastive losses compute their gradients in the forward and support no "
                "double backward (create_graph=True); use the unchunked loss for higher-order gradients."
            )
        if ctx.grads is None:
            raise RuntimeError(
                "the row-blocked loss was back-propagated twice (retain_graph=True): its "
                "gradients are kept for one backward."
            )
        d_scalars, d_reps = ctx.grads
        ctx.grads = None  # one backward: the kept buffers are scaled in place and handed over
        out = [None] * 6
        for d, dtype in zip([*d_scalars, *d_reps], ctx.dtypes):
            out.append(None if d is None else d.mul_(grad_out.to(d.dtype)).to(dtype))
        return (*out, *([None] * ctx.n_guides))


def scaled_by(grads: list[torch.Tensor | None], scale: torch.Tensor) -> list[torch.Tensor | None]:
    """``grads`` (the unscaled gradients a pass returns) multiplied by ``scale`` in place, ``None`` kept: the
    step that turns :func:`softmax_rows`'s and :func:`sigmoid_rows`'s gradients into the loss's.

    >>> import torch
    >>> scaled_by([torch.ones(2), None], torch.tensor(3.0))
    [tensor([3., 3.]), None]
    """
    return [None if g is None else g.mul_(scale.detach()) for g in grads]
