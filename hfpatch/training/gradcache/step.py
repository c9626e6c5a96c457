"""GradCache's step: :class:`GradCache`, the three passes over the chunks of a batch (embed without a graph,
the loss and its gradient with respect to the embeddings, re-embed with a graph and back-propagate) that give
the full-batch gradient with one chunk's activations. The design notes are in :mod:`hfpatch.training.gradcache`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..contrastive import cross_rank_world, takes_local_embeddings
from ..pooling import Pooling, default_rep
from ..vlm_split import VisionTokenSpec, has_media, validate_vlm_chunk
from .chunks import batch_len, chunk_tensors, split_inputs
from .compiled import CompiledForwards
from .encoders import (
    call_encoder,
    config_vision_spec,
    frozen_vision_encoder,
    is_sentence_transformer,
    with_vision_features,
)
from .rng import RngState

__all__ = ["GradCache"]


class GradCache:
    """Chunked contrastive training step with the exact full-batch gradient (see :mod:`hfpatch.training.gradcache`).

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
        compile: Run the encoder's ``forward`` through ``torch.compile`` in both passes (see
            :class:`~hfpatch.training.gradcache.compiled.CompiledForwards`): one static-shape graph per kind of
            chunk call, each compiled once.
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
        self.vision_specs = [vision_spec or config_vision_spec(m) for m in self.models]
        self.vision_encoders = [
            frozen_vision_encoder(m) if reuse_frozen_vision else None for m in self.models
        ]
        self.features_dict = [
            is_sentence_transformer(m) if features_dict is None else features_dict for m in self.models
        ]
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be a bool, got {compile!r}")
        if compile:
            from ...core.compile import check_compile_backend

            check_compile_backend(compile_backend, False, "GradCache")
        self.compiled = CompiledForwards(compile_backend) if compile else None

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
        total, parts = batch_len(inputs), [batch_len(c) for c in chunks]
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
                output = call_encoder(model, chunk, features_dict)
        else:
            output = call_encoder(model, chunk, features_dict)
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
                            chunk = model_chunks[j] = with_vision_features(encoder, chunk)
                    if (k, j) == kept:
                        with torch.enable_grad(), self._sync_context(model, kept_syncs):
                            with self._autocast(model):  # DDP decides at forward time whether to sync
                                kept_rep = self._embed(model, chunk, as_dict[k])
                        model_states.append(None)
                        model_reps.append(kept_rep.detach())
                        continue
                    model_states.append(
                        RngState.capture(*chunk_tensors(chunk), *params)
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
