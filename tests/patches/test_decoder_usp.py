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

import pytest
import torch
import torch.distributed as dist
from decoder_cases import CASES, build, objective, outputs

import hfpatch
from hfpatch import ParallelConfig, all_reduce_gradients
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64

ALL = list(CASES)
#: Backward at worlds 3 and 4: one text and the three VL families (all of them run at world 2).
BACKWARD_SUBSET = [
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
    refs: dict[str, tuple[dict[str, torch.Tensor], dict[str, float]]] = {}
    rank, world = dist.get_rank(), dist.get_world_size()
    for case, ulysses, ring, output in cases:
        model, kwargs = build(case)
        with torch.no_grad():
            if case not in refs:
                ref = outputs(model(**kwargs))
                ref64 = outputs(to_fp64(model)(**to_fp64(build(case)[1])))
                refs[case] = (ref, {k: rel_error(ref[k], ref64[k]) for k in ref})
            ref, noise = refs[case]
            with hfpatch.apply(model, parallel=ParallelConfig(ulysses=ulysses, ring=ring), sp_output=output):
                got = outputs(model(**kwargs))
        found = {}
        for name, value in got.items():
            expected = ref[name]
            if output == "shard" and name in (
                "logits",
                "last_hidden_state",
            ):  # this rank's shard of the sequence
                from hfpatch.patches.decoder import shard_tokens

                expected = shard_tokens(expected, 1, world, rank)
                valid = min(expected.shape[1], max(0, ref[name].shape[1] - rank * expected.shape[1]))
                value, expected = value[:, :valid], expected[:, :valid]
            assert value.shape == expected.shape and value.dtype == expected.dtype, (case, name, value.shape)
            found[name] = (rel_error(value, expected, ref[name].abs().max().item()), noise[name], value)
        results[(case, ulysses, ring, output)] = found
    return results


def _grads(model: torch.nn.Module, kwargs: dict[str, Any], patched: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    objective(model(**kwargs)).backward()
    if patched:
        all_reduce_gradients(model)  # the MEAN over the sp group (what DDP computes)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def backward_cases(cases: list[tuple[str, int, int, str]]) -> dict[tuple, dict[str, Any]]:
    """Per case: every parameter gradient's error (after the mean over the sp group) and the fp32 noise."""
    results = {}
    refs: dict[str, tuple[dict[str, torch.Tensor], dict[str, float], float]] = {}
    for case, ulysses, ring, output in cases:
        model, kwargs = build(case)
        model.train()
        if case not in refs:
            ref = _grads(model, kwargs, patched=False)
            model64 = to_fp64(model)
            ref64 = _grads(model64, to_fp64(build(case)[1]), patched=False)
            # Errors relative to max(|ref|, 1% of the largest gradient): some gradients are exactly zero in
            # exact arithmetic (key biases; rounding noise only).
            floor = 0.01 * max(g.abs().max().item() for g in ref64.values())
            scales = {n: max(g.abs().max().item(), floor) for n, g in ref64.items()}
            noise = max(rel_error(ref[n], ref64[n], scales[n]) for n in ref)
            refs[case] = (ref, scales, noise)
        ref, scales, noise = refs[case]
        with hfpatch.apply(model, parallel=ParallelConfig(ulysses=ulysses, ring=ring), sp_output=output):
            got = _grads(model, kwargs, patched=True)
        results[(case, ulysses, ring, output)] = {
            "keys_match": set(got) == set(ref),
            "n_params": len(ref),
            "errors": {n: rel_error(got[n], ref[n], scales[n]) for n in ref if n in got},
            "noise": noise,
        }
    return results


# ----------------------------------------------------------------------------------------------- tests
def _check_forward(results: list[dict], cases: list[tuple]) -> None:
    for case in cases:
        for rank, rank_result in enumerate(results):
            for name, (error, noise, _) in rank_result[case].items():
                assert error <= reassociation_tol(noise), (rank, case, name, error, noise)
        if case[3] == "full":  # every rank gathers the same shards: identical outputs
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
    cases += [(case, world, 1, "shard") for case in ("qwen3_left", "qwen3_vl_right", "qwen3_vl_base")]
    _check_forward(rank_pool(world).run(forward_cases, cases), cases)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_decoder_backward_every_parameter_gradient_matches_unpatched(rank_pool, world):
    names = ALL if world == 2 else BACKWARD_SUBSET
    configs = _configs(world) if world < 4 else [(2, 2), (1, 4)]
    cases = [(case, u, r, "full") for case in names for u, r in configs]
    cases += [(case, 1, world, "shard") for case in ("qwen3_packed", "qwen3_vl_left")]
    _check_backward(rank_pool(world).run(backward_cases, cases), cases)
