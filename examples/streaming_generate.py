"""Stream a long video block by block from a stock WanPipeline, switch prompts mid-stream, train a chunk.

Runs on tiny random-weight models on CPU in seconds (the pixels are noise; the point is the mechanics):

1. ``StreamingWanPipeline.from_pipe`` patches the pipeline's ``WanTransformer3DModel`` block-causal
   (KV cache with a local window and sink frames) and streams decoded frames as each block is ready;
2. a prompt schedule switches prompts at a block boundary, rebuilding the cache under the new prompt;
3. ``StreamingTrainingModel`` produces one training chunk (new frames + overlap) with its gradient mask.

    python examples/streaming_generate.py --blocks 8 --switch-at 4
    torchrun --nproc-per-node 2 examples/streaming_generate.py --parallel 2   # each block split over 2 ranks

With real weights (Self-Forcing / LongLive generator checkpoints are in the native Wan layout):

    pipe = WanPipeline.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", torch_dtype=torch.bfloat16).to("cuda")
    pipe.transformer.load_state_dict(convert_native_to_diffusers(torch.load(ckpt_path)), strict=True)
    stream = StreamingWanPipeline.from_pipe(pipe, StreamingConfig(num_frame_per_block=3, local_attn_size=12,
                                                                  sink_size=3))
    prompt_embeds, _ = pipe.encode_prompt("a cat surfing", do_classifier_free_guidance=False)
    for out in stream.stream(prompt_embeds, num_blocks=20, height=480, width=832,
                             denoising_step_list=warp_denoising_steps([1000, 750, 500, 250], shift=5.0),
                             generator=torch.Generator().manual_seed(0)):
        show(out.frames)   # [B, f, 3, H, W] in [0, 1]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from hfpatch.streaming import StreamingConfig, StreamingTrainingModel, StreamingWanPipeline
from hfpatch.testing import tiny_wan_pipe, wan_prompt_embeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--switch-at", type=int, default=4, help="block where the second prompt starts")
    parser.add_argument("--window", type=int, default=6, help="local_attn_size in latent frames")
    parser.add_argument("--sink", type=int, default=2)
    parser.add_argument(
        "--parallel", type=int, default=1, help="ranks that split each block (launch with torchrun)"
    )
    args = parser.parse_args()

    config = StreamingConfig(num_frame_per_block=2, local_attn_size=args.window, sink_size=args.sink)
    # parallel > 1: every block's tokens, both caches and the VAE decode split over the ranks (same frames).
    stream = StreamingWanPipeline.from_pipe(tiny_wan_pipe(), config, parallel=args.parallel)
    show = not dist.is_initialized() or dist.get_rank() == 0  # every rank holds the same frames: print once
    if show and args.parallel > 1:
        print(f"plan: {stream.plan}")
    schedule = [(0, wan_prompt_embeds(seed=1)), (args.switch_at, wan_prompt_embeds(seed=2))]
    if show:
        print(f"{'block':>5} {'prompt':>6} {'frames':>10} {'cache KiB':>9} {'ms':>6}")
    start = time.perf_counter()
    for out in stream.stream(
        schedule,
        args.blocks,
        height=16,
        width=32,
        denoising_step_list=(1000, 750, 500, 250),
        generator=torch.Generator().manual_seed(0),
    ):
        now = time.perf_counter()
        if show:
            print(
                f"{out.block_index:>5} {out.prompt_index:>6} {out.frames.shape[1]:>10} "
                f"{stream.cache.nbytes / 1024:>9.1f} {1e3 * (now - start):>6.0f}"
            )
        start = now
    if show:
        print("cached frames at the end:", stream.cache.frames())

    trainer = StreamingTrainingModel(
        stream.transformer, config, chunk_size=6, min_new_frames=2, denoising_step_list=(1000, 750, 500, 250)
    )
    trainer.setup_sequence(wan_prompt_embeds(), latent_shape=(4, 4, 4), max_length=24)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        chunk, info = trainer.generate_next_chunk(requires_grad=step > 0, generator=gen)
        loss = (chunk.square().mean(dim=(1, 3, 4)) * info.gradient_mask).sum() / info.gradient_mask.sum()
        if chunk.requires_grad:
            loss.backward()
        if show:
            print(
                f"chunk {step}: frames {info.chunk_start_frame}..{info.chunk_start_frame + chunk.shape[2] - 1}, "
                f"new {info.new_frames}, exit steps {info.exit_steps}, loss {loss.item():.3f}"
            )
    stream.remove()


if __name__ == "__main__":
    main()
