"""GradCache for sentence-transformers: a loss module for ``SentenceTransformerTrainer(loss=...)``.

:class:`GradCacheLoss` wraps any in-batch-negatives loss, a sentence-transformers loss module
(``MultipleNegativesRankingLoss``, ``MultipleNegativesSymmetricRankingLoss``, ``GISTEmbedLoss``, ...) or a
function of the embeddings ``fn(*reps) -> loss``, and computes it with :class:`~hfpatch.training.GradCache`:

1. every column (anchor, positive, negatives) is embedded in mini-batches without a graph (RNG states kept);
2. the wrapped loss runs on the cached embeddings: inside it, the model is replaced by a stand-in that
   returns them (so the loss's own code, margins, masks and guide included, is what runs), and its
   gradients with respect to the embeddings are cached;
3. the returned loss tensor carries a hook: when the Trainer calls ``loss.backward()``, each mini-batch is
   re-embedded with a graph (same dropout masks) and its cached gradient, times the gradient the Trainer
   hands to the loss (gradient accumulation, fp16 loss scale), is back-propagated into the model.

This is how sentence-transformers' own ``CachedMultipleNegativesRankingLoss`` works; here the loss is any,
and hfpatch's extras apply: ``cross_rank=True`` all-gathers the embeddings of every data-parallel rank so
that each rank computes the loss of the global batch (see :class:`~hfpatch.training.GradCache`; guide
embeddings are gathered too), ``autocast_dtype`` and ``split_fn``/``vision_spec`` pass through.

Step 2 holds the loss of the whole batch: a plain MNRL/GIST keeps its ``B x B`` similarity matrix and
gradients. ``MultipleNegativesRankingLoss`` (its symmetric variant too) and ``GISTEmbedLoss`` are therefore
computed by their row-blocked equivalents of :mod:`hfpatch.training.contrastive` (:func:`row_blocked_equivalent`:
same value and gradients, loss-stage memory ``O(B x block)``; ``row_blocked=False`` keeps their own code), as
sentence-transformers' cached losses compute theirs in mini-batches; other losses run their own code on the
cached embeddings.

Frozen auxiliary sentence-transformers models inside the loss (``GISTEmbedLoss``'s ``guide``) run in
mini-batches under ``torch.no_grad()``. Losses that need the model for something other than embedding the
batch's columns (``MatryoshkaLoss``, ``AdaptiveLayerLoss``, losses that embed extra texts) are not supported.

>>> import pytest, torch
>>> _ = pytest.importorskip("sentence_transformers")  # this doctest needs the optional dependency
>>> from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
>>> from hfpatch.training.sentence_transformers import GradCacheLoss, tiny_sentence_transformer
>>> model = tiny_sentence_transformer()
>>> loss = GradCacheLoss(MultipleNegativesRankingLoss(model), mini_batch_size=2)
>>> anchors = model.preprocess(["the cat sat", "a dog ran", "the sun", "a log on the mat"])
>>> positives = model.preprocess(["a cat sat", "the dog ran", "a sun", "the mat"])
>>> value = loss([anchors, positives], None)   # what SentenceTransformerTrainer.compute_loss calls
>>> value.backward()                            # re-embeds the mini-batches, fills .grad
>>> value.shape, model[0].auto_model.embeddings.word_embeddings.weight.grad is not None
(torch.Size([]), True)
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .contrastive import ContrastiveLoss, GISTLoss, InfoNCELoss, cross_rank_world
from .gradcache import GradCache, is_sentence_transformer, split_inputs
from .gradcache.encoders import inner_module
from .vlm_split import VisionTokenSpec

__all__ = ["GradCacheLoss", "row_blocked_equivalent", "tiny_sentence_transformer"]

_TINY_WORDS = "the a cat dog sat ran on mat log sun big red blue sky sea car road tree leaf".split()


def tiny_sentence_transformer(seed: int = 0, dropout: float = 0.0, pooling: str = "mean") -> nn.Module:
    """A ``SentenceTransformer`` (``Transformer`` + ``Pooling``) around :func:`hfpatch.testing.tiny_bert`, with a
    word-level ``BertTokenizerFast`` over a few English words (others map to ``[UNK]``). Built locally from
    random weights, no download; for tests, examples and docs.

    >>> import pytest
    >>> _ = pytest.importorskip("sentence_transformers")  # this doctest needs the optional dependency
    >>> model = tiny_sentence_transformer()
    >>> tuple(model.encode(["the cat sat on the mat"], convert_to_tensor=True).shape)
    (1, 32)
    """
    from safetensors.torch import save_file
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertTokenizerFast

    from hfpatch.testing import tiny_bert

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_TINY_WORDS]
    with tempfile.TemporaryDirectory() as path:
        BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)
        bert = tiny_bert(seed=seed, dropout=dropout)
        bert.config.save_pretrained(
            path
        )  # not bert.save_pretrained: it writes on rank 0 only once distributed
        save_file({k: v.contiguous() for k, v in bert.state_dict().items()}, f"{path}/model.safetensors")
        transformer = Transformer(path, model_kwargs={"add_pooling_layer": False})
    return SentenceTransformer(
        modules=[transformer, Pooling(transformer.get_embedding_dimension(), pooling)], device="cpu"
    )


def _sentence_embedding(output: Any, chunk: Any) -> torch.Tensor:
    return output["sentence_embedding"]


class _CachedModel(nn.Module):
    """Stands in for the trained model inside the wrapped loss while it computes the loss: called on one of the
    batch's feature dicts, returns that column's cached (possibly gathered) embeddings instead of running the
    encoder. Any other attribute is the real model's."""

    def __init__(self, model: nn.Module, reps: dict[int, torch.Tensor]):
        super().__init__()
        self.__dict__["_real"] = model  # not a submodule: .to()/parameters() must not see it twice
        self.__dict__["_reps"] = reps

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        rep = self._reps.get(id(features))
        if rep is None:  # a shallow copy of a column's dict still holds the same tensors
            rep = next((self._reps[id(v)] for v in features.values() if id(v) in self._reps), None)
        if rep is None:
            raise RuntimeError(
                "GradCacheLoss: the wrapped loss called the model on features that are not one of the batch's "
                "columns (merged columns, extra texts, or a model-patching loss such as MatryoshkaLoss); only "
                "losses that embed each column once can be cached. Pass a function of the embeddings instead."
            )
        return {**features, "sentence_embedding": rep}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)


class _FrozenInMiniBatches(nn.Module):
    """Stands in for a frozen auxiliary model of the loss (``GISTEmbedLoss``'s guide): embeds whatever features
    it gets in mini-batches under ``torch.no_grad()``; with ``gather``, all-gathers the embeddings like the
    trained model's (rank-major order)."""

    def __init__(
        self, model: nn.Module, mini_batch_size: int, gather: Callable[[torch.Tensor], torch.Tensor]
    ):
        super().__init__()
        self.__dict__["_real"] = model
        self.__dict__["_mini_batch_size"] = mini_batch_size
        self.__dict__["_gather"] = gather

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        with torch.no_grad():
            reps = [
                self._real(dict(chunk), **kwargs)["sentence_embedding"]
                for chunk in split_inputs(features, self._mini_batch_size)
            ]
            return {**features, "sentence_embedding": self._gather(torch.cat(reps))}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)


def _model_slots(module: nn.Module, model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module, bool]]:
    """``(parent, name, child, is_trained_model)`` for every sentence-transformers model held by ``module`` (its
    submodules included; not looking inside the models themselves)."""
    for name, child in module.named_children():
        if inner_module(child) is inner_module(model):
            yield module, name, child, True
        elif is_sentence_transformer(child):
            yield module, name, child, False
        else:
            yield from _model_slots(child, model)


def _gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0 (uneven sizes allowed), without gradient."""
    from hfpatch.distributed.collectives import all_gather

    world = cross_rank_world(group)
    if world == 1:  # one process: nothing to gather
        return x
    count = torch.tensor([x.shape[0]], device=x.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    with torch.no_grad():
        return all_gather(x.contiguous(), 0, group, [int(c) for c in counts])


def row_blocked_equivalent(
    loss: nn.Module, *, block_size: int | None = None, block_bytes: int | None = None
) -> tuple[ContrastiveLoss, nn.Module | None] | None:
    """The loss of :mod:`hfpatch.training.contrastive` that computes a sentence-transformers loss in row blocks,
    and the frozen guide model whose embeddings it needs (GIST); ``None`` where there is none.

    - ``MultipleNegativesRankingLoss`` (and the deprecated ``MultipleNegativesSymmetricRankingLoss``) with
      ``similarity_fct`` ``cos_sim`` or ``dot_score`` and no hardness weighting -> :class:`InfoNCELoss` with
      the same scale, directions and partition mode;
    - ``GISTEmbedLoss`` whose guide shares the model's tokenizer -> :class:`GISTLoss` with the same
      temperature, margin and contrast settings, and the guide.

    Anything else (other losses, subclasses, other similarity functions, hardness weighting, a guide that needs
    retokenizing) keeps the wrapped loss's own code.

    >>> import pytest
    >>> _ = pytest.importorskip("sentence_transformers")  # this doctest needs the optional dependency
    >>> from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    >>> blocked, guide = row_blocked_equivalent(MultipleNegativesRankingLoss(tiny_sentence_transformer()))
    >>> blocked, guide
    (InfoNCELoss(normalize=True, scale=20.0, directions=('query_to_doc',), partition_mode='joint', block_bytes=268435456), None)
    """
    if not type(loss).__module__.startswith("sentence_transformers."):
        return None
    from sentence_transformers.sentence_transformer import losses as st_losses
    from sentence_transformers.util import cos_sim, dot_score

    blocks = dict(block_size=block_size, block_bytes=block_bytes)
    symmetric = getattr(st_losses, "MultipleNegativesSymmetricRankingLoss", None)
    if type(loss) in (st_losses.MultipleNegativesRankingLoss, symmetric):
        if getattr(loss, "hardness_mode", None) is not None and getattr(loss, "hardness_strength", 0.0) > 0:
            return None
        if loss.similarity_fct not in (cos_sim, dot_score):
            return None
        both = type(loss) is symmetric
        directions = getattr(
            loss, "directions", ("query_to_doc", "doc_to_query") if both else ("query_to_doc",)
        )
        partition = getattr(loss, "partition_mode", "per_direction" if both else "joint")
        blocked = InfoNCELoss(
            float(loss.scale),
            directions=directions,
            partition_mode=partition,
            normalize=loss.similarity_fct is cos_sim,
            **blocks,
        )
        return blocked, None
    if type(loss) is st_losses.GISTEmbedLoss and not getattr(loss, "must_retokenize", True):
        blocked = GISTLoss(
            float(loss.temperature),
            margin_strategy=loss.margin_strategy,
            margin=float(loss.margin),
            contrast_anchors=bool(loss.contrast_anchors),
            contrast_positives=bool(loss.contrast_positives),
            **blocks,
        )
        return blocked, loss.guide
    return None


class GradCacheLoss(nn.Module):
    """A sentence-transformers loss computed with GradCache: the exact gradient of ``loss`` on the whole batch,
    with the activation memory of ``mini_batch_size`` samples (see the module docstring).

    Args:
        loss: A sentence-transformers loss module built on the model (``MultipleNegativesRankingLoss(model)``,
            ``MultipleNegativesSymmetricRankingLoss(model)``, ``GISTEmbedLoss(model, guide)``, ...; not an
            already cached one), or a function of the column embeddings ``loss(*reps) -> scalar`` (``reps[k]``
            is ``[B, D]`` for column ``k``: anchor, positive, negatives), which then needs ``model``. A function
            that is an ``nn.Module`` (e.g. with a learnable temperature) is registered, so its parameters train.
        mini_batch_size: Most samples embedded at once (the memory knob).
        model: The ``SentenceTransformer``; default: ``loss.model``.
        cross_rank: All-gather the embeddings of all data-parallel ranks (``process_group``) and compute the loss
            of the global batch on every rank; gradients are scaled so that DDP's *average* over ranks is the
            global-batch gradient. Refused together with the wrapped loss's own ``gather_across_devices``.
        process_group: Group for ``cross_rank`` (default: world).
        autocast_dtype: Run the encoder and the loss under ``torch.autocast`` with this dtype. Leave unset under
            ``SentenceTransformerTrainer(bf16=True)``: accelerate already autocasts the model's forward.
        replay_rng: Replay each mini-batch's RNG state in the second pass (exact gradients with dropout).
        split_fn, vision_spec: As for :class:`~hfpatch.training.GradCache` (custom splitting; Qwen-VL media).
        row_blocked: Compute a ``MultipleNegativesRankingLoss``/``GISTEmbedLoss`` with its row-blocked
            equivalent (:func:`row_blocked_equivalent`: the same value and gradients, loss-stage memory
            ``O(B x block)`` instead of ``O(B^2)``); ``False`` runs the wrapped loss's own code. Losses without an
            equivalent always run their own code.
        loss_block_size, loss_block_bytes: Rows per block, or the loss stage's memory budget, of that
            equivalent (default: :data:`~hfpatch.training.contrastive.DEFAULT_BLOCK_BYTES`).
        guide: With a :class:`~hfpatch.training.contrastive.GISTLoss` as ``loss``: the frozen guide
            ``SentenceTransformer``, which embeds every column in mini-batches without gradient.

    ``forward(sentence_features, labels)`` returns the loss; under ``torch.no_grad()`` (evaluation) the loss
    only. Labels are passed to a wrapped loss module (all-gathered with ``cross_rank``), not to a function.

    Raises:
        TypeError: ``loss`` is neither a sentence-transformers loss nor callable, or ``model`` is missing.
        ValueError: An already cached loss, or ``cross_rank`` with ``gather_across_devices=True``.
    """

    def __init__(
        self,
        loss: nn.Module | Callable[..., torch.Tensor],
        mini_batch_size: int = 32,
        *,
        model: nn.Module | None = None,
        cross_rank: bool = False,
        process_group: dist.ProcessGroup | None = None,
        autocast_dtype: torch.dtype | None = None,
        replay_rng: bool = True,
        split_fn: Callable[[Any, int], Sequence[Any]] | None = None,
        vision_spec: VisionTokenSpec | None = None,
        row_blocked: bool = True,
        loss_block_size: int | None = None,
        loss_block_bytes: int | None = None,
        guide: nn.Module | None = None,
    ):
        super().__init__()
        if not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(
                f"mini_batch_size must be a positive number of samples, got {mini_batch_size!r}."
            )
        is_st_loss = isinstance(loss, nn.Module) and isinstance(getattr(loss, "model", None), nn.Module)
        if is_st_loss and getattr(loss, "uses_gradient_cache", False):
            raise ValueError(
                f"{type(loss).__name__} already caches gradients; wrap its plain counterpart instead "
                "(e.g. MultipleNegativesRankingLoss rather than CachedMultipleNegativesRankingLoss)."
            )
        if is_st_loss and cross_rank and getattr(loss, "gather_across_devices", False):
            raise ValueError(
                f"cross_rank=True gathers the embeddings already; build {type(loss).__name__} with "
                "gather_across_devices=False (or drop cross_rank to keep its own gathering)."
            )
        if not is_st_loss and not callable(loss):
            raise TypeError(
                f"loss must be a sentence-transformers loss or a callable, got {type(loss).__name__}."
            )
        model = model if model is not None else (loss.model if is_st_loss else None)
        if not isinstance(model, nn.Module):
            raise TypeError("GradCacheLoss(fn, ...) with a function of the embeddings needs model=... .")
        self.model = model  # a submodule named "model": SentenceTransformerTrainer swaps in its DDP wrapper
        if isinstance(loss, nn.Module):
            self.loss = loss  # registered: its parameters (if any) are trained and moved with this module
        else:
            self.__dict__["loss"] = loss
        self.is_st_loss = is_st_loss
        self.mini_batch_size = mini_batch_size
        self.cross_rank = cross_rank
        self.process_group = process_group
        self.autocast_dtype = autocast_dtype
        self.replay_rng = replay_rng
        self.split_fn = split_fn
        self.vision_spec = vision_spec
        if isinstance(loss, GISTLoss) and guide is None:
            raise TypeError(
                "GradCacheLoss(GISTLoss(), ...) needs guide=<the frozen guide SentenceTransformer>."
            )
        if guide is not None and not isinstance(loss, GISTLoss):
            raise TypeError(
                "guide= is for a GISTLoss of hfpatch.training.contrastive; a sentence-transformers GISTEmbedLoss "
                f"brings its own guide (got loss={type(loss).__name__})."
            )
        self.__dict__["guide"] = guide  # frozen and not trained: not a submodule of the loss
        self.row_blocked = row_blocked
        if is_st_loss and row_blocked:  # fail early on bad block settings
            row_blocked_equivalent(loss, block_size=loss_block_size, block_bytes=loss_block_bytes)
        self.loss_block_size = loss_block_size
        self.loss_block_bytes = loss_block_bytes

    # sentence-transformers' cached losses set this; MatryoshkaLoss/AdaptiveLayerLoss read it.
    uses_gradient_cache = True

    @contextlib.contextmanager
    def _cached_models(self, features: list[dict[str, Any]], reps: Sequence[torch.Tensor]) -> Iterator[None]:
        """Swap the models inside the wrapped loss for stand-ins returning ``reps`` (trained model) or embedding
        in no-grad mini-batches (frozen models), and keep it from merging columns into one forward."""
        try:
            from sentence_transformers.base.losses.merged_forward import column_merging_disabled
        except ImportError:  # pragma: no cover - sentence-transformers < 6.2 never merges
            column_merging_disabled = contextlib.nullcontext
        lookup = {}
        for f, rep in zip(features, reps):
            lookup[id(f)] = rep
            lookup.update({id(v): rep for v in f.values() if isinstance(v, torch.Tensor)})
        gather = (lambda x: _gather_rows(x, self.process_group)) if self.cross_rank else (lambda x: x)
        slots = list(_model_slots(self.loss, self.model))
        try:
            for parent, name, child, trained in slots:
                stub = (
                    _CachedModel(child, lookup)
                    if trained
                    else _FrozenInMiniBatches(child, self.mini_batch_size, gather)
                )
                setattr(parent, name, stub)
            with column_merging_disabled():
                yield
        finally:
            for parent, name, child, _ in slots:
                setattr(parent, name, child)

    def _guide_embeddings(self, guide: nn.Module, features: list[dict[str, Any]]) -> list[torch.Tensor]:
        """The frozen guide's embeddings of every column, in mini-batches without gradient (local rows: a
        row-blocked loss gathers them itself with ``cross_rank``)."""
        with torch.no_grad():
            return [
                torch.cat(
                    [
                        guide(dict(chunk))["sentence_embedding"]
                        for chunk in split_inputs(column, self.mini_batch_size)
                    ]
                )
                for column in features
            ]

    def _loss_parameters(self) -> list[nn.Parameter]:
        if not isinstance(self.loss, nn.Module):
            return []
        frozen = {id(p) for *_, child, _ in _model_slots(self.loss, self.model) for p in child.parameters()}
        frozen |= {id(p) for p in self.model.parameters()}
        return [p for p in self.loss.parameters() if p.requires_grad and id(p) not in frozen]

    def forward(
        self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None
    ) -> torch.Tensor:
        """The loss of the batch; its ``backward()`` accumulates the full-batch gradient into the model.

        Args:
            sentence_features: One tokenized feature dict per column (what ``model.preprocess`` returns).
            labels: The batch labels (``None`` without a label column).
        """
        features = list(sentence_features)
        loss_kwargs: dict[str, Any] = {}
        blocked = (
            row_blocked_equivalent(
                self.loss, block_size=self.loss_block_size, block_bytes=self.loss_block_bytes
            )
            if self.is_st_loss and self.row_blocked
            else None
        )
        if blocked is not None:  # MNRL / GIST in row blocks: labels are unused by these losses
            loss_fn, guide = blocked
            if guide is not None:
                loss_kwargs["guide"] = self._guide_embeddings(guide, features)
        elif self.is_st_loss:
            if self.cross_rank and isinstance(labels, torch.Tensor) and labels.ndim > 0:
                labels = _gather_rows(labels, self.process_group)

            def loss_fn(*reps: torch.Tensor) -> torch.Tensor:
                with self._cached_models(features, reps):
                    return self.loss(features, labels)
        else:
            loss_fn = self.loss
            if self.guide is not None:
                loss_kwargs["guide"] = self._guide_embeddings(self.guide, features)
        cache = GradCache(
            self.model,
            loss_fn,
            self.mini_batch_size,
            split_fn=self.split_fn,
            rep_fn=_sentence_embedding,
            autocast_dtype=self.autocast_dtype,
            replay_rng=self.replay_rng,
            cross_rank=self.cross_rank,
            process_group=self.process_group,
            vision_spec=self.vision_spec,
            features_dict=True,
        )
        if not torch.is_grad_enabled():
            return cache.prepare(*features, **loss_kwargs)[0]
        # The loss's own parameters get their step-2 gradient now; hold it back so that the hook adds it times
        # the gradient the Trainer hands down (accumulation division, loss scale), like the model's.
        params = self._loss_parameters()
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss, finish = cache.prepare(*features, **loss_kwargs)
        finally:
            own = [p.grad for p in params]
            for p, g in zip(params, held):
                p.grad = g

        def backward_hook(grad: torch.Tensor) -> None:
            finish(grad)
            for p, g in zip(params, own):
                if g is not None:
                    g = g * grad.to(g.dtype)
                    p.grad = g if p.grad is None else p.grad + g

        loss = loss.requires_grad_()
        loss.register_hook(backward_hook)
        return loss

    def get_config_dict(self) -> dict[str, Any]:
        """What sentence-transformers writes into the model card."""
        inner = self.loss.get_config_dict() if hasattr(self.loss, "get_config_dict") else {}
        name = (
            type(self.loss).__name__ if self.is_st_loss else getattr(self.loss, "__name__", repr(self.loss))
        )
        return {"loss": name, **inner, "mini_batch_size": self.mini_batch_size, "cross_rank": self.cross_rank}

    @property
    def citation(self) -> str:
        """GradCache (Gao et al., 2021)."""
        return (
            "@inproceedings{gao2021scaling,\n  title={Scaling Deep Contrastive Learning Batch Size under Memory "
            "Limited Setup},\n  author={Gao, Luyu and Zhang, Yunyi and Han, Jiawei and Callan, Jamie},\n"
            "  booktitle={RepL4NLP},\n  year={2021}\n}\n"
        )
