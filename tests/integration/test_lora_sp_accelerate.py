"""``examples/integrations/lora_sp_accelerate.py`` trains the same LoRA at world 2 (sequence parallel, under
accelerate's DDP, with a checkpoint and a resume in the middle) as the unpatched script on ONE process.

Four launches: the reference in fp32 and in fp64 (one process each; their gap is the rounding noise of this
training run), then two ranks via ``torch.distributed.run`` for steps 0-1 (``save_state`` after step 2's
predecessor) and a second launch resuming from that checkpoint for steps 2-3. The losses of every step and
the LoRA weight updates must equal the fp32 reference within ``reassociation_tol`` of that noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hfpatch.testing.tolerance import reassociation_tol, rel_error

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "integrations" / "lora_sp_accelerate.py"
STEPS, CHECKPOINT = 4, 2
# SGD: AdamW's first updates are ~lr * sign(grad), which turns rounding noise on tiny gradients into
# lr-sized weight differences (the script's default stays AdamW, as DreamBooth's).
COMMON = ["--steps", str(STEPS), "--optimizer", "sgd"]


def _run(args: list[str], out: Path, world: int = 1) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "HFPATCH_TIMEOUT_S": "120"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
    )
    command = [sys.executable, *launcher, str(SCRIPT), *COMMON, "--output-dir", str(out), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _updates(result: dict) -> dict[str, list[float]]:
    return {k: [b - a for a, b in zip(result["lora_init"][k], v)] for k, v in result["lora_final"].items()}


def test_lora_sp_accelerate_matches_one_process(tmp_path):
    import torch

    _run(["--no-hfpatch"], tmp_path / "ref32")
    _run(["--no-hfpatch", "--dtype", "float64"], tmp_path / "ref64")
    sp = tmp_path / "sp"
    _run(["--checkpoint-at", str(CHECKPOINT), "--stop-after-checkpoint"], sp, world=2)
    assert (sp / f"checkpoint-{CHECKPOINT}").is_dir()
    _run(["--resume", "--results-file", "resumed.json"], sp, world=2)

    ref32, ref64 = _load(tmp_path / "ref32" / "results.json"), _load(tmp_path / "ref64" / "results.json")
    first, resumed = _load(sp / "results.json"), _load(sp / "resumed.json")
    assert first["world"] == resumed["world"] == 2 and "ulysses=2" in first["plan"], first["plan"]
    assert sorted(first["losses"]) == ["0", "1"] and sorted(resumed["losses"]) == ["2", "3"]

    steps = [str(s) for s in range(STEPS)]
    losses = torch.tensor([{**first["losses"], **resumed["losses"]}[s] for s in steps])
    loss32 = torch.tensor([ref32["losses"][s] for s in steps])
    loss64 = torch.tensor([ref64["losses"][s] for s in steps], dtype=torch.float64)
    loss_noise = rel_error(loss32, loss64)
    loss_error = rel_error(losses, loss32)
    assert loss_error <= reassociation_tol(loss_noise), (loss_error, loss_noise)

    # The LoRA updates (final - initial), each tensor relative to its fp64 update (at least 1% of the largest:
    # lora_B starts at zero, so a tensor's update can be tiny next to the others).
    got, want, want64 = (
        {k: torch.tensor(v, dtype=torch.float64) for k, v in _updates(r).items()}
        for r in (resumed, ref32, ref64)
    )
    assert got.keys() == want.keys() == want64.keys() and got
    floor = 0.01 * max(v.abs().max().item() for v in want64.values())
    scales = {k: max(v.abs().max().item(), floor) for k, v in want64.items()}
    weight_noise = max(rel_error(want[k], want64[k], scales[k]) for k in want)
    weight_error = max(rel_error(got[k], want[k], scales[k]) for k in want)
    assert weight_error <= reassociation_tol(weight_noise), (weight_error, weight_noise)

    # Validation ran on the main process only, unpatched, on the resumed run's final weights.
    val_noise = rel_error(torch.tensor(ref32["validation_loss"]), torch.tensor(ref64["validation_loss"]))
    val_error = rel_error(torch.tensor(resumed["validation_loss"]), torch.tensor(ref32["validation_loss"]))
    assert val_error <= reassociation_tol(val_noise), (val_error, val_noise)
    print(
        f"loss {loss_error:.3g} <= {reassociation_tol(loss_noise):.3g}; LoRA update {weight_error:.3g} <= "
        f"{reassociation_tol(weight_noise):.3g}; validation {val_error:.3g} <= {reassociation_tol(val_noise):.3g}"
    )
