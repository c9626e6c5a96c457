"""Gradients of a sequence-parallel model inside the wrappers training scripts use (2 gloo ranks).

``all_reduce_gradients`` finds the patch of a wrapped model: DDP (what ``accelerator.prepare`` returns on
several ranks) and ``torch.compile``, on a sequence-parallel stock Wan transformer (ulysses=2). Under DDP
the gradient is already the group's mean (the full gradient), and averaging it again changes nothing; under
compile the mean of the ``N``-scaled shares is the full gradient.

Training-loop setups under DDP (no hfpatch line after ``prepare``) are in ``test_ddp_training.py``.

Every result equals the unpatched model's within ``reassociation_tol`` of its fp32-vs-fp64 noise (the split
only reorders sums).
"""

from __future__ import annotations

from typing import Any

import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64


def _inputs(sample: int = 0, batch: int = 1) -> tuple[torch.Tensor, ...]:
    """Samples ``sample .. sample + batch - 1`` of a fixed data set (each sample drawn from its own seed)."""
    x = torch.cat(
        [
            torch.randn(1, 4, 1, 10, 10, generator=torch.Generator().manual_seed(1 + i))
            for i in range(sample, sample + batch)
        ]
    )
    text = torch.cat([wan_prompt_embeds(1, 6, seed=1 + i) for i in range(sample, sample + batch)])
    return x, torch.tensor([500] * batch), text


def _grads(model: torch.nn.Module, call: Any, inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    out = call(*inputs).sample
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)  # same draw
    (out * weight).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _wrapped_cases() -> dict[str, tuple[float, float]]:
    from torch.nn.parallel import DistributedDataParallel

    reference_model = tiny_wan_transformer()
    reference = _grads(reference_model, reference_model, _inputs())
    model64 = to_fp64(reference_model)
    model64.zero_grad(set_to_none=True)
    reference64 = _grads(model64, model64, to_fp64(_inputs()))
    floor = 0.01 * max(g.abs().max().item() for g in reference64.values())
    scales = {n: max(g.abs().max().item(), floor) for n, g in reference64.items()}
    noise = max(rel_error(reference[n], reference64[n], scales[n]) for n in reference)

    results = {}
    for wrapper in ("ddp", "compile"):
        model = tiny_wan_transformer()
        with hfpatch.apply(model, parallel=ParallelConfig(ulysses=2)):
            if wrapper == "ddp":
                wrapped = DistributedDataParallel(model, find_unused_parameters=True)
            else:
                wrapped = torch.compile(model, backend="eager")
            grads = _grads(model, wrapped, _inputs())
            for name, p in model.named_parameters():  # DDP: the mean already; compile: N x the shares
                assert p.grad is None or torch.equal(p.grad, grads[name])
            hfpatch.all_reduce_gradients(wrapped)  # the wrapper, as the training script holds it
            reduced = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert reduced.keys() == reference.keys(), sorted(set(reduced) ^ set(reference))
        results[wrapper] = (max(rel_error(reduced[n], reference[n], scales[n]) for n in reference), noise)
    return results


def test_all_reduce_gradients_sees_through_ddp_and_compile(rank_pool):
    for rank_results in rank_pool(2).run(_wrapped_cases):
        for wrapper, (error, noise) in rank_results.items():
            assert error <= reassociation_tol(noise), (wrapper, error, noise)
