"""Ray as a second engine (issue 48, the ``[ray]`` extra): the recipe's training step inside
``ray.train.torch.TorchTrainer`` on a local Ray with 2 CPU workers (gloo), unchanged.

Ray starts the workers and their process group (``TorchConfig(backend="gloo")``: ``RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE`` set by Ray); the train loop is :func:`pipe_helpers.lora_step` (a tiny Wan transformer with a
LoRA adapter, ``hfpatch.apply(model, parallel=2)``, ``backward()``, ``hfpatch.all_reduce_gradients``), which
compares every LoRA gradient with one process's on the same rank. Each worker writes its report to a folder the
test reads (one host). Skipped without Ray installed (``pip install hfpatch[ray]``); CI installs the extra.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is the [ray] extra (pip install 'hfpatch[ray]'); CI installs it")


def _train_loop(config: dict) -> None:
    import torch.distributed as dist
    from pipe_helpers import lora_step

    report = lora_step(2)
    report.update(
        rank=dist.get_rank(), world=dist.get_world_size(), local_world=os.environ.get("LOCAL_WORLD_SIZE")
    )
    Path(config["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps(report))


def test_the_recipe_step_under_ray_torch_trainer_equals_one_process(tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    tests = str(Path(__file__).resolve().parents[1])  # pipe_helpers, and this module for the pickled loop
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (tests, here, os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HFPATCH_TIMEOUT_S": "120"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"out": str(tmp_path)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(storage_path=str(tmp_path / "ray"), name="hfpatch-recipe"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["world"] == 2 and report["local_world"] == "2", report
        assert report["plan"] == "ParallelConfig(data=1, cfg=1, ring=1, ulysses=2, vae=1)", report
        assert report["tensors"] > 0 and report["worst_error_over_tolerance"] <= 1.0, report
