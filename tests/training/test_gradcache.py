"""GradCache vs the full-batch loss: parameter gradients, RNG replay, LoRA, AMP, DDP cross-rank negatives, Trainer.

Reference = one forward/backward of the whole batch through the stock model. Chunking changes only the
grouping of matmuls and of the per-chunk gradient sums (reassociation), so losses and gradients are compared
within ``reassociation_tol`` of the reference's own rounding noise: the same reference step on fp64 copies
of the models and inputs (``_reference_noise``). Gradients are relative to the largest reference gradient of
all parameters (``max |diff| <= tol * max |g_ref|``), so near-zero entries need no per-entry bound. Steps
under bf16/fp16 autocast are compared with the plain step under the same autocast, within
``low_precision_tol`` of that step's noise against fp64.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gradcache_helpers import fp64_loss, grad_noise

from hfpatch.testing import qwen3_vl_inputs, tiny_bert, tiny_qwen3_vl
from hfpatch.testing.tolerance import (
    eps,
    low_precision_tol,
    reassociation_tol,
    rel_error,
    rounding_noise,
    summation_tol,
    to_fp64,
)
from hfpatch.training import GradCache, GradCacheTrainer, VisionTokenSpec, split_inputs
from hfpatch.training.pooling import default_rep, pool
from hfpatch.training.trainer import info_nce

# Batch of 6: images of different sizes, a sample with two images, one with none, one with a video.
MEDIA = [
    [("image", (1, 4, 4))],
    [("image", (1, 2, 4)), ("image", (1, 2, 2))],
    [],
    [("video", (2, 2, 2))],
    [("image", (1, 4, 2))],
    [("image", (1, 2, 6))],
]


def _docs(seed: int = 1) -> dict:
    return qwen3_vl_inputs(MEDIA, seed=seed)


def _queries(seed: int = 2, padding: str = "right") -> dict:
    return qwen3_vl_inputs([[]] * len(MEDIA), text_len=5, seed=seed, padding=padding)


def _text(n: int = 6, length: int = 7, seed: int = 3) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, length), generator=gen)
    mask = torch.ones_like(ids)
    for i in range(n):
        mask[i, length - i % 3 :] = 0  # right padding of 0-2 tokens
    return {"input_ids": ids * mask, "attention_mask": mask}


def _take_grads(*models: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for k, model in enumerate(models):
        for name, p in model.named_parameters():
            if p.grad is not None:
                grads[f"{k}.{name}"] = p.grad.clone()
        model.zero_grad(set_to_none=True)
    return grads


def _max_diff(got: dict, ref: dict) -> tuple[float, float]:
    assert set(got) == set(ref), f"different parameters got gradients: {set(got) ^ set(ref)}"
    return max((got[n] - ref[n]).abs().max().item() for n in ref), max(
        g.abs().max().item() for g in ref.values()
    )


def _assert_grads_close(
    got: dict, ref: dict, noise: float = 0.0, extra: float = 0.0, tol: float | None = None
):
    """``max |diff| <= tol * max |g_ref|``, ``tol`` = ``reassociation_tol(noise) + extra`` unless given."""
    diff, scale = _max_diff(got, ref)
    tol = reassociation_tol(noise) + extra if tol is None else tol
    print(f"max |grad diff| / max |grad| = {diff / scale:.3e}, tolerance {tol:.3e}")
    assert diff <= tol * scale, f"max |grad diff| {diff:.3e} > {tol:.3e} * {scale:.3e}"
    return diff / scale


def _assert_loss_close(loss, ref_loss, noise: float = 0.0, tol: float | None = None) -> None:
    error = rel_error(loss, ref_loss)
    tol = reassociation_tol(noise) if tol is None else tol
    print(f"loss relative error {error:.3e}, tolerance {tol:.3e}")
    assert error <= tol, f"loss relative error {error:.3e} > {tol:.3e}"


def _full_batch(models, inputs, loss_fn=info_nce) -> tuple[torch.Tensor, dict]:
    models = models if isinstance(models, (list, tuple)) else [models] * len(inputs)
    loss = loss_fn(*[default_rep(m(**x), x) for m, x in zip(models, inputs)])
    loss.backward()
    return loss.detach(), _take_grads(*dict.fromkeys(models))


def _tensor_step(models, inputs, loss_fn=info_nce) -> tuple[torch.Tensor, dict]:
    """``_full_batch`` for models taking one tensor and returning the embeddings."""
    models = models if isinstance(models, (list, tuple)) else [models] * len(inputs)
    loss = loss_fn(*[m(x) for m, x in zip(models, inputs)])
    loss.backward()
    return loss.detach(), _take_grads(*dict.fromkeys(models))


def _reference_noise(models, inputs, ref_loss, ref, loss_fn=info_nce, reference=_full_batch):
    """(loss noise, gradient noise) of an fp32 reference step ``reference(models, inputs, loss_fn)``: its
    relative error against the same step on fp64 copies of the models and inputs (loss in fp64 too)."""
    models = models if isinstance(models, (list, tuple)) else [models] * len(inputs)
    twins = {m: to_fp64(m) for m in dict.fromkeys(models)}
    exact_loss, exact = reference([twins[m] for m in models], to_fp64(inputs), fp64_loss(loss_fn))
    return rounding_noise(ref_loss, exact_loss), grad_noise(ref, exact)


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen3_vl()


@pytest.mark.parametrize("chunk_size, chunk_patches", [(1, None), (2, None), (3, None), (4, 20)])
def test_gradcache_qwen3_vl_chunks_match_full_batch(qwen, chunk_size, chunk_patches):
    queries, docs = _queries(), _docs()
    ref_loss, ref = _full_batch(qwen, [queries, docs])
    loss_noise, grad_noise = _reference_noise(qwen, [queries, docs], ref_loss, ref)
    loss = GradCache(qwen, info_nce, chunk_size, chunk_patches=chunk_patches).step(queries, docs)
    _assert_loss_close(loss, ref_loss, loss_noise)
    _assert_grads_close(_take_grads(qwen), ref, grad_noise)


def _chunked_reference(models, inputs, chunk_size, loss_fn=info_nce) -> tuple[torch.Tensor, dict]:
    """The big-batch loss computed by embedding the same chunks in the same order *with* a graph: it draws
    the same dropout masks as GradCache's first pass, so it is the exact target with dropout on."""
    reps = []
    for model, x in zip(models, inputs):
        spec = VisionTokenSpec.from_config(model.config) if "pixel_values" in x else None
        reps.append(
            torch.cat([default_rep(model(**c), c) for c in split_inputs(x, chunk_size, vision_spec=spec)])
        )
    loss = loss_fn(*reps)
    loss.backward()
    return loss.detach(), _take_grads(*models)


def test_gradcache_dropout_replay_matches_reference_without_replay_differs():
    # Separate encoders: a BERT query tower and a Qwen3-VL document tower, both with dropout 0.1.
    bert, vl = tiny_bert(dropout=0.1).train(), tiny_qwen3_vl(attention_dropout=0.1).train()
    inputs = [_text(), _docs()]
    torch.manual_seed(7)
    ref_loss, ref = _chunked_reference([bert, vl], inputs, 2)
    after_ref = torch.get_rng_state()
    # The fp64 copies draw the same dropout masks from the same seed (bernoulli draws do not depend on dtype).
    torch.manual_seed(7)
    _, noise = _reference_noise(
        [bert, vl], inputs, ref_loss, ref, reference=lambda m, x, f: _chunked_reference(m, x, 2, f)
    )

    torch.manual_seed(7)
    GradCache([bert, vl], info_nce, 2).step(*inputs)
    # Exact: the RNG state is a byte string, restored and advanced by the same draws.
    assert torch.equal(torch.get_rng_state(), after_ref), "replay must leave the RNG where one pass leaves it"
    _assert_grads_close(_take_grads(bert, vl), ref, noise)

    torch.manual_seed(7)
    GradCache([bert, vl], info_nce, 2, replay_rng=False).step(*inputs)
    diff, scale = _max_diff(_take_grads(bert, vl), ref)
    print(f"without RNG replay: max |grad diff| / max |grad| = {diff / scale:.3e}")
    assert diff > reassociation_tol(noise) * scale, (
        "dropout masks differ between the passes without replay: gradients must differ beyond the tolerance"
    )


def test_gradcache_lora_with_gradient_checkpointing_matches_full_batch():
    from peft import LoraConfig, get_peft_model

    def lora_model(checkpointing: bool):
        model = tiny_qwen3_vl()
        if checkpointing:
            # transformers' current name; releases before it (the 5.17 floor) call it gradient_checkpointing_enable
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        torch.manual_seed(0)  # LoRA A is drawn from the global RNG
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "qkv"])
        )
        with torch.no_grad():  # LoRA B starts at zero, which would leave A without gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        return model.train()

    queries, docs = _queries(), _docs()
    reference = lora_model(False)
    ref_loss, ref = _full_batch(reference, [queries, docs])
    assert ref and all("lora_" in n for n in ref), "only LoRA parameters train"
    _, noise = _reference_noise(reference, [queries, docs], ref_loss, ref)
    model = lora_model(True)
    assert model.base_model.model.language_model.gradient_checkpointing
    GradCache(model, info_nce, 2).step(queries, docs)
    _assert_grads_close(_take_grads(model), ref, noise)


def _takes_encoder_outputs() -> bool:
    """Whether this transformers' Qwen-VL models take precomputed tower outputs (``mm_encoder_outputs``)."""
    import inspect

    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    return "mm_encoder_outputs" in inspect.signature(Qwen3VLModel.forward).parameters


def test_gradcache_reuse_frozen_vision_runs_tower_once_and_matches_full_batch():
    from peft import LoraConfig, get_peft_model

    def lora_llm():  # LoRA on the language model only: the vision tower is frozen
        torch.manual_seed(0)
        model = get_peft_model(tiny_qwen3_vl(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        return model.train()

    if not _takes_encoder_outputs():  # an older transformers would silently ignore the cached tower outputs
        with pytest.raises(ValueError, match="Qwen3VLModel.forward takes mm_encoder_outputs"):
            GradCache(lora_llm(), info_nce, 2, reuse_frozen_vision=True)
        return
    queries, docs = _queries(), _docs()
    reference = lora_llm()
    ref_loss, ref = _full_batch(reference, [queries, docs])
    _, noise = _reference_noise(reference, [queries, docs], ref_loss, ref)
    model = lora_llm()
    calls = []
    model.base_model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    GradCache(model, info_nce, 2, reuse_frozen_vision=True).step(queries, docs)
    assert len(calls) == 3, (
        "the tower runs once per media chunk (3 chunks of 2 documents), not again in pass 2"
    )
    _assert_grads_close(_take_grads(model), ref, noise)

    trainable = tiny_qwen3_vl()
    with pytest.raises(ValueError, match="vision tower of Qwen3VLModel has trainable parameters"):
        GradCache(trainable, info_nce, 2, reuse_frozen_vision=True)


def test_gradcache_naive_pixel_split_raises(qwen):
    def dim0_split(x, chunk_size):  # what a generic split does: every tensor by sample count
        return [{k: v[s : s + chunk_size] for k, v in x.items()} for s in range(0, 6, chunk_size)]

    with pytest.raises(
        ValueError, match="'pixel_values' has 2 rows but its 'image_grid_thw' .* gives 24 patches"
    ):
        GradCache(qwen, info_nce, 2, split_fn=dim0_split).step(_queries(), _docs())

    def grid_rows_by_sample(x, chunk_size):  # pixels follow the grids, but grid rows are taken one per sample
        patches = [0] + x["image_grid_thw"].prod(-1).cumsum(0).tolist()
        chunks, n, images = [], len(x["input_ids"]), len(x["image_grid_thw"])
        for s in range(0, n, chunk_size):
            i, e = min(s, images), min(s + chunk_size, images)
            chunk = {
                k: x[k][s : s + chunk_size] for k in ("input_ids", "attention_mask", "mm_token_type_ids")
            }
            chunk.update(
                image_grid_thw=x["image_grid_thw"][i:e],
                pixel_values=x["pixel_values"][patches[i] : patches[e]],
            )
            chunks.append(chunk)
        return chunks

    docs = qwen3_vl_inputs(MEDIA[:3], seed=1)  # images only; sample 1 has two
    with pytest.raises(
        ValueError, match="chunk has 7 image placeholder tokens but its .image_grid_thw. .* needs 6"
    ):
        GradCache(qwen, info_nce, 2, split_fn=grid_rows_by_sample).step(docs, docs)

    def without_token_types(x, chunk_size):  # media right, but a key the M-RoPE positions need is lost
        chunks = split_inputs(x, chunk_size, vision_spec=VisionTokenSpec.from_config(qwen.config))
        return [{k: v for k, v in c.items() if k != "mm_token_type_ids"} for c in chunks]

    with pytest.raises(ValueError, match="chunk lacks \\['mm_token_type_ids'\\]"):
        GradCache(qwen, info_nce, 2, split_fn=without_token_types).step(docs, docs)


def test_gradcache_autocast_bf16_matches_plain_autocast():
    bert = tiny_bert()
    inputs = [_text(seed=3), _text(seed=4)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref = _full_batch(bert, inputs)
    # Both steps round the same values to bf16 except where chunking's fp32 reassociation flips a rounding:
    # within low_precision_tol of the bf16 step's own noise against fp64 (autocast leaves fp64 alone). The
    # loss is reduced in fp32 (info_nce), the gradients come out of bf16 matmuls. Measured over seeds 3-8
    # and ATEN_CPU_CAPABILITY default/avx2/avx512: loss equal, gradients <= 1.2e-2 against a bf16 noise of
    # 5-6e-2 (floored at 6.25e-2); a chunk's gradient lost or doubled is off by O(1) of the scale.
    loss_noise, grad_noise = _reference_noise(bert, inputs, ref_loss, ref)
    loss = GradCache(bert, info_nce, 2, autocast_dtype=torch.bfloat16).step(*inputs)
    _assert_loss_close(loss, ref_loss, tol=low_precision_tol(loss_noise, torch.float32))
    _assert_grads_close(_take_grads(bert), ref, tol=low_precision_tol(grad_noise, torch.bfloat16))


def test_gradcache_fp16_grad_scaler_scales_gradients_like_plain_step():
    bert = tiny_bert()
    inputs = [_text(seed=3), _text(seed=4)]
    # The reference: a plain fp16-autocast step, its loss scaled by the same power of two (so the same
    # gradients underflow, and unscaling is exact). As for bf16 above, both fp16 steps round the same values
    # except where chunking's reassociation flips a rounding: within low_precision_tol of the fp16 step's
    # noise against fp64 (measured ~1e-2; the gap <= 1.9e-3 over seeds 3-8 and the three CPU
    # capabilities). A wrong or missing unscale is off by a factor of 2 or more.
    with torch.autocast("cpu", dtype=torch.float16):
        loss16, ref16 = _full_batch(bert, inputs, loss_fn=lambda *reps: info_nce(*reps) * 1024.0)
    ref16 = {n: g / 1024.0 for n, g in ref16.items()}
    _, noise16 = _reference_noise(bert, inputs, loss16 / 1024.0, ref16)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    GradCache(bert, info_nce, 2, autocast_dtype=torch.float16, scaler=scaler).step(*inputs)
    got = {n: g / scaler.get_scale() for n, g in _take_grads(bert).items()}
    _assert_grads_close(got, ref16, tol=low_precision_tol(noise16, torch.float16))


def test_gradcache_tensor_inputs_separate_models_uneven_chunks():
    torch.manual_seed(0)
    towers = [
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)) for _ in range(2)
    ]
    q, p = torch.randn(7, 8), torch.randn(7, 8)
    ref_loss = info_nce(towers[0](q), towers[1](p))
    ref_loss.backward()
    ref = _take_grads(*towers)
    _, noise = _reference_noise(towers, [q, p], ref_loss.detach(), ref, reference=_tensor_step)
    calls = [[], []]
    for tower, log in zip(towers, calls):
        tower.register_forward_hook(lambda module, args, out, log=log: log.append(torch.is_grad_enabled()))
    GradCache(towers, info_nce, 3).step(q, p)  # chunks of 3, 3, 1
    _assert_grads_close(_take_grads(*towers), ref, noise)
    # Pass 1 embeds every chunk; pass 2 re-embeds all but the last chunk of the last input, whose pass-1
    # graph is kept: 2 x 3 - 1 forwards for the positive tower, and exactly one with a graph per re-run.
    assert calls[0] == [False] * 3 + [True] * 3
    assert calls[1] == [False, False, True, True, True]


@pytest.mark.parametrize("sizes", [(4, 4), (2,), (6, 4)])
def test_gradcache_forward_count_is_two_per_chunk_minus_one(sizes):
    torch.manual_seed(0)
    tower = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    inputs = [torch.randn(n, 8) for n in sizes]

    def loss_fn(*reps):  # any scalar coupling all samples
        return torch.cat(reps).pow(2).sum().sqrt()

    ref_loss = loss_fn(*[tower(x) for x in inputs])
    ref_loss.backward()
    ref = _take_grads(tower)
    _, noise = _reference_noise(tower, inputs, ref_loss.detach(), ref, loss_fn, reference=_tensor_step)
    calls = []
    tower.register_forward_hook(lambda *_: calls.append(1))
    GradCache(tower, loss_fn, 2).step(*inputs)
    chunks = sum(-(-n // 2) for n in sizes)
    assert len(calls) == 2 * chunks - 1
    _assert_grads_close(_take_grads(tower), ref, noise)


def test_gradcache_loss_ignoring_an_input_leaves_its_tower_without_grad():
    torch.manual_seed(0)
    towers = [torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)]
    calls = []
    towers[1].register_forward_hook(lambda *_: calls.append(1))

    def queries_only(q, p):  # e.g. a regulariser step; a plain step leaves p's tower with .grad None
        return q.pow(2).sum()

    GradCache(towers, queries_only, 2).step(torch.randn(4, 8), torch.randn(4, 8))
    assert towers[0].weight.grad is not None
    assert towers[1].weight.grad is None, "an optimizer would decay/move a tower given zero gradients"
    assert len(calls) == 2, "pass 1 only: chunks whose embeddings get no gradient are not re-run"


def test_gradcache_needs_chunk_size_even_with_chunk_patches(qwen):
    with pytest.raises(ValueError, match="chunk_size must be a positive number of samples, got None"):
        GradCache(qwen, info_nce, None, chunk_patches=20)


def test_gradcache_clip_style_pixel_values_split_by_sample():
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=64, max_position_embeddings=16, **small))
    vision = CLIPVisionModel(CLIPVisionConfig(image_size=16, patch_size=8, **small))
    captions = _text(n=5, length=6)
    images = {"pixel_values": torch.randn(5, 3, 16, 16)}  # [B, C, H, W]: not Qwen-VL patch rows

    def pooled(output, inputs):
        return output.pooler_output

    def step(models, inputs, loss_fn):
        loss = loss_fn(*[pooled(m(**x), x) for m, x in zip(models, inputs)])
        loss.backward()
        return loss.detach(), _take_grads(*models)

    ref_loss, ref = step([text, vision], [captions, images], info_nce)
    _, noise = _reference_noise([text, vision], [captions, images], ref_loss, ref, reference=step)
    GradCache([text, vision], info_nce, 2, rep_fn=pooled).step(captions, images)  # chunks of 2, 2, 1
    _assert_grads_close(_take_grads(text, vision), ref, noise)


def test_default_rep_causal_lm_hidden_states_and_positional_inputs():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden = torch.randn(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    output = CausalLMOutputWithPast(logits=torch.randn(2, 3, 9), hidden_states=(torch.randn(2, 3, 4), hidden))
    # Last-token pooling indexes rows: exact.
    assert torch.equal(default_rep(output, {"attention_mask": mask}), hidden[[0, 1], [1, 2]])
    with pytest.raises(TypeError, match="output_hidden_states=True"):
        default_rep(CausalLMOutputWithPast(logits=torch.randn(2, 3, 9)), {"attention_mask": mask})
    with pytest.raises(TypeError, match="positional \\(tuple\\) inputs"):
        default_rep(hidden, (torch.ones(2, 3, dtype=torch.long), mask))


def test_gradcache_wrong_model_count_raises():
    towers = [torch.nn.Linear(4, 4) for _ in range(3)]
    with pytest.raises(ValueError, match="3 models but step\\(\\) got 2 inputs"):
        GradCache(towers, info_nce, 2).step(torch.randn(4, 4), torch.randn(4, 4))


def test_pool_left_and_right_padding_agree():
    bert = tiny_bert()
    right = _text()
    left = {
        k: torch.stack([torch.roll(v[i], int((1 - right["attention_mask"][i]).sum())) for i in range(6)])
        for k, v in right.items()
    }  # same tokens, padding moved to the left
    for mode in ("last", "mean", "cls"):
        # BERT's absolute positions shift with left padding, so compare pooling on the same token states.
        hidden = bert(**right).last_hidden_state
        shifted = torch.stack(
            [torch.roll(hidden[i], int((1 - right["attention_mask"][i]).sum()), 0) for i in range(6)]
        )
        got, expected = (
            pool(shifted, left["attention_mask"], mode),
            pool(hidden, right["attention_mask"], mode),
        )
        if mode != "mean":  # indexing a row: exact
            assert torch.equal(got, expected), mode
            continue
        # The mean sums the same terms with the padding zeros elsewhere (which may regroup a blocked sum):
        # two orders of L terms differ by summation_tol(L) of the sum of magnitudes, then one division each.
        mask = right["attention_mask"].unsqueeze(-1)
        count = mask.sum(1)
        tol = summation_tol(hidden.shape[1]) * (hidden.abs() * mask).sum(1) / count + eps() * expected.abs()
        assert ((got - expected).abs() <= tol).all(), mode
    lengths = right["attention_mask"].sum(1)
    assert torch.equal(pool(hidden, right["attention_mask"], "last"), hidden[torch.arange(6), lengths - 1])


def test_gradcache_trainer_step_matches_full_batch_sgd_update(tmp_path):
    from transformers import TrainingArguments

    queries, positives = _text(seed=3), _text(seed=4)
    rows = [
        {"query": {k: v[i] for k, v in queries.items()}, "positive": {k: v[i] for k, v in positives.items()}}
        for i in range(6)
    ]

    def collate(batch):
        return {
            side: {k: torch.stack([r[side][k] for r in batch]) for k in batch[0][side]}
            for side in ("query", "positive")
        }

    ref_model = tiny_bert()
    ref_loss, ref = _full_batch(ref_model, [queries, positives])
    _, noise = _reference_noise(ref_model, [queries, positives], ref_loss, ref)
    lr = 0.5
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=6,
        max_steps=1,
        optim="sgd",
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        report_to="none",
        remove_unused_columns=False,
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GradCacheTrainer(
        model=model, args=args, train_dataset=rows, eval_dataset=rows, data_collator=collate, chunk_size=2
    )
    trainer.train()
    # Batch order is shuffled, but the InfoNCE batch loss is invariant to permuting query/positive pairs
    # (another order of the sums over samples: reassociation).
    got = {f"0.{n}": (before[n] - p.detach()) / lr for n, p in model.named_parameters()}
    # Reading the gradient back from the update adds the update's roundings: p - lr * g rounds by eps / 2 of
    # |p - lr * g| and of |lr * g| (the difference before - p is then exact, the division by 0.5 too), so
    # up to eps / 2 * (|p| / lr + 2 |g|) per entry: relative to the gradient scale, added to the tolerance.
    scale = max(g.abs().max().item() for g in ref.values())
    update = max((eps() / 2 * (before[n[2:]].abs() / lr + 2 * ref[n].abs())).max().item() for n in ref)
    _assert_grads_close({n: got[n] for n in ref}, ref, noise, extra=update / scale)

    # Evaluation: the plain loss of each eval batch (one batch of 6 here), from the trained model: the same
    # forward as here, bit for bit. Trainer repeats each batch's loss per sample and averages the copies in
    # fp32: 6 terms, within summation_tol(6) of their sum, plus the division's rounding.
    with torch.no_grad():
        expected = info_nce(
            default_rep(model(**queries), queries), default_rep(model(**positives), positives)
        )
    metrics = trainer.evaluate()
    assert abs(metrics["eval_loss"] - expected.item()) <= (summation_tol(6) + eps()) * abs(expected.item())


def test_gradcache_trainer_requires_remove_unused_columns_false(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="remove_unused_columns=False"):
        GradCacheTrainer(model=tiny_bert(), args=args, chunk_size=2)


# -- world size 2: DDP, no_sync, cross-rank negatives ----------------------------------------------------


def _docs_first_info_nce(docs: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    return info_nce(queries, docs)


def _ddp_cross_rank_case(layouts: list[tuple[list[int], bool]], ref: dict[str, torch.Tensor]) -> list[dict]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    queries, docs = _queries(), _docs()
    results = []
    for sizes, docs_first in layouts:
        # Text-only query chunks leave the vision tower unused in some backwards: find_unused_parameters.
        # forward_sync_buffers=False: ranks with different chunk counts run different numbers of forwards.
        ddp = DistributedDataParallel(
            tiny_qwen3_vl(), find_unused_parameters=True, forward_sync_buffers=False
        )
        spec = VisionTokenSpec.from_config(ddp.module.config)
        # Rank r owns the r-th block of `sizes` samples of both inputs (rank-major global order).
        local = [
            split_inputs(x, sizes[0], vision_spec=spec)[rank] for x in (queries, docs)
        ]  # sizes[0] >= sizes[1]
        assert local[0]["input_ids"].shape[0] == sizes[rank]
        allreduces = []

        def hook(state, bucket, allreduces=allreduces):
            allreduces.append(bucket.index())
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, hook)
        if docs_first:  # the last chunk is then text-only: vision-tower grads come only from no_sync chunks
            loss = GradCache(ddp, _docs_first_info_nce, 2, cross_rank=True).step(local[1], local[0])
        else:
            loss = GradCache(ddp, info_nce, 2, cross_rank=True).step(*local)
        diff, scale = _max_diff(_take_grads(ddp.module), ref)
        results.append(
            dict(
                diff=diff,
                scale=scale,
                loss=loss.item(),
                allreduces=len(allreduces),
                buckets=len(set(allreduces)),
            )
        )
    return results


def test_gradcache_cross_rank_ddp_world_size_2_matches_single_process(rank_pool):
    reference, inputs = tiny_qwen3_vl(), [_queries(), _docs()]
    ref_loss, ref = _full_batch(reference, inputs)  # one process, the whole batch
    loss_noise, grad_noise = _reference_noise(reference, inputs, ref_loss, ref)
    # The ranks' chunk gradients are summed by DDP's all-reduce: one more order of the same sums, and one
    # rounding of the 2-term sum (eps / 2 of the result); the loss is the global batch's, gathered.
    grad_tol = reassociation_tol(grad_noise) + eps() / 2
    loss_tol = reassociation_tol(loss_noise)
    layouts = [([3, 3], False), ([4, 2], False), ([4, 2], True)]
    per_rank = rank_pool(2).run(_ddp_cross_rank_case, layouts, ref)
    for layout, r0, r1 in zip(layouts, *per_rank):
        print(
            f"layout {layout}: max |grad diff| / max |grad| rank0 {r0['diff'] / r0['scale']:.3e} rank1 "
            f"{r1['diff'] / r1['scale']:.3e} (tolerance {grad_tol:.3e})"
        )
        for r in (r0, r1):
            assert r["diff"] <= grad_tol * r["scale"]
            loss_error = abs(r["loss"] - ref_loss.item()) / abs(ref_loss.item())
            assert loss_error <= loss_tol, f"every rank returns the global-batch loss ({loss_error:.2e})"
            assert r["allreduces"] == r["buckets"], (
                "no_sync: one all-reduce per bucket per step, not per chunk"
            )


def _towers(seed: int = 0) -> list[torch.nn.Module]:
    """Two towers of the same shape (a dual encoder from one checkpoint): an all-reduce that pairs tower A
    on one rank with tower B on the other would run without error and sum the wrong gradients."""
    torch.manual_seed(seed)
    return [
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)) for _ in range(2)
    ]


def _tower_batches(sizes: list[int], inputs: int) -> list[list[torch.Tensor]]:
    """``batches[rank][k]``: rank ``r`` owns ``sizes[r]`` samples of each of ``inputs`` inputs."""
    gen = torch.Generator().manual_seed(5)
    full = [torch.randn(sum(sizes), 8, generator=gen) for _ in range(inputs)]
    return [[x.split(sizes)[r] for x in full] for r in range(len(sizes))]


def _ddp_towers_case(layouts: list[tuple[list[int], list[int]]]) -> list[tuple[float, float]]:
    """Separate DDP towers; ``models`` maps inputs to towers ([0, 1] = query/doc, [0, 1, 0] = negatives
    through the query tower). Ranks get different batch sizes, hence different chunk counts per model.
    Per layout: (relative gradient error, the one-process reference's gradient noise)."""
    from torch.nn.parallel import DistributedDataParallel

    rank, results = dist.get_rank(), []
    for sizes, tower_of_input in layouts:
        towers = [DistributedDataParallel(t) for t in _towers()]
        batches = _tower_batches(sizes, len(tower_of_input))
        models = [towers[i] for i in tower_of_input]
        GradCache(models, info_nce, 2, cross_rank=True).step(*batches[rank])
        got = _take_grads(*dict.fromkeys(m.module for m in models))  # _tensor_step's order: first use
        ref_towers = _towers()  # one process, the concatenated (rank-major) batch
        full = [torch.cat([b[k] for b in batches]) for k in range(len(tower_of_input))]
        ref_models = [ref_towers[i] for i in tower_of_input]
        ref_loss, ref = _tensor_step(ref_models, full)
        _, noise = _reference_noise(ref_models, full, ref_loss, ref, reference=_tensor_step)
        diff, scale = _max_diff(got, ref)
        results.append((diff / scale, noise))
    return results


def test_gradcache_ddp_separate_towers_uneven_chunk_counts_match_single_process(rank_pool):
    # Rank 0: 2 samples (1 chunk per input), rank 1: 4 (2 chunks): the last input's tower has only its kept
    # chunk on rank 0, so its all-reduce would come first there and last on rank 1 without a fixed order.
    layouts = [([2, 4], [0, 1]), ([4, 2], [0, 1]), ([2, 4], [0, 1, 0]), ([3, 4], [1, 0])]
    per_rank = rank_pool(2).run(_ddp_towers_case, layouts)
    for layout, (d0, noise), (d1, _) in zip(layouts, *per_rank):
        tol = reassociation_tol(noise) + eps() / 2  # + the 2-rank all-reduce's one rounding
        print(
            f"layout {layout}: max |grad diff| / max |grad| rank0 {d0:.2e} rank1 {d1:.2e} (tolerance {tol:.2e})"
        )
        assert max(d0, d1) <= tol
