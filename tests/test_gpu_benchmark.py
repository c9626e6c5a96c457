"""``benchmarks/gpu.py --device cpu --tiny``: the one-GPU benchmark runs every section on CPU (so it cannot rot
between GPU runs), writes its JSON and plot, and its attention paths agree with stock SDPA."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu.py"


def test_gpu_benchmark_tiny_on_cpu_runs_every_section(tmp_path):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--device", "cpu", "--tiny", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "gpu_tiny.json").read_text())
    assert (tmp_path / "gpu_tiny.png").stat().st_size > 0
    for section in bench.SECTIONS:
        if section == "streaming_sp":  # the sharded stream needs several GPUs: skipped on CPU, saying why
            assert "needs at least 2 GPUs on this machine; found 0" in result[section]["skipped"]
            continue
        assert "error" not in result[section] and "skipped" not in result[section], (section, result[section])
    attention = result["attention"]
    assert attention["auto"] == "flash_cpu" and {"math", "flash_cpu"} <= set(attention["kernels"])
    for row in attention["rows"].values():
        for name in ("stock sdpa", "usp degree 1 (sdpa)", "ring path: flash_cpu", "ring path: math"):
            assert row[name]["fwd_ms"] > 0 and row[name]["fwd_bwd_ms"] > 0, (name, row[name])
            assert row[name]["rel_vs_stock"] < 1e-5, (name, row[name])  # fp32: reassociation only
        assert row["usp degree 1 (sdpa)"]["rel_vs_stock"] == 0.0  # the same SDPA call
    for name in ("stock", "usp degree 1 (sdpa)", "ring path (auto lse kernel)"):
        assert result["wan_forward"][name]["rel_vs_stock"] < 1e-5, (name, result["wan_forward"][name])
    assert result["wan_forward"]["usp degree 1 (sdpa)"]["rel_vs_stock"] == 0.0
    for mode in ("", "compiled: "):
        for name in ("transformer only", "with VAE decode", "with VAE decode, overlapped"):
            assert result["streaming"][mode + name]["pixel_frames_per_s"] > 0, (mode, name)
    pixel = result["pixel_loss"]
    # Live bytes on CPU (deterministic): chunk 1 at batch 4 holds about one item, one-shot batch 2 two.
    assert (
        pixel["hfpatch chunk 1, batch 4"]["step_peak_gib"] < 0.75 * pixel["one-shot batch 2"]["step_peak_gib"]
    )
    gradcache = [n for n in result["gradcache"] if n.startswith("gradcache")]
    assert {"gradcache chunk 4, compiled", "gradcache chunk 8, compiled"} <= set(gradcache)
    assert all(result["gradcache"][n]["time_vs_plain"] > 0 for n in gradcache)
