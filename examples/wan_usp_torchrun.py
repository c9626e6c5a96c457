"""Wan 2.1 text-to-video on several GPUs with one ``hfpatch.apply`` call.

Run the same script on every GPU; every rank gets the full video, rank 0 saves it:

    torchrun --nproc-per-node 8 examples/wan_usp_torchrun.py --prompt "A cat surfing a wave at sunset"

With 8 ranks and the 12 heads of Wan2.1-T2V-1.3B the planner picks CFG parallel 2 x Ulysses 4 (cond and
uncond on different ranks, each half sequence-parallel over 4), and the VAE decodes split over all 8.
Force other degrees with ``--cfg/--ulysses/--ring`` (their product must be the number of ranks).
Use the 14B checkpoint (``--model-id Wan-AI/Wan2.1-T2V-14B-Diffusers``) the same way. The checkpoint comes
from the Hugging Face hub or its local cache (offline: ``hf download MODEL_ID`` first); saving the mp4
needs ``imageio`` + ``imageio-ffmpeg`` (or ``opencv-python``).

Without GPUs or a download, ``--tiny`` runs the same script on a tiny random-weight Wan pipeline from
``hfpatch.testing`` on CPU processes (gloo), in seconds, and also runs it unpatched to check the outputs:

    torchrun --nproc-per-node 2 examples/wan_usp_torchrun.py --tiny
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

DEFAULT_MODEL = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
DEFAULT_NEGATIVE = (
    "Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality, JPEG artifacts, "
    "ugly, deformed, extra fingers, poorly drawn hands, poorly drawn face, still picture, cluttered background"
)
#: (height, width, frames, steps) by default for the real checkpoint and for --tiny.
DEFAULTS = {False: (480, 832, 81, 50), True: (32, 32, 5, 2)}
#: --tiny's pixel tolerance against the unpatched run: the fp32 outputs differ only by the order of float
#: sums (split VAE, sequence parallel; CFG parallel is bit-exact), measured <= 1e-6 (see ``hfpatch demo``).
TINY_ATOL = 2e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-id", default=DEFAULT_MODEL, help=f"diffusers checkpoint (default: {DEFAULT_MODEL})"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny random-weight Wan pipeline from hfpatch.testing (CPU/gloo, no download, seconds); also runs "
        "it unpatched and exits with status 1 if the outputs differ by more than fp32 reassociation",
    )
    parser.add_argument("--prompt", default="A cat walks on the grass, realistic")
    parser.add_argument("--negative-prompt", default=DEFAULT_NEGATIVE)
    parser.add_argument("--height", type=int, help="default: 480 (--tiny: 32)")
    parser.add_argument("--width", type=int, help="default: 832 (--tiny: 32)")
    parser.add_argument("--frames", type=int, help="4k+1 frames (default: 81, 5 s at 16 fps; --tiny: 5)")
    parser.add_argument("--steps", type=int, help="default: 50 (--tiny: 2)")
    parser.add_argument("--guidance-scale", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0, help="same on every rank: the noise is identical")
    parser.add_argument(
        "--cfg", type=int, help="CFG degree (1 or 2); with --ulysses/--ring instead of the plan"
    )
    parser.add_argument("--ulysses", type=int, help="Ulysses degree (all-to-all over heads)")
    parser.add_argument("--ring", type=int, help="Ring degree (K/V passed rank to rank)")
    parser.add_argument(
        "--output",
        help="default: wan_usp.mp4; with --tiny nothing is saved unless given (the frames as a torch tensor file)",
    )
    args = parser.parse_args(argv)
    for name, default in zip(("height", "width", "frames", "steps"), DEFAULTS[args.tiny]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.output is None and not args.tiny:
        args.output = "wan_usp.mp4"
    return args


def load_pipe(args: argparse.Namespace, device):
    """The pipeline on ``device``: the tiny one, or the checkpoint (with a clear error when it is unavailable)."""
    import torch

    if args.tiny:
        from hfpatch.testing import tiny_wan_pipe

        return tiny_wan_pipe().to(device)
    from diffusers import AutoencoderKLWan, WanPipeline

    try:
        # The Wan VAE is numerically sensitive: keep it in fp32, the transformer in bf16 (as the model card does).
        vae = AutoencoderKLWan.from_pretrained(args.model_id, subfolder="vae", torch_dtype=torch.float32)
        pipe = WanPipeline.from_pretrained(args.model_id, vae=vae, torch_dtype=torch.bfloat16)
    except OSError as exc:
        # Hub unreachable or files missing from the local cache: diffusers raises OSError for both.
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _exit(
            f"could not load {args.model_id}: no network access / not in the local HF cache ({cause}); "
            f"download it first with `hf download {args.model_id}` (`huggingface-cli download {args.model_id}` "
            "with huggingface_hub < 1.0) or run with --tiny"
        )
    return pipe.to(device)


def _exit(message: str) -> None:
    """Exit with status 1 on every rank; the message once per machine (local rank 0)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"{os.path.basename(__file__)}: {message}", file=sys.stderr)
    sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.tiny and not (importlib.util.find_spec("imageio") or importlib.util.find_spec("cv2")):
        _exit("saving the mp4 needs imageio and imageio-ffmpeg (or opencv-python): pip install them first")
    import torch

    import hfpatch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pipe = load_pipe(args, device)

    def generate():
        if args.tiny:  # no text encoder in the tiny pipeline: random UMT5-shaped embeddings instead
            from hfpatch.testing import wan_prompt_embeds

            prompts = dict(
                prompt_embeds=wan_prompt_embeds().to(device),
                negative_prompt_embeds=wan_prompt_embeds(seed=2).to(device),
            )
        else:
            prompts = dict(prompt=args.prompt, negative_prompt=args.negative_prompt)
        return pipe(
            **prompts,
            height=args.height,
            width=args.width,
            num_frames=args.frames,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale,
            # A CPU generator gives the same noise on every rank and every GPU type.
            generator=torch.Generator().manual_seed(args.seed),
        ).frames[0]

    reference = generate() if args.tiny else None  # unpatched, on every rank (seconds for the tiny model)

    explicit = {k: v for k, v in (("cfg", args.cfg), ("ulysses", args.ulysses), ("ring", args.ring)) if v}
    # None = every rank torchrun started, planned automatically; initialises torch.distributed (NCCL on CUDA,
    # gloo on CPU).
    try:
        patch = hfpatch.apply(pipe, parallel=hfpatch.ParallelConfig(**explicit) if explicit else None)
    except (ValueError, TypeError) as exc:  # e.g. degrees that do not multiply to the number of ranks
        # Raised alike on every rank: say it once (rank 0), not once per rank with its traceback.
        raise SystemExit(f"error: {exc}" if os.environ.get("RANK", "0") == "0" else 1) from None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        print(f"plan: {patch.plan}")

    start = time.perf_counter()
    frames = generate()
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"rank {rank}: {seconds:.1f} s, peak GPU memory {peak:.1f} GiB")
    else:
        print(f"rank {rank}: {seconds:.1f} s on CPU")
    status = 0
    if reference is not None:
        diff = float(abs(frames - reference).max())
        if diff <= TINY_ATOL:
            print(
                f"rank {rank}: output equals the unpatched pipeline's up to fp32 reassociation "
                f"(max abs diff {diff:.1e} <= {TINY_ATOL:.0e})"
            )
        else:
            print(
                f"rank {rank}: FAIL, output differs from the unpatched pipeline's by {diff:.1e} > {TINY_ATOL:.0e}"
            )
            status = 1
    if rank == 0:
        if not args.tiny:
            from diffusers.utils import export_to_video

            export_to_video(frames, args.output, fps=16)
            print(f"saved {args.output}")
        elif args.output:
            torch.save(torch.from_numpy(frames), args.output)  # [frames, height, width, 3] in [0, 1]
            print(f"saved {args.output} (tiny mode: the frames as a tensor, no mp4)")
        else:
            print("tiny mode: no video saved (pass --output FILE.pt to save the frames as a tensor)")
    patch.remove()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
