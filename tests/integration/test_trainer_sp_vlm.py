"""``examples/integrations/trainer_sp_vlm.py``: a transformers ``Trainer`` LoRA fine-tune of a stock Qwen3-VL
under ``torchrun --nproc-per-node 2`` with sequence parallelism trains what the unpatched script trains on ONE
process.

The Trainer wraps the model in DDP (which averages the per-rank gradients: hfpatch's convention makes that
the full gradient), accumulates gradients over 2 micro-batches and logs the loss of every step. The batches
hold images of several sizes (two in one sample), videos and text-only rows, left padded. Runs: Ulysses 2 with
the gathered outputs (the default), Ring 2 with ``sp_output="shard"`` (sharded logits, the loss summed over
ranks). The reference runs in fp32 and fp64; their gap is this training run's rounding noise, and the logged
losses and the LoRA weight updates must equal the fp32 reference within ``reassociation_tol`` of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hfpatch.testing.tolerance import reassociation_tol, rel_error

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "integrations" / "trainer_sp_vlm.py"
SEVERAL_RUNS = Path(__file__).with_name("several_runs.py")


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "HFPATCH_TIMEOUT_S": "120"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _command(runs: list[tuple[list[str], Path]], world: int) -> list[str]:
    """The runs of the script one after the other in ONE launch of ``world`` processes (``several_runs.py``;
    starting a process costs ~7 s of CPU, a run of 3 tiny steps about a second)."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
    )
    argvs = [json.dumps(["--steps", "3", "--output-dir", str(out), *args]) for args, out in runs]
    return [sys.executable, *launcher, str(SEVERAL_RUNS), str(SCRIPT), *argvs]


def _finish(process: subprocess.Popen, command: list[str], runs: list[tuple[list[str], Path]]) -> list[dict]:
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, f"{' '.join(command)}\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return [json.loads((out / "results.json").read_text()) for _, out in runs]


def _start(runs: list[tuple[list[str], Path]], world: int = 1) -> tuple[subprocess.Popen, list[str]]:
    command = _command(runs, world)
    process = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process, command


def _updates(result: dict) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in result["updates"].items()}


def test_trainer_lora_qwen3_vl_sequence_parallel_equals_one_process(tmp_path):
    # The two unpatched references in one process, in the background while the patched runs train (one
    # torchrun launch for both plans).
    references = [
        (["--no-hfpatch"], tmp_path / "ref32"),
        (["--no-hfpatch", "--dtype", "float64"], tmp_path / "ref64"),
    ]
    plans = {"ulysses2": [], "ring2_shard": ["--ring", "2", "--sp-output", "shard"]}
    patched = [(args, tmp_path / name) for name, args in plans.items()]
    background = _start(references)
    try:
        got_all = dict(zip(plans, _finish(*_start(patched, world=2), patched)))
        ref32, ref64 = _finish(*background, references)
    finally:
        if background[0].poll() is None:
            background[0].kill()
            background[0].communicate()
    loss32, loss64 = torch.tensor(ref32["losses"]), torch.tensor(ref64["losses"], dtype=torch.float64)
    assert len(loss32) == 3
    loss_tol = reassociation_tol(rel_error(loss32, loss64))
    want, want64 = _updates(ref32), _updates(ref64)
    assert len(want) == 16  # q/k/v/o LoRA A and B in both language-model layers
    floor = 0.01 * max(v.abs().max().item() for v in want64.values())
    scales = {k: max(v.abs().max().item(), floor) for k, v in want64.items()}
    weight_tol = reassociation_tol(max(rel_error(want[k], want64[k], scales[k]) for k in want))
    for name, got in got_all.items():
        assert rel_error(torch.tensor(got["losses"]), loss32) <= loss_tol, (
            name,
            got["losses"],
            ref32["losses"],
        )
        updates = _updates(got)
        assert updates.keys() == want.keys()
        for k in want:
            assert rel_error(updates[k], want[k], scales[k]) <= weight_tol, (name, k)
