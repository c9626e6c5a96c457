"""The training recipe over several epochs, a resume and accumulation (issue 32), against the stock loop.

Three defects of the earlier recipe (loader kept out of ``accelerator.prepare``, ``step_rng(seed, step)`` with
``step`` from ``enumerate(loader)``) were invisible to a patched-vs-unpatched comparison because the
unpatched recipe had them too; here every run is compared with the STOCK loop (the same loop with no hfpatch
line):

1. every micro-step of every epoch draws new noise (torch, ``random``, NumPy), the same on the ranks of a
   group, its own per data replica: :class:`hfpatch.StepRNG` counts the blocks itself; the legacy
   ``step_rng(seed, step)`` raises on an index used twice (the issue's repro);
2. a run resumed from ``save_state`` (at an epoch boundary, or in the middle of an epoch with
   ``skip_first_batches``) loads and draws what the uninterrupted run does, and ends with the same weights bit
   for bit: the loader's order is checkpointed by :func:`hfpatch.data_parallel_loaders` (accelerate 1.15
   itself restores neither a half-done epoch's order nor, over several processes, its shuffling generator);
3. the loader stays in ``prepare``, so with ``len(loader) % accumulation != 0`` the last window of each epoch
   closes at the epoch's end: as many optimizer steps as the stock loop on as many processes as there are
   data replicas, which also loads, replica for replica, the same samples in the same order.

The accelerate loop trains a linear layer under accelerate's DDP (the patched tiny Wan transformer only
provides the plan: the DreamBooth-style example runs the real model, tests/integration/
test_lora_sp_accelerate.py); world 2 is Ulysses 2 (one replica), world 4 is 2 replicas x Ulysses 2. A plain
DDP loop (``data_parallel_sampler`` + ``set_epoch``, ``StepRNG`` saved with the checkpoint) is checked the
same way.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.distributed import data as data_module

EPOCHS, ACCUMULATION = 3, 2
#: samples -> the optimizer step after which the first run saves (mid-epoch when an epoch has 2+ windows).
SAMPLES = {2: {1: 2, 2: 2, 3: 3}, 4: {1: 2, 2: 2, 6: 3}}


# ----------------------------------------------------------------------------------------------- one process
def test_step_rng_index_reused_across_epochs_raises():
    """The issue's repro: ``step`` from ``enumerate`` restarts every epoch; the second epoch is an error."""
    data_module._USED_STEPS.clear()
    draws = []
    with pytest.raises(ValueError, match=r"step_rng\(seed=0, step=0\) already drew.*StepRNG"):
        for _epoch in range(3):
            for step, _ in enumerate([0]):
                with hfpatch.step_rng(0, step, None):
                    draws.append(torch.rand(1).item())
    assert len(draws) == 1
    with pytest.raises(ValueError, match="already drew"):
        hfpatch.step_generator(0, 0)  # the same index from the generator form: the same seed
    with hfpatch.step_rng(0, 0, None, replay=True):
        assert torch.rand(1).item() == draws[0]  # replay on purpose


def test_step_rng_counter_never_repeats_and_resumes():
    """The same loop with :class:`hfpatch.StepRNG`: three epochs, three draws of each RNG; a resumed object
    continues the sequence; its n-th block draws what ``step_rng(seed, n)`` draws (the draws of scripts that
    kept a global micro-step count do not change)."""
    data_module._USED_STEPS.clear()
    rng = hfpatch.StepRNG(0)
    draws = []
    for _epoch in range(3):
        for _step, _ in enumerate([0]):
            with rng:
                draws.append((torch.rand(1).item(), random.random(), float(np.random.rand())))
    assert rng.step == 3 and rng.state_dict() == {"seed": 0, "step": 3}
    assert all(len({d[k] for d in draws}) == 3 for k in range(3)), draws
    for n, expected in enumerate(draws):
        with hfpatch.step_rng(0, n):
            assert (torch.rand(1).item(), random.random(), float(np.random.rand())) == expected
    resumed = hfpatch.StepRNG(1)
    resumed.load_state_dict({"seed": 0, "step": 2})
    with resumed:
        assert torch.rand(1).item() == draws[2][0]
    outside = torch.get_rng_state()
    with rng:
        torch.rand(5)
    assert torch.equal(torch.get_rng_state(), outside)  # restored on exit


def test_step_rng_misuse_is_a_clear_error():
    rng = hfpatch.StepRNG(0)
    with pytest.raises(RuntimeError, match="already open"), rng, rng:
        pass
    assert rng.step == 1  # the outer block drew index 0; the failed inner one consumed nothing
    with pytest.raises(ValueError, match="expected"):
        rng.load_state_dict({"seed": 0})
    with pytest.raises(TypeError, match="seed must be an int"):
        hfpatch.StepRNG(0.5)
    with pytest.raises(TypeError, match="needs the Patch"):
        hfpatch.prepare_accelerator(object(), None)
    assert repr(hfpatch.StepRNG(3)) == "StepRNG(seed=3, step=0, data_rank=0)"


# ----------------------------------------------------------------------------------------------- ranks
def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    GradientState._reset_state()
    AcceleratorState._reset_state(reset_partial_state=True)


def _draws() -> list[float]:
    """What a training step draws from the global RNGs (noise, a timestep, caption dropout, NumPy)."""
    return [*torch.randn(2).tolist(), torch.rand(1).item(), random.random(), float(np.random.rand())]


def _accelerate_loop(samples: int, mode: str, checkpoint: Path, save_at: int, resume: bool) -> dict:
    """The stock accelerate loop (diffusers' DreamBooth structure): ``stock``; ``patched`` adds the recipe's
    lines; ``unpatched`` only its ``StepRNG`` (no patch: every process its own replica).

    After each optimizer step the main process alone draws from the global RNGs (validation without a seed).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, set_seed

    _reset_accelerate()
    world = dist.get_world_size()
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=ACCUMULATION,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],  # as diffusers' scripts
    )
    patch = None
    patched = mode == "patched"
    if patched:
        from hfpatch.testing import tiny_wan_transformer

        plan = ParallelConfig(data=world // 2, ulysses=2)
        patch = hfpatch.apply(tiny_wan_transformer(), parallel=plan)  # hfpatch
    try:
        set_seed(0)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(list(range(samples)), batch_size=1, shuffle=True)
        rng: Any = contextlib.nullcontext()
        if patched:
            rng = hfpatch.prepare_accelerator(accelerator, patch, seed=0)  # hfpatch
        elif mode == "unpatched":
            rng = hfpatch.StepRNG(0)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        per_epoch = math.ceil(len(loader) / ACCUMULATION)
        global_step, first_epoch, skip = 0, 0, 0
        if resume:
            accelerator.load_state(str(checkpoint))
            global_step = save_at
            first_epoch, skip = divmod(global_step, per_epoch)
            skip *= ACCUMULATION
        trace, steps = [], 0
        for epoch in range(first_epoch, EPOCHS):
            epoch_loader = (
                accelerator.skip_first_batches(loader, skip) if epoch == first_epoch and skip else loader
            )
            for batch in epoch_loader:
                with accelerator.accumulate(model), rng:  # hfpatch: `, rng`
                    draws = _draws()
                    loss = model(torch.tensor([[float(batch.item()), draws[2]]])).square().mean()
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                trace.append((epoch, batch.tolist(), draws))
                if accelerator.sync_gradients:
                    global_step, steps = global_step + 1, steps + 1
                    if accelerator.is_main_process:
                        _draws()  # validation on the main process, from the global RNG
                    if global_step == save_at and not resume:
                        accelerator.save_state(str(checkpoint))
        weights = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
        restored = None
        if patch is not None:  # remove() takes back the registered objects and the replaced method
            patch.remove()
            patch = None
            restored = not accelerator._custom_objects and "prepare_data_loader" not in vars(accelerator)
        return {
            "trace": trace,
            "steps": steps,
            "batches": len(loader),
            "weights": weights,
            "restored": restored,
        }
    finally:
        if patch is not None:
            patch.remove()
        _reset_accelerate()


def _accelerate_cases(patched: bool, root: Path) -> dict[int, dict[str, dict]]:
    """Every sample count, patched: the uninterrupted run (saving after ``save_at``) and the resumed one; on one
    process per replica: the stock loop and the recipe unpatched."""
    world = dist.get_world_size() if patched else 2 * dist.get_world_size()
    out: dict[int, dict[str, dict]] = {}
    for samples, save_at in SAMPLES[world].items():
        checkpoint = root / f"{world}-{samples}"
        if patched:
            out[samples] = {
                "full": _accelerate_loop(samples, "patched", checkpoint, save_at, False),
                "resumed": _accelerate_loop(samples, "patched", checkpoint, save_at, True),
            }
        else:
            out[samples] = {
                mode: _accelerate_loop(samples, mode, checkpoint, 0, False) for mode in ("stock", "unpatched")
            }
    return out


def _ddp_loop(samples: int, stop_after: int | None, state: dict | None) -> dict:
    """A plain torchrun/DDP loop: ``data_parallel_sampler`` + ``set_epoch``, ``no_sync`` accumulation, a
    checkpoint dict (model, optimizer, ``StepRNG``, epoch, batches done) taken after ``stop_after`` windows."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hfpatch.testing import tiny_wan_transformer

    world = dist.get_world_size()
    patch = hfpatch.apply(tiny_wan_transformer(), parallel=ParallelConfig(data=world // 2, ulysses=2))
    try:
        torch.manual_seed(0)
        # find_unused_parameters=True keeps DDP's first bucket layout (no rebuild after the first backward),
        # so a resumed process sums the 4 ranks' gradients in the uninterrupted run's order.
        model = DDP(torch.nn.Linear(2, 1), find_unused_parameters=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = hfpatch.data_parallel_sampler(
            range(samples), patch, seed=0
        )  # hfpatch: DistributedSampler(...)
        loader = torch.utils.data.DataLoader(list(range(samples)), batch_size=1, sampler=sampler)
        rng = hfpatch.StepRNG(0, patch)  # hfpatch
        epoch0, done = 0, 0
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            rng.load_state_dict(state["rng"])
            epoch0, done = state["epoch"], state["done"]
        trace, windows, checkpoint = [], 0, None
        for epoch in range(epoch0, EPOCHS):
            sampler.set_epoch(epoch)
            batches = list(itertools.islice(loader, done if epoch == epoch0 else 0, None))
            for start in range(0, len(batches), ACCUMULATION):
                window = batches[start : start + ACCUMULATION]
                for k, batch in enumerate(window):
                    sync = model.no_sync() if k < len(window) - 1 else contextlib.nullcontext()
                    with sync, rng:  # hfpatch: `, rng`
                        draws = _draws()
                        model(torch.tensor([[float(batch.item()), draws[2]]])).square().mean().backward()
                    trace.append((epoch, batch.tolist(), draws))
                optimizer.step()
                optimizer.zero_grad()
                windows += 1
                if windows == stop_after:
                    checkpoint = {
                        "model": {k: v.clone() for k, v in model.state_dict().items()},
                        "optimizer": optimizer.state_dict(),
                        "rng": rng.state_dict(),
                        "epoch": epoch,
                        "done": (done if epoch == epoch0 else 0) + start + len(window),
                    }
        weights = [p.detach().clone() for p in model.parameters()]
        return {"trace": trace, "weights": weights, "checkpoint": checkpoint}
    finally:
        patch.remove()


def _ddp_cases() -> dict[int, dict[str, dict]]:
    world = dist.get_world_size()
    out = {}
    for samples, save_at in SAMPLES[world].items():
        full = _ddp_loop(samples, save_at, None)
        out[samples] = {"full": full, "resumed": _ddp_loop(samples, None, full.pop("checkpoint"))}
    return out


def _check_draws(traces: list[list], groups: list[list[int]], what: str) -> None:
    """Equal on the ranks of a group; never the same twice on a rank; different across replicas."""
    for group in groups:
        assert all(traces[r] == traces[group[0]] for r in group), (what, group)
    for rank, trace in enumerate(traces):
        for k in range(5):  # each RNG on its own: torch normal x2, torch uniform, random, NumPy
            values = [draws[k] for _, _, draws in trace]
            assert len(set(values)) == len(values), (what, rank, k, values)
    if len(groups) > 1:
        first, second = ({tuple(d) for _, _, d in traces[g[0]]} for g in groups)
        assert not first & second, what


@pytest.mark.parametrize("world", [2, 4])
def test_recipe_epochs_resume_accumulation_against_the_stock_loop(rank_pool, world, tmp_path):
    data_module._USED_STEPS.clear()
    replicas = world // 2
    groups = [list(range(g * 2, g * 2 + 2)) for g in range(replicas)]
    patched = rank_pool(world).run(_accelerate_cases, True, tmp_path)
    stock = rank_pool(replicas).run(_accelerate_cases, False, tmp_path)
    ddp = rank_pool(world).run(_ddp_cases)
    for samples in SAMPLES[world]:
        what = f"world {world}, {samples} samples"
        full = [p[samples]["full"] for p in patched]
        _check_draws([f["trace"] for f in full], groups, what)
        assert {epoch for epoch, _, _ in full[0]["trace"]} == set(range(EPOCHS)), what
        for rank, run in enumerate(full):
            reference = stock[rank // 2][samples]["stock"]  # the stock loop's process of the same replica
            unpatched = stock[rank // 2][samples]["unpatched"]
            # accelerate's own step arithmetic and end-of-epoch windows: len(loader) per replica.
            assert run["batches"] == reference["batches"], what
            assert run["steps"] == reference["steps"] == EPOCHS * math.ceil(run["batches"] / ACCUMULATION)
            # The samples and their order: those of the stock loop on `replicas` processes. With one replica
            # the stock order follows the global RNG, which the stock loop's own noise draws move and
            # StepRNG does not: from the second epoch on the patched order is that of the recipe unpatched.
            order = [t[1] for t in run["trace"]]
            stock_order = [t[1] for t in reference["trace"]]
            assert order == [t[1] for t in unpatched["trace"]], (what, rank)
            first = len(order) // EPOCHS
            assert (
                order[: first if replicas == 1 else None] == stock_order[: first if replicas == 1 else None]
            )
            resumed = patched[rank][samples]["resumed"]
            assert run["restored"] and resumed["restored"], (what, rank)
            assert resumed["trace"] == run["trace"][-len(resumed["trace"]) :], (what, rank)
            assert all(torch.equal(a, b) for a, b in zip(resumed["weights"], run["weights"])), (what, rank)
        ddp_full = [d[samples]["full"] for d in ddp]
        _check_draws([f["trace"] for f in ddp_full], groups, f"DDP loop, {what}")
        for rank, run in enumerate(ddp_full):
            resumed = ddp[rank][samples]["resumed"]
            assert resumed["trace"] == run["trace"][-len(resumed["trace"]) :], ("DDP loop", what, rank)
            assert all(torch.equal(a, b) for a, b in zip(resumed["weights"], run["weights"])), ("DDP", what)
        if replicas > 1 and samples > 1:  # the replicas' shards are disjoint within each epoch
            for epoch in range(EPOCHS):
                loaded = [[t[1][0] for t in f["trace"] if t[0] == epoch] for f in (ddp_full[0], ddp_full[2])]
                assert not set(loaded[0]) & set(loaded[1]), (what, epoch, loaded)


def _shared_seed() -> int:
    return hfpatch.StepRNG(None).seed


def test_step_rng_without_a_seed_shares_rank_0s(rank_pool):
    seeds = rank_pool(2).run(_shared_seed)
    assert seeds[0] == seeds[1] and isinstance(seeds[0], int)
