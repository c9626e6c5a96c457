"""Plan-driven sequence parallelism (``hfpatch.patches.dit``) vs the unpatched stock models, gloo, fp32.

The same battery as ``test_dit_usp.py`` (its rank functions and tolerances: patched output and gradients
within ``reassociation_tol`` of the unpatched model's own fp32-vs-fp64 noise), over the classes whose plan
is diffusers' ``_cp_plan``, translated: QwenImage (joint attention, text replicated, with and without a
padded-prompt mask), Flux.2 (dual- and single-stream joint attention) and LTX-Video (self-attention, cross-
attention to a masked text; per-sample and per-token timesteps), and over the classes with a table plan:
ChronoEdit (Wan I2V layout: image keys in the cross-attention, temporal-skip rotary of 2 frames, 50 tokens),
Wan VACE (a control video embedded and cut like the latent, VACE blocks' self-attention routed) and
HunyuanVideo (text joined *behind* the video tokens in dual- and single-stream blocks, padded text masked per
sample). 25, 50 or 12 tokens: every world size of 2-4 leaves padding in some layout. On top: the sequence is really cut (each rank attends from its shard), the
mask really matters, two patched models and an unpatched one share a process (and ``torch.compile``) without
touching each other or diffusers' module globals, and bad inputs raise before any collective on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_dit_usp import (
    CONTROLNET,
    PLANNED,
    _configs,
    _same,
    _snapshot,
    backward_cases,
    build,
    check_backward,
    check_forward,
    forward_cases,
    lifecycle_cases,
)

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.attention.layout import shard_len
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64


# ----------------------------------------------------------------------------------------------- rank functions
def shard_cases(families: list[str]) -> dict[str, dict[str, Any]]:
    """What the stand-in processors saw in one patched forward (ring over the whole world)."""
    from hfpatch.patches.dit import USPDispatchProcessor

    world = dist.get_world_size()
    results = {}
    for family in families:
        model, kwargs, name = build(family)
        with torch.no_grad(), hfpatch.apply(model, parallel=ParallelConfig(ring=world)):
            model(**kwargs)
            stand_ins = [
                m.processor
                for m in model.modules()
                if isinstance(getattr(m, "processor", None), USPDispatchProcessor)
            ]
            state = stand_ins[0].state
            # packed [B, S, C], or a latent [B, C, H, W] / [B, C, F, H, W] (CogVideoX: [B, F, C, H, W]), 2x2
            # patches (HunyuanVideo 1.5: 1x1x1)
            x = kwargs[name]
            frames = 1 if x.dim() == 4 else x.shape[1 if family == "cogvideox" else 2]
            patch = 1 if family == "hunyuanvideo15" else 4
            results[family] = {
                "tokens": x.shape[1] if x.dim() == 3 else frames * x.shape[-2] * x.shape[-1] // patch,
                "valid_len": state.valid_len,
                "local_len": state.local_len,
                "calls": [p.calls for p in stand_ins],
            }
    return results


def coexistence_case(family: str) -> dict[str, Any]:
    """Two patched models (Ulysses, Ring) and an unpatched one, interleaved; the last two compiled.

    ``qwenimage_mask`` routes ``dispatch_attention_fn``; ``pixart`` routes ``F.scaled_dot_product_attention``
    in its ``attn1`` only, while its ``attn2`` (and the unpatched model) run the same stock
    ``AttnProcessor2_0`` code unrouted.
    """
    from diffusers.models import attention_processor
    from diffusers.models.transformers import transformer_qwenimage

    def watched() -> tuple[Any, ...]:  # what a global patch of diffusers or torch would change
        return (
            transformer_qwenimage.dispatch_attention_fn,
            attention_processor.F,
            torch.nn.functional.scaled_dot_product_attention,
        )

    world = dist.get_world_size()
    before = watched()
    models = [build(family)[0] for _ in range(3)]
    _, kwargs, _ = build(family)
    with torch.no_grad():
        refs = [m(**kwargs).sample for m in models]
        noise = rel_error(refs[0], to_fp64(models[0])(**to_fp64(kwargs)).sample)
        processor = next(m.processor for m in models[2].modules() if hasattr(m, "processor"))
        unpatched_call = type(processor).__call__
        a = hfpatch.apply(models[0], parallel=ParallelConfig(ulysses=world))
        b = hfpatch.apply(models[1], parallel=ParallelConfig(ring=world))
        # Compiled, a patched model and the unpatched one run the same stock code object (and a copy of it).
        compiled, compiled_stock = (torch.compile(m, backend="eager") for m in models[1:])
        outs = [models[0](**kwargs).sample, compiled(**kwargs).sample, compiled_stock(**kwargs).sample]
        outs.append(models[0](**kwargs).sample)  # again, after the others ran
        outs.append(compiled(**kwargs).sample)  # and the compiled patched one again (its cached frames)
        a.remove()
        b.remove()
        after = [m(**kwargs).sample for m in models]
    return {
        "errors": [rel_error(o, r) for o, r in zip(outs, refs + refs[:2])],
        "noise": noise,
        "unpatched_bitwise": torch.equal(outs[2], refs[2]),
        "removed_bitwise": [torch.equal(o, r) for o, r in zip(after, refs)],
        "globals_untouched": all(x is y for x, y in zip(watched(), before))
        and type(processor).__call__ is unpatched_call,
    }


def planned_error_cases() -> dict[str, str]:
    """Errors raised before any collective (the same message on every rank)."""
    from diffusers import UNet2DModel

    world = dist.get_world_size()
    messages: dict[str, str] = {}

    def expect(name: str, error: type[Exception], fn) -> None:
        try:
            fn()
        except error as exc:
            messages[name] = str(exc)
        else:
            messages[name] = "no error"

    unet = UNet2DModel(
        sample_size=8, in_channels=1, out_channels=1, block_out_channels=(4,), layers_per_block=1,
        down_block_types=("DownBlock2D",), up_block_types=("UpBlock2D",), norm_num_groups=2,
    )  # fmt: skip
    expect("unsupported", TypeError, lambda: hfpatch.apply(unet, parallel=world))

    qwen, _, _ = build("qwenimage")
    qwen.transformer_blocks[1].attn.processor = _Custom()
    before = _snapshot(qwen)
    expect("custom_processor", ValueError, lambda: hfpatch.apply(qwen, parallel=ParallelConfig(ring=world)))
    messages["untouched_after_error"] = str(_same(before, _snapshot(qwen)))

    flux2, kwargs, _ = build("flux2")
    with hfpatch.apply(flux2, parallel=ParallelConfig(ulysses=world)), torch.no_grad():
        expect(
            "kv_cache_mode", ValueError, lambda: flux2(**kwargs, kv_cache_mode="extract", num_ref_tokens=1)
        )
        messages["runs_after_refusal"] = str(tuple(flux2(**kwargs).sample.shape))

    ltx, _, _ = build("ltx")
    ltx._parallel_config = object()  # what diffusers' enable_parallelism() leaves
    expect("diffusers_cp", ValueError, lambda: hfpatch.apply(ltx, parallel=ParallelConfig(ring=world)))

    from hfpatch.testing import tiny_hunyuanvideo_transformer

    i2v = tiny_hunyuanvideo_transformer(image_condition_type="token_replace")
    expect("token_replace", ValueError, lambda: hfpatch.apply(i2v, parallel=ParallelConfig(ulysses=world)))

    ltx2, kwargs, _ = build("ltx2")
    ic_lora = {**kwargs, "video_self_attention_mask": torch.ones(2, 25, 25)}
    with hfpatch.apply(ltx2, parallel=ParallelConfig(ulysses=world)), torch.no_grad():
        expect("video_self_attention_mask", ValueError, lambda: ltx2(**ic_lora))

    vace, kwargs, _ = build("wan_vace")
    short = {
        **kwargs,
        "control_hidden_states": kwargs["control_hidden_states"][..., :8, :],
    }  # 20 of 25 tokens
    with hfpatch.apply(vace, parallel=ParallelConfig(ring=world)), torch.no_grad():
        expect("short_control", ValueError, lambda: vace(**short))
        messages["vace_runs_after_error"] = str(tuple(vace(**kwargs).sample.shape))
    return messages


class _Custom:
    """Stands for an IP-Adapter or user processor the USP patch must not silently replace."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("not called")


# ----------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 3, 4])
def test_planned_usp_forward_every_class_and_layout_matches_unpatched(rank_pool, world):
    cases = [(family, u, r) for family in PLANNED + CONTROLNET for u, r in _configs(world)]
    check_forward(rank_pool(world).run(forward_cases, cases), cases)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_planned_usp_backward_param_and_input_grads_after_sp_sum_match_unpatched(rank_pool, world):
    layouts = {2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2), (1, 4), (4, 1)]}[world]
    cases = [(family, u, r) for family in PLANNED for u, r in layouts]
    if world == 2:  # gradient checkpointing: blocks recomputed in backward re-cut the same shard
        cases += [
            ("qwenimage_mask_gc", 1, 2),
            ("flux2_gc", 2, 1),
            ("ltx_tokens_gc", 1, 2),
            ("hunyuanvideo_gc", 2, 1),
            ("ltx2_tokens_gc", 1, 2),  # split rope, gated attention, per-token timesteps
        ]
    check_backward(rank_pool(world).run(backward_cases, cases), cases)


def test_planned_usp_lifecycle_remove_restores_identity_double_apply_conflict(rank_pool):
    families = ["qwenimage", "flux2", "ltx", "chronoedit", "wan_vace", "hunyuanvideo", "hunyuandit", "pixart"]
    families += ["hunyuanvideo15", "ltx2", "minimax_h3"]
    results = rank_pool(2).run(lifecycle_cases, families)
    # LTX, ChronoEdit, HunyuanDiT, PixArt: attn1 only (attn2 attends to the text/image); Wan VACE: attn1 of 2
    # blocks + 2 VACE blocks; LTX-2: attn1 and video_to_audio_attn of 2 blocks.
    expected_swaps = {
        "qwenimage": 2, "flux2": 2, "ltx": 2, "chronoedit": 2, "wan_vace": 4, "hunyuanvideo": 2, "hunyuandit": 4,
        "pixart": 2, "hunyuanvideo15": 2, "ltx2": 4, "minimax_h3": 2,
    }  # fmt: skip
    for rank_result in results:
        for family, result in rank_result.items():
            assert result["identity"], family
            assert result["again_is_patch"], family
            assert result["conflict"] is not None and "already patched" in result["conflict"], family
            assert result["swapped"] == expected_swaps[family], (family, result["repr"])


def test_planned_usp_attends_from_each_rank_shard(rank_pool):
    families = [
        "qwenimage", "flux2", "ltx_tokens", "chronoedit", "wan_vace", "hunyuanvideo", "flux", "sd35", "cogvideox",
        "hunyuandit", "pixart", "hunyuanvideo15", "ltx2",
    ]  # fmt: skip
    for world in (3,):
        for rank_result in rank_pool(world).run(shard_cases, families):
            for family, seen in rank_result.items():
                assert seen["valid_len"] == seen["tokens"], (family, seen)
                assert seen["local_len"] == shard_len(seen["tokens"], world) < seen["tokens"], (family, seen)
                assert all(calls == 1 for calls in seen["calls"]), (family, seen)


@pytest.mark.parametrize(
    ("family", "mask"),
    [
        ("qwenimage_mask", "encoder_hidden_states_mask"),
        ("hunyuanvideo", "encoder_attention_mask"),
        ("hunyuanvideo15", "encoder_attention_mask"),
        ("hunyuanvideo15", "encoder_attention_mask_2"),
        ("hunyuandit", "text_embedding_mask_t5"),
        ("pixart", "encoder_attention_mask"),
    ],
)
def test_planned_usp_text_mask_changes_the_stock_output(family, mask):
    """The masked cases can fail: the mask moves the unpatched output by far more than any tolerance (and so
    do the ControlNet residuals)."""
    model, masked, _ = build(family)
    unmasked = {**masked, mask: torch.ones_like(masked[mask])}
    with torch.no_grad():
        assert rel_error(model(**masked).sample, model(**unmasked).sample) > 1e-3
        for controlled in CONTROLNET:
            model, kwargs, _ = build(controlled)
            plain = build(controlled.removesuffix("_cn"))[1]
            assert rel_error(model(**kwargs).sample, model(**plain).sample) > 1e-3, controlled


class _Branchy:
    """A stock-like processor with a path that attends without ``F.scaled_dot_product_attention``."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, use_sdpa: bool = False) -> torch.Tensor:
        if use_sdpa:
            return F.scaled_dot_product_attention(hidden_states, hidden_states, hidden_states)
        return hidden_states.softmax(-1)  # e.g. a hand-written kernel: local to the shard under USP


def test_planned_usp_sdpa_route_is_per_object_and_refuses_unrouted_attention():
    from hfpatch.patches.dit.processors import USPSDPAProcessor, usp_dispatch_processor

    stock = _Branchy()
    stand_in = usp_dispatch_processor(stock, state=None, joint=None, where="blocks.0.attn1")
    assert isinstance(stand_in, USPSDPAProcessor) and stand_in.stock is stock
    with pytest.raises(RuntimeError, match="attended without F.scaled_dot_product_attention"):
        stand_in(None, torch.ones(1, 1, 2, 4))
    # The routed copy has its own globals and code object; the stock function and this module are untouched.
    assert stand_in._call.__code__ is not _Branchy.__call__.__code__
    assert stand_in._call.__globals__ is not globals() and F is torch.nn.functional
    other = usp_dispatch_processor(_Branchy(), state=None, joint=None, where="blocks.1.attn1")
    assert other._call.__code__ is not stand_in._call.__code__  # per stand-in: no cache entry shared
    x = torch.randn(1, 1, 3, 4)
    assert torch.equal(stock(None, x, use_sdpa=True), F.scaled_dot_product_attention(x, x, x))
    with pytest.raises(ValueError, match="attends through neither"):
        usp_dispatch_processor(object(), state=None, joint=None, where="x")


@pytest.mark.parametrize("family", ["qwenimage_mask", "pixart"])
def test_planned_usp_two_patched_and_one_unpatched_model_share_a_process(rank_pool, family):
    for result in rank_pool(2).run(coexistence_case, family):
        assert result["globals_untouched"]
        assert result["unpatched_bitwise"]
        assert all(result["removed_bitwise"]), result["removed_bitwise"]
        tol = reassociation_tol(result["noise"])
        assert all(error <= tol for error in result["errors"]), (result["errors"], result["noise"])


def test_planned_usp_errors_raise_before_collectives_on_every_rank(rank_pool):
    results = rank_pool(2).run(planned_error_cases)
    assert results[0] == results[1]
    messages = results[0]
    # The built-in registry's dozens of classes are counted, not listed (`hfpatch info` lists them).
    unsupported = messages["unsupported"]
    assert unsupported.startswith(
        "hfpatch has no patch for UNet2DModel (diffusers.models.unets.unet_2d); supported classes: "
    ), unsupported
    assert "classes, listed by `hfpatch info`" in unsupported and len(unsupported) < 300, unsupported
    assert (
        "transformer_blocks.1.attn uses attention processor _Custom; sequence parallelism replaces only the stock "
        "QwenDoubleStreamAttnProcessor2_0" in messages["custom_processor"]
    ), messages["custom_processor"]
    assert messages["untouched_after_error"] == "True"
    assert "kv_cache_mode= is not supported under sequence parallelism" in messages["kv_cache_mode"]
    assert messages["runs_after_refusal"] == "(1, 25, 16)"
    assert "diffusers' own context parallelism" in messages["diffusers_cp"]
    assert (
        "HunyuanVideoTransformer3DModel with image_condition_type='token_replace' is not supported under sequence "
        "parallelism" in messages["token_replace"]
    ), messages["token_replace"]
    assert "got a sequence of 20 tokens but this forward already split 25" in messages["short_control"], (
        messages["short_control"]
    )
    assert messages["vace_runs_after_error"] == "(2, 4, 1, 10, 10)"
    assert (
        "video_self_attention_mask= is not supported under sequence parallelism"
        in (messages["video_self_attention_mask"])
    ), messages["video_self_attention_mask"]


def test_planned_usp_support_table_names_plan_source_per_class():
    from hfpatch.cli import info_lines
    from hfpatch.patches.dit.family import support_table

    rows = dict(support_table())
    assert rows["QwenImageTransformer2DModel"] == "dit_usp (plan: _cp_plan)"
    assert rows["LTXVideoTransformer3DModel"] == "dit_usp (plan: _cp_plan)"
    assert rows["WanTransformer3DModel"] == "dit_usp (plan: hfpatch table)"
    assert rows["FluxTransformer2DModel"] == "dit_usp (plan: _cp_plan)"
    for name in (
        "ChronoEditTransformer3DModel",
        "WanVACETransformer3DModel",
        "HunyuanVideoTransformer3DModel",
        "HunyuanVideo15Transformer3DModel",
        "SD3Transformer2DModel",
        "CogVideoXTransformer3DModel",
        "HunyuanDiT2DModel",
        "PixArtTransformer2DModel",
    ):
        assert rows[name] == "dit_usp (plan: hfpatch table)", (name, rows[name])
    assert rows["LTX2VideoTransformer3DModel"] == "dit_usp (plan: _cp_plan)"
    assert rows["MiniMaxH3Transformer3DModel"] == "dit_usp (plan: _cp_plan)"
    assert rows["HeliosTransformer3DModel"].startswith(
        "not supported (one forward attends over sequences of"
    ), rows["HeliosTransformer3DModel"]
    assert rows["SanaTransformer2DModel"].startswith("not supported (linear"), rows["SanaTransformer2DModel"]
    assert "  Flux2Transformer2DModel: dit_usp (plan: _cp_plan)" in info_lines(classes=True)


def test_planned_usp_token_mask_is_a_key_mask_plus_masked_query_rows_or_refused():
    """HunyuanVideo 1.5's query x key mask m[i] & m[j] is read as key mask m plus masked query rows."""
    from hfpatch.patches.dit.processors import _token_masks

    m = torch.tensor([[True, True, True, False], [True, True, True, True]])
    outer = (m[:, :, None] & m[:, None, :])[:, None]
    keys, queries = _token_masks(outer, 2, 4, 4, "here")
    assert torch.equal(keys, m) and torch.equal(queries, m)
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~outer, float("-inf"))
    keys, queries = _token_masks(additive, 2, 4, 4, "here")
    assert torch.equal(keys, m) and torch.equal(queries, m)
    keys, queries = _token_masks(torch.ones(1, 1, 4, 4, dtype=torch.bool), 2, 4, 4, "here")
    assert keys.all() and queries is None
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    with pytest.raises(ValueError, match="outer AND of one mask of tokens"):
        _token_masks(causal, 1, 4, 4, "here")
    with pytest.raises(ValueError, match="token mask"):
        _token_masks(torch.ones(1, 2, 4, 4, dtype=torch.bool), 1, 4, 4, "here")
