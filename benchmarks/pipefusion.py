"""PipeFusion on the stock ``WanPipeline``: weights per rank, activation peak, bytes sent, and fidelity.

Two parts, fp32 on CPU (gloo ranks):

1. **Split and communication** (``P`` = 2 and 4 ranks, ``M = 4`` patches, warm-up 1): a stock
   ``WanTransformer3DModel`` whose blocks dominate its weights (8 heads of 16 channels, ``C = 128``,
   ``ffn_dim = 4 C``, 8 blocks) inside a ``WanPipeline``. Per rank: parameter bytes that hold memory after
   ``hfpatch.apply`` (the other stages' blocks are on the ``meta`` device) against the target
   ``1.1 / P`` of the block weights plus the unsplit embeddings/norms/output projection; peak live
   activation bytes of one pipelined transformer call (``hfpatch.testing.memory.track_memory``; weights,
   inputs and the K/V buffers that exist before the call are not counted) against the unpatched call, and the
   K/V buffer bytes the rank holds; bytes sent per denoising step (cond + uncond calls) against the analytic
   count (:func:`hfpatch.patches._pipefusion_layout.stage_bytes_per_call`: a stage before the last sends one
   ``[B, S, C]`` tensor per call, as ``M`` patches; the last stage sends the output to the ``P - 1`` others).
2. **Fidelity** of the approximate mode: PSNR, max and mean abs difference of the decoded frames
   (``output_type="pt"``, values in [0, 1]) against the unpatched pipeline, for warm-up 1, 2, 4 (and 8 = every
   step, which must be exact) and M = 2, 4, 8, on the tiny pipeline (4 blocks, 64x64 pixels, 5 frames: 32
   tokens, 8 steps, guidance 5). The stale-K/V arithmetic does not depend on which rank holds a block, so the
   table is computed with the one-process simulation (``apply_pipefusion(..., group=None)``), and one cell
   (warm-up 1, M = 4) is also run on 2 ranks, whose output is checked to equal it.

Writes ``benchmarks/results/pipefusion.json`` (and ``.png`` when matplotlib is installed).

    python benchmarks/pipefusion.py
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.core.patch import Patch
from hfpatch.distributed.collectives import count_comm
from hfpatch.patches._pipefusion_layout import stage_bytes_per_call
from hfpatch.patches.pipefusion import WanPipeFusion, apply_pipefusion, parameter_bytes
from hfpatch.testing import RankPool, tiny_wan_pipe, tiny_wan_transformer, wan_prompt_embeds
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
    sent = counter.by_op.get("pipefusion", 0) + counter.by_op.get("pipefusion_output", 0)
    result = {
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
        "sent_per_step": sent / SPLIT_STEPS,
        "analytic_per_step": analytic_step,
        "p2p_sends_per_step": counter.calls.get("pipefusion", 0) / SPLIT_STEPS,
    }
    patch.remove()  # warns: the released weights do not come back (the pipe is dropped here)
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


def _plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for stages, ranks in results["split"].items():
        x = [int(stages) + 0.1 * (r["stage"] - (len(ranks) - 1) / 2) for r in ranks]
        left.plot(x, [r["weight_bytes"] / MB for r in ranks], "o", label=f"P={stages}: per rank")
        left.plot(x, [r["target_bytes"] / MB for r in ranks], "_", markersize=20, color="k")
    left.axhline(
        results["split"]["2"][0]["weight_bytes_unpatched"] / MB, ls="--", color="gray", label="unpatched"
    )
    left.set_xticks([int(stages) for stages in results["split"]])
    left.set_xlabel("PipeFusion ranks P")
    left.set_ylabel("parameter MiB on the rank")
    left.set_title("weights per rank (bar: 1.1/P of blocks + unsplit)")
    left.legend(fontsize=8)
    for warmup in WARMUPS:
        cells = [c for c in results["fidelity"]["table"] if c["warmup"] == warmup]
        right.plot(
            [c["patches"] for c in cells], [c["psnr_db"] for c in cells], "o-", label=f"warm-up {warmup}"
        )
    right.set_xscale("log", base=2)
    right.set_xticks(list(PATCH_COUNTS), [str(m) for m in PATCH_COUNTS])
    right.set_xlabel("patches M")
    right.set_ylabel("PSNR of decoded frames vs unpatched (dB)")
    right.set_title(f"fidelity, {FIDELITY_STEPS} steps (warm-up {FIDELITY_STEPS}: exact)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    started = time.time()
    split: dict[str, Any] = {}
    for stages in (2, 4):
        with RankPool(stages, timeout_s=600) as pool:
            split[str(stages)] = pool.run(_split_rank, stages)
            if stages == 2:
                on_ranks = pool.run(_fidelity_rank, 4, 1)

    reference = _run(_fidelity_pipe(), FIDELITY_SIZE, FIDELITY_STEPS)
    table = []
    for warmup in (*WARMUPS, FIDELITY_STEPS):
        for patches in PATCH_COUNTS:
            out = _simulate(patches, warmup)
            table.append({"warmup": warmup, "patches": patches, **_errors(out, reference)})
            if (warmup, patches) == (1, 4):
                simulated = out
    results = {
        "setup": {
            "split": f"WanPipeline, transformer C={HIDDEN}, ffn=4C, {LAYERS} blocks, {SPLIT_SIZE}, M={PATCHES}, "
            f"warm-up 1, {SPLIT_STEPS} steps, guidance 5 (cond + uncond calls per step), fp32",
            "fidelity": f"tiny WanPipeline, {FIDELITY_LAYERS} blocks, {FIDELITY_SIZE} (32 tokens), "
            f"{FIDELITY_STEPS} steps, guidance 5, fp32",
        },
        "split": split,
        "fidelity": {
            "table": table,
            "two_ranks_vs_simulation_max_abs": max((o - simulated).abs().max().item() for o in on_ranks),
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
    for cell in out["fidelity"]["table"]:
        print(cell)
    print("2 ranks vs simulation:", out["fidelity"]["two_ranks_vs_simulation_max_abs"])
