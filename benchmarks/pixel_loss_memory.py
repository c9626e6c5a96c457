"""Peak memory of a pixel-loss training step: one-shot decode vs a plain per-chunk decode loop without checkpointing vs hfpatch.

Measures peak live tensor bytes (``hfpatch.testing.memory.track_memory``: tensors created during the step,
parameters and inputs excluded) over forward + backward of the pixel loss, with a frozen tiny VAE and
latents that require grad (the usual recipe: the gradient goes to the denoiser through the latents).

- vs batch size, chunk 1: one-shot grows with the batch, the seed's chunked loop (``loss += chunk`` with
  every chunk's graph kept until backward) grows the same way, hfpatch stays flat.
- vs chunk size at batch 8: hfpatch's peak follows the chunk, the seed's does not.
- the same batch sweep with the tiny Wan 2.1 video VAE.
- a GradCache-style custom ``autograd.Function`` (no graph in forward, per-chunk re-decode and backward in
  its backward) for comparison with the library's checkpointing: same memory, as argued in its docstring.
- the frame axis: ONE video of 1 + 4 (T - 1) frames (latent 4x4, 32x32 pixels) with the tiny Wan 2.1 VAE, T
  latent frames from 2 to 32: one-shot (what a lambda decode gets: a video is one item) vs hfpatch with the
  VAE itself as ``decode`` (time chunks of one latent frame, caches kept every ``ceil(sqrt(T))`` chunks, the
  default) and with every cache kept (``snapshot_every=1``); and the same with the VAE split over N = 2 and 4
  ranks (``hfpatch.apply(vae, parallel=N)``, gloo; the largest peak over the ranks).

Wall times are CPU times on a shared machine (indicative only: the recompute adds one decode forward per
chunk; time chunks with the default snapshots about two). Writes ``benchmarks/results/pixel_loss_memory.json``
and ``.png``; runs in a few minutes (the split runs dominate).

    python benchmarks/pixel_loss_memory.py

:func:`wan_video_gpu` is the same frame-axis step on the real Wan 2.1 VAE config (81 frames of 480x832, fp32
and bf16) for a GPU benchmark to call; no GPU figure has been measured by this script.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

import hfpatch
from hfpatch.testing import tiny_autoencoder_kl, tiny_wan_vae
from hfpatch.testing.memory import track_memory
from hfpatch.testing.runner import RankPool
from hfpatch.training import chunked_pixel_loss
from hfpatch.training.pixel_loss import _seed_variant_pixel_loss

RESULTS = Path(__file__).parent / "results"
MiB = 2**20
COLORS = {
    "one-shot": "tab:blue",
    "seed (chunked, graph kept)": "tab:orange",
    "GradCache-style Function": "tab:purple",
    "hfpatch (chunked + recompute)": "tab:green",
}
STYLES = {"GradCache-style Function": "x--"}  # it overlaps hfpatch's line
LATENT_FRAMES = [2, 4, 8, 16, 32]
SPLIT_WORLDS = [2, 4]
FRAME_VARIANTS = {  # name -> (decode given as the VAE, chunked_pixel_loss options)
    "one-shot": (False, {"reference": True}),
    "hfpatch (time chunks, default)": (True, {}),
    "hfpatch (time chunks, all caches kept)": (True, {"snapshot_every": 1}),
}
FRAME_COLORS = {
    "one-shot": "tab:blue",
    "hfpatch (time chunks, default)": "tab:green",
    "hfpatch (time chunks, all caches kept)": "tab:olive",
}


class _GradCacheStyle(torch.autograd.Function):
    """The alternative design, for comparison: no graph in forward; backward re-decodes chunk by chunk.

    Gradients reach the latents only (the decoder here is frozen); the library's checkpointing version also
    reaches any trainable tensor ``decode`` uses, which this design would have to be handed explicitly.
    """

    @staticmethod
    def forward(ctx, latents, decode, targets, chunk_size):
        ctx.decode, ctx.targets, ctx.chunk_size = decode, targets, chunk_size
        ctx.save_for_backward(latents)
        with torch.no_grad():
            return _seed_variant_pixel_loss(decode, latents, targets, chunk_size=chunk_size)

    @staticmethod
    def backward(ctx, grad_loss):
        (latents,) = ctx.saved_tensors
        grad = torch.empty_like(latents)
        for start in range(0, len(latents), ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            chunk = latents[rows].detach().requires_grad_(True)
            with torch.enable_grad():
                # The chunk's mean error rescaled to its share of the batch mean (no masks here).
                part = _seed_variant_pixel_loss(ctx.decode, chunk, ctx.targets[rows]) * (
                    len(chunk) / len(latents)
                )
            (grad[rows],) = torch.autograd.grad(part, chunk, grad_loss)
        return grad, None, None, None


def _variants(chunk_size: int) -> dict[str, Callable[..., torch.Tensor]]:
    return {
        "one-shot": lambda d, z, x: chunked_pixel_loss(d, z, x, reference=True),
        "seed (chunked, graph kept)": lambda d, z, x: _seed_variant_pixel_loss(
            d, z, x, chunk_size=chunk_size
        ),
        "GradCache-style Function": lambda d, z, x: _GradCacheStyle.apply(z, d, x, chunk_size),
        "hfpatch (chunked + recompute)": lambda d, z, x: chunked_pixel_loss(d, z, x, chunk_size=chunk_size),
    }


def _step(loss_fn, decode, latents: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    leaves = latents.detach().clone().requires_grad_(True)
    start = time.perf_counter()
    with track_memory() as memory:
        loss = loss_fn(decode, leaves, targets)
        forward_peak = memory.peak_bytes
        loss.backward()
    return {
        "forward_peak_mib": forward_peak / MiB,
        "step_peak_mib": memory.peak_bytes / MiB,
        "seconds": time.perf_counter() - start,
        "loss": loss.item(),
    }


def _inputs(latent_shape: tuple[int, ...], image_shape: tuple[int, ...], batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *latent_shape, generator=gen), torch.rand(
        batch, *image_shape, generator=gen
    ) * 2 - 1


def _video_inputs(latent_frames: int, height: int = 4, width: int = 4, seed: int = 0):
    """One video: latents ``(1, 4, T, h, w)`` and targets of ``1 + 4 (T - 1)`` frames of ``8h x 8w``."""
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 4, latent_frames, height, width, generator=gen)
    frames = 1 + 4 * (latent_frames - 1)
    return latents, torch.rand(1, 3, frames, 8 * height, 8 * width, generator=gen) * 2 - 1


def _frame_step(vae, latents, targets, as_vae: bool, options: dict) -> tuple[dict, torch.Tensor]:
    """``_step`` for one video; also returns the latent gradient (for the error column)."""
    decode = vae if as_vae else (lambda z: vae.decode(z).sample)
    leaves = latents.detach().clone().requires_grad_(True)
    start = time.perf_counter()
    with track_memory() as memory:
        loss = chunked_pixel_loss(decode, leaves, targets, **options)
        forward_peak = memory.peak_bytes
        loss.backward()
    row = {
        "forward_peak_mib": forward_peak / MiB,
        "step_peak_mib": memory.peak_bytes / MiB,
        "seconds": time.perf_counter() - start,
        "loss": loss.item(),
    }
    return row, leaves.grad


def _frame_records() -> list[dict]:
    vae = tiny_wan_vae("2.1").requires_grad_(False)
    records = []
    for t in LATENT_FRAMES:
        latents, targets = _video_inputs(t)
        reference = None
        for name, (as_vae, options) in FRAME_VARIANTS.items():
            row, grad = _frame_step(vae, latents, targets, as_vae, options)
            if reference is None:
                reference = grad
            row["grad_rel_err"] = float((grad - reference).norm() / reference.norm())
            records.append(_frame_record(name, t, row))
    return records


def _frame_record(name: str, latent_frames: int, row: dict, world: int = 1) -> dict:
    return {
        "sweep": "frames",
        "model": "wan2.1",
        "variant": name,
        "world": world,
        "latent_frames": latent_frames,
        "pixel_frames": 1 + 4 * (latent_frames - 1),
        **row,
    }


def _split_frames(latent_frames: list[int]) -> list[dict]:
    """On every rank of a VAE split: one-shot (the stock decode, split) vs hfpatch's time chunks (default)."""
    torch.set_num_threads(1)
    vae = tiny_wan_vae("2.1").requires_grad_(False)
    rows = []
    with hfpatch.apply(vae):
        for t in latent_frames:
            latents, targets = _video_inputs(t)
            for name in ("one-shot", "hfpatch (time chunks, default)"):
                as_vae, options = FRAME_VARIANTS[name]
                row, _ = _frame_step(vae, latents, targets, as_vae, options)
                rows.append(_frame_record(name, t, row))
    return rows


def _split_records() -> list[dict]:
    records = []
    for world in SPLIT_WORLDS:
        with RankPool(world, timeout_s=1800) as pool:
            per_rank = pool.run(_split_frames, LATENT_FRAMES)
        for rows in zip(*per_rank):  # the same case on every rank: keep the largest peak, the slowest time
            worst = max(rows, key=lambda r: r["step_peak_mib"])
            records.append(
                {
                    **worst,
                    "world": world,
                    "step_peak_mib": worst["step_peak_mib"],
                    "seconds": max(r["seconds"] for r in rows),
                    "forward_peak_mib": max(r["forward_peak_mib"] for r in rows),
                }
            )
    return records


def wan_video_gpu(args, device: torch.device, dtype: torch.dtype, result: dict) -> None:
    """GPU benchmark section: one Wan 2.1 VAE (default config, random weights, frozen) video, pixel-loss step
    (decode + loss + backward to the latents), hfpatch's time chunks (the VAE given as ``decode``, defaults).

    Fills ``result`` with, per dtype (fp32 and bf16) and latent frames (21 = 81 pixel frames of 480x832;
    ``args.tiny``: the tiny VAE, 2 and 5 latent frames of 32x32): ``step_peak_gib`` (CUDA:
    ``torch.cuda.max_memory_allocated`` above the baseline; CPU: live tensor bytes), ``seconds`` (one step,
    synchronised), ``loss``; and, for scale, the one-shot step at 2 latent frames (5 pixel frames: 23.7 GiB in
    bf16 on an H100 in the seed's measurement). ``args`` needs ``tiny`` (bool). A failing case records its
    error and the others still run. Call it from a GPU benchmark, e.g. ``benchmarks/gpu.py``: add
    ``"pixel_loss_video"`` to its sections and ``from pixel_loss_memory import wan_video_gpu as
    pixel_loss_video``.
    """
    from diffusers import AutoencoderKLWan

    tiny = bool(getattr(args, "tiny", False))
    torch.manual_seed(0)
    with torch.device(device):
        vae = tiny_wan_vae("2.1") if tiny else AutoencoderKLWan()
    vae = vae.to(device).eval().requires_grad_(False)
    h, w = (4, 4) if tiny else (60, 104)
    cases = [(2, "one-shot", {"reference": True})] + [(t, "hfpatch", {}) for t in ((2, 5) if tiny else (21,))]
    result.update(height=8 * h, width=8 * w, vae="tiny Wan 2.1" if tiny else "Wan 2.1 default config")
    for case_dtype in dict.fromkeys((torch.float32, dtype, torch.bfloat16)):
        if device.type == "cpu" and case_dtype == torch.bfloat16:
            continue  # the bf16 Wan decode + backward crashes some CPU builds of torch (README, Known gaps)
        vae.to(case_dtype)
        for t, mode, options in cases:
            key = (
                f"{str(case_dtype).removeprefix('torch.')} {mode} {t} latent / {1 + 4 * (t - 1)} pixel frames"
            )
            gen = torch.Generator().manual_seed(t)
            latents = torch.randn(1, vae.config.z_dim, t, h, w, generator=gen).to(device, case_dtype)
            targets = (torch.rand(1, 3, 1 + 4 * (t - 1), 8 * h, 8 * w, generator=gen) * 2 - 1).to(
                device, case_dtype
            )
            try:
                result[key] = _gpu_step(vae, latents, targets, options, device)
            except Exception as error:  # noqa: BLE001 - out of memory is a result here
                result[key] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            finally:
                del latents, targets
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"pixel loss video {key}: {result[key]}", flush=True)


def _gpu_step(vae, latents, targets, options: dict, device: torch.device) -> dict:
    leaf = latents.detach().clone().requires_grad_(True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        loss = chunked_pixel_loss(vae, leaf, targets, **options)
        loss.backward()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        start = time.perf_counter()
        with track_memory() as memory:
            loss = chunked_pixel_loss(vae, leaf, targets, **options)
            loss.backward()
        seconds, peak = time.perf_counter() - start, memory.peak_bytes
    return {"step_peak_gib": peak / 2**30, "seconds": seconds, "loss": float(loss.detach())}


def run() -> dict:
    torch.set_num_threads(1)  # shared CPUs: one thread keeps tiny convs from spin-waiting
    kl = tiny_autoencoder_kl().requires_grad_(False)
    wan = tiny_wan_vae("2.1").requires_grad_(False)
    kl_decode, wan_decode = (lambda z: kl.decode(z).sample), (lambda z: wan.decode(z).sample)
    kl_shapes = ((4, 32, 32), (3, 64, 64))  # 64x64 images: decoder activations dominate
    wan_shapes = ((4, 2, 4, 4), (3, 5, 32, 32))  # 5-frame 32x32 videos
    records = []
    for model, decode, shapes, batches in [
        ("kl", kl_decode, kl_shapes, [1, 2, 4, 8, 16]),
        ("wan2.1", wan_decode, wan_shapes, [1, 2, 4, 8]),
    ]:
        for batch in batches:
            latents, targets = _inputs(*shapes, batch)
            for name, fn in _variants(chunk_size=1).items():
                records.append(
                    {
                        "sweep": "batch",
                        "model": model,
                        "variant": name,
                        "batch": batch,
                        "chunk_size": 1 if name != "one-shot" else batch,
                        **_step(fn, decode, latents, targets),
                    }
                )
    latents, targets = _inputs(*kl_shapes, 8)
    for chunk in [1, 2, 4, 8]:
        for name, fn in _variants(chunk_size=chunk).items():
            if name != "one-shot":
                records.append(
                    {
                        "sweep": "chunk",
                        "model": "kl",
                        "variant": name,
                        "batch": 8,
                        "chunk_size": chunk,
                        **_step(fn, kl_decode, latents, targets),
                    }
                )
    records += _frame_records()
    records += _split_records()
    return {
        "description": "peak live tensor bytes of a pixel-loss step (forward + backward), frozen tiny VAE, "
        "latents require grad; KL: 64x64 images, Wan 2.1: 5x32x32 videos; frames sweep: one Wan 2.1 video "
        "of 1 + 4 (T - 1) frames of 32x32 (split rows: the largest peak over the ranks)",
        "records": records,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    records = results["records"]
    fig, grid = plt.subplots(4, 1, figsize=(9, 17.2))
    axes = grid.flat
    for ax, model, title in [
        (axes[0], "kl", "AutoencoderKL, 64x64, chunk 1"),
        (axes[1], "wan2.1", "AutoencoderKLWan 2.1, 5x32x32, chunk 1"),
    ]:
        for name in _variants(1):
            rows = [
                r for r in records if r["sweep"] == "batch" and r["model"] == model and r["variant"] == name
            ]
            ax.plot(
                [r["batch"] for r in rows],
                [r["step_peak_mib"] for r in rows],
                STYLES.get(name, "o-"),
                color=COLORS[name],
                label=name,
            )
        ax.set(title=title, xlabel="images per step", ylabel="peak MiB (forward + backward)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[2]
    for name in list(_variants(1))[1:]:
        rows = [r for r in records if r["sweep"] == "chunk" and r["variant"] == name]
        ax.plot(
            [r["chunk_size"] for r in rows],
            [r["step_peak_mib"] for r in rows],
            STYLES.get(name, "o-"),
            color=COLORS[name],
            label=name,
        )
    one_shot = next(
        r
        for r in records
        if r["sweep"] == "batch" and r["model"] == "kl" and r["variant"] == "one-shot" and r["batch"] == 8
    )
    ax.axhline(one_shot["step_peak_mib"], color=COLORS["one-shot"], ls="--", label="one-shot")
    ax.set(
        title="AutoencoderKL, 8 images of 64x64", xlabel="chunk size", ylabel="peak MiB (forward + backward)"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    _plot_frames(axes[3], records)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_frames(ax, records: list[dict]) -> None:
    frames = [r for r in records if r["sweep"] == "frames"]
    styles = {1: "o-", 2: "s--", 4: "^:"}
    for world in [1, *SPLIT_WORLDS]:
        for name in FRAME_VARIANTS:
            rows = [r for r in frames if r["variant"] == name and r["world"] == world]
            if rows:
                label = name if world == 1 else f"{name.split(' (')[0]}, split N={world} (per rank)"
                ax.plot(
                    [r["latent_frames"] for r in rows],
                    [r["step_peak_mib"] for r in rows],
                    styles[world],
                    color=FRAME_COLORS[name],
                    label=label,
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set(
        title="AutoencoderKLWan 2.1, one video of 32x32, VAE given as decode",
        xlabel="latent frames (pixel frames = 1 + 4 (T - 1))",
        ylabel="peak MiB (forward + backward)",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend()


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = run()
    (RESULTS / "pixel_loss_memory.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "pixel_loss_memory.png")
    print(f"{'model':7} {'variant':31} {'batch':>5} {'chunk':>5} {'fwd MiB':>8} {'step MiB':>8} {'s':>6}")
    for r in results["records"]:
        if r["sweep"] == "frames":
            print(
                f"{r['model']:7} {r['variant'][:31]:31} N={r['world']} T={r['latent_frames']:3} "
                f"{r['forward_peak_mib']:8.2f} {r['step_peak_mib']:8.2f} {r['seconds']:6.2f}"
            )
            continue
        print(
            f"{r['model']:7} {r['variant']:31} {r['batch']:5} {r['chunk_size']:5} {r['forward_peak_mib']:8.2f} "
            f"{r['step_peak_mib']:8.2f} {r['seconds']:6.2f}"
        )
    print(f"wrote {RESULTS / 'pixel_loss_memory.json'} and .png")


if __name__ == "__main__":
    main()
