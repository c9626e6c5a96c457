"""SigLIP's pairwise sigmoid loss with a learned temperature and bias, as a row-blocked loss. The design
notes are in :mod:`hfpatch.training.contrastive`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import ContrastiveLoss, scalar_input
from .blocks import scaled_by, sigmoid_rows

__all__ = ["SigLIPLoss"]

_SIGLIP_LOGIT_SCALE = math.log(10.0)  # SigLIP's initial t = 10 (bias -10)


class SigLIPLoss(ContrastiveLoss):
    """SigLIP's pairwise sigmoid loss (Zhai et al., 2023; OpenCLIP's ``SigLipLoss``), computed in row blocks.

    Inputs ``(image_embeddings, text_embeddings)``, ``[B, D]`` each; the loss is
    ``-sum_ij log sigmoid(z_ij (t x_i . y_j + b)) / B`` with ``t = exp(logit_scale)``, ``z_ij = 1`` for the
    pairs and -1 for every other image-text combination of the (global) batch, normalized by the number of
    images as in the paper. Cross-rank, every rank scores its images against all texts (OpenCLIP exchanges
    text blocks between neighbours instead; the sum is the same).

    Args:
        logit_scale: Log of ``t`` (init ``log 10``) and
        logit_bias: ``b`` (init -10): floats (parameters of this loss) or scalar tensors (e.g. a
            ``SiglipModel``'s ``logit_scale`` and ``logit_bias``, used as they are).
        block_size, block_bytes, normalize: See :class:`ContrastiveLoss`.

    >>> import torch
    >>> loss_fn = SigLIPLoss(block_size=4)
    >>> loss = loss_fn(torch.randn(6, 8), torch.randn(6, 8))
    >>> loss.backward()
    >>> loss_fn.logit_scale.grad is not None and loss_fn.logit_bias.grad is not None
    True
    """

    min_inputs = max_inputs = 2

    def __init__(
        self,
        logit_scale: float | torch.Tensor = _SIGLIP_LOGIT_SCALE,
        logit_bias: float | torch.Tensor = -10.0,
        *,
        block_size: int | None = None,
        block_bytes: int | None = None,
        normalize: bool = True,
    ):
        super().__init__(block_size=block_size, block_bytes=block_bytes, normalize=normalize)
        for name, value in (("logit_scale", logit_scale), ("logit_bias", logit_bias)):
            tensor = scalar_input(value, name, type(self).__name__)
            if isinstance(value, torch.Tensor):
                self.__dict__[name] = tensor
            else:
                setattr(self, name, nn.Parameter(tensor))

    def _scalars(self) -> list[torch.Tensor]:
        return [self.logit_scale.reshape(()).exp(), self.logit_bias.reshape(())]

    def _bytes_per_row(self, n_reps, total, width, guide_width, itemsize):
        return itemsize * (2 * total + 2 * width)

    def _gathered(self, n_reps: int) -> list[int]:
        return [1]

    def _run(self, scalars, anchors, columns, guides, where, block, grad):
        scale, bias = scalars
        value, d_images, d_texts, d_scale, d_bias = sigmoid_rows(
            anchors[0], columns[1], scale.detach(), bias.detach(), where, block, grad
        )
        d_anchor = scaled_by([d_images, None], scale)
        return value, d_anchor, scaled_by([None, d_texts], scale), [d_scale, d_bias]
