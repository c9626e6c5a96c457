"""``wan_video_gpu`` of ``benchmarks/pixel_loss_memory.py`` (the Wan 2.1 VAE video step a GPU benchmark calls) on
the tiny VAE on CPU, so it cannot rot between GPU runs."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import torch

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "pixel_loss_memory.py"


def test_wan_video_gpu_section_tiny_on_cpu():
    spec = importlib.util.spec_from_file_location("pixel_loss_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = {}
    bench.wan_video_gpu(types.SimpleNamespace(tiny=True), torch.device("cpu"), torch.float32, result)
    rows = {k: v for k, v in result.items() if isinstance(v, dict)}
    assert list(rows) == [
        "float32 one-shot 2 latent / 5 pixel frames",
        "float32 hfpatch 2 latent / 5 pixel frames",
        "float32 hfpatch 5 latent / 17 pixel frames",
    ]
    assert all("error" not in r and r["step_peak_gib"] > 0 for r in rows.values()), rows
    one_shot, ours = (rows[f"float32 {m} 2 latent / 5 pixel frames"]["loss"] for m in ("one-shot", "hfpatch"))
    assert abs(ours - one_shot) <= 1e-6 * abs(one_shot)  # the same step (fp32 reassociation)
