"""A sequence-parallel transformer inside FSDP2 (``fully_shard``): no hfpatch line after the wrap.

hfpatch's gradient convention (:mod:`hfpatch.distributed.gradients`: the gradient entering a split model's
output is scaled by the sp group size, so the MEAN over the group is the full gradient) is what FSDP2's
reduce-scatter computes, and HSDP's all-reduce over the replicas averages the data replicas. Every case
trains a stock tiny Wan transformer (all of it, or a LoRA on it) AND a trainable "text module" upstream (a
linear layer on the prompt embeddings, sharded too), over two micro-steps, and compares the full-tensor view
of every gradient with ONE unpatched process that trains on the same global batch:

* world 2, ``ulysses=2``: FSDP2 over both ranks (the sp group), full fine-tune and LoRA; gradient
  accumulation with FSDP2's sync at every micro-step and with ``set_requires_gradient_sync(False)`` first;
  and ``hfpatch.apply(..., shard_weights=True)`` (hfpatch shards the transformer itself) in a training step.
* world 4, ``data=2 x ulysses=2`` (two replicas, each replica's ranks sharing its samples): FSDP2 over all
  four ranks; HSDP sharding within each sp group and replicating over the data axis; HSDP sharding over the
  data axis and replicating over sp; full and LoRA.

Errors are bounded by ``reassociation_tol`` of the unpatched fp32 run's own noise against fp64.

And under ``shard_weights=True`` an in-place op on the model's output keeps FSDP2's pre-backward hook (the
output is never a view; FSDP2 would warn, and the hook would be dropped): the in-place loss's gradients equal
the out-of-place loss's, for a stock view (Wan's output reshaping) and hfpatch's gather (FLUX.3).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pipe_helpers import wan_sample, wan_sample_loss

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.testing import tiny_wan_transformer
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64

MICRO_STEPS = 2


def _models(lora: bool, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The transformer (with a gaussian-initialised LoRA and its base frozen when ``lora``) and the text module."""
    transformer = tiny_wan_transformer()
    if lora:
        from peft import LoraConfig

        transformer.requires_grad_(False)
        torch.manual_seed(3)
        transformer.add_adapter(
            LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian", target_modules=["to_q", "to_v"])
        )
    torch.manual_seed(5)
    text = torch.nn.Linear(16, 16)
    if dtype != torch.float32:
        transformer, text = to_fp64(transformer), to_fp64(text)
    return transformer, text


def _grads(*modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient, the full tensor of a sharded one (a collective: same order on every rank)."""
    from torch.distributed.tensor import DTensor

    return {
        f"{k}:{n}": (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for k, module in enumerate(modules)
        for n, p in module.named_parameters()
        if p.grad is not None
    }


def _reference(lora: bool, num_data: int) -> tuple[dict, dict, dict]:
    """fp32 and fp64 gradients of one unpatched process on the global batches, and per-tensor scales."""
    results = []
    for dtype in (torch.float32, torch.float64):
        transformer, text = _models(lora, dtype)
        for step in range(MICRO_STEPS):
            wan_sample_loss(
                transformer, text, [step * num_data + d for d in range(num_data)], dtype
            ).backward()
        results.append(_grads(transformer, text))
    ref32, ref64 = results
    floor = 0.01 * max(g.abs().max().item() for g in ref64.values())
    scales = {n: max(g.abs().max().item(), floor) for n, g in ref64.items()}
    return ref32, ref64, scales


def _mesh(kind: str) -> Any:
    """The user's FSDP2 mesh: ``"all"`` (1-D over every rank), ``"hsdp_sp"`` (replicate over data, shard
    within each sp group) or ``"hsdp_data"`` (shard over data, replicate over sp). hfpatch's rank layout
    is data-major: rank = data_index * sp + sp_index."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    world = dist.get_world_size()
    if kind == "all":
        return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    grid = torch.arange(world).view(2, world // 2)  # (data, sp)
    layout = grid if kind == "hsdp_sp" else grid.t()  # (replicate, shard)
    return DeviceMesh("cpu", layout, mesh_dim_names=("replicate", "shard"))


def _shard(transformer: torch.nn.Module, text: torch.nn.Module, mesh: Any) -> None:
    """What a user (or accelerate's FSDP2 plugin) does: each block, then the root; the text module too."""
    from torch.distributed.fsdp import fully_shard

    for block in transformer.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(transformer, mesh=mesh)
    fully_shard(text, mesh=mesh)


#: (case, LoRA, mesh, sync at every micro-step) per world size; world 2 runs ulysses=2, world 4 data=2 x ulysses=2.
CASES: dict[int, list[tuple[str, bool, str, bool]]] = {
    2: [
        ("full, sync every micro-step", False, "all", True),
        ("full, no sync then sync", False, "all", False),
        ("LoRA", True, "all", True),
        ("full, shard_weights=True", False, "shard_weights", True),
    ],
    4: [
        ("full, FSDP over all ranks", False, "all", True),
        ("LoRA, FSDP over all ranks", True, "all", True),
        ("full, HSDP: shard in sp, replicate over data", False, "hsdp_sp", True),
        ("LoRA, HSDP: shard over data, replicate over sp", True, "hsdp_data", False),
    ],
}


def _training_cases(references: dict[bool, tuple[dict, dict, dict]]) -> dict[str, tuple[float, float]]:
    from hfpatch.distributed.data import data_coordinates

    world = dist.get_world_size()
    plan = ParallelConfig(ulysses=2) if world == 2 else ParallelConfig(data=2, ulysses=2)
    data_rank, num_data = data_coordinates(dist.get_rank(), world, plan)
    results: dict[str, tuple[float, float]] = {}
    for name, lora, mesh_kind, sync_every in CASES[world]:
        ref32, ref64, scales = references[lora]
        noise = max(rel_error(ref32[n], ref64[n], scales[n]) for n in ref32)
        transformer, text = _models(lora)
        if mesh_kind == "shard_weights":
            patch = hfpatch.apply(transformer, parallel=plan, shard_weights=True)
            from torch.distributed.fsdp import fully_shard

            fully_shard(text, mesh=_mesh("all"))
        else:
            patch = hfpatch.apply(transformer, parallel=plan)  # hfpatch: before the wrap
            _shard(transformer, text, _mesh(mesh_kind))
        for step in range(MICRO_STEPS):
            last = step == MICRO_STEPS - 1
            for module in (transformer, text):
                module.set_requires_gradient_sync(sync_every or last)
            wan_sample_loss(transformer, text, [step * num_data + data_rank], torch.float32).backward()
        grads = _grads(transformer, text)  # no hfpatch line after backward
        assert grads.keys() == ref32.keys(), sorted(set(grads) ^ set(ref32))
        results[name] = (max(rel_error(grads[n], ref32[n], scales[n]) for n in ref32), noise)
        if mesh_kind == "shard_weights":
            patch.remove()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_sequence_parallel_gradients_match_one_process(rank_pool, world):
    num_data = 1 if world == 2 else 2
    references = {
        lora: _reference(lora, num_data) for lora in {case[1] for case in CASES[world]}
    }  # once, here
    for rank, rank_results in enumerate(rank_pool(world).run(_training_cases, references)):
        assert len(rank_results) == len(CASES[world]), rank_results
        for case, (error, noise) in rank_results.items():
            assert error <= reassociation_tol(noise), (world, rank, case, error, noise)


def _in_place_on_sharded_outputs() -> dict[str, tuple[int, float, int]]:
    """``shard_weights=True`` training: an in-place op on the model's output (``pred.mul_(w)``) gives the
    gradients of the out-of-place loss, and FSDP2 never warns that the output is a view.

    The root's output was a view in both ways one can be: Wan's stock output reshaping
    (``unflatten``/``permute``/``flatten``) and hfpatch's sequence gather (FLUX.3's output is gathered last).
    FSDP2 hooks its pre-backward on the output; an in-place op on a view drops that hook (Wan's backward then
    fails in ``setStorage``; the gather's view refuses the in-place op). Returns per model: FSDP2 view warnings,
    the largest gradient difference, the number of gradients compared."""
    from hfpatch.testing.dits import tiny_dit, tiny_dit_inputs

    latents, prompt = wan_sample(0)
    models = {
        "wan": (
            tiny_wan_transformer(),
            {"hidden_states": latents, "timestep": torch.tensor([500]), "encoder_hidden_states": prompt},
        ),
        "flux3": (tiny_dit("flux3"), tiny_dit_inputs("flux3")),
    }
    results = {}
    for name, (model, kwargs) in models.items():
        patch = hfpatch.apply(model, parallel=2, shard_weights=True)
        grads = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for in_place in (False, True):
                output = model(**kwargs)
                pred = output.sample if hasattr(output, "sample") else output[0]
                weight = torch.randn(pred.shape, generator=torch.Generator().manual_seed(7))
                if in_place:
                    pred.mul_(weight)
                    loss = pred.sum()
                else:
                    loss = (pred * weight).sum()
                loss.backward()
                grads.append(_grads(model))
                model.zero_grad()
        views = sum("returned a view tensor" in str(w.message) for w in caught)
        diff = max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0])
        assert grads[0].keys() == grads[1].keys()
        results[name] = (views, diff, len(grads[0]))
        patch.remove()
    return results


def test_shard_weights_in_place_op_on_the_output_keeps_the_gradient(rank_pool):
    for rank, results in enumerate(rank_pool(2).run(_in_place_on_sharded_outputs)):
        for name, (views, diff, count) in results.items():
            assert views == 0 and count > 0, (rank, name, views, count)
            assert diff == 0.0, (rank, name, diff)  # the same ops on the same values
