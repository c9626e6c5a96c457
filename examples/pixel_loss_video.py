"""Train a video latent denoiser with a pixel loss on long videos: the step's memory bounded over frames.

A flow-matching loop on tiny random-weight models (CPU, seconds): a frozen stock ``AutoencoderKLWan`` (Wan 2.1
form) encodes one video once; a small 3D-conv denoiser predicts the velocity; the loss adds
``chunked_pixel_loss(vae, x0_pred * std + mean, video)``. Given the VAE itself (not a lambda), the video is
decoded one latent frame at a time with the decoder's causal cache, each time chunk's loss is taken as soon as
its frames exist, and the backward recomputes one time chunk at a time: the step's peak stays about flat as
the video grows, where the one-shot decode's grows with every frame.

    python examples/pixel_loss_video.py --frames 16 --check     # --check: compare step 0 with the one-shot step
    python examples/pixel_loss_video.py --debug                 # log the plan (time chunks, kept caches)
    torchrun --nproc-per-node 2 examples/pixel_loss_video.py    # the VAE split over 2 ranks (time x height)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.nn.functional as F

import hfpatch
from hfpatch.testing import tiny_wan_vae
from hfpatch.testing.memory import track_memory
from hfpatch.training import chunked_pixel_loss


def denoiser(channels: int = 4) -> torch.nn.Module:
    """A small velocity model on video latents [B, C, T, h, w] (time-step conditioning left out for brevity)."""
    return torch.nn.Sequential(
        torch.nn.Conv3d(channels, 32, 3, padding=1),
        torch.nn.SiLU(),
        torch.nn.Conv3d(32, channels, 3, padding=1),
    )


def step_loss(model, vae, video, x0, t, noise, **pixel_options):
    """Flow-matching loss plus the pixel loss of the x0 prediction (latents unnormalised as WanPipeline does)."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    x_t = (1 - t) * x0 + t * noise
    velocity = model(x_t)
    x0_pred = x_t - t * velocity
    pixel = chunked_pixel_loss(vae, x0_pred * std + mean, video, **pixel_options)
    return F.mse_loss(velocity, noise - x0) + 0.5 * pixel, pixel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--frames", type=int, default=16, help="latent frames (pixel frames: 1 + 4 (T - 1))")
    parser.add_argument(
        "--size", type=int, default=32, help="frame height and width in pixels (8x the latent)"
    )
    parser.add_argument("--check", action="store_true", help="compare step 0 with the one-shot step")
    parser.add_argument("--debug", action="store_true", help="log the pixel-loss plan")
    args = parser.parse_args()
    if args.debug:
        logging.basicConfig(stream=sys.stdout, format="  [%(name)s] %(message)s")
        logging.getLogger("hfpatch.training.pixel_loss").setLevel(logging.DEBUG)
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))

    vae = tiny_wan_vae("2.1").requires_grad_(False)  # frozen; every rank holds it (the same seed)
    patch = hfpatch.apply(vae, parallel=world)  # one rank: nothing to split; N ranks: height-split VAE
    model = denoiser()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(0)  # the same video and noise on every rank (they share the VAE)
    frames = 1 + 4 * (args.frames - 1)
    low = torch.rand(1, 3, frames, args.size // 8, args.size // 8, generator=gen) * 2 - 1
    video = F.interpolate(low, size=(frames, args.size, args.size), mode="trilinear")
    with torch.no_grad():
        x0 = vae.encode(video).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        x0 = (x0 - mean) / std  # the normalised latents the denoiser works in
    for step in range(args.steps):
        t = torch.rand(1, generator=gen).view(1, 1, 1, 1, 1) * 0.5
        noise = torch.randn(x0.shape, generator=gen)
        with track_memory() as memory:
            loss, pixel = step_loss(model, vae, video, x0, t, noise)
            loss.backward()
        if args.check and step == 0:
            check(model, vae, video, x0, t, noise, memory.peak_bytes)
        optimizer.step()  # DDP/FSDP over the denoiser would average its gradients here as usual
        optimizer.zero_grad()
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"step {step}: loss {loss.item():.4f} (pixel {pixel.item():.4f}), {frames} frames of "
                f"{args.size}x{args.size}, step peak {memory.peak_bytes / 2**20:.2f} MiB"
            )
    patch.remove()


def check(model, vae, video, x0, t, noise, peak: int) -> None:
    """The one-shot step (``reference=True``: the stock decode, every frame's graph kept) gives the same loss
    and gradients; print both peaks."""
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with track_memory() as memory:
        loss, _ = step_loss(model, vae, video, x0, t, noise, reference=True)
        loss.backward()
    for mine, theirs in zip(ours, (p.grad for p in model.parameters())):
        error = ((mine - theirs).abs().max() / theirs.abs().max()).item()
        if error > 1e-4:  # fp32 reassociation is ~1e-6 here; a lost or doubled time chunk is O(1)
            raise SystemExit(f"check failed: gradient differs from the one-shot step by {error:.2e}")
    print(
        f"check: gradients equal the one-shot step's; step peak {peak / 2**20:.2f} MiB vs one-shot "
        f"{memory.peak_bytes / 2**20:.2f} MiB"
    )
    for p, g in zip(model.parameters(), ours):
        p.grad = g


if __name__ == "__main__":
    main()
