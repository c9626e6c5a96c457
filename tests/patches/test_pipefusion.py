"""PipeFusion (``hfpatch.patches.pipefusion``, ``pipefusion_flux``) on tiny stock ``WanPipeline`` and
``FluxPipeline``, gloo ranks, fp32.

Exactness: with ``pipefusion_warmup`` >= the number of steps every call is a synchronous warm-up call, which
runs the stock kernels on the stock shapes (the stages only hand the hidden states on), so every rank must
return the unpatched output; the tolerance is the reassociation one of the other parallel tests (the
measured difference is 0).

Approximate mode: the stale-K/V arithmetic does not depend on which rank holds a block, so the output of
``P`` ranks must equal the single-process simulation of the same algorithm (``apply_pipefusion(...,
group=None)``), and differ from the exact output by the measured, bounded error (README: PipeFusion).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import pytest
import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.core.patch import Patch
from hfpatch.distributed.collectives import count_comm
from hfpatch.patches.pipefusion import WanPipeFusion, parameter_bytes
from hfpatch.patches.pipefusion.flux import FluxPipeFusion, apply_flux_pipefusion, flux_blocks
from hfpatch.patches.pipefusion.layout import (
    SequenceShardLayout,
    balanced_stage_counts,
    patch_ranges,
    stage_bytes_per_call,
    stage_ranges,
)
from hfpatch.patches.pipefusion.wan import apply_pipefusion
from hfpatch.testing import (
    tiny_flux_pipe,
    tiny_flux_pipe_with_text_encoders,
    tiny_flux_transformer,
    tiny_sd3_pipe,
    tiny_wan_pipe,
    tiny_wan_transformer,
    wan_prompt_embeds,
)
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

STEPS = 3
LAYERS = 5  # uneven over 2, 3 and 4 stages: (3, 2), (2, 2, 1), (2, 1, 1, 1)
#: 32x32 pixels, 5 frames -> latents [1, 4, 2, 4, 4] -> 2 * 2 * 2 = 8 tokens of 32 channels.
TOKENS, CHANNELS, OUT_NUMEL = 8, 32, 4 * 2 * 4 * 4
#: Approximate mode on the tiny pipeline (3 steps, 8 tokens): PSNR of the decoded frames against the exact
#: ones measured at 35.6 dB (warm-up 1, M=4) and 91 dB (warm-up 2, M=3) on this machine (README table: 49-55 dB
#: at 64x64, 8 steps). The bound only says the error stays an error of stale K/V, not a broken pipeline.
MIN_PSNR_DB = 20.0

#: Flux: 3 dual-stream + 3 single-stream blocks; a dual block holds 2.4x the parameter bytes of a single one,
#: so the default (byte-balanced) stages are (2, 4) at P=2 (stage 1 spans both lists), (2, 1, 3) at P=3 and
#: (1, 1, 1, 3) at P=4: uneven everywhere. 16x16 pixels -> 16 image tokens after the T=8 text tokens: a joint
#: sequence of 24 tokens of 32 channels; M=4 patches of 6 tokens make a text-only first patch and a mixed
#: (2 text + 4 image) second one.
FLUX_DUAL, FLUX_SINGLE, FLUX_STEPS = 3, 3, 3
FLUX_TEXT, FLUX_IMAGE, FLUX_WIDTH, FLUX_OUT = 8, 16, 32, 16


def _pipe(layers: int = LAYERS) -> Any:
    pipe = tiny_wan_pipe()
    pipe.transformer = tiny_wan_transformer(num_layers=layers)
    return pipe


def _run(
    pipe: Any, dtype: torch.dtype = torch.float32, steps: int = STEPS, per_prompt: int = 1
) -> torch.Tensor:
    return pipe(
        prompt_embeds=wan_prompt_embeds().to(dtype),
        negative_prompt_embeds=wan_prompt_embeds(seed=2).to(dtype),
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=steps,
        guidance_scale=5.0,
        num_videos_per_prompt=per_prompt,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames


# The unpatched outputs and the one-process simulations depend only on their arguments (seeded weights and
# inputs, one thread, the same kernels): each process computes each of them once (cached for the life of the
# process, a pool rank's included) instead of once per case. Every case still builds and patches its own
# pipeline. The cached tensors are only compared, never written.
@functools.cache
def _reference(per_prompt: int = 1) -> tuple[torch.Tensor, float]:
    """The unpatched output of ``_pipe()`` and its fp32-vs-fp64 rounding noise."""
    pipe = _pipe()
    reference = _run(pipe, per_prompt=per_prompt)
    return reference, rounding_noise(
        reference, _run(to_fp64(pipe), dtype=torch.float64, per_prompt=per_prompt)
    )


@functools.cache
def _simulated(patches: int, warmup: int) -> torch.Tensor:
    """The approximate mode computed in one process (every block in one stage)."""
    pipe = _pipe()
    with Patch("simulation") as patch:
        options = {**WanPipeFusion.options, "pipefusion_patches": patches, "pipefusion_warmup": warmup}
        apply_pipefusion(pipe.transformer, patch, None, options)
        return _run(pipe)


def _psnr(out: torch.Tensor, reference: torch.Tensor) -> float:
    mse = (out.double() - reference.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _exact_case(parallel: ParallelConfig, patches: int = 2, per_prompt: int = 1) -> dict[str, Any]:
    """Warm-up = every step: patched vs unpatched, and the bytes sent against the analytic count (the batch
    of ``per_prompt`` videos is split over the data ranks: one video per rank here)."""
    pipe = _pipe()
    reference, noise = _reference(per_prompt)
    patch = hfpatch.apply(pipe, parallel, pipefusion_patches=patches, pipefusion_warmup=STEPS)
    with count_comm() as counter:
        out = _run(pipe, per_prompt=per_prompt)
    state = pipe.transformer._hfpatch_pipefusion
    calls = STEPS * (2 if parallel.cfg == 1 else 1)  # cond and uncond calls on this rank
    analytic = calls * stage_bytes_per_call(state.stage, state.world, TOKENS * CHANNELS * 4, OUT_NUMEL * 4)
    sent = counter.by_op.get("pipefusion", 0) + counter.by_op.get("pipefusion_output", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # released weights: tested in _remove_cases
        patch.remove()
    return {
        "diff": rel_error(out, reference),
        "max_abs": (out - reference).abs().max().item(),
        "tol": reassociation_tol(noise),
        "shape": (tuple(out.shape), tuple(reference.shape)),
        "sent": sent,
        "analytic": analytic,
        "stage": (state.stage, state.first, state.end),
    }


def _approx_case(parallel: ParallelConfig, patches: int = 4, warmup: int = 1) -> dict[str, Any]:
    """Pipelined after the warm-up: equal to the one-process simulation, deterministic, a bounded error."""
    pipe = _pipe()
    reference = _reference()[0]
    patch = hfpatch.apply(pipe, parallel, pipefusion_patches=patches, pipefusion_warmup=warmup)
    with count_comm() as counter:
        out = _run(pipe)
    again = _run(pipe)
    state = pipe.transformer._hfpatch_pipefusion
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch.remove()
    simulated = _simulated(patches, warmup)
    return {
        "vs_simulation": (out - simulated).abs().max().item(),
        "deterministic": torch.equal(out, again),
        "max_abs": (out - reference).abs().max().item(),
        "psnr": _psnr(out, reference),
        "handoffs": counter.calls.get("pipefusion", 0),
        "handoff_bytes": counter.by_op.get("pipefusion", 0),
        "stage": state.stage,
        "kv_bytes": state.kv_bytes(),
    }


def _sp_rows(patches: int, sp: int, tokens: int = TOKENS) -> int:
    """Tokens a rank of a stage's ``sp`` ranks holds: its (padded) shard of every patch."""
    return sum(-(-(end - start) // sp) for start, end in patch_ranges(tokens, patches))


def _sp_case(
    parallel: ParallelConfig, patches: int, warmup: int | None = None, flux: bool = False
) -> dict[str, Any]:
    """PipeFusion x sequence parallel (Wan, or Flux with ``flux``): against the unpatched output (warm-up =
    every step: exact) and against PipeFusion alone, the one-process simulation at the same ``M`` and warm-up
    (sequence parallel is exact, so the two must agree up to reassociation). Hand-off bytes: each sp rank's
    (padded) shard of each patch (Flux: of the joint ``[text, image]`` sequence)."""
    steps = FLUX_STEPS if flux else STEPS
    warmup = steps if warmup is None else warmup
    pipe, run = (_flux_pipe(), _flux_run) if flux else (_pipe(), _run)
    reference, noise = _flux_reference() if flux else _reference()
    patch = hfpatch.apply(pipe, parallel, pipefusion_patches=patches, pipefusion_warmup=warmup)
    with count_comm() as counter:
        out = run(pipe)
    state = pipe.transformer._hfpatch_pipefusion
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch.remove()
    simulated = (_flux_simulated if flux else _simulated)(patches, warmup) if warmup < steps else reference
    streams = 1 if flux else 2 // parallel.cfg  # Wan: cond and uncond, or one of them per cfg rank
    tokens, width, output = (
        (FLUX_TEXT + FLUX_IMAGE, FLUX_WIDTH, FLUX_IMAGE * FLUX_OUT) if flux else (TOKENS, CHANNELS, OUT_NUMEL)
    )
    hidden = streams * steps * _sp_rows(patches, parallel.ring * parallel.ulysses, tokens) * width * 4
    output = (state.world - 1) * streams * steps * output * 4
    return {
        "diff": rel_error(out, reference),
        "vs_pipefusion": rel_error(out, simulated),
        "max_abs": (out - reference).abs().max().item(),
        "tol": reassociation_tol(noise),
        "handoff_bytes": counter.by_op.get("pipefusion", 0),
        "output_bytes": counter.by_op.get("pipefusion_output", 0),
        "analytic": (0, output) if state.is_last else (hidden, 0),
        "handoffs": counter.calls.get("pipefusion", 0),
        "ops": dict(counter.by_op),
        "stage": (state.stage, state.sp_index),
        "streams": streams,
    }


def _sp_error_cases() -> dict[str, str]:
    """PipeFusion x sequence parallel misconfigured: raised alike on every rank, before any collective."""
    pf_u2 = ParallelConfig(pipefusion=2, ulysses=2, vae=1)
    one_head = _pipe()
    one_head.transformer = tiny_wan_transformer(num_heads=1, head_dim=32, num_layers=LAYERS)
    results = {
        "heads": _errors(lambda: hfpatch.apply(one_head, pf_u2)),
        "sd3": _errors(lambda: hfpatch.apply(tiny_sd3_pipe(), pf_u2)),
    }
    pipe = _pipe()
    patch = hfpatch.apply(pipe, pf_u2, pipefusion_patches=TOKENS + 1, pipefusion_release_weights=False)
    results["patches_over_tokens"] = _errors(lambda: _run(pipe))
    patch.remove()
    return results


def _wan22_case() -> dict[str, Any]:
    """Wan 2.2 (``transformer_2`` takes over at the boundary step): each transformer has its own stages and
    streams; ``transformer_2`` warms up when it starts. Exact at warm-up = steps; pipelined equals simulation."""
    steps = 6
    pf2 = ParallelConfig(pipefusion=2, vae=1)
    results: dict[str, Any] = {}
    for warmup in (steps, 1):
        pipe = tiny_wan_pipe(two_transformers=True)
        reference = _run(pipe, steps=steps)
        patch = hfpatch.apply(pipe, pf2, pipefusion_patches=4, pipefusion_warmup=warmup)
        out = _run(pipe, steps=steps)
        calls = [
            sum(s.calls for s in model._hfpatch_pipefusion.streams.values())
            for model in (pipe.transformer, pipe.transformer_2)
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            patch.remove()
        simulated = tiny_wan_pipe(two_transformers=True)
        with Patch("simulation") as sim:
            options = {**WanPipeFusion.options, "pipefusion_patches": 4, "pipefusion_warmup": warmup}
            for model in (simulated.transformer, simulated.transformer_2):
                apply_pipefusion(model, sim, None, options)
            expected = _run(simulated, steps=steps)
        results[warmup] = {
            "vs_unpatched": (out - reference).abs().max().item(),
            "vs_simulation": (out - expected).abs().max().item(),
            "calls": calls,
        }
    return results


def _errors(fn: Any) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _error_cases() -> dict[str, str]:
    pf2 = ParallelConfig(pipefusion=2, vae=1)
    results = {
        "stages_over_blocks": _errors(lambda: hfpatch.apply(_pipe(layers=1), pf2)),
        "patches_zero": _errors(lambda: hfpatch.apply(_pipe(), pf2, pipefusion_patches=0)),
        "warmup_zero": _errors(lambda: hfpatch.apply(_pipe(), pf2, pipefusion_warmup=0)),
        "bad_blocks": _errors(lambda: hfpatch.apply(_pipe(), pf2, pipefusion_blocks=(4, 2))),
        "without_pipefusion": _errors(
            lambda: hfpatch.apply(_pipe(), ParallelConfig(cfg=2), pipefusion_patches=4)
        ),
    }
    training = _pipe()
    training.transformer.train()
    results["training_at_apply"] = _errors(lambda: hfpatch.apply(training, pf2))

    pipe = _pipe()
    patch = hfpatch.apply(pipe, pf2, pipefusion_patches=TOKENS + 1, pipefusion_release_weights=False)
    results["patches_over_tokens"] = _errors(lambda: _run(pipe))
    patch.remove()

    pipe = _pipe()
    patch = hfpatch.apply(pipe, pf2, pipefusion_release_weights=False)
    x = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    t, text = torch.tensor([900.0]), wan_prompt_embeds()
    with torch.enable_grad():
        results["grad_enabled"] = _errors(lambda: pipe.transformer(x, t, text))
    pipe.transformer.train()
    with torch.no_grad():
        results["training_at_call"] = _errors(lambda: pipe.transformer(x, t, text))
    pipe.transformer.eval()
    with torch.no_grad():  # the refused calls left nothing behind: the next call runs (a warm-up call: exact)
        patched = pipe.transformer(x, t, text).sample
    patch.remove()
    with torch.no_grad():
        results["after_errors_exact"] = torch.equal(patched, pipe.transformer(x, t, text).sample)
    return results


def _remove_cases() -> dict[str, Any]:
    """Weights released per rank, and what ``remove()`` does with and without releasing."""
    pf2 = ParallelConfig(pipefusion=2, vae=1)
    pipe = _pipe()
    model = pipe.transformer
    total = parameter_bytes(model)
    per_block = [parameter_bytes(b) for b in model.blocks]
    snapshot = [(m, dict(vars(m)), dict(m._parameters)) for m in model.modules()]
    patch = hfpatch.apply(pipe, pf2, pipefusion_release_weights=False)
    kept = parameter_bytes(model)
    patch.remove()
    restored = all(
        vars(m).keys() == before.keys()
        and all(vars(m)[k] is v for k, v in before.items())
        and all(m._parameters[k] is v for k, v in params.items())
        for m, before, params in snapshot
    )

    patch = hfpatch.apply(pipe, pf2)
    state = model._hfpatch_pipefusion
    own = range(state.first, state.end)
    released_expected = sum(b for i, b in enumerate(per_block) if i not in own)
    after = parameter_bytes(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch.remove()
    meta = [i for i, b in enumerate(model.blocks) if all(p.device.type == "meta" for p in b.parameters())]
    return {
        "total": total,
        "kept_without_release": kept,
        "restored_without_release": restored,
        "after_release": after,
        "expected_after": total - released_expected,
        "released_bytes": state.released_bytes,
        "released_expected": released_expected,
        "blocks_bytes": sum(per_block),
        "own_blocks_bytes": sum(per_block[i] for i in own),
        "warnings": [str(w.message) for w in caught],
        "meta_blocks": meta,
        "own": list(own),
    }


# ----------------------------------------------------------------------------------------------- Flux
def _flux_pipe(guide: bool = False) -> Any:
    """Without ``guide``: embeddings given, one call per step. With ``guide``: tiny CLIP/T5 text encoders, a
    negative prompt and ``true_cfg_scale`` (two calls per step, in ``cache_context("cond")``/``("uncond")``)."""
    pipe = tiny_flux_pipe_with_text_encoders() if guide else tiny_flux_pipe()
    pipe.transformer = tiny_flux_transformer(num_layers=FLUX_DUAL, num_single_layers=FLUX_SINGLE)
    return pipe


def _flux_run(pipe: Any, guide: bool = False) -> torch.Tensor:
    dtype = pipe.transformer.dtype
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(1, FLUX_IMAGE, FLUX_OUT, generator=gen)  # packed noise, fp32 draws for fp64 twins
    if guide:
        text = dict(prompt="a cat", negative_prompt="a dog", true_cfg_scale=4.0, max_sequence_length=8)
    else:
        text = dict(
            prompt_embeds=torch.randn(1, FLUX_TEXT, 16, generator=gen).to(dtype),
            pooled_prompt_embeds=torch.randn(1, 16, generator=gen).to(dtype),
        )
    return pipe(
        **text,
        latents=latents.to(dtype),
        height=16,
        width=16,
        num_inference_steps=FLUX_STEPS,
        output_type="pt",
    ).images


@functools.cache
def _flux_reference(guide: bool = False) -> tuple[torch.Tensor, float]:
    """The unpatched output of ``_flux_pipe(guide)`` and its fp32-vs-fp64 rounding noise (cached as
    ``_reference``)."""
    pipe = _flux_pipe(guide)
    reference = _flux_run(pipe, guide)
    return reference, rounding_noise(reference, _flux_run(to_fp64(pipe), guide))


@functools.cache
def _flux_simulated(patches: int, warmup: int, guide: bool = False) -> torch.Tensor:
    pipe = _flux_pipe(guide)
    with Patch("simulation") as patch:
        options = {**FluxPipeFusion.options, "pipefusion_patches": patches, "pipefusion_warmup": warmup}
        apply_flux_pipefusion(pipe.transformer, patch, None, options)
        return _flux_run(pipe, guide)


def _flux_exact_case(parallel: ParallelConfig | int, guide: bool = False, **options: Any) -> dict[str, Any]:
    """Warm-up = every step: patched vs unpatched, bytes sent against the analytic count. With ``guide`` and
    cfg=2 the pipeline family computes both CFG calls of the first step on every cfg rank (it learns the
    two-call pattern from it), then one call per step: ``steps + 1`` transformer calls per rank."""
    pipe = _flux_pipe(guide)
    reference, noise = _flux_reference(guide)
    patch = hfpatch.apply(pipe, parallel, pipefusion_warmup=FLUX_STEPS, **options)
    with count_comm() as counter:
        out = _flux_run(pipe, guide)
    state = pipe.transformer._hfpatch_pipefusion
    calls = FLUX_STEPS + (1 if guide and patch.plan.cfg == 2 else 0)
    hidden_bytes = (FLUX_TEXT + FLUX_IMAGE) * FLUX_WIDTH * 4  # the joint [text, image] sequence
    analytic = calls * stage_bytes_per_call(state.stage, state.world, hidden_bytes, FLUX_IMAGE * FLUX_OUT * 4)
    sent = counter.by_op.get("pipefusion", 0) + counter.by_op.get("pipefusion_output", 0)
    plan = patch.plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # released weights: tested in _flux_weights_case
        patch.remove()
    return {
        "diff": rel_error(out, reference),
        "tol": reassociation_tol(noise),
        "shape": (tuple(out.shape), tuple(reference.shape)),
        "sent": sent,
        "analytic": analytic,
        "stage": (state.stage, state.first, state.end),
        "plan": (plan.cfg, plan.pipefusion, plan.ulysses, plan.ring, plan.vae),
    }


def _flux_approx_case(
    parallel: ParallelConfig, patches: int, warmup: int, guide: bool = False
) -> dict[str, Any]:
    """Pipelined after the warm-up: equal to the one-process simulation, deterministic, a bounded error."""
    pipe = _flux_pipe(guide)
    reference = _flux_reference(guide)[0]
    patch = hfpatch.apply(pipe, parallel, pipefusion_patches=patches, pipefusion_warmup=warmup)
    with count_comm() as counter:
        out = _flux_run(pipe, guide)
    again = _flux_run(pipe, guide)
    state = pipe.transformer._hfpatch_pipefusion
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch.remove()
    simulated = _flux_simulated(patches, warmup, guide)
    return {
        "vs_simulation": (out - simulated).abs().max().item(),
        "deterministic": torch.equal(out, again),
        "max_abs": (out - reference).abs().max().item(),
        "psnr": _psnr(out, reference),
        "handoffs": counter.calls.get("pipefusion", 0),
        "handoff_bytes": counter.by_op.get("pipefusion", 0),
        "stage": state.stage,
    }


def _flux_weights_case() -> dict[str, Any]:
    """Weights per rank after release: own blocks (across both block lists) plus the unsplit layers."""
    pipe = _flux_pipe()
    model = pipe.transformer
    total = parameter_bytes(model)
    per_block = [parameter_bytes(b) for b in flux_blocks(model)]
    patch = hfpatch.apply(pipe, ParallelConfig(pipefusion=2, vae=1))
    state = model._hfpatch_pipefusion
    own = range(state.first, state.end)
    after = parameter_bytes(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch.remove()
    return {
        "after": after,
        "expected": total - sum(per_block) + sum(per_block[i] for i in own),
        "released": (state.released_bytes, sum(b for i, b in enumerate(per_block) if i not in own)),
        "meta": [
            i
            for i, b in enumerate(flux_blocks(model))
            if all(p.device.type == "meta" for p in b.parameters())
        ],
        "own": list(own),
        "own_block_bytes": sum(per_block[i] for i in own),
        "block_bytes": sum(per_block),
        "warnings": [str(w.message) for w in caught],
    }


def _flux_error_cases() -> dict[str, str]:
    pf2 = ParallelConfig(pipefusion=2, vae=1)
    one_block = tiny_flux_pipe()
    one_block.transformer = tiny_flux_transformer(num_layers=1, num_single_layers=0)
    results = {"stages_over_blocks": _errors(lambda: hfpatch.apply(one_block, pf2))}

    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    class CustomProcessor(FluxAttnProcessor):
        pass

    custom = _flux_pipe()
    custom.transformer.single_transformer_blocks[1].attn.set_processor(CustomProcessor())
    results["custom_processor"] = _errors(lambda: hfpatch.apply(custom, pf2))

    pipe = _flux_pipe()
    patch = hfpatch.apply(pipe, pf2, pipefusion_release_weights=False)
    model, gen = pipe.transformer, torch.Generator().manual_seed(2)
    args = [torch.randn(1, FLUX_IMAGE, 16, generator=gen), torch.randn(1, FLUX_TEXT, 16, generator=gen)]
    kwargs = dict(
        pooled_projections=torch.randn(1, 16, generator=gen),
        timestep=torch.tensor([0.9]),
        img_ids=torch.zeros(FLUX_IMAGE, 3),
        txt_ids=torch.zeros(FLUX_TEXT, 3),
    )
    with torch.no_grad():
        residuals = [torch.zeros(1, FLUX_IMAGE, FLUX_WIDTH)]
        results["controlnet"] = _errors(lambda: model(*args, **kwargs, controlnet_block_samples=residuals))
        patched = model(*args, **kwargs).sample  # the refused call left nothing behind: a warm-up call, exact
    patch.remove()
    with torch.no_grad():
        results["after_errors_exact"] = torch.equal(patched, model(*args, **kwargs).sample)
    pipe = _flux_pipe()
    patch = hfpatch.apply(pipe, pf2, pipefusion_patches=FLUX_TEXT + FLUX_IMAGE + 1)
    results["patches_over_tokens"] = _errors(lambda: _flux_run(pipe))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch.remove()
    return results


def _planner_cases() -> dict[str, Any]:
    """``parallel=N, pipefusion=True`` (2 ranks): Wan guides, so CFG takes both ranks (pipefusion=1, the
    PipeFusion options are then moot); Flux without true CFG gets pipefusion=2. ``parallel=2`` alone never
    plans PipeFusion."""
    pipe = _pipe()
    reference, noise = _reference()
    with hfpatch.apply(pipe, 2, pipefusion=True, pipefusion_warmup=STEPS) as patch:
        out = _run(pipe)
        wan_plan = (patch.plan.cfg, patch.plan.pipefusion, patch.plan.vae)
    with hfpatch.apply(_flux_pipe(), 2) as patch:
        default_plan = (patch.plan.cfg, patch.plan.pipefusion, patch.plan.ulysses)
    return {
        "wan": {"plan": wan_plan, "diff": rel_error(out, reference), "tol": reassociation_tol(noise)},
        "flux": _flux_exact_case(2, pipefusion=True),
        "default_flux_plan": default_plan,
    }


# ----------------------------------------------------------------------------------------------- rank fns
def _cases_two_ranks() -> dict[str, Any]:
    pf2 = ParallelConfig(pipefusion=2, vae=1)
    return {
        "exact": _exact_case(pf2),
        "exact_m4": _exact_case(pf2, patches=4),
        "approx": _approx_case(pf2),
        "wan22": _wan22_case(),
        "errors": _error_cases(),
        "remove": _remove_cases(),
        "flux_exact": _flux_exact_case(ParallelConfig(pipefusion=2, vae=1), pipefusion_patches=4),
        "flux_approx": _flux_approx_case(ParallelConfig(pipefusion=2, vae=1), patches=4, warmup=1),
        "flux_weights": _flux_weights_case(),
        "flux_errors": _flux_error_cases(),
        "planner": _planner_cases(),
    }


def _cases_three_ranks() -> dict[str, Any]:
    pf3 = ParallelConfig(pipefusion=3, vae=1)
    return {
        "exact": _exact_case(pf3),
        "approx": _approx_case(pf3, patches=3, warmup=2),
        "flux_exact": _flux_exact_case(pf3),
        "flux_approx": _flux_approx_case(pf3, patches=3, warmup=2),
    }


def _cases_four_ranks() -> dict[str, Any]:
    cfg_pf = ParallelConfig(cfg=2, pipefusion=2, vae=1)
    pf_u2, pf_r2 = ParallelConfig(pipefusion=2, ulysses=2, vae=1), ParallelConfig(pipefusion=2, ring=2, vae=1)
    return {
        "exact_p4": _exact_case(ParallelConfig(pipefusion=4, vae=1)),
        "exact_cfg_pf": _exact_case(cfg_pf),
        "exact_data_pf": _exact_case(ParallelConfig(data=2, pipefusion=2, vae=1), per_prompt=2),
        "approx_cfg_pf": _approx_case(cfg_pf),
        "pf_ulysses_exact": _sp_case(pf_u2, patches=2),
        "pf_ulysses_exact_uneven": _sp_case(pf_u2, patches=3),
        "pf_ring_exact_uneven": _sp_case(pf_r2, patches=3),
        "pf_ulysses_approx": _sp_case(pf_u2, patches=4, warmup=1),
        "pf_ring_approx": _sp_case(pf_r2, patches=3, warmup=1),
        "sp_errors": _sp_error_cases(),
        "flux_exact_p4": _flux_exact_case(ParallelConfig(pipefusion=4, vae=1)),
        "flux_exact_cfg_pf": _flux_exact_case(cfg_pf, guide=True),
        "flux_approx_cfg_pf": _flux_approx_case(cfg_pf, patches=4, warmup=1, guide=True),
        # joint sequence of 24 tokens (8 text): M=5 -> 5, 5, 5, 5, 4 (odd patches padded per sp shard), M=4 ->
        # 6 each (patch 1 = 2 text + 4 image: sp shard 0 holds text and image rows)
        "flux_pf_ulysses_exact": _sp_case(pf_u2, patches=5, flux=True),
        "flux_pf_ring_exact": _sp_case(pf_r2, patches=4, flux=True),
        "flux_pf_ulysses_approx": _sp_case(pf_u2, patches=4, warmup=1, flux=True),
        "flux_pf_ring_approx": _sp_case(pf_r2, patches=5, warmup=1, flux=True),
    }


def _cases_eight_ranks() -> dict[str, Any]:
    """xDiT's three-way hybrid: cfg 2 x pipefusion 2 x ulysses 2 (ring 2 on a second run)."""
    return {
        "cfg_pf_ulysses_exact": _sp_case(ParallelConfig(cfg=2, pipefusion=2, ulysses=2, vae=1), patches=3),
        "cfg_pf_ring_approx": _sp_case(
            ParallelConfig(cfg=2, pipefusion=2, ring=2, vae=1), patches=4, warmup=1
        ),
    }


@pytest.fixture(scope="module")
def two(rank_pool):
    return rank_pool(2).run(_cases_two_ranks)


@pytest.fixture(scope="module")
def three(rank_pool):
    return rank_pool(3).run(_cases_three_ranks)


@pytest.fixture(scope="module")
def four(rank_pool):
    return rank_pool(4).run(_cases_four_ranks)


@pytest.fixture(scope="module")
def eight(rank_pool):
    return rank_pool(8).run(_cases_eight_ranks)


# ----------------------------------------------------------------------------------------------- layout
def test_stage_ranges_uneven_first_stages_take_more():
    assert stage_ranges(5, 2) == [(0, 3), (3, 5)]
    assert stage_ranges(5, 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert stage_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_ranges(6, 2, counts=(2, 4)) == [(0, 2), (2, 6)]


def test_balanced_stage_counts_minimise_the_heaviest_stage():
    dual, single = 24, 10  # Flux-like: a dual-stream block weighs 2.4 single-stream ones
    assert balanced_stage_counts([dual] * 3 + [single] * 3, 2) == [2, 4]  # 48 | 54, not 72 | 30 by count
    assert balanced_stage_counts([dual] * 4 + [single] * 8, 4) == [2, 2, 4, 4]
    assert balanced_stage_counts([7] * 5, 3) == [2, 2, 1]  # equal blocks: as stage_ranges deals them
    for n in range(1, 9):
        for stages in range(1, n + 1):
            weights = [(3 * i) % 7 + 1 for i in range(n)]
            counts = balanced_stage_counts(weights, stages)
            assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
            edges = [sum(counts[:s]) for s in range(stages + 1)]
            heaviest = max(sum(weights[a:b]) for a, b in zip(edges, edges[1:]))
            assert heaviest == _brute_force_heaviest(weights, stages)


def _brute_force_heaviest(weights: list[int], stages: int) -> int:
    from itertools import combinations

    n = len(weights)
    return min(
        max(sum(weights[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
        for cuts in combinations(range(1, n), stages - 1)
    )


def test_stage_ranges_more_stages_than_blocks_raises():
    with pytest.raises(ValueError, match="pipefusion=3 stages but the model has only 2 transformer blocks"):
        stage_ranges(2, 3)
    with pytest.raises(ValueError, match="pipefusion_blocks must be 2 positive ints"):
        stage_ranges(5, 2, counts=(5, 0))


def test_patch_ranges_cover_tokens_and_reject_misfits():
    assert patch_ranges(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert patch_ranges(8, 8)[-1] == (7, 8)
    for bad in (0, 9, True):
        with pytest.raises(ValueError, match="does not fit a sequence of 8 tokens"):
            patch_ranges(8, bad)


@pytest.mark.parametrize(
    ("tokens", "patches", "world", "ulysses"),
    [(8, 2, 2, 2), (8, 3, 2, 1), (10, 3, 4, 2), (7, 3, 4, 4), (5, 2, 4, 1)],
)
def test_sequence_shard_layout_covers_every_token_once(tokens, patches, world, ulysses):
    ranges = patch_ranges(tokens, patches)
    layouts = [SequenceShardLayout(ranges, world, index, ulysses) for index in range(world)]
    rows = layouts[0].rows
    gathered = [token for layout in layouts for token in layout.local_index]  # sp ranks' rows, rank by rank
    assert [gathered[row] for row in layouts[0].global_rows] == list(range(tokens))
    for layout in layouts:
        assert layout.rows == rows and layout.kv_len == ulysses * rows
        real = [len(keep) if keep is not None else layout.kv_len for keep in layout.valid_keys]
        assert sum(real) == tokens  # over the ring ranks' buffers, every token's K/V once
        assert sorted(layout.sync_order) == list(range(layout.kv_len))


def test_parallel_config_pipefusion_world_size_and_repr():
    config = ParallelConfig(cfg=2, pipefusion=2)
    assert config.world_size == 4 and config.vae == 4
    assert "pipefusion=2" in repr(config)
    assert "pipefusion" not in repr(ParallelConfig(cfg=2))  # unchanged for plans without it
    with pytest.raises(ValueError, match="pipefusion must be a positive int"):
        ParallelConfig(pipefusion=0)


def test_simulation_warmup_every_step_equals_unpatched():
    pipe = _pipe()
    assert torch.equal(_simulated(patches=4, warmup=STEPS), _run(pipe))


# ----------------------------------------------------------------------------------------------- ranks
@pytest.mark.parametrize("case", ["exact", "exact_m4"])
def test_pipefusion_warmup_all_steps_two_stages_equals_unpatched(two, case):
    for rank, result in enumerate(two):
        r = result[case]
        assert r["shape"][0] == r["shape"][1]
        assert r["diff"] <= r["tol"], (rank, r)
        assert r["sent"] == r["analytic"], (rank, r)
    assert [r[case]["stage"] for r in two] == [(0, 0, 3), (1, 3, 5)]


def test_pipefusion_warmup_all_steps_three_stages_uneven_equals_unpatched(three):
    assert [r["exact"]["stage"] for r in three] == [(0, 0, 2), (1, 2, 4), (2, 4, 5)]
    for rank, result in enumerate(three):
        r = result["exact"]
        assert r["diff"] <= r["tol"] and r["sent"] == r["analytic"], (rank, r)


@pytest.mark.parametrize("case", ["exact_p4", "exact_cfg_pf", "exact_data_pf"])
def test_pipefusion_warmup_all_steps_four_ranks_equals_unpatched(four, case):
    for rank, result in enumerate(four):
        r = result[case]
        assert r["diff"] <= r["tol"] and r["sent"] == r["analytic"], (rank, r)
    if case == "exact_p4":
        assert [r[case]["stage"] for r in four] == [(0, 0, 2), (1, 2, 3), (2, 3, 4), (3, 4, 5)]
    else:  # cfg/data outermost: ranks 0, 1 are one branch's (one video's) two stages, ranks 2, 3 the other's
        assert [r[case]["stage"] for r in four] == [(0, 0, 3), (1, 3, 5), (0, 0, 3), (1, 3, 5)]


@pytest.mark.parametrize(("world", "case"), [(2, "approx"), (3, "approx"), (4, "approx_cfg_pf")])
def test_pipefusion_after_warmup_equals_simulation_with_bounded_error(two, three, four, world, case):
    results = {2: two, 3: three, 4: four}[world]
    for rank, result in enumerate(results):
        r = result[case]
        assert r["vs_simulation"] == 0.0, (rank, r)  # same kernels, same shapes, bytes handed on unchanged
        assert r["deterministic"], (rank, r)
        assert 0.0 < r["max_abs"] and r["psnr"] >= MIN_PSNR_DB, (rank, r)  # pipelined for real, error bounded
    # one P2P hand-off per patch per pipelined call, one per warm-up call (cond and uncond: 2 streams)
    first = results[0][case]
    patches, warmup = {2: (4, 1), 3: (3, 2), 4: (4, 1)}[world]
    streams = 1 if world == 4 else 2
    assert first["handoffs"] == streams * (warmup + (STEPS - warmup) * patches)
    assert first["handoff_bytes"] == streams * STEPS * TOKENS * CHANNELS * 4
    assert all(r[case]["max_abs"] == first["max_abs"] for r in results)  # every rank returns the same output


@pytest.mark.parametrize("case", ["pf_ulysses_exact", "pf_ulysses_exact_uneven", "pf_ring_exact_uneven"])
def test_pipefusion_x_sequence_parallel_warmup_all_steps_equals_unpatched(four, case):
    """pipefusion=2 x ulysses=2 / ring=2 (world 4; M=3 cuts 8 tokens into 3, 3, 2: patches of an odd token
    count are padded per sp shard). Each sp rank hands its shard of every patch to the same sp rank of the
    next stage; the last stage's ranks gather the sequence and send the output on as without sp."""
    assert [r[case]["stage"] for r in four] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, result in enumerate(four):
        r = result[case]
        assert r["diff"] <= r["tol"], (rank, r)
        assert (r["handoff_bytes"], r["output_bytes"]) == r["analytic"], (rank, r)


@pytest.mark.parametrize(("case", "patches"), [("pf_ulysses_approx", 4), ("pf_ring_approx", 3)])
def test_pipefusion_x_sequence_parallel_after_warmup_equals_pipefusion_alone(four, case, patches):
    """Pipelined (warm-up 1): sequence parallel inside the stages is exact, so the output equals PipeFusion
    alone at the same M and warm-up (the one-process simulation) up to reassociation, and differs from the
    unpatched output by PipeFusion's own stale-K/V error."""
    for rank, result in enumerate(four):
        r = result[case]
        assert r["vs_pipefusion"] <= r["tol"], (rank, r)
        assert r["max_abs"] > 0.0, (rank, r)
        if r["stage"][0] == 0:  # one hand-off per patch per pipelined call, one per warm-up call; 2 streams
            assert r["handoffs"] == r["streams"] * (1 + (STEPS - 1) * patches), (rank, r)
        assert (r["handoff_bytes"], r["output_bytes"]) == r["analytic"], (rank, r)


def test_pipefusion_x_cfg_x_sequence_parallel_world_eight(eight):
    """cfg 2 x pipefusion 2 x ulysses 2 (warm-up every step: equals unpatched) and cfg 2 x pipefusion 2 x
    ring 2 pipelined (equals PipeFusion alone at the same M and warm-up). Rank order: cfg, stage, sp."""
    stages = [(s, i) for s in (0, 1) for i in (0, 1)] * 2
    for case in ("cfg_pf_ulysses_exact", "cfg_pf_ring_approx"):
        assert [r[case]["stage"] for r in eight] == stages, case
        for rank, result in enumerate(eight):
            r = result[case]
            assert r["streams"] == 1
            assert (r["handoff_bytes"], r["output_bytes"]) == r["analytic"], (case, rank, r)
    for rank, result in enumerate(eight):
        exact, approx = result["cfg_pf_ulysses_exact"], result["cfg_pf_ring_approx"]
        assert exact["diff"] <= exact["tol"], (rank, exact)
        assert approx["vs_pipefusion"] <= approx["tol"], (rank, approx)
        assert approx["max_abs"] > 0.0, (rank, approx)
        if approx["stage"][0] == 0:
            assert approx["handoffs"] == 1 + (STEPS - 1) * 4, (rank, approx)


def test_pipefusion_wan22_two_transformers_each_warm_up(two):
    for rank, result in enumerate(two):
        exact, pipelined = result["wan22"][6], result["wan22"][1]
        assert exact["vs_unpatched"] == 0.0 and exact["vs_simulation"] == 0.0, (rank, exact)
        assert pipelined["vs_simulation"] == 0.0 and pipelined["vs_unpatched"] > 0.0, (rank, pipelined)
        # both transformers ran (cond and uncond streams), each counting its own calls
        assert all(c > 0 for c in pipelined["calls"]) and sum(pipelined["calls"]) == 2 * 6, pipelined


def test_pipefusion_bad_configurations_raise_on_every_rank(two, four):
    expected = {
        "stages_over_blocks": "ValueError: pipefusion=2 stages but WanTransformer3DModel has only 1",
        "patches_zero": "ValueError: pipefusion_patches must be a positive int",
        "warmup_zero": "ValueError: pipefusion_warmup must be an int >= 1",
        "bad_blocks": "ValueError: pipefusion_blocks must be 2 positive ints",
        "without_pipefusion": "ValueError: pipefusion_patches=4 configure PipeFusion, but the plan has pipefusion=1",
        "training_at_apply": "ValueError: PipeFusion is inference only",
        "patches_over_tokens": "ValueError: pipefusion_patches=9 does not fit a sequence of 8 tokens",
        "grad_enabled": "RuntimeError: PipeFusion on WanTransformer3DModel is inference only",
        "training_at_call": "RuntimeError: PipeFusion on WanTransformer3DModel is inference only",
    }
    for rank, result in enumerate(two):
        for name, start in expected.items():
            assert start in result["errors"][name], (rank, name, result["errors"][name])
        assert result["errors"]["after_errors_exact"], rank
    sp_expected = {
        "heads": "ValueError: ulysses=2 exceeds the 1 attention heads of WanPipeline",
        "sd3": "ValueError: pipefusion=2 splits a transformer's blocks, but StableDiffusion3Pipeline has no "
        "transformer that hfpatch's PipeFusion supports",
        "patches_over_tokens": "ValueError: pipefusion_patches=9 does not fit a sequence of 8 tokens",
    }
    for rank, result in enumerate(four):
        for name, start in sp_expected.items():
            assert result["sp_errors"][name].startswith(start), (rank, name, result["sp_errors"][name])


def test_pipefusion_releases_other_stages_weights_and_remove_warns(two):
    for rank, result in enumerate(two):
        r = result["remove"]
        assert r["kept_without_release"] == r["total"] and r["restored_without_release"], (rank, r)
        assert r["after_release"] == r["expected_after"] and r["released_bytes"] == r["released_expected"]
        # each rank holds its own blocks plus the unsplit embeddings, norms and output projection
        assert r["after_release"] == r["total"] - r["blocks_bytes"] + r["own_blocks_bytes"]
        assert r["meta_blocks"] == [i for i in range(LAYERS) if i not in r["own"]]
        assert len(r["warnings"]) == 1 and "cannot restore them" in r["warnings"][0], r["warnings"]


# ----------------------------------------------------------------------------------------------- Flux
@pytest.mark.parametrize(
    ("case", "patches", "warmup"),
    [
        ("flux_pf_ulysses_exact", 5, FLUX_STEPS),
        ("flux_pf_ring_exact", 4, FLUX_STEPS),
        ("flux_pf_ulysses_approx", 4, 1),
        ("flux_pf_ring_approx", 5, 1),
    ],
)
def test_flux_pipefusion_x_sequence_parallel(four, case, patches, warmup):
    """Flux pipefusion=2 x ulysses=2 / ring=2 (world 4): every patch of the joint [text, image] sequence is cut
    into sp shards, each its text rows then its image rows (M=5: patches of 5 tokens, padded to 6; M=4: a
    shard of text and image rows). Warm-up every step equals unpatched; pipelined (warm-up 1) equals Flux
    PipeFusion alone at the same M and warm-up. Hand-off: each sp rank's padded shard of every patch."""
    assert [r[case]["stage"] for r in four] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, result in enumerate(four):
        r = result[case]
        if warmup == FLUX_STEPS:
            assert r["diff"] <= r["tol"], (rank, r)
        else:
            assert r["vs_pipefusion"] <= r["tol"] and r["max_abs"] > 0.0, (rank, r)
        if r["stage"][0] == 0:  # one hand-off per patch per pipelined call, one per warm-up call
            assert r["handoffs"] == warmup + (FLUX_STEPS - warmup) * patches, (rank, r)
        assert (r["handoff_bytes"], r["output_bytes"]) == r["analytic"], (rank, r)


def test_flux_simulation_warmup_every_step_equals_unpatched():
    assert torch.equal(_flux_simulated(patches=4, warmup=FLUX_STEPS), _flux_run(_flux_pipe()))


@pytest.mark.parametrize(
    ("world", "case", "stages"),
    [
        (2, "flux_exact", [(0, 0, 2), (1, 2, 6)]),  # stage 1: transformer_blocks 2 + single 0-2
        (3, "flux_exact", [(0, 0, 2), (1, 2, 3), (2, 3, 6)]),
        (4, "flux_exact_p4", [(0, 0, 1), (1, 1, 2), (2, 2, 3), (3, 3, 6)]),
        (4, "flux_exact_cfg_pf", [(0, 0, 2), (1, 2, 6), (0, 0, 2), (1, 2, 6)]),  # true CFG, negative prompt
    ],
)
def test_flux_pipefusion_warmup_all_steps_equals_unpatched(two, three, four, world, case, stages):
    results = {2: two, 3: three, 4: four}[world]
    for rank, result in enumerate(results):
        r = result[case]
        assert r["shape"][0] == r["shape"][1]
        assert r["diff"] <= r["tol"] and r["sent"] == r["analytic"], (rank, r)
    assert [r[case]["stage"] for r in results] == stages


@pytest.mark.parametrize(
    ("world", "case"), [(2, "flux_approx"), (3, "flux_approx"), (4, "flux_approx_cfg_pf")]
)
def test_flux_pipefusion_after_warmup_equals_simulation_with_bounded_error(two, three, four, world, case):
    results = {2: two, 3: three, 4: four}[world]
    for rank, result in enumerate(results):
        r = result[case]
        assert r["vs_simulation"] == 0.0, (rank, r)
        assert r["deterministic"], (rank, r)
        assert 0.0 < r["max_abs"] and r["psnr"] >= MIN_PSNR_DB, (rank, r)
    first = results[0][case]
    patches, warmup = {2: (4, 1), 3: (3, 2), 4: (4, 1)}[world]
    # one hand-off per patch per pipelined call, one per warm-up call; with true CFG at cfg=2 the first step
    # also ran the other branch's call on this rank (one more warm-up call, in its own stream)
    extra = 1 if world == 4 else 0
    assert first["handoffs"] == warmup + (FLUX_STEPS - warmup) * patches + extra
    assert first["handoff_bytes"] == (FLUX_STEPS + extra) * (FLUX_TEXT + FLUX_IMAGE) * FLUX_WIDTH * 4
    assert all(r[case]["max_abs"] == first["max_abs"] for r in results)


def test_flux_pipefusion_releases_other_stages_weights(two):
    for rank, result in enumerate(two):
        r = result["flux_weights"]
        assert r["after"] == r["expected"] and r["released"][0] == r["released"][1], (rank, r)
        assert r["meta"] == [i for i in range(FLUX_DUAL + FLUX_SINGLE) if i not in r["own"]]
        assert len(r["warnings"]) == 1 and "cannot restore them" in r["warnings"][0], r["warnings"]
    assert "Model.transformer_blocks 0-1 on this rank" in two[1]["flux_weights"]["warnings"][0]
    assert (
        "transformer_blocks 2, single_transformer_blocks 0-2 on this rank"
        in two[0]["flux_weights"]["warnings"][0]
    )
    # byte-balanced stages: each rank holds at most 1.1/P of the block weights (block counts 2 and 4)
    for result in two:
        r = result["flux_weights"]
        assert r["own_block_bytes"] <= 1.1 / 2 * r["block_bytes"], r


def test_flux_pipefusion_bad_configurations_raise_on_every_rank(two):
    expected = {
        "stages_over_blocks": "ValueError: pipefusion=2 stages but FluxTransformer2DModel has only 1 transformer",
        "custom_processor": "ValueError: FluxTransformer2DModel.single_transformer_blocks.1.attn uses attention "
        "processor CustomProcessor",
        "controlnet": "ValueError: PipeFusion on FluxTransformer2DModel does not support ControlNet residuals",
        "patches_over_tokens": "ValueError: pipefusion_patches=25 does not fit a sequence of 24 tokens",
    }
    for rank, result in enumerate(two):
        for name, start in expected.items():
            assert result["flux_errors"][name].startswith(start), (rank, name, result["flux_errors"][name])
        assert result["flux_errors"]["after_errors_exact"], rank


# ----------------------------------------------------------------------------------------------- planner
def test_planner_pipefusion_opt_in_spawned(two):
    for rank, result in enumerate(two):
        r = result["planner"]
        assert r["wan"]["plan"] == (2, 1, 2) and r["wan"]["diff"] <= r["wan"]["tol"], (rank, r["wan"])
        flux = r["flux"]
        assert flux["plan"] == (1, 2, 1, 1, 2), (rank, flux)  # cfg, pipefusion, ulysses, ring, vae
        assert flux["diff"] <= flux["tol"] and flux["sent"] == flux["analytic"], (rank, flux)
        assert r["default_flux_plan"] == (1, 1, 2), rank  # parallel=2 alone: Ulysses, never PipeFusion


def test_planner_pipefusion_opt_in_one_process_and_misuse():
    pipe = _flux_pipe()
    reference = _flux_run(pipe)
    # parallel=1 (one process): the planner had one rank for PipeFusion; its options are then moot, not errors
    with hfpatch.apply(pipe, 1, pipefusion=True, pipefusion_warmup=2) as patch:
        assert patch.plan.pipefusion == 1 and patch.plan.world_size == 1
        assert torch.equal(_flux_run(pipe), reference)
    with pytest.raises(ValueError, match="pipefusion must be True or False"):
        hfpatch.apply(pipe, 1, pipefusion="yes")
    with pytest.raises(ValueError, match="set ParallelConfig\\(pipefusion=P, ...\\) there instead"):
        hfpatch.apply(pipe, ParallelConfig(), pipefusion=True)
    with pytest.raises(TypeError, match="unknown option 'pipefusion' for StableDiffusion3Pipeline"):
        hfpatch.apply(tiny_sd3_pipe(), 1, pipefusion=True)  # no PipeFusion family for SD3 (yet)
