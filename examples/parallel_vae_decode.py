"""Decode (and train through) a Wan VAE split over several ranks with one ``hfpatch.apply`` call.

Every rank holds 1/N of the rows of every feature map; the result equals one-device decoding:

    torchrun --nproc-per-node 4 examples/parallel_vae_decode.py                      # Wan 2.1 VAE, 720p
    torchrun --nproc-per-node 2 examples/parallel_vae_decode.py --tiny --check       # CPU, tiny random VAE
    torchrun --nproc-per-node 2 examples/parallel_vae_decode.py --tiny --train       # one training step

``--check`` decodes once more unpatched on rank 0 and prints the largest difference; ``--train`` runs a
reconstruction loss through the split encoder and decoder and averages the parameter gradients over the
ranks (:func:`hfpatch.all_reduce_gradients`; under DDP nothing is needed) before the optimizer step.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import hfpatch
from hfpatch import all_reduce_gradients
from hfpatch.distributed import runtime
from hfpatch.testing.memory import track_memory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-id", default="Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    parser.add_argument("--tiny", action="store_true", help="tiny random VAE on CPU (no download)")
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--frames", type=int, default=21, help="latent frames (21 -> 81 video frames)")
    parser.add_argument("--mode", choices=("precise", "approx"), default="precise")
    parser.add_argument("--check", action="store_true", help="compare with an unpatched decode on rank 0")
    parser.add_argument("--train", action="store_true", help="one reconstruction training step")
    return parser.parse_args(argv)


def load_vae(args: argparse.Namespace) -> torch.nn.Module:
    if args.tiny:
        from hfpatch.testing import tiny_wan_vae

        args.height, args.width, args.frames = 64, 48, 3
        return tiny_wan_vae("2.1")
    from diffusers import AutoencoderKLWan

    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return AutoencoderKLWan.from_pretrained(args.model_id, subfolder="vae", torch_dtype=torch.float32).to(
        device
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runtime.ensure_process_group(int(os.environ.get("WORLD_SIZE", "1")))  # from torchrun's environment
    rank = runtime.rank()
    vae = load_vae(args)
    device = next(vae.parameters()).device
    z_dim, scale = vae.config.z_dim, vae.spatial_compression_ratio
    latents = torch.randn(
        1,
        z_dim,
        args.frames,
        args.height // scale,
        args.width // scale,
        generator=torch.Generator().manual_seed(0),
    ).to(device)  # the same seed on every rank: every rank must pass the same latents

    reference = None
    if args.check and rank == 0:
        with torch.no_grad():
            reference = vae.decode(latents).sample

    patch = hfpatch.apply(vae, vae_mode=args.mode)  # parallel=None: all ranks of the torchrun world
    with torch.no_grad(), track_memory() as mem:
        video = vae.decode(latents).sample
    print(f"rank {rank}: decoded {tuple(video.shape)}, peak activations {mem.peak_bytes / 2**20:.1f} MiB")
    if reference is not None:
        print(f"rank {rank}: max |split - unpatched| = {(video - reference).abs().max().item():.2e}")

    if args.train:
        optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-5)
        target = video.detach()[:, :, :5]  # a short clip: 1 + 4 frames -> 2 latent frames
        recon = vae.decode(vae.encode(target).latent_dist.mode()).sample
        loss = torch.nn.functional.mse_loss(recon, target)  # the same loss on every rank
        loss.backward()
        all_reduce_gradients(vae)  # each rank holds N x the gradient of its rows: average them
        optimizer.step()
        print(f"rank {rank}: training step done, loss {loss.item():.4f}")
    patch.remove()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
