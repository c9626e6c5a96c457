"""Fine-tune a stock Qwen3-VL with the transformers ``Trainer``, LoRA and sequence parallelism.

One long multimodal sample per rank group: the token sequence after the vision merge is split over the
ranks (``hfpatch.apply(model, parallel=N)``), and every rank computes the unpatched model's loss. The
script is a plain ``Trainer`` fine-tune (peft LoRA on the language model's attention, SGD, gradient
accumulation); the hfpatch lines are marked ``# hfpatch``. Tiny random-weight model from ``hfpatch.testing``,
batches built by hand in the Qwen3-VL processor layout (images of several sizes, a video, text-only rows),
so it runs on CPU in seconds.

    torchrun --nproc-per-node 2 examples/integrations/trainer_sp_vlm.py --steps 3           # Ulysses 2
    torchrun --nproc-per-node 2 examples/integrations/trainer_sp_vlm.py --ring 2            # Ring 2
    torchrun --nproc-per-node 2 examples/integrations/trainer_sp_vlm.py --sp-output shard   # sharded loss
    python examples/integrations/trainer_sp_vlm.py --no-hfpatch --steps 3                    # the reference

On GPUs, launch the same way (or ``accelerate launch``); on CPU the launcher needs ``ACCELERATE_USE_CPU=true``
for accelerate to start gloo. The main process writes the logged loss of every step and the final LoRA
weights to ``<output-dir>/<results-file>`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments, set_seed

import hfpatch  # hfpatch
from hfpatch.testing import qwen3_vl_inputs, tiny_qwen3_vl

# Each sample's media: images of several sizes (two in one sample), a video, text only.
SAMPLES = [
    [("image", (1, 4, 4)), ("image", (1, 2, 4))],
    [("video", (2, 2, 2))],
    [],
    [("image", (1, 4, 2))],
    [("image", (1, 2, 2)), ("video", (2, 2, 4))],
    [("image", (1, 6, 4))],
]


class MediaDataset(torch.utils.data.Dataset):
    """Sample ``i``: its media and a seed for its text and pixels (the collator builds the tensors)."""

    def __len__(self) -> int:
        return len(SAMPLES)

    def __getitem__(self, i: int) -> dict:
        return {"media": SAMPLES[i], "seed": i}


def collate(dtype: torch.dtype):
    def build(rows: list[dict]) -> dict[str, torch.Tensor]:
        seed = sum(r["seed"] * 7**k for k, r in enumerate(rows))
        batch = qwen3_vl_inputs([r["media"] for r in rows], text_len=9, seed=seed, padding="left")
        for key in ("pixel_values", "pixel_values_videos"):
            if key in batch:
                batch[key] = batch[key].to(dtype)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=None, help="default: every rank (or --ring)")
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--sp-output", choices=["full", "shard"], default="full")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--no-hfpatch", action="store_true", help="the plain script (the reference)")
    parser.add_argument("--output-dir", default="/tmp/hfpatch_trainer_sp_vlm")
    parser.add_argument("--results-file", default="results.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    world = int(os.environ.get("WORLD_SIZE", "1"))

    model = tiny_qwen3_vl(causal_lm=True).to(dtype)
    patch = None
    if not args.no_hfpatch:  # hfpatch
        ulysses = args.ulysses or world // args.ring  # hfpatch
        parallel = hfpatch.ParallelConfig(ulysses=ulysses, ring=args.ring)  # hfpatch
        patch = hfpatch.apply(model, parallel=parallel, sp_output=args.sp_output)  # hfpatch
        print(f"rank {os.environ.get('RANK', 0)}: {patch}")  # the degrees that matter here: no VAE, no vae=
    set_seed(
        0
    )  # LoRA's A matrices are drawn from the global RNG: the same on every rank and in the reference
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)")
    model = get_peft_model(model, lora)
    initial = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}

    training = TrainingArguments(
        args.output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=MediaDataset(), data_collator=collate(dtype))
    if patch is not None:
        hfpatch.data_parallel_loaders(trainer.accelerator, patch)  # hfpatch: the same batches within a group
    trainer.train()

    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        final = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
        result = {
            "losses": losses,
            "updates": {k: (final[k].double() - initial[k].double()).flatten().tolist() for k in initial},
        }
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, args.results_file), "w") as f:
            json.dump(result, f)
        print(f"losses: {', '.join(f'{x:.6f}' for x in losses)}")


if __name__ == "__main__":
    main()
