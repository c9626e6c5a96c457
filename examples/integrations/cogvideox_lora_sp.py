"""diffusers' CogVideoX LoRA script with sequence parallelism: the recipe where the script encodes its videos first.

The structure of diffusers' ``examples/cogvideo/train_cogvideox_lora.py``, on tiny random-weight parts (a stock
``CogVideoXTransformer3DModel`` in the 5B layout, ``AutoencoderKLCogVideoX``, a T5 encoder and
``CogVideoXDPMScheduler``) so it runs on CPU in seconds:

* the VAE encodes every video ONCE before training, each process the videos ``i`` with ``i %
  accelerator.num_processes == accelerator.process_index``, and the latent distributions are broadcast;
* ``collate_fn`` samples each posterior (``latent_dist.sample() * scaling_factor``);
* the script computes the 3D rotary table and passes it as ``image_rotary_emb``; the loss is the v-prediction of
  ``scheduler.get_velocity`` against the latents, weighted by ``1 / (1 - alphas_cumprod[t])``;
* ``accelerator.accumulate([transformer])``, gradient clipping, a learning-rate schedule sized with
  ``accelerator.num_processes``, ``save_state`` on the main process every ``--checkpointing-steps`` (LoRA weights
  through the script's save/load hooks and ``CogVideoXPipeline.save_lora_weights``), a resume from a named
  checkpoint that restarts that checkpoint's epoch, and validation with a ``CogVideoXPipeline`` on the main
  process at the end of every epoch.

The hfpatch lines are marked ``# hfpatch``. Two differ from the DreamBooth recipe (README):

* ``hfpatch.apply`` and ``hfpatch.prepare_accelerator`` go AFTER the encoding block (still before
  ``get_scheduler`` and ``accelerator.prepare``). Until ``prepare``, ``prepare_accelerator`` makes
  ``accelerator.num_processes`` count data replicas (the scheduler's sizing means that) while
  ``process_index`` stays the global rank: the encoding block split by both would give rank 1 of a one-replica
  world no video and no broadcast.
* The posterior sample moves from ``collate_fn`` into the ``with ..., rng`` block: ``collate_fn`` runs when the
  prepared loader fetches a batch, one batch ahead of the training step, outside the block, so it would draw
  from each rank's global RNG (different samples on the ranks of a sequence-parallel group).

Modes: the default runs the script patched; ``--stock`` is the stock script (no hfpatch line, the sample in
``collate_fn``, every draw from the global RNG); ``--unpatched`` keeps the draws of ``StepRNG`` without the
patch (the one-process reference the tests compare with).

    # 2 CPU processes, one sequence-parallel group (on GPUs drop ACCELERATE_USE_CPU)
    export ACCELERATE_USE_CPU=true
    torchrun --nproc-per-node 2 examples/integrations/cogvideox_lora_sp.py --epochs 3 --checkpointing-steps 2
    torchrun --nproc-per-node 2 examples/integrations/cogvideox_lora_sp.py --epochs 3 \\
        --resume-from-checkpoint checkpoint-2 --results-file resumed.json
    python examples/integrations/cogvideox_lora_sp.py --stock        # the stock script, one process

The main process writes the per-step losses, the LoRA weights (initial, and final as saved by
``save_lora_weights``) and each epoch's validation video in ``<output-dir>/<results-file>`` (JSON); every
process writes what each of its micro-steps loaded and drew to ``<output-dir>/<results-file>.rank<N>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from diffusers import CogVideoXDPMScheduler, CogVideoXPipeline
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.optimization import get_scheduler
from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid
from diffusers.utils import convert_unet_state_dict_to_peft
from peft import LoraConfig, set_peft_model_state_dict
from peft.utils import get_peft_model_state_dict

import hfpatch  # hfpatch
from hfpatch.testing import tiny_cogvideox_transformer, tiny_model, tiny_t5_encoder, tiny_t5_tokenizer

# frames, channels, height, width of each training video: the tiny VAE compresses 2x in time and space, so
# 3 x 8 x 12 latents, 3 x 4 x 6 = 72 video tokens after the 2x2 patches (the pipeline wants sizes divisible by 8)
VIDEO_SHAPE = (5, 3, 16, 24)
PROMPTS = ["sks dog runs", "sks dog sits", "sks dog jumps", "sks dog sleeps", "sks dog swims", "sks dog eats"]
TEXT_LENGTH = (
    16  # text tokens (one per letter with the tiny tokenizer): the transformer's max_text_seq_length
)


class VideoDataset(torch.utils.data.Dataset):
    """Fixed (video, prompt) pairs, as the script's ``VideoDataset`` holds them: ``instance_videos`` (``[F, C,
    H, W]`` in [-1, 1]) that the encoding block replaces with their latent distributions."""

    def __init__(self, size: int) -> None:
        self.instance_prompts = [PROMPTS[i % len(PROMPTS)] for i in range(size)]
        self.instance_videos = [
            torch.rand(VIDEO_SHAPE, generator=torch.Generator().manual_seed(1000 + i)) * 2 - 1
            for i in range(size)
        ]

    def __len__(self) -> int:
        return len(self.instance_videos)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"instance_prompt": self.instance_prompts[i], "instance_video": self.instance_videos[i]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="num_train_epochs")
    parser.add_argument("--grad-accum", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--batch-size", type=int, default=1, help="train_batch_size")
    parser.add_argument("--num-samples", type=int, default=3, help="videos in the dataset")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank (lora_alpha equals it)")
    parser.add_argument("--lr-scheduler", default="constant", help="diffusers' get_scheduler name")
    parser.add_argument("--lr-warmup-steps", type=int, default=0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "sgd"],
        help="sgd for comparisons: AdamW's first steps are ~lr*sign(grad), so rounding noise on tiny "
        "gradients becomes lr-sized weight differences",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float64"], help="float64: the tests' twin"
    )
    parser.add_argument("--seed", type=int, default=42, help="also the validation generator's (when not 0)")
    parser.add_argument("--ulysses", type=int, default=0, help="sp degree (default: every process)")
    parser.add_argument("--validation-epochs", type=int, default=1, help="validate after every N epochs")
    parser.add_argument("--validation-steps", type=int, default=2, help="the validation pipeline's steps")
    parser.add_argument(
        "--checkpointing-steps", type=int, default=0, help="save_state every N optimizer steps"
    )
    parser.add_argument(
        "--resume-from-checkpoint",
        default=None,
        help="a checkpoint-<step> folder name in --output-dir, or latest",
    )
    parser.add_argument(
        "--output-dir",
        default=os.path.join(tempfile.gettempdir(), "hfpatch-cogvideox-lora-output"),
        help="results, checkpoints and LoRA weights (default: in the temporary folder)",
    )
    parser.add_argument("--results-file", default="results.json")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stock", action="store_true", help="no hfpatch line: the stock script")
    mode.add_argument(
        "--unpatched", action="store_true", help="StepRNG's draws without the patch (the tests' reference)"
    )
    return parser.parse_args(argv)


def prepare_rotary_positional_embeddings(
    height: int,
    width: int,
    num_frames: int,
    vae_scale_factor_spatial: int,
    patch_size: int,
    attention_head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 3D rotary table of the latents, as the script computes it (its base size: 480 x 720 pixels)."""
    grid_height = height // (vae_scale_factor_spatial * patch_size)
    grid_width = width // (vae_scale_factor_spatial * patch_size)
    base_width = 720 // (vae_scale_factor_spatial * patch_size)
    base_height = 480 // (vae_scale_factor_spatial * patch_size)
    crops = get_resize_crop_region_for_grid((grid_height, grid_width), base_width, base_height)
    return get_3d_rotary_pos_embed(
        embed_dim=attention_head_dim,
        crops_coords=crops,
        grid_size=(grid_height, grid_width),
        temporal_size=num_frames,
    )


def prompt_embeddings(tokenizer: Any, text_encoder: torch.nn.Module, prompts: list[str]) -> torch.Tensor:
    ids = tokenizer(
        prompts, padding="max_length", max_length=TEXT_LENGTH, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        return text_encoder(ids.input_ids)[0]


def fingerprint(tensor: torch.Tensor) -> list[float]:
    return tensor.flatten()[:3].tolist()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    patched = not (args.stock or args.unpatched)
    sample_in_loop = not args.stock  # hfpatch: the posterior sample inside `with rng` (module docstring)
    kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, kwargs_handlers=[kwargs])
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    tokenizer = tiny_t5_tokenizer(model_max_length=TEXT_LENGTH)
    text_encoder, transformer = tiny_t5_encoder(), tiny_cogvideox_transformer(max_text_seq_length=TEXT_LENGTH)
    vae = tiny_model("cogvideox_vae")
    scheduler = CogVideoXDPMScheduler(  # CogVideoX-5b's scheduler config
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        timestep_spacing="trailing",
    )
    for model in (text_encoder, transformer, vae):
        model.requires_grad_(False)
    transformer.add_adapter(
        LoraConfig(
            r=args.rank,
            lora_alpha=args.rank,
            init_lora_weights=True,
            target_modules=["to_k", "to_q", "to_v", "to_out.0"],
        )
    )
    dtype = getattr(torch, args.dtype)
    if (
        dtype != torch.float32
    ):  # the fp64 twin (tests: rounding noise) casts the same fp32 weights, LoRA included
        transformer.to(dtype)
    lora_init = {"transformer": lora_weights(transformer)}

    def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
        return accelerator.unwrap_model(model)

    transformer_class = type(transformer)

    def save_model_hook(models: list, weights: list, output_dir: str) -> None:
        if accelerator.is_main_process:
            layers = None
            for model in models:
                if not isinstance(model, transformer_class):
                    raise ValueError(f"unexpected save model: {model.__class__}")
                layers = get_peft_model_state_dict(model)
                weights.pop()  # the model's own weights are not saved again
            CogVideoXPipeline.save_lora_weights(output_dir, transformer_lora_layers=layers)

    def load_model_hook(models: list, input_dir: str) -> None:
        transformer_ = models.pop()
        state = CogVideoXPipeline.lora_state_dict(input_dir)
        state = {k.replace("transformer.", ""): v for k, v in state.items() if k.startswith("transformer.")}
        set_peft_model_state_dict(
            transformer_, convert_unet_state_dict_to_peft(state), adapter_name="default"
        )

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = (torch.optim.SGD if args.optimizer == "sgd" else torch.optim.AdamW)(params, lr=args.lr)
    train_dataset = VideoDataset(args.num_samples)

    def encode_video(video: torch.Tensor) -> DiagonalGaussianDistribution:
        video = (
            video.to(accelerator.device, dtype=vae.dtype).unsqueeze(0).permute(0, 2, 1, 3, 4)
        )  # [B, C, F, H, W]
        return vae.encode(video).latent_dist

    # Each process encodes its share of the videos; the latent distributions are then broadcast to all.
    num_videos, num_procs = len(train_dataset.instance_videos), accelerator.num_processes
    encoded = [
        encode_video(video) if i % num_procs == accelerator.process_index else None
        for i, video in enumerate(train_dataset.instance_videos)
    ]
    if num_procs > 1:
        reference = next(v for v in encoded if v is not None).parameters
        for i in range(num_videos):
            params_i = (
                encoded[i].parameters.contiguous() if encoded[i] is not None else torch.empty_like(reference)
            )
            dist.broadcast(params_i, src=i % num_procs)
            encoded[i] = DiagonalGaussianDistribution(params_i)
    train_dataset.instance_videos = encoded

    patch = None
    if patched:  # hfpatch: after the encoding block, which splits the videos by process (module docstring)
        ulysses = args.ulysses or accelerator.num_processes
        parallel = hfpatch.ParallelConfig(data=accelerator.num_processes // ulysses, ulysses=ulysses)
        patch = hfpatch.apply(transformer, parallel=parallel)  # hfpatch
        rng = hfpatch.prepare_accelerator(accelerator, patch, seed=args.seed)  # hfpatch
    elif args.unpatched:
        rng = hfpatch.StepRNG(args.seed)  # the reference: the draws of data replica 0
    else:
        rng = contextlib.nullcontext()  # the stock script draws from the global RNG

    scaling_factor = vae.config.scaling_factor

    def collate_fn(examples: list[dict[str, Any]]) -> dict[str, Any]:
        if sample_in_loop:  # hfpatch: the distributions' parameters; sampled in the training step
            latents = torch.cat([example["instance_video"].parameters for example in examples])
        else:
            latents = torch.cat([example["instance_video"].sample() * scaling_factor for example in examples])
        return {"videos": latents, "prompts": [example["instance_prompt"] for example in examples]}

    train_dataloader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=True, collate_fn=collate_fn
    )
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.grad_accum)
    max_train_steps = args.epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )
    transformer, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        transformer, optimizer, train_dataloader, lr_scheduler
    )
    text_encoder.to(accelerator.device)
    vae.to(accelerator.device)
    # The step arithmetic again on the prepared loader (its length per data replica), as the script does.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.grad_accum)
    max_train_steps = args.epochs * num_update_steps_per_epoch

    global_step, first_epoch = 0, 0
    if args.resume_from_checkpoint:
        path = args.resume_from_checkpoint
        if path == "latest":
            found = sorted(
                (d for d in os.listdir(args.output_dir) if d.startswith("checkpoint")),
                key=lambda d: int(d.split("-")[1]),
            )
            path = found[-1]
        accelerator.load_state(os.path.join(args.output_dir, path))
        global_step = int(path.split("-")[1])
        first_epoch = (
            global_step // num_update_steps_per_epoch
        )  # the script restarts this epoch from its start

    config = unwrap_model(transformer).config
    vae_scale_factor_spatial = 2 ** (len(vae.config.block_out_channels) - 1)
    losses: dict[int, float] = {}
    validations: dict[int, list[float]] = {}
    trace: list[dict[str, Any]] = []  # per micro-step: what this process loaded and drew
    step_losses: list[float] = []
    optimizer_steps = 0
    for epoch in range(first_epoch, args.epochs):
        transformer.train()
        for batch in train_dataloader:
            with accelerator.accumulate([transformer]), rng:  # hfpatch: `, rng`
                if sample_in_loop:  # hfpatch: moved from collate_fn
                    model_input = DiagonalGaussianDistribution(batch["videos"]).sample() * scaling_factor
                else:
                    model_input = batch["videos"]
                model_input = model_input.permute(0, 2, 1, 3, 4)  # [B, F, C, H, W]
                prompt_embeds = prompt_embeddings(tokenizer, text_encoder, batch["prompts"]).to(dtype)
                # Drawn in fp32 whatever the model dtype: the fp64 twin draws the same values.
                noise = torch.randn_like(model_input)
                batch_size, num_frames, _, height, width = model_input.shape
                timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (batch_size,)).long()
                draws = [fingerprint(model_input), fingerprint(noise), timesteps.tolist()]
                model_input, noise = model_input.to(dtype), noise.to(dtype)
                image_rotary_emb = prepare_rotary_positional_embeddings(
                    height * vae_scale_factor_spatial,
                    width * vae_scale_factor_spatial,
                    num_frames,
                    vae_scale_factor_spatial,
                    config.patch_size,
                    config.attention_head_dim,
                )
                noisy_model_input = scheduler.add_noise(model_input, noise, timesteps)
                model_output = transformer(
                    hidden_states=noisy_model_input,
                    encoder_hidden_states=prompt_embeds,
                    timestep=timesteps,
                    image_rotary_emb=image_rotary_emb,
                    return_dict=False,
                )[0]
                model_pred = scheduler.get_velocity(model_output, noisy_model_input, timesteps)
                weights = 1 / (1 - scheduler.alphas_cumprod[timesteps])
                while weights.ndim < model_pred.ndim:
                    weights = weights.unsqueeze(-1)
                loss = torch.mean(
                    (weights * (model_pred - model_input) ** 2).reshape(batch_size, -1), dim=1
                ).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(transformer.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
                lr_scheduler.step()
            trace.append({"epoch": epoch, "step": global_step, "samples": batch["prompts"], "draws": [draws]})
            step_losses.append(accelerator.reduce(loss.detach(), "mean").item())  # sp ranks: equal losses
            if not accelerator.sync_gradients:
                continue
            global_step += 1
            optimizer_steps += 1
            losses[global_step] = sum(step_losses) / len(step_losses)
            step_losses = []
            accelerator.print(f"epoch {epoch} step {global_step}: loss {losses[global_step]:.6f}")
            if (
                accelerator.is_main_process
                and args.checkpointing_steps
                and global_step % args.checkpointing_steps == 0
            ):
                accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))
            if global_step >= max_train_steps:
                break
        if accelerator.is_main_process and (epoch + 1) % args.validation_epochs == 0:
            unpatched = patch.disabled() if patch is not None else contextlib.nullcontext()  # hfpatch
            with unpatched:
                validations[epoch] = validate(
                    args, accelerator, tokenizer, text_encoder, vae, transformer, scheduler
                )

    accelerator.wait_for_everyone()
    results: dict[str, Any] = {
        "losses": losses,
        "world": accelerator.num_processes,
        "optimizer_steps": optimizer_steps,
        "batches_per_epoch": len(train_dataloader),
    }
    with open(
        os.path.join(args.output_dir, f"{args.results_file}.rank{accelerator.process_index}.json"), "w"
    ) as f:
        json.dump({"trace": trace, "data_rank": patch.data_rank if patch else 0}, f)
    if accelerator.is_main_process:
        CogVideoXPipeline.save_lora_weights(
            args.output_dir, transformer_lora_layers=get_peft_model_state_dict(unwrap_model(transformer))
        )
        saved = CogVideoXPipeline.lora_state_dict(args.output_dir)  # what a user loads back
        final = {k.replace("transformer.", ""): v for k, v in saved.items()}
        results.update(
            plan=None if patch is None else repr(patch.plan),
            validations=validations,
            lora_init=lora_init,
            lora_final={
                "transformer": lora_weights(unwrap_model(transformer), convert_unet_state_dict_to_peft(final))
            },
        )
        with open(os.path.join(args.output_dir, args.results_file), "w") as f:
            json.dump(results, f)
    del transformer
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


def lora_weights(model: torch.nn.Module, state_dict: dict | None = None) -> dict[str, list[float]]:
    weights = get_peft_model_state_dict(model, state_dict=state_dict)
    return {k: v.detach().double().flatten().tolist() for k, v in weights.items()}


def validate(
    args: argparse.Namespace,
    accelerator: Accelerator,
    tokenizer: Any,
    text_encoder: torch.nn.Module,
    vae: torch.nn.Module,
    transformer: torch.nn.Module,
    scheduler: CogVideoXDPMScheduler,
) -> list[float]:
    """The script's validation: a ``CogVideoXPipeline`` of the trained transformer on the main process, with
    classifier-free guidance and its generator seeded by ``--seed`` (none when 0: the global RNG). Returns the
    final latents' first values, mean and mean magnitude."""
    transformer = accelerator.unwrap_model(transformer)
    if transformer.dtype != torch.float32:  # the fp64 twin validates its weights in fp32 too: the same draws
        transformer = copy.deepcopy(transformer).float()
    pipe = CogVideoXPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    generator = torch.Generator(device=accelerator.device).manual_seed(args.seed) if args.seed else None
    frames, _, height, width = VIDEO_SHAPE
    with torch.no_grad():
        video = pipe(
            prompt=PROMPTS[0],
            guidance_scale=6.0,
            use_dynamic_cfg=True,
            height=height,
            width=width,
            num_frames=frames,
            num_inference_steps=args.validation_steps,
            max_sequence_length=TEXT_LENGTH,
            generator=generator,
            output_type="latent",  # the tiny random VAE's decoded frames saturate: compare the latents
        ).frames
    return [*fingerprint(video.double()), video.double().mean().item(), video.double().abs().mean().item()]


if __name__ == "__main__":
    main()
