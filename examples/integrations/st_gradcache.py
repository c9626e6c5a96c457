"""Train a (tiny) sentence-transformers model with GradCache through ``SentenceTransformerTrainer``.

The only change to a stock sentence-transformers script is the loss (lines marked ``# hfpatch``):
``GradCacheLoss`` embeds each batch in mini-batches, so the batch size (the number of in-batch negatives)
is not limited by activation memory, and with ``cross_rank=True`` every rank's anchors are scored against
the positives of *all* ranks. Runs on CPU in seconds with a tiny random-weight model built locally:

    python examples/integrations/st_gradcache.py
    torchrun --nproc-per-node 2 examples/integrations/st_gradcache.py   # DDP on CPU, cross-rank negatives

For a real model use ``SentenceTransformer("BAAI/bge-small-en-v1.5")`` (or any) instead of
``tiny_sentence_transformer()``, a real dataset, and ``bf16=True`` on GPUs.
"""

from __future__ import annotations

import argparse
import os
import tempfile

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
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))

    model = tiny_sentence_transformer(dropout=0.1)
    loss = GradCacheLoss(  # hfpatch: wrap any in-batch-negatives loss (or a function of the embeddings)
        MultipleNegativesRankingLoss(model),
        mini_batch_size=args.mini_batch_size,
        cross_rank=world > 1,  # hfpatch: negatives from every rank (global batch = world * batch size)
    )
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = SentenceTransformerTrainingArguments(
            output_dir,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=1e-3,
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
        losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
        print(
            f"trained {args.steps} steps on {world} process(es): {args.batch_size} pairs per rank embedded "
            f"{args.mini_batch_size} at a time, each anchor scored against {args.batch_size * world} positives "
            f"({'cross-rank' if world > 1 else 'in-batch'}); losses {losses}"
        )


if __name__ == "__main__":
    main()
