"""The decoder families of issue 49 under sequence parallelism vs the unpatched stock models, gloo, fp32.

Cases (``decoder_family_cases.CASES``): Gemma 3 and Gemma 4 causal LMs (sliding and full layers; Gemma 4 with
per-layer embeddings, KV-sharing layers and its MoE block) with a window shorter than one shard and one longer than
two; the Gemma 3 VLM (two images, bidirectional image blocks in the masks the outer model builds) and its headless
``Gemma3Model``; the Gemma 4 VLM (two images of different sizes); Mistral (a window on every layer), Ministral and
Ministral 3 (its query scale by position); Mistral 3 with a Mistral and a Ministral 3 text model (two images of
different sizes); Qwen3-VL-MoE and GLM-4.5V with ``output_router_logits=True`` (the load-balancing loss); GLM-4.1V
and the headless ``Glm46VModel``; InternVL with a Qwen2 and a Qwen3 text model. Every family forward at worlds 2, 3
and 4 with Ulysses, Ring and Ulysses 2 x Ring 2 (a family's second cases, :data:`VARIANTS`, at world 2); every
parameter gradient at world 2 for every case and at worlds 3 and 4 for every family; ``sp_output="shard"`` at
world 2.

Packed samples (position ids that restart, no attention mask: transformers' packing), :data:`PACKED_CASES`, for
every family: three text samples in one row for Gemma 3, Gemma 4, Mistral, Ministral and Ministral 3; two
multimodal samples (two images each, of different sizes where the tower takes any) in one row for the Gemma 3 and
Gemma 4 VLMs, Mistral 3, InternVL, and, with ``[4, 1, S]`` position ids whose text row restarts, Qwen3-VL-MoE,
GLM-4.1V and GLM-4.5V (the MoE ones with their load-balancing loss). Forward at world 2 with Ulysses and Ring, at
world 3 with Ring and at world 4 with Ring and Ulysses 2 x Ring 2 (:data:`PACKED_SECOND`); every parameter
gradient at worlds 2 (Ring alone beyond the Gemma 3 and Ministral text cases, :data:`RING_GRADS`), 3 (Ring) and 4
(Ulysses 2 x Ring 2). Every stock model of transformers 5.24 packs: each
sample's logits in the packed row equal the sample run alone (fp64, checked here), so no family is recorded as
"packing not supported by the stock model".

Also: every refused class raises the same error on every rank; the load-balancing dispatcher and a Gemma VLM's
outer config are per patch and undone; the registry, transformers and the docs' table agree.

Tolerances: as ``test_decoder_usp.py``, every output and gradient within ``reassociation_tol`` of the unpatched
model's own fp32-vs-fp64 rounding, measured per case.
"""

from __future__ import annotations

from typing import Any

import decoder_gradients
import pytest
import torch
import torch.distributed as dist
from decoder_family_cases import CASES, build, objective, outputs, packed_samples

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.patches.decoder import sequence_order, shard_tokens
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64

ALL = list(CASES)
#: Second cases of a family (another layout, its headless base model, another text model inside a wrapper): at
#: world 2 only; every family runs at worlds 2, 3 and 4.
VARIANTS = ["gemma3_vlm_base", "mistral3_ministral3", "internvl_qwen3"]
#: Packed samples, one case per family (transformers' packing: position ids that restart, no attention mask).
PACKED_CASES = [case for case, (_, layout, _) in CASES.items() if layout.startswith("packed")]
#: Packed cases beside a family's other cases, under the time budget: forward with Ulysses and Ring at world 2, with
#: Ring at world 3 and with Ring and Ulysses 2 x Ring 2 at world 4.
PACKED_SECOND = PACKED_CASES
#: Of those, all but the Gemma 3 and Ministral text cases: gradients with Ring alone at world 2 (the time budget).
RING_GRADS = [case for case in PACKED_SECOND if case not in ("gemma3_packed", "ministral_packed")]
#: Backward at worlds 3 and 4: every family's unpacked case(s) (every case runs it at world 2; the packed ones also
#: run at worlds 3 and 4, see PACKED_SECOND).
BACKWARD_SUBSET = [case for case in ALL if case not in VARIANTS + PACKED_SECOND]


def _configs(world: int) -> list[tuple[int, int]]:
    return [(world, 1), (1, world)] + ([(2, 2)] if world == 4 else [])


# ----------------------------------------------------------------------------------------------- rank functions
def forward_cases(
    cases: list[tuple[str, int, int, str]],
) -> dict[tuple, dict[str, tuple[float, float, torch.Tensor]]]:
    """Per ``(case, ulysses, ring, sp_output)``: per output, (error vs unpatched, fp32 noise, patched value); with
    ``sp_output="shard"`` the logits are compared on this rank's real tokens."""
    results = {}
    refs = decoder_gradients.forward_references([case for case, *_ in cases], build, outputs)
    rank, world = dist.get_rank(), dist.get_world_size()
    for case, ulysses, ring, output in cases:
        model, kwargs = build(case)
        with torch.no_grad():
            ref, noise = refs[case]
            plan = ParallelConfig(ulysses=ulysses, ring=ring)
            with hfpatch.apply(model, parallel=plan, sp_output=output):
                got = outputs(model(**kwargs))
        found = {"names": sorted(got) == sorted(ref)}
        for name, value in got.items():
            expected = ref[name]
            if output == "shard" and name in ("logits", "last_hidden_state"):  # this rank's real tokens
                order = sequence_order("auto", ring)
                real = shard_tokens(
                    torch.ones(1, expected.shape[1], dtype=torch.bool), 1, world, rank, False, order
                )
                expected = shard_tokens(expected, 1, world, rank, order=order)[:, real[0]]
                value = value[:, real[0]]
            if value.shape == expected.shape and value.dtype == expected.dtype:
                found[name] = (rel_error(value, expected, ref[name].abs().max().item()), noise[name], value)
        results[(case, ulysses, ring, output)] = found
    return results


def backward_cases(cases: list[tuple[str, int, int, str]]) -> dict[tuple, dict[str, Any]]:
    """Per case: every parameter gradient's error (after the mean over the sp group) and the fp32 noise."""
    return decoder_gradients.backward_cases(cases, build, objective)


# ----------------------------------------------------------------------------------------------- tests
#: ``sp_output="shard"`` (the rank's logit shard, the loss over every rank's tokens) on a VLM whose masks are built
#: outside its decoder and a MoE VLM with its load-balancing term, in the zigzag order of Ring.
SHARD_CASES = ["gemma4_vlm", "qwen3_vl_moe"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_families_forward_matches_unpatched(rank_pool, world):
    names = ALL if world == 2 else [case for case in ALL if case not in VARIANTS]
    cases = [
        (case, u, r, "full")
        for case in names
        for u, r in _configs(world)
        if world == 2 or case not in PACKED_SECOND or u == 1 or (u, r) == (2, 2)
    ]
    if world == 2:
        cases += [(case, 1, 2, "shard") for case in SHARD_CASES]
    results = rank_pool(world).run(forward_cases, cases)
    for case in cases:
        for rank, found in enumerate(results):
            assert found[case].pop("names"), (rank, case)
            assert {"logits", "last_hidden_state"} & set(found[case]), (rank, case)
            for name, (error, noise, _) in found[case].items():
                assert error <= reassociation_tol(noise), (rank, case, name, error, noise)
        if case[3] == "full":  # every rank gathers the same shards: identical outputs
            for name in results[0][case]:
                values = [r[case][name][2] for r in results]
                assert all(torch.equal(values[0], v) for v in values[1:]), (case, name)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_families_backward_every_parameter_gradient_matches_unpatched(rank_pool, world):
    names = ALL if world == 2 else BACKWARD_SUBSET + PACKED_SECOND
    configs = [(world, 1), (1, world)] if world < 4 else [(2, 2)]
    # Packed cases: Ring alone at worlds 2 (beyond RING_GRADS' exceptions) and 3; Ulysses 2 x Ring 2 at world 4.
    ring_alone = RING_GRADS if world == 2 else PACKED_SECOND if world == 3 else []
    cases = [(case, u, r, "full") for case in names for u, r in configs if case not in ring_alone or u == 1]
    if world == 2:
        cases += [(case, 1, 2, "shard") for case in SHARD_CASES]
    for rank, found in enumerate(rank_pool(world).run(backward_cases, cases)):
        for case in cases:
            result = found[case]
            assert result["keys_match"] and result["n_params"] >= 20, (rank, case, result["n_params"])
            for name, error in result["errors"].items():
                assert error <= reassociation_tol(result["noise"]), (rank, case, name, error, result["noise"])


def test_stock_models_pack_each_case_is_separate_samples():
    """The packed cases test packing: in fp64, the unpatched model's logits of each sample in the packed row equal
    the sample run alone, and differ from attending across the samples (an all-ones attention mask turns
    transformers' packing detection off)."""
    for case in PACKED_CASES:
        model, kwargs = build(case)
        model, kwargs = to_fp64(model), to_fp64(kwargs)
        with torch.no_grad():
            packed = model(**kwargs).logits
            mixed = model(**kwargs, attention_mask=torch.ones_like(kwargs["input_ids"])).logits
            for span, alone in packed_samples(case):
                error = rel_error(packed[:, span], model(**to_fp64(alone)).logits)
                assert error < 1e-12, (case, span, error)
        assert rel_error(mixed, packed) > 1e-2, case


# ----------------------------------------------------------------------------------------------- refusals
def refusal_cases() -> dict[str, str]:
    """``apply`` on every refused model, and a sliding layer given the full mask: the error (type and text)."""
    from decoder_family_cases import REFUSED_MODELS, refused_model

    plan = ParallelConfig(ulysses=dist.get_world_size())
    messages = {}
    for name in REFUSED_MODELS:
        try:
            hfpatch.apply(refused_model(name), parallel=plan)
            messages[name] = "no error"
        except Exception as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
    # Gemma 3 whose layers all read the full-attention mask (layer_types changed after construction): its first
    # layer still attends within a window of 4, which the full mask does not keep.
    model, kwargs = build("gemma3_short")
    model.model.config.layer_types = ["full_attention"] * 2
    with hfpatch.apply(model, parallel=plan), torch.no_grad():
        try:
            model(**kwargs)
            messages["full_mask_to_sliding_layer"] = "no error"
        except RuntimeError as exc:
            messages["full_mask_to_sliding_layer"] = f"RuntimeError: {exc}"
    return messages


def test_refused_classes_raise_the_same_error_with_the_reason_on_every_rank(rank_pool):
    from hfpatch.patches.decoder import REFUSED

    results = rank_pool(2).run(refusal_cases)
    assert results[0] == results[1]
    m = results[0]
    for name, module in (
        ("qwen3_5", "qwen3_5"), ("qwen3_5_moe_vlm", "qwen3_5_moe"), ("qwen3_next", "qwen3_next"),
        ("llama4", "llama4"), ("llama4_vlm", "llama4"), ("gpt_oss", "gpt_oss"),
    ):  # fmt: skip
        cls = m[name].split(" (transformers.")[0].rsplit(" ", 1)[1]
        assert m[name] == (
            f"TypeError: hfpatch does not split {cls} (transformers.models.{module}.modeling_{module}) over ranks: "
            f"{REFUSED[f'transformers.{cls}']}."
        ), m[name]
        assert "What to do: run the model whole on each rank" in m[name]
    assert "linear_attention layers (Gated DeltaNet)" in m["qwen3_5"] and "upstream" in m["llama4_vlm"]
    assert "learned sinks" in m["gpt_oss"]
    assert m["internvl_gpt_oss"].startswith(
        "TypeError: hfpatch does not split InternVLForConditionalGeneration over ranks with its decoder "
        "InternVLForConditionalGeneration.model.language_model, a GptOssModel "
        "(transformers.models.gpt_oss.modeling_gpt_oss): its attention has learned sinks"
    ), m["internvl_gpt_oss"]
    assert (
        "inside InternVLForConditionalGeneration: Qwen2Model, Qwen3Model, LlamaModel" in m["internvl_gpt_oss"]
    )
    assert m["mistral3_llama"] == (
        "TypeError: hfpatch does not split Mistral3ForConditionalGeneration over ranks with its decoder "
        "Mistral3ForConditionalGeneration.model.language_model, a LlamaModel "
        "(transformers.models.llama.modeling_llama): not one of the decoders sequence parallelism supports inside "
        "it. Supported text models inside Mistral3ForConditionalGeneration: MistralModel, Ministral3Model, "
        "MinistralModel; or run the model whole on each rank (data parallel, no sequence split)."
    ), m["mistral3_llama"]
    assert (
        "a sliding-window layer (3 tokens) got a mask that lets a query see keys 3 tokens back"
        in (m["full_mask_to_sliding_layer"])
    )


# ----------------------------------------------------------------------------------------------- lifecycle
def lifecycle_cases() -> dict[str, Any]:
    """The load-balancing dispatcher is shared by two patched models, serves an unpatched twin the stock function,
    and leaves with the last patch (removed out of order); a Gemma VLM's outer config comes back by identity."""
    import sys

    world = dist.get_world_size()
    a, kwargs = build("qwen3_vl_moe")
    b, _ = build("qwen3_vl_moe")
    twin, _ = build("qwen3_vl_moe")
    module = sys.modules[type(a).__module__]
    stock = module.load_balancing_loss_func
    with torch.no_grad():
        before = outputs(twin(**kwargs))
        patch_a = hfpatch.apply(a, parallel=ParallelConfig(ring=world))
        patch_b = hfpatch.apply(b, parallel=ParallelConfig(ulysses=world))
        during = outputs(twin(**kwargs))
        installed = module.load_balancing_loss_func is not stock
        patch_a.remove()
        only_b = outputs(b(**kwargs))
        still_installed = module.load_balancing_loss_func is not stock
        patch_b.remove()
    gemma, gemma_kwargs = build("gemma3_vlm")
    outer, text = gemma.model.config, gemma.model.language_model.config
    with hfpatch.apply(gemma, parallel=world):
        routed = gemma.model.config is not outer and gemma.model.config.get_text_config() is not text
    return {
        "twin_unchanged": all(torch.equal(before[k], during[k]) for k in before),
        "installed": installed,
        "still_installed_for_b": still_installed,
        "b_aux_error": rel_error(only_b["aux_loss"], before["aux_loss"]),
        "stock_back": module.load_balancing_loss_func is stock,
        "gemma_routed": routed,
        "gemma_restored": gemma.model.config is outer and gemma.model.language_model.config is text,
    }


def test_aux_loss_dispatcher_and_outer_config_are_per_patch_and_removed(rank_pool):
    for result in rank_pool(2).run(lifecycle_cases):
        assert result.pop("b_aux_error") < 1e-5, result
        assert all(result.values()), result


# ----------------------------------------------------------------------------------------------- table
def test_registry_table_docs_and_transformers_agree():
    """Every class of the table exists in transformers and is registered for the decoder family alone; every
    refused class exists and is refused by the registry with its reason; the docs' table is the generated one."""
    from pathlib import Path

    import transformers

    from hfpatch.patches import DECODER_USP_CLASSES, default_registry
    from hfpatch.patches.decoder import REFUSED, TARGETS
    from hfpatch.patches.decoder.table import support_markdown

    assert {f"transformers.{name}" for name in DECODER_USP_CLASSES} == set(TARGETS)
    registry = default_registry()
    for key in TARGETS:
        cls = getattr(transformers, key.split(".", 1)[1])
        assert [f.name for f in registry.families_for_class(cls)] == ["decoder_usp"], key
    for key, reason in REFUSED.items():
        cls = getattr(transformers, key.split(".", 1)[1])
        assert registry.refusal_for_class(cls) == reason and not registry.families_for_class(cls), key
    assert not set(REFUSED) & set(TARGETS)
    page = (Path(__file__).parents[2] / "docs/capabilities/decoder-sequence-parallel.md").read_text()
    start, end = (
        "<!-- decoder-table: generated by hfpatch.patches.decoder.table.support_markdown -->",
        "<!-- /decoder-table -->",
    )
    assert page.split(start, 1)[1].split(end, 1)[0].strip() == support_markdown(), (
        "regenerate the docs' table"
    )


def test_every_tiny_row_resolves_its_decoder_and_tower_for_the_class_and_its_base_model():
    """The paths of both rows of a family (the class with a head and its base model) lead to the same decoder, and
    a split tower is a frame tower."""
    from hfpatch.core.registry import class_key
    from hfpatch.patches.decoder import decoder_of, vision_of
    from hfpatch.patches.decoder.table import FRAME_TOWERS
    from hfpatch.testing.decoders import TINY_DECODERS, tiny_decoder

    for name in TINY_DECODERS:
        model = tiny_decoder(name)
        decoder = decoder_of(model)[1]
        assert decoder is decoder_of(model.model)[1] and type(decoder).__name__.endswith("Model"), name
        assert hasattr(decoder, "layers") and hasattr(decoder, "rotary_emb"), name
        tower = vision_of(model)
        assert tower is vision_of(model.model), name
        assert tower is None or class_key(type(tower)) in FRAME_TOWERS, name
