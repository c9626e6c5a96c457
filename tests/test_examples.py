"""The examples run as documented: scripts on CPU with tiny models, notebooks through a real kernel.

Each runs in a fresh process (as a user would run it) and must exit 0; the scripts check their own results
(e.g. the parallel VAE example's ``--check`` compares with the unpatched decode and fails otherwise).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

SCRIPTS = [
    ["examples/pixel_loss_finetune.py"],
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


@pytest.mark.parametrize("argv", SCRIPTS, ids=lambda a: " ".join(a[-3:]))
def test_example_script_runs(argv):
    out = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"{argv} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.ipynb")))
def test_example_notebook_executes(name):
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()  # raises CellExecutionError with the failing cell's traceback
