"""Train a (tiny) sentence-transformers model with GradCache through ``SentenceTransformerTrainer``.

The only change to a stock sentence-transformers script is the loss (lines marked ``# hfpatch``):
``GradCacheLoss`` embeds each batch in mini-batches, so the batch size (the number of in-batch negatives)
is not limited by activation memory, and with ``cross_rank=True`` every rank's anchors are scored against
the positives of *all* ranks. Runs on CPU in seconds with a tiny random-weight model built locally:

    python examples/integrations/st_gradcache.py
    torchrun --nproc-per-node 2 examples/integrations/st_gradcache.py   # DDP on CPU, cross-rank negatives

For a real model use ``SentenceTransformer("BAAI/bge-small-en-v1.5")`` (or any) instead of
``tiny_sentence_transformer()``, a real dataset, and ``bf16=True`` on GPUs.

``--no-hfpatch`` runs the stock script (plain ``MultipleNegativesRankingLoss``); ``tests/integration/
test_st_gradcache.py`` checks that 2 processes with GradCache train exactly as one unpatched process with the
global batch (``--results-file`` writes the losses and final weights for that comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from hfpatch.training.sentence_transformers import GradCacheLoss, tiny_sentence_transformer  # hfpatch

WORDS = "the a cat dog sat ran on mat log sun big red blue sky sea car road tree leaf".split()


def pairs(n: int) -> Dataset:
    """``n`` (anchor, positive) pairs of distinct short sentences over the tiny model's vocabulary."""
    anchors, positives = [], []
    for i in range(n):
        a, b, c = WORDS[i % len(WORDS)], WORDS[(3 * i + 1) % len(WORDS)], WORDS[(7 * i + 2) % len(WORDS)]
        anchors.append(f"{a} {b} {c} {i}")
        positives.append(f"{c} {a} {b}")
    return Dataset.from_dict({"anchor": anchors, "positive": positives})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16, help="pairs per rank and step")
    parser.add_argument("--mini-batch-size", type=int, default=4, help="pairs embedded at once (memory)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--optim", default="adamw_torch", help="the Trainer's optim= (tests use sgd)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--no-hfpatch", action="store_true", help="the stock loss: the reference run")
    parser.add_argument("--results-file", help="write the losses and the final weights here (JSON)")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))

    model = tiny_sentence_transformer(dropout=args.dropout).to(getattr(torch, args.dtype))
    initial = {k: v.double().flatten().tolist() for k, v in model.state_dict().items()}
    loss = MultipleNegativesRankingLoss(model)
    if not args.no_hfpatch:
        loss = GradCacheLoss(  # hfpatch: wrap any in-batch-negatives loss (or a function of the embeddings)
            loss,
            mini_batch_size=args.mini_batch_size,
            cross_rank=world > 1,  # hfpatch: negatives from every rank (global batch = world * batch size)
        )
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = SentenceTransformerTrainingArguments(
            output_dir,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=args.learning_rate,
            optim=args.optim,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            ddp_find_unused_parameters=False,
        )
        trainer = SentenceTransformerTrainer(
            model=model,
            args=training_args,
            train_dataset=pairs(args.batch_size * world * args.steps),
            loss=loss,
        )
        trainer.train()
    if trainer.is_world_process_zero():
        if args.results_file:
            weights = {k: v.double().flatten().tolist() for k, v in model.state_dict().items()}
            history = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            with open(args.results_file, "w") as f:
                json.dump({"world": world, "losses": history, "initial": initial, "final": weights}, f)
        losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
        print(
            f"trained {args.steps} steps on {world} process(es): {args.batch_size} pairs per rank embedded "
            f"{args.mini_batch_size} at a time, each anchor scored against {args.batch_size * world} positives "
            f"({'cross-rank' if world > 1 else 'in-batch'}); losses {losses}"
        )


if __name__ == "__main__":
    main()
