"""Train a (tiny) Qwen3-VL embedding model with GradCache in a plain accelerate loop.

Text queries are matched to image documents with InfoNCE over the whole batch; GradCache embeds the batch
in chunks, so the batch size (the number of in-batch negatives) is not limited by activation memory.
Runs on CPU in seconds with the tiny random-weight model from ``hfpatch.testing``:

    python examples/gradcache_accelerate.py --lora --checkpointing
    # DDP over 2 CPU processes, cross-rank negatives ("over 32 pairs"); on GPUs drop ACCELERATE_USE_CPU=true
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/gradcache_accelerate.py

Without GPUs, ``accelerate launch --num_processes 2`` starts one process; ``--multi_gpu`` starts two, but
without ``ACCELERATE_USE_CPU=true`` accelerate reports one process in each (no DDP, no cross-rank negatives).

For a real model swap in ``Qwen3VLModel.from_pretrained(...)`` and a collator built on its processor; the
batch layout (``input_ids``, ``attention_mask``, ``mm_token_type_ids``, ``pixel_values``, ``image_grid_thw``)
is the processor's.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs

from hfpatch.testing import qwen3_vl_inputs, tiny_qwen3_vl
from hfpatch.training import GradCache
from hfpatch.training.trainer import info_nce

IMAGE_GRIDS = [(1, 4, 4), (1, 2, 4), (1, 4, 6), (1, 2, 2)]  # images of different sizes


def collate(indices: list[int]) -> tuple[dict, dict]:
    """A batch of (text query, image document) pairs; sample ``i`` is always the same pair."""
    seed = sum(indices)
    queries = qwen3_vl_inputs([[]] * len(indices), text_len=6, seed=seed)
    docs = qwen3_vl_inputs([[("image", IMAGE_GRIDS[i % len(IMAGE_GRIDS)])] for i in indices], seed=seed + 1)
    return queries, docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--chunk-size", type=int, default=4)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument(
        "--lora", action="store_true", help="train a LoRA adapter (peft) instead of all weights"
    )
    parser.add_argument(
        "--checkpointing", action="store_true", help="gradient checkpointing in the second pass"
    )
    args = parser.parse_args()

    # Text-only query chunks do not use the vision tower: DDP must allow unused parameters.
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )
    model = tiny_qwen3_vl()
    if args.checkpointing:
        # transformers' current name; releases before it call it gradient_checkpointing_enable
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable()
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loader = torch.utils.data.DataLoader(
        range(args.steps * args.batch_size * accelerator.num_processes),
        batch_size=args.batch_size,
        collate_fn=collate,
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    # accelerate already wraps forward in autocast for bf16/fp16; GradCache needs the fp16 scaler only.
    cache = GradCache(
        model, info_nce, args.chunk_size, scaler=accelerator.scaler, cross_rank=accelerator.num_processes > 1
    )
    for step, (queries, docs) in enumerate(loader):
        loss = cache.step(queries, docs)  # fills .grad with the gradient of the whole (global) batch
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(
            f"step {step}: loss {loss.item():.4f} over {len(queries['input_ids']) * accelerator.num_processes} pairs"
        )


if __name__ == "__main__":
    main()
