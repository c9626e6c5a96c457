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

The package, one concept a module: :mod:`~hfpatch.training.contrastive.base` (:class:`ContrastiveLoss`, the
contract every loss fills: validation, block size, the call), :mod:`~hfpatch.training.contrastive.infonce`
(InfoNCE/MNRL and CLIP), :mod:`~hfpatch.training.contrastive.gist` (GISTEmbed),
:mod:`~hfpatch.training.contrastive.siglip` (SigLIP), :mod:`~hfpatch.training.contrastive.blocks` (the passes
over row blocks and the autograd Function) and :mod:`~hfpatch.training.contrastive.ranks` (the cross-rank
exchange).

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

from .base import DEFAULT_BLOCK_BYTES, ContrastiveLoss, takes_local_embeddings
from .gist import GISTLoss
from .infonce import CLIPLoss, InfoNCELoss
from .ranks import cross_rank_world
from .siglip import SigLIPLoss

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
