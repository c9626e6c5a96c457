"""LoRA fine-tuning of a stock diffusers transformer with sequence parallelism, in a DreamBooth-LoRA-style loop.

The structure of diffusers' ``train_dreambooth_lora_*.py``: an Accelerator with gradient accumulation
(``accelerator.accumulate`` given a LIST of models, as diffusers' scripts do), a shuffled ``DataLoader``
passed to ``accelerator.prepare`` with the models, ``num_update_steps_per_epoch = ceil(len(loader) /
accumulation)``, epochs, the VAE encoding pixels with a posterior SAMPLE, a text encoder (optionally trained
with its own LoRA, ``--train-text-encoder``), ``add_adapter(LoraConfig)``, the flow-matching loss, gradient
clipping, ``save_state``/``load_state`` checkpoints (a resume in the middle of an epoch skips the batches
already trained with ``accelerator.skip_first_batches``), and validation on the main process. Tiny
random-weight Wan transformer, Wan VAE and T5 encoder from ``hfpatch.testing``, so it runs on CPU in
seconds.

The hfpatch lines are marked ``# hfpatch``: ``import hfpatch``, ``hfpatch.apply`` before ``prepare``,
``hfpatch.prepare_accelerator`` (the prepared loader shards over data replicas, its order checkpointed; it
returns a ``StepRNG``, a checkpointed counter of micro-steps) and the ``with rng`` around each micro-step's
draws, plus ``patch.disabled()`` for validation on the main process. Without them (``--stock``) this is the
stock script, drawing from the global RNG; ``--unpatched`` keeps the draws of ``StepRNG`` but not the patch
(the one-process reference the tests compare with, ``--replicas`` emulating data replicas).

    # 2 CPU processes, one sequence-parallel group. On CPU, accelerate joins the processes only with
    # ACCELERATE_USE_CPU=true (without it each one trains alone, and hfpatch.apply refuses); on GPUs drop it.
    export ACCELERATE_USE_CPU=true
    torchrun --nproc-per-node 2 examples/integrations/lora_sp_accelerate.py --epochs 3 --checkpoint-at 3
    torchrun --nproc-per-node 2 examples/integrations/lora_sp_accelerate.py --epochs 3 --resume
    accelerate launch --multi_gpu --num_processes 2 \\
        examples/integrations/lora_sp_accelerate.py --grad-accum 2 --train-text-encoder
    # 4 processes: 2 data replicas x Ulysses 2
    torchrun --nproc-per-node 4 examples/integrations/lora_sp_accelerate.py --ulysses 2
    python examples/integrations/lora_sp_accelerate.py --stock      # the stock script, one process
    # accelerate's FSDP2 (GPUs; it prepares one model, so no --train-text-encoder): the same script
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP \\
        --fsdp_cpu_ram_efficient_loading false examples/integrations/lora_sp_accelerate.py --checkpoint-at 3

Under FSDP2 (``accelerator.is_fsdp2``) the weights are sharded: validation runs on every rank (patched), the
LoRA weights are gathered with ``accelerator.get_state_dict``, and ``accelerator.accumulate`` gets the models
rather than a list (accelerate's FSDP2 ``no_sync`` needs them). On CPU, accelerate never selects FSDP;
``tests/integration/accelerate_fsdp2_cpu.py`` runs this script under it there (see its docstring).

Per optimizer step the main process records the loss (the mean over data replicas and micro-steps), and at
the end the LoRA weights and a validation loss, in ``<output-dir>/<results-file>`` (JSON); every process
writes what each of its micro-steps loaded and drew to ``<output-dir>/<results-file>.rank<N>.json``.
``--output-dir`` defaults to ``hfpatch-lora-sp-output`` in the system's temporary folder (checkpoints go there too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from diffusers.optimization import get_scheduler
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict

import hfpatch  # hfpatch
from hfpatch.testing import tiny_t5_encoder, tiny_t5_tokenizer, tiny_wan_transformer, tiny_wan_vae

PIXEL_SHAPE = (
    3,
    1,
    64,
    64,
)  # channels, frames, height, width: 8x8 latents, 16 tokens after the 1x2x2 patches
PROMPTS = ["a sks dog", "a sks dog on grass", "sks dog", "a photo of sks dog"]


class InstanceDataset(torch.utils.data.Dataset):
    """Fixed (pixels, prompt token ids) pairs: stands in for DreamBooth's instance images and prompt."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.tokenizer = tiny_t5_tokenizer(model_max_length=8)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        pixels = torch.rand(PIXEL_SHAPE, generator=torch.Generator().manual_seed(1000 + i)) * 2 - 1
        ids = self.tokenizer(PROMPTS[i % len(PROMPTS)], padding="max_length", max_length=8, truncation=True)
        return {"pixels": pixels, "input_ids": torch.tensor(ids.input_ids), "index": i}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="num_train_epochs")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-steps per optimizer step")
    parser.add_argument("--batch-size", type=int, default=1, help="per data-parallel replica and micro-step")
    parser.add_argument("--num-samples", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank")
    parser.add_argument(
        "--lr-scheduler",
        default="none",
        help="diffusers' get_scheduler name (linear, cosine, ...), sized as train_dreambooth_lora_flux.py sizes it",
    )
    parser.add_argument("--lr-warmup-steps", type=int, default=0)
    parser.add_argument(
        "--max-train-steps", type=int, default=None, help="default: the epochs' optimizer steps"
    )
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="accelerator.clip_grad_norm_")
    parser.add_argument("--train-text-encoder", action="store_true", help="a LoRA on the text encoder too")
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "sgd"],
        help="sgd for comparisons: AdamW's first steps are ~lr*sign(grad), so rounding noise on tiny "
        "gradients becomes lr-sized weight differences",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ulysses", type=int, default=0, help="sp degree (default: every process)")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="with --unpatched on one process: train on the global batch of this many data replicas, each "
        "replica's samples and random draws as its own process would make them (the reference of a run "
        "with data replicas)",
    )
    parser.add_argument("--validate-every", type=int, default=0, help="validation on the main process")
    parser.add_argument(
        "--output-dir",
        default=os.path.join(tempfile.gettempdir(), "hfpatch-lora-sp-output"),
        help="results and checkpoints (default: hfpatch-lora-sp-output in the temporary folder)",
    )
    parser.add_argument("--results-file", default="results.json")
    parser.add_argument("--checkpoint-at", type=int, default=0, help="accelerator.save_state after this step")
    parser.add_argument(
        "--stop-after-checkpoint", action="store_true", help="exit after saving (then --resume)"
    )
    parser.add_argument("--resume", action="store_true", help="load_state from the latest checkpoint")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stock", action="store_true", help="no hfpatch line: the stock script")
    mode.add_argument(
        "--unpatched", action="store_true", help="StepRNG's draws without the patch (the tests' reference)"
    )
    return parser.parse_args(argv)


def latest_checkpoint(output_dir: str) -> tuple[str, int] | None:
    """``(path, step)`` of the newest ``checkpoint-<step>`` folder (DreamBooth's naming), or None."""
    steps = [int(d.split("-")[1]) for d in os.listdir(output_dir) if d.startswith("checkpoint-")]
    if not steps:
        return None
    return os.path.join(output_dir, f"checkpoint-{max(steps)}"), max(steps)


def flow_matching_loss(
    transformer: torch.nn.Module,
    text_encoder: torch.nn.Module,
    vae: torch.nn.Module,
    pixels: torch.Tensor,
    input_ids: torch.Tensor,
    draws: list | None = None,
) -> torch.Tensor:
    """Rectified-flow loss: predict ``noise - latents`` at a random point between them (SD3/Flux/Wan).

    Draws from the global RNGs, on the device of the tensors (no generator), as diffusers' scripts do: the
    caller decides what seeds them (``with rng:`` in the training loop). ``draws`` collects a fingerprint of
    the VAE sample, the noise and the sigmas.
    """
    dtype = next(transformer.parameters()).dtype
    with torch.no_grad():  # the VAE stays in fp32 (diffusers' scripts upcast it too)
        latents = vae.encode(pixels.float()).latent_dist.sample()  # a random draw: the posterior sample
    with contextlib.nullcontext() if text_encoder.training else torch.no_grad():
        prompt_embeds = text_encoder(input_ids)[0]
    # Drawn in fp32 whatever the model dtype: an fp64 twin run then draws the same values.
    noise = torch.randn_like(latents).to(dtype)
    sigmas = torch.rand(latents.shape[0], device=latents.device).to(dtype)
    if draws is not None:
        draws.append([latents.flatten()[:3].tolist(), noise.flatten()[:3].tolist(), sigmas.tolist()])
    latents = latents.to(dtype)
    sigma = sigmas.view(-1, *([1] * (latents.ndim - 1)))
    noisy = (1 - sigma) * latents + sigma * noise
    pred = transformer(
        hidden_states=noisy, timestep=sigmas * 1000, encoder_hidden_states=prompt_embeds, return_dict=False
    )[0]
    return ((pred - (noise - latents)) ** 2).flatten(1).mean(1).mean()


def training_step_loss(
    models: tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module],
    batch: dict[str, Any],
    args: argparse.Namespace,
    rngs: list[Any],
    device: torch.device,
    dtype: torch.dtype,
    draws: list | None = None,
) -> torch.Tensor:
    """The loss of one micro-step on this process's batch (``--replicas``: the mean over the replicas').

    ``rngs[r]`` holds replica ``r``'s draws (one ``hfpatch.StepRNG`` per replica; ``nullcontext`` in the
    stock script)."""
    pixels, input_ids = batch["pixels"].to(device), batch["input_ids"].to(device)  # prepared: no-ops
    size = len(pixels) // len(rngs)
    losses = []
    for replica, rng in enumerate(rngs):
        with rng:  # hfpatch: every random draw of the micro-step: per group, never twice, resumable
            part = slice(replica * size, (replica + 1) * size)  # accelerate gives replica r the r-th batch
            losses.append(flow_matching_loss(*models, pixels[part], input_ids[part], draws))
    return torch.stack(losses).mean()


def lora_weights(model: torch.nn.Module, state_dict: dict | None = None) -> dict[str, list[float]]:
    weights = get_peft_model_state_dict(model, state_dict=state_dict)
    return {k: v.detach().double().flatten().tolist() for k, v in weights.items()}


def build_models(args: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.nn.Module, ...]:
    transformer, vae, text_encoder = tiny_wan_transformer(), tiny_wan_vae("2.1"), tiny_t5_encoder()
    for model in (transformer, vae, text_encoder):
        model.requires_grad_(False)
    torch.manual_seed(args.seed)  # the LoRA init draws from the global RNG: the same on every process
    lora = dict(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian")
    transformer.add_adapter(LoraConfig(**lora, target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    if args.train_text_encoder:
        # diffusers calls text_encoder.add_adapter(...); transformers 5.24 wants peft >= 0.22 for that, which
        # is not released: peft's own injection is the same LoRA.
        inject_adapter_in_model(LoraConfig(**lora, target_modules=["q", "k", "v", "o"]), text_encoder)
    transformer.train()
    text_encoder.train(args.train_text_encoder)  # its forward keeps a graph only when it trains
    if dtype != torch.float32:  # the fp64 twin (tests: rounding noise) casts the same fp32 weights
        transformer, text_encoder = transformer.to(dtype), text_encoder.to(dtype)
    return transformer, text_encoder, vae


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    # As diffusers' DreamBooth scripts do. With it DDP also keeps its first bucket layout: a resumed process
    # then sums the ranks' gradients in the order of the uninterrupted one (DDP otherwise rebuilds its buckets
    # after each process's first backward; over 3+ ranks the order of a sum changes its rounding).
    ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, kwargs_handlers=[ddp_kwargs])
    if args.replicas > 1 and (not args.unpatched or accelerator.num_processes > 1):
        raise SystemExit("--replicas emulates data replicas in ONE unpatched process (--unpatched)")
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    transformer, text_encoder, vae = build_models(args, dtype)
    lora_init = {"transformer": lora_weights(transformer)}
    if args.train_text_encoder:
        lora_init["text_encoder"] = lora_weights(text_encoder)
    patched = not (args.stock or args.unpatched)
    patch = None
    if patched:
        world = accelerator.num_processes
        ulysses = args.ulysses or world
        parallel = hfpatch.ParallelConfig(data=world // ulysses, ulysses=ulysses)
        patch = hfpatch.apply(transformer, parallel=parallel)  # hfpatch: before accelerator.prepare
        # Loaders shard over data replicas (order checkpointed); the micro-steps' RNG, checkpointed too.
        rngs = [hfpatch.prepare_accelerator(accelerator, patch, seed=args.seed)]  # hfpatch
    elif args.unpatched:  # the reference: replica r's draws, as its own process makes them
        rngs = [hfpatch.StepRNG(args.seed, data_rank=r) for r in range(args.replicas)]
    else:
        rngs = [contextlib.nullcontext()]  # the stock script draws from the global RNG

    dataset = InstanceDataset(args.num_samples)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size * args.replicas, shuffle=True)
    if args.replicas > 1:
        # What accelerate does to a shuffled loader it shards over several processes: one generator, seeded
        # from the global RNG at prepare, shuffles every epoch.
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        loader.sampler.generator = torch.Generator().manual_seed(seed)
    trained = [transformer, text_encoder] if args.train_text_encoder else [transformer]
    params = [p for model in trained for p in model.parameters() if p.requires_grad]
    optimizer = (torch.optim.SGD if args.optimizer == "sgd" else torch.optim.AdamW)(params, lr=args.lr)
    lr_scheduler = None
    if args.lr_scheduler != "none":  # the lines of diffusers' train_dreambooth_lora_flux.py, unchanged
        num_warmup_steps_for_scheduler = args.lr_warmup_steps * accelerator.num_processes
        if args.max_train_steps is None:
            len_train_dataloader_after_sharding = math.ceil(len(loader) / accelerator.num_processes)
            num_update_steps_per_epoch = math.ceil(len_train_dataloader_after_sharding / args.grad_accum)
            num_training_steps_for_scheduler = (
                args.epochs * accelerator.num_processes * num_update_steps_per_epoch
            )
        else:
            num_training_steps_for_scheduler = args.max_train_steps * accelerator.num_processes
        lr_scheduler = get_scheduler(
            args.lr_scheduler,
            optimizer=optimizer,
            num_warmup_steps=num_warmup_steps_for_scheduler,
            num_training_steps=num_training_steps_for_scheduler,
        )
    scheduled = [] if lr_scheduler is None else [lr_scheduler]
    if args.train_text_encoder:
        transformer, text_encoder, optimizer, loader, *scheduled = accelerator.prepare(
            transformer, text_encoder, optimizer, loader, *scheduled
        )
    else:
        transformer, optimizer, loader, *scheduled = accelerator.prepare(
            transformer, optimizer, loader, *scheduled
        )
        text_encoder.to(accelerator.device)
    lr_scheduler = scheduled[0] if scheduled else None
    vae.to(accelerator.device)
    # No hfpatch line here: DDP's (or FSDP2's) gradient averaging is right for the patched transformer and
    # for the text encoder that feeds it, with accumulation syncing at every micro-step or not.
    # Under FSDP2 (`accelerate launch --use_fsdp --fsdp_version 2`) prepare replaced the parameters by
    # sharded ones: clip the model's parameters as they are now.
    params = [p for model in trained for p in accelerator.unwrap_model(model).parameters() if p.requires_grad]
    # FSDP2 shards the weights: every rank holds 1/N of them, so validation runs on every rank (patched: its
    # output is the unpatched one) instead of on the main process alone.
    sharded = accelerator.is_fsdp2

    # diffusers' step arithmetic, on the prepared loader (its length per data replica).
    num_update_steps_per_epoch = math.ceil(len(loader) / args.grad_accum)
    max_train_steps = args.max_train_steps or args.epochs * num_update_steps_per_epoch
    total_batch_size = args.batch_size * accelerator.num_processes * args.grad_accum  # as diffusers logs it
    accelerator.print(
        f"Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}"
    )
    global_step, first_epoch, skip = 0, 0, 0
    if args.resume:
        found = latest_checkpoint(args.output_dir)
        if found is None:
            raise SystemExit(f"--resume: no checkpoint-<step> folder in {args.output_dir}")
        path, global_step = found
        accelerator.load_state(path)  # LoRA, optimizer, RNG states, and what register_for_checkpointing holds
        first_epoch = global_step // num_update_steps_per_epoch
        skip = (global_step % num_update_steps_per_epoch) * args.grad_accum  # batches of that epoch trained

    models_to_accumulate = [transformer, text_encoder] if args.train_text_encoder else [transformer]
    models = (transformer, text_encoder, vae)
    losses: dict[int, float] = {}
    lrs: dict[int, float] = {}  # what diffusers' scripts log: lr_scheduler.get_last_lr()[0] after each step
    validations: dict[int, float] = {}
    trace: list[dict[str, Any]] = []  # per micro-step: what this process loaded and drew
    step_losses: list[float] = []
    optimizer_steps = 0
    done = False
    for epoch in range(first_epoch, args.epochs):
        epoch_loader = (
            accelerator.skip_first_batches(loader, skip) if epoch == first_epoch and skip else loader
        )
        for batch in epoch_loader:
            # A list, as diffusers' scripts pass it (DDP then syncs at every micro-step); accelerate's FSDP2
            # no_sync needs the models themselves.
            with accelerator.accumulate(*models_to_accumulate if sharded else [models_to_accumulate]):
                draws: list = []
                loss = training_step_loss(models, batch, args, rngs, accelerator.device, dtype, draws)
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()
                if lr_scheduler is not None:
                    lr_scheduler.step()
                optimizer.zero_grad()
            trace.append(
                {"epoch": epoch, "step": global_step, "samples": batch["index"].tolist(), "draws": draws}
            )
            step_losses.append(accelerator.reduce(loss.detach(), "mean").item())  # sp ranks: equal losses
            if not accelerator.sync_gradients:
                continue
            global_step += 1
            optimizer_steps += 1
            losses[global_step] = sum(step_losses) / len(step_losses)
            if lr_scheduler is not None:
                lrs[global_step] = lr_scheduler.get_last_lr()[0]
            step_losses = []
            accelerator.print(f"epoch {epoch} step {global_step}: loss {losses[global_step]:.6f}")
            if args.validate_every and global_step % args.validate_every == 0:
                if accelerator.is_main_process or sharded:
                    validations[global_step] = validate(accelerator, models, dataset, patch, None, sharded)
            if args.checkpoint_at and global_step == args.checkpoint_at:
                accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))
                done = args.stop_after_checkpoint
            if done or global_step >= max_train_steps:
                done = True
                break
        if done:
            break

    results: dict[str, Any] = {
        "losses": losses,
        "lrs": lrs,
        "world": accelerator.num_processes,
        "optimizer_steps": optimizer_steps,
        "num_update_steps_per_epoch": num_update_steps_per_epoch,
        "batches_per_epoch": len(loader),
    }
    # Full state dicts: under FSDP2 a gather over every rank (each holds shards), else the model's own.
    final_state = {"transformer": accelerator.get_state_dict(transformer, unwrap=True)}
    if args.train_text_encoder:
        final_state["text_encoder"] = accelerator.get_state_dict(text_encoder, unwrap=True)
    validation_loss = None
    if accelerator.is_main_process or sharded:
        validation_loss = validate(accelerator, models, dataset, patch, seed=123, sharded=sharded)
    with open(
        os.path.join(args.output_dir, f"{args.results_file}.rank{accelerator.process_index}.json"), "w"
    ) as f:
        json.dump({"trace": trace, "data_rank": patch.data_rank if patch else 0}, f)
    if accelerator.is_main_process:
        wrapped = {"transformer": transformer, "text_encoder": text_encoder}
        final = {k: lora_weights(accelerator.unwrap_model(wrapped[k]), sd) for k, sd in final_state.items()}
        results.update(
            plan=None if patch is None else repr(patch.plan),
            fsdp=sharded,
            validation_loss=validation_loss,
            mid_run_validations=validations,
            lora_init=lora_init,
            lora_final=final,
        )
        with open(os.path.join(args.output_dir, args.results_file), "w") as f:
            json.dump(results, f)
        del wrapped
    # The DDP-wrapped models go before the process group does: a DDP reducer that outlives destroy_process_group
    # (end_training) destroys the gloo group itself, holding the GIL, and can deadlock with gloo's worker thread
    # freeing a finished collective's tensors (seen once under heavy load; pytorch/pytorch#56297).
    del transformer, text_encoder, models, models_to_accumulate
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


def validate(
    accelerator: Accelerator,
    models: tuple[torch.nn.Module, ...],
    dataset: InstanceDataset,
    patch: hfpatch.Patch | None,
    seed: int | None,
    sharded: bool = False,
) -> float:
    """A validation loss on the main process only: unpatched, so it needs no other rank.

    ``seed=None`` draws from the global RNG, as diffusers' ``log_validation`` does without ``--seed`` (or
    with ``--seed 0``, which its ``if args.seed`` treats as none): only the main process's RNG moves (the
    next epoch's shuffle follows the main process, ``hfpatch.data_parallel_loaders``). ``sharded`` (FSDP2):
    every rank calls this and runs the patched models together (each holds 1/N of the weights).
    """
    transformer, text_encoder, vae = (accelerator.unwrap_model(m) for m in models)
    item = dataset[0]
    pixels, input_ids = (item[k][None].to(accelerator.device) for k in ("pixels", "input_ids"))
    modes = [m.training for m in (transformer, text_encoder)]
    for model in (transformer, text_encoder):
        model.eval()
    unpatched = patch.disabled() if patch is not None and not sharded else contextlib.nullcontext()  # hfpatch
    with unpatched, torch.no_grad():
        with torch.random.fork_rng() if seed is not None else contextlib.nullcontext():
            if seed is not None:
                torch.manual_seed(seed)
            loss = flow_matching_loss(transformer, text_encoder, vae, pixels, input_ids)
    for model, mode in zip((transformer, text_encoder), modes):
        model.train(mode)
    return loss.item()


if __name__ == "__main__":
    main()
