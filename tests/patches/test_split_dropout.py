"""Dropout inside a split VAE call (issue 51's rule for every split forward): the patch-parallel VAE splits its
rows over the ranks, so a training-mode dropout in the coder it runs (Allegro's temporal convolutions have
``p=0.1``) would draw per-shard masks; the call is refused on every rank alike, naming the modules, before any
collective. Eval mode runs, and a dropout in the OTHER coder (the encoder, for a
decode) does not refuse. The same for a sequence-parallel decoder with a peft LoRA of ``lora_dropout=0.05`` (the
usual VLM LoRA setting). The DiT/LoRA case is in ``test_dit_lora.py``."""

from __future__ import annotations

from typing import Any

import torch
from video_vae_cases import inputs, run

import hfpatch
from hfpatch.testing.models import tiny_model


def allegro_dropout_cases() -> dict[str, Any]:
    vae = tiny_model("allegro_vae")
    x, kwargs = inputs("AutoencoderKLAllegro", "decode")
    with torch.no_grad():
        reference = run(vae, "decode", x, kwargs)
    report: dict[str, Any] = {}
    with hfpatch.apply(vae, parallel=2):
        vae.decoder.train()
        try:
            run(vae, "decode", x, kwargs)
            report["decoder_train"] = None
        except ValueError as error:
            report["decoder_train"] = str(error)
        vae.decoder.eval()
        vae.encoder.train()  # the encoder's dropout does not draw in a decode
        with torch.no_grad():
            report["decode_shape"] = (tuple(run(vae, "decode", x, kwargs).shape), tuple(reference.shape))
    return report


def test_training_mode_dropout_in_a_split_vae_coder_is_refused_by_name(rank_pool):
    reports = rank_pool(2).run(allegro_dropout_cases)
    said = reports[0]["decoder_train"]
    assert said is not None and all(r["decoder_train"] == said for r in reports), reports
    assert "dropout inside its split decode" in said and "(Dropout, p=0.1)" in said, said
    # Eval mode (and the encoder's dropout) does not refuse; the split decode's values are test_video_vaes.py's.
    assert all(got == want for r in reports for got, want in [r["decode_shape"]]), reports


def decoder_dropout_cases() -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    from hfpatch.testing import tiny_qwen3_causal_lm

    model = tiny_qwen3_causal_lm()
    ids = torch.randint(0, model.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(0))
    hfpatch.apply(model, parallel=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # LoRA A is drawn from the global RNG
        peft_model = get_peft_model(
            model, LoraConfig(r=2, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
        )
    report: dict[str, Any] = {}
    try:
        peft_model.train()(input_ids=ids)
        report["train"] = None
    except ValueError as error:
        report["train"] = str(error)
    with torch.no_grad():
        report["eval"] = tuple(peft_model.eval()(input_ids=ids).logits.shape)
    hfpatch.get_patch(model).remove()
    return report


def test_lora_dropout_in_a_sequence_parallel_decoder_is_refused_by_name(rank_pool):
    reports = rank_pool(2).run(decoder_dropout_cases)
    said = reports[0]["train"]
    assert said is not None and all(r["train"] == said for r in reports), reports
    assert (
        ".q_proj.lora_dropout.default (Dropout, p=0.05)" in said and "LoraConfig(lora_dropout=0.0)" in said
    ), said
    assert all(r["eval"] == reports[0]["eval"] for r in reports), reports
