"""A sequence-parallel transformer in the DDP training setups scripts use: no hfpatch line after ``prepare``.

Every case trains a stock tiny Wan transformer AND a trainable "text module" upstream of it (a linear layer
on the prompt embeddings, standing in for a LoRA text encoder; its own DDP, as diffusers'
``--train_text_encoder`` prepares it), over two micro-steps of gradient accumulation, and compares both
modules' accumulated gradients with ONE unpatched process that trains on the same global batch:

* ``sync every micro-step``: DDP all-reduces at each backward (diffusers passes a LIST to
  ``accelerator.accumulate``, which never enters ``no_sync``). A sum of shares counted the first micro-step
  twice here (issue 21); the mean the convention relies on is idempotent.
* ``no_sync``: the first micro-step inside ``ddp.no_sync()``, the second syncs.
* ``one step``: no accumulation.
* ``plain loop``: no DDP; ``all_reduce_gradients(transformer)`` after the micro-steps, nothing for the text
  module (its gradient is averaged at the transformer's input boundary), plus an average over the data
  replicas (world 4) as any data-parallel loop without DDP does.

World 2 runs ulysses=2 (one replica), world 4 data=2 x ulysses=2 (two replicas of a sequence-parallel
model, each replica's ranks sharing its samples). Errors are bounded by ``reassociation_tol`` of the
unpatched fp32 run's own noise against fp64.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pipe_helpers import wan_sample_loss

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.testing import tiny_wan_transformer
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64

MICRO_STEPS = 2


def _text_module() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Linear(16, 16)


def _grads(*modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{k}:{n}": p.grad.detach().clone()
        for k, module in enumerate(modules)
        for n, p in module.named_parameters()
        if p.grad is not None
    }


def _reference(num_data: int, micro_steps: int) -> tuple[dict, dict, dict]:
    """fp32 and fp64 gradients of one unpatched process on the global batches, and per-tensor scales."""
    results = []
    for dtype in (torch.float32, torch.float64):
        transformer, text = tiny_wan_transformer(), _text_module()
        if dtype == torch.float64:
            transformer, text = to_fp64(transformer), to_fp64(text)
        for step in range(micro_steps):
            global_batch = [step * num_data + d for d in range(num_data)]
            wan_sample_loss(transformer, text, global_batch, dtype).backward()
        results.append(_grads(transformer, text))
    ref32, ref64 = results
    floor = 0.01 * max(g.abs().max().item() for g in ref64.values())
    scales = {n: max(g.abs().max().item(), floor) for n, g in ref64.items()}
    return ref32, ref64, scales


def _training_cases() -> dict[str, tuple[float, float]]:
    from torch.nn.parallel import DistributedDataParallel

    from hfpatch.distributed.data import data_coordinates

    world = dist.get_world_size()
    plan = ParallelConfig(ulysses=2) if world == 2 else ParallelConfig(data=2, ulysses=2)
    data_rank, num_data = data_coordinates(dist.get_rank(), world, plan)
    results: dict[str, tuple[float, float]] = {}
    for name, micro_steps in (
        ("sync every micro-step", MICRO_STEPS),
        ("no_sync", MICRO_STEPS),
        ("one step", 1),
        ("plain loop", MICRO_STEPS),
    ):
        ref32, ref64, scales = _reference(num_data, micro_steps)
        noise = max(rel_error(ref32[n], ref64[n], scales[n]) for n in ref32)
        transformer, text = tiny_wan_transformer(), _text_module()
        with hfpatch.apply(transformer, parallel=plan):
            if name == "plain loop":
                model, encoder = transformer, text
            else:
                model = DistributedDataParallel(transformer, find_unused_parameters=True)
                encoder = DistributedDataParallel(text)
            for step in range(micro_steps):
                sync = name != "no_sync" or step == micro_steps - 1
                quiet = contextlib.ExitStack()
                if not sync:
                    quiet.enter_context(model.no_sync())
                    quiet.enter_context(encoder.no_sync())
                with quiet:
                    wan_sample_loss(model, encoder, [step * num_data + data_rank], torch.float32).backward()
            if name == "plain loop":
                hfpatch.all_reduce_gradients(transformer)  # the text module needs nothing
                if num_data > 1:  # a data-parallel loop without DDP averages over the replicas itself
                    hfpatch.all_reduce_gradients([transformer, text], dist.group.WORLD)
            grads = _grads(transformer, text)
        assert grads.keys() == ref32.keys(), sorted(set(grads) ^ set(ref32))
        results[name] = (max(rel_error(grads[n], ref32[n], scales[n]) for n in ref32), noise)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_accumulation_and_upstream_module_match_one_process(rank_pool, world):
    for rank, rank_results in enumerate(rank_pool(world).run(_training_cases)):
        for case, (error, noise) in rank_results.items():
            assert error <= reassociation_tol(noise), (world, rank, case, error, noise)


def _hook_case() -> dict[str, Any]:
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    model = tiny_wan_transformer()
    with hfpatch.apply(model, parallel=ParallelConfig(ulysses=2)):
        ddp = DistributedDataParallel(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            returned = hfpatch.register_ddp_hook(ddp)
    return {
        "same": returned is ddp,
        "no_hook": ddp._comm_hooks == [] if hasattr(ddp, "_comm_hooks") else True,
        "warned": [str(w.category.__name__) for w in caught],
    }


def test_register_ddp_hook_is_a_warning_no_op(rank_pool):
    for result in rank_pool(2).run(_hook_case):
        assert result["same"] and result["no_hook"], result
        assert result["warned"] == ["FutureWarning"], result
