"""The examples run as documented: scripts on CPU with tiny models, notebooks through a real kernel.

Each runs in a fresh process (as a user would run it; two at a time) and must exit 0; the scripts
check their own results (e.g. the parallel VAE example's ``--check`` compares with the unpatched decode and fails
otherwise).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

SCRIPTS = [
    ["examples/pixel_loss_finetune.py"],
    ["examples/pixel_loss_video.py", "--frames", "8", "--steps", "1", "--check"],
    ["examples/gradcache_accelerate.py", "--lora", "--checkpointing"],
    ["examples/streaming_generate.py", "--blocks", "4", "--switch-at", "2"],
    [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "examples/parallel_vae_decode.py",
        "--tiny",
        "--check",
    ],
    ["examples/wan_usp_torchrun.py", "--help"],  # needs the real checkpoint and GPUs to run for real
]


NOTEBOOKS = sorted(p.name for p in EXAMPLES.glob("*.ipynb"))


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def script_runs(request, tmp_path_factory):
    """Every selected script run and notebook of this module, started at once two at a time, the longest first:
    most of a script's time is one process importing torch and diffusers on one core, so two keep both cores busy.
    Each test waits for its own (``argv`` tuple -> future of the finished process; ``("notebook", name)`` -> future
    of its execution)."""
    frames = tmp_path_factory.mktemp("wan_usp") / "frames.pt"
    wanted = [tuple(argv) for argv in SCRIPTS]
    wanted.insert(0, ("-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/wan_usp_torchrun.py", "--tiny",
                   "--output", str(frames)))  # fmt: skip
    selected = {
        item.name for item in request.session.items if getattr(item, "module", None) is request.module
    }
    if not any(name.startswith("test_example_wan_usp_torchrun_tiny") for name in selected):
        wanted.pop(0)
    wanted = [
        a
        for a in wanted
        if a[-1] == str(frames) or f"test_example_script_runs[{' '.join(a[-3:])}]" in selected
    ]
    notebooks = [name for name in NOTEBOOKS if f"test_example_notebook_executes[{name}]" in selected]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs: dict[tuple, Future] = {argv: pool.submit(_run, list(argv)) for argv in wanted}
        runs.update({("notebook", name): pool.submit(_execute_notebook, name) for name in notebooks})
        yield runs, frames


def test_example_wan_usp_torchrun_tiny_equals_unpatched(script_runs):
    # The real script on the tiny pipeline: 2 CPU ranks under torchrun, checked against the unpatched run.
    runs, output = script_runs
    argv = next(a for a in runs if a[-1] == str(output))
    out = runs[argv].result()
    assert out.returncode == 0, f"{argv} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    # In the output, not as whole lines: the ranks' unbuffered prints write a line's text and its newline apart,
    # so another rank's line may land in between.
    assert "plan: ParallelConfig(data=1, cfg=2, ring=1, ulysses=1, vae=2)" in out.stdout, out.stdout
    for rank in (0, 1):
        assert (
            f"rank {rank}: output equals the unpatched pipeline's up to fp32 reassociation" in out.stdout
        ), out.stdout
    assert f"saved {output} (tiny mode: the frames as a tensor, no mp4)" in out.stdout, out.stdout  # idem
    import torch

    frames = torch.load(output)
    assert frames.shape == (5, 32, 32, 3) and 0.0 <= frames.min() and frames.max() <= 1.0


def test_testing_exports_every_builder():
    import hfpatch.testing
    import hfpatch.testing.models
    import hfpatch.testing.runner

    names = set(hfpatch.testing.__all__)
    assert (
        set(hfpatch.testing.models.__all__) | set(hfpatch.testing.runner.__all__) | {"track_memory"} == names
    )
    assert names <= set(dir(hfpatch.testing))
    for name in sorted(names):
        assert callable(getattr(hfpatch.testing, name)), name
    for name in hfpatch.testing.models.__all__:
        assert f":func:`{name}`" in hfpatch.testing.__doc__, f"{name} is not in the hfpatch.testing docstring"
    with pytest.raises(AttributeError, match="has no attribute 'tiny_nope'"):
        hfpatch.testing.tiny_nope  # noqa: B018


@pytest.mark.parametrize("argv", SCRIPTS, ids=lambda a: " ".join(a[-3:]))
def test_example_script_runs(argv, script_runs):
    out = script_runs[0][tuple(argv)].result()
    assert out.returncode == 0, f"{argv} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def _execute_notebook(name: str) -> None:
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    for attempt in range(2):
        client = nbclient.NotebookClient(
            notebook, timeout=300, resources={"metadata": {"path": str(EXAMPLES)}}
        )
        try:
            client.execute()  # raises CellExecutionError with the failing cell's traceback
            return
        except RuntimeError as exc:
            # jupyter_client picks free ports and binds them later; another process (a gloo rank, a second
            # test run) may take one in between and the kernel dies at start. Only that is retried, once.
            if "Kernel died before replying to kernel_info" not in str(exc) or attempt:
                raise


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_example_notebook_executes(name, script_runs):
    script_runs[0][("notebook", name)].result()  # re-raises the kernel's error
