"""The ``hfpatch`` command: ``demo``, ``selftest``, ``bench`` and ``info`` run as a user runs them, in a subprocess."""

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
        cli.main(["frobnicate"])
    assert exc.value.code == 2


def test_cli_selftest_two_ranks_passes_every_check():
    result = _hfpatch("selftest", "--nproc", "2", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    checks = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    names = " | ".join(checks)
    for check in ("all_gather (uneven)", "all_to_all", "ring=1 ulysses=2", "ring=2 ulysses=1"):
        assert check in names, names
    assert all(line.startswith("PASS") for line in checks) and lines[-1] == "verdict: PASS"


def test_cli_selftest_failure_exits_nonzero(monkeypatch, capsys):
    failing = [{"all_to_all": (0.0, 0.0)}, {"all_to_all": (1.0, 0.0)}]  # rank 1 received wrong values
    monkeypatch.setattr(demo, "run_selftest", lambda nproc: demo.format_selftest(failing))
    assert cli.main(["selftest"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  all_to_all" in out and out.splitlines()[-1] == "verdict: FAIL (1 of 1 checks)"


def test_cli_bench_lists_checkout_benchmarks():
    result = _hfpatch("bench", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usp_attention " in result.stdout and "vae_memory " in result.stdout


def test_cli_bench_runs_named_script_from_checkout_root(monkeypatch, tmp_path, capsys):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "hello.py").write_text(
        '"""Say hello."""\nfrom pathlib import Path\nPath("ran").write_text("yes")\nraise SystemExit(3)\n'
    )
    monkeypatch.setattr(cli, "benchmark_dir", lambda: tmp_path / "benchmarks")
    assert cli.main(["bench", "hello"]) == 3  # the script's exit status
    assert (tmp_path / "ran").read_text() == "yes"  # ran from the checkout root
    assert cli.main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'nope'" in err and "available: hello" in err


def test_cli_bench_outside_checkout_explains(monkeypatch, capsys):
    monkeypatch.setattr(cli, "benchmark_dir", lambda: None)
    assert cli.main(["bench"]) == 2
    assert "ship with the source, not the wheel" in capsys.readouterr().err


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
