"""Per-rank activation memory, halo traffic and approx error of the height-split VAE decodes, for every split class.

Runs the tiny stock ``AutoencoderKLWan`` (Wan 2.1 form) on CPU gloo ranks; memory is the deterministic peak of
live tensors created during ``vae.decode`` (parameters and inputs excluded, ``vae_output="shard"`` so the
gathered output is not counted). Writes ``benchmarks/results/vae_memory.json`` and ``.png``; the video VAEs
(:data:`VIDEO_CLASSES`) get the same decode peak per rank at N = 2 and 4 and two latent heights, and their bytes
sent by kind (halo rows, GroupNorm statistics, ring attention) against the analytic count, in the same JSON. Then
every image class (``CLASSES``: AutoencoderKL, Flux.2, QwenImage, QwenImage 2.1, HunyuanImage and its refiner,
DC-AE) in its released proportions (``hfpatch.testing.models.VAE_MEMORY_CONFIGS``): decode peak per rank vs
unpatched at N = 2 and 4 over latent heights, and the bytes each rank sends (halo rows; all-gathers of
statistics, attention keys/values and DC-AE's linear-attention sums) against the analytic volumes
(``benchmarks/results/vae_classes.json``, ``.png``).

Reported:
- peak bytes vs ranks N (1, 2, 4) and vs latent height, unpatched vs diffusers tiling vs hfpatch;
- the largest latent height each rank can decode within a fixed activation budget (peaks are affine in the
  height, so the largest height is read off a least-squares line through the measured points);
- peak bytes of a training step through the decoder (forward + backward), where tiling does not help;
- halo bytes sent per rank, measured vs the analytic count;
- the error of ``vae_mode="approx"`` against the exact result;
- per split class: the decode peak per rank vs unpatched at N = 2 and 4 (latent heights 16 and 32), bytes sent
  vs analytic; Allegro (which decodes only through fixed tiles, and blends whole tiles on every rank) also at
  wider channels, where the decoder's activations outweigh the tile buffers every rank holds whole.

Usage: ``python benchmarks/vae_memory.py`` (10-14 minutes on 2 CPU cores).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hfpatch
from hfpatch.distributed.collectives import count_comm
from hfpatch.patches.vae.family import analytic_gather_bytes, analytic_halo_bytes, analytic_split_bytes
from hfpatch.testing import tiny_wan_vae
from hfpatch.testing.memory import track_memory
from hfpatch.testing.models import VAE_MEMORY_CONFIGS, tiny_model
from hfpatch.testing.runner import RankPool

HEIGHTS = [8, 16, 32]  # latent rows (x8 pixels)
WIDTH, FRAMES = 8, 2  # latent columns; latent frames (-> 5 video frames)
TILE = 64  # diffusers tiling: 64-pixel tiles (8 latent rows), 48-pixel stride
RESULTS = Path(__file__).parent / "results"


#: class -> (hfpatch.testing tiny model row, config overrides, latent [channels, frames, width]); Allegro's tiles
#: (``kernel``/``stride`` attributes) cover the whole latent: one tile per decode.
VIDEO_CLASSES: dict[str, tuple[str, dict, tuple[int, int, int]]] = {
    "AutoencoderKLHunyuanVideo": ("hunyuanvideo_vae", {}, (4, 2, 4)),
    "AutoencoderKLHunyuanVideo15": ("hunyuanvideo15_vae", {}, (4, 2, 4)),
    "AutoencoderKLLTXVideo": ("ltx_vae", {"decoder_inject_noise": (True, True, False, True, False)}, (8, 2, 2)),
    "AutoencoderKLLTX2Video": ("ltx2_vae", {}, (8, 2, 2)),
    "AutoencoderKLCogVideoX": ("cogvideox_vae", {}, (4, 3, 4)),
    "AutoencoderKLMochi": ("mochi_vae", {}, (4, 2, 4)),
    "AutoencoderKLCosmos": ("cosmos_vae", {}, (4, 2, 4)),
    "AutoencoderKLAllegro": ("allegro_vae", {}, (4, 2, 16)),
    "AutoencoderKLAllegro (32 channels)": ("allegro_vae", {"block_out_channels": (32, 32), "norm_num_groups": 8},
                                           (4, 2, 16)),
}  # fmt: skip
VIDEO_HEIGHTS = [16, 32]


def _video_vae(name: str, height: int) -> torch.nn.Module:
    row, overrides, (_, _, width) = VIDEO_CLASSES[name]
    vae = tiny_model(row, **overrides)
    if row == "allegro_vae":  # one tile covering the latent (Allegro decodes only through its tiles)
        factor = vae.spatial_compression_ratio
        vae.kernel = (4, height * factor, width * factor)
        vae.stride = (2, height * factor - 4, width * factor - 4)
    return vae


def _video_latents(name: str, height: int) -> torch.Tensor:
    channels, frames, width = VIDEO_CLASSES[name][2]
    return torch.randn(1, channels, frames, height, width, generator=torch.Generator().manual_seed(0))


def _video_decode(vae: torch.nn.Module, z: torch.Tensor) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the LTX decoder draws noise from the global RNG: the same on every rank
        vae.decode(z)


def _video_peaks() -> dict[str, list[int]]:
    """Unpatched decode peaks of every class, per height (one process)."""
    peaks = {}
    for name in VIDEO_CLASSES:
        peaks[name] = []
        for height in VIDEO_HEIGHTS:
            vae, z = _video_vae(name, height), _video_latents(name, height)
            with torch.no_grad(), track_memory() as mem:
                _video_decode(vae, z)
            peaks[name].append(mem.peak_bytes)
    return peaks


def _video_run() -> dict[str, list[dict]]:
    """On every rank: split decode peak and bytes sent (measured, analytic) per class and height."""
    rows: dict[str, list[dict]] = {}
    for name, (row, _, _) in VIDEO_CLASSES.items():
        rows[name] = []
        output = "full" if row == "allegro_vae" else "shard"
        for height in VIDEO_HEIGHTS:
            vae, z = _video_vae(name, height), _video_latents(name, height)
            with torch.no_grad(), hfpatch.apply(vae, vae_output=output):
                analytic = analytic_split_bytes(vae, lambda v=vae, z=z: _video_decode(v, z), height)
                with track_memory() as mem, count_comm() as comm:
                    _video_decode(vae, z)
            sent = {k: v for k, v in comm.by_op.items() if k != "guard"}
            rows[name].append(
                {"height": height, "peak_bytes": mem.peak_bytes, "sent": sent, "analytic": analytic}
            )
    return rows


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
            analytic = analytic_halo_bytes(vae, lambda z=z, vae=vae: vae.decode(z), rank, world)
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


#: Class -> (tiny model row, frames or None for images, config overrides: the released proportions).
CLASSES: dict[str, tuple[str, int | None, dict]] = {
    "AutoencoderKL": ("autoencoder_kl", None, VAE_MEMORY_CONFIGS["flux2_vae"]),  # the same encoder/decoder
    "AutoencoderKLFlux2": ("flux2_vae", None, VAE_MEMORY_CONFIGS["flux2_vae"]),
    "AutoencoderKLQwenImage": ("qwenimage_vae", 1, VAE_MEMORY_CONFIGS["qwenimage_vae"]),
    "AutoencoderKLQwenImage21": ("qwenimage21_vae", 1, VAE_MEMORY_CONFIGS["qwenimage21_vae"]),
    "AutoencoderKLHunyuanImage": ("hunyuanimage_vae", None, VAE_MEMORY_CONFIGS["hunyuanimage_vae"]),
    "AutoencoderKLHunyuanImageRefiner": (
        "hunyuanimage_refiner_vae",
        2,
        VAE_MEMORY_CONFIGS["hunyuanimage_refiner_vae"],
    ),  # fmt: skip
    "AutoencoderDC": ("autoencoder_dc", None, VAE_MEMORY_CONFIGS["autoencoder_dc"]),
}
CLASS_HEIGHTS = [8, 16, 24]  # latent rows (x8 pixels), CLASS_WIDTH latent columns
CLASS_WIDTH = 8


def _class_latents(frames: int | None, height: int) -> torch.Tensor:
    time = () if frames is None else (frames,)
    return torch.randn(1, 4, *time, height, CLASS_WIDTH, generator=torch.Generator().manual_seed(0))


def _class_run(heights: list[int]) -> dict[str, list[dict]]:
    """On every rank, every class of CLASSES: decode peak (shard output), bytes sent measured and analytic."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, list[dict]] = {}
    for name, (row, frames, overrides) in CLASSES.items():
        vae = tiny_model(row, **overrides)
        rows = []
        for height in heights:
            z = _class_latents(frames, height)
            with torch.no_grad():
                halo = analytic_halo_bytes(vae, lambda z=z, vae=vae: vae.decode(z), rank, world)
                gather = analytic_gather_bytes(vae, lambda z=z, vae=vae: vae.decode(z), height, rank, world)
                with hfpatch.apply(vae, vae_output="shard"), count_comm() as comm:
                    peak = _peak(vae, z)
            rows.append(
                {
                    "height": height,
                    "peak_bytes": peak,
                    "halo_bytes": comm.by_op.get("halo", 0),
                    "analytic_halo_bytes": halo,
                    "all_gather_bytes": comm.by_op.get("all_gather", 0),
                    "analytic_all_gather_bytes": gather,
                }
            )
        out[name] = rows
    return out


def classes_main() -> dict:
    """Every split class: peak per rank vs unpatched at N = 2 and 4, bytes per rank vs analytic."""
    unpatched = {}
    for name, (row, frames, overrides) in CLASSES.items():
        vae = tiny_model(row, **overrides)
        unpatched[name] = [_peak(vae, _class_latents(frames, h)) for h in CLASS_HEIGHTS]
    split = {}
    for world in (2, 4):
        with RankPool(world, timeout_s=900) as pool:
            split[world] = pool.run(_class_run, CLASS_HEIGHTS)
    result: dict = {
        "models": "hfpatch.testing tiny rows with VAE_MEMORY_CONFIGS (spatial factor 8), fp32, CPU",
        "input": {"latent_width": CLASS_WIDTH, "latent_heights": CLASS_HEIGHTS},
        "classes": {},
    }
    for name in CLASSES:
        entry: dict = {"unpatched_peak_bytes": unpatched[name]}
        for world, ranks in split.items():
            per_rank = [[r[name][i] for r in ranks] for i in range(len(CLASS_HEIGHTS))]
            entry[f"N{world}"] = {
                "peak_ratio_max_rank": [
                    max(r["peak_bytes"] for r in rows) / u for rows, u in zip(per_rank, unpatched[name])
                ],
                "bytes_per_rank": [
                    {k: r[k] for k in r if k != "peak_bytes"} | {"rank": rank}
                    for rows in per_rank
                    for rank, r in enumerate(rows)
                ],
            }
        result["classes"][name] = entry
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vae_classes.json").write_text(json.dumps(result, indent=2))
    _plot_classes(result)
    return result


def _plot_classes(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width
    heights = result["input"]["latent_heights"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, world, bound in zip(axes, (2, 4), (0.6, 0.35)):
        for name, entry in result["classes"].items():
            ax.plot(heights, entry[f"N{world}"]["peak_ratio_max_rank"], "o-", label=name)
        ax.axhline(bound, color="gray", ls=":", label=f"acceptance {bound}")
        ax.axhline(1 / world, color="k", ls="--", lw=0.8, label="ideal 1/N")
        ax.set(xlabel="latent height (rows)", title=f"decode peak per rank / unpatched, N = {world}")
    axes[0].set_ylabel("ratio")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "vae_classes.png", dpi=120)


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

    class_peaks = _video_peaks()
    split: dict[int, list[list[dict]]] = {}
    classes: dict[int, list[dict]] = {}
    for world in (2, 4):
        with RankPool(world, timeout_s=1200) as pool:
            split[world] = pool.run(_split_run, HEIGHTS)
            classes[world] = pool.run(_video_run)

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
    result["classes"] = {
        "input": {
            name: {"latent_heights": VIDEO_HEIGHTS, "latent": VIDEO_CLASSES[name][2]}
            for name in VIDEO_CLASSES
        },
        "unpatched_peak_bytes": class_peaks,
        "peak_ratio_vs_unpatched": {
            name: {
                f"N{w}": [
                    max(r[name][i]["peak_bytes"] for r in classes[w]) / class_peaks[name][i]
                    for i in range(len(VIDEO_HEIGHTS))
                ]
                for w in classes
            }
            for name in VIDEO_CLASSES
        },
        "bytes_per_rank": {
            name: {
                f"N{w}": [
                    {"rank": rank, **{k: v for k, v in row.items() if k != "peak_bytes"}}
                    for rank, rows in enumerate(classes[w])
                    for row in rows[name]
                ]
                for w in classes
            }
            for name in VIDEO_CLASSES
        },
        "bytes_equal_analytic": all(
            row["sent"] == {k: v for k, v in row["analytic"].items() if v}
            for w in classes
            for rows in classes[w]
            for name in VIDEO_CLASSES
            for row in rows[name]
        ),
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
    classes = "classes" in result  # a JSON written before the video VAEs has no class panel
    fig, axes = plt.subplots(4 if classes else 3, 1, figsize=(9, 17.2 if classes else 12.9))
    ax_n, ax_h, ax_t = axes[:3]
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
    if classes:
        _plot_video_classes(axes[3], result["classes"]["peak_ratio_vs_unpatched"])
    fig.tight_layout()
    fig.savefig(RESULTS / "vae_memory.png", dpi=120)


def _plot_video_classes(ax_c, ratios: dict) -> None:
    """Per split class: the decode peak per rank vs unpatched at the largest height, N = 2 and 4."""
    names = list(ratios)
    for offset, world in ((-0.2, 2), (0.2, 4)):
        ax_c.bar([i + offset for i in range(len(names))], [ratios[n][f"N{world}"][-1] for n in names], 0.4,
                 label=f"N = {world}")  # fmt: skip
    for bound in (0.6, 0.35):
        ax_c.axhline(bound, color="gray", ls=":")
    ax_c.set_xticks(range(len(names)))
    ax_c.set_xticklabels([n.replace("AutoencoderKL", "") for n in names], rotation=45, ha="right")
    ax_c.set(
        ylabel="decode peak per rank / unpatched", title=f"video VAEs, latent height {VIDEO_HEIGHTS[-1]}"
    )
    ax_c.legend()


if __name__ == "__main__":
    classes = classes_main()
    json.dump(
        {
            name: {w: e[w]["peak_ratio_max_rank"] for w in ("N2", "N4")}
            for name, e in classes["classes"].items()
        },
        sys.stdout,
        indent=2,
    )
    print()
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
