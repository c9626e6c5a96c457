"""``GradCacheTrainer``: a ``transformers.Trainer`` whose training step is a :class:`GradCache` step.

Everything else (optimizer, scheduler, gradient accumulation, DDP/accelerate, mixed precision, logging,
checkpointing, peft models, ``gradient_checkpointing=True``) stays the Trainer's. A batch is a mapping from
input names to model inputs, e.g. ``{"query": {...}, "positive": {...}}``; the collator builds it and
``input_keys`` says which entries go to the encoder, in the order ``loss_fn`` takes them.

>>> import torch
>>> from transformers import TrainingArguments
>>> from hfpatch.training import GradCacheTrainer
>>> from hfpatch.training.trainer import info_nce
>>> from hfpatch.testing import tiny_bert
>>> rows = [{"q": torch.randint(1, 64, (5,)), "p": torch.randint(1, 64, (7,))} for _ in range(8)]
>>> def collate(batch):
...     return {k: {"input_ids": torch.stack([r[k] for r in batch])} for k in ("q", "p")}
>>> args = TrainingArguments("/tmp/hfpatch_gc_doctest", per_device_train_batch_size=8, max_steps=1,
...                          remove_unused_columns=False, report_to="none", use_cpu=True)
>>> trainer = GradCacheTrainer(model=tiny_bert(), args=args, train_dataset=rows, data_collator=collate,
...                            loss_fn=info_nce, chunk_size=2, input_keys=("q", "p"))
>>> loss = trainer.training_step(trainer.model, collate(rows))   # what trainer.train() runs per batch
>>> loss.shape, trainer.model.embeddings.word_embeddings.weight.grad is not None
(torch.Size([]), True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from .contrastive import takes_local_embeddings
from .gradcache import GradCache, is_sentence_transformer
from .pooling import Pooling, default_rep

__all__ = ["GradCacheTrainer", "info_nce"]


def info_nce(
    query: torch.Tensor, positive: torch.Tensor, *negatives: torch.Tensor, temperature: float = 0.05
):
    """InfoNCE over in-batch negatives (and optional extra negatives): query ``i`` should pick positive ``i``."""
    q = nn.functional.normalize(query.float(), dim=-1)
    docs = nn.functional.normalize(torch.cat([positive, *negatives]).float(), dim=-1)
    logits = q @ docs.T / temperature
    return nn.functional.cross_entropy(logits, torch.arange(len(q), device=logits.device))


_ST_HINT = (
    "from hfpatch.training.sentence_transformers import GradCacheLoss; "
    "SentenceTransformerTrainer(model, args, train_dataset, loss=GradCacheLoss(MultipleNegativesRankingLoss(model), "
    "mini_batch_size=32))"
)


def _refuse_sentence_transformers(model: Any, kwargs: dict[str, Any]) -> None:
    """GradCacheTrainer runs on transformers models and nested batches; sentence-transformers training goes
    through its own Trainer, whose loss= takes :class:`~hfpatch.training.sentence_transformers.GradCacheLoss`."""
    collator = kwargs.get("data_collator")
    reason = None
    if is_sentence_transformer(model):
        reason = f"model is a sentence-transformers {type(model).__name__}"
    elif "loss" in kwargs:
        reason = "loss= is a SentenceTransformerTrainer argument (GradCacheTrainer takes loss_fn=)"
    elif type(collator).__module__.startswith("sentence_transformers"):
        reason = f"data_collator is sentence-transformers' {type(collator).__name__}"
    if reason is not None:
        raise TypeError(
            f"GradCacheTrainer does not drive sentence-transformers training: {reason}. Keep "
            f"SentenceTransformerTrainer and wrap its loss instead: {_ST_HINT}."
        )


class GradCacheTrainer(Trainer):
    """``transformers.Trainer`` drop-in for contrastive embedding training with GradCache.

    Args:
        *args: As for ``Trainer``.
        **kwargs: As for ``Trainer``. ``TrainingArguments(remove_unused_columns=False)`` is required (the
            batch holds nested model inputs, not model-signature columns).
        loss_fn: ``loss_fn(*reps) -> scalar``, reps in ``input_keys`` order (default :func:`info_nce`), e.g. a
            row-blocked loss of :mod:`hfpatch.training.contrastive` (``InfoNCELoss()``, ``CLIPLoss()``, ...; a
            loss with parameters, such as CLIP's ``logit_scale``, trains when they are in the optimizer: pass
            ``optimizers=`` or put the loss's parameters on the model).
        chunk_size: Most samples per chunk; ``chunk_patches`` also bounds Qwen-VL vision patches per chunk.
        input_keys: Batch entries fed to the model, in loss order.
        pooling: Pooling of ``last_hidden_state`` (``"last"``, ``"mean"``, ``"cls"``).
        **gradcache_kwargs: Further :class:`GradCache` options (``rep_fn``, ``split_fn``, ``cross_rank``, ...).

    fp16 uses the accelerator's ``GradScaler`` (cached embedding gradients are scaled like the loss); bf16
    and fp16 autocast come from accelerate's wrapping of the model's forward, as in a plain Trainer step
    (with ``reuse_frozen_vision=True`` also pass ``autocast_dtype``: the tower then runs outside that forward).
    Evaluation computes the plain, unchunked loss. DeepSpeed is refused: its engine owns the backward.

    sentence-transformers models, losses and collators are refused: use ``SentenceTransformerTrainer`` with
    ``loss=GradCacheLoss(...)`` (:mod:`hfpatch.training.sentence_transformers`) instead.

    Raises:
        ValueError: ``remove_unused_columns=True``, no ``chunk_size``, or a DeepSpeed configuration.
        TypeError: A sentence-transformers model, ``loss=`` or the sentence-transformers data collator.
    """

    def __init__(
        self,
        *args: Any,
        loss_fn: Callable[..., torch.Tensor] = info_nce,
        chunk_size: int | None = None,
        chunk_patches: int | None = None,
        input_keys: Sequence[str] = ("query", "positive"),
        pooling: Pooling = "last",
        **kwargs: Any,
    ):
        gradcache_keys = {
            "split_fn",
            "rep_fn",
            "replay_rng",
            "no_sync",
            "cross_rank",
            "process_group",
            "vision_spec",
            "reuse_frozen_vision",
            "autocast_dtype",
        }
        self.gradcache_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in gradcache_keys}
        _refuse_sentence_transformers(args[0] if args else kwargs.get("model"), kwargs)
        super().__init__(*args, **kwargs)
        if self.args.remove_unused_columns:
            raise ValueError(
                "GradCacheTrainer batches are {input_key: model inputs} mappings, which Trainer's column removal "
                "would drop; pass TrainingArguments(..., remove_unused_columns=False)."
            )
        if chunk_size is None:
            raise ValueError(
                "GradCacheTrainer needs chunk_size (the most samples per chunk); chunk_patches only adds a bound "
                "on Qwen-VL vision patches."
            )
        if self.is_deepspeed_enabled:
            raise ValueError(
                "GradCacheTrainer does not support DeepSpeed: GradCache back-propagates chunk by chunk itself, "
                "which bypasses the DeepSpeed engine's backward (loss scaling, gradient partitioning). Use DDP or FSDP."
            )
        self.gradcache_loss_fn = loss_fn
        self.chunk_size = chunk_size
        self.chunk_patches = chunk_patches
        self.input_keys = tuple(input_keys)
        self.pooling = pooling

    def _batch_inputs(self, inputs: dict[str, Any]) -> list[Any]:
        missing = [k for k in self.input_keys if k not in inputs]
        if missing and any(str(k).endswith("_input_ids") for k in inputs):
            raise TypeError(
                f"batch has flat sentence-transformers columns {sorted(inputs)}; GradCacheTrainer takes "
                "{input_key: model inputs} batches. For sentence-transformers training use "
                f"SentenceTransformerTrainer(loss=GradCacheLoss(...)) instead ({_ST_HINT})."
            )
        if missing:
            raise ValueError(
                f"batch has keys {sorted(inputs)} but input_keys asks for {missing}; "
                "set input_keys=... to the collator's entries."
            )
        return [inputs[k] for k in self.input_keys]

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Run one GradCache step on ``inputs``; return the loss divided by the accumulation steps (Trainer's
        convention), with the matching gradient accumulated into ``.grad``."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        # Set by Trainer's loop for each accumulation cycle; the configured value outside of train().
        steps = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)

        def loss_fn(*reps: torch.Tensor, **kw: Any) -> torch.Tensor:
            return self.gradcache_loss_fn(*reps, **kw) / steps

        # A row-blocked loss (hfpatch.training.contrastive) gathers cross-rank negatives itself: keep it so.
        loss_fn.gathers_across_ranks = takes_local_embeddings(self.gradcache_loss_fn)

        cache = GradCache(
            model,
            loss_fn,
            self.chunk_size,
            chunk_patches=self.chunk_patches,
            pooling=self.pooling,
            scaler=getattr(self.accelerator, "scaler", None),
            **self.gradcache_kwargs,
        )
        with self.compute_loss_context_manager():
            return cache.step(*self._batch_inputs(inputs))

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Plain (unchunked) loss, used by evaluation; training goes through :meth:`training_step`."""
        rep_fn = self.gradcache_kwargs.get("rep_fn") or (lambda out, x: default_rep(out, x, self.pooling))
        reps = [rep_fn(model(**x), x) for x in self._batch_inputs(inputs)]
        loss = self.gradcache_loss_fn(*reps)
        return (loss, {"reps": reps}) if return_outputs else loss

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor, None, None]:
        """Evaluation step: the plain contrastive loss of the batch (no logits or labels to gather)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
