"""GISTEmbed's InfoNCE whose false negatives a guide model masks, as a row-blocked loss: the pieces of a row's
softmax and the guide's threshold per row. The design notes are in :mod:`hfpatch.training.contrastive`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from .base import ContrastiveLoss
from .blocks import Piece, scaled_by, softmax_rows

__all__ = ["GISTLoss"]


class GISTLoss(ContrastiveLoss):
    """GISTEmbed (Solatorio, 2024): InfoNCE whose false negatives are masked by a guide model, in row blocks.

    Inputs ``(anchors, positives, *negatives)`` and ``guide=(guide_anchors, guide_positives, *guide_negatives)``
    (the guide model's embeddings of the same texts; any width). A candidate is dropped from anchor ``i``'s
    softmax when the guide scores it above the guide's score of the pair ``(i, i)`` minus a margin; anchor ``i``
    is scored against every positive, every other anchor (``contrast_anchors``), positive ``i`` against every
    other positive (``contrast_positives``), and against every negative; all in one softmax with temperature
    ``temperature``. The same loss as sentence-transformers' ``GISTEmbedLoss`` (which takes one negative at
    most; this one takes any number), with the guide's embeddings given instead of the guide model
    (:class:`~hfpatch.training.sentence_transformers.GradCacheLoss` computes them from a ``GISTEmbedLoss``'s
    guide). Similarities are cosine.

    Args:
        temperature: Logits are ``cos / temperature`` (ST's default 0.01).
        margin_strategy: ``"absolute"`` (drop above ``guide(i, i) - margin``) or ``"relative"`` (above
            ``guide(i, i) - |guide(i, i)| * margin``).
        margin: The margin (default 0).
        contrast_anchors, contrast_positives: Add the anchor-anchor and positive-positive terms.
        block_size, block_bytes: See :class:`ContrastiveLoss`.

    >>> import torch
    >>> a, p = torch.randn(5, 8), torch.randn(5, 8)
    >>> guide = [torch.randn(5, 3), torch.randn(5, 3)]
    >>> GISTLoss(block_size=2)(a, p, guide=guide).shape
    torch.Size([])
    """

    def __init__(
        self,
        temperature: float = 0.01,
        *,
        margin_strategy: Literal["absolute", "relative"] = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        block_size: int | None = None,
        block_bytes: int | None = None,
    ):
        super().__init__(block_size=block_size, block_bytes=block_bytes, normalize=True)
        name = type(self).__name__
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"{name}: temperature must be a positive float, got {temperature!r}.")
        if margin_strategy not in ("absolute", "relative"):
            raise ValueError(
                f"{name}: margin_strategy must be 'absolute' or 'relative', got {margin_strategy!r}."
            )
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise ValueError(f"{name}: margin must be a finite float, got {margin!r}.")
        self.temperature = float(temperature)
        self.margin_strategy = margin_strategy
        self.margin = float(margin)
        self.contrast_anchors = bool(contrast_anchors)
        self.contrast_positives = bool(contrast_positives)

    def _settings(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "margin_strategy": self.margin_strategy,
            "margin": self.margin,
            "contrast_anchors": self.contrast_anchors,
            "contrast_positives": self.contrast_positives,
        }

    def _check_guides(self, n_reps: int, n_guides: int) -> str | None:
        if n_guides != n_reps:
            return f"needs guide=[...] with the guide model's embeddings of every input ({n_reps}), got {n_guides}"
        return None

    def _scalars(self) -> list[torch.Tensor]:
        return [torch.tensor(1.0 / self.temperature, dtype=torch.float64)]

    def _pieces(self, n_reps: int) -> list[Piece]:
        pieces = [Piece(0, (1,), positive=True, guide=True)]
        if self.contrast_anchors:
            pieces.append(Piece(0, (0,), guide=True))
        if self.contrast_positives:
            pieces.append(Piece(1, (1,), guide=True))
        if n_reps > 2:
            pieces.append(Piece(0, tuple(range(2, n_reps)), guide=True))
        return pieces

    def _bytes_per_row(self, n_reps, total, width, guide_width, itemsize):
        columns = [total * len(p.candidates) for p in self._pieces(n_reps)]
        return itemsize * (sum(columns) + 2 * max(columns) + width * (len(columns) + 1)) + max(columns)

    def _gathered(self, n_reps: int) -> list[int]:
        return sorted({k for p in self._pieces(n_reps) for k in p.candidates})

    def _run(self, scalars, anchors, columns, guides, where, block, grad):
        (scale,) = scalars
        local_guides, guide_columns = guides
        pair = (local_guides[0] * local_guides[1]).sum(-1)  # the guide's cosine of each pair (i, i)
        if self.margin_strategy == "absolute":
            threshold = pair - self.margin
        else:
            threshold = pair - pair.abs() * self.margin
        value, d_anchor, d_columns, _ = softmax_rows(
            anchors,
            columns,
            self._pieces(len(anchors)),
            scale,
            where,
            block,
            grad,
            guides=(local_guides, guide_columns, threshold),
        )
        return value, scaled_by(d_anchor, scale), scaled_by(d_columns, scale), [None]
