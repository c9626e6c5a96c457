"""Sequence-parallel transformers decoders (``hfpatch.patches.decoder``) vs the unpatched stock models, gloo, fp32.

Cases (``decoder_cases.CASES``): Qwen3 and Llama causal LMs with left padding, right padding and packed samples
(position ids that restart, no attention mask); Qwen3-VL, Qwen2.5-VL and Qwen2-VL ``ForConditionalGeneration``
on a batch with two images of different sizes in one sample, a video and a text-only row (left and right
padding), Qwen3-VL with two multimodal samples packed in one row (``[4, B, S]`` position ids), and the
headless ``Qwen3VLModel``. At worlds 2, 3 and 4 with Ulysses, Ring and Ulysses 2 x Ring 2; 4 query heads and
2 key/value heads (GQA), so Ulysses 3 splits the heads unevenly and Ulysses 4 repeats key/value heads.

Tolerances: the patch changes only the order of floating-point sums (tiles and ring steps merged by their
log-sum-exp, gradients averaged over the group), so every output and gradient must be within
``reassociation_tol`` of the unpatched model's own fp32-vs-fp64 rounding, measured per case.
"""

from __future__ import annotations

from typing import Any

import decoder_gradients
import pytest
import torch
import torch.distributed as dist
from decoder_cases import CASES, build, objective, outputs
from decoder_gradients import gradient_reference

import hfpatch
from hfpatch import ParallelConfig, all_reduce_gradients
from hfpatch.distributed.agreement import InputMismatchError
from hfpatch.patches.decoder import sequence_order, shard_tokens
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64

ALL = [case for case in CASES if not case.endswith("_checkpointing")]
#: Backward at worlds 3 and 4: one text and the three VL families (all of them run at world 2).
BACKWARD_SUBSET = [
    "qwen3_vl_frames",
    "qwen2_5_vl_frames",
    "qwen3_left",
    "llama_packed",
    "qwen3_vl_left",
    "qwen3_vl_packed",
    "qwen2_5_vl_left",
    "qwen2_vl_right",
]


def _configs(world: int) -> list[tuple[int, int]]:
    return [(world, 1), (1, world)] + ([(2, 2)] if world == 4 else [])


# ----------------------------------------------------------------------------------------------- rank functions
def forward_cases(
    cases: list[tuple[str, int, int, str]],
) -> dict[tuple, dict[str, tuple[float, float, torch.Tensor]]]:
    """Per ``(case, ulysses, ring, sp_output)``: per output, (error vs unpatched, fp32 noise, patched value)."""
    results: dict[tuple, dict[str, tuple[float, float, torch.Tensor]]] = {}
    refs = decoder_gradients.forward_references([case for case, *_ in cases], build, outputs)
    rank, world = dist.get_rank(), dist.get_world_size()
    for case, ulysses, ring, output in cases:
        model, kwargs = build(case)
        with torch.no_grad():
            ref, noise = refs[case]
            vision = output.endswith("+replicate")
            options = dict(sp_output=output.removesuffix("+replicate"))
            if vision:
                options["sp_vision"] = "replicate"
            with hfpatch.apply(model, parallel=ParallelConfig(ulysses=ulysses, ring=ring), **options):
                got = outputs(model(**kwargs))
        found = {}
        for name, value in got.items():
            expected = ref[name]
            if output.startswith("shard") and name != "loss":  # this rank's shard, padding dropped
                order = sequence_order("auto", ring)  # zigzag under Ring
                expected = shard_tokens(expected, 1, world, rank, order=order)
                real = shard_tokens(
                    torch.ones(1, ref[name].shape[1], dtype=torch.bool), 1, world, rank, False, order
                )
                value, expected = value[:, real[0]], expected[:, real[0]]
            assert value.shape == expected.shape and value.dtype == expected.dtype, (case, name, value.shape)
            found[name] = (rel_error(value, expected, ref[name].abs().max().item()), noise[name], value)
        results[(case, ulysses, ring, output)] = found
    return results


def backward_cases(cases: list[tuple[str, int, int, str]]) -> dict[tuple, dict[str, Any]]:
    """Per case: every parameter gradient's error (after the mean over the sp group) and the fp32 noise."""
    return decoder_gradients.backward_cases(cases, build, objective)


# ----------------------------------------------------------------------------------------------- tests
def _check_forward(results: list[dict], cases: list[tuple]) -> None:
    for case in cases:
        for rank, rank_result in enumerate(results):
            for name, (error, noise, _) in rank_result[case].items():
                assert error <= reassociation_tol(noise), (rank, case, name, error, noise)
        if case[3].startswith("full"):  # every rank gathers the same shards: identical outputs
            for name in results[0][case]:
                values = [r[case][name][2] for r in results]
                assert all(torch.equal(values[0], v) for v in values[1:]), (case, name)


def _check_backward(results: list[dict], cases: list[tuple]) -> None:
    for rank, rank_result in enumerate(results):
        for case in cases:
            result = rank_result[case]
            assert result["keys_match"] and result["n_params"] >= 20, (rank, case, result["n_params"])
            for name, error in result["errors"].items():
                assert error <= reassociation_tol(result["noise"]), (rank, case, name, error, result["noise"])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_decoder_forward_every_case_and_layout_matches_unpatched(rank_pool, world):
    cases = [(case, u, r, "full") for case in ALL for u, r in _configs(world)]
    cases += [(case, world, 1, "shard") for case in ("qwen3_extras", "qwen3_vl_right", "qwen3_vl_base")]
    cases += [(case, 1, world, "shard") for case in ("qwen3_extras", "qwen3_vl_right")]  # the zigzag order
    cases += [
        ("qwen3_vl_frames", 1, world, "full+replicate"),
        ("qwen2_5_vl_frames", world, 1, "full+replicate"),
    ]
    _check_forward(rank_pool(world).run(forward_cases, cases), cases)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_decoder_backward_every_parameter_gradient_matches_unpatched(rank_pool, world):
    names = ALL if world == 2 else BACKWARD_SUBSET
    configs = _configs(world) if world < 4 else [(2, 2), (1, 4)]
    cases = [(case, u, r, "full") for case in names for u, r in configs]
    cases += [(case, 1, world, "shard") for case in ("qwen3_packed", "qwen3_vl_left")]
    if (
        world == 2
    ):  # gradient checkpointing: every layer (and its attention's collectives) recomputed in backward
        cases += [("qwen3_vl_checkpointing", 2, 1, "full"), ("qwen3_checkpointing", 1, 2, "shard")]
    _check_backward(rank_pool(world).run(backward_cases, cases), cases)


# ----------------------------------------------------------------------------------------------- lifecycle
def _snapshot(model: torch.nn.Module) -> list[tuple[Any, dict[str, Any], dict[str, tuple]]]:
    """vars() of every submodule, plus the contents of every hook dict (same objects)."""
    return [
        (m, dict(vars(m)), {k: tuple(v.items()) for k, v in vars(m).items() if k.startswith("_forward")})
        for m in model.modules()
    ]


def _same(before: list, after: list) -> bool:
    return len(before) == len(after) and all(
        b[0] is a[0] and b[1].keys() == a[1].keys() and all(b[1][k] is a[1][k] for k in b[1]) and b[2] == a[2]
        for b, a in zip(before, after)
    )


def lifecycle_cases() -> dict[str, Any]:
    """remove() restores identity; a twin built from the SAME config object runs unpatched meanwhile; double
    apply returns the live patch; a different plan raises; the interface names are gone after remove()."""
    from transformers import Qwen3ForCausalLM
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from hfpatch.testing import tiny_qwen3_causal_lm

    world = dist.get_world_size()
    model = tiny_qwen3_causal_lm()
    twin = Qwen3ForCausalLM(model.config)  # shares model.config (and its decoder's config object)
    twin.load_state_dict(model.state_dict())
    shared = twin.model.config is model.model.config
    kwargs = build("qwen3_left")[1]
    with torch.no_grad():
        twin_before = twin(**kwargs).logits
    names_before = set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)
    before = _snapshot(model)
    config = ParallelConfig(ulysses=world)
    patch = hfpatch.apply(model, parallel=config)
    again = hfpatch.apply(model, parallel=config)
    try:
        hfpatch.apply(model, parallel=ParallelConfig(ring=world))
        conflict = None
    except ValueError as exc:
        conflict = str(exc)
    with torch.no_grad():
        model(**kwargs)
        twin_during = twin(**kwargs).logits  # same class, same config object: not routed
    registered = set(AttentionInterface._global_mapping) - names_before[0]
    text = patch.describe()
    patch.remove()
    with torch.no_grad():
        restored = model(**kwargs).logits
    return {
        "shared_config": shared,
        "twin_untouched": torch.equal(twin_before, twin_during),
        "twin_implementation": twin.model.config._attn_implementation,
        "registered": sorted(registered),
        "identity": _same(before, _snapshot(model)),
        "unregistered": (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping))
        == names_before,
        "restored_equals_twin": torch.equal(restored, twin_before),
        "again_is_patch": again is patch,
        "conflict": conflict,
        "repr": text,
    }


def error_cases() -> dict[str, str]:
    """Bad calls and inputs: the same clear error on every rank, before any collective."""
    from transformers import BertConfig, BertModel, DynamicCache

    from hfpatch.testing import tiny_qwen3_causal_lm

    world = dist.get_world_size()
    config = ParallelConfig(ulysses=world)
    messages: dict[str, str] = {}

    def expect(name: str, fn) -> None:
        try:
            fn()
        except Exception as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
        else:
            messages[name] = "no error"

    bert = BertModel(
        BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    )
    expect("unsupported", lambda: hfpatch.apply(bert, parallel=config))
    expect("bad_output", lambda: hfpatch.apply(tiny_qwen3_causal_lm(), parallel=config, sp_output="gathered"))
    # Sliding windows are supported (issue 49); a layer type the split does not carry is refused by name.
    expect("layer_type", lambda: hfpatch.apply(tiny_qwen3_causal_lm(layer_types=["full_attention", "chunked_attention"]),
                                               parallel=config))  # fmt: skip
    one_head = tiny_qwen3_causal_lm(num_attention_heads=1, num_key_value_heads=1, head_dim=32)
    expect("heads", lambda: hfpatch.apply(one_head, parallel=config))
    model = tiny_qwen3_causal_lm()
    ids = build("qwen3_left")[1]["input_ids"]
    with hfpatch.apply(model, parallel=config):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            with hfpatch.get_patch(model).disabled():
                model(input_ids=ids[:, :4], cache=cache, use_cache=True)
            expect("decode_with_cache", lambda: model(input_ids=ids[:, 4:5], cache=cache, use_cache=True))
            expect("output_attentions", lambda: model(input_ids=ids, output_attentions=True))
            mask4d = torch.ones(2, 1, ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
            expect("mask_4d", lambda: model(input_ids=ids, attention_mask=mask4d))
            # A different sample on the last rank: the same InputMismatchError everywhere, then a good call works.
            odd = ids.clone()
            if dist.get_rank() == world - 1:
                odd[0, -1] += 1
            try:
                model(input_ids=odd)
                messages["mismatch"] = "no error"
            except InputMismatchError as exc:
                messages["mismatch"] = f"InputMismatchError: {exc}"
            messages["after_mismatch"] = str(tuple(model(input_ids=ids).logits.shape))
        model.set_attn_implementation("eager")
        expect("implementation_changed", lambda: model(input_ids=ids))
    model = tiny_qwen3_causal_lm(attention_dropout=0.1).train()
    with hfpatch.apply(model, parallel=config):
        expect("dropout", lambda: model(input_ids=ids))
    return messages


def packing_matters() -> dict[str, float]:
    """The packed cases test something: the unpatched model's packed logits differ from attending across
    the packed samples (an all-ones attention mask turns transformers' packing detection off)."""
    found = {}
    for case in ("qwen3_packed", "qwen3_vl_packed"):
        model, kwargs = build(case)
        with torch.no_grad():
            packed = model(**kwargs).logits
            mixed = model(**kwargs, attention_mask=torch.ones_like(kwargs["input_ids"])).logits
        found[case] = rel_error(mixed, packed)
    return found


def test_decoder_lifecycle_remove_restores_identity_and_twin_stays_unpatched(rank_pool):
    for result in rank_pool(2).run(lifecycle_cases):
        assert result["shared_config"]  # the twin really shares the config object the patch must not touch
        assert result["twin_untouched"] and result["twin_implementation"] == "sdpa"
        assert len(result["registered"]) == 1 and result["registered"][0].startswith("hfpatch_sp_")
        assert result["identity"] and result["unregistered"] and result["restored_equals_twin"]
        assert result["again_is_patch"]
        assert result["conflict"] is not None and "already patched" in result["conflict"]
        assert "Qwen3Model.config" in result["repr"] or "config" in result["repr"], result["repr"]


def test_decoder_errors_are_clear_and_identical_on_every_rank(rank_pool):
    results = rank_pool(2).run(error_cases)
    assert results[0] == results[1]
    m = results[0]
    assert m["unsupported"].startswith("TypeError") and "BertModel" in m["unsupported"]
    assert "sp_output must be one of" in m["bad_output"]
    assert (
        "['chunked_attention'] layers" in m["layer_type"]
        and "(full_attention, sliding_attention)" in m["layer_type"]
    )
    assert "ulysses=2 exceeds the 1 attention heads" in m["heads"]
    assert "KV cache holding 4 tokens" in m["decode_with_cache"]
    assert "output_attentions=True" in m["output_attentions"]
    assert "not a prepared 4D mask" in m["mask_4d"]
    assert m["mismatch"].startswith("InputMismatchError") and "input_ids" in m["mismatch"]
    assert m["after_mismatch"] == "(2, 11, 128)"
    assert "changed after hfpatch.apply" in m["implementation_changed"]
    assert "attention dropout (0.1)" in m["dropout"]


def test_decoder_packed_cases_depend_on_the_packing_mask():
    for case, difference in packing_matters().items():
        assert difference > 1e-2, (case, difference)


def fsdp2_case(case: str) -> dict[str, Any]:
    """The decoder layers and the model under FSDP2 (``fully_shard`` over every rank) on top of the patch: the
    reduce-scatter's mean is the unpatched gradient (hfpatch's convention), no hfpatch line after backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, kwargs = build(case)
    model.train()
    ref, scales, noise = gradient_reference(model, kwargs, build(case)[1], objective)
    hfpatch.apply(model, parallel=dist.get_world_size())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    objective(model(**kwargs)).backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "keys_match": got.keys() == ref.keys(),
        "errors": {n: rel_error(got[n], ref[n], scales[n]) for n in ref},
        "noise": noise,
    }


def test_decoder_under_fsdp2_reduce_scatter_gives_unpatched_gradients(rank_pool):
    for rank, result in enumerate(rank_pool(2).run(fsdp2_case, "qwen3_vl_left")):
        assert result["keys_match"], rank
        for name, error in result["errors"].items():
            assert error <= reassociation_tol(result["noise"]), (rank, name, error, result["noise"])


def vision_split_rows(case: str) -> dict[str, Any]:
    """Patch rows each rank's vision tower encodes, with ``sp_vision="split"`` (default) and ``"replicate"``."""
    from hfpatch.patches.decoder import vision_of

    rows: dict[str, int] = {}
    for mode in ("split", "replicate"):
        model, kwargs = build(case)
        seen = []
        vision = vision_of(model)
        handle = vision.patch_embed.register_forward_hook(
            lambda m, a, o, seen=seen: seen.append(a[0].shape[0])
        )
        with torch.no_grad(), hfpatch.apply(model, parallel=dist.get_world_size(), sp_vision=mode):
            out = model(**kwargs)
        handle.remove()
        rows[mode] = sum(seen)
        rows[f"{mode}_image_states"] = out.image_outputs.last_hidden_state is None
    rows["total"] = int(kwargs["pixel_values"].shape[0] + kwargs["pixel_values_videos"].shape[0])
    return rows


@pytest.mark.parametrize("world", [2, 4])
def test_decoder_vision_split_encodes_a_share_of_the_frames_on_each_rank(rank_pool, world):
    results = rank_pool(world).run(vision_split_rows, "qwen3_vl_frames")
    assert sum(r["split"] for r in results) == results[0]["total"]  # every patch encoded once, somewhere
    assert max(r["split"] for r in results) <= 2 * results[0]["total"] / world  # each rank a share
    assert all(r["replicate"] == r["total"] for r in results)
    assert all(r["split_image_states"] and not r["replicate_image_states"] for r in results)


def lora_cases(case: str) -> dict[str, Any]:
    """peft LoRA on the language model's attention, added before or after ``apply``: the LoRA gradients (after
    the mean over the group) equal the unpatched model's."""
    from peft import LoraConfig, get_peft_model

    def lora_model(order: str | None, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict]:
        model, kwargs = build(case)
        model = model.to(dtype)
        if order == "before":
            hfpatch.apply(model, parallel=dist.get_world_size())
        torch.manual_seed(0)  # LoRA A is drawn from the global RNG
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
        )
        peft_model = get_peft_model(model, config)
        if order == "after":
            hfpatch.apply(model, parallel=dist.get_world_size())
        with torch.no_grad():  # LoRA B starts at zero: make the adapters matter
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        return peft_model.train(), to_fp64(kwargs) if dtype == torch.float64 else kwargs

    def lora_grads(order: str | None, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        model, kwargs = lora_model(order, dtype)
        objective(model(**kwargs)).backward()
        trained = [p for p in model.parameters() if p.requires_grad]
        if order is not None:
            all_reduce_gradients(trained, dist.group.WORLD)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref, ref64 = lora_grads(None), lora_grads(None, torch.float64)
    floor = 0.01 * max(g.abs().max().item() for g in ref64.values())
    scales = {n: max(g.abs().max().item(), floor) for n, g in ref64.items()}
    noise = max(rel_error(ref[n], ref64[n], scales[n]) for n in ref)
    results = {"noise": noise, "n_lora": len(ref)}
    for order in ("before", "after"):
        got = lora_grads(order)
        results[order] = (
            max(rel_error(got[n], ref[n], scales[n]) for n in ref) if got.keys() == ref.keys() else 1.0
        )
    return results


def test_decoder_with_peft_lora_added_before_or_after_apply(rank_pool):
    for rank, result in enumerate(rank_pool(2).run(lora_cases, "qwen3_vl_left")):
        assert result["n_lora"] == 16, result
        for order in ("before", "after"):
            assert result[order] <= reassociation_tol(result["noise"]), (rank, order, result)


def custom_loss_cases(case: str) -> dict[str, Any]:
    """``sp_output="shard"`` without labels and a loss of one's own on the logit shard, summed over the group
    with ``sequence_sum``: equal to the same loss on the unpatched logits, and so are the gradients."""
    from hfpatch.patches.decoder import output_shard, sequence_sum

    def loss_of(logits: torch.Tensor, labels: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        nll = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
            labels.flatten(),
            reduction="none",
        )
        return (nll * (labels.flatten() != -100)).sum() / count

    def unpatched(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict]:
        loss = loss_of(model(**kwargs).logits, shifted, count)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model, kwargs = build(case)
    shifted = torch.nn.functional.pad(kwargs.pop("labels"), (0, 1), value=-100)[:, 1:]
    count = (shifted != -100).sum()
    model.train()
    ref_loss, ref = unpatched(model, kwargs)
    ref64_loss, ref64 = unpatched(to_fp64(model), to_fp64(kwargs))
    scale = max(g.abs().max().item() for g in ref64.values())
    results = {}
    world = dist.get_world_size()
    for plan in (ParallelConfig(ulysses=world), ParallelConfig(ring=world)):  # contiguous, then zigzag order
        model.zero_grad(set_to_none=True)
        with hfpatch.apply(model, parallel=plan, sp_output="shard") as patch:
            local = output_shard(patch, shifted, fill=-100)
            loss = sequence_sum(loss_of(model(**kwargs).logits, local, count), patch)
            loss.backward()
            all_reduce_gradients(model)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[f"loss {plan}"] = (rel_error(loss, ref_loss), rel_error(ref_loss, ref64_loss))
        results[f"grads {plan}"] = (
            max(rel_error(grads[n], ref[n], scale) for n in ref),
            max(rel_error(ref[n], ref64[n], scale) for n in ref),
        )
    return results


def test_decoder_shard_output_with_a_custom_loss_and_sequence_sum(rank_pool):
    for result in rank_pool(3).run(custom_loss_cases, "qwen3_left"):
        for error, noise in result.values():
            assert error <= reassociation_tol(noise), result


def failing_rank_case(timeout_s: float) -> dict[str, Any]:
    """Rank 1 raises inside the second decoder layer (after the first layer's collectives): rank 0, waiting in
    that layer's attention, must raise hfpatch's ``CollectiveError`` within the timeout, not hang."""
    import os
    import time

    from hfpatch.distributed.runtime import CollectiveError

    os.environ["HFPATCH_TIMEOUT_S"] = str(timeout_s)  # the groups this apply creates carry it
    model, kwargs = build("qwen3_left")
    hfpatch.apply(model, parallel=ParallelConfig(ulysses=2))
    if dist.get_rank() == 1:

        def fail(*_):
            raise RuntimeError("injected failure")

        model.model.layers[1].register_forward_pre_hook(fail)
    start = time.monotonic()
    try:
        with torch.no_grad():
            model(**kwargs)
    except CollectiveError as exc:
        return {"error": "CollectiveError", "seconds": time.monotonic() - start, "message": str(exc)}
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None}


FAILING_RANK_TIMEOUT_S = 5.0


def _failing_rank_run() -> list[dict]:
    from hfpatch.testing import RankPool

    with RankPool(2, timeout_s=120) as pool:  # its own ranks: the failure leaves their groups unusable
        return pool.run(failing_rank_case, FAILING_RANK_TIMEOUT_S)


@pytest.fixture(scope="module", autouse=True)
def failing_rank(background):
    """The failing-rank run (mostly waiting out its 5 s timeout), started with the module."""
    return background(
        "test_decoder_a_failing_rank_makes_the_other_raise_within_the_timeout", _failing_rank_run
    )


def test_decoder_a_failing_rank_makes_the_other_raise_within_the_timeout(failing_rank):
    timeout_s, margin_s = FAILING_RANK_TIMEOUT_S, 15.0
    waiting, failed = failing_rank.result()
    assert failed["error"] == "injected failure"
    assert waiting["error"] == "CollectiveError", waiting
    assert 0.5 * timeout_s <= waiting["seconds"] <= timeout_s + margin_s, waiting
