"""``examples/integrations/lora_sp_accelerate.py`` under accelerate/DDP trains what the unpatched script trains
on ONE process with the same global batch.

Both runs accumulate gradients over 2 micro-steps with ``accelerator.accumulate`` given a LIST of models (as
diffusers' scripts do: DDP then syncs at every micro-step), clip gradients, encode pixels with the VAE's
posterior SAMPLE, and train a LoRA on the text encoder that feeds the patched transformer as well as on the
transformer. No hfpatch line follows ``accelerator.prepare``.

* world 2 (Ulysses 2, one replica), with validation on the main process after every step (it draws from the
  main process's global RNG) and a ``save_state`` / ``load_state`` resume in the middle: two launches.
* world 4 (2 data replicas x Ulysses 2): against one process that trains on both replicas' samples with the
  draws each replica makes (``--replicas 2``).

Each reference runs in fp32 and fp64; their gap is the rounding noise of this training run. The losses of
every step and the LoRA weight updates (transformer and text encoder) must equal the fp32 reference within
``reassociation_tol`` of that noise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from hfpatch.testing.tolerance import reassociation_tol, rel_error

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "integrations" / "lora_sp_accelerate.py"
STEPS, CHECKPOINT = 4, 2
# SGD: AdamW's first updates are ~lr * sign(grad), which turns rounding noise on tiny gradients into
# lr-sized weight differences (the script's default stays AdamW, as DreamBooth's).
COMMON = ["--steps", str(STEPS), "--optimizer", "sgd", "--grad-accum", "2", "--train-text-encoder"]


def _fsdp2_launcher(world: int) -> list[str]:
    """``accelerate launch --use_fsdp --fsdp_version 2`` on ``world`` CPU processes (through the shim that
    gives accelerate's FSDP2 on CPU, :mod:`accelerate_fsdp2_cpu`; see its docstring)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        *("-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2"),
        *("--num_processes", str(world), "--num_machines", "1", "--main_process_port", str(port)),
        *("--mixed_precision", "no", "--dynamo_backend", "no"),
        # blocks from _no_split_modules; accelerate's cpu_ram_efficient_loading (its default) fails on diffusers
        # models with root-level parameters (Wan's scale_shift_table: no get_parameter_or_buffer)
        *("--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_cpu_ram_efficient_loading", "false"),
        str(Path(__file__).with_name("accelerate_fsdp2_cpu.py")),
    ]


def _run(args: list[str], out: Path, world: int = 1, common: list[str] = COMMON, fsdp2: bool = False) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "HFPATCH_TIMEOUT_S": "120"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
    )
    if fsdp2:
        launcher = _fsdp2_launcher(world)
    command = [sys.executable, *launcher, str(SCRIPT), *common, "--output-dir", str(out), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    name = args[args.index("--results-file") + 1] if "--results-file" in args else "results.json"
    return json.loads((out / name).read_text()) if (out / name).exists() else {}


def _updates(result: dict) -> dict[str, torch.Tensor]:
    return {
        f"{model}:{k}": torch.tensor(
            [b - a for a, b in zip(result["lora_init"][model][k], v)], dtype=torch.float64
        )
        for model, weights in result["lora_final"].items()
        for k, v in weights.items()
    }


def _compare(
    losses: dict[str, float],
    final: dict,
    ref32: dict,
    ref64: dict,
    trained: tuple[str, ...] = ("transformer", "text_encoder"),
) -> str:
    steps = [str(s) for s in range(STEPS)]
    got = torch.tensor([losses[s] for s in steps])
    loss32 = torch.tensor([ref32["losses"][s] for s in steps])
    loss64 = torch.tensor([ref64["losses"][s] for s in steps], dtype=torch.float64)
    loss_noise, loss_error = rel_error(loss32, loss64), rel_error(got, loss32)
    assert loss_error <= reassociation_tol(loss_noise), (loss_error, loss_noise)

    # The LoRA updates (final - initial), each tensor relative to its fp64 update (at least 1% of the largest:
    # lora_B starts at zero, so a tensor's update can be tiny next to the others).
    got_u, want, want64 = (_updates(r) for r in (final, ref32, ref64))
    assert got_u.keys() == want.keys() == want64.keys(), sorted(set(got_u) ^ set(want))
    assert all(any(k.startswith(f"{model}:") for k in want) for model in trained), sorted(want)
    floor = 0.01 * max(v.abs().max().item() for v in want64.values())
    scales = {k: max(v.abs().max().item(), floor) for k, v in want64.items()}
    weight_noise = max(rel_error(want[k], want64[k], scales[k]) for k in want)
    errors = {k: rel_error(got_u[k], want[k], scales[k]) for k in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= reassociation_tol(weight_noise), (worst, errors[worst], weight_noise)

    val_noise = rel_error(torch.tensor(ref32["validation_loss"]), torch.tensor(ref64["validation_loss"]))
    val_error = rel_error(torch.tensor(final["validation_loss"]), torch.tensor(ref32["validation_loss"]))
    assert val_error <= reassociation_tol(val_noise), (val_error, val_noise)
    return (
        f"loss {loss_error:.3g} <= {reassociation_tol(loss_noise):.3g}; LoRA updates {errors[worst]:.3g} <= "
        f"{reassociation_tol(weight_noise):.3g}; validation {val_error:.3g} <= {reassociation_tol(val_noise):.3g}"
    )


def test_lora_sp_accelerate_world2_accumulation_text_encoder_resume(tmp_path):
    ref32 = _run(["--no-hfpatch"], tmp_path / "ref32")
    ref64 = _run(["--no-hfpatch", "--dtype", "float64"], tmp_path / "ref64")
    sp = tmp_path / "sp"
    # Validation after every step on the main process only, then a checkpoint, an exit and a resume.
    patched = ["--validate-every", "1", "--checkpoint-at", str(CHECKPOINT)]
    _run([*patched, "--stop-after-checkpoint", "--results-file", "first.json"], sp, world=2)
    assert (sp / f"checkpoint-{CHECKPOINT}").is_dir()
    first = json.loads((sp / "first.json").read_text())
    resumed = _run(["--validate-every", "1", "--resume", "--results-file", "resumed.json"], sp, world=2)
    assert first["world"] == resumed["world"] == 2 and "ulysses=2" in first["plan"], first["plan"]
    assert sorted(first["losses"]) == ["0", "1"] and sorted(resumed["losses"]) == ["2", "3"]
    assert sorted(first["mid_run_validations"]) == ["0", "1"]
    print(_compare({**first["losses"], **resumed["losses"]}, resumed, ref32, ref64))


def test_lora_sp_accelerate_world4_two_replicas_of_ulysses2(tmp_path):
    reference = ["--no-hfpatch", "--replicas", "2"]
    ref32 = _run(reference, tmp_path / "ref32")
    ref64 = _run([*reference, "--dtype", "float64"], tmp_path / "ref64")
    run = _run(["--ulysses", "2"], tmp_path / "sp", world=4)
    assert run["world"] == 4 and "data=2" in run["plan"] and "ulysses=2" in run["plan"], run["plan"]
    print(_compare(run["losses"], run, ref32, ref64))


def test_lora_sp_accelerate_fsdp2_world2_ulysses2_resume(tmp_path):
    """The same script under ``accelerate launch --use_fsdp --fsdp_version 2``: accelerate shards the patched
    transformer block by block (``fully_shard``), averages the gradients with FSDP2's reduce-scatter (no hfpatch
    line), clips them as DTensors, saves a sharded (DCP) checkpoint and resumes from it. FSDP2 in accelerate
    prepares one model, so only the transformer trains (its LoRA); validation runs on every rank (the weights
    are sharded), patched."""
    common = [a for a in COMMON if a != "--train-text-encoder"]
    ref32 = _run(["--no-hfpatch"], tmp_path / "ref32", common=common)
    ref64 = _run(["--no-hfpatch", "--dtype", "float64"], tmp_path / "ref64", common=common)
    sp = tmp_path / "fsdp2"
    patched = ["--validate-every", "1", "--checkpoint-at", str(CHECKPOINT)]
    _run([*patched, "--stop-after-checkpoint", "--results-file", "first.json"], sp, 2, common, fsdp2=True)
    assert (sp / f"checkpoint-{CHECKPOINT}" / "pytorch_model_fsdp_0").is_dir()  # a sharded DCP checkpoint
    first = json.loads((sp / "first.json").read_text())
    resumed = _run(
        ["--validate-every", "1", "--resume", "--results-file", "resumed.json"], sp, 2, common, fsdp2=True
    )
    assert first["fsdp"] and resumed["fsdp"] and "ulysses=2" in first["plan"], first
    assert sorted(first["losses"]) == ["0", "1"] and sorted(resumed["losses"]) == ["2", "3"]
    assert sorted(first["mid_run_validations"]) == ["0", "1"]
    print(_compare({**first["losses"], **resumed["losses"]}, resumed, ref32, ref64, trained=("transformer",)))


def test_lora_sp_accelerate_under_torchrun_without_the_cpu_flag_refuses(tmp_path):
    """Issue 33: on CPU without ``ACCELERATE_USE_CPU=true`` accelerate counts one process in each rank, so the
    script trained twice on its own, silently. ``hfpatch.apply`` sees the launcher's ``WORLD_SIZE=2`` and
    refuses on both ranks, naming the fix; nothing is written."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HFPATCH_TIMEOUT_S": "120"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(var, None)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = tmp_path / "out"
    command = [sys.executable, *launcher, str(SCRIPT), "--steps", "1", "--output-dir", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout[-2000:]
    for rank in (0, 1):
        assert (
            f"[rank{rank}]: RuntimeError: the launcher started WORLD_SIZE=2 processes, but accelerate sees 1"
            in (done.stderr)
        ), done.stderr[-4000:]
    assert "set ACCELERATE_USE_CPU=true" in done.stderr
    assert not (out / "results.json").exists()
