"""``examples/integrations/lora_sp_accelerate.py`` under accelerate/DDP, several epochs, a resume, accumulation.

The DreamBooth-style example keeps its shuffled loader in ``accelerator.prepare`` (``hfpatch.
data_parallel_loaders``), draws every micro-step's randomness in ``with rng:`` (``hfpatch.StepRNG``), accumulates
over 2 micro-steps with ``accelerator.accumulate`` given a LIST of models (as diffusers' scripts do: DDP then
syncs at every micro-step), clips gradients, encodes pixels with the VAE's posterior SAMPLE, trains a LoRA on
the text encoder that feeds the patched transformer as well as on the transformer, and validates on the main
process after every optimizer step (drawing from the main process's global RNG). Three epochs over 3 samples
per replica: ``len(loader) % accumulation == 1``, so each epoch ends with a one-micro-step window.

Each world size runs the patched script once (saving a checkpoint in the middle of epoch 1) and a second
launch resumed from that checkpoint, and compares with:

* the recipe unpatched on ONE process with the same global batch (``--unpatched``, in fp32 and fp64; with
  ``--replicas 2`` it trains on both replicas' samples with the draws each replica makes): losses, LoRA updates
  of both models and the validation loss within ``reassociation_tol`` of that run's fp32-vs-fp64 noise, and
  the same samples and random draws at every micro-step, bit for bit;
* itself: every micro-step of the three epochs draws a new VAE sample, noise and timesteps, the same on the
  ranks of a group (and per replica at world 4); the resumed launch trains on the same samples with the same
  draws and ends with the same LoRA weights and validation loss as the uninterrupted one, bit for bit;
* the STOCK script (``--stock``: no hfpatch line, one process; world 2): the same number of optimizer steps
  (accelerate's end-of-epoch windows) and the first epoch's samples in its order; its own draws never repeat
  either (the global RNG moves).

The FSDP2 case runs the same script under ``accelerate launch --use_fsdp --fsdp_version 2`` over one sample.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hfpatch.testing.tolerance import reassociation_tol, rel_error

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "integrations" / "lora_sp_accelerate.py"
#: diffusers' CogVideoX LoRA script (issue 51). Its runs share this module's launches and reference process:
#: their command lines start with its path (``several_runs.py``).
COGVIDEOX = ROOT / "examples" / "integrations" / "cogvideox_lora_sp.py"
EPOCHS, STEPS_PER_EPOCH, CHECKPOINT = 3, 2, 3  # 3 batches per replica: windows of 2 and 1 micro-steps
# SGD: AdamW's first updates are ~lr * sign(grad), which turns rounding noise on tiny gradients into
# lr-sized weight differences (the script's default stays AdamW, as DreamBooth's).
COMMON = [
    *("--epochs", str(EPOCHS), "--grad-accum", "2", "--optimizer", "sgd"),
    *("--train-text-encoder", "--validate-every", "1"),
]


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


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "HFPATCH_TIMEOUT_S": "120"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _results(args: list[str], out: Path, world: int) -> dict:
    """A launch's main-process results, with ``traces``: every process's micro-steps."""
    name = args[args.index("--results-file") + 1] if "--results-file" in args else "results.json"
    results = json.loads((out / name).read_text())
    results["traces"] = [
        json.loads((out / f"{name}.rank{r}.json").read_text())["trace"] for r in range(world)
    ]
    return results


def _run(
    args: list[str],
    out: Path,
    world: int = 1,
    common: list[str] = COMMON,
    fsdp2: bool = False,
    script: Path = SCRIPT,
) -> dict:
    """Launch the example; its main process's results, with ``traces``: every process's micro-steps."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
    )
    if fsdp2:
        launcher = _fsdp2_launcher(world)
    command = [sys.executable, *launcher, str(script), *common, "--output-dir", str(out), *args]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return _results(args, out, world)


def _run_several(runs: list[tuple[list[str], Path]], world: int) -> list[dict]:
    """``_run`` for each ``(full command line, out)`` of ``runs``, one after the other in ONE launch of ``world``
    processes under torchrun (``several_runs.py``: a launch costs ~7 s of CPU per process, a tiny run under a
    second)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    argvs = [json.dumps([*argv, "--output-dir", str(out)]) for argv, out in runs]
    command = [
        sys.executable,
        *launcher,
        str(Path(__file__).with_name("several_runs.py")),
        str(SCRIPT),
        *argvs,
    ]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [_results(argv, out, world) for argv, out in runs]


class _PatchedLaunches:
    """The first patched launch of each world size, shared by the tests that use it: the epochs run that saves
    the mid-run checkpoint, then the learning-rate schedules, one after the other in ONE torchrun launch
    (``_run_several``; the epochs run first, so it runs as in a launch of its own). The resumed launches stay
    launches of their own: a resume must start from a fresh process."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.done: dict[int, dict[str, dict]] = {}

    def folder(self, world: int, name: str) -> Path:
        return self.tmp / f"world{world}" / name

    def runs(self, world: int) -> list[tuple[str, list[str]]]:
        ulysses = dict(LR_WORLDS)[world]
        samples = ["--num-samples", str(3 * (world // ulysses))]  # 3 batches per data replica
        epochs = [*COMMON, *samples, "--checkpoint-at", str(CHECKPOINT)]
        if world > ulysses:
            epochs += ["--ulysses", str(ulysses)]
        lr_data = [*samples, "--ulysses", str(ulysses)]
        cogvideox = [("cogvideox", [str(COGVIDEOX), *COGVIDEOX_COMMON])] if world == 2 else []
        return (
            [("epochs", epochs)]
            + [(f"lr-{k}", [*LR_COMMON, *lr_data, *args]) for k, args in _lr_cases(world).items()]
            + cogvideox
        )

    def results(self, world: int) -> dict[str, dict]:
        if world not in self.done:
            runs = self.runs(world)
            found = _run_several([(argv, self.folder(world, name)) for name, argv in runs], world)
            self.done[world] = {name: result for (name, _), result in zip(runs, found)}
        return self.done[world]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> _PatchedLaunches:
    return _PatchedLaunches(tmp_path_factory.mktemp("patched"))


def _references(tmp: Path) -> dict[str, list[tuple[list[str], Path]]]:
    """Per test: the one-process runs it compares with (references, stock): full command lines and output dirs."""
    data3, data6 = ["--num-samples", "3"], ["--num-samples", "6"]
    replicas = [*data6, "--unpatched", "--replicas", "2"]
    fsdp2 = [a for a in COMMON if a != "--train-text-encoder"] + ["--num-samples", "1"]
    runs = {
        "world2": [
            ([*COMMON, *data3, "--unpatched"], "ref32"),
            ([*COMMON, *data3, "--unpatched", "--dtype", "float64"], "ref64"),
            ([*COMMON, *data3, "--stock"], "stock"),
        ],
        "world4": [([*COMMON, *replicas], "ref32"), ([*COMMON, *replicas, "--dtype", "float64"], "ref64")],
        "fsdp2": [
            ([*fsdp2, "--unpatched"], "ref32"),
            ([*fsdp2, "--unpatched", "--dtype", "float64"], "ref64"),
        ],
    }
    cogvideox = [str(COGVIDEOX), *COGVIDEOX_COMMON]
    runs["cogvideox"] = [
        ([*cogvideox, "--unpatched"], "ref32"),
        ([*cogvideox, "--unpatched", "--dtype", "float64"], "ref64"),
        ([*cogvideox, "--stock"], "stock"),
    ]
    for world, ulysses in LR_WORLDS:
        replicas = world // ulysses
        lr = [*LR_COMMON, "--num-samples", str(3 * replicas), "--batch-size", str(replicas)]
        runs[f"lr{world}"] = [([*lr, *args, "--stock"], f"stock-{k}") for k, args in _lr_cases(world).items()]
    return {key: [(argv, tmp / key / name) for argv, name in found] for key, found in runs.items()}


class _OneProcessRuns:
    """Every one-process run (references, stock) of the selected tests, one after the other in ONE process
    started with the module (``several_runs.py``: each run builds its own Accelerator, models, loader and
    optimizer and seeds every RNG it draws from; starting a process costs ~7 s of CPU, a tiny run ~0.5 s), in
    the background while the tests launch the patched runs; :meth:`results` waits for one test's runs."""

    def __init__(self, runs: dict[str, list[tuple[list[str], Path]]], log: Path) -> None:
        self.runs = runs
        argvs = [
            json.dumps([*argv, "--output-dir", str(out)]) for found in runs.values() for argv, out in found
        ]
        self.command = [sys.executable, str(Path(__file__).with_name("several_runs.py")), str(SCRIPT), *argvs]
        self.log = log  # a file, not a pipe: nobody reads a pipe while the tests poll for results
        with open(log, "w") as out:
            self.process = subprocess.Popen(self.command, env=_env(), stdout=out, stderr=subprocess.STDOUT)

    def results(self, key: str) -> list[dict]:
        """The results of test ``key``'s runs, once their files are written (the process goes on)."""
        deadline = time.monotonic() + 600
        while True:
            # a run's results.json is its last file; the next run starts only after it is closed
            done = self.process.poll() is not None
            try:
                return [_results(argv, out, 1) for argv, out in self.runs[key]]
            except (FileNotFoundError, json.JSONDecodeError):
                if done or time.monotonic() > deadline:
                    self.close()
                    output = self.log.read_text()
                    raise AssertionError(f"{' '.join(self.command)}\n{output[-8000:]}") from None
            time.sleep(0.2)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def references(request, tmp_path_factory):
    """The one-process runs of the module's selected tests, started once with the module (see :class:`_OneProcessRuns`)."""
    names = {
        item.name.split("[")[0] + "["
        for item in request.session.items
        if getattr(item, "module", None) is request.module
    }
    wanted = {
        "world2": "test_lora_sp_accelerate_world2_epochs_resume_against_stock[",
        "world4": "test_lora_sp_accelerate_world4_two_replicas_of_ulysses2_resume[",
        "fsdp2": "test_lora_sp_accelerate_fsdp2_world2_ulysses2_resume[",
        "cogvideox": "test_cogvideox_lora_script_world2_epochs_resume_against_stock[",
        **{
            f"lr{w}": "test_lora_sp_accelerate_lr_schedule_equals_the_stock_script_on_one_process["
            for w, _ in LR_WORLDS
        },
    }
    tmp = tmp_path_factory.mktemp("references")
    runs = {k: v for k, v in _references(tmp).items() if wanted[k] in names}
    runner = _OneProcessRuns(runs, tmp / "output.log")
    yield runner
    runner.close()


def _updates(result: dict) -> dict[str, torch.Tensor]:
    return {
        f"{model}:{k}": torch.tensor(
            [b - a for a, b in zip(result["lora_init"][model][k], v)], dtype=torch.float64
        )
        for model, weights in result["lora_final"].items()
        for k, v in weights.items()
    }


def _compare(
    run: dict, ref32: dict, ref64: dict, trained: tuple[str, ...] = ("transformer", "text_encoder")
) -> str:
    """The patched run against the unpatched fp32 run, within ``reassociation_tol`` of its fp64 gap."""
    steps = sorted(ref32["losses"], key=int)
    assert sorted(run["losses"], key=int) == steps, (sorted(run["losses"]), steps)
    # float64 tensors: the losses are Python floats of fp32 sums, rounding them to fp32 again would hide errors
    got = torch.tensor([run["losses"][s] for s in steps], dtype=torch.float64)
    loss32 = torch.tensor([ref32["losses"][s] for s in steps], dtype=torch.float64)
    loss64 = torch.tensor([ref64["losses"][s] for s in steps], dtype=torch.float64)
    loss_noise, loss_error = rel_error(loss32, loss64), rel_error(got, loss32)
    assert loss_error <= reassociation_tol(loss_noise), (loss_error, loss_noise)

    # The LoRA updates (final - initial), each tensor relative to its fp64 update (at least 1% of the largest:
    # lora_B starts at zero, so a tensor's update can be tiny next to the others).
    got_u, want, want64 = (_updates(r) for r in (run, ref32, ref64))
    assert got_u.keys() == want.keys() == want64.keys(), sorted(set(got_u) ^ set(want))
    assert all(any(k.startswith(f"{model}:") for k in want) for model in trained), sorted(want)
    floor = 0.01 * max(v.abs().max().item() for v in want64.values())
    scales = {k: max(v.abs().max().item(), floor) for k, v in want64.items()}
    weight_noise = max(rel_error(want[k], want64[k], scales[k]) for k in want)
    errors = {k: rel_error(got_u[k], want[k], scales[k]) for k in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= reassociation_tol(weight_noise), (worst, errors[worst], weight_noise)

    val32, val64, val = (torch.tensor(r["validation_loss"], dtype=torch.float64) for r in (ref32, ref64, run))
    val_noise, val_error = rel_error(val32, val64), rel_error(val, val32)
    assert val_error <= reassociation_tol(val_noise), (val_error, val_noise)
    return (
        f"loss {loss_error:.3g} <= {reassociation_tol(loss_noise):.3g}; LoRA updates {errors[worst]:.3g} <= "
        f"{reassociation_tol(weight_noise):.3g}; validation {val_error:.3g} <= {reassociation_tol(val_noise):.3g}"
    )


def _check_draws(traces: list[list[dict]], groups: list[list[int]]) -> None:
    """Equal on the ranks of a group; a new VAE sample, noise and timestep at every micro-step of a rank (one
    draw list per replica part of the micro-step); different across replicas; every epoch ran."""
    for group in groups:
        assert all(traces[r] == traces[group[0]] for r in group), group
    for trace in traces:
        assert {t["epoch"] for t in trace} == set(range(EPOCHS))
        for k, what in enumerate(("VAE sample", "noise", "timesteps")):
            values = [tuple(part[k]) for t in trace for part in t["draws"]]
            assert len(set(values)) == len(values), (what, values)
    if len(groups) > 1:
        first, second = ({json.dumps(t["draws"]) for t in traces[g[0]]} for g in groups)
        assert not first & second


def _check_resumed(run: dict, resumed: dict) -> None:
    """The resumed launch is the uninterrupted run's tail, bit for bit (samples, draws, losses, weights)."""
    after = [s for s in run["losses"] if int(s) > CHECKPOINT]
    assert sorted(resumed["losses"]) == sorted(after) and all(
        resumed["losses"][s] == run["losses"][s] for s in after
    )
    assert resumed["optimizer_steps"] == len(after)
    for trace, tail in zip(run["traces"], resumed["traces"]):
        assert trace[-len(tail) :] == tail and trace[-len(tail) - 1]["step"] < CHECKPOINT
    assert resumed["lora_final"] == run["lora_final"]
    assert resumed["validation_loss"] == run["validation_loss"]
    assert all(resumed["mid_run_validations"][s] == run["mid_run_validations"][s] for s in after)


def test_lora_sp_accelerate_world2_epochs_resume_against_stock(launches, references):
    data = ["--num-samples", "3"]
    run = launches.results(2)["epochs"]
    sp = launches.folder(2, "epochs")
    assert (sp / f"checkpoint-{CHECKPOINT}").is_dir()
    resumed = _run([*data, "--resume", "--results-file", "resumed.json"], sp, world=2)
    ref32, ref64, stock = references.results("world2")
    assert run["world"] == 2 and "ulysses=2" in run["plan"], run["plan"]

    # accelerate's step arithmetic: 3 batches, windows of 2 and 1 micro-steps, as in the stock script.
    assert run["batches_per_epoch"] == stock["batches_per_epoch"] == 3
    assert run["optimizer_steps"] == stock["optimizer_steps"] == EPOCHS * STEPS_PER_EPOCH
    _check_draws(run["traces"], [[0, 1]])
    _check_draws(stock["traces"], [[0]])  # the stock script's own draws never repeat either
    samples = [t["samples"] for t in run["traces"][0]]
    assert samples == [t["samples"] for t in ref32["traces"][0]]
    assert samples[:3] == [t["samples"] for t in stock["traces"][0]][:3]  # later epochs: see the docstring
    assert [t["draws"] for t in run["traces"][0]] == [t["draws"] for t in ref32["traces"][0]]
    _check_resumed(run, resumed)
    print(_compare(run, ref32, ref64))


def test_lora_sp_accelerate_world4_two_replicas_of_ulysses2_resume(launches, references):
    data = ["--num-samples", "6"]  # 3 per replica
    run = launches.results(4)["epochs"]
    sp = launches.folder(4, "epochs")
    resumed = _run([*data, "--ulysses", "2", "--resume", "--results-file", "resumed.json"], sp, world=4)
    ref32, ref64 = references.results("world4")
    assert run["world"] == 4 and "data=2" in run["plan"] and "ulysses=2" in run["plan"], run["plan"]

    assert run["batches_per_epoch"] == ref32["batches_per_epoch"] == 3
    assert run["optimizer_steps"] == ref32["optimizer_steps"] == EPOCHS * STEPS_PER_EPOCH
    _check_draws(run["traces"], [[0, 1], [2, 3]])
    for replica in (0, 1):  # the reference's replica parts: its samples and draws, bit for bit
        want = [(t["samples"][replica], t["draws"][replica]) for t in ref32["traces"][0]]
        got = [(t["samples"][0], t["draws"][0]) for t in run["traces"][2 * replica]]
        assert got == want, replica
    _check_resumed(run, resumed)
    print(_compare(run, ref32, ref64))


def test_lora_sp_accelerate_fsdp2_world2_ulysses2_resume(tmp_path, references):
    """The same script under ``accelerate launch --use_fsdp --fsdp_version 2``: accelerate shards the patched
    transformer block by block (``fully_shard``), averages the gradients with FSDP2's reduce-scatter (no hfpatch
    line), clips them as DTensors, saves a sharded (DCP) checkpoint and resumes from it. FSDP2 in accelerate
    prepares one model, so only the transformer trains (its LoRA); validation runs on every rank (the weights
    are sharded), patched. One sample: one window per epoch, closed at the epoch's end; the checkpoint falls
    between two epochs (the resumed launch starts the next epoch in the uninterrupted run's order)."""
    common = [a for a in COMMON if a != "--train-text-encoder"] + ["--num-samples", "1"]
    sp = tmp_path / "fsdp2"
    run = _run(["--checkpoint-at", "2"], sp, 2, common, fsdp2=True)
    assert (sp / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()  # a sharded DCP checkpoint
    resumed = _run(["--resume", "--results-file", "resumed.json"], sp, 2, common, fsdp2=True)
    ref32, ref64 = references.results("fsdp2")
    assert run["fsdp"] and resumed["fsdp"] and "ulysses=2" in run["plan"], run
    assert run["optimizer_steps"] == ref32["optimizer_steps"] == EPOCHS  # 1 batch, accumulation 2
    _check_draws(run["traces"], [[0, 1]])
    assert sorted(resumed["losses"], key=int) == ["3"] and resumed["losses"]["3"] == run["losses"]["3"]
    assert [t["draws"] for t in resumed["traces"][0]] == [t["draws"] for t in run["traces"][0]][-1:]
    print(_compare(run, ref32, ref64, trained=("transformer",)))


def test_lora_sp_accelerate_under_torchrun_without_the_cpu_flag_refuses(tmp_path):
    """Issue 33: on CPU without ``ACCELERATE_USE_CPU=true`` accelerate counts one process in each rank, so the
    script trained twice on its own, silently. ``hfpatch.apply`` sees the launcher's ``WORLD_SIZE=2`` and
    refuses on both ranks, naming the fix; nothing is written."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HFPATCH_TIMEOUT_S": "120"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(var, None)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = tmp_path / "out"
    command = [sys.executable, *launcher, str(SCRIPT), "--epochs", "1", "--output-dir", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout[-2000:]
    for rank in (0, 1):
        assert (
            f"[rank{rank}]: RuntimeError: the launcher started WORLD_SIZE=2 processes, but accelerate sees 1"
            in (done.stderr)
        ), done.stderr[-4000:]
    assert "set ACCELERATE_USE_CPU=true" in done.stderr
    assert not (out / "results.json").exists()


#: The learning-rate schedule of diffusers' Flux LoRA script (its scheduler lines, in the example), 3 epochs of 3
#: batches per replica with accumulation 2: 6 optimizer steps.
LR_COMMON = [*("--epochs", str(EPOCHS), "--grad-accum", "2", "--optimizer", "sgd", "--lr", "1e-3")]
LR_CASES = {  # name: the script's schedule arguments
    "linear": ["--lr-scheduler", "linear"],
    "cosine": ["--lr-scheduler", "cosine"],
    "warmup_max_steps": ["--lr-scheduler", "linear", "--lr-warmup-steps", "2", "--max-train-steps", "5"],
}


LR_WORLDS = [(2, 2), (4, 2)]  # (world, ulysses)


def _lr_cases(world: int) -> dict[str, list[str]]:
    return LR_CASES if world == 2 else {k: v for k, v in LR_CASES.items() if k != "warmup_max_steps"}


@pytest.mark.parametrize(("world", "ulysses"), LR_WORLDS)
def test_lora_sp_accelerate_lr_schedule_equals_the_stock_script_on_one_process(
    launches, references, world, ulysses
):
    """Issue 45 (1b): the README recipe in a script that sizes its scheduler as diffusers' Flux LoRA script does
    (``num_processes`` in the warmup and in the steps; the loader length divided by ``num_processes``), with no
    ``--max_train_steps`` and with it: the learning rate the script logs after every optimizer step equals the
    stock script's on one process training on the same global batch (per-replica batch x data replicas), bit for
    bit. Before the fix accelerate stepped the scheduler once per process: 2x too fast at world 2. The patched
    schedules run one after the other in the world's first launch (``_PatchedLaunches``)."""
    cases = _lr_cases(world)
    runs = {k: launches.results(world)[f"lr-{k}"] for k in cases}
    stock = dict(zip(cases, references.results(f"lr{world}")))  # per-replica batch x replicas, one process
    for k in cases:
        got, want = runs[k]["lrs"], stock[k]["lrs"]
        assert len(want) == (5 if k == "warmup_max_steps" else EPOCHS * STEPS_PER_EPOCH), (k, want)
        assert got == want, (k, got, want)
        assert want[str(len(want))] == 0.0  # the schedule ends where the stock one does


#: diffusers' CogVideoX LoRA script's runs: 3 videos, 3 epochs, accumulation 2 (windows of 2 and 1 micro-steps),
#: a checkpoint every 2 optimizer steps: checkpoint-2 closes epoch 0. The script resumes by restarting the
#: checkpoint's epoch, so a resume that equals the uninterrupted run starts from an epoch boundary.
COGVIDEOX_COMMON = [
    *("--epochs", str(EPOCHS), "--grad-accum", "2", "--optimizer", "sgd", "--num-samples", "3"),
    *("--checkpointing-steps", "2"),
]


def _with_validations(result: dict) -> dict:
    """``result`` with its per-epoch validation latents (fingerprints) as the one vector ``_compare`` reads."""
    epochs = sorted(result["validations"], key=int)
    return {**result, "validation_loss": [v for e in epochs for v in result["validations"][e]]}


def test_cogvideox_lora_script_world2_epochs_resume_against_stock(launches, references):
    """Issue 51: diffusers' CogVideoX LoRA script (``examples/integrations/cogvideox_lora_sp.py``: its VAE encoding
    split over the processes and broadcast before training, the posterior sampled in ``collate_fn``, external
    rotary embeddings, the v-prediction loss, checkpoints on the main process, validation with a
    ``CogVideoXPipeline`` on the main process after every epoch) with the recipe's lines at world 2, 3 epochs,
    against:

    * the same script unpatched on one process (fp32, and fp64 for the rounding noise): the same videos, posterior
      samples, noise and timesteps at every micro-step, bit for bit; losses, LoRA updates and every epoch's
      validation latents within ``reassociation_tol``;
    * itself resumed from ``checkpoint-2`` (the end of epoch 0) in a new launch: epochs 1 and 2 bit for bit
      (losses, draws, validations, the saved LoRA file);
    * the stock script (no hfpatch line, every draw from the global RNG) on one process: the same steps, the
      first epoch's videos in its order, and its draws never repeat either.
    """
    run = launches.results(2)["cogvideox"]
    out = launches.folder(2, "cogvideox")
    assert (out / "checkpoint-2").is_dir()
    resume = ["--resume-from-checkpoint", "checkpoint-2", "--results-file", "resumed.json"]
    resumed = _run(resume, out, world=2, common=COGVIDEOX_COMMON, script=COGVIDEOX)
    ref32, ref64, stock = references.results("cogvideox")
    assert run["world"] == 2 and "ulysses=2" in run["plan"], run["plan"]

    assert run["batches_per_epoch"] == stock["batches_per_epoch"] == ref32["batches_per_epoch"] == 3
    assert run["optimizer_steps"] == stock["optimizer_steps"] == EPOCHS * STEPS_PER_EPOCH
    _check_draws(run["traces"], [[0, 1]])
    _check_draws(stock["traces"], [[0]])
    trace = run["traces"][0]
    assert [t["samples"] for t in trace] == [t["samples"] for t in ref32["traces"][0]]
    assert [t["draws"] for t in trace] == [t["draws"] for t in ref32["traces"][0]]
    assert [t["samples"] for t in trace][:3] == [t["samples"] for t in stock["traces"][0]][:3]

    after = [s for s in run["losses"] if int(s) > 2]
    assert sorted(resumed["losses"]) == sorted(after)
    assert all(resumed["losses"][s] == run["losses"][s] for s in after)
    for full, tail in zip(run["traces"], resumed["traces"]):
        assert [t["epoch"] for t in tail] == [1] * 3 + [2] * 3 and full[-len(tail) :] == tail
    assert resumed["lora_final"] == run["lora_final"]
    assert sorted(resumed["validations"]) == ["1", "2"]
    assert all(resumed["validations"][e] == run["validations"][e] for e in ("1", "2"))
    print(
        _compare(_with_validations(run), _with_validations(ref32), _with_validations(ref64), ("transformer",))
    )
