"""GradCache in sentence-transformers: ``GradCacheLoss`` against the plain loss, in ``SentenceTransformerTrainer``,
across two ranks; ``GradCache`` on a ``SentenceTransformer``; ``GradCacheTrainer`` refusing ST inputs.

Reference = the plain sentence-transformers loss on the whole batch (one forward/backward). Mini-batching only
regroups matmuls and the per-chunk gradient sums (reassociation), so results are compared within
``reassociation_tol`` of the reference's own rounding noise: the same reference step on an fp64 copy of the
model(s) (as in ``test_gradcache.py``). Gradients are relative to the largest reference gradient.
The model is a tiny random BERT behind a word-level tokenizer, built locally (no download).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from gradcache_helpers import fp64_float, grad_noise

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")

from sentence_transformers.sentence_transformer.losses import (  # noqa: E402
    GISTEmbedLoss,
    MultipleNegativesRankingLoss,
    MultipleNegativesSymmetricRankingLoss,
)

from hfpatch.testing.tolerance import (  # noqa: E402
    eps,
    low_precision_tol,
    reassociation_tol,
    rel_error,
    rounding_noise,
    to_fp64,
)
from hfpatch.training import GradCache, GradCacheTrainer  # noqa: E402
from hfpatch.training.sentence_transformers import GradCacheLoss, tiny_sentence_transformer  # noqa: E402
from hfpatch.training.trainer import info_nce  # noqa: E402

ANCHORS = [
    "the cat sat on the mat",
    "a dog ran on the road",
    "the sun",
    "a big red car",
    "blue sky",
    "the tree on the log",
    "a leaf on the sea",
    "the red sun sat",
]
POSITIVES = [
    "a cat sat",
    "the dog ran",
    "a sun in the sky",
    "the red car",
    "the blue sea",
    "a big tree",
    "the leaf",
    "a sun",
]


def _features(model, n: int = 6, start: int = 0) -> list[dict]:
    return [model.preprocess(ANCHORS[start : start + n]), model.preprocess(POSITIVES[start : start + n])]


def _user_fn(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return info_nce(q, p, temperature=0.1)


def _make_loss(kind: str, model, guide=None):
    if kind == "mnrl":
        return MultipleNegativesRankingLoss(model)
    if kind == "symmetric":  # deprecated (warns) but still shipped
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return MultipleNegativesSymmetricRankingLoss(model)
    if kind == "gist":
        return GISTEmbedLoss(model, guide)
    raise ValueError(kind)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _plain_step(kind: str, model, features, guide=None) -> tuple[torch.Tensor, dict]:
    """The plain sentence-transformers loss on the whole batch, or ``_user_fn`` on the model's embeddings."""
    features = [dict(f) for f in features]  # ST modules write their outputs into the dicts
    if kind == "fn":
        loss = _user_fn(*[model(f)["sentence_embedding"] for f in features])
    else:
        loss = _make_loss(kind, model, guide)(features, None)
    loss.backward()
    return loss.detach(), _grads(model)


def _noise(kind: str, model, features, ref_loss, ref, guide=None) -> tuple[float, float]:
    """(loss noise, gradient noise) of the fp32 plain step against the same step on fp64 copies."""
    with fp64_float():  # info_nce's .float() must keep the fp64 twin fp64
        loss64, grads64 = _plain_step(kind, to_fp64(model), features, to_fp64(guide) if guide else None)
    return rounding_noise(ref_loss, loss64), grad_noise(ref, grads64)


def _assert_grads_close(got: dict, ref: dict, tol: float) -> float:
    assert set(got) == set(ref), set(got) ^ set(ref)
    scale = max(g.abs().max().item() for g in ref.values())
    error = max((got[n] - ref[n]).abs().max().item() for n in ref) / scale
    print(f"max |grad diff| / max |grad| = {error:.3e}, tolerance {tol:.3e}")
    assert error <= tol
    return error


@pytest.fixture(scope="module")
def models():
    return tiny_sentence_transformer(seed=0), tiny_sentence_transformer(seed=1)  # model, GIST guide


@pytest.mark.parametrize(
    "kind, cross_rank",
    [("mnrl", False), ("symmetric", False), ("gist", False), ("fn", False), ("mnrl", True), ("gist", True)],
)
def test_gradcache_loss_matches_plain_loss(models, kind, cross_rank):
    """``cross_rank=True`` in one process (no process group) is a world of one: the same script runs."""
    model, guide = models
    features = _features(model)  # batch 6, mini-batches of 2
    ref_loss, ref = _plain_step(kind, model, features, guide)
    loss_noise, noise = _noise(kind, model, features, ref_loss, ref, guide)

    base = _user_fn if kind == "fn" else _make_loss(kind, model, guide)
    wrapped = GradCacheLoss(
        base, mini_batch_size=2, model=model if kind == "fn" else None, cross_rank=cross_rank
    )
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    loss = wrapped([dict(f) for f in features], None)
    assert model[0].auto_model.embeddings.word_embeddings.weight.grad is None, "backward deferred to the hook"
    loss.backward()
    handle.remove()
    assert len(calls) == 2 * 6 - 1, "3 + 3 mini-batches embedded, all but the last re-embedded"
    if kind == "gist":
        assert all(p.grad is None for p in guide.parameters()), "the guide stays frozen"
    error = rel_error(loss, ref_loss)
    print(f"{kind}: loss relative error {error:.3e}, tolerance {reassociation_tol(loss_noise):.3e}")
    assert error <= reassociation_tol(loss_noise)
    _assert_grads_close(_grads(model), ref, reassociation_tol(noise))


def test_cross_rank_launched_without_a_process_group_says_so(models, monkeypatch):
    model, _ = models
    for var, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "x",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(var, value)
    wrapped = GradCacheLoss(_make_loss("mnrl", model, None), mini_batch_size=2, cross_rank=True)
    with pytest.raises(ValueError, match="needs the torch.distributed process group"):
        wrapped([dict(f) for f in _features(model)], None)
    model.zero_grad(set_to_none=True)


def test_gradcache_loss_scales_by_outer_gradient_and_evaluates_without_grad(models):
    model, _ = models
    features = _features(model)
    ref_loss, ref = _plain_step("mnrl", model, features)
    _, noise = _noise("mnrl", model, features, ref_loss, ref)
    wrapped = GradCacheLoss(MultipleNegativesRankingLoss(model), mini_batch_size=4)  # chunks of 4 and 2
    (wrapped([dict(f) for f in features], None) / 4).backward()  # Trainer: loss / accumulation steps
    # Dividing by 4 is exact in binary: the same tolerance as the unscaled step.
    _assert_grads_close({n: g * 4 for n, g in _grads(model).items()}, ref, reassociation_tol(noise))
    with torch.no_grad():
        loss = wrapped([dict(f) for f in features], None)
    assert not loss.requires_grad and rel_error(loss, ref_loss) <= reassociation_tol(noise)
    assert all(p.grad is None for p in model.parameters())


class _LearnedTemperature(torch.nn.Module):
    """A function of the embeddings with a parameter of its own (trained with the model by the ST Trainer)."""

    def __init__(self):
        super().__init__()
        self.log_scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return info_nce(q * self.log_scale.exp(), p, temperature=1.0)


def _temperature_step(model, fn, features) -> dict[str, torch.Tensor]:
    """Plain step of ``fn`` on the model's embeddings, divided by 4 (a Trainer's accumulation over 4 steps)."""
    (fn(*[model(dict(f))["sentence_embedding"] for f in features]) / 4).backward()
    grads = {**_grads(model), "log_scale": fn.log_scale.grad.clone()}
    fn.log_scale.grad = None
    return grads


def test_gradcache_loss_parameters_of_the_loss_get_the_outer_gradient(models):
    model, _ = models
    features = _features(model)
    fn = _LearnedTemperature()
    ref = _temperature_step(model, fn, features)
    with fp64_float():
        noise = grad_noise(ref, _temperature_step(to_fp64(model), to_fp64(fn), features))
    loss = GradCacheLoss(fn, 2, model=model)([dict(f) for f in features], None)
    assert fn.log_scale.grad is None, "the loss's own gradient waits for the outer backward too"
    (loss / 4).backward()  # the division by 4 is exact: the tolerance of the unscaled step
    _assert_grads_close({**_grads(model), "log_scale": fn.log_scale.grad}, ref, reassociation_tol(noise))


def test_gradcache_loss_bf16_autocast_matches_plain_autocast_step(models):
    model, _ = models
    features = _features(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref = _plain_step("mnrl", model, features)
    # As in test_gradcache.py: both bf16 steps round the same values except where chunking's fp32
    # reassociation flips a rounding, so they differ by at most the bf16 step's own noise against fp64.
    loss_noise, noise = _noise("mnrl", model, features, ref_loss, ref)
    wrapped = GradCacheLoss(MultipleNegativesRankingLoss(model), 2, autocast_dtype=torch.bfloat16)
    loss = wrapped([dict(f) for f in features], None)
    loss.backward()
    print(
        f"bf16 loss error {rel_error(loss, ref_loss):.3e} (tol {low_precision_tol(loss_noise, torch.bfloat16):.3e})"
    )
    assert rel_error(loss, ref_loss) <= low_precision_tol(loss_noise, torch.bfloat16)
    _assert_grads_close(_grads(model), ref, low_precision_tol(noise, torch.bfloat16))


def test_gradcache_on_sentence_transformer_model_takes_one_features_dict(models):
    model, _ = models
    features = _features(model)
    ref_loss, ref = _plain_step("fn", model, features)
    loss_noise, noise = _noise("fn", model, features, ref_loss, ref)
    cache = GradCache(model, _user_fn, 2)  # detected: model(features) and its "sentence_embedding"
    assert cache.features_dict == [True]
    loss = cache.step(*features)
    assert rel_error(loss, ref_loss) <= reassociation_tol(loss_noise)
    _assert_grads_close(_grads(model), ref, reassociation_tol(noise))
    assert set(features[0]) == {"input_ids", "token_type_ids", "attention_mask", "modality"}, (
        "the caller's features are not filled with token_embeddings"
    )

    class DictEncoder(torch.nn.Module):  # any module taking one dict: opt in with features_dict=True
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, features):
            return features["x"] @ self.linear.weight.T

    encoder = DictEncoder()
    x = {"x": torch.randn(5, 3)}
    GradCache(encoder, _user_fn, 2, features_dict=True).step(x, {"x": torch.randn(5, 3)})
    assert encoder.linear.weight.grad is not None


def test_gradcache_loss_refuses_cached_or_double_gathering_losses(models):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    model, _ = models
    with pytest.raises(ValueError, match="already caches gradients"):
        GradCacheLoss(CachedMultipleNegativesRankingLoss(model))
    with pytest.raises(ValueError, match="gather_across_devices=False"):
        GradCacheLoss(MultipleNegativesRankingLoss(model, gather_across_devices=True), cross_rank=True)
    with pytest.raises(TypeError, match="needs model="):
        GradCacheLoss(_user_fn)


def test_gradcache_trainer_refuses_sentence_transformers(models, tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(str(tmp_path), remove_unused_columns=False, report_to="none", use_cpu=True)
    with pytest.raises(TypeError, match="SentenceTransformerTrainer\\(.*loss=GradCacheLoss"):
        GradCacheTrainer(model=models[0], args=args, chunk_size=2)


# -- SentenceTransformerTrainer -------------------------------------------------------------------------


def _train(model, loss, tmp_path, name: str) -> tuple[list[float], list[torch.Tensor]]:
    """Two SGD steps of 4 pairs; returns the per-step losses and the batches' anchor ids."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    class Recording(SentenceTransformerTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            batches.append(inputs["anchor_input_ids"].clone())
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(loss.item())
            return loss

    losses, batches = [], []
    args = SentenceTransformerTrainingArguments(
        str(tmp_path / name),
        per_device_train_batch_size=4,
        max_steps=2,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    data = Dataset.from_dict({"anchor": ANCHORS, "positive": POSITIVES})
    Recording(model=model, args=args, train_dataset=data, loss=loss).train()
    return losses, batches


def test_sentence_transformer_trainer_with_gradcache_loss_matches_plain_loss(tmp_path):
    pytest.importorskip(
        "datasets", reason="SentenceTransformerTrainer needs datasets (sentence-transformers[train])"
    )
    start = tiny_sentence_transformer(seed=2)
    before = {n: p.detach().clone() for n, p in start.named_parameters()}

    def updates(model):
        return {n: p.detach().double() - before[n].double() for n, p in model.named_parameters()}

    plain, twin, cached = start, to_fp64(start), to_fp64(start).float()  # same weights, bit for bit
    ref_losses, ref_batches = _train(plain, MultipleNegativesRankingLoss(plain), tmp_path, "plain")
    with fp64_float():
        losses64, _ = _train(twin, MultipleNegativesRankingLoss(twin), tmp_path, "fp64")
    losses, batches = _train(cached, GradCacheLoss(MultipleNegativesRankingLoss(cached), 2), tmp_path, "gc")
    assert all(torch.equal(a, b) for a, b in zip(batches, ref_batches)), "same batches in the same order"
    # The fp32 plain run against the fp64 one: the rounding noise of two SGD steps (forward, backward, update).
    loss_noise = max(
        rounding_noise(a, b) for a, b in zip(map(torch.tensor, ref_losses), map(torch.tensor, losses64))
    )
    ref, exact = updates(plain), updates(twin)
    noise = grad_noise(ref, exact)
    tol = reassociation_tol(noise)
    got = updates(cached)
    error = max((got[n] - ref[n]).abs().max().item() for n in ref) / max(
        u.abs().max().item() for u in ref.values()
    )
    print(f"losses {losses} vs {ref_losses}; weight-update error {error:.3e}, tolerance {tol:.3e}")
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= reassociation_tol(loss_noise) * abs(b)
    assert error <= tol


# -- world size 2: cross-rank negatives ------------------------------------------------------------------


def _cross_rank_case(kinds: list[str], refs: list[dict]) -> list[tuple[float, float]]:
    """Rank r owns pairs [4r, 4r + 4) of the global batch of 8 and computes GradCacheLoss(cross_rank=True)
    through a DDP-wrapped model, as SentenceTransformerTrainer sets it up; returns per kind (loss, gradient
    error relative to the one-process global-batch gradient ``refs``)."""
    from torch.nn.parallel import DistributedDataParallel

    rank, results = dist.get_rank(), []
    for kind, ref in zip(kinds, refs):
        model, guide = tiny_sentence_transformer(seed=0), tiny_sentence_transformer(seed=1)
        base = _user_fn if kind == "fn" else _make_loss(kind, model, guide)
        loss = GradCacheLoss(base, 2, model=model if kind == "fn" else None, cross_rank=True)
        ddp = DistributedDataParallel(model)
        loss.model = ddp  # what SentenceTransformerTrainer.override_model_in_loss does
        if kind != "fn":
            loss.loss.model = ddp
        value = loss(_features(model, n=4, start=4 * rank), None)
        value.backward()  # DDP averages the two ranks' gradients
        got = _grads(model)
        diff = max((got[n] - ref[n]).abs().max().item() for n in ref)
        results.append((value.item(), diff / max(g.abs().max().item() for g in ref.values())))
    return results


def test_gradcache_loss_cross_rank_world_2_matches_global_batch(rank_pool, models):
    model, guide = models
    kinds = ["mnrl", "gist", "fn"]
    refs, tols = [], []
    for kind in kinds:  # one process, the global batch of 8 (rank-major: rank 0's pairs first)
        features = _features(model, n=8)
        ref_loss, ref = _plain_step(kind, model, features, guide)
        loss_noise, noise = _noise(kind, model, features, ref_loss, ref, guide)
        # + one rounding of DDP's 2-rank average (eps / 2 of the result)
        refs.append(ref)
        tols.append((ref_loss.item(), reassociation_tol(loss_noise), reassociation_tol(noise) + eps() / 2))
    per_rank = rank_pool(2).run(_cross_rank_case, kinds, refs)
    for kind, (ref_loss, loss_tol, grad_tol), *ranks in zip(kinds, tols, *per_rank):
        for rank, (loss, error) in enumerate(ranks):
            print(
                f"{kind} rank {rank}: loss {loss:.6f} vs {ref_loss:.6f}, grad error {error:.3e} (tol {grad_tol:.3e})"
            )
            assert abs(loss - ref_loss) <= loss_tol * abs(ref_loss), (
                "every rank returns the global-batch loss"
            )
            assert error <= grad_tol


# -- row-blocked equivalents of sentence-transformers' losses ----------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
        {"directions": ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), "scale": 7.0},
        {"similarity_fct": "dot_score", "scale": 0.5},
    ],
    ids=["mnrl", "symmetric", "gte_joint", "dot"],
)
def test_row_blocked_equivalent_equals_sentence_transformers_mnrl(models, settings):
    """sentence-transformers' own ``compute_loss_from_embeddings`` on random embeddings (2 hard negatives,
    batch 7) against the translated loss in blocks of 3: value and every input's gradient."""
    from sentence_transformers import util

    from hfpatch.training.sentence_transformers import row_blocked_equivalent

    settings = dict(settings)
    if "similarity_fct" in settings:
        settings["similarity_fct"] = getattr(util, settings["similarity_fct"])
    st_loss = MultipleNegativesRankingLoss(models[0], **settings)
    blocked, guide = row_blocked_equivalent(st_loss, block_size=3)
    assert guide is None

    def run(fn, dtype):
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(7, 5, generator=gen).to(dtype).requires_grad_() for _ in range(4)]
        value = fn(xs)
        value.backward()
        return [value.detach(), *(x.grad for x in xs)]

    ref = run(lambda xs: st_loss.compute_loss_from_embeddings(xs, None), torch.float32)
    with fp64_float():
        exact = run(lambda xs: st_loss.compute_loss_from_embeddings(xs, None), torch.float64)
    got = run(lambda xs: blocked(*xs), torch.float32)
    noise = max(rel_error(r, e) for r, e in zip(ref, exact))
    error = max(rel_error(g, r) for g, r in zip(got, ref))
    print(
        f"{settings}: row-blocked vs sentence-transformers {error:.2e} (tol {reassociation_tol(noise):.2e})"
    )
    assert error <= reassociation_tol(noise)


def test_gradcache_loss_runs_mnrl_and_gist_in_row_blocks(models, monkeypatch):
    """GradCacheLoss(MNRL / GISTEmbedLoss) computes the translated loss (blocks of 4 rows: ragged at batch 6)
    and equals the plain loss; ``row_blocked=False`` keeps the wrapped loss's code; a GISTLoss of
    hfpatch.training.contrastive takes the guide model directly."""
    from hfpatch.training.contrastive import ContrastiveLoss, GISTLoss

    model, guide = models
    features = _features(model)
    calls = []
    forward = ContrastiveLoss.forward
    monkeypatch.setattr(
        ContrastiveLoss,
        "forward",
        lambda self, *a, **kw: calls.append(type(self).__name__) or forward(self, *a, **kw),
    )
    for kind in ("mnrl", "gist"):
        ref_loss, ref = _plain_step(kind, model, features, guide)
        loss_noise, noise = _noise(kind, model, features, ref_loss, ref, guide)
        wrappers = [
            GradCacheLoss(_make_loss(kind, model, guide), 2, loss_block_size=4),
            GradCacheLoss(_make_loss(kind, model, guide), 2, row_blocked=False),
        ]
        if kind == "gist":
            wrappers.append(GradCacheLoss(GISTLoss(block_size=4), 2, model=model, guide=guide))
        expected = [["InfoNCELoss" if kind == "mnrl" else "GISTLoss"], [], ["GISTLoss"]]
        for wrapped, names in zip(wrappers, expected):
            calls.clear()
            loss = wrapped([dict(f) for f in features], None)
            loss.backward()
            assert calls == names
            assert rel_error(loss, ref_loss) <= reassociation_tol(loss_noise)
            _assert_grads_close(_grads(model), ref, reassociation_tol(noise))
    assert all(p.grad is None for p in guide.parameters()), "the guide stays frozen"
    with pytest.raises(TypeError, match="needs guide="):
        GradCacheLoss(GISTLoss(), 2, model=model)
