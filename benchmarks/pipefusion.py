"""PipeFusion on the stock ``WanPipeline`` and ``FluxPipeline``: weights per rank, activation peak, bytes sent,
and fidelity.

Two parts, fp32 on CPU (gloo ranks):

1. **Split and communication** (``P`` = 2 and 4 ranks, ``M = 4`` patches, warm-up 1): a stock
   ``WanTransformer3DModel`` whose blocks dominate its weights (8 heads of 16 channels, ``C = 128``,
   ``ffn_dim = 4 C``, 8 blocks) inside a ``WanPipeline``. Per rank: parameter bytes that hold memory after
   ``hfpatch.apply`` (the other stages' blocks are on the ``meta`` device) against the target
   ``1.1 / P`` of the block weights plus the unsplit embeddings/norms/output projection; peak live
   activation bytes of one pipelined transformer call (``hfpatch.testing.memory.track_memory``; weights,
   inputs and the K/V buffers that exist before the call are not counted) against the unpatched call, and the
   K/V buffer bytes the rank holds; bytes sent per denoising step (cond + uncond calls) against the analytic
   count (:func:`hfpatch.patches.pipefusion.layout.stage_bytes_per_call`: a stage before the last sends one
   ``[B, S, C]`` tensor per call, as ``M`` patches; the last stage sends the output to the ``P - 1`` others).
2. **Fidelity** of the approximate mode: PSNR, max and mean abs difference of the decoded frames
   (``output_type="pt"``, values in [0, 1]) against the unpatched pipeline, for warm-up 1, 2, 4 (and 8 = every
   step, which must be exact) and M = 2, 4, 8, on the tiny pipeline (4 blocks, 64x64 pixels, 5 frames: 32
   tokens, 8 steps, guidance 5). The stale-K/V arithmetic does not depend on which rank holds a block, so the
   table is computed with the one-process simulation (``apply_pipefusion(..., group=None)``), and one cell
   (warm-up 1, M = 4) is also run on 2 ranks, whose output is checked to equal it.

3. **Flux** (``FluxPipeline``, one transformer call per step): the same split measurements for a
   ``FluxTransformer2DModel`` of 4 dual-stream + 8 single-stream blocks (Flux.1's 1:2 mix; 8 heads of 16
   channels, ``C = 128``; the default stages balance parameter bytes, a dual block weighing 2.4 single ones) at
   64x64 pixels (256 image tokens after 8 text tokens: the stages hand on the joint ``[text, image]`` sequence,
   ``[B, T + S, C]`` per call), P = 2 and 4, M = 4; and the fidelity table (decoded images, ``output_type="pt"``)
   on the tiny pipeline (2 + 2 blocks, 32x32 pixels: 8 text + 64 image tokens, 8 steps) for warm-up 1, 2, 4, 8
   and M = 2, 4, 8, by the one-process simulation, with one cell (warm-up 1, M = 4) also run on 2 ranks.

4. **PipeFusion x sequence parallel** (xDiT's hybrid, world 4: ``pipefusion=2`` with ``ulysses=2`` or
   ``ring=2``; the part 1 pipeline, M = 4, warm-up 1): per rank, parameter and K/V buffer bytes and the bytes
   sent per step by kind against their analytic counts: hand-off (each sp rank's shard of every patch, ``[B,
   S / sp, C]`` per call), the last stage's output sends and its sp all-gather, the Ulysses all-to-alls (q, k,
   v in and the output back: ``4 (u - 1) / u`` of the rank's ``[B, S / sp, H, D]`` per block and call) and the
   ring passes of the K/V buffer (``(r - 1)`` times both ``[B, S / r, H, D]`` buffers per block and attention
   call: once per warm-up call, once per patch in a pipelined call).

Writes ``benchmarks/results/pipefusion.json`` (and ``.png`` when matplotlib is installed).

    python benchmarks/pipefusion.py
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.core.patch import Patch
from hfpatch.distributed.collectives import count_comm
from hfpatch.patches.pipefusion import WanPipeFusion, parameter_bytes
from hfpatch.patches.pipefusion.flux import FluxPipeFusion, apply_flux_pipefusion, flux_blocks
from hfpatch.patches.pipefusion.layout import patch_ranges, stage_bytes_per_call
from hfpatch.patches.pipefusion.wan import apply_pipefusion
from hfpatch.testing import (
    RankPool,
    tiny_flux_pipe,
    tiny_flux_transformer,
    tiny_wan_pipe,
    tiny_wan_transformer,
    wan_prompt_embeds,
)
from hfpatch.testing.memory import track_memory

RESULTS = Path(__file__).parent / "results"
MB = 2**20

# Part 1: a transformer whose weights are mostly blocks.
HEADS, HEAD_DIM, LAYERS, PATCHES = 8, 16, 8, 4
HIDDEN = HEADS * HEAD_DIM
SPLIT_SIZE = dict(height=64, width=64, num_frames=9)  # latents [1, 4, 3, 8, 8] -> 3 * 4 * 4 = 48 tokens
SPLIT_STEPS = 3

# Part 2: fidelity on the tiny pipeline.
FIDELITY_LAYERS, FIDELITY_STEPS = 4, 8
FIDELITY_SIZE = dict(height=64, width=64, num_frames=5)  # 2 * 4 * 4 = 32 tokens
WARMUPS, PATCH_COUNTS = (1, 2, 4), (2, 4, 8)

# Part 3: Flux.
FLUX_TEXT, FLUX_IN = 8, 16  # text tokens; packed latent channels (in = out)
FLUX_SPLIT = dict(heads=8, head_dim=16, dual=4, single=8, size=64, tokens=256, steps=3)
FLUX_FIDELITY = dict(dual=2, single=2, size=32, tokens=64, steps=8)


def _split_pipe() -> Any:
    pipe = tiny_wan_pipe()
    pipe.transformer = tiny_wan_transformer(
        num_heads=HEADS, head_dim=HEAD_DIM, num_layers=LAYERS, ffn_dim=4 * HIDDEN
    )
    return pipe


def _fidelity_pipe() -> Any:
    pipe = tiny_wan_pipe()
    pipe.transformer = tiny_wan_transformer(num_layers=FIDELITY_LAYERS)
    return pipe


def _run(pipe: Any, size: dict[str, int], steps: int) -> torch.Tensor:
    return pipe(
        prompt_embeds=wan_prompt_embeds(),
        negative_prompt_embeds=wan_prompt_embeds(seed=2),
        num_inference_steps=steps,
        guidance_scale=5.0,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
        **size,
    ).frames


def _transformer_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    latents = torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return latents, wan_prompt_embeds()


def _split_rank(stages: int) -> dict[str, Any]:
    """Part 1 on one rank of ``stages`` PipeFusion ranks."""
    pipe = _split_pipe()
    model = pipe.transformer
    total = parameter_bytes(model)
    blocks = sum(parameter_bytes(b) for b in model.blocks)
    latents, text = _transformer_inputs()
    with torch.no_grad(), track_memory() as unpatched:
        model(latents, torch.tensor([900.0]), text)

    patch = hfpatch.apply(pipe, ParallelConfig(pipefusion=stages, vae=1), pipefusion_patches=PATCHES)
    state = model._hfpatch_pipefusion
    kept = parameter_bytes(model)
    with torch.no_grad():
        model(latents, torch.tensor([900.0]), text)  # warm-up call: fills the K/V buffers
        with track_memory() as pipelined:
            model(latents, torch.tensor([800.0]), text)  # pipelined (timestep decreases: same generation)
    kv_bytes = state.kv_bytes()
    with count_comm() as counter:
        _run(pipe, SPLIT_SIZE, SPLIT_STEPS)
    tokens = 3 * 4 * 4
    hidden_bytes, output_bytes = tokens * HIDDEN * 4, 4 * 3 * 8 * 8 * 4
    analytic_step = 2 * stage_bytes_per_call(state.stage, state.world, hidden_bytes, output_bytes)
    result = _split_result(
        state,
        (kept, total, blocks, stages),
        (unpatched, pipelined, kv_bytes),
        counter,
        SPLIT_STEPS,
        analytic_step,
    )
    patch.remove()  # warns: the released weights do not come back (the pipe is dropped here)
    return result


def _split_result(
    state: Any,
    weights: tuple[int, int, int, int],
    memory: tuple[Any, Any, int],
    counter: Any,
    steps: int,
    analytic_step: int,
) -> dict[str, Any]:
    """One rank's row of a weight-split run (Wan or Flux): ``weights`` = (kept, total, block bytes, stages),
    ``memory`` = (unpatched tracker, pipelined tracker, K/V buffer bytes), traffic per step of ``steps``."""
    kept, total, blocks, stages = weights
    unpatched, pipelined, kv_bytes = memory
    sent = counter.by_op.get("pipefusion", 0) + counter.by_op.get("pipefusion_output", 0)
    return {
        "stage": state.stage,
        "blocks": [state.first, state.end],
        "weight_bytes": kept,
        "weight_bytes_unpatched": total,
        "block_bytes_unpatched": blocks,
        "unsplit_bytes": total - blocks,
        "target_bytes": 1.1 / stages * blocks + (total - blocks),
        "released_bytes": state.released_bytes,
        "activation_peak": pipelined.peak_bytes,
        "activation_peak_unpatched": unpatched.peak_bytes,
        "kv_buffer_bytes": kv_bytes,
        "sent_per_step": sent / steps,
        "analytic_per_step": analytic_step,
        "p2p_sends_per_step": counter.calls.get("pipefusion", 0) / steps,
    }


def _sp_split_rank(ulysses: int, ring: int) -> dict[str, Any]:
    """Part 4 on one rank of ``pipefusion=2 x ulysses x ring`` ranks."""
    pipe = _split_pipe()
    model = pipe.transformer
    patch = hfpatch.apply(
        pipe, ParallelConfig(pipefusion=2, ulysses=ulysses, ring=ring, vae=1), pipefusion_patches=PATCHES
    )
    state = model._hfpatch_pipefusion
    with count_comm() as counter:
        _run(pipe, SPLIT_SIZE, SPLIT_STEPS)
    kv_bytes = state.kv_bytes()
    tokens, sp, calls = 3 * 4 * 4, ulysses * ring, 2 * SPLIT_STEPS  # cond + uncond
    rows = sum(-(-(end - start) // sp) for start, end in patch_ranges(tokens, PATCHES))
    blocks = state.end - state.first
    attention_calls = 2 * (1 + (SPLIT_STEPS - 1) * PATCHES)  # per block: warm-up once, then once per patch
    analytic = {
        "pipefusion": 0 if state.is_last else calls * rows * HIDDEN * 4,
        "pipefusion_output": calls * 4 * 3 * 8 * 8 * 4 if state.is_last else 0,
        "all_gather": calls * (sp - 1) * rows * HIDDEN * 4 if state.is_last else 0,
        "all_to_all": calls * blocks * 4 * (ulysses - 1) * rows * HIDDEN * 4 // ulysses,
        "ring": attention_calls * blocks * (ring - 1) * 2 * ulysses * rows * (HIDDEN // ulysses) * 4,
    }
    result = {
        "stage": state.stage,
        "sp_index": state.sp_index,
        "blocks": [state.first, state.end],
        "weight_bytes": parameter_bytes(model),
        "kv_buffer_bytes": kv_bytes,
        "sent_per_step": {k: counter.by_op.get(k, 0) / SPLIT_STEPS for k in analytic},
        "analytic_per_step": {k: v / SPLIT_STEPS for k, v in analytic.items()},
    }
    patch.remove()
    return result


def _simulate(patches: int, warmup: int) -> torch.Tensor:
    pipe = _fidelity_pipe()
    with Patch("simulation") as patch:
        options = {**WanPipeFusion.options, "pipefusion_patches": patches, "pipefusion_warmup": warmup}
        apply_pipefusion(pipe.transformer, patch, None, options)
        return _run(pipe, FIDELITY_SIZE, FIDELITY_STEPS)


def _fidelity_rank(patches: int, warmup: int) -> torch.Tensor:
    pipe = _fidelity_pipe()
    hfpatch.apply(
        pipe,
        ParallelConfig(pipefusion=2, vae=1),
        pipefusion_patches=patches,
        pipefusion_warmup=warmup,
        pipefusion_release_weights=False,
    )
    return _run(pipe, FIDELITY_SIZE, FIDELITY_STEPS)


def _errors(out: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    diff = (out.double() - reference.double()).abs()
    mse = diff.pow(2).mean().item()
    return {
        "max_abs": diff.max().item(),
        "mean_abs": diff.mean().item(),
        "psnr_db": None if mse == 0 else 10 * math.log10(1.0 / mse),  # None: identical (infinite PSNR)
    }


def _flux_pipe(heads: int = 4, head_dim: int = 8, dual: int = 2, single: int = 2, **_: Any) -> Any:
    pipe = tiny_flux_pipe()
    rope = (2, 2, 4) if head_dim == 8 else (4, 6, 6)  # axes of the rotary table: they sum to head_dim
    pipe.transformer = tiny_flux_transformer(
        num_heads=heads, head_dim=head_dim, num_layers=dual, num_single_layers=single, axes_dims_rope=rope
    )
    return pipe


def _flux_text(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "prompt_embeds": torch.randn(1, FLUX_TEXT, 16, generator=gen),
        "pooled_prompt_embeds": torch.randn(1, 16, generator=gen),
    }


def _flux_run(pipe: Any, size: int, steps: int) -> torch.Tensor:
    return pipe(
        **_flux_text(),
        height=size,
        width=size,
        num_inference_steps=steps,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images


def _flux_transformer_inputs(model: Any, tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    text = _flux_text()
    return {
        "hidden_states": torch.randn(1, tokens, FLUX_IN, generator=gen),
        "encoder_hidden_states": text["prompt_embeds"],
        "pooled_projections": text["pooled_prompt_embeds"],
        "img_ids": torch.randn(tokens, 3, generator=gen),
        "txt_ids": torch.zeros(FLUX_TEXT, 3),
    }


def _flux_split_rank(stages: int) -> dict[str, Any]:
    """Part 3 (split) on one rank of ``stages`` PipeFusion ranks."""
    cfg = FLUX_SPLIT
    pipe = _flux_pipe(**cfg)
    model = pipe.transformer
    hidden = cfg["heads"] * cfg["head_dim"]
    total = parameter_bytes(model)
    blocks = sum(parameter_bytes(b) for b in flux_blocks(model))
    inputs = _flux_transformer_inputs(model, cfg["tokens"])
    with torch.no_grad(), track_memory() as unpatched:
        model(**inputs, timestep=torch.tensor([0.9]))

    patch = hfpatch.apply(pipe, ParallelConfig(pipefusion=stages, vae=1), pipefusion_patches=PATCHES)
    state = model._hfpatch_pipefusion
    kept = parameter_bytes(model)
    with torch.no_grad():
        model(**inputs, timestep=torch.tensor([0.9]))  # warm-up call: fills the K/V buffers
        with track_memory() as pipelined:
            model(**inputs, timestep=torch.tensor([0.8]))  # pipelined
    kv_bytes = state.kv_bytes()
    with count_comm() as counter:
        _flux_run(pipe, cfg["size"], cfg["steps"])
    joint = FLUX_TEXT + cfg["tokens"]
    analytic_step = stage_bytes_per_call(
        state.stage, state.world, joint * hidden * 4, cfg["tokens"] * FLUX_IN * 4
    )
    result = _split_result(
        state,
        (kept, total, blocks, stages),
        (unpatched, pipelined, kv_bytes),
        counter,
        cfg["steps"],
        analytic_step,
    )
    patch.remove()
    return result


def _flux_simulate(patches: int, warmup: int) -> torch.Tensor:
    pipe = _flux_pipe(**FLUX_FIDELITY)
    with Patch("simulation") as patch:
        options = {**FluxPipeFusion.options, "pipefusion_patches": patches, "pipefusion_warmup": warmup}
        apply_flux_pipefusion(pipe.transformer, patch, None, options)
        return _flux_run(pipe, FLUX_FIDELITY["size"], FLUX_FIDELITY["steps"])


def _flux_fidelity_rank(patches: int, warmup: int) -> torch.Tensor:
    pipe = _flux_pipe(**FLUX_FIDELITY)
    hfpatch.apply(
        pipe,
        ParallelConfig(pipefusion=2, vae=1),
        pipefusion_patches=patches,
        pipefusion_warmup=warmup,
        pipefusion_release_weights=False,
    )
    return _flux_run(pipe, FLUX_FIDELITY["size"], FLUX_FIDELITY["steps"])


def _fidelity_table(
    simulate: Callable[[int, int], torch.Tensor], reference: torch.Tensor, steps: int
) -> tuple:
    table, simulated = [], None
    for warmup in (*WARMUPS, steps):
        for patches in PATCH_COUNTS:
            out = simulate(patches, warmup)
            table.append({"warmup": warmup, "patches": patches, **_errors(out, reference)})
            if (warmup, patches) == (1, 4):
                simulated = out
    return table, simulated


def _plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    fig, axes = plt.subplots(4, 1, figsize=(9, 17.2))
    for row, (model, split, fidelity, steps) in enumerate(
        [
            ("Wan", results["split"], results["fidelity"], FIDELITY_STEPS),
            ("Flux", results["flux"]["split"], results["flux"]["fidelity"], FLUX_FIDELITY["steps"]),
        ]
    ):
        _plot_row(plt, axes[2 * row : 2 * row + 2], model, split, fidelity, steps)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_row(plt: Any, axes: Any, model: str, split: dict, fidelity: dict, steps: int) -> None:
    left, right = axes
    for stages, ranks in split.items():
        x = [int(stages) + 0.1 * (r["stage"] - (len(ranks) - 1) / 2) for r in ranks]
        left.plot(x, [r["weight_bytes"] / MB for r in ranks], "o", label=f"P={stages}: per rank")
        left.plot(x, [r["target_bytes"] / MB for r in ranks], "_", markersize=20, color="k")
    left.axhline(split["2"][0]["weight_bytes_unpatched"] / MB, ls="--", color="gray", label="unpatched")
    left.set_xticks([int(stages) for stages in split])
    left.set_xlabel("PipeFusion ranks P")
    left.set_ylabel("parameter MiB on the rank")
    left.set_title(f"{model}: weights per rank (bar: 1.1/P of blocks + unsplit)")
    left.legend()
    for warmup in WARMUPS:
        cells = [c for c in fidelity["table"] if c["warmup"] == warmup]
        right.plot(
            [c["patches"] for c in cells], [c["psnr_db"] for c in cells], "o-", label=f"warm-up {warmup}"
        )
    right.set_xscale("log", base=2)
    right.set_xticks(list(PATCH_COUNTS), [str(m) for m in PATCH_COUNTS])
    right.set_xlabel("patches M")
    right.set_ylabel("PSNR of decoded output vs unpatched (dB)")
    right.set_title(f"{model}: fidelity, {steps} steps (warm-up {steps}: exact)")
    right.legend()


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    started = time.time()
    split: dict[str, Any] = {}
    flux_split: dict[str, Any] = {}
    for stages in (2, 4):
        with RankPool(stages, timeout_s=600) as pool:
            split[str(stages)] = pool.run(_split_rank, stages)
            flux_split[str(stages)] = pool.run(_flux_split_rank, stages)
            if stages == 2:
                on_ranks = pool.run(_fidelity_rank, 4, 1)
                flux_on_ranks = pool.run(_flux_fidelity_rank, 4, 1)
            else:
                sp_split = {
                    "pipefusion=2,ulysses=2": pool.run(_sp_split_rank, 2, 1),
                    "pipefusion=2,ring=2": pool.run(_sp_split_rank, 1, 2),
                }

    reference = _run(_fidelity_pipe(), FIDELITY_SIZE, FIDELITY_STEPS)
    table, simulated = _fidelity_table(_simulate, reference, FIDELITY_STEPS)
    flux_reference = _flux_run(_flux_pipe(**FLUX_FIDELITY), FLUX_FIDELITY["size"], FLUX_FIDELITY["steps"])
    flux_table, flux_simulated = _fidelity_table(_flux_simulate, flux_reference, FLUX_FIDELITY["steps"])
    f, fs = FLUX_FIDELITY, FLUX_SPLIT
    results = {
        "setup": {
            "split": f"WanPipeline, transformer C={HIDDEN}, ffn=4C, {LAYERS} blocks, {SPLIT_SIZE}, M={PATCHES}, "
            f"warm-up 1, {SPLIT_STEPS} steps, guidance 5 (cond + uncond calls per step), fp32",
            "fidelity": f"tiny WanPipeline, {FIDELITY_LAYERS} blocks, {FIDELITY_SIZE} (32 tokens), "
            f"{FIDELITY_STEPS} steps, guidance 5, fp32",
        },
        "split": split,
        "sequence_parallel": sp_split,
        "fidelity": {
            "table": table,
            "two_ranks_vs_simulation_max_abs": max((o - simulated).abs().max().item() for o in on_ranks),
        },
        "flux": {
            "setup": {
                "split": f"FluxPipeline, transformer C={fs['heads'] * fs['head_dim']}, {fs['dual']} dual + "
                f"{fs['single']} single blocks, {fs['size']}x{fs['size']} px ({FLUX_TEXT} text + {fs['tokens']} "
                f"image tokens), M={PATCHES}, warm-up 1, {fs['steps']} steps (one call per step), fp32",
                "fidelity": f"tiny FluxPipeline, {f['dual']} dual + {f['single']} single blocks, {f['size']}x"
                f"{f['size']} px ({FLUX_TEXT} text + {f['tokens']} image tokens), {f['steps']} steps, fp32",
            },
            "split": flux_split,
            "fidelity": {
                "table": flux_table,
                "two_ranks_vs_simulation_max_abs": max(
                    (o - flux_simulated).abs().max().item() for o in flux_on_ranks
                ),
            },
        },
        "seconds": time.time() - started,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipefusion.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "pipefusion.png")
    return results


if __name__ == "__main__":
    out = main()
    for stages, ranks in out["split"].items():
        for r in ranks:
            print(
                f"P={stages} stage {r['stage']} blocks {r['blocks']}: weights {r['weight_bytes'] / MB:.2f} MiB "
                f"(unpatched {r['weight_bytes_unpatched'] / MB:.2f}, target {r['target_bytes'] / MB:.2f}), "
                f"activation peak {r['activation_peak'] / MB:.3f} MiB (unpatched "
                f"{r['activation_peak_unpatched'] / MB:.3f}), K/V {r['kv_buffer_bytes'] / MB:.3f} MiB, sent/step "
                f"{r['sent_per_step']:.0f} B (analytic {r['analytic_per_step']})"
            )
    for config, ranks in out["sequence_parallel"].items():
        for r in ranks:
            print(
                f"{config} stage {r['stage']} sp {r['sp_index']}: weights {r['weight_bytes'] / MB:.2f} MiB, K/V "
                f"{r['kv_buffer_bytes'] / MB:.3f} MiB, sent/step {r['sent_per_step']} (analytic "
                f"{r['analytic_per_step']})"
            )
    for cell in out["fidelity"]["table"]:
        print(cell)
    print("2 ranks vs simulation:", out["fidelity"]["two_ranks_vs_simulation_max_abs"])
    for stages, ranks in out["flux"]["split"].items():
        for r in ranks:
            print(
                f"Flux P={stages} stage {r['stage']} blocks {r['blocks']}: weights {r['weight_bytes'] / MB:.2f} MiB "
                f"(unpatched {r['weight_bytes_unpatched'] / MB:.2f}, target {r['target_bytes'] / MB:.2f}), "
                f"activation peak {r['activation_peak'] / MB:.3f} MiB (unpatched "
                f"{r['activation_peak_unpatched'] / MB:.3f}), K/V {r['kv_buffer_bytes'] / MB:.3f} MiB, sent/step "
                f"{r['sent_per_step']:.0f} B (analytic {r['analytic_per_step']})"
            )
    for cell in out["flux"]["fidelity"]["table"]:
        print("Flux", cell)
    print("Flux 2 ranks vs simulation:", out["flux"]["fidelity"]["two_ranks_vs_simulation_max_abs"])
