"""LoRA fine-tuning of a stock diffusers transformer with sequence parallelism, in a DreamBooth-LoRA-style loop.

The structure of diffusers' ``train_dreambooth_lora_*.py`` (Accelerator, ``add_adapter(LoraConfig)``,
``accelerator.prepare``, flow-matching loss, ``save_state``/``load_state`` checkpoints, validation on the
main process), on the tiny random-weight Wan transformer from ``hfpatch.testing`` so it runs on CPU in
seconds. The hfpatch lines are marked ``# hfpatch``; without them (``--no-hfpatch``) this is the plain
script, which the tests run on one process as the reference.

    # 2 CPU processes, one sequence-parallel group (on GPUs: torchrun / accelerate launch without the CPU flag)
    torchrun --nproc-per-node 2 examples/integrations/lora_sp_accelerate.py --steps 4 --checkpoint-at 2
    torchrun --nproc-per-node 2 examples/integrations/lora_sp_accelerate.py --steps 4 --resume
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \\
        examples/integrations/lora_sp_accelerate.py --steps 4
    python examples/integrations/lora_sp_accelerate.py --no-hfpatch --steps 4   # the unpatched reference

Per step the main process records the loss (the mean over data replicas), and at the end the LoRA weights
and a validation loss, in ``<output-dir>/<results-file>`` (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

import hfpatch  # hfpatch
from hfpatch.distributed.data import data_parallel_sampler, step_generator  # hfpatch
from hfpatch.distributed.gradients import register_ddp_hook  # hfpatch
from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds

LATENT_SHAPE = (4, 1, 8, 8)  # channels, frames, height, width: 16 tokens after the 1x2x2 patch embedding


class InstanceDataset(torch.utils.data.Dataset):
    """Fixed (latents, prompt embeddings) pairs: stands in for VAE-encoded instance images and their prompt."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        latents = torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(1000 + i))
        return latents, wan_prompt_embeds(1, 6, seed=2000 + i)[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="total optimizer steps")
    parser.add_argument("--batch-size", type=int, default=2, help="per data-parallel replica")
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank")
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "sgd"],
        help="sgd for comparisons: AdamW's first steps are ~lr*sign(grad), so rounding noise on tiny "
        "gradients becomes lr-sized weight differences",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="lora-sp-output")
    parser.add_argument("--results-file", default="results.json")
    parser.add_argument("--checkpoint-at", type=int, default=0, help="accelerator.save_state after this step")
    parser.add_argument(
        "--stop-after-checkpoint", action="store_true", help="exit after saving (then --resume)"
    )
    parser.add_argument("--resume", action="store_true", help="load_state from the latest checkpoint")
    parser.add_argument("--no-hfpatch", action="store_true", help="the plain script (the reference)")
    return parser.parse_args(argv)


def latest_checkpoint(output_dir: str) -> tuple[str, int] | None:
    """``(path, step)`` of the newest ``checkpoint-<step>`` folder (DreamBooth's naming), or None."""
    steps = [int(d.split("-")[1]) for d in os.listdir(output_dir) if d.startswith("checkpoint-")]
    if not steps:
        return None
    return os.path.join(output_dir, f"checkpoint-{max(steps)}"), max(steps)


def flow_matching_loss(
    model: torch.nn.Module, latents: torch.Tensor, prompt_embeds: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Rectified-flow loss: predict ``noise - latents`` at a random point between them (SD3/Flux/Wan)."""
    # Drawn in fp32 whatever the model dtype: an fp64 twin run then draws the same values.
    noise = torch.randn(latents.shape, generator=generator).to(latents.dtype)
    sigmas = torch.rand(latents.shape[0], generator=generator).to(latents.dtype)
    sigma = sigmas.view(-1, *([1] * (latents.ndim - 1)))
    noisy = (1 - sigma) * latents + sigma * noise
    pred = model(
        hidden_states=noisy, timestep=sigmas * 1000, encoder_hidden_states=prompt_embeds, return_dict=False
    )[0]
    return ((pred - (noise - latents)) ** 2).flatten(1).mean(1).mean()


def lora_weights(model: torch.nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().double().flatten().tolist() for k, v in get_peft_model_state_dict(model).items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    accelerator = Accelerator()
    os.makedirs(args.output_dir, exist_ok=True)

    transformer = tiny_wan_transformer()
    transformer.requires_grad_(False)
    torch.manual_seed(args.seed)  # the LoRA init draws from the global RNG: the same on every process
    transformer.add_adapter(
        LoraConfig(
            r=args.rank,
            lora_alpha=args.rank,
            init_lora_weights="gaussian",
            target_modules=["to_k", "to_q", "to_v", "to_out.0"],
        )
    )
    if dtype != torch.float32:  # the fp64 twin (tests: rounding noise) casts the same fp32 weights
        transformer = transformer.to(dtype)
    lora_init = lora_weights(transformer)
    patch = None
    if not args.no_hfpatch:
        patch = hfpatch.apply(transformer, parallel=accelerator.num_processes)  # hfpatch

    dataset = InstanceDataset(args.num_samples)
    # One shard per data replica; the ranks of a sequence-parallel group load the same batch. Not passed to
    # accelerator.prepare, which would shard it again over every process.
    sampler = data_parallel_sampler(dataset, patch, seed=args.seed)  # hfpatch
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    params = [p for p in transformer.parameters() if p.requires_grad]
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=args.lr)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.lr)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    transformer = register_ddp_hook(transformer)  # hfpatch: DDP sums sp shares, averages replicas

    first_step = 0
    if args.resume:
        found = latest_checkpoint(args.output_dir)
        if found is None:
            raise SystemExit(f"--resume: no checkpoint-<step> folder in {args.output_dir}")
        path, first_step = found
        accelerator.load_state(path)  # LoRA + optimizer + per-process RNG states

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from loader

    losses: dict[int, float] = {}
    # A resumed run skips the batches already trained on (what accelerator.skip_first_batches does).
    stream = itertools.islice(batches(), first_step, None)
    transformer.train()
    for step in range(first_step, args.steps):
        latents, prompt_embeds = (t.to(accelerator.device, dtype) for t in next(stream))
        # Noise and timesteps from (seed, step, data replica): the same on every rank of a group, and the
        # same after a resume, whatever RNG state load_state restored.
        generator = step_generator(args.seed, step, patch)  # hfpatch
        loss = flow_matching_loss(transformer, latents, prompt_embeds, generator)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = accelerator.reduce(loss.detach(), "mean").item()  # sp ranks hold equal losses
        accelerator.print(f"step {step}: loss {losses[step]:.6f}")
        if args.checkpoint_at and step + 1 == args.checkpoint_at:
            accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{step + 1}"))
            if args.stop_after_checkpoint:
                break

    results: dict[str, Any] = {"losses": losses, "world": accelerator.num_processes}
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(transformer)
        # Validation on the main process only: unpatched, so it needs no other rank.
        with patch.disabled() if patch is not None else contextlib.nullcontext(), torch.no_grad():  # hfpatch
            latents, prompt_embeds = (t[None].to(accelerator.device, dtype) for t in dataset[0])
            val = flow_matching_loss(model, latents, prompt_embeds, torch.Generator().manual_seed(123))
        results.update(
            plan=None if patch is None else repr(patch.plan),
            validation_loss=val.item(),
            lora_init=lora_init,
            lora_final=lora_weights(model),
        )
        with open(os.path.join(args.output_dir, args.results_file), "w") as f:
            json.dump(results, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


if __name__ == "__main__":
    main()
