"""The backward comparison shared by the decoder tests (``test_decoder_usp.py``, ``test_decoder_families.py``):
every parameter gradient of a patched decoder, averaged over the sp group, against the unpatched model's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import hfpatch
from hfpatch import ParallelConfig, all_reduce_gradients
from hfpatch.testing.tolerance import rel_error, to_fp64


def grads(
    model: torch.nn.Module, kwargs: dict[str, Any], objective: Callable, patched: bool
) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    objective(model(**kwargs)).backward()
    if patched:
        all_reduce_gradients(model)  # the MEAN over the sp group (what DDP computes)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def backward_cases(
    cases: list[tuple[str, int, int, str]], build: Callable, objective: Callable
) -> dict[tuple, dict[str, Any]]:
    """Per ``(case, ulysses, ring, sp_output)``: every parameter gradient's error (after the mean over the sp
    group) and the fp32 noise; an ``sp_output`` ending in ``+replicate`` also sets ``sp_vision="replicate"``."""
    results = {}
    refs: dict[str, tuple[dict[str, torch.Tensor], dict[str, float], float]] = {}
    for case, ulysses, ring, output in cases:
        model, kwargs = build(case)
        model.train()
        if case not in refs:
            ref = grads(model, kwargs, objective, patched=False)
            ref64 = grads(to_fp64(model), to_fp64(build(case)[1]), objective, patched=False)
            # Errors relative to max(|ref|, 1% of the largest gradient): some gradients are exactly zero in
            # exact arithmetic (key biases; rounding noise only).
            floor = 0.01 * max(g.abs().max().item() for g in ref64.values())
            scales = {n: max(g.abs().max().item(), floor) for n, g in ref64.items()}
            refs[case] = (ref, scales, max(rel_error(ref[n], ref64[n], scales[n]) for n in ref))
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
