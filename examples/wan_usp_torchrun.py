"""Wan 2.1 text-to-video on several GPUs with one ``hfpatch.apply`` call.

Run the same script on every GPU; every rank gets the full video, rank 0 saves it:

    torchrun --nproc-per-node 8 examples/wan_usp_torchrun.py --prompt "A cat surfing a wave at sunset"

With 8 ranks and the 12 heads of Wan2.1-T2V-1.3B the planner picks CFG parallel 2 x Ulysses 4 (cond and
uncond on different ranks, each half sequence-parallel over 4), and the VAE decodes split over all 8.
Force other degrees with ``--cfg/--ulysses/--ring`` (their product must be the number of ranks).
Use the 14B checkpoint (``--model-id Wan-AI/Wan2.1-T2V-14B-Diffusers``) the same way.
"""

from __future__ import annotations

import argparse
import os
import time

DEFAULT_MODEL = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
DEFAULT_NEGATIVE = (
    "Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality, JPEG artifacts, "
    "ugly, deformed, extra fingers, poorly drawn hands, poorly drawn face, still picture, cluttered background"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-id", default=DEFAULT_MODEL, help=f"diffusers checkpoint (default: {DEFAULT_MODEL})"
    )
    parser.add_argument("--prompt", default="A cat walks on the grass, realistic")
    parser.add_argument("--negative-prompt", default=DEFAULT_NEGATIVE)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=81, help="4k+1 frames (default: 81, 5 s at 16 fps)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance-scale", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0, help="same on every rank: the noise is identical")
    parser.add_argument(
        "--cfg", type=int, help="CFG degree (1 or 2); with --ulysses/--ring instead of the plan"
    )
    parser.add_argument("--ulysses", type=int, help="Ulysses degree (all-to-all over heads)")
    parser.add_argument("--ring", type=int, help="Ring degree (K/V passed rank to rank)")
    parser.add_argument("--output", default="wan_usp.mp4")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline
    from diffusers.utils import export_to_video

    import hfpatch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    # The Wan VAE is numerically sensitive: keep it in fp32, the transformer in bf16 (as the model card does).
    vae = AutoencoderKLWan.from_pretrained(args.model_id, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(args.model_id, vae=vae, torch_dtype=torch.bfloat16).to(device)

    explicit = {k: v for k, v in (("cfg", args.cfg), ("ulysses", args.ulysses), ("ring", args.ring)) if v}
    # None = every rank torchrun started, planned automatically; initialises torch.distributed (NCCL on CUDA).
    patch = hfpatch.apply(pipe, parallel=hfpatch.ParallelConfig(**explicit) if explicit else None)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        print(f"plan: {patch.plan}")

    start = time.perf_counter()
    frames = pipe(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale,
        # A CPU generator gives the same noise on every rank and every GPU type.
        generator=torch.Generator().manual_seed(args.seed),
    ).frames[0]
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"rank {rank}: {seconds:.1f} s, peak GPU memory {peak:.1f} GiB")
    if rank == 0:
        export_to_video(frames, args.output, fps=16)
        print(f"saved {args.output}")
    patch.remove()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
