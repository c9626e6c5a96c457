"""Data and CFG parallel of ``hfpatch.patches.pipeline`` for pipelines whose denoiser hfpatch has no USP
family for, or whose class is not in its tables: a stock ``FluxPipeline`` with tiny CLIP/T5 text encoders
and in-memory tokenizers, a stock ``QwenImagePipeline`` with true CFG, and the SD3 pipeline with its table entries hidden (so the generic per-call rule,
:func:`hfpatch.patches.pipeline.generic_split`, decides what to split). Gloo ranks, fp32.

Tolerances. Data parallel at ``data=B`` over ``B`` prompts gives each rank one row: its transformer call is a
batch-1 call on the same inputs as the batch-1 call of an unpatched run of that prompt alone (the text
encoders, the scheduler step and the latents are computed on the full batch; encoders and scheduler act on
each row independently). So the patched row must equal the per-prompt unpatched run where the batch-2 text
encoding gives the same rows as batch-1 encoding; where it does not, the gap is reassociation, bounded by
``reassociation_tol`` of that run's fp32-vs-fp64 noise. Against the unpatched batch-``B`` run (other GEMM
shapes in the transformer) the bound is ``reassociation_tol`` too. The generic rule and the explicit table
split the same arguments the same way: bit-exact to each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from diffusers import DiffusionPipeline
from pipe_helpers import restored, snapshot, wan_pipe_call

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.core.registry import Registry
from hfpatch.distributed.collectives import count_comm
from hfpatch.patches.pipeline import PipelineParallel
from hfpatch.patches.pipeline import cfg_data as pipeline_module
from hfpatch.testing import (
    tiny_flux_pipe_with_text_encoders,
    tiny_flux_transformer,
    tiny_sd3_pipe,
    tiny_sdxl_pipe,
    tiny_wan_pipe,
)
from hfpatch.testing import tiny_qwenimage_pipe as _tiny_qwen_image_pipe
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

PROMPTS = ["a cat", "a dog", "the sea"]  # at most 8 CLIP tokens with BOS/EOS: no truncation


def _registry() -> Registry:
    """Only the pipeline family: the results isolate the batch/CFG split (transformer families have tests)."""
    registry = Registry()
    registry.register("diffusers.DiffusionPipeline", PipelineParallel)
    return registry


@contextmanager
def _unlisted(*classes: str) -> Iterator[None]:
    """Hide ``classes`` from the pipeline family's tables, as if hfpatch had never heard of them."""
    saved = (
        dict(pipeline_module.PER_SAMPLE_ARGS),
        pipeline_module.TWO_CALL_CFG_PIPELINES,
        pipeline_module.BATCHED_CFG_PIPELINES,
    )
    for name in classes:
        pipeline_module.PER_SAMPLE_ARGS.pop(name, None)
    pipeline_module.TWO_CALL_CFG_PIPELINES = tuple(c for c in saved[1] if c not in classes)
    pipeline_module.BATCHED_CFG_PIPELINES = tuple(c for c in saved[2] if c not in classes)
    try:
        yield
    finally:
        pipeline_module.PER_SAMPLE_ARGS.clear()
        pipeline_module.PER_SAMPLE_ARGS.update(saved[0])
        pipeline_module.TWO_CALL_CFG_PIPELINES, pipeline_module.BATCHED_CFG_PIPELINES = saved[1:]


#: Attributes that every pipeline call replaces by new objects, patched or not: compared by presence only.
RUN_STATE: dict[str, frozenset[str]] = {
    "FlowMatchEulerDiscreteScheduler": frozenset({"timesteps", "sigmas"}),
    "FluxPipeline": frozenset({"_joint_attention_kwargs"}),  # a new {} per call
}


def _restored(before: Any) -> bool:
    return restored(before, RUN_STATE)


# ----------------------------------------------------------------------------------------------- runs
def _flux_latents(pipe: Any, batch: int) -> torch.Tensor:
    """The packed fp32 noise the pipeline would draw for ``batch`` images of 16x16 (seed 0)."""
    latents, _ = pipe.prepare_latents(
        batch,
        pipe.transformer.config.in_channels // 4,
        16,
        16,
        torch.float32,
        torch.device("cpu"),
        torch.Generator().manual_seed(0),
    )
    return latents


def _flux(
    pipe: Any, prompts: list[str] | None, latents: torch.Tensor, **embeds: torch.Tensor
) -> torch.Tensor:
    return pipe(
        prompt=prompts,
        **embeds,
        latents=latents.to(pipe.transformer.dtype),
        height=16,
        width=16,
        num_inference_steps=2,
        max_sequence_length=8,
        output_type="latent",
    ).images


def _sd3(pipe: Any, batch: int) -> torch.Tensor:
    """SD3 with CFG (batch ``2 * batch`` per call); the fp32 draws, cast to the pipe's dtype."""
    gen = torch.Generator().manual_seed(5)
    dtype = pipe.transformer.dtype
    embeds = {
        "prompt_embeds": torch.randn(batch, 7, 16, generator=gen),
        "pooled_prompt_embeds": torch.randn(batch, 16, generator=gen),
        "negative_prompt_embeds": torch.randn(batch, 7, 16, generator=gen),
        "negative_pooled_prompt_embeds": torch.randn(batch, 16, generator=gen),
    }
    latents = torch.randn(batch, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    return pipe(
        **{k: v.to(dtype) for k, v in embeds.items()},
        latents=latents.to(dtype),
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=5.0,
        output_type="latent",
    ).images


def _outcome(fn: Any) -> str:
    """``"ok"`` or the error's type and message, plus the bytes hfpatch sent besides the input guard."""
    with count_comm() as counter:
        try:
            fn()
            result = "ok"
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"
    return f"{result} [sent {counter.bytes_sent - counter.by_op.get('guard', 0)} B]"


# ----------------------------------------------------------------------------------------------- rank fns
def _flux_cases() -> dict[str, Any]:
    """FluxPipeline at data=world: rows, per-prompt references, progress bar, ambiguity errors, removal."""
    world = torch.distributed.get_world_size()
    prompts = PROMPTS[:world]
    pipe = tiny_flux_pipe_with_text_encoders()
    pipe.set_progress_bar_config(desc="denoise")  # no "disable": diffusers' own default would decide
    latents = _flux_latents(pipe, world)
    fp64 = to_fp64(pipe)
    results: dict[str, Any] = {}

    # Unpatched references: each prompt alone, on the rows of the batch's own text encoding (so its batch-1
    # transformer calls see exactly the inputs of a rank's: bit-exact), and the batch together.
    # no_grad as inside the pipeline: T5's kernels differ with autograd on (~7e-7 here).
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, max_sequence_length=8)
    rows = [
        {"prompt_embeds": embeds[i : i + 1], "pooled_prompt_embeds": pooled[i : i + 1]} for i in range(world)
    ]
    alone = [_flux(pipe, None, latents[i : i + 1], **rows[i]) for i in range(world)]
    alone_noise = [
        rounding_noise(
            a, _flux(fp64, None, latents[i : i + 1], **{k: v.double() for k, v in rows[i].items()})
        )
        for i, a in enumerate(alone)
    ]
    batched = _flux(pipe, prompts, latents)
    batched_noise = rounding_noise(batched, _flux(fp64, prompts, latents))

    saved = snapshot(pipe)
    before_bar = pipe._progress_bar_config
    patch = hfpatch.apply(pipe, ParallelConfig(data=world), registry=_registry())
    results["plan"] = patch.plan
    results["bar_config"] = dict(pipe._progress_bar_config)
    out = _flux(pipe, prompts, latents)
    results["rows_vs_alone"] = [(rel_error(out[i : i + 1], a), alone_noise[i]) for i, a in enumerate(alone)]
    results["vs_batched"] = (rel_error(out, batched), batched_noise)
    results["shape"] = (tuple(out.shape), tuple(batched.shape))

    # A bar config set after apply still shows the bar on rank 0 only.
    patched_bar = pipe._progress_bar_config
    pipe.set_progress_bar_config(disable=False, desc="later")
    bar = pipe.progress_bar(total=1)
    results["bar_disabled_after_set"] = bar.disable
    bar.close()
    pipe._progress_bar_config = patched_bar  # undo the test's change: remove() warns about later changes

    # Tensors inside joint_attention_kwargs: refused by name, on every rank, before any split collective.
    gen = torch.Generator().manual_seed(3)
    call = dict(
        hidden_states=torch.randn(world, 16, 16, generator=gen),
        encoder_hidden_states=torch.randn(world, 8, 16, generator=gen),
        pooled_projections=torch.randn(world, 16, generator=gen),
        timestep=torch.full((world,), 0.5),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )
    kwargs_with_tensor = {"ip_adapter_image_embeds": [torch.zeros(world, 16)]}
    results["dict_error"] = _outcome(
        lambda: pipe.transformer(**call, joint_attention_kwargs=kwargs_with_tensor)
    )
    patch.remove()
    results["restored"] = _restored(saved) and "progress_bar" not in vars(pipe)
    results["bar_restored"] = pipe._progress_bar_config is before_bar

    # The generic rule on Flux (class hidden from the table): img_ids [16, 3] (the first of the [seq, 3] position
    # tables in Flux's signature) has no batch dim: refused by name.
    with (
        _unlisted("FluxTransformer2DModel"),
        hfpatch.apply(pipe, ParallelConfig(data=world), registry=_registry()),
    ):
        results["generic_flux"] = _outcome(lambda: _flux(pipe, prompts, latents))
        # txt_ids of `world` rows (a text of `world` tokens) would be taken for batched: the documented limit.
        results["generic_flux_coincidence"] = pipeline_module.generic_split(
            "FluxTransformer2DModel",
            {"hidden_states": call["hidden_states"], "txt_ids": torch.zeros(world, 3)},
            "hidden_states",
        )
    return results


def _sd3_generic_cases() -> dict[str, Any]:
    """SD3 through the generic rule (hidden from the tables) against the table path and the unpatched pipe."""
    pipe = tiny_sd3_pipe()
    results: dict[str, Any] = {}
    for case, config, batch in (
        ("data", ParallelConfig(data=2), 2),  # CFG batch 4 over 2 data ranks
        ("cfg", ParallelConfig(cfg=2), 1),  # [uncond, cond] over the cfg ranks
    ):
        reference = _sd3(pipe, batch)
        noise = rounding_noise(reference, _sd3(to_fp64(pipe), batch))
        with hfpatch.apply(pipe, config, registry=_registry()):
            table = _sd3(pipe, batch)
        saved = snapshot(pipe)
        with _unlisted("StableDiffusion3Pipeline", "SD3Transformer2DModel"):
            with hfpatch.apply(pipe, config, registry=_registry()) as patch:
                generic = _sd3(pipe, batch)
                mode = pipe.transformer.forward.mode
        results[case] = {
            "vs_table": rel_error(generic, table),
            "vs_unpatched": (rel_error(generic, reference), noise),
            "mode": mode,
            "plan": patch.plan,
            "restored": _restored(saved),
        }

    # Wan with its table entry hidden: its two calls per step found from the calls (first step observed).
    wan = tiny_wan_pipe()
    reference = wan_pipe_call(wan)
    with _unlisted("WanPipeline"), hfpatch.apply(wan, ParallelConfig(cfg=2), registry=_registry()):
        results["wan_observed"] = (
            torch.equal(wan_pipe_call(wan), reference),
            wan.transformer.forward.state.phase,
        )
    return results


def _qwen_image_cases() -> dict[str, Any]:
    """QwenImagePipeline (a class in no table: the generic rule) at data=world, with true CFG (two calls per
    step, each split over the data ranks) and a padded prompt mask; rows against per-prompt unpatched runs."""
    world = torch.distributed.get_world_size()
    pipe = _tiny_qwen_image_pipe()
    fp64 = to_fp64(pipe)
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "prompt_embeds": torch.randn(world, 5, 16, generator=gen),
        "prompt_embeds_mask": torch.ones(world, 5, dtype=torch.long),
        "negative_prompt_embeds": torch.randn(world, 4, 16, generator=gen),
        "negative_prompt_embeds_mask": torch.ones(world, 4, dtype=torch.long),
        "latents": torch.randn(world, 64, 16, generator=gen),  # 32 x 32 pixels: 8 x 8 packed tokens of 16
    }
    inputs["prompt_embeds_mask"][-1, 3:] = 0  # the last prompt is padded

    def run(target: Any, rows: slice) -> torch.Tensor:
        kwargs = {k: v[rows] for k, v in inputs.items()}
        if target is fp64:
            kwargs = to_fp64(kwargs)
        return target(
            **kwargs, true_cfg_scale=4.0, height=32, width=32, num_inference_steps=2, output_type="latent"
        ).images

    alone = [(run(pipe, slice(i, i + 1)), run(fp64, slice(i, i + 1))) for i in range(world)]
    with hfpatch.apply(pipe, ParallelConfig(data=world), registry=_registry()) as patch:
        out = run(pipe, slice(None))
        split_args = pipe.transformer.forward.split_args
    return {
        "plan": patch.plan,
        "generic": split_args is None,
        "rows_vs_alone": [
            (rel_error(out[i : i + 1], a32), rounding_noise(a32, a64)) for i, (a32, a64) in enumerate(alone)
        ],
    }


class _CountCalls:
    """Counts the transformer computations on this rank (``proj_out`` runs once per forward)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self.handle = model.proj_out.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def _observed_cfg_cases() -> dict[str, Any]:
    """cfg=2 on pipelines whose two calls per step hfpatch learns from the first step: Flux and QwenImage true
    CFG, Flux without a negative prompt (one call per step: nothing to split), a pipeline that computes with
    the cond prediction before its uncond call (from the first step, or only later: refused on both ranks)."""
    results: dict[str, Any] = {}
    flux = tiny_flux_pipe_with_text_encoders()
    counter = _CountCalls(flux.transformer)
    latents = _flux_latents(flux, 2)

    def flux_call(guide: bool) -> torch.Tensor:
        negative = {"negative_prompt": ["a log", "the sun"], "true_cfg_scale": 4.0} if guide else {}
        return flux(
            prompt=PROMPTS[:2],
            **negative,
            latents=latents,
            height=16,
            width=16,
            num_inference_steps=3,
            max_sequence_length=8,
            output_type="latent",
        ).images

    for guide in (True, False):
        reference = flux_call(guide)
        unpatched_calls = counter.take()
        with hfpatch.apply(flux, ParallelConfig(cfg=2), registry=_registry()):
            out = flux_call(guide)
            phase = flux.transformer.forward.state.phase
        results[f"flux_guide_{guide}"] = {
            "equal": torch.equal(out, reference),
            "plain_tensor": type(out) is torch.Tensor,
            "phase": phase,
            "calls": (counter.take(), unpatched_calls),
        }

    qwen = _tiny_qwen_image_pipe()
    gen = torch.Generator().manual_seed(4)
    inputs = {
        "prompt_embeds": torch.randn(1, 5, 16, generator=gen),
        "prompt_embeds_mask": torch.ones(1, 5, dtype=torch.long),
        "negative_prompt_embeds": torch.randn(1, 4, 16, generator=gen),
        "negative_prompt_embeds_mask": torch.ones(1, 4, dtype=torch.long),
        "latents": torch.randn(1, 64, 16, generator=gen),
    }

    def qwen_call() -> torch.Tensor:
        return qwen(
            **inputs, true_cfg_scale=4.0, height=32, width=32, num_inference_steps=3, output_type="latent"
        ).images

    reference = qwen_call()
    with hfpatch.apply(qwen, ParallelConfig(cfg=2), registry=_registry()):
        results["qwen_image"] = (torch.equal(qwen_call(), reference), qwen.transformer.forward.state.phase)

    pipe = _ReadsCond(tiny_flux_transformer())
    gen = torch.Generator().manual_seed(6)
    args = [
        torch.randn(1, 16, 16, generator=gen),
        torch.randn(1, 8, 16, generator=gen),
        torch.randn(1, 16, generator=gen),
    ]
    # Reads from the first step / from the second step / never; directly, or inside a list (torch.cat).
    cases = [(0, False), (1, False), (None, False), (0, True), (1, True)]
    references = {case: pipe(*args, read_from_step=case[0], in_list=case[1]) for case in cases}
    with hfpatch.apply(pipe, ParallelConfig(cfg=2), registry=_registry()):
        for read, in_list in cases:
            outcome = _outcome(
                lambda read=read, in_list=in_list: results.__setitem__(
                    "out", pipe(*args, read_from_step=read, in_list=in_list)
                )
            )
            equal = outcome.startswith("ok") and torch.equal(results.pop("out"), references[read, in_list])
            key = f"reads_from_{read}" + ("_in_list" if in_list else "")
            results[key] = (outcome, equal, pipe.transformer.forward.state.phase)
    return results


class _ReadsCond(DiffusionPipeline):
    """A two-call CFG pipeline that computes with the cond prediction before its uncond call from step
    ``read_from_step`` on (``None``: never), directly or as an element of a list argument (``in_list``), to
    test what hfpatch does when the first step's pattern is not the supported one or changes later."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)

    @torch.no_grad()
    def __call__(
        self, latents, text, pooled, read_from_step: int | None = None, in_list: bool = False, steps: int = 3
    ) -> torch.Tensor:
        ids = {"img_ids": torch.zeros(latents.shape[1], 3), "txt_ids": torch.zeros(text.shape[1], 3)}
        for i in self.progress_bar(range(steps)):
            t = torch.full((latents.shape[0],), 1.0 - i / steps)
            with self.transformer.cache_context("cond"):
                cond = self.transformer(latents, text, pooled, t, **ids, return_dict=False)[0]
            if read_from_step is not None and i >= read_from_step:
                # e.g. a guidance rescale that needs the cond prediction early
                cond = torch.cat([cond], dim=0) * 1.5 if in_list else cond.clamp(-10, 10)
            with self.transformer.cache_context("uncond"):
                uncond = self.transformer(latents, -text, pooled, t, **ids, return_dict=False)[0]
            latents = latents - 0.1 * (uncond + 3.0 * (cond - uncond))
        self.maybe_free_model_hooks()
        return latents


def _sdxl_cases() -> dict[str, Any]:
    """StableDiffusionXLPipeline (a UNet, batched CFG, per-sample tensors inside ``added_cond_kwargs``) at
    data=2, cfg=2 and parallel=2 against the unpatched pipe (batch 4 per call: 2 prompts x CFG)."""
    pipe = tiny_sdxl_pipe()
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "prompt_embeds": torch.randn(2, 5, 16, generator=gen),
        "pooled_prompt_embeds": torch.randn(2, 16, generator=gen),
        "negative_prompt_embeds": torch.randn(2, 5, 16, generator=gen),
        "negative_pooled_prompt_embeds": torch.randn(2, 16, generator=gen),
        "latents": torch.randn(2, 4, 8, 8, generator=gen),
    }

    def run(target: Any) -> torch.Tensor:
        kwargs = to_fp64(inputs) if target is not pipe else inputs
        return target(
            **kwargs, height=16, width=16, num_inference_steps=2, guidance_scale=5.0, output_type="latent"
        ).images

    reference = run(pipe)
    noise = rounding_noise(reference, run(to_fp64(pipe)))
    results: dict[str, Any] = {}
    for case, parallel in (("data", ParallelConfig(data=2)), ("cfg", ParallelConfig(cfg=2)), ("planned", 2)):
        with hfpatch.apply(pipe, parallel, registry=_registry()) as patch:
            results[case] = (rel_error(run(pipe), reference), noise, patch.plan)
    return results


def _all_cases() -> dict[str, Any]:
    return {
        "sdxl": _sdxl_cases(),
        "flux": _flux_cases(),
        "sd3": _sd3_generic_cases(),
        "qwen_image": _qwen_image_cases(),
        "observed": _observed_cfg_cases(),
    }


# ----------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def results(rank_pool) -> list[dict[str, Any]]:
    return rank_pool(2).run(_all_cases)


def test_flux_data_parallel_rows_equal_per_prompt_runs(results):
    for rank, result in enumerate(results):
        flux = result["flux"]
        assert flux["plan"] == ParallelConfig(
            data=2, vae=1
        )  # the test registry has no VAE family: no VAE split
        assert flux["shape"][0] == flux["shape"][1]
        # Each rank's batch-1 transformer calls get the inputs of the per-prompt run (views of the batch's
        # rows instead of tensors of their own): same kernels, equal to reassociation tolerance at most.
        for diff, noise in flux["rows_vs_alone"]:
            assert diff <= reassociation_tol(noise), (rank, flux["rows_vs_alone"])
        # Against the batch-2 run (other GEMM shapes): reassociation only.
        diff, noise = flux["vs_batched"]
        assert diff <= reassociation_tol(noise), (rank, diff, noise)


def test_sdxl_unet_data_and_cfg_parallel_equal_unpatched(results):
    # Each rank runs the UNet on its rows of the batch (other GEMM shapes): reassociation only.
    for rank, result in enumerate(results):
        for case, (diff, noise, _plan) in result["sdxl"].items():
            assert diff <= reassociation_tol(noise), (rank, case, diff, noise)
        assert result["sdxl"]["planned"][2] == ParallelConfig(
            cfg=2, vae=1
        )  # parallel=2: CFG parallel for a UNet


def test_qwen_image_true_cfg_data_parallel_rows_equal_per_prompt_runs(results):
    for rank, result in enumerate(results):
        qwen = result["qwen_image"]
        assert qwen["plan"] == ParallelConfig(data=2, vae=1) and qwen["generic"]
        for diff, noise in qwen["rows_vs_alone"]:
            assert diff <= reassociation_tol(noise), (rank, qwen["rows_vs_alone"])


def test_flux_progress_bar_only_on_rank_zero(results):
    assert results[0]["flux"]["bar_config"] == {"desc": "denoise"}
    assert results[1]["flux"]["bar_config"] == {"desc": "denoise", "disable": True}
    # set_progress_bar_config(disable=False) after apply: rank 1 still shows no bar.
    assert [r["flux"]["bar_disabled_after_set"] for r in results] == [False, True]
    assert all(r["flux"]["bar_restored"] and r["flux"]["restored"] for r in results)


def test_ambiguous_arguments_raise_the_same_error_on_every_rank(results):
    dict_errors = {r["flux"]["dict_error"] for r in results}
    generic_errors = {r["flux"]["generic_flux"] for r in results}
    assert len(dict_errors) == len(generic_errors) == 1  # alike on every rank
    (dict_error,), (generic_error,) = dict_errors, generic_errors
    assert dict_error.startswith(
        "TypeError: FluxTransformer2DModel.forward got tensors in joint_attention_kwargs"
    )
    assert dict_error.endswith("[sent 0 B]")  # raised before any collective of the split
    assert generic_error.startswith("TypeError: hfpatch data/CFG parallel cannot tell whether")
    assert "argument img_ids (shape (16, 3))" in generic_error and generic_error.endswith("[sent 0 B]")


def test_generic_rule_splits_a_coincident_leading_dim(results):
    # The documented limit: a non-batched tensor with as many rows as the batch is split (hence the table).
    for result in results:
        assert "txt_ids" in result["flux"]["generic_flux_coincidence"]


@pytest.mark.parametrize("case", ["data", "cfg"])
def test_generic_rule_equals_table_and_unpatched(results, case):
    for rank, result in enumerate(results):
        sd3 = result["sd3"][case]
        assert sd3["vs_table"] == 0.0, (rank, sd3)  # same arguments split the same way: same kernels
        diff, noise = sd3["vs_unpatched"]
        assert diff <= reassociation_tol(noise), (rank, sd3)
        assert sd3["mode"] == ("generic" if case == "cfg" else None)
        assert sd3["restored"], (rank, case)


def test_unlisted_wan_two_call_cfg_is_found_from_the_calls(results):
    # Wan hidden from the tables: observed in the first step, then cond and uncond on different cfg ranks;
    # each call runs as in the unpatched pipe (same inputs, same kernels): bit-exact.
    for result in results:
        assert result["sd3"]["wan_observed"] == (True, "parallel")


def test_true_cfg_pipelines_split_cond_and_uncond_over_cfg_ranks(results):
    for rank, result in enumerate(results):
        observed = result["observed"]
        guided = observed["flux_guide_True"]
        # Two calls per step, 3 steps: both calls on every rank in the first step, one per rank after it.
        assert guided == {"equal": True, "plain_tensor": True, "phase": "parallel", "calls": (4, 6)}, rank
        assert observed["flux_guide_False"] == {
            "equal": True,
            "plain_tensor": True,
            "phase": "off",  # no negative prompt: one call per step, computed on both ranks
            "calls": (3, 3),
        }, rank
        assert observed["qwen_image"] == (True, "parallel"), rank


def test_cond_prediction_used_before_the_uncond_call(results):
    outcomes = [r["observed"] for r in results]
    for observed in outcomes:
        # From the first step on: CFG parallel stays off for the call (logged), the result is exact.
        assert observed["reads_from_0"] == ("ok [sent 0 B]", True, "off")
        assert observed["reads_from_None"][1:] == (True, "parallel")
        # Only from the second step on: the guarded prediction refuses the use on both ranks, no wrong value.
        outcome, equal, _ = observed["reads_from_1"]
        assert not equal and outcome.startswith(
            "RuntimeError: hfpatch CFG parallel (cfg=2): _ReadsCond computed with the cond prediction"
        )
        assert "Apply with cfg=1" in outcome
        # The same when the prediction is used inside a list argument (torch.cat([cond])).
        assert observed["reads_from_0_in_list"] == ("ok [sent 0 B]", True, "off")
        assert observed["reads_from_1_in_list"][0] == outcome and not observed["reads_from_1_in_list"][1]
    assert outcomes[0]["reads_from_1"] == outcomes[1]["reads_from_1"]  # the same error on both ranks


def test_flux_cfg_is_accepted_but_not_planned():
    # cfg=2 runs where asked (true CFG is opt-in per call); parallel=N does not plan it for Flux.
    PipelineParallel().validate(tiny_flux_pipe_with_text_encoders(), ParallelConfig(cfg=2), {})
    assert PipelineParallel().facts(tiny_flux_pipe_with_text_encoders()).guides is False
