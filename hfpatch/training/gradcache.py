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

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from .contrastive import cross_rank_world, takes_local_embeddings
from .gradcache_models import (
    _batch_len,
    _call,
    _CompiledForwards,
    _frozen_vision_encoder,
    _tensors,
    _vision_spec,
    _with_vision_features,
    is_sentence_transformer,
)
from .pooling import Pooling, default_rep
from .vlm_split import VisionTokenSpec, has_grids, has_media, split_vlm_inputs, validate_vlm_chunk

__all__ = ["GradCache", "RngState", "is_sentence_transformer", "split_inputs"]


def split_inputs(
    inputs: Any,
    chunk_size: int | None,
    *,
    chunk_patches: int | None = None,
    vision_spec: VisionTokenSpec | None = None,
) -> list[Any]:
    """Default split of one encoder input into chunks of whole samples.

    - tensor: along dim 0;
    - tuple/list of tensors (positional model arguments): each along dim 0, chunks are tuples;
    - mapping (``dict``, ``BatchEncoding``): Qwen-VL media (grids present, or media keys with a
      ``vision_spec``) -> :func:`split_vlm_inputs`; otherwise every ``[B, ...]`` tensor by sample (CLIP-style
      ``pixel_values`` ``[B, C, H, W]`` too), other values shared.

    Raises:
        ValueError: A mapping tensor whose first dimension is not the batch size (e.g. Qwen-VL
            ``pixel_values`` without ``image_grid_thw``), or grids without a ``vision_spec``.
    """
    if isinstance(inputs, torch.Tensor):
        if chunk_size is None:
            raise ValueError(
                "chunk_patches applies to inputs with Qwen-VL media only; give chunk_size for tensors."
            )
        return list(inputs.split(chunk_size))
    if isinstance(inputs, (tuple, list)):
        parts = [split_inputs(x, chunk_size) for x in inputs]
        if len({len(p) for p in parts}) != 1:
            raise ValueError(f"positional inputs have different batch sizes: {[len(x) for x in inputs]}.")
        return [type(inputs)(chunk) for chunk in zip(*parts)]
    if isinstance(inputs, Mapping):
        if has_grids(inputs) or (vision_spec is not None and has_media(inputs)):
            if vision_spec is None:
                raise ValueError(
                    "inputs carry Qwen-VL grids (image_grid_thw/video_grid_thw) but the encoder config has no "
                    "image_token_id/vision_config.spatial_merge_size; pass vision_spec=VisionTokenSpec(...)."
                )
            return split_vlm_inputs(inputs, vision_spec, chunk_size, chunk_patches)
        sizes = {k: v.shape[0] for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.ndim > 0}
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"cannot split a model input by sample: tensors have different first dimensions {sizes}. "
                "Pass split_fn=... for this layout."
            )
        if chunk_size is None:
            raise ValueError(
                "chunk_patches applies to inputs with Qwen-VL media only; this input has none, so "
                "also give chunk_size (samples per chunk)."
            )
        batch = next(iter(sizes.values()))
        return [
            {
                k: v[s : s + chunk_size] if isinstance(v, torch.Tensor) and v.ndim > 0 else v
                for k, v in inputs.items()
            }
            for s in range(0, batch, chunk_size)
        ]
    raise TypeError(
        f"cannot split an input of type {type(inputs).__name__}; expected a tensor, a tuple of tensors, a dict "
        "or a BatchEncoding. Pass split_fn=... to GradCache."
    )


@dataclass
class RngState:
    """CPU and accelerator RNG states captured before a chunk's first forward, replayed for its second.

    Like ``RandContext`` in luyug/GradCache and the state that ``torch.utils.checkpoint`` preserves:
    replaying happens inside ``torch.random.fork_rng``, so the global RNG continues afterwards as if each
    chunk had been run once.
    """

    cpu: torch.Tensor
    device_type: str
    devices: list[int]
    device_states: list[torch.Tensor]

    @classmethod
    def capture(cls, *tensors: torch.Tensor) -> RngState:
        """Save the CPU state and the states of the accelerators that ``tensors`` live on."""
        device_type = next((t.device.type for t in tensors if t.device.type not in ("cpu", "meta")), "cuda")
        devices, states = get_device_states(*tensors)
        return cls(torch.get_rng_state(), device_type, devices, states)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block under the saved states; restore the current ones afterwards."""
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu)
            set_device_states(self.devices, self.device_states, device_type=self.device_type)
            yield


class GradCache:
    """Chunked contrastive training step with the exact full-batch gradient (see module docstring).

    Args:
        models: One encoder shared by all inputs, or a sequence with one encoder per input (the same module
            may appear several times). DDP/accelerate/peft wrappers are fine.
        loss_fn: ``loss_fn(*reps, **loss_kwargs) -> scalar``; ``reps[k]`` is ``[B_k, D]`` for input ``k``
            (the global batch with ``cross_rank=True``), or a row-blocked loss of
            :mod:`hfpatch.training.contrastive` (given the local embeddings; it gathers the negatives itself).
        chunk_size: Most samples per chunk (the memory knob).
        split_fn: ``split_fn(inputs, chunk_size) -> list of chunks`` (default :func:`split_inputs`). Chunks
            of Qwen-VL inputs are validated whatever splits them.
        rep_fn: ``rep_fn(model_output, chunk) -> [b, D]`` (default: a ``[b, D]`` output, or the embedding the
            output documents (``sentence_embedding``, ``text_embeds``/``image_embeds``), is used as is; else
            pool ``last_hidden_state`` by ``pooling`` with the chunk's ``attention_mask``).
        chunk_patches: For Qwen-VL inputs, also at most this many vision patches per chunk (images vary in
            size; ``chunk_size`` still bounds text-only samples, which have none).
        pooling: ``"last"`` (default; left or right padding), ``"mean"`` or ``"cls"``.
        autocast_dtype: Run encoders and loss under ``torch.autocast`` with this dtype (e.g. bf16).
        scaler: ``torch.amp.GradScaler`` for fp16; gradients are scaled like ``scaler.scale(loss).backward()``.
        replay_rng: Replay each chunk's RNG state in the second pass (needed for exact gradients with dropout).
        no_sync: Use ``model.no_sync()`` (DDP) for all but each model's last chunk.
        cross_rank: All-gather embeddings over ``process_group`` and compute the global-batch loss.
        process_group: Group for ``cross_rank`` (default: world).
        vision_spec: Token ids and merge size for Qwen-VL splitting (default: read from each model's config).
        features_dict: Call the model with each chunk as one dict, ``model(chunk)``, instead of
            ``model(**chunk)``. Default: on for sentence-transformers models (``SentenceTransformer``, DDP
            wrapped or not), whose output dict's ``"sentence_embedding"`` is then the embedding.
        compile: Run the encoder's ``forward`` through ``torch.compile`` in both passes (see "Compiled chunk
            passes" in the module docstring): one static-shape graph per kind of chunk call, each compiled once.
        compile_backend: The ``torch.compile`` backend (``"inductor"``; ``"aot_eager"``/``"eager"`` to debug).
        reuse_frozen_vision: For Qwen-VL models whose vision tower is frozen (e.g. LoRA on the language model
            only), run the tower once in the first pass and feed its outputs (``mm_encoder_outputs``) to the
            second pass instead of the pixels. Saves the tower's second forward and its activations; costs
            keeping the tower outputs (merged image tokens x hidden, plus deepstack features) of the whole
            batch until the step ends.

    Raises:
        ValueError: Bad chunk sizes, a models/inputs count mismatch, or badly split Qwen-VL inputs (at
            :meth:`step`, before any collective).
    """

    def __init__(
        self,
        models: nn.Module | Sequence[nn.Module],
        loss_fn: Callable[..., torch.Tensor],
        chunk_size: int,
        split_fn: Callable[[Any, int], Sequence[Any]] | None = None,
        rep_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        chunk_patches: int | None = None,
        pooling: Pooling = "last",
        autocast_dtype: torch.dtype | None = None,
        scaler: torch.amp.GradScaler | None = None,
        replay_rng: bool = True,
        no_sync: bool = True,
        cross_rank: bool = False,
        process_group: dist.ProcessGroup | None = None,
        vision_spec: VisionTokenSpec | None = None,
        reuse_frozen_vision: bool = False,
        features_dict: bool | None = None,
        compile: bool = False,
        compile_backend: str = "inductor",
    ):
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(
                f"chunk_size must be a positive number of samples, got {chunk_size!r} (chunk_patches only adds a "
                "bound on vision patches: text-only samples have none, so the sample bound is always needed)."
            )
        if pooling not in ("last", "mean", "cls"):
            raise ValueError(f"unknown pooling {pooling!r}; expected 'last', 'mean' or 'cls'.")
        self.models = [models] if isinstance(models, nn.Module) else list(models)
        if not self.models or not all(isinstance(m, nn.Module) for m in self.models):
            raise TypeError(
                f"models must be an nn.Module or a sequence of them, got {type(models).__name__}."
            )
        self.loss_fn = loss_fn
        self.chunk_size = chunk_size
        self.chunk_patches = chunk_patches
        self.split_fn = split_fn
        self.rep_fn = rep_fn
        self.pooling = pooling
        self.autocast_dtype = autocast_dtype
        self.scaler = scaler
        self.replay_rng = replay_rng
        self.no_sync = no_sync
        self.cross_rank = cross_rank
        self.process_group = process_group
        self.vision_specs = [vision_spec or _vision_spec(m) for m in self.models]
        self.vision_encoders = [
            _frozen_vision_encoder(m) if reuse_frozen_vision else None for m in self.models
        ]
        self.features_dict = [
            is_sentence_transformer(m) if features_dict is None else features_dict for m in self.models
        ]
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be a bool, got {compile!r}")
        if compile:
            from ..core.compile import check_compile_backend

            check_compile_backend(compile_backend, False, "GradCache")
        self.compiled = _CompiledForwards(compile_backend) if compile else None

    def __repr__(self) -> str:
        return (
            f"GradCache(models={len(self.models)}, chunk_size={self.chunk_size}, chunk_patches={self.chunk_patches}, "
            f"pooling={self.pooling!r}, autocast_dtype={self.autocast_dtype}, scaler={self.scaler is not None}, "
            f"replay_rng={self.replay_rng}, cross_rank={self.cross_rank}, compile={self.compiled is not None})"
        )

    # -- pieces ---------------------------------------------------------------------------------------

    def _split(self, inputs: Any, spec: VisionTokenSpec | None) -> list[Any]:
        if self.split_fn is None:  # Qwen-VL chunks come validated from split_vlm_inputs
            chunks = split_inputs(inputs, self.chunk_size, chunk_patches=self.chunk_patches, vision_spec=spec)
        else:
            chunks = list(self.split_fn(inputs, self.chunk_size))
            if isinstance(inputs, Mapping) and has_media(inputs) and spec is not None:
                for chunk in chunks:  # e.g. a split_fn that cuts pixel_values by sample count
                    validate_vlm_chunk(chunk, spec, source=inputs)
        total, parts = _batch_len(inputs), [_batch_len(c) for c in chunks]
        if total is not None and None not in parts and sum(parts) != total:
            raise ValueError(f"split_fn returned chunks of {parts} samples for an input of {total} samples.")
        if not chunks:
            raise ValueError("split_fn returned no chunks.")
        return chunks

    def _autocast(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device_type(model), dtype=self.autocast_dtype)

    @staticmethod
    def _device_type(model: nn.Module) -> str:
        param = next(model.parameters(), None)
        return param.device.type if param is not None else "cpu"

    def _sync_context(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync()`` unless this forward's backward is the model's last one of the step."""
        if self.no_sync and not sync and hasattr(model, "no_sync"):
            return model.no_sync()
        return contextlib.nullcontext()

    def _embed(self, model: nn.Module, chunk: Any, features_dict: bool = False) -> torch.Tensor:
        if self.compiled is not None:
            with self.compiled.installed(model, chunk):
                output = _call(model, chunk, features_dict)
        else:
            output = _call(model, chunk, features_dict)
        rep = (
            self.rep_fn(output, chunk)
            if self.rep_fn is not None
            else default_rep(output, chunk, self.pooling)
        )
        if not isinstance(rep, torch.Tensor) or rep.ndim < 1:
            raise TypeError(f"rep_fn must return a [b, D] tensor, got {type(rep).__name__}.")
        return rep

    def _gather(self, reps: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """Leaves for the local reps and the (differentiable) global reps built from them."""
        from hfpatch.distributed.collectives import all_gather

        leaves = [r.detach().requires_grad_() for r in reps]
        world = cross_rank_world(self.process_group) if self.cross_rank else 1
        if world == 1:
            return leaves, leaves, 1
        counts = torch.tensor([r.shape[0] for r in reps], device=reps[0].device)
        every = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(every, counts, group=self.process_group)
        sizes = torch.stack(every).T.tolist()  # [input][rank]
        # backward="slice": every rank computes the same global loss, so a shard's gradient is its slice.
        full = [
            all_gather(leaf, 0, self.process_group, s, backward="slice") for leaf, s in zip(leaves, sizes)
        ]
        return leaves, full, world

    # -- the step ---------------------------------------------------------------------------------------

    def step(self, *inputs: Any, **loss_kwargs: Any) -> torch.Tensor:
        """One GradCache step: accumulate the full-batch gradient into ``.grad``; return the detached loss.

        Args:
            *inputs: One model input per encoder input (e.g. queries, positives, negatives).
            **loss_kwargs: Passed to ``loss_fn``.
        """
        loss, finish = self.prepare(*inputs, **loss_kwargs)
        finish()
        return loss

    def prepare(
        self, *inputs: Any, **loss_kwargs: Any
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor | None], None]]:
        """Steps 1 and 2 of :meth:`step`; step 3 (the parameter backward) is left to the returned callable.

        For callers whose framework runs the backward itself, e.g. a loss module whose returned tensor a
        ``Trainer`` back-propagates (:class:`hfpatch.training.sentence_transformers.GradCacheLoss` calls
        ``finish`` from a hook on it). Gradients of the loss's own parameters (step 2) are accumulated here.
        Under ``torch.no_grad()`` (evaluation) only the chunked no-graph embedding and the loss run, and
        ``finish`` must not be called.

        Returns:
            ``(loss, finish)``: the detached loss and ``finish(scale=None)``, which back-propagates the cached
            embedding gradients times ``scale`` (a scalar, e.g. the gradient a Trainer's backward hands to
            the loss: accumulation division, fp16 loss scale) into the encoders. Call it at most once.

        >>> import torch
        >>> encoder = torch.nn.Linear(4, 2)
        >>> gc = GradCache(encoder, lambda q, p: (q @ p.T).logsumexp(-1).mean(), chunk_size=2)
        >>> loss, finish = gc.prepare(torch.randn(4, 4), torch.randn(4, 4))
        >>> encoder.weight.grad is None          # nothing back-propagated into the encoder yet
        True
        >>> finish(torch.tensor(0.5))            # e.g. gradient accumulation over 2 steps
        >>> encoder.weight.grad.shape
        torch.Size([2, 4])
        """
        if len(self.models) not in (1, len(inputs)):
            raise ValueError(
                f"GradCache has {len(self.models)} models but step() got {len(inputs)} inputs; "
                "give one shared model or one per input."
            )
        one = len(self.models) == 1
        models = self.models * len(inputs) if one else self.models
        specs = self.vision_specs * len(inputs) if one else self.vision_specs
        encoders = self.vision_encoders * len(inputs) if one else self.vision_encoders
        as_dict = self.features_dict * len(inputs) if one else self.features_dict
        chunks = [self._split(x, spec) for x, spec in zip(inputs, specs)]
        grad_enabled = torch.is_grad_enabled()

        # The last chunk of the last input keeps its graph in pass 1 (nothing runs between its forward and
        # the loss), so pass 2 back-propagates it first and re-embeds only the others: one chunk's forward
        # fewer per step at the same peak memory (luyug/GradCache re-runs every chunk).
        kept = (len(inputs) - 1, len(chunks[-1]) - 1) if grad_enabled else None
        last_model = models[-1]
        kept_syncs = sum(len(c) for m, c in zip(models, chunks) if m is last_model) == 1

        # 1. Embeddings without a graph; the RNG state before each chunk is kept for the second pass.
        reps, states, kept_rep = [], [], None
        with torch.no_grad():
            for k, (model, encoder, model_chunks) in enumerate(zip(models, encoders, chunks)):
                model_reps, model_states = [], []
                params = [p for p in (next(model.parameters(), None),) if p is not None]
                for j, chunk in enumerate(model_chunks):
                    if encoder is not None and isinstance(chunk, Mapping) and has_media(chunk):
                        with self._autocast(model):  # before the RNG capture: replay starts after the tower
                            chunk = model_chunks[j] = _with_vision_features(encoder, chunk)
                    if (k, j) == kept:
                        with torch.enable_grad(), self._sync_context(model, kept_syncs):
                            with self._autocast(model):  # DDP decides at forward time whether to sync
                                kept_rep = self._embed(model, chunk, as_dict[k])
                        model_states.append(None)
                        model_reps.append(kept_rep.detach())
                        continue
                    model_states.append(
                        RngState.capture(*_tensors(chunk), *params)
                        if self.replay_rng and grad_enabled
                        else None
                    )
                    with self._autocast(model):
                        rep = self._embed(model, chunk, as_dict[k])
                    model_reps.append(rep.clone() if rep._base is not None else rep)  # don't pin token states
                reps.append(model_reps)
                states.append(model_states)

        # 2. Loss on the (gathered) embeddings and its gradient with respect to each local embedding. The
        # losses of hfpatch.training.contrastive gather the negatives themselves, compute only this rank's
        # rows (in blocks) and hand back gradients that are already routed and scaled for DDP's average.
        shapes = [[r.shape for r in model_reps] for model_reps in reps]
        local = [torch.cat(r) for r in reps]
        del reps  # the chunks' copies: one [B, D] per input fewer during the loss
        if takes_local_embeddings(self.loss_fn):
            leaves = [x.requires_grad_() for x in local]
            full, world = leaves, 1
            if self.cross_rank:
                loss_kwargs = {**loss_kwargs, "cross_rank": True, "process_group": self.process_group}
        else:
            leaves, full, world = self._gather(local)
        del local
        with self._autocast(models[0]):
            loss = self.loss_fn(*full, **loss_kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {loss!r:.80}.")
        if not grad_enabled:
            return loss.detach(), _no_backward
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        grads = []
        for leaf, model_shapes in zip(leaves, shapes):
            grad = leaf.grad
            if grad is None and (dist.is_available() and dist.is_initialized()):
                grad = torch.zeros_like(leaf)  # every rank must run the same backwards (DDP/FSDP hooks)
            if grad is None:
                # The loss ignores this input: its parameters keep .grad None, as after a plain step.
                grads.append([None] * len(model_shapes))
                continue
            grads.append((grad * world if world > 1 else grad).split([s[0] for s in model_shapes]))
        del leaves, full, loss_kwargs
        pending = {"kept_rep": kept_rep}
        del kept_rep

        # 3. Back-propagate the kept chunk, then re-embed every other chunk with a graph under its saved RNG
        # state and back-propagate its cached gradient. DDP all-reduces with each model's last backward: the
        # kept chunk's model goes first, so the order of models is the same on every rank.
        def finish(scale: torch.Tensor | None = None) -> None:
            if "kept_rep" not in pending:
                raise RuntimeError("GradCache.prepare's finish() was already called for this batch.")
            kept_rep = pending.pop("kept_rep")

            def scaled(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
                return (grad if scale is None else grad * scale.to(grad.dtype)).to(dtype)

            with torch.enable_grad():
                kept_grad = grads[kept[0]][kept[1]]
                if kept_grad is not None:
                    with self._sync_context(last_model, kept_syncs):  # FSDP decides at backward time
                        kept_rep.backward(gradient=scaled(kept_grad, kept_rep.dtype))
                del kept_rep
                rerun = [
                    (k, j)
                    for k, c in enumerate(chunks)
                    for j in range(len(c))
                    if (k, j) != kept and grads[k][j] is not None
                ]
                rerun.sort(key=lambda kj: models[kj[0]] is not last_model)  # stable: input order otherwise
                last_use = {id(models[k]): (k, j) for k, j in rerun}
                for k, j in rerun:
                    model, chunk = models[k], chunks[k][j]
                    with contextlib.ExitStack() as stack:
                        stack.enter_context(self._sync_context(model, last_use[id(model)] == (k, j)))
                        if states[k][j] is not None:
                            stack.enter_context(states[k][j].replay())
                        with self._autocast(model):
                            rep = self._embed(model, chunk, as_dict[k])
                        if rep.shape != shapes[k][j]:
                            raise RuntimeError(
                                f"input {k} chunk {j}: the second forward gave shape {tuple(rep.shape)}, the "
                                f"first {tuple(shapes[k][j])}; the encoder must be deterministic given its "
                                "inputs and RNG."
                            )
                        rep.backward(gradient=scaled(grads[k][j], rep.dtype))
            chunks.clear()  # release the inputs and RNG states of this batch
            states.clear()

        return loss.detach(), finish


def _no_backward(scale: torch.Tensor | None = None) -> None:
    raise RuntimeError("GradCache.prepare ran under torch.no_grad(): there is no backward to finish.")
