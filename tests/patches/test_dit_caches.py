"""diffusers' step caches and hooks composed with hfpatch's sequence and CFG parallelism, end to end, gloo, fp32.

Every rank builds the same tiny pipeline with the same cache (``transformer.enable_cache``) and runs it unpatched
(the reference: what the cache does on one rank) and patched. The patched output must equal the reference within
``reassociation_tol`` of the uncached pipeline's own fp32-vs-fp64 noise, every rank must return the same output,
and FirstBlockCache's skip decisions (the only metric-driven cache: the others follow step counters) must be
identical on every rank and equal to the reference's, with both outcomes present (the cache really skipped).
Pipelines: ``QwenImagePipeline`` (true CFG, two calls per step) and ``LTXPipeline`` (batched CFG, whose split
batch makes the decision metric a sum over the cfg ranks too), 6 steps, 25 image tokens (every world pads).

Caches that cannot agree are refused at ``apply`` with a clear error (SeaCache always; FasterCache with CFG;
PyramidAttentionBroadcast with two-call CFG parallel; MagCache calibration), and so is a cache enabled after
``apply``, at the next call, on every rank, before any collective.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

STEPS = 6


def _pipe(name: str) -> Any:
    from hfpatch.testing import tiny_ltx_pipe, tiny_qwenimage_pipe

    return {"qwenimage": tiny_qwenimage_pipe, "ltx": tiny_ltx_pipe}[name]()


def _run(name: str, pipe: Any) -> torch.Tensor:
    from test_dit_pipelines import _ltx_inputs, _qwen_inputs

    if name == "qwenimage":
        inputs = _qwen_inputs()
        if pipe.transformer.dtype == torch.float64:
            inputs = to_fp64(inputs)
        return pipe(
            **inputs, true_cfg_scale=4.0, height=20, width=20, num_inference_steps=STEPS, output_type="pt"
        ).images
    inputs = _ltx_inputs()
    if pipe.transformer.dtype == torch.float64:
        inputs = to_fp64(inputs)
    return pipe(
        **inputs, guidance_scale=3.0, height=160, width=160, num_frames=1, num_inference_steps=STEPS,
        output_type="latent",
    ).frames  # fmt: skip


def _cache(kind: str, pipe: Any) -> Any:
    import diffusers

    if kind == "fbc":
        # Tiny random models change a lot between steps (metrics 0.85 to 3.0): thresholds that skip some steps,
        # 9% or more away from every metric of the reference run.
        threshold = 1.0 if type(pipe).__name__ == "QwenImagePipeline" else 1.2
        return diffusers.FirstBlockCacheConfig(threshold=threshold)
    if kind == "taylorseer":
        # fp32 Taylor factors: the default bf16 storage rounds the two runs' reassociation differences to bf16
        return diffusers.TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=1, max_order=1, taylor_factors_dtype=torch.float32
        )
    if kind == "magcache":
        return diffusers.MagCacheConfig(
            threshold=0.5,
            max_skip_steps=1,
            retention_ratio=0.0,
            num_inference_steps=STEPS,
            mag_ratios=[1.2] * STEPS,
        )
    if kind == "pab":
        return diffusers.PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep,
        )
    if kind == "faster":
        return diffusers.FasterCacheConfig(current_timestep_callback=lambda: pipe.current_timestep)
    if kind == "sea":
        return diffusers.SeaCacheConfig()
    raise ValueError(kind)


def _recorded(pipe: Any) -> list[tuple[str | None, bool]]:
    """Record the reference FirstBlockCache decisions of an unpatched pipe, as ``(cache context, decision)``
    (wraps the leader hook's method)."""
    decisions: list[tuple[str | None, bool]] = []
    for module in pipe.transformer.modules():
        for name, hook in getattr(getattr(module, "_diffusers_hook", None), "hooks", {}).items():
            if name == "fbc_leader_block_hook":
                decide = hook._should_compute_remaining_blocks

                def record(residual, decide=decide, hook=hook):
                    context = getattr(hook.state_manager._context, "name", None)
                    decisions.append((context, decide(residual)))
                    return decisions[-1][1]

                hook._should_compute_remaining_blocks = record
    return decisions


def _by_context(decisions: list[tuple[str | None, bool]]) -> dict[str | None, list[bool]]:
    out: dict[str | None, list[bool]] = {}
    for context, decision in decisions:
        out.setdefault(context, []).append(decision)
    return out


def _configs(world: int) -> dict[str, tuple[str, str, ParallelConfig]]:
    """Caches per pipeline where diffusers' own cache works on the tiny model: TaylorSeer changes nothing on the
    tiny LTX (its block identifiers), PyramidAttentionBroadcast breaks QwenImage's two calls of different text
    lengths on its own (it reuses one call's attention for the other), FasterCache runs on neither."""
    half = world // 2
    cases = {}
    for kind in ("fbc", "taylorseer", "magcache"):
        cases[f"qwenimage {kind} ulysses={world}"] = ("qwenimage", kind, ParallelConfig(ulysses=world))
        cases[f"qwenimage {kind} cfg=2 ring={half}"] = ("qwenimage", kind, ParallelConfig(cfg=2, ring=half))
    for kind in ("fbc", "magcache", "pab"):
        cases[f"ltx {kind} ring={world}"] = ("ltx", kind, ParallelConfig(ring=world))
        cases[f"ltx {kind} cfg=2 ulysses={half}"] = ("ltx", kind, ParallelConfig(cfg=2, ulysses=half))
    return cases


# ----------------------------------------------------------------------------------------------- rank functions
def cache_cases() -> dict[str, dict[str, Any]]:
    """Per case: error vs the same cache unpatched, the uncached noise, the output, the decisions (FBC)."""
    from hfpatch.patches.caches import FirstBlockDecision

    world = dist.get_world_size()
    # Per pipeline: the uncached output and its fp64 noise; per (pipeline, cache): the cached reference and its
    # decisions. Both are independent of the parallel layout, so each is computed once for all its cases.
    uncached: dict[str, torch.Tensor] = {}
    noise: dict[str, float] = {}
    references: dict[tuple[str, str], tuple[torch.Tensor, list]] = {}
    results = {}
    for case, (name, kind, parallel) in _configs(world).items():
        if name not in noise:
            plain = _pipe(name)
            uncached[name] = _run(name, plain)
            noise[name] = rounding_noise(uncached[name], _run(name, to_fp64(plain)))
        if (name, kind) not in references:
            reference_pipe = _pipe(name)
            reference_pipe.transformer.enable_cache(_cache(kind, reference_pipe))
            reference_decisions = _recorded(reference_pipe)
            references[name, kind] = (_run(name, reference_pipe), reference_decisions)
        reference, reference_decisions = references[name, kind]
        pipe = _pipe(name)
        pipe.transformer.enable_cache(_cache(kind, pipe))
        with hfpatch.apply(pipe, parallel=parallel):
            out = _run(name, pipe)
            deciders = [
                value
                for module in pipe.transformer.modules()
                for hook in getattr(getattr(module, "_diffusers_hook", None), "hooks", {}).values()
                for value in vars(hook).values()
                if isinstance(value, FirstBlockDecision)
            ]
        results[case] = {
            "error": rel_error(out, reference),
            "noise": noise[name],
            "cache_effect": rel_error(reference, uncached[name]),
            "out": out,
            "decisions": [list(d.decisions) for d in deciders],
            "reference_decisions": reference_decisions,
        }
    return results


def refusal_cases() -> dict[str, str]:
    """Errors at apply (or at the first call) for caches that cannot agree, the same on every rank."""
    world = dist.get_world_size()
    messages = {}

    def expect(case: str, name: str, kind: str, parallel: ParallelConfig, after: bool = False) -> None:
        pipe = _pipe(name)
        try:
            if after:
                with hfpatch.apply(pipe, parallel=parallel):
                    pipe.transformer.enable_cache(_cache(kind, pipe))
                    _run(name, pipe)
            else:
                pipe.transformer.enable_cache(_cache(kind, pipe))
                hfpatch.apply(pipe, parallel=parallel)
        except (ValueError, RuntimeError) as exc:
            messages[case] = f"{type(exc).__name__}: {exc}"
        else:
            messages[case] = "no error"

    expect("sea", "ltx", "sea", ParallelConfig(ring=world))
    expect("sea_cfg", "ltx", "sea", ParallelConfig(cfg=2, ulysses=world // 2))
    expect("sea_two_call", "qwenimage", "sea", ParallelConfig(cfg=2, ring=world // 2))
    expect("faster_cfg", "ltx", "faster", ParallelConfig(cfg=2, ulysses=world // 2))
    expect("faster_two_call", "qwenimage", "faster", ParallelConfig(cfg=2, ring=world // 2))
    expect("pab_two_call", "qwenimage", "pab", ParallelConfig(cfg=2, ulysses=world // 2))
    expect("after_apply", "ltx", "fbc", ParallelConfig(ulysses=world), after=True)
    pipe = _pipe("ltx")
    import diffusers

    pipe.transformer.enable_cache(diffusers.MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
    try:
        hfpatch.apply(pipe, parallel=ParallelConfig(ring=world))
        messages["mag_calibrate"] = "no error"
    except ValueError as exc:
        messages["mag_calibrate"] = f"ValueError: {exc}"
    return messages


# ----------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 4])
def test_caches_with_sequence_and_cfg_parallel_equal_the_same_cache_on_one_rank(rank_pool, world):
    results = rank_pool(world).run(cache_cases)
    for case, (_, kind, parallel) in _configs(world).items():
        for rank, result in enumerate(r[case] for r in results):
            assert result["error"] <= reassociation_tol(result["noise"]), (rank, case, result["error"])
            # The cache really changed the result (it skipped or extrapolated something).
            assert result["cache_effect"] > 1e-3, (case, result["cache_effect"])
        outputs = [r[case]["out"] for r in results]
        assert all(torch.equal(outputs[0], o) for o in outputs[1:]), (
            f"{case}: ranks returned different outputs"
        )
        if kind != "fbc":
            continue
        reference = _by_context(results[0][case]["reference_decisions"])
        assert any(False in d for d in reference.values()) and any(True in d for d in reference.values()), (
            reference
        )
        seen: dict[str | None, list[bool]] = {}
        for rank, result in enumerate(r[case] for r in results):
            assert len(result["decisions"]) == 1, (rank, case)  # one decider: the one FirstBlockCache
            for context, decisions in _by_context(result["decisions"][0]).items():
                # Every decision this rank took is the one rank's decision for that call (a prefix: under
                # two-call CFG parallel a cfg rank computes the other context's call only in the observed step).
                assert decisions == reference[context][: len(decisions)], (rank, case, context, decisions)
                seen[context] = max(seen.get(context, []), decisions, key=len)
        assert seen == reference, (case, seen, reference)  # every call decided somewhere, in full
        # The ranks that compute the same calls (all of them, except the cfg halves of two-call CFG) agree.
        if not (parallel.cfg == 2 and case.startswith("qwenimage")):
            assert all(r[case]["decisions"] == results[0][case]["decisions"] for r in results), case


def test_caches_that_cannot_agree_are_refused_on_every_rank(rank_pool):
    results = rank_pool(2).run(refusal_cases)
    assert results[0] == results[1]
    messages = results[0]
    for case in ("sea", "sea_cfg", "sea_two_call"):
        assert (
            "SeaCache enabled: it all-reduces its skip vote over the default process group" in messages[case]
        )
    for case in ("faster_cfg", "faster_two_call"):
        assert "FasterCache enabled: its denoiser hook splits each call's batch" in messages[case]
    assert "PyramidAttentionBroadcast enabled: its counters advance at every call" in messages["pab_two_call"]
    assert "step cache was enabled or changed after hfpatch.apply" in messages["after_apply"]
    assert "MagCache in calibration mode" in messages["mag_calibrate"]
