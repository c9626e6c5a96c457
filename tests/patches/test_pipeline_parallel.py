"""CFG parallel and data parallel of ``hfpatch.patches.pipeline`` on tiny stock pipelines, gloo ranks, fp32.

The pipeline family is tested alone through a registry that holds only it (the transformer and VAE
families have their own tests), so these results isolate the batch/CFG splitting.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from pipe_helpers import restored, snapshot

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.core.registry import PatchFamily, Registry
from hfpatch.distributed.collectives import count_comm
from hfpatch.patches.pipeline import PipelineParallel
from hfpatch.testing import tiny_flux_pipe, tiny_sd3_pipe, tiny_wan_pipe, wan_prompt_embeds
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

# Two-call CFG runs the same kernels on the same shapes as the unpatched pipe: bit-exact (EXACT). Splitting
# a batch or a sequence changes GEMM shapes and reduction orders: those cases must stay within
# ``reassociation_tol`` of the unpatched fp32 pipeline's own rounding noise against an fp64 copy of it (the
# tiny random SD3 transformer, without qk-norm, amplifies rounding ~50x more than Wan: one fixed tolerance
# would either fail on SD3 or hide a bug in Wan).
EXACT = ("wan_cfg", "wan_cfg_no_guidance", "wan22_cfg", "wan_cfg_nested_forward")


class _Notes(logging.Handler):
    """Collects the messages logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _registry() -> Registry:
    registry = Registry()
    registry.register("diffusers.DiffusionPipeline", PipelineParallel)
    return registry


class _ForwardWrapper(PatchFamily):
    """A component family that wraps ``transformer.forward`` (as the streaming patch does): it appends to
    ``calls`` (set by :func:`_registry_with_forward_wrapper`) so the test sees that it ran."""

    name = "test_forward_wrapper"
    options: dict[str, Any] = {}
    role = "transformer"
    calls: list[int]

    def apply(self, target: Any, patch: Any, mesh: Any, options: dict[str, Any]) -> None:
        def wrapper(original: Any) -> Any:
            def forward(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(1)
                return original(*args, **kwargs)

            return forward

        patch.wrap_method(target, "forward", wrapper)


def _registry_with_forward_wrapper(calls: list[int]) -> Registry:
    registry = _registry()
    registry.register(
        "diffusers.WanTransformer3DModel", type("_CountingWrapper", (_ForwardWrapper,), {"calls": calls})
    )
    return registry


def _wan(
    pipe: Any, batch: int = 1, guidance: float = 5.0, per_prompt: int = 1, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return pipe(
        prompt_embeds=wan_prompt_embeds(batch=batch).to(dtype),
        negative_prompt_embeds=wan_prompt_embeds(batch=batch, seed=2).to(dtype),
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=guidance,
        num_videos_per_prompt=per_prompt,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames


def _sd3(pipe: Any, batch: int = 1, per_prompt: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    embeds = {
        "prompt_embeds": torch.randn(batch, 7, 16, generator=gen).to(dtype),
        "pooled_prompt_embeds": torch.randn(batch, 16, generator=gen).to(dtype),
        "negative_prompt_embeds": torch.randn(batch, 7, 16, generator=gen).to(dtype),
        "negative_pooled_prompt_embeds": torch.randn(batch, 16, generator=gen).to(dtype),
    }
    latents = None
    if dtype != torch.float32:  # the fp32 draw the pipeline makes itself (an fp64 draw gives other numbers)
        latents = pipe.prepare_latents(
            batch * per_prompt,
            pipe.transformer.config.in_channels,
            32,
            32,
            torch.float32,
            torch.device("cpu"),
            torch.Generator().manual_seed(0),
        ).to(dtype)
    return pipe(
        **embeds,
        latents=latents,
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=5.0,
        num_images_per_prompt=per_prompt,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images


def _sd3_pipe() -> Any:
    return tiny_sd3_pipe()


#: Attributes that every pipeline call replaces by new objects, patched or not (class name -> keys); only
#: their presence is compared after ``patch.remove()``, every other attribute of every object by identity.
RUN_STATE: dict[str, frozenset[str]] = {
    # set_timesteps() at the start of each call builds new timesteps/sigmas tensors.
    "FlowMatchEulerDiscreteScheduler": frozenset({"timesteps", "sigmas"}),
    # clear_cache() at each encode/decode starts new causal-conv caches (lists) and their indices.
    "AutoencoderKLWan": frozenset({"_conv_idx", "_feat_map", "_enc_conv_idx", "_enc_feat_map"}),
}


def _restored(before: Any) -> bool:
    return restored(before, RUN_STATE)


def _compare(
    references: dict[tuple, torch.Tensor],
    pipe: Any,
    run: Any,
    parallel: int | ParallelConfig,
    all_families: bool = False,
    registry: Registry | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Reference run, patched run (counting bytes sent), removal; what each rank saw.

    ``references``: unpatched outputs and their fp32 rounding noise (against an fp64 copy of the pipe) by
    (pipe, run, arguments), owned by the calling rank function so that its pipes die with it. ``all_families``: apply with the default registry (transformer USP and VAE
    families too), end to end; ``registry``: apply with this one.
    """
    key = (id(pipe), run, tuple(sorted(kwargs.items())))  # the caller keeps every pipe alive: ids are unique
    if key not in references:
        reference = run(pipe, **kwargs)
        references[key] = (
            reference,
            rounding_noise(reference, run(to_fp64(pipe), dtype=torch.float64, **kwargs)),
        )
    reference, noise = references[key]
    saved = snapshot(pipe)
    patch = hfpatch.apply(pipe, parallel, registry=None if all_families else registry or _registry())
    with count_comm() as counter:
        out = run(pipe, **kwargs)
    patch.remove()
    return {
        "diff": rel_error(out, reference),
        "noise": noise,
        "shape": (tuple(out.shape), tuple(reference.shape)),
        "bytes": counter.bytes_sent - counter.by_op.get("guard", 0),
        "guard_calls": counter.calls.get("guard", 0),
        "restored": _restored(saved),
        "plan": patch.plan,
    }


# ----------------------------------------------------------------------------------------------- rank fns
def _cases_two_ranks() -> dict[str, Any]:
    cfg2 = ParallelConfig(cfg=2)
    wan, sd3 = tiny_wan_pipe(), _sd3_pipe()
    refs: dict[tuple, torch.Tensor] = {}
    calls: list[int] = []
    results = {
        "wan_cfg": _compare(refs, wan, _wan, cfg2),
        "wan_cfg_no_guidance": _compare(refs, wan, _wan, cfg2, guidance=1.0),
        "wan_data": _compare(refs, wan, _wan, ParallelConfig(data=2), per_prompt=3),
        "wan22_cfg": _compare(refs, tiny_wan_pipe(two_transformers=True), _wan, cfg2),
        "sd3_cfg": _compare(refs, sd3, _sd3, cfg2),
        "sd3_data": _compare(refs, sd3, _sd3, ParallelConfig(data=2)),
        # End to end: parallel=2 plans cfg=2, the VAE family splits the decode over both ranks.
        "wan_auto": _compare(refs, wan, _wan, 2, all_families=True),
        "sd3_auto": _compare(refs, sd3, _sd3, 2, all_families=True),
        # The pipeline family and a component family both wrap transformer.forward (the component's first).
        "wan_cfg_nested_forward": _compare(
            refs, wan, _wan, cfg2, registry=_registry_with_forward_wrapper(calls)
        ),
    }
    results["nested_forward_calls"] = len(calls)

    # A call without guidance on a cfg plan is exact ("wan_cfg_no_guidance") and says so once per patch.
    notes = _Notes()
    logger = logging.getLogger("hfpatch.patches.pipeline")
    logger.addHandler(notes)
    try:
        with hfpatch.apply(wan, cfg2, registry=_registry()):
            _wan(wan, guidance=1.0)
            _wan(wan, guidance=1.0)
    finally:
        logger.removeHandler(notes)
    results["unguided_notes"] = notes.messages

    # A direct transformer call with return_dict=True gets the stock output type back, batch split over data.
    inputs = dict(
        hidden_states=torch.randn(3, 4, 2, 4, 4, generator=torch.Generator().manual_seed(3)),
        timestep=torch.tensor([500.0, 300.0, 100.0]),
        encoder_hidden_states=wan_prompt_embeds(batch=3),
    )
    with torch.no_grad():
        expected = wan.transformer(**inputs).sample
        noise = rounding_noise(expected, to_fp64(wan.transformer)(**to_fp64(inputs)).sample)
        with hfpatch.apply(wan, ParallelConfig(data=2), registry=_registry()):
            got = wan.transformer(**inputs)
    results["return_dict"] = (type(got).__name__, rel_error(got.sample, expected), noise)

    # Double apply is a no-op, a different plan raises, progress bar off on rank > 0 and restored.
    wan.set_progress_bar_config(disable=False, desc="denoise")
    before = wan._progress_bar_config
    patch = hfpatch.apply(wan, cfg2, registry=_registry())
    results["same_again"] = hfpatch.apply(wan, cfg2, registry=_registry()) is patch
    try:
        hfpatch.apply(wan, ParallelConfig(data=2), registry=_registry())
        results["conflict"] = None
    except ValueError as exc:
        results["conflict"] = str(exc)
    results["bar"] = dict(wan._progress_bar_config)
    results["repr"] = patch.describe()

    # Call patterns other than cond-then-uncond raise instead of returning a placeholder.
    transformer = wan.transformer
    args = dict(
        hidden_states=torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(4)),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=wan_prompt_embeds(),
        return_dict=False,
    )
    wan._guidance_scale = 5.0  # what WanPipeline.__call__ sets before its loop
    errors = []
    for contexts in (["uncond"], ["cond", "cond"], [None]):
        try:
            for name in contexts:
                if name is None:
                    transformer(**args)
                else:
                    with transformer.cache_context(name):
                        transformer(**args)
            errors.append(None)
        except RuntimeError as exc:
            errors.append(str(exc))
    results["pattern_errors"] = errors
    patch.remove()
    results["bar_restored"] = wan._progress_bar_config is before
    return results


def _cases_four_ranks() -> dict[str, Any]:
    wan = tiny_wan_pipe()
    cfg_data = ParallelConfig(data=2, cfg=2)
    refs: dict[tuple, torch.Tensor] = {}
    return {
        # batch 3 over 2 data ranks: uneven [2, 1].
        "wan_cfg_data": _compare(refs, wan, _wan, cfg_data, batch=3),
        # 2B = 4 rows: the cfg halves [uncond, cond] of 2 prompts each, 1 per data rank. (SD3 does not
        # repeat given pooled embeds for num_images_per_prompt, so the batch comes from prompts.)
        "sd3_cfg_data": _compare(refs, _sd3_pipe(), _sd3, cfg_data, batch=2),
        # End to end: parallel=4 plans cfg=2 x ulysses=2 (4 heads); cfg and sequence groups together.
        "wan_auto": _compare(refs, wan, _wan, 4, all_families=True),
        "wan22_auto": _compare(refs, tiny_wan_pipe(two_transformers=True), _wan, 4, all_families=True),
        "sd3_auto": _compare(refs, _sd3_pipe(), _sd3, 4, all_families=True),
    }


def _cases_three_ranks() -> dict[str, Any]:
    wan = tiny_wan_pipe()
    refs: dict[tuple, torch.Tensor] = {}
    return {
        # batch 4 over 3 data ranks: uneven [2, 1, 1].
        "wan_data": _compare(refs, wan, _wan, ParallelConfig(data=3), batch=4),
        # End to end: 3 ranks cannot split cond/uncond, and 3 does not divide 4 heads: Ring 3, VAE over 3.
        "wan_auto": _compare(refs, wan, _wan, 3, all_families=True),
        "sd3_auto": _compare(refs, _sd3_pipe(), _sd3, 3, all_families=True),
    }


def _cfg_error_on_one_rank() -> dict[str, str | None]:
    """Two-call CFG where the transformer call fails (or returns a wrong shape) on one cfg rank only."""
    wan = tiny_wan_pipe()
    rank = torch.distributed.get_rank()
    args = dict(
        hidden_states=torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(4)),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=wan_prompt_embeds(),
        return_dict=False,
    )

    def wrong_channels(original: Any) -> Any:
        return lambda *a, **k: (torch.zeros(1, 3, 2, 4, 4),)  # out_channels is 4: cfg rank 1 can tell

    def fails_on(failing_rank: int) -> Any:
        def make(original: Any) -> Any:
            def forward(*a: Any, **k: Any) -> Any:
                if rank == failing_rank:
                    raise ValueError(f"transformer failed on rank {rank}")
                return original(*a, **k)

            return forward

        return make

    errors: dict[str, str | None] = {}
    for case, make in (
        ("wrong_shape", wrong_channels),
        ("uncond_fails", fails_on(1)),
        ("cond_fails", fails_on(0)),
    ):
        with hfpatch.apply(wan, ParallelConfig(cfg=2), registry=_registry()):
            wan._guidance_scale = 5.0  # what WanPipeline.__call__ sets before its loop
            forward = wan.transformer.forward  # the pipeline family's _ParallelForward
            forward.original = make(forward.original)
            try:
                for name in ("cond", "uncond"):
                    with wan.transformer.cache_context(name):
                        wan.transformer(**args)
                errors[case] = None
            except (RuntimeError, ValueError) as exc:
                errors[case] = f"{type(exc).__name__}: {exc}"
    return errors


def _data_batch_too_small() -> str:
    wan = tiny_wan_pipe()
    with hfpatch.apply(wan, ParallelConfig(data=2), registry=_registry()):
        try:
            _wan(wan)
        except ValueError as exc:
            return str(exc)
    return "no error"


# ----------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def two_rank_results(rank_pool) -> list[dict[str, Any]]:
    return rank_pool(2).run(_cases_two_ranks)


@pytest.mark.parametrize(
    "case",
    [
        "wan_cfg",
        "wan_cfg_no_guidance",
        "wan_data",
        "wan22_cfg",
        "sd3_cfg",
        "sd3_data",
        "wan_auto",
        "sd3_auto",
        "wan_cfg_nested_forward",
    ],
)
def test_pipeline_parallel_two_ranks_equals_unpatched(two_rank_results, case):
    for rank, results in enumerate(two_rank_results):
        result = results[case]
        assert result["shape"][0] == result["shape"][1], (rank, result)
        assert result["diff"] <= (0.0 if case in EXACT else reassociation_tol(result["noise"])), (
            rank,
            result,
        )
        assert result["restored"], (rank, case)


def test_pipeline_parallel_cfg_sends_one_prediction_per_step(two_rank_results):
    # Two-call CFG: each rank sends its prediction (1x4x2x4x4 fp32 = 512 B) once per step, 2 steps, after
    # the metadata both ranks check first ([ok, 2 x (dtype, ndim, 8 dims)] int64 = 21 x 8 = 168 B).
    for results in two_rank_results:
        assert results["wan_cfg"]["bytes"] == 2 * (512 + 168)
        assert results["wan22_cfg"]["bytes"] == 2 * (512 + 168)
        assert results["wan_cfg_no_guidance"]["bytes"] == 0
        # Plus the same-input check of every transformer call (2 steps, cond + uncond): one table each.
        assert results["wan_cfg"]["guard_calls"] == results["wan22_cfg"]["guard_calls"] == 4
        assert results["wan_cfg_no_guidance"]["guard_calls"] == 2


def test_pipeline_parallel_call_without_guidance_says_once_what_the_cfg_ranks_do(two_rank_results):
    # Exactness: "wan_cfg_no_guidance" above (bit for bit). Two calls, one patch: one note, on rank 0 only.
    rank0, rank1 = (results["unguided_notes"] for results in two_rank_results)
    assert len(rank0) == 1 and rank1 == [], (rank0, rank1)
    assert "does not guide" in rank0[0] and "both cfg ranks compute the same prediction" in rank0[0]
    assert "parallel=hfpatch.ParallelConfig(ulysses=2)" in rank0[0], rank0[0]


def test_pipeline_parallel_auto_plan_two_ranks_is_cfg(two_rank_results):
    for results in two_rank_results:
        assert results["wan_auto"]["plan"] == ParallelConfig(cfg=2)
        assert results["sd3_auto"]["plan"] == ParallelConfig(cfg=2)


def test_pipeline_parallel_direct_call_return_dict_keeps_output_type(two_rank_results):
    for results in two_rank_results:
        name, diff, noise = results["return_dict"]
        assert name == "Transformer2DModelOutput"
        assert diff <= reassociation_tol(noise), (diff, noise)  # batch 3 split [2, 1]: GEMM shapes change


def test_pipeline_parallel_apply_twice_is_noop_and_conflict_raises(two_rank_results):
    for results in two_rank_results:
        assert results["same_again"] is True
        # Only what differs, not both option dicts whole
        assert "already patched" in results["conflict"], results["conflict"]
        # The test's registry has the pipeline family only: no VAE family, so the plans split no VAE (vae=1).
        assert (
            "(plan: ParallelConfig(cfg=2, vae=1) now, ParallelConfig(data=2, vae=1) asked)"
            in results["conflict"]
        )
        assert "WanTransformer3DModel" in results["repr"] and ".forward (was ABSENT)" in results["repr"]


def test_pipeline_parallel_progress_bar_only_on_rank_zero(two_rank_results):
    assert two_rank_results[0]["bar"] == {"disable": False, "desc": "denoise"}
    assert two_rank_results[1]["bar"] == {"disable": True, "desc": "denoise"}
    assert all(results["bar_restored"] for results in two_rank_results)


def test_pipeline_parallel_unknown_call_pattern_raises(two_rank_results):
    for results in two_rank_results:
        uncond_first, cond_twice, no_context = results["pattern_errors"]
        assert "uncond call without a cond call" in uncond_first
        assert "two cond calls in a row" in cond_twice
        assert "cache_context(None)" in no_context


def test_pipeline_parallel_four_ranks_cfg_and_data_equals_unpatched(rank_pool):
    for rank, results in enumerate(rank_pool(4).run(_cases_four_ranks)):
        for case, result in results.items():
            assert result["shape"][0] == result["shape"][1], (rank, case, result)
            assert result["diff"] <= reassociation_tol(result["noise"]), (rank, case, result)
            assert result["restored"], (rank, case)
        assert results["wan_cfg_data"]["plan"] == ParallelConfig(
            data=2, cfg=2, vae=1
        )  # no VAE family registered
        for case in ("wan_auto", "wan22_auto", "sd3_auto"):
            assert results[case]["plan"] == ParallelConfig(cfg=2, ulysses=2), (case, results[case]["plan"])


def test_pipeline_parallel_three_ranks_data_and_ring_equals_unpatched(rank_pool):
    for rank, results in enumerate(rank_pool(3).run(_cases_three_ranks)):
        for case, result in results.items():
            assert result["shape"][0] == result["shape"][1], (rank, case, result)
            assert result["diff"] <= reassociation_tol(result["noise"]), (rank, case, result)
            assert result["restored"], (rank, case)
        assert results["wan_data"]["plan"] == ParallelConfig(data=3, vae=1)  # no VAE family registered
        for case in ("wan_auto", "sd3_auto"):
            assert results[case]["plan"] == ParallelConfig(ring=3), (case, results[case]["plan"])


def test_pipeline_parallel_cfg_error_on_one_rank_raises_on_both(rank_pool):
    # Before the metadata exchange, the failing rank raised and the other one waited in the all-gather.
    rank0, rank1 = rank_pool(2).run(_cfg_error_on_one_rank)
    expected = "returned (1, 3, 2, 4, 4) torch.float32 for the uncond call on cfg rank 1"
    assert expected in rank0["wrong_shape"] and rank0["wrong_shape"] == rank1["wrong_shape"]
    assert "expected (1, 4, 2, 4, 4) torch.float32" in rank0["wrong_shape"]
    assert rank1["uncond_fails"] == "ValueError: transformer failed on rank 1"
    assert rank0["uncond_fails"].startswith("RuntimeError: hfpatch CFG parallel: the uncond call of")
    assert rank0["cond_fails"] == "ValueError: transformer failed on rank 0"
    assert "the cond call of WanTransformer3DModel failed on cfg rank 0" in rank1["cond_fails"]


def test_pipeline_parallel_remove_after_component_wrapped_same_forward_restores_identity(two_rank_results):
    # transformer.forward is wrapped twice: by a component family (child patch), then by the pipeline family.
    for results in two_rank_results:
        assert results["wan_cfg_nested_forward"]["restored"]
        assert results["nested_forward_calls"] == 2  # 2 steps: cond on cfg rank 0, uncond on cfg rank 1


def test_pipeline_parallel_data_batch_smaller_than_ranks_raises(rank_pool):
    for message in rank_pool(2).run(_data_batch_too_small):
        assert "data=2" in message and "has batch 1" in message


def test_pipeline_parallel_validate_cfg_needs_a_denoiser():
    pipe = tiny_flux_pipe()
    pipe.transformer = None  # diffusers components may be None
    with pytest.raises(ValueError, match="data=1, cfg=2 split the denoiser calls of FluxPipeline, but none"):
        PipelineParallel().validate(pipe, ParallelConfig(cfg=2), {})


def test_pipeline_parallel_facts_guides_only_for_supported_cfg():
    family = PipelineParallel()
    assert family.facts(tiny_wan_pipe()).guides is True
    assert family.facts(_sd3_pipe()).guides is True
    assert family.facts(tiny_flux_pipe()).guides is False  # guidance-distilled: plan no cfg degree
    assert family.facts(tiny_wan_pipe()).num_heads is None


def test_pipeline_parallel_single_rank_is_identity():
    pipe = tiny_wan_pipe()
    reference = _wan(pipe)
    saved = snapshot(pipe)
    with hfpatch.apply(pipe, registry=_registry()) as patch:
        assert patch.plan == ParallelConfig()
        assert torch.equal(_wan(pipe), reference)
    assert _restored(saved)
