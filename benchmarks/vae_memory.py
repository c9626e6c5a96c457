"""Per-rank activation memory, halo traffic and approx error of the height-split Wan VAE decode.

Runs the tiny stock ``AutoencoderKLWan`` (Wan 2.1 form) on CPU gloo ranks; memory is the deterministic peak of
live tensors created during ``vae.decode`` (parameters and inputs excluded, ``vae_output="shard"`` so the
gathered output is not counted). Writes ``benchmarks/results/vae_memory.json`` and ``.png``.

Reported:
- peak bytes vs ranks N (1, 2, 4) and vs latent height, unpatched vs diffusers tiling vs hfpatch;
- the largest latent height each rank can decode within a fixed activation budget (peaks are affine in the
  height, so the largest height is read off a least-squares line through the measured points);
- peak bytes of a training step through the decoder (forward + backward), where tiling does not help;
- halo bytes sent per rank, measured vs the analytic count;
- the error of ``vae_mode="approx"`` against the exact result.

Usage: ``python benchmarks/vae_memory.py`` (2-3 minutes on 2 CPU cores).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hfpatch
from hfpatch.distributed.collectives import count_comm
from hfpatch.patches.vae.family import analytic_halo_bytes
from hfpatch.testing import tiny_wan_vae
from hfpatch.testing.memory import track_memory
from hfpatch.testing.runner import RankPool

HEIGHTS = [8, 16, 32]  # latent rows (x8 pixels)
WIDTH, FRAMES = 8, 2  # latent columns; latent frames (-> 5 video frames)
TILE = 64  # diffusers tiling: 64-pixel tiles (8 latent rows), 48-pixel stride
RESULTS = Path(__file__).parent / "results"


def _latents(height: int) -> torch.Tensor:
    return torch.randn(1, 4, FRAMES, height, WIDTH, generator=torch.Generator().manual_seed(0))


def _peak(vae, z: torch.Tensor) -> int:
    with torch.no_grad(), track_memory() as mem:
        vae.decode(z)
    return mem.peak_bytes


def _train_peak(vae, z: torch.Tensor) -> int:
    """Peak of one decode forward + backward (a training step through the decoder; parameter grads included)."""
    leaf = z.clone().requires_grad_(True)
    with track_memory() as mem:
        vae.decode(leaf).sample.square().mean().backward()
    vae.zero_grad(set_to_none=True)
    return mem.peak_bytes


def _split_run(heights: list[int]) -> list[dict]:
    """On every rank: peak bytes, halo bytes (measured, analytic) and approx error for each height."""
    vae = tiny_wan_vae("2.1")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for height in heights:
        z = _latents(height)
        with torch.no_grad():
            exact = vae.decode(z).sample
            analytic = analytic_halo_bytes(vae, lambda z=z: vae.decode(z), rank, world)
            with hfpatch.apply(vae, vae_output="shard"):
                with count_comm() as comm:
                    peak = _peak(vae, z)
        with hfpatch.apply(vae, vae_output="shard"):
            train_peak = _train_peak(vae, z)  # each rank's loss on its rows
        with torch.no_grad():
            with hfpatch.apply(vae, vae_mode="approx"):
                approx = vae.decode(z).sample
        err = (approx - exact).abs()
        rows.append(
            {
                "height": height,
                "peak_bytes": peak,
                "train_peak_bytes": train_peak,
                "halo_bytes": comm.by_op.get("halo", 0),
                "analytic_halo_bytes": analytic,
                "approx_max_abs_err": err.max().item(),
                "approx_mean_abs_err": err.mean().item(),
            }
        )
    return rows


def _fit_largest(heights: list[int], peaks: list[int], budget: float) -> float:
    """Largest height with ``a + b * height <= budget`` on the least-squares line through the points."""
    h, p = torch.tensor(heights, dtype=torch.float64), torch.tensor(peaks, dtype=torch.float64)
    slope = ((h - h.mean()) * (p - p.mean())).sum() / ((h - h.mean()) ** 2).sum()
    intercept = p.mean() - slope * h.mean()
    return float((budget - intercept) / slope)


def main() -> dict:
    torch.set_num_threads(1)
    vae = tiny_wan_vae("2.1")
    unpatched = [_peak(vae, _latents(h)) for h in HEIGHTS]
    vae.enable_tiling(TILE, 10**6, TILE * 3 // 4, 10**6)  # tile rows only: isolates the height dimension
    tiled = [_peak(vae, _latents(h)) for h in HEIGHTS]
    tiled_train = [_train_peak(vae, _latents(h)) for h in HEIGHTS]
    vae.disable_tiling()
    unpatched_train = [_train_peak(vae, _latents(h)) for h in HEIGHTS]

    split: dict[int, list[list[dict]]] = {}
    for world in (2, 4):
        with RankPool(world, timeout_s=600) as pool:
            split[world] = pool.run(_split_run, HEIGHTS)

    budget = unpatched[HEIGHTS.index(16)]  # what one rank holds decoding 16 latent rows unpatched
    per_rank_peak = {
        w: [max(r[i]["peak_bytes"] for r in split[w]) for i in range(len(HEIGHTS))] for w in split
    }
    largest = {
        "unpatched": _fit_largest(HEIGHTS, unpatched, budget),
        "diffusers_tiling": _fit_largest(HEIGHTS, tiled, budget),
        **{f"hfpatch_N{w}": _fit_largest(HEIGHTS, per_rank_peak[w], budget) for w in split},
    }
    train = {
        "unpatched": unpatched_train,
        "diffusers_tiling": tiled_train,
        **{
            f"hfpatch_N{w}": [max(r[i]["train_peak_bytes"] for r in split[w]) for i in range(len(HEIGHTS))]
            for w in split
        },
    }
    result = {
        "model": "tiny AutoencoderKLWan 2.1 (hfpatch.testing.tiny_wan_vae), fp32, CPU",
        "input": {"latent_width": WIDTH, "latent_frames": FRAMES, "latent_heights": HEIGHTS},
        "peak_bytes": {
            "unpatched": unpatched,
            "diffusers_tiling": tiled,
            **{f"hfpatch_N{w}": per_rank_peak[w] for w in split},
        },
        "peak_ratio_vs_unpatched": {
            f"hfpatch_N{w}": [p / u for p, u in zip(per_rank_peak[w], unpatched)] for w in split
        },
        "train_peak_bytes": train,
        "budget_bytes": budget,
        "largest_latent_height_within_budget": largest,
        "halo_bytes_per_rank": {
            f"N{w}": [
                {
                    "height": r["height"],
                    "rank": rank,
                    "measured": r["halo_bytes"],
                    "analytic": r["analytic_halo_bytes"],
                }
                for rank, rows in enumerate(split[w])
                for r in rows
            ]
            for w in split
        },
        "approx_error_vs_precise": {
            f"N{w}": [
                {
                    "height": r["height"],
                    "max_abs": r["approx_max_abs_err"],
                    "mean_abs": r["approx_mean_abs_err"],
                }
                for r in split[w][0]
            ]
            for w in split
        },
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vae_memory.json").write_text(json.dumps(result, indent=2))
    _plot(result)
    return result


def _plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    heights = result["input"]["latent_heights"]
    peaks = result["peak_bytes"]
    fig, (ax_n, ax_h, ax_t) = plt.subplots(3, 1, figsize=(9, 12.9))
    ranks = [1, 2, 4]
    at = heights.index(max(heights))
    measured = [peaks["unpatched"][at], peaks["hfpatch_N2"][at], peaks["hfpatch_N4"][at]]
    ax_n.plot(ranks, [m / 2**20 for m in measured], "o-", label="hfpatch (per rank)")
    ax_n.plot(ranks, [measured[0] / n / 2**20 for n in ranks], "k--", label="ideal 1/N")
    ax_n.set(
        xlabel="ranks N",
        ylabel="peak activation MiB",
        title=f"decode, latent {max(heights)}x{WIDTH}x{FRAMES}",
    )
    ax_n.set_xticks(ranks)
    ax_n.legend()
    for name, values in peaks.items():
        ax_h.plot(heights, [v / 2**20 for v in values], "o-", label=name)
    ax_h.axhline(result["budget_bytes"] / 2**20, color="gray", ls=":", label="budget")
    ax_h.set(xlabel="latent height (rows)", ylabel="peak activation MiB per rank", title="peak vs resolution")
    ax_h.legend()
    for name, values in result["train_peak_bytes"].items():
        ax_t.plot(heights, [v / 2**20 for v in values], "o-", label=name)
    ax_t.set(xlabel="latent height (rows)", ylabel="peak MiB per rank", title="training step (fwd + bwd)")
    ax_t.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "vae_memory.png", dpi=120)


if __name__ == "__main__":
    out = main()
    json.dump(
        {
            k: out[k]
            for k in ("peak_ratio_vs_unpatched", "largest_latent_height_within_budget", "train_peak_bytes")
        },
        sys.stdout,
        indent=2,
    )
    print()
