"""The ``hfpatch`` command: ``demo`` and ``info`` run as a user runs them, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfpatch import cli, demo


def _hfpatch(*args: str, timeout: float) -> subprocess.CompletedProcess:
    # ``python -m hfpatch.cli`` runs the same ``main`` as the ``hfpatch`` console script.
    return subprocess.run(
        [sys.executable, "-m", "hfpatch.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_cli_demo_two_ranks_passes_and_reports():
    result = _hfpatch("demo", "--nproc", "2", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "plan: ParallelConfig(data=1, cfg=2, ring=1, ulysses=1, vae=2)" in lines
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"])]
    assert [row[0] for row in rows] == ["0", "1"]
    assert all(float(row[1]) == 0.0 for row in rows)  # two-call CFG parallel is bit-exact
    assert all("KiB" in line or "MiB" in line for line in lines if line.split()[:1] in (["0"], ["1"]))
    assert lines[-1].startswith("verdict: PASS")


def test_cli_info_lists_versions_and_families():
    result = _hfpatch("info", timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for package in ("hfpatch", "torch", "diffusers", "transformers", "peft", "accelerate", "xformers"):
        assert f"\n{package} " in out
    assert "world size    1 (rank 0)" in out
    assert "diffusers.DiffusionPipeline: pipeline_parallel (pipeline)" in out
    assert "diffusers.WanTransformer3DModel:" in out


def test_cli_demo_failure_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: (False, "verdict: FAIL, max abs diff 1.0e+00"))
    assert cli.main(["demo"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_demo_report_verdict_fails_above_tolerance():
    rows = [demo.DemoResult(r, 1e-3 * r, "ParallelConfig(cfg=2)", 2048, 1024, 512, 1.0) for r in range(2)]
    assert demo.format_report(rows, nproc=2, steps=2, atol=2e-4).splitlines()[-1] == (
        "verdict: FAIL, max abs diff 1.0e-03 > 2.0e-04"
    )


def test_cli_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench"])
    assert exc.value.code == 2


def test_example_wan_usp_torchrun_help_runs_without_loading_models():
    result = subprocess.run(
        [sys.executable, "examples/wan_usp_torchrun.py", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "COLUMNS": "200"},  # argparse wraps help at the terminal width
    )
    assert result.returncode == 0, result.stderr
    assert (
        "torchrun --nproc-per-node 8" in result.stdout and "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in result.stdout
    )
