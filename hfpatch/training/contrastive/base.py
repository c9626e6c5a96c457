"""The contract of a row-blocked contrastive loss: :class:`ContrastiveLoss`, the base every loss of
:mod:`hfpatch.training.contrastive` fills with its maths (validation, block size, the agreement of the ranks'
inputs, the call through :class:`~hfpatch.training.contrastive.blocks.BlockwiseLoss`), and how GradCache tells
such a loss from a plain callable (:func:`takes_local_embeddings`). The design notes are in
:mod:`hfpatch.training.contrastive`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .blocks import BlockwiseLoss, Rows
from .ranks import agree, cross_rank_world, gather_columns, route_back

__all__ = ["DEFAULT_BLOCK_BYTES", "ContrastiveLoss", "scalar_input", "takes_local_embeddings"]

#: Working memory of the loss stage per rank when neither ``block_size`` nor ``block_bytes`` is given.
DEFAULT_BLOCK_BYTES = 256 * 2**20


def takes_local_embeddings(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` gathers cross-rank negatives itself (the losses of :mod:`hfpatch.training.contrastive`,
    and callables that carry a true ``gathers_across_ranks`` attribute): GradCache then hands it the local
    embeddings with ``cross_rank=``/``process_group=`` keywords instead of gathering them and scaling their
    gradients.

    >>> from hfpatch.training.contrastive import InfoNCELoss
    >>> takes_local_embeddings(InfoNCELoss()), takes_local_embeddings(lambda q, d: (q * d).sum())
    (True, False)
    """
    return getattr(loss_fn, "gathers_across_ranks", False) is True


def scalar_input(value: float | torch.Tensor, name: str, owner: str) -> torch.Tensor:
    """A loss's scalar setting (a temperature, a bias) as a tensor: a scalar tensor (shape ``()`` or ``(1,)``,
    floating) as it is, a finite float as a new 0-dim tensor; anything else raises a ``ValueError`` naming
    ``owner`` and ``name``.

    >>> scalar_input(2.0, "scale", "InfoNCELoss")
    tensor(2.)
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.ndim > 1:
            raise ValueError(
                f"{owner}: {name} must be a scalar (shape () or (1,)), got a tensor of shape {tuple(value.shape)}; "
                "one temperature for the whole batch."
            )
        if not value.is_floating_point():
            raise ValueError(f"{owner}: {name} must be a floating-point tensor, got {value.dtype}.")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be a finite float or a scalar tensor, got {value!r}.")
    return torch.tensor(float(value))


class ContrastiveLoss(nn.Module):
    """Base of the row-blocked contrastive losses (see :mod:`hfpatch.training.contrastive`): validation, block size,
    cross-rank gathering and routing; subclasses give the maths.

    Args:
        block_size: Anchor rows per block (default: from ``block_bytes``).
        block_bytes: Working memory of the loss stage per rank; the block is the most rows it holds (at least
            one). Default :data:`DEFAULT_BLOCK_BYTES` (256 MiB).
        normalize: L2-normalize the embeddings first (cosine similarity), inside the loss's graph.

    ``forward(*embeddings, cross_rank=False, process_group=None)`` returns the scalar loss; row ``i`` of every
    input belongs to pair ``i``. With ``cross_rank=True`` the negatives of every rank of ``process_group``
    (default: world) take part (one process: a world of one).

    Raises:
        ValueError: Bad settings (at construction); inputs of different batch sizes or widths, inputs that
            are not ``[batch, dim]`` floating tensors, the wrong number of inputs, or (cross-rank) ranks that
            disagree on the number, widths or dtype of the inputs or on the loss's settings: at ``forward``, the
            same error on every rank, before the embeddings are gathered.
    """

    #: GradCache hands the local embeddings and ``cross_rank=``/``process_group=`` (:func:`takes_local_embeddings`).
    gathers_across_ranks = True
    #: Least and most embedding inputs (``None``: no bound).
    min_inputs: int = 2
    max_inputs: int | None = None

    def __init__(
        self, *, block_size: int | None = None, block_bytes: int | None = None, normalize: bool = True
    ):
        super().__init__()
        name = type(self).__name__
        if block_size is not None and (
            isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
        ):
            raise ValueError(f"{name}: block_size must be a positive number of rows, got {block_size!r}.")
        if block_bytes is not None and (
            isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1
        ):
            raise ValueError(f"{name}: block_bytes must be a positive number of bytes, got {block_bytes!r}.")
        if block_size is not None and block_bytes is not None:
            raise ValueError(f"{name}: give block_size or block_bytes, not both.")
        if not isinstance(normalize, bool):
            raise ValueError(f"{name}: normalize must be a bool, got {normalize!r}.")
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.normalize = normalize

    # -- to be given by subclasses -------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        """The settings every rank must agree on (the metadata exchange compares a digest of them)."""
        return {"normalize": self.normalize}

    def _scalars(self) -> list[torch.Tensor]:
        """The loss's scalar inputs as autograd tensors (e.g. ``logit_scale.exp()``)."""
        raise NotImplementedError

    def _bytes_per_row(self, n_reps: int, total: int, width: int, guide_width: int, itemsize: int) -> int:
        raise NotImplementedError

    def _gathered(self, n_reps: int) -> list[int]:
        """Inputs whose global rows the loss needs (candidates)."""
        return list(range(n_reps))

    def _run(self, scalars, anchors, columns, guides, where, block, grad):
        """``(partial value, d anchors (final, local), d columns (global, partial), d scalars (partial))``."""
        raise NotImplementedError

    def _check_guides(self, n_reps: int, n_guides: int) -> str | None:
        return f"takes no guide embeddings, got {n_guides}" if n_guides else None

    # -- the call -------------------------------------------------------------------------------------------
    def forward(
        self,
        *embeddings: torch.Tensor,
        guide: Sequence[torch.Tensor] | None = None,
        cross_rank: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """The loss of the batch (of the global batch with ``cross_rank=True``), differentiable.

        Args:
            *embeddings: ``[B, D]`` per input, row ``i`` of each belonging to pair ``i``.
            guide: GIST only: the guide model's embeddings of the same inputs.
            cross_rank: Score against the candidates of every rank of ``process_group``.
            process_group: Group for ``cross_rank`` (default: world).
        """
        guides = [] if guide is None else list(guide)
        world = cross_rank_world(process_group) if cross_rank else 1
        group = process_group if world > 1 else None
        scalars = self._scalars()
        grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (*scalars, *embeddings)
        )
        sizes = agree(self, embeddings, guides, world, group, grad)  # raises alike on every rank
        work = torch.promote_types(embeddings[0].dtype, torch.float32)
        device = embeddings[0].device
        scalars = [s.to(device=device, dtype=work) for s in scalars]
        reps = [e.to(work) for e in embeddings]
        if self.normalize:
            reps = [nn.functional.normalize(r, dim=-1) for r in reps]
        guides = [nn.functional.normalize(g.detach().to(device=device, dtype=work), dim=-1) for g in guides]
        tensors = [*scalars, *reps]
        with torch.autocast(device.type, enabled=False):
            return BlockwiseLoss.apply(
                self, (group, sizes), world, len(scalars), len(reps), grad, *tensors, *guides
            )

    def block_rows(self, n_reps: int, total: int, width: int, guide_width: int = 0, itemsize: int = 4) -> int:
        """Anchor rows per block for ``n_reps`` inputs of ``width`` features and ``total`` global rows.

        ``block_size`` if given, else ``block_bytes`` (default :data:`DEFAULT_BLOCK_BYTES`) over the bytes a
        row of the block holds at once, at least one row.

        >>> from hfpatch.training.contrastive import InfoNCELoss
        >>> InfoNCELoss(block_bytes=2**20).block_rows(n_reps=2, total=1024, width=64)  # 8,704 bytes a row
        120
        """
        if self.block_size is not None:
            return self.block_size
        budget = DEFAULT_BLOCK_BYTES if self.block_bytes is None else self.block_bytes
        return max(1, budget // max(1, self._bytes_per_row(n_reps, total, width, guide_width, itemsize)))

    # -- inside the autograd function ----------------------------------------------------------------------
    def _compute(self, scalars, reps, guides, group_sizes, world, grad):
        group, sizes = group_sizes
        me = dist.get_rank(group) if world > 1 else 0
        where = Rows(offset=sum(sizes[:me]), total=sum(sizes))
        gathered = self._gathered(len(reps))
        guide_gathered = gathered if guides else []
        if world > 1:
            columns, guide_columns = gather_columns(reps, guides, gathered, guide_gathered, sizes, group)
        else:
            columns, guide_columns = list(reps), list(guides)
        block = self.block_rows(
            len(reps),
            where.total,
            reps[0].shape[-1],
            guides[0].shape[-1] if guides else 0,
            reps[0].element_size(),
        )
        value, d_anchor, d_columns, d_scalars = self._run(
            scalars, reps, columns, (guides, guide_columns), where, block, grad
        )
        # fixed scalars (a float scale, GIST's temperature): no gradient to sum over the ranks
        d_scalars = [d if s.requires_grad else None for d, s in zip(d_scalars, scalars)]
        if world > 1:
            del columns, guide_columns
            value, d_scalars, d_local = route_back(value, d_scalars, d_columns, gathered, sizes, group, grad)
        else:
            d_local = d_columns
        d_reps = None
        if grad:
            d_reps = []
            for a, c in zip(d_anchor, d_local):
                d = a if c is None else (c if a is None else a.add_(c))  # buffers of this call: in place
                d_reps.append(None if d is None else (d.mul_(world) if world > 1 else d))
        return value, (d_reps or [None] * len(reps)), (d_scalars or [None] * len(scalars))

    def extra_repr(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self._settings().items())
        block = (
            f"block_size={self.block_size}"
            if self.block_size is not None
            else f"block_bytes={self.block_bytes or DEFAULT_BLOCK_BYTES}"
        )
        return f"{settings}, {block}"
