"""Contrastive losses computed in row blocks: InfoNCE/MNRL, CLIP, GIST and SigLIP at batch sizes of 32k and more.

A contrastive loss scores every anchor against every candidate of the batch: the similarity matrix of a batch
of ``B`` pairs is ``B x B`` (``B x B(1 + K)`` with ``K`` hard negatives), and autograd keeps it, its softmax and
their gradients alive until the backward. At a global batch of 32,768 in fp32 that is 4 GiB per matrix on
every rank, growing with the square of the batch; GradCache bounds the encoder's activations by the chunk, not
this. The losses here never hold the matrix: rows are processed in blocks of ``block`` anchors, and each
block's logits ``[block, N]`` are formed, reduced and turned into gradients before the next block starts, so
the loss stage needs ``O(B x block)`` memory (plus the ``O(B x D)`` embeddings and their gradients).

**One pass, value and gradient together.** Every loss here is a sum over rows (softmax losses: the row's
log-sum-exp minus its positive logit; SigLIP: a sum of elementwise terms), so a block holds everything its
rows' gradients need: the block's logits give the row's log-sum-exp, then the softmax, then
``dL/dlogits = (softmax - onehot) / B`` in place, and two matmuls give the anchors' and candidates'
gradients. The gradients are computed in the forward, in the same pass over the blocks as the value, and kept
(``[B, D]`` per input, the size of the embeddings); the backward only multiplies them by the incoming
gradient. That is what GradCache needs anyway (its step 2 asks for the loss and ``dL/dr`` at once) and costs
three matmuls of ``block x N x D`` per block and direction, like autograd on the whole matrix (one forward,
two backward), where a recomputing backward would cost four. Under ``torch.no_grad()`` (evaluation) only the
value is computed. A ``torch.autograd.Function`` ties it together, so a loss is a plain ``nn.Module``: use it in
a plain step, as ``GradCache``'s ``loss_fn``, in :class:`~hfpatch.training.GradCacheTrainer` or inside
:class:`~hfpatch.training.sentence_transformers.GradCacheLoss`; a double backward is refused.

**Temperatures.** ``CLIPLoss`` and ``SigLIPLoss`` learn ``logit_scale`` (and SigLIP ``logit_bias``), both
scalars (shape ``()`` or ``(1,)``, as in OpenCLIP, transformers' ``CLIPModel``/``SiglipModel``); pass a float
for a parameter owned by the loss or a model's own parameter (``model.logit_scale``), used as it is and not
registered again. The gradient of the scale is exact: ``dL/ds = sum_ij G_ij sim_ij``, taken per block as
``sum_i a_i . (G c)_i`` from the same matmul as the anchors' gradient.

**Cross-rank negatives** (``cross_rank=True``, the keyword GradCache passes with its own ``cross_rank=True``):
every rank keeps its anchors (its rows) and scores them against the candidates of all ranks, so each rank
computes ``1/W`` of the global loss's rows. Per step, over ``process_group``:

1. one all-gather of a small fixed-size row of metadata (batch size, width, dtype, loss settings per input),
   from which every rank checks every rank's inputs and raises the same error on all of them when any is bad;
2. one all-gather of the (normalized) embeddings that serve as candidates, every input in one flat buffer
   (uneven batch sizes per rank allowed);
3. with gradients: one reduce-scatter that routes the candidates' gradients back to the rank that owns them,
   and one all-reduce (sum) of the value and the scale's (and bias's) gradient, so that every rank returns the
   loss of the global batch and holds the global batch's temperature gradient.

The gradients follow the convention of hfpatch's other cross-rank code (see ``docs/training.md``): the
gradient of a rank's embeddings is ``W`` times its rows of ``dL_global/dr`` (DDP, FSDP and accelerate
*average* parameter gradients over the ``W`` ranks, so the average is the global batch's gradient), and the
temperature's gradient is ``dL_global/ds`` itself on every rank (identical, so averaging leaves it unchanged,
and a temperature outside DDP gets it right too). Every rank returns the global loss. With the global batch
in rank-major order (rank 0's rows first), a rank's result equals one process computing the loss on the
concatenated batch.

**Block size.** ``block_size=`` fixes the rows per block; by default it follows from ``block_bytes`` (the
loss stage's working memory, default :data:`DEFAULT_BLOCK_BYTES` = 256 MiB): ``block = block_bytes //
bytes_per_row``, where a row costs its logits for every candidate in the working dtype, a temporary of the
largest piece (the log-sum-exp's) and, for GIST, the guide's similarities and mask. At a global batch of
32,768 and width 768 in fp32 that is 1,000 rows per block for one-direction InfoNCE, 667 for CLIP (two
directions).

Numerics: the logits, softmax and gradients are computed in fp32 (fp64 for fp64 embeddings) whatever the
embeddings' dtype or an enclosing autocast; gradients come back in the embeddings' dtype.

>>> import torch
>>> from hfpatch.training.contrastive import CLIPLoss
>>> images = torch.randn(10, 8, requires_grad=True)
>>> texts = torch.randn(10, 8, requires_grad=True)
>>> loss_fn = CLIPLoss(block_size=3)               # blocks of 3, 3, 3 and 1 rows
>>> loss = loss_fn(images, texts)
>>> loss.backward()                                 # gradients of images, texts and logit_scale
>>> images.grad.shape, loss_fn.logit_scale.grad.shape
(torch.Size([10, 8]), torch.Size([]))
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .contrastive_blocks import _BlockwiseLoss, _Piece, _Rows, _sigmoid_rows, _softmax_rows, _times
from .contrastive_ranks import _DTYPES, _HEADER, _MAX_INPUTS, _gather_columns, _problem, _route_back

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "CLIPLoss",
    "ContrastiveLoss",
    "GISTLoss",
    "InfoNCELoss",
    "SigLIPLoss",
    "cross_rank_world",
    "takes_local_embeddings",
]

#: Working memory of the loss stage per rank when neither ``block_size`` nor ``block_bytes`` is given.
DEFAULT_BLOCK_BYTES = 256 * 2**20

_CLIP_LOGIT_SCALE = math.log(1 / 0.07)  # CLIP's initial temperature 0.07
_SIGLIP_LOGIT_SCALE = math.log(10.0)  # SigLIP's initial t = 10 (bias -10)


def cross_rank_world(group: Any = None) -> int:
    """Ranks whose embeddings ``cross_rank=True`` gathers: ``group``'s size, or 1 in a single process.

    One process (no process group, no launcher) is a world of one: the same script runs unchanged before it
    is launched on several. Launched on several without a process group is an error (nothing to gather with).

    >>> cross_rank_world()
    1
    """
    from hfpatch.distributed import runtime

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    if runtime.launched_world_size() > 1:
        raise ValueError(
            "cross_rank=True in a run launched on several processes needs the torch.distributed process group: "
            "initialise it (torch.distributed.init_process_group, or let accelerate/Trainer do it) first."
        )
    return 1


def takes_local_embeddings(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` gathers cross-rank negatives itself (the losses of this module, and callables that
    carry a true ``gathers_across_ranks`` attribute): GradCache then hands it the local embeddings with
    ``cross_rank=``/``process_group=`` keywords instead of gathering them and scaling their gradients.

    >>> takes_local_embeddings(InfoNCELoss()), takes_local_embeddings(lambda q, d: (q * d).sum())
    (True, False)
    """
    return getattr(loss_fn, "gathers_across_ranks", False) is True


# ----------------------------------------------------------------------------------------------- the losses
def _scalar(value: float | torch.Tensor, name: str, owner: str) -> torch.Tensor:
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
    """Base of the row-blocked contrastive losses (see the module docstring): validation, block size,
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
        sizes = self._agree(embeddings, guides, world, group, grad)  # raises alike on every rank
        work = torch.promote_types(embeddings[0].dtype, torch.float32)
        device = embeddings[0].device
        scalars = [s.to(device=device, dtype=work) for s in scalars]
        reps = [e.to(work) for e in embeddings]
        if self.normalize:
            reps = [nn.functional.normalize(r, dim=-1) for r in reps]
        guides = [nn.functional.normalize(g.detach().to(device=device, dtype=work), dim=-1) for g in guides]
        tensors = [*scalars, *reps]
        with torch.autocast(device.type, enabled=False):
            return _BlockwiseLoss.apply(
                self, (group, sizes), world, len(scalars), len(reps), grad, *tensors, *guides
            )

    def block_rows(self, n_reps: int, total: int, width: int, guide_width: int = 0, itemsize: int = 4) -> int:
        """Anchor rows per block for ``n_reps`` inputs of ``width`` features and ``total`` global rows.

        ``block_size`` if given, else ``block_bytes`` (default :data:`DEFAULT_BLOCK_BYTES`) over the bytes a
        row of the block holds at once, at least one row.

        >>> InfoNCELoss(block_bytes=2**20).block_rows(n_reps=2, total=1024, width=64)  # 8,704 bytes a row
        120
        """
        if self.block_size is not None:
            return self.block_size
        budget = DEFAULT_BLOCK_BYTES if self.block_bytes is None else self.block_bytes
        return max(1, budget // max(1, self._bytes_per_row(n_reps, total, width, guide_width, itemsize)))

    # -- metadata: validation on every rank alike ---------------------------------------------------------
    def _meta(self, embeddings: Sequence[Any], guides: Sequence[Any], grad: bool) -> list[int]:
        inputs = [*embeddings, *guides]
        work = [
            torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else None
            for t in inputs
            if isinstance(t, torch.Tensor)
        ]
        dtype = 0
        if len(work) == len(inputs) and work and None not in work and len(set(work)) == 1:
            dtype = _DTYPES[work[0]]
        elif work and None not in work and len(work) == len(inputs):
            dtype = -1  # mixed precisions
        settings = repr(sorted(self._settings().items()))
        digest = zlib.crc32(f"{type(self).__name__}{settings}".encode()) - 2**31
        row = [len(embeddings), len(guides), dtype, digest, int(len(inputs) > _MAX_INPUTS), int(grad)]
        for t in inputs[:_MAX_INPUTS]:
            if isinstance(t, torch.Tensor):
                row += [t.shape[0] if t.ndim else -1, t.shape[-1] if t.ndim else -1, t.ndim]
            else:
                row += [-1, -1, -1]
        return row + [0] * (_HEADER + 3 * _MAX_INPUTS - len(row))

    def _agree(
        self, embeddings: Sequence[Any], guides: Sequence[Any], world: int, group: Any, grad: bool
    ) -> list[int]:
        """Check every rank's inputs from every rank's metadata; return each rank's batch size."""
        row = self._meta(embeddings, guides, grad)
        if world == 1:
            table = [row]
        else:
            from hfpatch.distributed.collectives import all_gather

            device = torch.device("cpu")  # the same on every rank, whatever a bad input's device
            if dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            local = torch.tensor(row, dtype=torch.int64, device=device)[None]
            table = all_gather(local, 0, group).tolist()
        problem = _problem(type(self).__name__, self, table)
        if problem is not None:
            raise ValueError(problem)
        return [r[_HEADER] for r in table]

    # -- inside the autograd function ----------------------------------------------------------------------
    def _compute(self, scalars, reps, guides, group_sizes, world, grad):
        group, sizes = group_sizes
        me = dist.get_rank(group) if world > 1 else 0
        where = _Rows(offset=sum(sizes[:me]), total=sum(sizes))
        gathered = self._gathered(len(reps))
        guide_gathered = gathered if guides else []
        if world > 1:
            columns, guide_columns = _gather_columns(reps, guides, gathered, guide_gathered, sizes, group)
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
            value, d_scalars, d_local = _route_back(value, d_scalars, d_columns, gathered, sizes, group, grad)
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
        value = _scalar(scale, "scale", type(self).__name__)
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

    def _pieces(self, n_reps: int) -> list[_Piece]:
        docs = tuple(range(1, n_reps))
        per_direction = self.partition_mode == "per_direction"
        table = {
            "query_to_doc": _Piece(0, docs, positive=True),
            "query_to_query": _Piece(0, (0,), mask_self=True),
            "doc_to_query": _Piece(1, (0,), positive=per_direction),  # its own softmax's positive
            "doc_to_doc": _Piece(1, docs, mask_own=True),
        }
        return [
            _Piece(**{**vars(table[d]), "group": g if per_direction else 0})
            for g, d in enumerate(self.directions)
        ]

    def _bytes_per_row(self, n_reps, total, width, guide_width, itemsize):
        columns = [total * len(p.candidates) for p in self._pieces(n_reps)]
        return itemsize * (sum(columns) + max(columns) + width * (len(columns) + 1))

    def _gathered(self, n_reps: int) -> list[int]:
        return sorted({k for p in self._pieces(n_reps) for k in p.candidates})

    def _run(self, scalars, anchors, columns, guides, where, block, grad):
        (scale,) = scalars
        value, d_anchor, d_columns, d_scale = _softmax_rows(
            anchors, columns, self._pieces(len(anchors)), scale.detach(), where, block, grad
        )
        return value, _times(d_anchor, scale), _times(d_columns, scale), [d_scale]

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
        log_scale = _scalar(logit_scale, "logit_scale", type(self).__name__)
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

    def _pieces(self, n_reps: int) -> list[_Piece]:
        pieces = [_Piece(0, (1,), positive=True, guide=True)]
        if self.contrast_anchors:
            pieces.append(_Piece(0, (0,), guide=True))
        if self.contrast_positives:
            pieces.append(_Piece(1, (1,), guide=True))
        if n_reps > 2:
            pieces.append(_Piece(0, tuple(range(2, n_reps)), guide=True))
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
        value, d_anchor, d_columns, _ = _softmax_rows(
            anchors,
            columns,
            self._pieces(len(anchors)),
            scale,
            where,
            block,
            grad,
            guides=(local_guides, guide_columns, threshold),
        )
        return value, _times(d_anchor, scale), _times(d_columns, scale), [None]


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
            tensor = _scalar(value, name, type(self).__name__)
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
        value, d_images, d_texts, d_scale, d_bias = _sigmoid_rows(
            anchors[0], columns[1], scale.detach(), bias.detach(), where, block, grad
        )
        d_anchor = _times([d_images, None], scale)
        return value, d_anchor, _times([None, d_texts], scale), [d_scale, d_bias]
