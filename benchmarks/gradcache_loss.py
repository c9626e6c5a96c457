"""GradCache at CLIP-scale batches: the row-blocked loss stage against the unchunked one, memory and CPU time.

A tiny stock ``BertModel`` (hidden 64 = the embedding dim, 2 layers, 16-token inputs, mean pooling) embeds
queries and documents; the loss is CLIP's (symmetric InfoNCE with a learned temperature). For batch sizes 1,024
to 16,384 with a fixed GradCache chunk (256 samples) it records, per variant of the loss stage,

- ``blocked``: :class:`hfpatch.training.CLIPLoss` with a fixed block of 64 rows (``block_size=64``): loss stage
  ``O(B x 64)`` plus the ``O(B x D)`` embeddings and their gradients;
- ``budget``: the same loss with its block chosen from a memory budget (``block_bytes=8 MiB``): the block
  shrinks as the batch grows, the loss stage stays at the budget plus ``O(B x D)``;
- ``unchunked``: the textbook loss through autograd on the whole ``B x B`` matrix (OpenCLIP's ``ClipLoss``),

the peak live tensor bytes of one GradCache step (``hfpatch.testing.memory``; parameters, inputs and the
already allocated ``.grad`` excluded) and of the loss stage alone (forward + backward of the loss on given
embeddings), and the CPU time (one thread, minimum over ``--repeats`` interleaved runs) of the GradCache step
with the blocked and the unchunked loss and of a plain step (one forward/backward of the whole batch, unchunked
loss). Writes ``benchmarks/results/gradcache_loss.json`` and ``.png``; about 10 minutes on 2 shared cores:

    python benchmarks/gradcache_loss.py [--batch-sizes 1024 2048 4096 8192 16384] [--chunk 256] [--block 64]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hfpatch.testing import tiny_bert
from hfpatch.testing.memory import track_memory
from hfpatch.training import CLIPLoss, GradCache
from hfpatch.training.pooling import default_rep

RESULTS = Path(__file__).parent / "results"
WIDTH, TOKENS = 64, 16


class UnchunkedCLIP(torch.nn.Module):
    """OpenCLIP's ClipLoss on the whole matrix (what a plain loss_fn does), with CLIPLoss's temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        logits = self.logit_scale.exp() * F.normalize(images, dim=-1) @ F.normalize(texts, dim=-1).T
        labels = torch.arange(len(images))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def encoder() -> torch.nn.Module:
    return tiny_bert(
        hidden_size=WIDTH, num_attention_heads=4, intermediate_size=4 * WIDTH, num_hidden_layers=2
    )


def batch(size: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 64, (size, TOKENS), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def losses(block: int, budget: int) -> dict[str, torch.nn.Module]:
    return {
        "blocked": CLIPLoss(block_size=block),
        "budget": CLIPLoss(block_bytes=budget),
        "unchunked": UnchunkedCLIP(),
    }


def plain_step(model: torch.nn.Module, loss: torch.nn.Module, queries: dict, docs: dict) -> None:
    reps = [default_rep(model(**x), x, "mean") for x in (queries, docs)]
    loss(*reps).backward()


def peak_bytes(model: torch.nn.Module, step, *inputs) -> int:
    """Peak tracked bytes of ``step(*inputs)`` after a warm-up that allocates ``.grad`` (not counted)."""
    step(*inputs)
    model.zero_grad(set_to_none=False)
    gc.collect()
    with track_memory() as mem:
        step(*inputs)
    return mem.peak_bytes


def loss_stage_peak(loss: torch.nn.Module, size: int) -> int:
    gen = torch.Generator().manual_seed(0)
    reps = [torch.randn(size, WIDTH, generator=gen).requires_grad_() for _ in range(2)]
    with track_memory() as mem:
        loss(*reps).backward()
    return mem.peak_bytes


def best_cpu_times(model: torch.nn.Module, steps: dict, inputs, repeats: int) -> dict[str, float]:
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            model.zero_grad(set_to_none=False)
            start = time.process_time()
            step(*inputs)
            times[name].append(time.process_time() - start)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--chunk", type=int, default=256, help="GradCache chunk (samples)")
    parser.add_argument("--block", type=int, default=64, help="rows per block of the 'blocked' loss")
    parser.add_argument("--budget-mib", type=int, default=8, help="block_bytes of the 'budget' loss, MiB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--name", default="gradcache_loss")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = encoder().train()
    budget = args.budget_mib * 2**20
    rows = []
    for size in args.batch_sizes:
        queries, docs = batch(size, 1), batch(size, 2)
        row = {"batch": size}
        for name, loss in losses(args.block, budget).items():
            cache = GradCache(model, loss, args.chunk, pooling="mean")
            row[f"{name}_step_peak_bytes"] = peak_bytes(model, cache.step, queries, docs)
            row[f"{name}_loss_peak_bytes"] = loss_stage_peak(loss, size)
        plain_loss = UnchunkedCLIP()
        row["plain_step_peak_bytes"] = peak_bytes(
            model, lambda q, d, loss=plain_loss: plain_step(model, loss, q, d), queries, docs
        )
        both = losses(args.block, budget)
        steps = {
            "blocked": GradCache(model, both["blocked"], args.chunk, pooling="mean").step,
            "unchunked": GradCache(model, both["unchunked"], args.chunk, pooling="mean").step,
            "plain": lambda q, d, loss=plain_loss: plain_step(model, loss, q, d),
        }
        times = best_cpu_times(model, steps, (queries, docs), args.repeats)
        row |= {f"{name}_step_s": t for name, t in times.items()}
        row["budget_rows"] = both["budget"].block_rows(2, size, WIDTH)
        rows.append(row)
        print(
            f"batch {size:6d}: step peak blocked {row['blocked_step_peak_bytes'] / 2**20:7.1f} MiB, budget "
            f"{row['budget_step_peak_bytes'] / 2**20:7.1f} MiB ({row['budget_rows']} rows), unchunked "
            f"{row['unchunked_step_peak_bytes'] / 2**20:8.1f} MiB, plain {row['plain_step_peak_bytes'] / 2**20:8.1f} MiB"
            f" | loss stage {row['blocked_loss_peak_bytes'] / 2**20:6.1f} / {row['budget_loss_peak_bytes'] / 2**20:6.1f}"
            f" / {row['unchunked_loss_peak_bytes'] / 2**20:8.1f} MiB | CPU s: blocked {times['blocked']:.2f}, "
            f"unchunked {times['unchunked']:.2f}, plain {times['plain']:.2f} "
            f"({times['blocked'] / times['plain']:.2f}x plain)",
            flush=True,
        )
    base = rows[0]

    def growth(key: str) -> list[float]:
        return [r[key] / base[key] for r in rows]

    summary = {
        "chunk": args.chunk,
        "block": args.block,
        "budget_bytes": budget,
        "step_peak_growth": {
            v: growth(f"{v}_step_peak_bytes") for v in ("blocked", "budget", "unchunked", "plain")
        },
        "loss_stage_peak_growth": {
            v: growth(f"{v}_loss_peak_bytes") for v in ("blocked", "budget", "unchunked")
        },
        "step_time_vs_plain": {
            v: [r[f"{v}_step_s"] / r["plain_step_s"] for r in rows] for v in ("blocked", "unchunked")
        },
    }
    RESULTS.mkdir(exist_ok=True)
    params = sum(p.numel() for p in model.parameters())
    out = {
        "model": f"BertModel, {params / 1e3:.0f}k params, hidden {WIDTH} x 2 layers, {TOKENS}-token inputs, "
        "mean pooling; CLIP loss (learned temperature), fp32 CPU, one thread",
        "rows": rows,
        "summary": summary,
    }
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    plot(rows, args, RESULTS / f"{args.name}.png")


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["batch"] for r in rows]
    fig, (ax_mem, ax_loss, ax_time) = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = {
        "blocked": f"row-blocked, block {args.block}",
        "budget": f"row-blocked, {args.budget_mib} MiB budget",
        "unchunked": "unchunked loss",
        "plain": "plain step (no GradCache)",
    }
    for variant, style in (("blocked", "s-"), ("budget", "d-"), ("unchunked", "o-"), ("plain", "x--")):
        ax_mem.plot(
            sizes, [r[f"{variant}_step_peak_bytes"] / 2**20 for r in rows], style, label=labels[variant]
        )
    for variant, style in (("blocked", "s-"), ("budget", "d-"), ("unchunked", "o-")):
        ax_loss.plot(
            sizes, [r[f"{variant}_loss_peak_bytes"] / 2**20 for r in rows], style, label=labels[variant]
        )
    for ax, title in (
        (ax_mem, f"Peak of one GradCache step (chunk {args.chunk})"),
        (ax_loss, "Peak of the loss stage alone"),
    ):
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="peak live tensor MiB", title=title)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.legend(fontsize=8)
    width = 0.38
    xs = range(len(sizes))
    for offset, variant in ((-width / 2, "blocked"), (width / 2, "unchunked")):
        ax_time.bar(
            [x + offset for x in xs],
            [r[f"{variant}_step_s"] / r["plain_step_s"] for r in rows],
            width,
            label=f"GradCache, {labels[variant]}",
        )
    ax_time.set_xticks(list(xs), [str(s) for s in sizes])
    ax_time.set(xlabel="batch size", ylabel="step CPU time / plain step", title="Step time (CPU, 1 thread)")
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
