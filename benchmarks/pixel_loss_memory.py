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

Wall times are CPU times on a shared machine (indicative only: the recompute adds one decode forward per
chunk). Writes ``benchmarks/results/pixel_loss_memory.json`` and ``.png``; runs in well under a minute.

    python benchmarks/pixel_loss_memory.py
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hfpatch.testing import tiny_autoencoder_kl, tiny_wan_vae
from hfpatch.testing.memory import track_memory
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
    return {
        "description": "peak live tensor bytes of a pixel-loss step (forward + backward), frozen tiny VAE, "
        "latents require grad; KL: 64x64 images, Wan 2.1: 5x32x32 videos",
        "records": records,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = results["records"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = run()
    (RESULTS / "pixel_loss_memory.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "pixel_loss_memory.png")
    print(f"{'model':7} {'variant':31} {'batch':>5} {'chunk':>5} {'fwd MiB':>8} {'step MiB':>8} {'s':>6}")
    for r in results["records"]:
        print(
            f"{r['model']:7} {r['variant']:31} {r['batch']:5} {r['chunk_size']:5} {r['forward_peak_mib']:8.2f} "
            f"{r['step_peak_mib']:8.2f} {r['seconds']:6.2f}"
        )
    print(f"wrote {RESULTS / 'pixel_loss_memory.json'} and .png")


if __name__ == "__main__":
    main()
