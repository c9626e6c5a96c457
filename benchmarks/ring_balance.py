"""Causal Ring attention's balance: the contiguous layout against the zigzag order (issue 49).

1. **Counted work** (no run): the query-key pairs each ring rank's kernels compute for ONE causal sample of
   ``S = 4096`` tokens (a partial tile counts whole), read from the kernels' own tile plan
   (:func:`hfpatch.attention.masked.ring_work`), at N = 2, 4, 8 (Ring N) and Ulysses 2 x Ring 2/4, for the
   contiguous layout (:mod:`hfpatch.attention.layout`) and the zigzag order (:mod:`hfpatch.attention.zigzag`);
   also for 4 packed samples of 1024 tokens. The figure of merit is the busiest rank's work over the mean
   (a Ring step waits for its busiest rank): 1.0 is balanced.
2. **CPU step time at N = 2**: the stock ``Qwen3ForCausalLM`` of ``benchmarks/decoder_sp.py`` (2 layers,
   C = 128, 8/4 heads of 16) takes training steps on one 4096-token sample under Ring 2 on two gloo ranks,
   ``sp_order="contiguous"`` and ``"zigzag"``: each rank's attention kernel seconds (its tiles' forward and
   backward kernels, timed around each call: the waits for the ring are not in them) and the step's wall seconds (median of 3 after a warm-up), with the loss and gradient error
   against the unpatched step. A shared 2-core machine: one core per rank, so the step waits for the busiest.

Writes ``benchmarks/results/ring_balance.json`` and ``.png``; about a minute on two CPU cores.

    python benchmarks/ring_balance.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
SEQ = 4096
TILE = 1024  # the decoder family's default sp_tile


def _packed_mask(samples: int):
    from hfpatch.attention.masked import classify_tile

    class Packed:
        """Causal within each of ``samples`` equal packed samples."""

        def tile(self, q_start: int, q_len: int, k_start: int, k_len: int):
            q = torch.arange(q_start, q_start + q_len)[:, None]
            k = torch.arange(k_start, k_start + k_len)[None, :]
            size = SEQ // samples
            return classify_tile(((k <= q) & (k // size == q // size))[None, None])

    return Packed()


def counted() -> list[dict[str, Any]]:
    """Work per ring rank, contiguous and zigzag, from the kernels' tile plan."""
    from hfpatch.attention.layout import shard_len
    from hfpatch.attention.masked import CausalMask, ring_work
    from hfpatch.attention.zigzag import ZigzagLayout, ZigzagMask

    rows = []
    for mask_name, mask in (("causal", CausalMask()), ("packed 4 x 1024", _packed_mask(4))):
        for ulysses, ring in ((1, 2), (1, 4), (1, 8), (2, 2), (2, 4)):
            world = ulysses * ring
            layout = ZigzagLayout(SEQ, world)
            work = {
                "contiguous": ring_work(mask, ring, ulysses * shard_len(SEQ, world), tile=TILE),
                "zigzag": ring_work(ZigzagMask(mask, layout), ring, ulysses * layout.shard_len, tile=TILE),
            }
            for order, per_rank in work.items():
                rows.append(
                    {
                        "mask": mask_name,
                        "ulysses": ulysses,
                        "ring": ring,
                        "order": order,
                        "pairs_per_ring_rank": per_rank,
                        "busiest_over_mean": max(per_rank) / (sum(per_rank) / len(per_rank)),
                    }
                )
    return rows


def timed_step(order: str, reference: dict[str, Any]) -> dict[str, Any]:
    """On each rank: attention seconds and step seconds under Ring 2 with ``sp_order=order``."""
    import hfpatch
    from hfpatch import ParallelConfig, all_reduce_gradients
    from hfpatch.attention import masked

    sys.path.insert(0, str(Path(__file__).parent))
    from decoder_sp import build

    model, kwargs = build("causal")
    spent = {"attention": 0.0}
    original = masked._tile_forward, masked._tile_backward

    def timed(fn):
        def run(*args, **kw):
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent["attention"] += time.perf_counter() - start

        return run

    masked._tile_forward, masked._tile_backward = (timed(f) for f in original)
    try:
        steps = []
        with hfpatch.apply(model, parallel=ParallelConfig(ring=2), sp_order=order):
            for i in range(4):
                model.zero_grad(set_to_none=True)
                spent["attention"] = 0.0
                start = time.perf_counter()
                loss = model(**kwargs).loss
                loss.backward()
                seconds = time.perf_counter() - start
                if i:  # the first is a warm-up
                    steps.append((seconds, spent["attention"]))
            all_reduce_gradients(model)
    finally:
        masked._tile_forward, masked._tile_backward = original
    scale = max(g.abs().max().item() for g in reference["grads"].values())
    grad_error = max(
        (p.grad - reference["grads"][n]).abs().max().item()
        for n, p in model.named_parameters()
        if p.grad is not None
    )
    return {
        "step_seconds": statistics.median(s for s, _ in steps),
        "attention_seconds": statistics.median(a for _, a in steps),
        "loss_rel_error": abs(loss.item() - reference["loss"]) / abs(reference["loss"]),
        "grad_rel_error": grad_error / scale,
    }


def main() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from decoder_sp import TEXT, build

    from hfpatch.testing import RankPool

    torch.set_num_threads(1)
    rows = counted()
    model, kwargs = build("causal")
    loss = model(**kwargs).loss
    loss.backward()
    reference = {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    timing = []
    with RankPool(2, timeout_s=900) as pool:
        for order in ("contiguous", "zigzag"):
            per_rank = pool.run(timed_step, order, reference)
            timing.append({"order": order, "ring": 2, "per_rank": per_rank})
    results = {
        "model": "transformers Qwen3ForCausalLM (benchmarks/decoder_sp.py's tiny config), one causal sample",
        "config": {**TEXT, "seq": SEQ, "tile": TILE, "dtype": "float32"},
        "counted": rows,
        "cpu_step_ring2": timing,
        "note": "counted pairs are exact; seconds are wall time on a shared 2-core CPU, one core per rank",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ring_balance.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "ring_balance.png")
    return results


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    ax = axes[0]
    causal = [r for r in results["counted"] if r["mask"] == "causal"]
    names = sorted({(r["ulysses"], r["ring"]) for r in causal}, key=lambda c: (c[0], c[1]))
    x = range(len(names))
    for offset, order, color in ((-0.2, "contiguous", "C3"), (0.2, "zigzag", "C0")):
        values = [
            next(
                r["busiest_over_mean"]
                for r in causal
                if (r["ulysses"], r["ring"]) == n and r["order"] == order
            )
            for n in names
        ]
        ax.bar([i + offset for i in x], values, 0.4, color=color, label=order)
    ax.axhline(1.10, color="k", ls=":", label="issue 49 bound 1.10")
    ax.set_xticks(list(x), [f"U{u} x R{r}" for u, r in names])
    ax.set(ylabel="busiest ring rank / mean (counted work)", title=f"causal, S = {SEQ}")
    ax.legend()
    ax = axes[1]
    for i, row in enumerate(results["cpu_step_ring2"]):
        for rank, r in enumerate(row["per_rank"]):
            ax.bar(
                i * 3 + rank,
                r["attention_seconds"],
                color=f"C{rank}",
                label=f"rank {rank}" if i == 0 else None,
            )
        ax.text(i * 3 + 0.5, max(r["attention_seconds"] for r in row["per_rank"]) * 1.03,
                f"step {max(r['step_seconds'] for r in row['per_rank']):.2f} s", ha="center")  # fmt: skip
    ax.set_xticks([0.5, 3.5], [r["order"] for r in results["cpu_step_ring2"]])
    ax.set(ylabel="attention seconds per training step", title="Ring 2, 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import timed_step from this file
    from ring_balance import main as _main  # noqa: E402  (the importable copy of this module)

    out = _main()
    for r in out["counted"]:
        print(
            f"{r['mask']:16s} U{r['ulysses']} x R{r['ring']} {r['order']:10s} busiest/mean {r['busiest_over_mean']:.3f}"
        )
    for row in out["cpu_step_ring2"]:
        print(
            row["order"],
            [(round(r["step_seconds"], 2), round(r["attention_seconds"], 2)) for r in row["per_rank"]],
        )
