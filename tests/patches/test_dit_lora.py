"""peft LoRA on sequence-parallel DiT transformers: added before or after ``hfpatch.apply``, same outputs and
LoRA gradients as the unpatched model with the same adapter (gloo, fp32).

The USP processors call the attention's projections as modules (``attn.to_q(x)``), so peft's wrapped
``lora.Linear`` layers run unchanged whether they were injected before the patch or after it; a wrapped
``proj_out`` (where the plan gathers the sequence) gets the gather moved onto the wrapper at the next call.
Tolerances as in ``test_dit_usp.py``: ``reassociation_tol`` of the unpatched model's own fp32-vs-fp64 error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_dit_usp import _double, build

import hfpatch
from hfpatch import ParallelConfig, all_reduce_gradients
from hfpatch.distributed.runtime import get_mesh
from hfpatch.testing.tolerance import reassociation_tol, rel_error

FAMILIES = ("wan21", "flux", "sd3", "cogvideox")


ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
# proj_out carries the plan's final gather: peft wraps it, and the gather must move onto the wrapper (after the
# LoRA term). Tested on its own: its gradients come from the output directly, while adding it to the attention
# adapters only shifts the ring-attention q/k gradient noise the tolerance is calibrated on.
PROJ_OUT = ("proj_out",)


def _add_lora(model: torch.nn.Module, targets: tuple[str, ...] = ATTENTION, dropout: float = 0.0) -> None:
    from peft import LoraConfig

    # The same adapter weights on every model and rank. peft draws them from the global RNG (no generator
    # argument): seed it inside fork_rng so the session-long rank processes get their RNG state back.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        # init_lora_weights=False: a random (non-zero) B, so the adapter changes the output.
        model.add_adapter(
            LoraConfig(
                r=2, lora_alpha=4, lora_dropout=dropout, target_modules=list(targets), init_lora_weights=False
            )
        )


def _run(model: torch.nn.Module, kwargs: dict[str, Any], weight: torch.Tensor, group=None):
    """Output and LoRA gradients of a fixed linear loss (summed over ``group`` when given)."""
    model.zero_grad(set_to_none=True)
    out = model(**kwargs).sample
    (out * weight).sum().backward()
    all_reduce_gradients([model], group)
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}
    return out.detach(), grads


def lora_cases(cases: list[tuple[str, str, int, int, tuple]]) -> dict[tuple, dict[str, Any]]:
    """Per case ``(family, when, ulysses, ring, targets)`` with ``when`` in ``"before"``/``"after"`` the apply."""
    results = {}
    for family, when, ulysses, ring, targets in cases:
        reference, kwargs, _ = build(family)
        _add_lora(reference, targets)
        reference.train()
        reference64, kwargs64 = _double(reference, kwargs)
        weight = torch.randn(reference(**kwargs).sample.shape, generator=torch.Generator().manual_seed(7))
        ref_out, ref_grads = _run(reference, kwargs, weight)
        out64, grads64 = _run(reference64, kwargs64, weight.double())

        model = build(family)[0]
        if when == "before":
            _add_lora(model, targets)
        config = ParallelConfig(ulysses=ulysses, ring=ring)
        patch = hfpatch.apply(model, parallel=config)
        if when == "after":
            _add_lora(model, targets)
        model.train()
        out, grads = _run(model, kwargs, weight, get_mesh(config).group("sp"))
        patch.remove()
        with torch.no_grad():  # the adapter outlives the patch
            after_remove = rel_error(model(**kwargs).sample, ref_out)

        floor = 0.01 * max(g.abs().max().item() for g in grads64.values())
        scales = {n: max(g.abs().max().item(), floor) for n, g in grads64.items()}
        results[(family, when, ulysses, ring, targets)] = {
            "n_lora": len(ref_grads),
            "same_names": set(grads) == set(ref_grads),
            "out": (rel_error(out, ref_out), rel_error(ref_out, out64)),
            "grads": (
                max(rel_error(grads[n], ref_grads[n], scales[n]) for n in ref_grads),
                max(rel_error(ref_grads[n], grads64[n], scales[n]) for n in ref_grads),
            ),
            "after_remove": after_remove,
            "lora_changes_output": rel_error(ref_out, build(family)[0](**kwargs).sample.detach()),
        }
    return results


@pytest.mark.parametrize("world, ulysses, ring", [(2, 2, 1), (4, 2, 2)])
def test_lora_before_or_after_apply_matches_unpatched_output_and_grads(rank_pool, world, ulysses, ring):
    cases = [
        (family, when, ulysses, ring, targets)
        for family in FAMILIES
        for when, targets in (("before", ATTENTION), ("after", ATTENTION), ("after", PROJ_OUT))
    ]
    results = rank_pool(world).run(lora_cases, cases)
    for rank, rank_result in enumerate(results):
        for case in cases:
            result = rank_result[case]
            assert result["same_names"] and result["n_lora"] >= 2 * len(case[-1]), (rank, case, result)
            assert result["lora_changes_output"] > 1e-3, (rank, case)  # the adapter is not a no-op
            error, noise = result["out"]
            assert error <= reassociation_tol(noise), (rank, case, "output", error, noise)
            error, noise = result["grads"]
            assert error <= reassociation_tol(noise), (rank, case, "lora grads", error, noise)
            # The same stock computation as the reference: only the floor of single roundings is allowed.
            assert result["after_remove"] <= reassociation_tol(0.0), (rank, case, result["after_remove"])


def dropout_cases() -> dict[str, Any]:
    """A LoRA with ``lora_dropout=0.1`` (added after ``apply``) on Wan at Ulysses 2: refused in training mode, run
    in eval mode."""
    model, kwargs, _ = build("wan21")
    report: dict[str, Any] = {}
    with hfpatch.apply(model, parallel=ParallelConfig(ulysses=2)):
        _add_lora(model, dropout=0.1)
        model.train()
        try:
            model(**kwargs)
            report["train"] = None
        except ValueError as error:
            report["train"] = str(error)
        model.eval()
        with torch.no_grad():
            report["eval"] = tuple(model(**kwargs).sample.shape)
    return report


def test_lora_dropout_under_sequence_parallelism_is_refused_by_name(rank_pool):
    """Issue 51: dropout inside a sequence-parallel forward draws per-shard masks (not the slice of the unpatched
    model's mask): refused on every rank alike, naming the modules and the LoRA option; eval mode runs."""
    reports = rank_pool(2).run(dropout_cases)
    said = reports[0]["train"]
    assert said is not None and all(r["train"] == said for r in reports), reports
    assert "blocks.0.attn1.to_q.lora_dropout.default (Dropout, p=0.1)" in said, said
    assert "LoraConfig(lora_dropout=0.0)" in said, said
    assert all(r["eval"] == reports[0]["eval"] for r in reports)
