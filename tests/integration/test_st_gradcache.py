"""``examples/integrations/st_gradcache.py`` trains at world 2 with ``GradCacheLoss(cross_rank=True)`` as the
stock script (plain ``MultipleNegativesRankingLoss``) trains on ONE process with the global batch.

``SentenceTransformerTrainer`` under DDP gives rank ``r`` the ``r``-th of every two consecutive batches of the
same shuffled order, so one global step of 2 x 16 pairs holds exactly the 32 pairs of the one-process step, in
the same order; each rank scores its anchors against all 32 positives and DDP averages the two ranks' mean
losses' gradients: the global batch's. Two launches at once: the reference in fp32 and fp64 one after the other
in one process (``several_runs.py``; their gap is the rounding noise of this training run) and two ranks via
``torch.distributed.run``. The losses of every step and
the weight updates must equal the fp32 reference within ``reassociation_tol`` of that noise. SGD, no dropout:
AdamW's first updates are ~lr * sign(grad), which turns rounding noise on tiny gradients into lr-sized ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfpatch.testing.tolerance import reassociation_tol, rel_error

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "integrations" / "st_gradcache.py"
COMMON = [
    "--steps",
    "4",
    "--dropout",
    "0",
    "--mini-batch-size",
    "4",
    "--optim",
    "sgd",
    "--learning-rate",
    "0.5",
]
# lr 0.5: SGD updates large enough (~1e-2 of the weights) that fp32 storage of the weights does not drown them.


def _start(runs: list[tuple[list[str], Path]], world: int = 1) -> tuple[subprocess.Popen, list[str]]:
    """The runs of the script one after the other in ONE launch of ``world`` processes (``several_runs.py``),
    started in the background."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
    )
    argvs = [json.dumps([*COMMON, "--results-file", str(results), *args]) for args, results in runs]
    command = [
        sys.executable,
        *launcher,
        str(Path(__file__).with_name("several_runs.py")),
        str(SCRIPT),
        *argvs,
    ]
    cwd = runs[0][1].parent
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
    )
    return process, command


def _finish(started: tuple[subprocess.Popen, list[str]], runs: list[tuple[list[str], Path]]) -> list[dict]:
    process, command = started
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, f"{' '.join(command)}\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return [json.loads(results.read_text()) for _, results in runs]


def test_st_gradcache_world_2_matches_one_process_global_batch(tmp_path):
    pytest.importorskip("datasets", reason="SentenceTransformerTrainer needs sentence-transformers[train]")
    import torch

    references = [
        (["--no-hfpatch", "--batch-size", "32"], tmp_path / "ref32.json"),
        (["--no-hfpatch", "--batch-size", "32", "--dtype", "float64"], tmp_path / "ref64.json"),
    ]
    patched = [(["--batch-size", "16"], tmp_path / "gc.json")]
    background = _start(references)
    try:
        (got,) = _finish(_start(patched, world=2), patched)
        ref32, ref64 = _finish(background, references)
    finally:
        if background[0].poll() is None:  # the patched launch failed: do not leave the references running
            background[0].kill()
            background[0].communicate()
    assert got["world"] == 2 and len(got["losses"]) == len(ref32["losses"]) == 4

    losses, loss32, loss64 = (torch.tensor(r["losses"], dtype=torch.float64) for r in (got, ref32, ref64))
    loss_noise = rel_error(loss32, loss64)
    loss_error = rel_error(losses, loss32)
    assert loss_error <= reassociation_tol(loss_noise), (loss_error, loss_noise)

    def updates(result: dict) -> dict[str, torch.Tensor]:
        return {
            k: torch.tensor(v, dtype=torch.float64) - torch.tensor(result["initial"][k], dtype=torch.float64)
            for k, v in result["final"].items()
        }

    # Every tensor's update relative to the largest update of all (embeddings of unused words do not move).
    upd, upd32, upd64 = updates(got), updates(ref32), updates(ref64)
    assert upd.keys() == upd32.keys() == upd64.keys() and upd
    scale = max(v.abs().max().item() for v in upd64.values())
    assert scale > 0
    weight_noise = max(rel_error(upd32[k], upd64[k], scale) for k in upd32)
    weight_error = max(rel_error(upd[k], upd32[k], scale) for k in upd32)
    assert weight_error <= reassociation_tol(weight_noise), (weight_error, weight_noise)
    print(
        f"losses {loss_error:.3g} <= {reassociation_tol(loss_noise):.3g}; weight updates {weight_error:.3g} "
        f"<= {reassociation_tol(weight_noise):.3g}"
    )
