"""SimpleTuner (issue 51): its ``context_parallel_size`` through :mod:`hfpatch.training.simpletuner`, against
SimpleTuner as it ships, for its Wan, Flux and LTX-Video families.

Needs SimpleTuner 4.10.1, which needs Python >= 3.12 (CI's Python is 3.11: skipped there; ``bash .ci/simpletuner``
builds the venv and runs this module, see docs/simpletuner.md). Everything is tiny and random and saved as diffusers
folders: the Wan of :func:`hfpatch.testing.tiny_wan_pipe` (UMT5, Wan VAE) with four 17-frame 80 x 80 clips (125
tokens), the Flux of :func:`hfpatch.testing.models.tiny_flux_pipe_with_text_encoders` (CLIP, T5) with a 32x VAE and
four 192 x 320 images (15 tokens), the LTX-Video of :func:`hfpatch.testing.tiny_ltx_pipe` (T5, 128 latent
channels) with four 33-frame 160 x 160 clips (125 tokens); no world of 2, 3 or 4 divides any. SimpleTuner's local
backends, with text-embed and VAE caches encoded once and shared by the runs.

* SimpleTuner's model class under hfpatch's plan row, patched against unpatched, output and every gradient, on 2, 3
  and 4 gloo ranks (Ulysses, Ring, both), within ``reassociation_tol`` of its fp32-vs-fp64 noise; what the row
  refuses (TREAD routing, the hidden-state captures, Flux's 0/1 attention bias and per-token timesteps) is refused by
  name.
* SimpleTuner's training (``torchrun ... tests/integration/simpletuner_driver.py``, LoRA rank 4, SGD, 3 optimizer
  steps) through the integration against SimpleTuner's own script, Wan, Flux and LTX-Video: Ulysses 2 and Ring 2
  (world 2) against one process; gradient accumulation 2 across an epoch's end against one process, and a resume from
  its step-2 checkpoint against the uninterrupted run (bit for bit). Wan: 2 data replicas x Ulysses 2 (world 4)
  against SimpleTuner's own DDP on 2 processes (one process cannot be the reference there: SimpleTuner gives two
  replicas other batches than one process, by design), and validation every step. Every micro-step's files, latents,
  text embeddings, noise and timesteps equal bit for bit; the loss, the gradient each optimizer step applies, every
  weight update and every validation model call within the row's tolerance; every rank's weights equal after every
  step.
* ``lora_dropout=0.1`` and ``tread_config`` refused by name, on every rank, before the first step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("simpletuner", reason="SimpleTuner needs Python >= 3.12: run `bash .ci/simpletuner`")

import hfpatch  # noqa: E402
from hfpatch import ParallelConfig  # noqa: E402
from hfpatch.distributed.runtime import get_mesh  # noqa: E402
from hfpatch.testing import (  # noqa: E402
    flux_inputs,
    tiny_flux_transformer,
    tiny_ltx_transformer,
    tiny_wan_transformer,
    wan_prompt_embeds,
)
from hfpatch.testing.dits import split_gradients  # noqa: E402
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("simpletuner_driver.py")
CAPTIONS = ["a dog runs", "a dog sits", "a dog jumps", "a cat naps"]
CP = {"ulysses": {"context_parallel_size": 2, "context_parallel_comm_strategy": "alltoall"}}
CP["ring"] = {"context_parallel_size": 2, "context_parallel_comm_strategy": "allgather"}


# ----------------------------------------------------------------------------------------------- the families
def _clips(root: Path, frames: int, pixels: int) -> None:
    """Four random ``frames``-frame clips of ``pixels`` squared with a caption each, in ``root / "media"``."""
    import imageio
    import numpy as np

    (root / "media").mkdir()
    rng = np.random.default_rng(0)
    for i, caption in enumerate(CAPTIONS):
        video = (rng.random((frames, pixels, pixels, 3)) * 255).astype(np.uint8)
        imageio.mimwrite(root / "media" / f"clip{i}.mp4", list(video), fps=8, codec="libx264", quality=8)
        (root / "media" / f"clip{i}.txt").write_text(caption)


def _wan_data(root: Path) -> None:
    """The tiny Wan (UMT5, Wan VAE) and four 17-frame 80 x 80 clips: 5 x 10 x 10 latents, 125 tokens."""
    from hfpatch.testing import tiny_wan_pipe

    tiny_wan_pipe(text_encoder=True).save_pretrained(root / "model")
    _clips(root, 17, 80)


def _flux_data(root: Path) -> None:
    """The tiny Flux (CLIP, T5) with a 32x VAE, and four 192 x 320 images (SimpleTuner aligns Flux to 64 pixels):
    6 x 10 latents, 3 x 5 = 15 packed tokens."""
    import numpy as np
    from PIL import Image

    from hfpatch.testing.models import tiny_autoencoder_kl, tiny_flux_pipe_with_text_encoders

    pipe = tiny_flux_pipe_with_text_encoders()
    pipe.vae = tiny_autoencoder_kl(
        latent_channels=4, shift_factor=0.0, block_out_channels=(8,) * 6,
        down_block_types=("DownEncoderBlock2D",) * 6, up_block_types=("UpDecoderBlock2D",) * 6,
    )  # fmt: skip
    pipe.save_pretrained(root / "model")
    (root / "media").mkdir()
    rng = np.random.default_rng(0)
    for i, caption in enumerate(CAPTIONS):
        Image.fromarray((rng.random((192, 320, 3)) * 255).astype(np.uint8)).save(
            root / "media" / f"img{i}.png"
        )
        (root / "media" / f"img{i}.txt").write_text(caption)


def _ltx_data(root: Path) -> None:
    """The tiny LTX-Video (T5, LTX VAE with the 128 latent channels SimpleTuner checks for) and four 33-frame
    160 x 160 clips: 5 x 5 x 5 latents, 125 tokens."""
    from hfpatch.testing.models import tiny_ltx_pipe, tiny_model, tiny_t5_encoder, tiny_t5_tokenizer

    pipe = tiny_ltx_pipe(in_channels=128, out_channels=128)
    pipe.register_modules(
        vae=tiny_model("ltx_vae", 0, latent_channels=128),
        text_encoder=tiny_t5_encoder(),
        tokenizer=tiny_t5_tokenizer(),
    )
    pipe.save_pretrained(root / "model")
    _clips(root, 33, 160)


def _video(family: str, frames: int, pixels: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A video family's SimpleTuner dataset entry and config keys: ``frames`` frames of ``pixels`` squared."""
    video = {"num_frames": frames, "min_frames": frames, "is_i2v": False}
    return {"dataset_type": "video", "resolution": pixels, "video": video}, {
        "model_family": family,
        "resolution": pixels,
    }


#: Per family: (data maker, its SimpleTuner dataset entry, its config keys).
FAMILIES: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {
    "wan": (_wan_data, *_video("wan", 17, 80)),
    "flux": (
        _flux_data,
        {"dataset_type": "image", "resolution": 192},
        {"model_family": "flux", "resolution": 192},
    ),
    "ltx": (_ltx_data, *_video("ltxvideo", 33, 160)),
}


# ----------------------------------------------------------------------------------------------- the model rows
def _row_model(family: str) -> torch.nn.Module:
    """SimpleTuner's class of ``family`` with the tiny diffusers model's config and weights."""
    if family == "wan":
        from simpletuner.helpers.models.wan.transformer import WanTransformer3DModel as cls

        stock = tiny_wan_transformer()
    elif family == "flux":
        from simpletuner.helpers.models.flux.transformer import FluxTransformer2DModel as cls

        stock = tiny_flux_transformer()
    else:
        from simpletuner.helpers.models.ltxvideo.transformer import LTXVideoTransformer3DModel as cls

        stock = tiny_ltx_transformer()
    model = cls.from_config(stock.config)
    model.load_state_dict(stock.state_dict())
    return model


def _row_inputs(family: str) -> tuple[dict[str, Any], torch.Tensor, list[tuple[str, Any]]]:
    """(forward kwargs with 125 / 25 tokens, the output weight, the arguments the row refuses with a value)."""
    if family == "wan":
        g = torch.Generator().manual_seed(3)
        kwargs = dict(
            hidden_states=torch.randn(1, 4, 5, 10, 10, generator=g),
            timestep=torch.tensor([500]),
            encoder_hidden_states=wan_prompt_embeds(1, 6),
        )
        refused = [("output_hidden_states", True), ("hidden_states_buffer", {})]
    elif family == "ltx":
        g = torch.Generator().manual_seed(3)
        kwargs = dict(
            hidden_states=torch.randn(1, 125, 8, generator=g),
            encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
            encoder_attention_mask=torch.ones(1, 6),
            timestep=torch.tensor([500]),
            num_frames=5,
            height=5,
            width=5,
        )
        refused = [("output_hidden_states", True), ("hidden_states_buffer", {})]
    else:
        kwargs = flux_inputs()  # SimpleTuner passes the ids batched, [B, S, 3]
        kwargs.update(img_ids=kwargs["img_ids"][None], txt_ids=kwargs["txt_ids"][None])
        refused = [("hidden_states_buffer", {}), ("attention_mask", torch.ones(1, 32))]
    out = _row_model(family)(**kwargs).sample
    return kwargs, torch.randn(out.shape, generator=torch.Generator().manual_seed(7)), refused


def row_cases(family: str, configs: list[tuple[int, int]]) -> dict[str, Any]:
    """Per ``(ulysses, ring)``: the patched model against the unpatched one (error), the tokens the first block saw,
    and the refusals; ``tol``: ``reassociation_tol`` of the unpatched fp32-vs-fp64 noise."""
    model = _row_model(family)
    kwargs, weight, refused = _row_inputs(family)
    ref = split_gradients(model, kwargs, weight)
    ref64 = split_gradients(to_fp64(_row_model(family)), to_fp64(kwargs), weight.double())
    floor = 0.01 * max(g.abs().max().item() for g in ref64.values())
    scales = {k: max(g.abs().max().item(), floor) for k, g in ref64.items()}
    noise = max(rel_error(ref[k], ref64[k], scales[k]) for k in ref)
    report: dict[str, Any] = {"tol": reassociation_tol(noise)}
    first = (
        model.blocks[0] if family == "wan" else model.transformer_blocks[0]
    )  # Flux's and LTX's first block
    for ulysses, ring in configs:
        config = ParallelConfig(ulysses=ulysses, ring=ring)
        seen: list[int] = []
        hook = first.register_forward_pre_hook(
            lambda _, args, kw, s=seen: s.append((args[0] if args else kw["hidden_states"]).shape[1]),
            with_kwargs=True,
        )
        refusals = []
        with hfpatch.apply(model, parallel=config):
            got = split_gradients(model, kwargs, weight, get_mesh(config).group("sp"))
            for name, value in refused:
                try:
                    model(**kwargs, **{name: value})
                except ValueError as error:
                    refusals.append(str(error))
            model.set_router(object(), [{"start_layer_idx": 0, "end_layer_idx": 1, "selection_ratio": 0.5}])
            try:
                model(**kwargs)
            except ValueError as error:
                refusals.append(str(error))
            model.set_router(None, None)
            if family == "flux":
                try:
                    model(**{**kwargs, "timestep": torch.full((1, 25), 0.7)})
                except ValueError as error:
                    refusals.append(str(error))
        hook.remove()
        report[(ulysses, ring)] = (max(rel_error(got[k], ref[k], scales[k]) for k in ref), seen, refusals)
    report["refused"] = [name for name, _ in refused]
    return report


@pytest.mark.parametrize("family", ["wan", "flux", "ltx"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_simpletuner_row_patched_equals_unpatched(rank_pool, world, family):
    configs = {2: [(2, 1), (1, 2)], 3: [(1, 3)], 4: [(2, 2)]}[world]
    tokens = {"wan": 125, "flux": 25, "ltx": 125}[family]
    for rank, report in enumerate(rank_pool(world).run(row_cases, family, configs)):
        for ulysses, ring in configs:
            error, seen, refusals = report[(ulysses, ring)]
            assert error <= report["tol"], (family, world, rank, ulysses, ring, error, report["tol"])
            assert set(seen) == {-(-tokens // world)}, seen  # each block saw this rank's shard
            named = report["refused"]
            assert [r.split(":")[1].split("=")[0].strip() for r in refusals[: len(named)]] == named, refusals
            assert "TREAD token routing" in refusals[len(named)], refusals
            if family == "flux":
                assert "per-token timesteps" in refusals[-1], refusals


# ----------------------------------------------------------------------------------------------- training runs
def _config(root: Path, run: Path, family: str, overrides: dict[str, Any]) -> Path:
    _, dataset, keys = FAMILIES[family]
    backend = [
        {
            "id": "media", "type": "local", "instance_data_dir": str(root / "media"), "caption_strategy": "textfile",
            "crop": False, "resolution_type": "pixel", "minimum_image_size": 0, "repeats": 0,
            "cache_dir_vae": str(root / "cache" / "vae"), **dataset,
        },
        {"id": "text-cache", "dataset_type": "text_embeds", "default": True, "type": "local",
         "cache_dir": str(root / "cache" / "text")},
    ]  # fmt: skip
    (run / "backend.json").write_text(json.dumps(backend))
    config = {
        "model_type": "lora", "pretrained_model_name_or_path": str(root / "model"),
        "pretrained_t5_model_name_or_path": str(root / "model"), "data_backend_config": str(run / "backend.json"),
        "output_dir": str(run / "out"), "max_train_steps": 3, "num_train_epochs": 0, "train_batch_size": 1,
        "learning_rate": 1e-2, "optimizer": "torch-sgd", "lr_scheduler": "constant", "lr_warmup_steps": 0,
        "lora_rank": 4, "lora_dropout": 0.0, "mixed_precision": "no", "base_model_precision": "no_change",
        "seed": 42, "report_to": "none", "resolution_type": "pixel", "validation_disable": True,
        "checkpoint_step_interval": 1000, "disable_benchmark": True, "caption_dropout_probability": 0.0,
        "push_to_hub": False, "attention_mechanism": "diffusers", "resume_from_checkpoint": None,
        **keys, **overrides,
    }  # fmt: skip
    if family != "wan":
        del config["pretrained_t5_model_name_or_path"]
    (run / "config.json").write_text(json.dumps(config))
    return run / "config.json"


def launch(root: Path, name: str, world: int, hfpatch_on: bool, overrides: dict[str, Any],
           checkpoint: Path | None = None) -> tuple[int, list[dict], str]:  # fmt: skip
    """One ``torchrun`` of the driver: (exit status, each rank's record, the log)."""
    run = root / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    (run / "record").mkdir(parents=True)
    if checkpoint is not None:
        (run / "out").mkdir()
        shutil.copytree(checkpoint, run / "out" / checkpoint.name)
    env = {
        **os.environ,
        "CONFIG_BACKEND": "json",
        "CONFIG_PATH": str(_config(root, run, (root / "family").read_text(), overrides)),
        "ACCELERATE_USE_CPU": "1",
        "HFPATCH_SIMPLETUNER": "1" if hfpatch_on else "0",
        "RECORD_DIR": str(run / "record"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), str(DRIVER)]
    done = subprocess.run(command, cwd=run, env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    (run / "log.txt").write_text(log)
    records = [torch.load(run / "record" / f"rank{r}.pt") for r in range(world)
               if (run / "record" / f"rank{r}.pt").exists()]  # fmt: skip
    return done.returncode, records, log


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> Any:
    """``datasets(family)``: the family's folder, made once, its text and VAE caches encoded by a first launch (a
    launch that encodes them draws from the RNG as it does, so the compared runs all find the caches made)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            root = tmp_path_factory.mktemp(f"{family}-simpletuner")
            (root / "family").write_text(family)
            FAMILIES[family][0](root)
            code, _, log = launch(root, "caches", 1, False, {"max_train_steps": 1})
            assert code == 0, log[-3000:]
            made[family] = root
        return made[family]

    return get


@pytest.fixture(scope="module")
def tolerance(rank_pool) -> Any:
    """``tolerance(family)``: the row's ``reassociation_tol`` (fp32-vs-fp64 noise of SimpleTuner's model), for the
    runs; measured once per family."""
    measured: dict[str, float] = {}

    def get(family: str) -> float:
        if family not in measured:
            measured[family] = rank_pool(2).run(row_cases, family, [])[0]["tol"]
        return measured[family]

    return get


def _same_run(got: dict, want: dict, tol: float, what: str) -> None:
    """``got`` (one rank of an hfpatch run) against ``want`` (SimpleTuner's own run)."""
    assert len(got["micro"]) == len(want["micro"]) and len(got["steps"]) == len(want["steps"]), what
    for i, (a, b) in enumerate(zip(got["micro"], want["micro"])):
        assert a["files"] == b["files"], (what, i, a["files"], b["files"])
        for key in ("latents", "noise", "timesteps", "encoder_hidden_states"):
            assert torch.equal(a[key], b[key]), (what, i, key)
        assert abs(a["loss"] - b["loss"]) <= tol * abs(b["loss"]), (what, i, a["loss"], b["loss"])
    for i, (a, b) in enumerate(zip(got["steps"], want["steps"])):
        assert a["micro"] == b["micro"], (what, i)
        assert rel_error(a["grad"], b["grad"]) <= tol, (what, i, rel_error(a["grad"], b["grad"]))
        update, reference = (
            a["weights"] - want["steps"][0]["before"],
            b["weights"] - want["steps"][0]["before"],
        )
        assert rel_error(update, reference) <= tol, (what, i, rel_error(update, reference))


def _ranks_agree(records: list[dict], what: str) -> None:
    for r, record in enumerate(records[1:], 1):
        for i, (a, b) in enumerate(zip(record["steps"], records[0]["steps"])):
            assert torch.equal(a["weights"], b["weights"]), (what, "rank", r, "step", i)


@pytest.mark.parametrize("family", ["wan", "flux", "ltx"])
def test_simpletuner_context_parallel_equals_one_process(datasets, tolerance, family):
    data, tol = datasets(family), tolerance(family)
    code, (stock,), log = launch(data, "stock-1", 1, False, {})
    assert code == 0, log[-3000:]
    assert len(stock["steps"]) == 3 and len({m["files"][0] for m in stock["micro"]}) == 3
    assert stock["patch"] == "None"
    for strategy in ("ulysses", "ring"):
        code, records, log = launch(data, f"{strategy}-2", 2, True, CP[strategy])
        assert code == 0, log[-3000:]
        assert len(records) == 2
        assert all(f"{strategy}=2" in r["patch"] for r in records), records[0][
            "patch"
        ]  # hfpatch's, not diffusers'
        _ranks_agree(records, strategy)
        for rank, record in enumerate(records):
            _same_run(record, stock, tol, f"{family} {strategy} rank {rank}")


@pytest.mark.parametrize("family", ["wan", "flux", "ltx"])
def test_simpletuner_accumulation_and_resume(datasets, tolerance, family):
    data, tol = datasets(family), tolerance(family)
    accumulate = {"gradient_accumulation_steps": 2, "checkpoint_step_interval": 2}
    code, (stock,), log = launch(data, "stock-1-ga2", 1, False, accumulate)
    assert code == 0, log[-3000:]
    assert [s["micro"] for s in stock["steps"]] == [2, 4, 6]  # 4 samples: step 3 starts the second epoch
    code, records, log = launch(data, "ulysses-2-ga2", 2, True, {**accumulate, **CP["ulysses"]})
    assert code == 0, log[-3000:]
    _ranks_agree(records, "ga2")
    for rank, record in enumerate(records):
        _same_run(record, stock, tol, f"{family} ga2 rank {rank}")
    checkpoint = data / "runs" / "ulysses-2-ga2" / "out" / "checkpoint-2"
    assert checkpoint.is_dir()
    resume = {**accumulate, **CP["ulysses"], "resume_from_checkpoint": "latest"}
    code, resumed, log = launch(data, "ulysses-2-ga2-resumed", 2, True, resume, checkpoint)
    assert code == 0, log[-3000:]
    for rank, record in enumerate(resumed):  # step 3 of the uninterrupted run, bit for bit
        whole = records[rank]
        assert [m["files"] for m in record["micro"]] == [m["files"] for m in whole["micro"][4:]]
        for a, b in zip(record["micro"], whole["micro"][4:]):
            assert all(torch.equal(a[k], b[k]) for k in ("noise", "timesteps")) and a["loss"] == b["loss"]
        assert len(record["steps"]) == 1
        assert torch.equal(record["steps"][0]["grad"], whole["steps"][2]["grad"])
        assert torch.equal(record["steps"][0]["weights"], whole["steps"][2]["weights"])


def test_simpletuner_replicas_times_ulysses_equals_its_ddp(datasets, tolerance):
    data, tol = datasets("wan"), tolerance("wan")
    code, stock, log = launch(data, "stock-2", 2, False, {"max_train_steps": 2})
    assert code == 0, log[-3000:]
    assert stock[0]["micro"][0]["files"] != stock[1]["micro"][0]["files"]  # two replicas, two batches
    code, records, log = launch(
        data, "replicas-2-ulysses-2", 4, True, {"max_train_steps": 2, **CP["ulysses"]}
    )
    assert code == 0, log[-3000:]
    assert all("data=2" in r["patch"] and "ulysses=2" in r["patch"] for r in records), records[0]["patch"]
    _ranks_agree(records, "2x2")
    for rank, record in enumerate(records):
        _same_run(record, stock[rank // 2], tol, f"2x2 rank {rank} (replica {rank // 2})")


def test_simpletuner_validation_with_context_parallel(datasets, tolerance):
    """SimpleTuner's validation (its pipeline, every rank of a context-parallel group generating) during training:
    each of its model calls runs patched on this rank's shard and returns what one process's returns, within the row's
    tolerance, and the training after each validation is unchanged."""
    data, tol = datasets("wan"), tolerance("wan")
    validation = {
        "validation_disable": False, "validation_steps": 1, "validation_num_inference_steps": 2,
        "validation_prompt": "a dog runs", "validation_resolution": "80x80", "validation_num_video_frames": 17,
        "validation_guidance": 3.0, "validation_seed": 7, "num_validation_images": 1,
    }  # fmt: skip
    code, (stock,), log = launch(data, "stock-1-validation", 1, False, validation)
    assert code == 0, log[-3000:]
    code, records, log = launch(data, "ulysses-2-validation", 2, True, {**validation, **CP["ulysses"]})
    assert code == 0, log[-3000:]
    # SimpleTuner validates at steps 2 and 3: 2 denoising steps x 2 (guided) calls each
    assert len(stock["validation"]) == 8 and set(stock["validation_tokens"]) == {125}
    for rank, record in enumerate(records):
        assert set(record["validation_tokens"]) == {63}, record[
            "validation_tokens"
        ]  # 125 tokens over 2 ranks
        assert len(record["validation"]) == len(stock["validation"])
        for i, (got, want) in enumerate(zip(record["validation"], stock["validation"])):
            assert rel_error(got, want) <= tol, (rank, i, rel_error(got, want), tol)
        _same_run(record, stock, tol, f"validation rank {rank}")


def test_simpletuner_refuses_what_it_cannot_split(datasets):
    data = datasets("wan")
    for option, value, named in (("lora_dropout", 0.1, "lora_dropout=0.1"),
                                 ("tread_config", {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0,
                                                               "end_layer_idx": 1}]}, "tread_config")):  # fmt: skip
        code, records, log = launch(data, f"refused-{option}", 2, True, {**CP["ulysses"], option: value})
        assert code != 0
        for rank in (0, 1):  # torchrun prefixes each rank's traceback
            lines = [line for line in log.splitlines() if line.startswith(f"[rank{rank}]")]
            assert any(named in line and "cannot be trained exactly" in line for line in lines), log[-3000:]
        assert all(not record["micro"] for record in records)  # refused before the first step
