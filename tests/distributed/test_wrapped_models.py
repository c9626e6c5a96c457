"""Gradients of a sequence-parallel model inside the wrappers training scripts use (2 gloo ranks).

``all_reduce_gradients`` finds the patch of a wrapped model: DDP (what ``accelerator.prepare`` returns on
several ranks) and ``torch.compile``, on a sequence-parallel stock Wan transformer (ulysses=2). Under DDP
over the two sequence-parallel ranks, DDP first averages the two shares and the SUM over the ``sp`` group
then restores the full gradient: 2 x (g0 + g1) / 2.

``register_ddp_hook`` needs no call after backward: DDP's own all-reduce sums the shares of a group and
averages over data replicas. Checked for ulysses=2 (one replica: the sum), for parallel=1 (two replicas,
one sample each: the mean) and at world 4 for data=2 x ulysses=2 (both: two replicas of a sequence-parallel
model), each against ONE unpatched process on the global batch with a mean loss.

Every result equals the unpatched model's within ``reassociation_tol`` of its fp32-vs-fp64 noise (the split
only reorders sums).
"""

from __future__ import annotations

from typing import Any

import pytest
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
            for name, p in model.named_parameters():  # the shares (DDP: averaged) before the reduction
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


def _mean_loss_grads(
    model: torch.nn.Module, call: Any, inputs: tuple[torch.Tensor, ...]
) -> dict[str, torch.Tensor]:
    """Gradients of the batch-mean of a per-sample loss (what a training loop averages over its batch)."""
    out = call(*inputs).sample
    weight = torch.randn(out.shape[1:], generator=torch.Generator().manual_seed(7)).to(out.dtype)
    (out * weight).flatten(1).sum(1).mean().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _ddp_hook_cases() -> dict[str, tuple[float, float]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hfpatch.distributed.data import data_coordinates
    from hfpatch.distributed.gradients import register_ddp_hook

    rank = dist.get_rank()
    results = {}
    # (plan, this rank's samples, the global batch one unpatched process trains on)
    if dist.get_world_size() == 2:
        cases = {
            "ulysses=2": (ParallelConfig(ulysses=2), _inputs(0, 1), _inputs(0, 1)),
            "parallel=1 (2 replicas)": (1, _inputs(rank, 1), _inputs(0, 2)),
        }
    else:  # world 4: two replicas of a sequence-parallel model, each replica's two ranks share its sample
        plan = ParallelConfig(data=2, ulysses=2)
        data_rank, _ = data_coordinates(rank, 4, plan)
        cases = {"data=2 x ulysses=2": (plan, _inputs(data_rank, 1), _inputs(0, 2))}
    for name, (parallel, local, global_batch) in cases.items():
        reference_model = tiny_wan_transformer()
        reference = _mean_loss_grads(reference_model, reference_model, global_batch)
        model64 = to_fp64(reference_model)
        model64.zero_grad(set_to_none=True)
        reference64 = _mean_loss_grads(model64, model64, to_fp64(global_batch))
        floor = 0.01 * max(g.abs().max().item() for g in reference64.values())
        scales = {n: max(g.abs().max().item(), floor) for n, g in reference64.items()}
        noise = max(rel_error(reference[n], reference64[n], scales[n]) for n in reference)

        model = tiny_wan_transformer()
        with hfpatch.apply(model, parallel=parallel):
            ddp = register_ddp_hook(DistributedDataParallel(model, find_unused_parameters=True))
            grads = _mean_loss_grads(model, ddp, local)  # no call after backward
            try:
                hfpatch.all_reduce_gradients(ddp)
            except ValueError as exc:  # a second reduction would double the gradients
                assert "already summed" in str(exc)
            else:
                raise AssertionError("all_reduce_gradients accepted a model whose DDP hook sums already")
        assert grads.keys() == reference.keys(), sorted(set(grads) ^ set(reference))
        results[name] = (max(rel_error(grads[n], reference[n], scales[n]) for n in reference), noise)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_hook_sums_shares_and_averages_replicas(rank_pool, world):
    for rank_results in rank_pool(world).run(_ddp_hook_cases):
        for case, (error, noise) in rank_results.items():
            assert error <= reassociation_tol(noise), (case, error, noise)
