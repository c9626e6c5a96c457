"""The ``hfpatch`` command: ``demo``, ``selftest``, ``bench`` and ``info`` run as a user runs them, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

from hfpatch import cli
from hfpatch.cli import demo


def _hfpatch(*args: str, timeout: float) -> subprocess.CompletedProcess:
    # ``python -m hfpatch.cli`` runs the same ``main`` as the ``hfpatch`` console script.
    return subprocess.run(
        [sys.executable, "-m", "hfpatch.cli", *args], capture_output=True, text=True, timeout=timeout
    )


# The commands that start ranks or import every library, by the test that checks each.
HEAVY_COMMANDS = {
    "test_cli_demo_two_ranks_passes_and_reports": ("demo", "--nproc", "2"),
    "test_cli_info_lists_versions_and_families": ("info",),
    "test_cli_selftest_two_ranks_passes_every_check": ("selftest", "--nproc", "2"),
    "test_cli_selftest_five_ranks_with_padding_only_shards_passes": ("selftest", "--nproc", "5"),
}


@pytest.fixture(scope="module")
def heavy_runs(background) -> dict[str, Future | None]:
    """The selected tests' commands, started at once two at a time (each is mostly one process importing torch
    and diffusers on one core, so two keep both cores busy): test name -> future of the finished process."""
    return {name: background(name, _hfpatch, *argv, timeout=300) for name, argv in HEAVY_COMMANDS.items()}


# Tolerance of the 2-rank demo, from what differs: its plan is CFG parallel (bit-exact: each rank makes one
# of the two stock transformer calls, the predictions are moved, not recomputed, so the latents must match
# exactly) and the split VAE, whose only difference is the order of fp32 sums: each of the decoder's 31
# convolutions (and its attention block) runs on row shards, where the CPU kernels may group an output's
# C_in*k^3 = 432 products differently. With O(1) activations a reordered sum moves by a few ulps, and the
# layers' differences add up along a pixel's path: FP32_EPS * PIXEL_SCALE * REASSOCIATED_SUMS * 8 = 3.1e-5.
# Measured: 3.3e-7 (AVX-512), 4.2e-7 (AVX2), 3.0e-7 (ATEN_CPU_CAPABILITY=default), about 100x below; a
# wrong result is far above it: without the halo rows (vae_mode="approx") the pixels move by 0.35, and a
# mixed-up CFG branch changes the latents, which must match exactly.
FP32_EPS = 2.0**-23  # torch.finfo(torch.float32).eps
PIXEL_SCALE = 1.0  # pixels in [0, 1]
REASSOCIATED_SUMS = 32  # 31 decoder convs + 1 attention block on each pixel's path
TWO_RANK_PIXEL_ATOL = 8 * FP32_EPS * PIXEL_SCALE * REASSOCIATED_SUMS


def test_cli_demo_two_ranks_passes_and_reports(heavy_runs):
    result = heavy_runs["test_cli_demo_two_ranks_passes_and_reports"].result()
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # Plan 1, parallel=2: CFG parallel (the call guides); plan 2: sequence parallelism alone on both ranks.
    assert "plan 1: hfpatch.apply(pipe, parallel=2)" in lines
    assert "plan: ParallelConfig(data=1, cfg=2, ring=1, ulysses=1, vae=2)" in lines
    assert "plan 2: hfpatch.apply(pipe, parallel=hfpatch.ParallelConfig(ulysses=2))" in lines
    assert "plan: ParallelConfig(data=1, cfg=1, ring=1, ulysses=2, vae=2)" in lines
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"])]
    assert [row[0] for row in rows] == ["0", "1", "0", "1"]
    latents, videos = [float(row[1]) for row in rows], [float(row[2]) for row in rows]
    assert latents[:2] == [0.0, 0.0]  # two-call CFG parallel is bit-exact
    assert all(0.0 <= v <= TWO_RANK_PIXEL_ATOL for v in videos[:2]), videos  # split VAE: fp32 reassociation
    # Ulysses too changes only the order of fp32 sums (the demo's atol; see hfpatch.cli.demo.DEFAULT_ATOL)
    assert all(0.0 <= x <= demo.DEFAULT_ATOL for x in latents[2:] + videos[2:]), (latents, videos)
    for row in rows:  # memory, bytes, then the unpatched and the patched call's time
        assert row[4] in ("KiB", "MiB") and row[-2].endswith("s") and row[-1].endswith("s"), row
    assert (
        "  CFG parallel (cond and uncond calls on different ranks): bit-exact, each call is the unpatched one"
        in lines
    )
    assert any(line.startswith("  sequence parallel (Ulysses 2): equal up to fp32") for line in lines)
    assert any(
        line.startswith("  split VAE (precise, 2 row shards): equal up to fp32 reassociation")
        for line in lines
    )
    assert lines[-1].startswith("verdict: PASS")


def test_cli_info_lists_versions_and_families(heavy_runs):
    result = heavy_runs["test_cli_info_lists_versions_and_families"].result()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for package in ("hfpatch", "torch", "diffusers", "transformers", "peft", "accelerate", "xformers"):
        assert f"\n{package} " in out
    assert "world size    1 (rank 0)" in out
    # A summary: each family once, its options once (issue 33: 50 lines repeated one option dict, twice)
    assert "  pipeline_parallel (pipeline), 1 class: DiffusionPipeline" in out, out
    assert out.count("compile_backend='inductor'") == 1, out
    assert len(out.splitlines()) < 45, out
    assert "`hfpatch info --classes`" in out


def test_cli_info_classes_lists_every_class():
    lines = cli.info_lines(classes=True)
    assert "  diffusers.DiffusionPipeline: pipeline_parallel (pipeline) [check_inputs=True]" in lines
    assert any(line.startswith("  diffusers.WanTransformer3DModel: dit_usp (transformer)") for line in lines)
    assert any(line.startswith("  WanTransformer3DModel: dit_usp (plan:") for line in lines)


def test_cli_demo_failure_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: (False, "verdict: FAIL, max abs diff 1.0e+00"))
    assert cli.main(["demo"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_demo_report_states_exactness_per_path():
    report = demo.format_report(
        [
            demo.DemoResult(
                0, 0.0, "ParallelConfig(data=1, cfg=1, ring=3, ulysses=1, vae=3)", 1, 1, 1, 1.0, 6e-6
            )
        ],
        nproc=3,
        steps=2,
        atol=2e-4,
    ).splitlines()
    assert report[5].split()[:3] == ["0", "6.0e-06", "0.0e+00"]  # rank, latents, video
    assert "  sequence parallel (Ring 3): equal up to fp32 reassociation" in " ".join(report)
    assert not any("CFG" in line for line in report[4:])  # no CFG degree in this plan
    assert demo.exactness_lines("ParallelConfig(data=1, cfg=1, ring=1, ulysses=1, vae=1)")[1] == (
        "  one rank: nothing is split, the patched call is the unpatched computation"
    )


def test_demo_max_nproc_matches_the_tiny_pipeline():
    from hfpatch.testing import tiny_wan_pipe

    # One latent row per rank at least: the VAE split's bound (5 ranks fail in split_rows).
    assert demo.MAX_DEMO_NPROC == demo.HEIGHT // tiny_wan_pipe().vae_scale_factor_spatial == 4


def test_demo_report_verdict_fails_above_tolerance():
    rows = [demo.DemoResult(r, 1e-3 * r, "ParallelConfig(cfg=2)", 2048, 1024, 512, 1.0) for r in range(2)]
    assert demo.format_report(rows, nproc=2, steps=2, atol=2e-4).splitlines()[-1] == (
        "verdict: FAIL, max abs diff 1.0e-03 > 2.0e-04"
    )


def test_cli_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit) as exc:
        cli.main(["frobnicate"])
    assert exc.value.code == 2


BAD_ARGUMENTS = [
    (["demo", "--nproc", "0"], "argument --nproc: must be an integer >= 1, got 0"),
    (["demo", "--nproc", "-1"], "argument --nproc: must be an integer >= 1, got -1"),
    (["demo", "--nproc", "two"], "argument --nproc: invalid int value: 'two'"),
    (
        ["demo", "--nproc", "5"],
        "argument --nproc: must be at most 4, got 5: the demo's 32x32 video has 4 latent rows",
    ),
    (["demo", "--nproc", "8"], "must be at most 4, got 8"),
    (["demo", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    (["demo", "--atol", "-1"], "argument --atol: must be a finite number >= 0, got -1"),
    (["demo", "--atol", "nan"], "argument --atol: must be a finite number >= 0, got nan"),
    (["demo", "--atol", "inf"], "argument --atol: must be a finite number >= 0, got inf"),
    (["selftest", "--nproc", "0"], "argument --nproc: must be an integer >= 1, got 0"),
    (["selftest", "--nproc", "65"], "argument --nproc: must be at most 64, got 65"),
]


@pytest.mark.parametrize(
    "argv, message", BAD_ARGUMENTS, ids=lambda a: " ".join(a) if isinstance(a, list) else None
)
def test_cli_bad_argument_is_a_usage_error_before_any_rank_starts(argv, message, monkeypatch, capsys):
    def must_not_run(**kwargs):
        raise AssertionError("started ranks despite a bad argument")

    monkeypatch.setattr(demo, "run_demo", must_not_run)
    monkeypatch.setattr(demo, "run_selftest", must_not_run)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"hfpatch {argv[0]}: error: " in err and message in err, err
    assert "Traceback" not in err


def test_cli_bad_arguments_fail_before_importing_torch():
    # As a user runs it: exit status 2, argparse's message, no traceback, and torch never imported.
    code = (
        "import sys\n"
        "from hfpatch.cli import main\n"
        f"for argv in {[argv for argv, _ in BAD_ARGUMENTS]!r}:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 2, (argv, exc.code)\n"
        "    else:\n"
        "        raise AssertionError(argv)\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("error: argument") == len(BAD_ARGUMENTS)


def test_run_demo_and_selftest_reject_bad_nproc_before_spawning():
    with pytest.raises(ValueError, match="nproc must be in 1..4"):
        demo.run_demo(nproc=5)
    with pytest.raises(ValueError, match="nproc must be in 1..64"):
        demo.run_selftest(nproc=0)


def test_cli_import_and_parser_are_light():
    code = (
        "import sys, hfpatch.cli; hfpatch.cli.build_parser(); "
        "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'accelerate') if m in sys.modules]; "
        "assert not heavy, heavy; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_cli_help_and_version_in_a_subprocess():
    import hfpatch

    result = _hfpatch("--version", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"hfpatch {hfpatch.__version__}"
    result = _hfpatch("--help", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: hfpatch" in result.stdout and "--version" in result.stdout
    for command in ("demo", "selftest", "bench", "info"):
        assert command in result.stdout
    result = _hfpatch("demo", "--help", timeout=120)
    assert result.returncode == 0 and "1 to 4" in " ".join(result.stdout.split()), result.stdout


def test_lazy_package_still_exposes_the_api():
    code = (
        "import sys, hfpatch; assert 'torch' not in sys.modules; "
        "assert set(hfpatch.__all__) <= set(dir(hfpatch)); "
        "from hfpatch import ParallelConfig; assert hfpatch.apply.__module__ == 'hfpatch.api'; "
        "assert all(getattr(hfpatch, n) is not None for n in hfpatch.__all__); "
        "assert ParallelConfig(cfg=2).world_size == 2; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    import hfpatch

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        hfpatch.nope  # noqa: B018


def test_cli_selftest_two_ranks_passes_every_check(heavy_runs):
    result = heavy_runs["test_cli_selftest_two_ranks_passes_every_check"].result()
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    checks = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    names = " | ".join(checks)
    for check in ("all_gather (uneven)", "all_to_all", "ring=1 ulysses=2", "ring=2 ulysses=1"):
        assert check in names, names
    assert all(line.startswith("PASS") for line in checks) and lines[-1] == "verdict: PASS"


def test_cli_selftest_five_ranks_with_padding_only_shards_passes(heavy_runs):
    # 3N + 1 = 16 rows over 5 ranks in shards of 4: the last rank holds padding only (nothing to compare).
    result = heavy_runs["test_cli_selftest_five_ranks_with_padding_only_shards_passes"].result()
    assert result.returncode == 0, result.stdout + result.stderr
    names = " | ".join(line for line in result.stdout.splitlines() if line.startswith("PASS"))
    assert "ring=1 ulysses=5" in names and "ring=5 ulysses=1" in names, result.stdout
    assert result.stdout.splitlines()[-1] == "verdict: PASS"


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
    # Each description whole (its docstring's first paragraph), wrapped: none cut mid-sentence
    text = " ".join(result.stdout.split())
    assert "bytes of one transformer forward, vs N, against the analytic figures." in text, result.stdout


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
    assert "torchrun --nproc-per-node 2 examples/wan_usp_torchrun.py --tiny" in result.stdout
