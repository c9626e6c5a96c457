"""GradCache: the exact gradient of a large-batch contrastive loss with the activation memory of one chunk.

A contrastive loss couples every sample of the batch (each query is scored against every document), so
the batch cannot simply be split into micro-batches with gradient accumulation. GradCache (Gao et al.,
2021) uses the chain rule ``dL/dθ = Σ_i dL/dr_i · dr_i/dθ``:

1. **Embed without a graph**: run the encoder on each chunk under ``torch.no_grad()`` and keep only the
   embeddings ``r_i`` (``[B, D]``; a few KB). The RNG state (CPU and accelerator) before each chunk is saved.
2. **Loss on embeddings**: concatenate the chunks, compute the loss on leaf tensors and back-propagate to
   ``g_i = dL/dr_i`` only (plus any parameters of the loss itself, e.g. a learnable temperature).
3. **Re-embed with a graph**: run each chunk again under the saved RNG state (so dropout draws the same
   masks) and back-propagate ``g_i`` into the parameters with ``r_i.backward(gradient=g_i)``. Only one
   chunk's activations are alive at a time. The very last chunk of step 1 is embedded *with* its graph
   (only the small loss runs before its backward), so it is not re-run: ``n`` chunks cost ``2n - 1``
   forwards.

The parameter gradients are those of one forward/backward over the whole batch, up to floating-point
reassociation, for a deterministic encoder. With dropout (or any other random op) in the encoder, each chunk
draws its masks in step 1 and replays them in step 3 (``replay_rng``), so the loss and gradient are exactly
those of the whole batch under THE MASKS GRADCACHE DREW; one full-batch forward would draw other masks (a
different sample of the same distribution), so the two differ by the dropout noise itself (0.3-1.4% of the
loss reported for a BERT with dropout 0.1), not by rounding. Equality with a plain step to rounding needs
the encoder deterministic (``model.eval()`` or dropout 0), as the tests run it. The cost is one extra no-grad forward of all but one chunk: about +1/3 of a plain step when a
backward costs twice a forward (large matrices), more where backward is relatively cheaper (small models on
CPU: +30-40% measured), plus per-call overhead that grows as chunks shrink.

Inputs may be plain tensors, dicts or ``BatchEncoding``; Qwen2-VL/Qwen2.5-VL/Qwen3-VL inputs (with
``pixel_values``/``image_grid_thw`` and their video counterparts) are split by whole samples with their
media (:mod:`hfpatch.training.vlm_split`), and every chunk is validated, so a naive ``pixel_values`` split
cannot silently train on misaligned patches.

Mixed precision and distribution:

- ``autocast_dtype=torch.bfloat16`` runs both encoder passes and the loss under ``torch.autocast``.
- fp16: pass ``scaler=torch.amp.GradScaler()``. Step 2 back-propagates ``scaler.scale(loss)``, so the cached
  embedding gradients, and therefore the parameter gradients, carry the scale factor exactly as after
  ``scaler.scale(loss).backward()`` in a plain step; then call ``scaler.step(optimizer); scaler.update()``
  as usual (an overflow in any chunk shows up as inf in ``.grad`` and the scaler skips the step).
- DDP: every backward except the last one of each model runs under ``model.no_sync()``, so gradients are
  all-reduced once per step (gradients accumulated under ``no_sync`` are included in that all-reduce).
  The model of the last input is back-propagated first (its kept chunk, then its other chunks), then the
  others in input order, so every rank all-reduces the models in the same order whatever its chunk counts
  (two same-shaped towers all-reduced in different orders would silently sum each other's gradients).
  Two DDP settings matter: ``find_unused_parameters=True`` when some chunks skip parameters (text-only
  chunks of a VLM never touch the vision tower), and ``broadcast_buffers=False`` (``forward_sync_buffers``)
  when ranks may run different numbers of chunks (uneven batches, ``chunk_patches``), because DDP
  broadcasts buffers in every forward. Models prepared by ``accelerate`` (or ``Trainer``) already autocast
  in forward, so leave ``autocast_dtype`` unset there, except with ``reuse_frozen_vision=True``: the tower
  is then called through ``get_image_features``, outside that forward, and runs in low precision only
  under ``autocast_dtype`` (nesting it inside accelerate's autocast of the same dtype changes nothing else).
- Cross-rank negatives (``cross_rank=True``): after step 1 the embeddings of all ranks are all-gathered and
  **every rank computes the loss of the global batch** (rank-major order: rank 0's samples first). The
  local embedding gradients are the rows of ``dL_global/dr`` for the local samples, **multiplied by the
  world size**, because DDP (and accelerate, FSDP) *averages* gradients over ranks:
  ``mean_r(W · Σ_{i∈r} g_i · dr_i/dθ) = Σ_i g_i · dr_i/dθ = dL_global/dθ``. After the all-reduce every rank
  holds exactly the gradient of one process computing the loss on the concatenated batch. The returned
  loss is the global loss (the same on every rank).

The loss stage. ``loss_fn`` sees the embeddings of the whole (global) batch at once, so a plain contrastive
loss holds its ``B x B`` similarity matrix, softmax and their gradients: memory growing with the square of the
batch, 4 GiB per matrix at a global batch of 32,768 in fp32, on every rank. The losses of
:mod:`hfpatch.training.contrastive` (``InfoNCELoss``, ``CLIPLoss``, ``GISTLoss``, ``SigLIPLoss``) compute the
value and the embedding gradients in row blocks instead (``O(B x block)``, the block from a memory budget).
GradCache recognises them (:func:`~hfpatch.training.contrastive.takes_local_embeddings`): it hands them the
local embeddings and, with ``cross_rank=True``, lets them gather the negatives themselves; each rank then
computes only its own rows, with one all-gather of the embeddings, one reduce-scatter of their gradients and
one all-reduce of the loss and the temperature's gradient per step, and the same gradient convention.

The package, one concept a module: :mod:`~hfpatch.training.gradcache.step` (:class:`GradCache` and its three
passes), :mod:`~hfpatch.training.gradcache.chunks` (splitting an input into chunks of whole samples),
:mod:`~hfpatch.training.gradcache.rng` (the RNG state a chunk is replayed under),
:mod:`~hfpatch.training.gradcache.encoders` (how an encoder is called: wrappers, sentence-transformers, a frozen
Qwen-VL vision tower) and :mod:`~hfpatch.training.gradcache.compiled` (``compile=True``'s compiled forwards).

>>> import torch
>>> from hfpatch.training import GradCache
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4))
>>> def info_nce(q, p):
...     logits = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(p, dim=-1).T / 0.05
...     return torch.nn.functional.cross_entropy(logits, torch.arange(len(q)))
>>> gc = GradCache(encoder, info_nce, chunk_size=2)
>>> loss = gc.step(torch.randn(6, 8), torch.randn(6, 8))   # .grad now holds the batch-6 gradient
>>> loss.requires_grad, encoder[0].weight.grad.shape
(False, torch.Size([16, 8]))
"""

from .chunks import split_inputs
from .encoders import is_sentence_transformer
from .rng import RngState
from .step import GradCache

__all__ = ["GradCache", "RngState", "is_sentence_transformer", "split_inputs"]
