"""End to end: tiny stock pipelines of the new DiT families (``hfpatch.testing.dits.TINY_DIT_PIPES``) under
``hfpatch.apply(pipe, parallel=...)`` at N = 2 and 4, gloo, fp32.

As ``test_dit_pipelines.py``: every rank runs the pipeline unpatched in fp32 (the reference) and fp64 (its rounding
scale), applies with the default registry and runs it again; every rank's output must equal the reference within
``reassociation_tol`` and the ranks must return bit-identical outputs. 25 image/video tokens (5 x 5) everywhere
(Z-Image pads them to 32), so every split pads.

* ``CogView4Pipeline`` and ``SkyReelsV2Pipeline`` (true CFG, two calls per step, prompts of other lengths):
  ``parallel=N`` plans Ulysses N; ``ParallelConfig(cfg=2, ulysses=N/2)`` puts cond and uncond on different ranks
  after the observed first step.
* ``CogView3PlusPipeline`` (batched CFG, found from its ``__call__``): ``parallel=N`` plans CFG 2 x Ulysses N/2.
* ``ZImagePipeline`` (batched CFG over Python lists of samples, which the CFG split does not cut): ``parallel=N``
  plans Ulysses N.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.testing.dits import TINY_DIT_PIPES, TINY_DITS, tiny_dit_pipe, tiny_dit_pipe_inputs
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

STEPS = 3


def _run(name: str, pipe: Any) -> torch.Tensor:
    inputs = tiny_dit_pipe_inputs(name)
    if pipe.transformer.dtype == torch.float64:
        inputs = to_fp64(inputs)
    out = getattr(pipe(**inputs, num_inference_steps=STEPS), TINY_DIT_PIPES[name].output)
    return torch.stack(out) if isinstance(out, list) else out


def _configs(world: int) -> dict[str, tuple[str, Any, ParallelConfig]]:
    """case -> (pipeline, ``parallel=``, the plan expected)."""
    half = world // 2
    return {
        f"cogview4 parallel={world}": ("cogview4", world, ParallelConfig(ulysses=world, vae=world)),
        f"cogview4 cfg=2 ulysses={half}": (
            "cogview4", ParallelConfig(cfg=2, ulysses=half), ParallelConfig(cfg=2, ulysses=half, vae=world),
        ),
        f"skyreels_v2 parallel={world}": ("skyreels_v2", world, ParallelConfig(ulysses=world, vae=world)),
        f"skyreels_v2 cfg=2 ring={half}": (
            "skyreels_v2", ParallelConfig(cfg=2, ring=half), ParallelConfig(cfg=2, ring=half, vae=world),
        ),
        f"cogview3plus parallel={world}": ("cogview3plus", world, ParallelConfig(cfg=2, ulysses=half, vae=world)),
        f"zimage parallel={world}": ("zimage", world, ParallelConfig(ulysses=world, vae=world)),
    }  # fmt: skip


def pipeline_cases() -> dict[str, dict[str, Any]]:
    from hfpatch.patches.dit import USPDispatchProcessor

    world = dist.get_world_size()
    built: dict[str, tuple[torch.Tensor, float]] = {}
    results = {}
    for case, (name, parallel, _) in _configs(world).items():
        if name not in built:
            pipe = tiny_dit_pipe(name)
            reference = _run(name, pipe)
            built[name] = (reference, rounding_noise(reference, _run(name, to_fp64(pipe))))
        reference, noise = built[name]
        pipe = tiny_dit_pipe(name)
        with hfpatch.apply(pipe, parallel=parallel) as patch:
            swapped = sum(
                isinstance(getattr(m, "processor", None), USPDispatchProcessor)
                for m in pipe.transformer.modules()
            )
            out = _run(name, pipe)
        results[case] = {
            "plan": patch.plan,
            "error": rel_error(out, reference),
            "noise": noise,
            "out": out,
            "same_shape": out.shape == reference.shape and out.dtype == reference.dtype,
            "swapped": swapped,
        }
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_zoo_pipelines_every_rank_equals_unpatched(rank_pool, world):
    results = rank_pool(world).run(pipeline_cases)
    cases = _configs(world)
    assert set(results[0]) == set(cases)
    for case, (name, _, plan) in cases.items():
        for rank, result in enumerate(r[case] for r in results):
            assert result["plan"] == plan, (rank, case, result["plan"])
            assert result["same_shape"], (rank, case)
            assert result["error"] <= reassociation_tol(result["noise"]), (rank, case, result["error"])
            # USP really ran where the plan has a sequence degree (every routed attention module swapped).
            routed = TINY_DITS[TINY_DIT_PIPES[name].transformer].routed
            assert result["swapped"] == (routed if plan.ulysses * plan.ring > 1 else 0), (rank, case)
        outputs = [r[case]["out"] for r in results]
        assert all(torch.equal(outputs[0], o) for o in outputs[1:]), (
            f"{case}: ranks returned different outputs"
        )
