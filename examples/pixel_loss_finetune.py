"""Fine-tune a latent denoiser with an added pixel-space loss whose memory stays at one decoded chunk.

A minimal diffusers-style flow-matching loop on tiny random-weight models (CPU, a few seconds):

- a frozen ``AutoencoderKL`` encodes the images once and decodes the denoiser's x0 prediction for the loss;
  it is kept out of ``accelerator.prepare`` (replicated, no gradients), so under FSDP/DDP the pixel loss
  adds no all-gather and no gradient sync;
- a stock ``UNet2DModel`` predicts the flow velocity; the loss is the flow-matching MSE plus, for the items
  at low noise (t <= 0.5 here; the seed used 0.2), ``chunked_pixel_loss`` on the decoded x0 prediction,
  with masks marking each image's valid region in the padded batch.

    python examples/pixel_loss_finetune.py --debug          # --debug: log each step's chunk plan
    HFPATCH_PIXEL_LOSS_V0=1 python examples/pixel_loss_finetune.py --chunk-size 1   # one-shot, for A/B
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import UNet2DModel

from hfpatch.testing import tiny_autoencoder_kl
from hfpatch.testing.memory import track_memory
from hfpatch.training import chunked_pixel_loss

PIXEL_WEIGHT = 0.5
PIXEL_T_MAX = 0.5


def synthetic_batch(batch: int, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Smooth random images in [-1, 1], padded to ``size``; masks mark each image's own (random) extent."""
    low = torch.rand(batch, 3, size // 8, size // 8, generator=gen) * 2 - 1
    images = F.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)
    masks = torch.zeros(batch, 1, size, size)
    for i in range(batch):
        h, w = (int(torch.randint(size // 2, size + 1, (1,), generator=gen)) for _ in range(2))
        masks[i, :, :h, :w] = 1
        images[i, :, h:, :] = 0  # padding
        images[i, :, :, w:] = 0
    return images, masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=64, help="image size in pixels (the tiny VAE is 2x)")
    parser.add_argument("--chunk-size", default="auto", help="'auto' or an int")
    parser.add_argument("--debug", action="store_true", help="log the pixel-loss chunk plan")
    args = parser.parse_args()
    if args.debug:
        logging.basicConfig(stream=sys.stdout, format="  [%(name)s] %(message)s")
        logging.getLogger("hfpatch.training.pixel_loss").setLevel(logging.DEBUG)
    chunk_size = args.chunk_size if args.chunk_size == "auto" else int(args.chunk_size)
    torch.manual_seed(0)

    accelerator = Accelerator(cpu=True)
    vae = tiny_autoencoder_kl().requires_grad_(False).to(accelerator.device)  # frozen, not prepared
    unet = UNet2DModel(
        sample_size=args.size // 2,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    unet, optimizer = accelerator.prepare(unet, optimizer)

    def decode(latents: torch.Tensor) -> torch.Tensor:
        # A real VAE: vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample
        return vae.decode(latents).sample

    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        images, masks = synthetic_batch(args.batch, args.size, gen)
        with torch.no_grad():
            x0 = vae.encode(images).latent_dist.mode()
        t = torch.rand(args.batch, generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        tt = t.view(-1, 1, 1, 1)
        x_t = (1 - tt) * x0 + tt * noise
        with track_memory() as memory, accelerator.accumulate(unet):
            velocity = unet(x_t, t * 1000).sample
            flow_loss = F.mse_loss(velocity, noise - x0)
            low_noise = t <= PIXEL_T_MAX
            pixel = torch.zeros(())
            if low_noise.any():
                x0_pred = x_t[low_noise] - tt[low_noise] * velocity[low_noise]
                pixel = chunked_pixel_loss(decode, x0_pred, images[low_noise], masks[low_noise], chunk_size)
            loss = flow_loss + PIXEL_WEIGHT * pixel
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.print(
            f"step {step}: loss {loss.item():.4f} = flow {flow_loss.item():.4f} + {PIXEL_WEIGHT} x pixel "
            f"{pixel.item():.4f} ({int(low_noise.sum())}/{args.batch} images decoded), "
            f"step peak {memory.peak_bytes / 2**20:.1f} MiB"
        )

    accelerator.print(
        "\nA real run is the same loop with a pretrained VAE and transformer, e.g. under\n"
        "  HFPATCH_PIXEL_LOSS_V0=0 accelerate launch --num_processes 8 train.py   # =1: one-shot A/B check\n"
        "where 1024x1024 images get chunk_size='auto' -> 1 (>= 1 MP), 512x512 -> 2, smaller -> 4, or pass\n"
        "memory_budget_bytes=... to size chunks from a measured one-image decode; the step's pixel-loss memory\n"
        "is then one chunk's decoder activations in forward and backward instead of the whole batch's."
    )


if __name__ == "__main__":
    main()
