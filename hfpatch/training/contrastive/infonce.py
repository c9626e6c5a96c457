"""InfoNCE with in-batch and hard negatives (sentence-transformers' MultipleNegativesRankingLoss, symmetric
InfoNCE) and CLIP's symmetric InfoNCE with a learned temperature, as row-blocked losses: the pieces of a row's
softmax each direction adds. The design notes are in :mod:`hfpatch.training.contrastive`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from .base import ContrastiveLoss, scalar_input
from .blocks import Piece, scaled_by, softmax_rows

__all__ = ["CLIPLoss", "InfoNCELoss"]

_CLIP_LOGIT_SCALE = math.log(1 / 0.07)  # CLIP's initial temperature 0.07


class InfoNCELoss(ContrastiveLoss):
    """InfoNCE / MultipleNegativesRankingLoss with in-batch (and hard) negatives, computed in row blocks.

    Inputs ``(queries, documents, *hard_negatives)``, each ``[B, D]``: query ``i`` should score document ``i``
    above every other document of the (global) batch and every hard negative; the candidates of a query are
    ``cat(documents, *hard_negatives)`` (``B (1 + K)`` columns). The same loss as sentence-transformers'
    ``MultipleNegativesRankingLoss`` (``compute_loss_from_embeddings``) with ``similarity_fct=cos_sim``
    (``normalize=True``) or ``dot_score`` (``normalize=False``), without hardness weighting; also InfoNCE,
    SimCSE, and (both directions) symmetric InfoNCE.

    Args:
        scale: Logits are ``scale * similarity`` (``1 / temperature``; ST's default 20): a float, or a scalar
            tensor (learned, or a model's; its gradient is exact).
        directions: Which terms a row's softmax covers (sentence-transformers' names): ``"query_to_doc"``
            (always; holds the positive), ``"doc_to_query"`` (document ``i`` against every query: the symmetric
            term), ``"query_to_query"`` (query ``i`` against the other queries), ``"doc_to_doc"`` (document ``i``
            against the documents of the other queries).
        partition_mode: ``"joint"``: one softmax over every direction of the row; ``"per_direction"``: one per
            direction, their log-normalisers averaged (then only query_to_doc and doc_to_query).
        block_size, block_bytes, normalize: See :class:`ContrastiveLoss`.

    >>> import torch
    >>> loss_fn = InfoNCELoss(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")
    >>> q, d, hard = (torch.randn(6, 4) for _ in range(3))
    >>> round(loss_fn(q, d, hard).item(), 4) > 0
    True
    """

    _DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")

    def __init__(
        self,
        scale: float | torch.Tensor = 20.0,
        *,
        directions: Sequence[str] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        block_size: int | None = None,
        block_bytes: int | None = None,
        normalize: bool = True,
    ):
        super().__init__(block_size=block_size, block_bytes=block_bytes, normalize=normalize)
        name = type(self).__name__
        directions = tuple(directions)
        unknown = [d for d in directions if d not in self._DIRECTIONS]
        if unknown or not directions or len(set(directions)) != len(directions):
            raise ValueError(
                f"{name}: directions must be distinct names among {self._DIRECTIONS}, got {directions}."
            )
        if "query_to_doc" not in directions:
            raise ValueError(f"{name}: directions must include 'query_to_doc' (it holds the positive pair).")
        if partition_mode not in ("joint", "per_direction"):
            raise ValueError(
                f"{name}: partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}."
            )
        if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(directions):
            raise ValueError(
                f"{name}: partition_mode='per_direction' needs every direction to hold the positive pair; "
                "query_to_query and doc_to_doc do not: use partition_mode='joint'."
            )
        self.directions = tuple(d for d in self._DIRECTIONS if d in directions)  # a fixed order: the pieces'
        self.partition_mode = partition_mode
        self._set_scale(scale)

    def _set_scale(self, scale: float | torch.Tensor) -> None:
        value = scalar_input(scale, "scale", type(self).__name__)
        if isinstance(scale, torch.Tensor):
            self.__dict__["_scale"] = value  # the caller's tensor (a model's parameter): not registered again
        else:
            self.register_buffer("_scale", value, persistent=False)

    def _settings(self) -> dict[str, Any]:
        fixed = {} if self._scale.requires_grad else {"scale": round(float(self._scale), 6)}
        return {
            **super()._settings(),
            **fixed,
            "directions": self.directions,
            "partition_mode": self.partition_mode,
        }

    def _scalars(self) -> list[torch.Tensor]:
        return [self._scale.reshape(())]

    def _pieces(self, n_reps: int) -> list[Piece]:
        docs = tuple(range(1, n_reps))
        per_direction = self.partition_mode == "per_direction"
        table = {
            "query_to_doc": Piece(0, docs, positive=True),
            "query_to_query": Piece(0, (0,), mask_self=True),
            "doc_to_query": Piece(1, (0,), positive=per_direction),  # its own softmax's positive
            "doc_to_doc": Piece(1, docs, mask_own=True),
        }
        return [
            Piece(**{**vars(table[d]), "group": g if per_direction else 0})
            for g, d in enumerate(self.directions)
        ]

    def _bytes_per_row(self, n_reps, total, width, guide_width, itemsize):
        columns = [total * len(p.candidates) for p in self._pieces(n_reps)]
        return itemsize * (sum(columns) + max(columns) + width * (len(columns) + 1))

    def _gathered(self, n_reps: int) -> list[int]:
        return sorted({k for p in self._pieces(n_reps) for k in p.candidates})

    def _run(self, scalars, anchors, columns, guides, where, block, grad):
        (scale,) = scalars
        value, d_anchor, d_columns, d_scale = softmax_rows(
            anchors, columns, self._pieces(len(anchors)), scale.detach(), where, block, grad
        )
        return value, scaled_by(d_anchor, scale), scaled_by(d_columns, scale), [d_scale]

    @property
    def scale(self) -> torch.Tensor:
        """The logits' scale (``1 / temperature``)."""
        return self._scale


class CLIPLoss(InfoNCELoss):
    """CLIP's symmetric InfoNCE with a learned temperature (OpenCLIP's ``ClipLoss``), computed in row blocks.

    Inputs ``(image_embeddings, text_embeddings)``, ``[B, D]`` each; the loss is
    ``(CE(s I T^T, labels) + CE(s T I^T, labels)) / 2`` with ``s = exp(logit_scale)`` and cosine similarities
    (``normalize=True``; pass ``normalize=False`` for embeddings that are normalized already, as OpenCLIP's
    models return them).

    Args:
        logit_scale: Log of the logits' scale: a float (a parameter of this loss, CLIP's init
            ``log(1 / 0.07)``) or a scalar tensor such as ``clip_model.logit_scale`` (used as it is, not
            registered here). OpenCLIP clamps it to ``[0, log 100]`` after each optimizer step; do so in your
            loop if you want that.
        block_size, block_bytes, normalize: See :class:`ContrastiveLoss`.

    >>> import torch
    >>> loss_fn = CLIPLoss()
    >>> loss_fn(torch.randn(4, 8), torch.randn(4, 8)).shape
    torch.Size([])
    """

    min_inputs = max_inputs = 2

    def __init__(
        self,
        logit_scale: float | torch.Tensor = _CLIP_LOGIT_SCALE,
        *,
        block_size: int | None = None,
        block_bytes: int | None = None,
        normalize: bool = True,
    ):
        log_scale = scalar_input(logit_scale, "logit_scale", type(self).__name__)
        super().__init__(
            1.0,
            directions=("query_to_doc", "doc_to_query"),
            partition_mode="per_direction",
            block_size=block_size,
            block_bytes=block_bytes,
            normalize=normalize,
        )
        if isinstance(logit_scale, torch.Tensor):
            self.__dict__["logit_scale"] = log_scale
        else:
            self.logit_scale = nn.Parameter(log_scale)

    def _scalars(self) -> list[torch.Tensor]:
        return [self.logit_scale.reshape(()).exp()]

    @property
    def scale(self) -> torch.Tensor:
        """``exp(logit_scale)``."""
        return self.logit_scale.exp()
