"""``hfpatch generate`` on tiny stock pipelines saved with ``save_pretrained``, run as a user runs it.

A tiny ``FluxPipeline`` (CLIP + T5 text encoders, in-memory tokenizers) and a tiny ``WanPipeline`` (a T5 encoder)
are saved to folders; the command loads them with ``DiffusionPipeline.from_pretrained``. The references are the
unpatched pipelines called here with the same arguments, written out independently of the command's code: the
prompt, sizes, steps, ``output_type="pt"`` and ``torch.Generator().manual_seed(0)``.

* One process (``cli.main`` in this process): the ``.pt`` outputs equal the reference bit for bit (a one-rank
  plan splits nothing), so do ``--lora`` and ``--cache`` against the same LoRA/cache on the unpatched pipeline,
  and ``--compile eager``; ``.png``/``.gif`` files are written and read back as the pipeline's own frames.
* Two processes (one ``torchrun`` launch running several ``hfpatch generate`` commands through ``cli.main``, the
  console script's entry point, so that one launch pays for the imports): ``--parallel 2`` on Flux (Ulysses 2 and
  a split VAE) and Wan (CFG 2 and a split VAE) equal the reference up to fp32 reassociation (``reassociation_tol``
  of the pipeline's own fp32-vs-fp64 error); ``--cfg 2 --vae 1`` on Wan is bit-identical (two-call CFG parallel
  moves whole transformer calls, the contract's bit-exact case); ``--shard-weights`` is bit-identical to the same
  plan without it.
* ``torchrun --nproc-per-node 2 -m hfpatch generate ... --parallel 3`` fails before loading anything, naming 3 and 2.
* Usage errors (degrees vs world size, suffixes, an unsupported transformer with the reason ``hfpatch info`` gives)
  are checked in this process with the launcher's environment set, for rank 0 and rank 1 alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cli_commands import checkout_env, launch

from hfpatch import cli
from hfpatch.cli import generate
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise

ROOT = Path(__file__).resolve().parents[1]
FLUX_ARGS = ["--prompt", "a fox", "--height", "16", "--width", "16", "--steps", "2"]
WAN_ARGS = [
    "--prompt", "a cat", "--negative-prompt", "blurry", "--height", "32", "--width", "32",
    "--frames", "5", "--steps", "2",
]  # fmt: skip
SHORT_TEXT = ["--pipeline-kwargs", '{"max_sequence_length": 8}']  # the tiny tokenizers' length


def _flux_call(pipe: Any, **extra: Any) -> torch.Tensor:
    return pipe(
        prompt="a fox", height=16, width=16, num_inference_steps=2, max_sequence_length=8, output_type="pt",
        **extra,
    ).images  # fmt: skip


def _wan_call(pipe: Any, **extra: Any) -> torch.Tensor:
    return pipe(
        prompt="a cat", negative_prompt="blurry", height=32, width=32, num_frames=5, num_inference_steps=2,
        max_sequence_length=8, output_type="pt", **extra,
    ).frames  # fmt: skip


def _seeded() -> dict[str, Any]:
    return {"generator": torch.Generator().manual_seed(0)}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Any]:
    """The saved checkpoints and the unpatched references: fp32 (as the command runs) and fp64 (its rounding)."""
    from diffusers import DiffusionPipeline

    from hfpatch.testing import tiny_flux_pipe_with_text_encoders, tiny_wan_pipe

    root = tmp_path_factory.mktemp("checkpoints")
    flux, wan = root / "flux", root / "wan"
    tiny_flux_pipe_with_text_encoders().save_pretrained(flux)
    tiny_wan_pipe(text_encoder=True).save_pretrained(wan)  # the quickstart's ./tiny-wan

    found: dict[str, Any] = {"flux": flux, "wan": wan}
    for name, folder, call in (("flux", flux, _flux_call), ("wan", wan, _wan_call)):
        pipe = DiffusionPipeline.from_pretrained(folder)
        found[f"{name}_pipe"] = pipe
        found[name + "32"] = call(pipe, **_seeded())
        transformer = pipe.transformer.config
        if name == "flux":  # the same fp32 noise for the fp64 twin (an fp64 draw gives other numbers)
            latents = pipe.prepare_latents(
                1, transformer.in_channels // 4, 16, 16, torch.float32, "cpu", **_seeded()
            )
            latents = latents[0]
        else:
            latents = pipe.prepare_latents(
                1, transformer.in_channels, 32, 32, 5, torch.float32, "cpu", **_seeded()
            )
        found[name + "64"] = call(
            DiffusionPipeline.from_pretrained(folder, dtype=torch.float64), latents=latents.double()
        )
        reference = found[name + "32"]
        # The outputs are pixels in [0, 1]: most of them inside, so comparing them compares the computation.
        assert ((reference > 0) & (reference < 1)).float().mean() > 0.5, name
    return found


def _tolerance(models: dict[str, Any], name: str) -> float:
    return reassociation_tol(rounding_noise(models[name + "32"], models[name + "64"]))


def _generate(*argv: str) -> int:
    return cli.main(["generate", *argv])


# ----------------------------------------------------------------------------------------------- one process
def test_generate_one_process_writes_the_unpatched_output(models, tmp_path, capsys):
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    out = tmp_path
    assert _generate(str(models["flux"]), *FLUX_ARGS, *SHORT_TEXT, "--out", f"{out}/f.pt", "--out", f"{out}/f.png",
                     "--report", f"{out}/f.json") == 0  # fmt: skip
    assert (
        _generate(str(models["wan"]), *WAN_ARGS, *SHORT_TEXT, "--out", f"{out}/w.pt", "--out", f"{out}/w.gif")
        == 0
    )
    stdout = capsys.readouterr().out
    assert "plan: ParallelConfig(data=1, cfg=1, ring=1, ulysses=1, vae=1)" in stdout

    # One rank splits nothing: the patched call is the unpatched computation, bit for bit.
    assert torch.equal(torch.load(out / "f.pt"), models["flux32"])
    assert torch.equal(torch.load(out / "w.pt"), models["wan32"])
    # The image and the video frames are the pipeline's own output_type="pil" conversion of those tensors.
    expected = VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(models["flux32"]))[0]
    assert np.array_equal(np.asarray(Image.open(out / "f.png").convert("RGB")), np.asarray(expected))
    gif = Image.open(out / "w.gif")
    assert gif.n_frames == 5 and gif.size == (32, 32)

    report = json.loads((out / "f.json").read_text())
    assert report["pipeline"] == "FluxPipeline" and report["world_size"] == 1
    assert report["plan"] == "ParallelConfig(data=1, cfg=1, ring=1, ulysses=1, vae=1)"
    times = report["times_s"]
    assert len(times["steps"]) == 2 and all(t > 0 for t in times["steps"])
    assert times["end_to_end"] >= times["before_denoising"] + sum(times["steps"]) + times["vae_decode"] - 1e-6
    (rank,) = report["ranks"]
    assert (
        rank["bytes_sent"] == 0 and rank["peak_memory_bytes"] > 0 and "resident set" in rank["memory_measure"]
    )
    assert report["versions"]["diffusers"] and report["call"]["num_inference_steps"] == 2
    assert report["output"] == {"shape": [1, 3, 16, 16], "dtype": "float32"}


def test_generate_lora_cache_and_compile_equal_the_same_on_the_unpatched_pipeline(models, tmp_path, capsys):
    from diffusers import DiffusionPipeline, FirstBlockCacheConfig, FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    # A LoRA with non-zero B (init_lora_weights=False), saved as diffusers saves LoRAs.
    pipe = DiffusionPipeline.from_pretrained(models["flux"])
    torch.manual_seed(0)
    pipe.transformer.add_adapter(
        LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    )
    FluxPipeline.save_lora_weights(
        tmp_path / "lora", transformer_lora_layers=get_peft_model_state_dict(pipe.transformer)
    )
    lora_reference = _flux_call(pipe, **_seeded())
    assert not torch.equal(lora_reference, models["flux32"])  # the LoRA changes the output

    pipe = DiffusionPipeline.from_pretrained(models["flux"])
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=5.0))  # far above the tiny model's metric
    cache_reference = _flux_call(pipe, **_seeded())
    assert not torch.equal(
        cache_reference, models["flux32"]
    )  # the second step reused the first one's residual

    flux = [str(models["flux"]), *FLUX_ARGS, *SHORT_TEXT]
    assert _generate(*flux, "--lora", str(tmp_path / "lora"), "--out", f"{tmp_path}/lora.pt") == 0
    assert _generate(*flux, "--cache", "first-block:5", "--out", f"{tmp_path}/cache.pt") == 0
    assert _generate(*flux, "--compile", "eager", "--out", f"{tmp_path}/compiled.pt") == 0
    assert ", compiled: transformer (repeated blocks) (eager)" in capsys.readouterr().out
    assert torch.equal(torch.load(tmp_path / "lora.pt"), lora_reference)
    assert torch.equal(torch.load(tmp_path / "cache.pt"), cache_reference)
    assert torch.equal(torch.load(tmp_path / "compiled.pt"), models["flux32"])  # the traced ops, unchanged


# ----------------------------------------------------------------------------------------------- two processes
def _torchrun(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *argv],
        capture_output=True, text=True, timeout=timeout, env=checkout_env(), cwd=ROOT,
    )  # fmt: skip


def test_generate_two_ranks_under_torchrun(models, tmp_path):
    from PIL import Image

    out, flux, wan = tmp_path, str(models["flux"]), str(models["wan"])
    # The [test] extra installs imageio and imageio-ffmpeg, so the .mp4 is written and read back.
    assert generate.mp4_unavailable() is None, generate.mp4_unavailable()
    videos = ["--out", f"{out}/w2.gif", "--out", f"{out}/w2.mp4"]
    commands = [
        ["generate", flux, *FLUX_ARGS, *SHORT_TEXT, "--parallel", "2", "--out", f"{out}/f2.pt", "--out",
         f"{out}/f2.png", "--report", f"{out}/f2.json"],
        ["generate", wan, *WAN_ARGS, *SHORT_TEXT, "--out", f"{out}/w2.pt", *videos, "--report", f"{out}/w2.json"],
        ["generate", wan, *WAN_ARGS, *SHORT_TEXT, "--cfg", "2", "--vae", "1", "--out", f"{out}/w2cfg.pt"],
        ["generate", wan, *WAN_ARGS, *SHORT_TEXT, "--parallel", "2", "--shard-weights", "--out", f"{out}/w2s.pt"],
    ]  # fmt: skip
    result = subprocess.run(  # one launch runs the four commands (tests/cli_commands.py)
        launch(commands, out), capture_output=True, text=True, timeout=600, env=checkout_env(), cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]

    # Rank 0 alone prints: one plan per command.
    plans = [line for line in result.stdout.splitlines() if line.startswith("plan: ")]
    assert plans == [
        "plan: ParallelConfig(data=1, cfg=1, ring=1, ulysses=2, vae=2)",  # Flux without a negative prompt
        "plan: ParallelConfig(data=1, cfg=2, ring=1, ulysses=1, vae=2)",  # Wan: CFG parallel first
        "plan: ParallelConfig(data=1, cfg=2, ring=1, ulysses=1, vae=1)",
        "plan: ParallelConfig(data=1, cfg=2, ring=1, ulysses=1, vae=2)",
    ], result.stdout

    # Ulysses, the split VAE: the same sums in another order (fp32 reassociation).
    flux2, wan2 = torch.load(out / "f2.pt"), torch.load(out / "w2.pt")
    assert flux2.shape == models["flux32"].shape and wan2.shape == models["wan32"].shape
    for name, output in (("flux", flux2), ("wan", wan2)):
        error, tolerance = rel_error(output, models[name + "32"]), _tolerance(models, name)
        print(f"{name} --parallel 2: relative error {error:.2e} (tolerance {tolerance:.2e})")
        assert error <= tolerance, (name, error, tolerance)
    # Two-call CFG parallel with the VAE on one rank: every computation is the unpatched one.
    assert torch.equal(torch.load(out / "w2cfg.pt"), models["wan32"])
    # Sharded weights: the same plan, the gathered weights are the original bits.
    assert torch.equal(torch.load(out / "w2s.pt"), wan2)

    assert Image.open(out / "f2.png").size == (16, 16)
    assert Image.open(out / "w2.gif").n_frames == 5
    import imageio.v3 as iio

    assert iio.imread(out / "w2.mp4").shape == (5, 32, 32, 3)  # 5 frames of 32 x 32 RGB
    for name, plan in (("f2", "ulysses=2, vae=2"), ("w2", "cfg=2, ring=1, ulysses=1, vae=2")):
        report = json.loads((out / f"{name}.json").read_text())
        assert report["world_size"] == 2 and plan in report["plan"] and report["backend"] == "gloo"
        assert [r["rank"] for r in report["ranks"]] == [0, 1]
        for rank in report["ranks"]:
            assert (
                rank["bytes_sent"] > 0
                and len(rank["times_s"]["steps"]) == 2
                and rank["peak_memory_bytes"] > 0
            )
        ops = set(report["ranks"][0]["bytes_sent_by_op"])
        assert ("all_to_all" in ops) if name == "f2" else ("halo" in ops)  # Ulysses; the split VAE's halos


def test_generate_parallel_3_on_two_processes_fails_before_loading(models):
    started = time.perf_counter()
    result = _torchrun("-m", "hfpatch", "generate", str(models["flux"]), "--prompt", "x", "--parallel", "3",
                       "--out", "never.png", timeout=300)  # fmt: skip
    seconds = time.perf_counter() - started
    assert result.returncode != 0
    message = (
        "hfpatch generate: error: --parallel 3 uses 3 ranks but 2 processes were launched (WORLD_SIZE=2); launch "
        "`torchrun --nproc-per-node 3 -m hfpatch generate ...`, or pass --parallel 2"
    )
    assert message in result.stderr, result.stderr[-3000:]
    assert (
        "Loading pipeline components" not in result.stderr
        and "Traceback" not in result.stderr.split("error:")[0]
    )
    print(f"torchrun --parallel 3 on 2 processes failed after {seconds:.1f} s (torchrun start included)")


# ----------------------------------------------------------------------------------------------- usage errors
@pytest.fixture(scope="module")
def sana(tmp_path_factory) -> Path:
    """A SanaPipeline's model_index.json and nothing else: no weight exists to load."""
    folder = tmp_path_factory.mktemp("sana")
    index = {
        "_class_name": "SanaPipeline",
        "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "SanaTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderDC"],
        "scheduler": ["diffusers", "DPMSolverMultistepScheduler"],
        "text_encoder": ["transformers", "Gemma2Model"],
        "tokenizer": ["transformers", "GemmaTokenizer"],
    }
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


USAGE_ERRORS = [
    # (model, arguments, world size, the message's part)
    ("flux", ["--parallel", "3"], 2, "--parallel 3 uses 3 ranks but 2 processes were launched (WORLD_SIZE=2)"),
    ("flux", ["--cfg", "2", "--ulysses", "2"], 2, "--cfg 2 --ulysses 2 uses 4 ranks but 2 processes were launched"),
    ("flux", ["--ring", "2"], 1, "--ring 2 uses 2 ranks but 1 process was launched (no torchrun)"),
    ("flux", ["--parallel", "2", "--ulysses", "2"], 2, "give either --parallel or --ulysses"),
    ("flux", ["--cfg", "3"], 3, "--cfg 3: CFG parallel splits cond and uncond over 1 or 2 ranks"),
    ("flux", ["--cfg", "2", "--ulysses", "2", "--vae", "2"], 4, "--vae 2: the VAE decodes after denoising"),
    ("flux", ["--shard-weights"], 1, "--shard-weights shards the weights over the ranks"),
    ("flux", ["--out", "x.mp4"], 1, "--out x.mp4: FluxPipeline makes images; write .png, .jpg, .jpeg, .pt"),
    ("wan", ["--out", "x.png"], 1, "--out x.png: WanPipeline makes videos; write .mp4, .gif, .pt"),
    ("flux", ["--out", "x.txt"], 1, "--out x.txt: unknown suffix '.txt'"),
    ("flux", ["--report", "r.txt"], 1, "the report is JSON, name it FILE.json"),
    ("flux", ["--frames", "5"], 1, "--frames: FluxPipeline is not a video pipeline"),
    ("flux", ["--pipeline-kwargs", '{"generator": 1}'], 1, "--pipeline-kwargs may not set generator"),
    ("flux", ["--pipeline-kwargs", '{"num_inference_steps": 4}'], 1, "num_inference_steps (use --steps)"),
    ("flux", ["--pipeline-kwargs", '{"nope": 1}'], 1, "--pipeline-kwargs: FluxPipeline.__call__ takes no nope"),
    ("wan", ["--pipefusion", "2", "--cfg", "2", "--compile"], 4, "--compile with --pipefusion"),
    ("sana", [], 2, "hfpatch cannot split SanaTransformer2DModel (transformer of SanaPipeline) over ranks: "
     "linear (ReLU-kernel) attention sums over all keys without softmax"),
    ("sana", ["--ulysses", "2"], 2, "--ulysses 2: hfpatch cannot split SanaTransformer2DModel"),
    ("sana", ["--pipefusion", "2"], 2, "hfpatch has no PipeFusion family for SanaTransformer2DModel"),
]  # fmt: skip


def _launched(monkeypatch, world: int, rank: int) -> None:
    if world == 1:
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name, raising=False)
        return
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    "model, extra, world, message", USAGE_ERRORS, ids=[" ".join([m, *a]) for m, a, _, _ in USAGE_ERRORS]
)
def test_generate_usage_error_alike_on_every_rank_before_loading(
    model, extra, world, message, models, sana, monkeypatch, capsys, tmp_path
):
    def must_not_load(*args, **kwargs):
        raise AssertionError("loaded weights despite a usage error")

    monkeypatch.setattr(generate, "load_pipeline", must_not_load)
    folder = sana if model == "sana" else models[model]
    out = [] if "--out" in extra else ["--out", str(tmp_path / "out.pt")]
    argv = [
        str(folder),
        "--prompt",
        "x",
        *[str(tmp_path / a) if a.startswith(("x.", "r.")) else a for a in extra],
        *out,
    ]
    errors = []
    for rank in range(world if world > 1 else 1):
        _launched(monkeypatch, world, rank)
        assert _generate(*argv) == 2
        errors.append(capsys.readouterr().err)
    assert all(e == errors[0] for e in errors), errors  # every rank says the same
    assert errors[0].startswith("hfpatch generate: error: ") and message in errors[0].replace(
        str(tmp_path) + "/", ""
    ), errors[0]


def test_generate_cfg_alone_runs_a_pipeline_hfpatch_cannot_split(sana, monkeypatch, tmp_path):
    # --cfg 2 splits no sequence: the model checks pass (any pipeline that guides runs CFG parallel).
    _launched(monkeypatch, 2, 0)
    args = cli.build_parser().parse_args(
        ["generate", str(sana), "--prompt", "x", "--cfg", "2", "--out", str(tmp_path / "a.png")]
    )
    generate.check_arguments(args, 2)
    generate.check_model(generate.inspect_model(str(sana)), args, 2)


def test_generate_refuses_mp4_without_a_writer_naming_the_package(models, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(generate.importlib.util, "find_spec", lambda name, *a: None)
    assert _generate(str(models["wan"]), "--prompt", "x", "--out", str(tmp_path / "v.mp4")) == 2
    err = capsys.readouterr().err
    assert (
        "cannot write .mp4 here" in err
        and "pip install imageio imageio-ffmpeg" in err
        and "Write .gif" in err
    )


def test_generate_not_a_pipeline_folder(tmp_path, capsys):
    assert _generate(str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "a.png")) == 2
    assert (
        "is not a diffusers pipeline (a folder or hub repository with model_index.json)"
        in capsys.readouterr().err
    )


# ----------------------------------------------------------------------------------------------- help
def test_generate_help_lists_every_option_with_its_default():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = [a for a in commands.choices["generate"]._actions if a.option_strings and a.dest != "help"]
    assert len(options) == 24  # --quantize: issue 50
    for action in options:
        text = " ".join((action.help or "").split())
        assert "default" in text, action.option_strings
    # As a user runs it: `python -m hfpatch` (the torchrun entry point too), no torch imported for --help.
    result = subprocess.run(
        [sys.executable, "-m", "hfpatch", "generate", "--help"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for action in options:
        assert action.option_strings[0] in result.stdout
    text = " ".join(result.stdout.split())
    assert "(default: 0)" in text and "(default: every launched rank)" in text


def test_write_outputs_numbers_a_batch_and_checks_the_shape(tmp_path):
    from PIL import Image

    images = torch.rand(2, 3, 8, 6, generator=torch.Generator().manual_seed(0))
    written = generate.write_outputs(images, "image", [str(tmp_path / "a.png"), str(tmp_path / "a.pt")])
    assert written == [str(tmp_path / "a-0.png"), str(tmp_path / "a-1.png"), str(tmp_path / "a.pt")]
    assert [Image.open(p).size for p in written[:2]] == [(6, 8), (6, 8)] and torch.equal(
        torch.load(written[2]), images
    )
    video = torch.rand(1, 3, 3, 8, 8, generator=torch.Generator().manual_seed(1))  # [B, F, C, H, W]
    (gif,) = generate.write_outputs(video, "video", [str(tmp_path / "v.gif")], fps=4)
    assert Image.open(gif).n_frames == 3
    with pytest.raises(
        ValueError, match=r"cannot write .*v.png: the image output has shape \(1, 3, 3, 8, 8\)"
    ):
        generate.write_outputs(video, "image", [str(tmp_path / "v.png")])
