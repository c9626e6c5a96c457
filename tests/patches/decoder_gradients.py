"""The comparisons shared by the decoder tests (``test_decoder_usp.py``, ``test_decoder_families.py``): the
unpatched model's outputs and their fp32 noise (:func:`forward_references`), and every parameter gradient of a
patched decoder, averaged over the sp group, against the unpatched model's (:func:`backward_cases`). Each case's
reference is computed on one rank of the pool and shared (``hfpatch.testing.runner.spread``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import hfpatch
from hfpatch import ParallelConfig, all_reduce_gradients
from hfpatch.testing.runner import spread
from hfpatch.testing.tolerance import rel_error, to_fp64


def grads(
    model: torch.nn.Module, kwargs: dict[str, Any], objective: Callable, patched: bool
) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    objective(model(**kwargs)).backward()
    if patched:
        all_reduce_gradients(model)  # the MEAN over the sp group (what DDP computes)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def forward_references(
    cases: list[str], build: Callable, outputs: Callable
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, float]]]:
    """Per case: the unpatched model's outputs and each output's fp32 noise (its error against the fp64 twin)."""

    def reference(case: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        model, kwargs = build(case)
        with torch.no_grad():
            ref = outputs(model(**kwargs))
            ref64 = outputs(to_fp64(model)(**to_fp64(build(case)[1])))
        return ref, {k: rel_error(ref[k], ref64[k]) for k in ref}

    return spread(cases, reference)


def gradient_reference(
    model: torch.nn.Module, kwargs: dict[str, Any], kwargs64: dict[str, Any], objective: Callable
) -> tuple[dict[str, torch.Tensor], dict[str, float], float]:
    """The unpatched gradients of ``model`` (left in fp32, its grads cleared), each one's error scale, and their fp32
    noise against the fp64 twin (``kwargs64``: inputs of its own, converted here)."""
    ref = grads(model, kwargs, objective, patched=False)
    ref64 = grads(to_fp64(model), to_fp64(kwargs64), objective, patched=False)
    model.zero_grad(set_to_none=True)
    # Errors relative to max(|ref|, 1% of the largest gradient): some gradients are exactly zero in exact
    # arithmetic (key biases; rounding noise only).
    floor = 0.01 * max(g.abs().max().item() for g in ref64.values())
    scales = {n: max(g.abs().max().item(), floor) for n, g in ref64.items()}
    return ref, scales, max(rel_error(ref[n], ref64[n], scales[n]) for n in ref)


def backward_cases(
    cases: list[tuple[str, int, int, str]], build: Callable, objective: Callable
) -> dict[tuple, dict[str, Any]]:
    """Per ``(case, ulysses, ring, sp_output)``: every parameter gradient's error (after the mean over the sp
    group) and the fp32 noise; an ``sp_output`` ending in ``+replicate`` also sets ``sp_vision="replicate"``."""

    def reference(case: str) -> tuple[dict[str, torch.Tensor], dict[str, float], float]:
        model, kwargs = build(case)
        model.train()
        return gradient_reference(model, kwargs, build(case)[1], objective)

    refs = spread([case for case, *_ in cases], reference)  # each case's reference on one rank
    results = {}
    for case, ulysses, ring, output in cases:
        model, kwargs = build(case)
        model.train()
        ref, scales, noise = refs[case]
        options = dict(sp_output=output.removesuffix("+replicate"))
        if output.endswith("+replicate"):
            options["sp_vision"] = "replicate"
        with hfpatch.apply(model, parallel=ParallelConfig(ulysses=ulysses, ring=ring), **options):
            got = grads(model, kwargs, objective, patched=True)
        results[(case, ulysses, ring, output)] = {
            "keys_match": set(got) == set(ref),
            "n_params": len(ref),
            "errors": {n: rel_error(got[n], ref[n], scales[n]) for n in ref if n in got},
            "noise": noise,
        }
    return results
