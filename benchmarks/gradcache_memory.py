"""GradCache vs a plain contrastive step on a small stock Qwen3-VL: peak memory and step time vs batch size.

Each sample is a text query (48 tokens) and an image document (a 12x12-patch image, 36 merged tokens, plus
48 text tokens); the loss is InfoNCE over the batch. The model is a stock ``Qwen3VLModel`` of 10M parameters
(text 384 wide x 4 layers, vision 192 x 2): big enough that matrix work, not Python, dominates a chunk's
forward on CPU, as it does for real embedding models on a GPU. For batch sizes 8, 32 and 128 (chunk 4) it
records

- peak live tensor bytes of one training step (``hfpatch.testing.memory``; parameters, inputs and the
  already allocated ``.grad`` buffers excluded, so the figure is activations + temporaries),
- the time of a step (no tracker), for the plain step and for GradCache: the minimum over interleaved
  repeats of the process CPU time with one torch thread (the least noisy estimate on a shared machine),
  and of wall time, and
- the time of one no-grad forward of the whole batch, GradCache's extra work: ``1 + nograd_forward_s /
  plain_step_s`` is the ratio that textbook GradCache would reach if chunking cost nothing (hfpatch's
  kept last chunk saves a little of that extra pass, smaller chunks cost per-call overhead).

Writes ``benchmarks/results/gradcache_memory.json`` and ``.png``. Runs on CPU in about eight minutes.
The README's second timing uses a wider model (38M parameters) at the batch sizes where a CPU step is short:

    python benchmarks/gradcache_memory.py [--batch-sizes 8 32 128] [--chunk 4] [--repeats 5]
    python benchmarks/gradcache_memory.py --hidden 768 --batch-sizes 8 32 --sweep-chunks 8 16 --repeats 3 \
        --name gradcache_memory_h768
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from hfpatch.testing import qwen3_vl_inputs, tiny_qwen3_vl
from hfpatch.testing.memory import track_memory
from hfpatch.training import GradCache
from hfpatch.training.pooling import default_rep
from hfpatch.training.trainer import info_nce

RESULTS = Path(__file__).parent / "results"


def small_qwen3_vl(hidden: int = 384) -> torch.nn.Module:
    """A stock ``Qwen3VLModel`` larger than ``tiny_qwen3_vl`` so that compute, not Python, dominates: text
    ``hidden`` wide x 4 layers (heads of 64), vision ``hidden / 2`` wide x 2 blocks."""
    text = dict(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=4,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
    )
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [8, 12, 12],
        "mrope_interleaved": True,
    }
    vision = dict(
        hidden_size=hidden // 2,
        intermediate_size=2 * hidden,
        num_heads=4,
        out_hidden_size=hidden,
        num_position_embeddings=256,
    )
    return tiny_qwen3_vl(vision_overrides=vision, rope_parameters=rope, **text).train()


def batch(size: int) -> tuple[dict, dict]:
    queries = qwen3_vl_inputs([[]] * size, text_len=48, seed=1)
    docs = qwen3_vl_inputs([[("image", (1, 12, 12))]] * size, text_len=48, seed=2)
    return queries, docs


def plain_step(model: torch.nn.Module, queries: dict, docs: dict) -> torch.Tensor:
    loss = info_nce(default_rep(model(**queries), queries), default_rep(model(**docs), docs))
    loss.backward()
    return loss.detach()


def peak_bytes(model: torch.nn.Module, step, inputs) -> int:
    """Peak tracked bytes of ``step(*inputs)`` after a warm-up that allocates ``.grad`` (not counted)."""
    step(*inputs)
    model.zero_grad(set_to_none=False)
    gc.collect()  # free garbage from earlier runs before counting
    with track_memory() as mem:
        step(*inputs)
    return mem.peak_bytes


def best_times(model: torch.nn.Module, steps: dict, inputs, repeats: int) -> dict[str, tuple[float, float]]:
    """Minimum CPU and wall time of each ``steps[name](*inputs)``, the steps interleaved in each repeat so
    that a slow phase of a shared machine hits all of them alike."""
    cpu = {name: [] for name in steps}
    wall = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            model.zero_grad(set_to_none=False)
            start_cpu, start_wall = time.process_time(), time.perf_counter()
            step(*inputs)
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start_wall)
    return {name: (min(cpu[name]), min(wall[name])) for name in steps}


def nograd_forward(model: torch.nn.Module, queries: dict, docs: dict) -> None:
    with torch.no_grad():
        model(**queries)
        model(**docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep-batch", type=int, default=32, help="batch of the chunk-size time sweep")
    # chunk = batch is one chunk: the bare cost of the extra no-grad pass, without per-chunk overhead.
    parser.add_argument("--sweep-chunks", type=int, nargs="+", default=[8, 16, 32])
    # Wider models shift CPU time from per-call overhead to matrix work, as real checkpoints on a GPU do.
    parser.add_argument("--hidden", type=int, default=384, help="text width (vision: half)")
    parser.add_argument("--name", default="gradcache_memory", help="results file name (.json, .png)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # CPU time of one thread measures work; threads on a busy machine spin-wait

    model = small_qwen3_vl(args.hidden)
    params = sum(p.numel() for p in model.parameters())
    description = (
        f"Qwen3VLModel, {params / 1e6:.0f}M params (text {args.hidden} x 4 layers, vision {args.hidden // 2} x 2); "
        "48-token queries, 12x12-patch image docs"
    )
    cache = GradCache(model, info_nce, args.chunk)
    plain = lambda q, d: plain_step(model, q, d)  # noqa: E731
    rows = []
    for size in args.batch_sizes:
        inputs = batch(size)
        plain_peak = peak_bytes(model, plain, inputs)
        gc_peak = peak_bytes(model, cache.step, inputs)
        times = best_times(
            model,
            {"plain": plain, "gradcache": cache.step, "nograd": lambda q, d: nograd_forward(model, q, d)},
            inputs,
            args.repeats,
        )
        rows.append(
            dict(
                batch=size,
                plain_peak_bytes=plain_peak,
                gradcache_peak_bytes=gc_peak,
                plain_step_s=times["plain"][0],
                gradcache_step_s=times["gradcache"][0],
                nograd_forward_s=times["nograd"][0],
                plain_step_wall_s=times["plain"][1],
                gradcache_step_wall_s=times["gradcache"][1],
            )
        )
        r = rows[-1]
        print(
            f"batch {size:4d}: peak plain {plain_peak / 2**20:7.2f} MiB, GradCache {gc_peak / 2**20:6.2f} MiB | "
            f"step plain {r['plain_step_s'] * 1e3:7.1f} ms, GradCache {r['gradcache_step_s'] * 1e3:7.1f} ms "
            f"({r['gradcache_step_s'] / r['plain_step_s']:.2f}x; unchunked estimate "
            f"{1 + r['nograd_forward_s'] / r['plain_step_s']:.2f}x)",
            flush=True,
        )
    sweep = []
    inputs = batch(args.sweep_batch)
    steps = {"plain": plain} | {chunk: GradCache(model, info_nce, chunk).step for chunk in args.sweep_chunks}
    times = best_times(model, steps, inputs, args.repeats)
    for chunk in args.sweep_chunks:
        sweep.append(
            dict(
                batch=args.sweep_batch,
                chunk=chunk,
                plain_step_s=times["plain"][0],
                gradcache_step_s=times[chunk][0],
            )
        )
        print(
            f"batch {args.sweep_batch} chunk {chunk:3d}: GradCache / plain step time "
            f"{times[chunk][0] / times['plain'][0]:.2f}x"
        )
    base = rows[0]
    summary = dict(
        chunk=args.chunk,
        gradcache_peak_vs_smallest_batch=[
            r["gradcache_peak_bytes"] / base["gradcache_peak_bytes"] for r in rows
        ],
        plain_peak_vs_smallest_batch=[r["plain_peak_bytes"] / base["plain_peak_bytes"] for r in rows],
        step_time_ratio=[r["gradcache_step_s"] / r["plain_step_s"] for r in rows],
        step_time_ratio_unchunked_estimate=[1 + r["nograd_forward_s"] / r["plain_step_s"] for r in rows],
        step_time_ratio_by_chunk={r["chunk"]: r["gradcache_step_s"] / r["plain_step_s"] for r in sweep},
    )
    RESULTS.mkdir(exist_ok=True)
    out = dict(
        model=f"{description}; InfoNCE, fp32 CPU",
        torch_threads=torch.get_num_threads(),
        rows=rows,
        chunk_sweep=sweep,
        summary=summary,
    )
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    plot(rows, sweep, args.chunk, RESULTS / f"{args.name}.png")


def plot(rows: list[dict], sweep: list[dict], chunk: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    sizes = [r["batch"] for r in rows]
    fig, (ax_mem, ax_time) = plt.subplots(2, 1, figsize=(9, 8.6))
    ax_mem.plot(sizes, [r["plain_peak_bytes"] / 2**20 for r in rows], "o-", label="plain step")
    ax_mem.plot(
        sizes, [r["gradcache_peak_bytes"] / 2**20 for r in rows], "s-", label=f"GradCache (chunk {chunk})"
    )
    ax_mem.set(
        xscale="log",
        yscale="log",
        xlabel="batch size",
        ylabel="peak live tensor MiB",
        title="Peak activation memory of one step",
    )
    ax_mem.set_xticks(sizes, [str(s) for s in sizes])
    ax_mem.legend()
    labels = [f"B={r['batch']}\nchunk {chunk}" for r in rows] + [
        f"B={r['batch']}\nchunk {r['chunk']}" for r in sweep
    ]
    ratios = [r["gradcache_step_s"] / r["plain_step_s"] for r in rows + sweep]
    ax_time.bar(labels, ratios, color=["tab:orange"] * len(rows) + ["tab:green"] * len(sweep))
    estimates = [1 + r["nograd_forward_s"] / r["plain_step_s"] for r in rows]
    ax_time.plot(labels[: len(rows)], estimates, "k_", ms=20, label="1 + no-grad forward / plain")
    ax_time.axhline(1.4, color="gray", ls="--", label="1.4x target")
    ax_time.set(ylabel="GradCache / plain step CPU time", title="Step time overhead (CPU, 1 thread)")
    ax_time.tick_params(axis="x", labelsize=10)
    ax_time.set_ylim(0, 1.85)
    ax_time.legend(loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
