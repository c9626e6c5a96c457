"""The Ulysses exchange per attention call: bytes copied and sent against their analytic minima, CPU time with and
without overlap, and the FP8 exchange's bytes and error (gloo ranks on CPU; JSON + plot).

One long sequence (S = 4096 image tokens, H = 8 heads of D = 64, 64 replicated text tokens in front, batch 1 and 2)
is sharded over u = 2 and 4 gloo ranks (Ulysses, ring degree 1). Every rank reports:

1. **copies**: bytes written by copying ops during one ``usp_attention`` call (``count_copies``: copy_, clone, cat,
   conversions, ...) against :func:`hfpatch.attention.exchange.copy_minimum` (one copy of q, k, v and the
   output, the text heads into the kernel's buffers and the joined output), default and overlapped exchange;
2. **bytes sent** (``count_comm``) against the analytic minimum (``(u - 1) / u`` of each local tensor, plus the text
   output heads' all-gather), exact in bf16 and FP8 (``ExchangeConfig(dtype=torch.float8_e4m3fn)``: payload half of
   bf16's, plus a float32 scale per sample and head of each message);
3. **time**: a DiT block forward (pre-norm attention with q/k/v/out projections, 4x GELU MLP, ``C = H D = 512``),
   median over repeats taken round-robin over the variants, max over ranks: blocking exchange;
   ``exchange="overlap"`` (head chunks pipelined with the attention); projections overlapped with the exchange
   (:func:`~hfpatch.attention.exchange.start_sequence_to_heads` after each projection,
   :func:`~hfpatch.attention.exchange.project_heads_to_sequence` in 2 head chunks);
4. **FP8 error**: the attention output with the FP8 exchange against the exact exchange (per-head and per-tensor
   scales, keys exact or not; fp32 and bf16 inputs): largest error over the largest ``|v|`` (the output's natural
   scale: an average of values), and the root-mean-square error over the output's; on tiny stock DiTs (Wan,
   Flux, CogVideoX, QwenImage at Ulysses 2) the model output's largest error over its largest magnitude.

What CPU time can and cannot show: two ranks share two cores with gloo's threads, and gloo moves bytes over
loopback TCP with the same cores, so the messages compete with the computation they are meant to hide behind; a
CPU figure measures the machinery's overhead (more, smaller messages; chunked kernels), not what overlap gains on
GPUs, where NCCL runs on its own stream and links. The GPU's figures come from ``benchmarks/gpu.py``.

Writes ``benchmarks/results/ulysses_exchange.json`` and ``.png``; several minutes on two CPU cores.

    python benchmarks/ulysses_exchange.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hfpatch.attention import usp_attention
from hfpatch.attention.exchange import (
    ExchangeConfig,
    copy_minimum,
    project_heads_to_sequence,
    start_sequence_to_heads,
)
from hfpatch.attention.layout import head_sizes
from hfpatch.attention.usp import sdpa_bshd
from hfpatch.core.config import ParallelConfig
from hfpatch.distributed.collectives import count_comm
from hfpatch.distributed.runtime import get_mesh
from hfpatch.testing import RankPool
from hfpatch.testing.memory import count_copies, track_memory
from hfpatch.testing.tolerance import rel_error

RESULTS = Path(__file__).parent / "results"
SEQ, HEADS, DIM, TEXT = 4096, 8, 64, 64
WORLDS = (2, 4)
REPEATS = 9
FP8 = torch.float8_e4m3fn
VARIANTS = {
    "fp8, head scales": ExchangeConfig(dtype=FP8),
    "fp8, tensor scales": ExchangeConfig(dtype=FP8, scale="tensor"),
    "fp8, exact keys": ExchangeConfig(dtype=FP8, exact_keys=True),
}
MODELS = ("wan21", "flux", "cogvideox", "qwenimage")


def _inputs(batch: int, local: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, local, HEADS, DIM, generator=gen).to(dtype) for _ in range(3))
    gen = torch.Generator().manual_seed(0)  # the text is replicated: the same on every rank
    joint = [torch.randn(batch, TEXT, HEADS, DIM, generator=gen).to(dtype) for _ in range(3)]
    return (q, k, v), joint


def _attention(qkv, joint, group, exchange=None):
    return usp_attention(
        *qkv, ulysses_group=group, ring_group=None, joint_query=joint[0], joint_key=joint[1],
        joint_value=joint[2], exchange=exchange,
    )  # fmt: skip


def _counts(world: int, batch: int) -> dict:
    """Copies and bytes sent of one attention call (exact and overlapped, fp32; exact and FP8, bf16)."""
    group = get_mesh(ParallelConfig(ulysses=world)).group("ulysses")
    me = torch.distributed.get_rank(group)
    local = SEQ // world
    qkv, joint = _inputs(batch, local, torch.float32, seed=1 + me)
    minimum = copy_minimum(batch, local, HEADS, head_sizes(HEADS, world)[me], DIM, TEXT, 4)
    out = {"copy_minimum": minimum}
    with torch.no_grad():
        for name, exchange in (("exact", None), ("overlap", "overlap")):
            with count_copies() as copies, count_comm() as comm, track_memory() as mem:
                _attention(qkv, joint, group, exchange)
            out[name] = {"copied": copies.bytes_copied, "by_op": copies.by_op, "sent": comm.by_op,
                         "peak": mem.peak_bytes}  # fmt: skip
        qkv16, joint16 = _inputs(batch, local, torch.bfloat16, seed=1 + me)
        for name, exchange in (("bf16 exact", None), ("bf16 fp8", ExchangeConfig(dtype=FP8))):
            with count_comm() as comm:
                _attention(qkv16, joint16, group, exchange)
            out[name] = {"sent": comm.by_op}
    element = 4
    shard = batch * local * HEADS * DIM * element  # one local [B, S/u, H, D] fp32 tensor
    text_heads = batch * TEXT * head_sizes(HEADS, world)[me] * DIM * element
    out["sent_minimum"] = {
        "all_to_all": 4 * (world - 1) * shard // world,
        "all_gather": (world - 1) * text_heads,
    }
    return out


def _block(x, weights, attention):
    wq, wk, wv, wo, w1, w2 = weights
    h = F.layer_norm(x, x.shape[-1:])
    x = x + attention(h, wq, wk, wv, wo)
    return x + F.gelu(F.layer_norm(x, x.shape[-1:]) @ w1) @ w2


def _timing(world: int) -> dict:
    """Median ms of a DiT block forward per exchange variant (inference)."""
    group = get_mesh(ParallelConfig(ulysses=world)).group("ulysses")
    me = torch.distributed.get_rank(group)
    local, width = SEQ // world, HEADS * DIM
    x = torch.randn(1, local, width, generator=torch.Generator().manual_seed(me))
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(width, width, generator=gen) / width**0.5 for _ in range(4)]
    weights += [torch.randn(width, 4 * width, generator=gen) / width**0.5]
    weights += [torch.randn(4 * width, width, generator=gen) / (4 * width) ** 0.5]

    def heads(t):
        return t.unflatten(-1, (HEADS, DIM))

    def blocking(h, wq, wk, wv, wo):
        out, _ = usp_attention(
            heads(h @ wq), heads(h @ wk), heads(h @ wv), ulysses_group=group, ring_group=None
        )
        return out.flatten(2) @ wo

    def chunked(h, wq, wk, wv, wo):
        out, _ = usp_attention(
            heads(h @ wq),
            heads(h @ wk),
            heads(h @ wv),
            ulysses_group=group,
            ring_group=None,
            exchange="overlap",
        )
        return out.flatten(2) @ wo

    def projections(h, wq, wk, wv, wo):
        started = []
        for w in (wq, wk, wv):  # each projection computes while the previous one's exchange travels
            started.append(start_sequence_to_heads(heads(h @ w), group, HEADS))
        q, k, v = (p.wait() for p in started)
        return project_heads_to_sequence(sdpa_bshd(q, k, v, None, None), group, HEADS, wo.T, chunks=2)

    variants = {"blocking": blocking, "overlap: head chunks": chunked, "overlap: projections": projections}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        reference = _block(x, weights, blocking)
        errors = {
            name: rel_error(_block(x, weights, attention), reference) for name, attention in variants.items()
        }
        for _ in range(REPEATS):  # round-robin: load on the shared machine weighs on every variant alike
            for name, attention in variants.items():
                torch.distributed.barrier(group)
                start = time.perf_counter()
                _block(x, weights, attention)
                times[name].append((time.perf_counter() - start) * 1e3)
    return {
        name: {"ms": statistics.median(times[name]), "rel_vs_blocking": errors[name]} for name in variants
    }


def _fp8_errors(world: int) -> dict:
    """Relative error of the attention output, FP8 exchange vs exact, per variant and dtype."""
    group = get_mesh(ParallelConfig(ulysses=world)).group("ulysses")
    me = torch.distributed.get_rank(group)
    out = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            qkv, joint = _inputs(1, SEQ // world, dtype, seed=1 + me)
            exact, exact_text = _attention(qkv, joint, group)
            exact = torch.cat([exact_text, exact], 1).double()
            values = max(t.abs().max().item() for t in (qkv[2], joint[2]))
            for name, exchange in VARIANTS.items():
                got, got_text = _attention(qkv, joint, group, exchange)
                diff = torch.cat([got_text, got], 1).double() - exact
                out[f"{name}, {str(dtype).removeprefix('torch.')}"] = {
                    "max_over_max_v": diff.abs().max().item() / values,
                    "rms_over_rms": (diff.square().mean() / exact.square().mean()).sqrt().item(),
                }
    return out


def _model_errors() -> dict:
    """Tiny stock DiTs at Ulysses 2: the output's relative error, FP8 exchange vs exact (and vs unpatched)."""
    import hfpatch

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "patches"))
    from test_dit_usp import build

    out = {}
    for family in MODELS:
        model, kwargs, _ = build(family)
        with torch.no_grad():
            reference = model(**kwargs).sample
            with hfpatch.apply(model, parallel=ParallelConfig(ulysses=2)):
                exact = model(**kwargs).sample
            with hfpatch.apply(model, parallel=ParallelConfig(ulysses=2), exchange="fp8"):
                fp8 = model(**kwargs).sample
        out[family] = {
            "fp8_vs_exact": rel_error(fp8, exact),
            "exact_vs_unpatched": rel_error(exact, reference),
        }
    return out


def _world(world: int) -> dict:
    result = {
        "counts": {b: _counts(world, b) for b in (1, 2)},
        "time": _timing(world),
        "fp8": _fp8_errors(world),
    }
    if world == 2:
        result["models"] = _model_errors()
    return result


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    fig, (ax_copy, ax_sent, ax_time, ax_err) = plt.subplots(4, 1, figsize=(9, 19))
    labels, measured, minimum, overlapped = [], [], [], []
    for world in WORLDS:
        for batch in (1, 2):
            row = results["worlds"][str(world)]["copies"][str(batch)]
            labels.append(f"u={world}, B={batch}")
            measured.append(row["exact_max"] / 2**20)
            overlapped.append(row["overlap_max"] / 2**20)
            minimum.append(row["minimum_max"] / 2**20)
    x = range(len(labels))
    ax_copy.bar([i - 0.27 for i in x], measured, 0.27, label="exact exchange")
    ax_copy.bar(list(x), overlapped, 0.27, label="overlapped")
    ax_copy.bar([i + 0.27 for i in x], minimum, 0.27, label="analytic minimum")
    ax_copy.set_xticks(list(x), labels)
    ax_copy.set(ylabel="bytes copied per call (MiB)")
    ax_copy.set_title(f"copies per attention call, S={SEQ} + {TEXT} text, H={HEADS}, D={DIM}, fp32")
    ax_copy.legend()
    sent = [results["worlds"][str(w)]["sent"] for w in WORLDS]
    xs = range(len(WORLDS))
    ax_sent.bar([i - 0.27 for i in xs], [s["bf16 exact"] / 2**20 for s in sent], 0.27, label="bf16 exact")
    ax_sent.bar(list(xs), [s["bf16 fp8"] / 2**20 for s in sent], 0.27, label="FP8 (e4m3 + scales)")
    ax_sent.bar(
        [i + 0.27 for i in xs], [s["minimum_fp32"] / 2**20 for s in sent], 0.27, label="fp32 analytic"
    )
    ax_sent.set_xticks(list(xs), [f"u={w}" for w in WORLDS])
    ax_sent.set(ylabel="bytes sent per rank, B=1 (MiB)")
    ax_sent.set_title("bytes sent per attention call (FP8 / bf16 on the bars)")
    for i, s in enumerate(sent):
        ax_sent.text(i, s["bf16 fp8"] / 2**20, f"{s['fp8_over_bf16']:.4f}", ha="center", va="bottom")
    ax_sent.legend()
    names = list(results["worlds"][str(WORLDS[0])]["time"])
    for j, name in enumerate(names):
        ax_time.bar([i + (j - 1) * 0.27 for i in xs],
                    [results["worlds"][str(w)]["time"][name]["ms"] for w in WORLDS], 0.27, label=name)  # fmt: skip
    ax_time.set_xticks(list(xs), [f"u={w}" for w in WORLDS])
    ax_time.set(ylabel="block forward (ms, median)")
    ax_time.set_title("CPU time, DiT block (gloo, shared cores): overhead, not GPU gains")
    ax_time.legend()
    errors = results["worlds"][str(WORLDS[0])]["fp8"]
    ax_err.barh(list(errors), [e["max_over_max_v"] for e in errors.values()], label="attention: max / max|v|")
    ax_err.barh(
        [f"{n} " for n in errors], [e["rms_over_rms"] for e in errors.values()], label="attention: rms / rms"
    )
    ax_err.barh([f"tiny {f}" for f in results["models"]], [r["fp8_vs_exact"] for r in results["models"].values()],
                label="tiny model output: max / max")  # fmt: skip
    ax_err.set(xlabel="error vs the exact exchange (u=2)", xscale="log", xlim=(1e-3, 1e-1))
    ax_err.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: no overlapping labels
    ax_err.tick_params(axis="y", labelsize=9)
    ax_err.legend(loc="lower right")
    ax_err.set_title("FP8 exchange error")
    fig.tight_layout()
    fig.savefig(path)


def main() -> dict:
    worlds = {}
    models = {}
    for world in WORLDS:
        with RankPool(world, timeout_s=1800) as pool:
            per_rank = pool.run(_world, world)
        copies = {}
        for batch in (1, 2):
            rows = [r["counts"][batch] for r in per_rank]
            copies[str(batch)] = {
                "exact_max": max(r["exact"]["copied"] for r in rows),
                "overlap_max": max(r["overlap"]["copied"] for r in rows),
                "minimum_max": max(r["copy_minimum"] for r in rows),
                "exact_over_minimum": max(r["exact"]["copied"] / r["copy_minimum"] for r in rows),
                "overlap_over_minimum": max(r["overlap"]["copied"] / r["copy_minimum"] for r in rows),
                "by_op_rank0": rows[0]["exact"]["by_op"],
                "attention_peak_max": max(r["exact"]["peak"] for r in rows),
                "overlap_peak_max": max(r["overlap"]["peak"] for r in rows),
                "sent_over_minimum": max(
                    sum(r["exact"]["sent"].values()) / sum(r["sent_minimum"].values()) for r in rows
                ),
            }
        rows = [r["counts"][1] for r in per_rank]
        bf16 = max(sum(r["bf16 exact"]["sent"].values()) for r in rows)
        fp8 = max(sum(r["bf16 fp8"]["sent"].values()) for r in rows)
        sent = {
            "bf16 exact": bf16,
            "bf16 fp8": fp8,
            "fp8_over_bf16": fp8 / bf16,
            "minimum_fp32": max(sum(r["sent_minimum"].values()) for r in rows),
        }
        time_rows = {
            name: {
                "ms": max(r["time"][name]["ms"] for r in per_rank),
                "rel_vs_blocking": max(r["time"][name]["rel_vs_blocking"] for r in per_rank),
            }
            for name in per_rank[0]["time"]
        }
        fp8_errors = {
            name: {key: max(r["fp8"][name][key] for r in per_rank) for key in per_rank[0]["fp8"][name]}
            for name in per_rank[0]["fp8"]
        }
        worlds[str(world)] = {"copies": copies, "sent": sent, "time": time_rows, "fp8": fp8_errors}
        if world == 2:
            models = {
                family: {
                    key: max(r["models"][family][key] for r in per_rank)
                    for key in per_rank[0]["models"][family]
                }
                for family in MODELS
            }
    results = {
        "seq": SEQ,
        "heads": HEADS,
        "dim": DIM,
        "text": TEXT,
        "repeats": REPEATS,
        "threads": torch.get_num_threads(),
        "worlds": worlds,
        "models": models,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ulysses_exchange.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "ulysses_exchange.png")
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import this module's functions
    from ulysses_exchange import main as _main  # noqa: E402  (the importable copy of this module)

    results = _main()
    for world, row in results["worlds"].items():
        for batch, c in row["copies"].items():
            print(
                f"u={world} B={batch}: copied {c['exact_max'] / 2**20:.2f} MiB = {c['exact_over_minimum']:.3f} x "
                f"minimum (overlap {c['overlap_over_minimum']:.3f} x); sent {c['sent_over_minimum']:.3f} x minimum"
            )
        print(f"u={world}: FP8 / bf16 bytes {row['sent']['fp8_over_bf16']:.4f}; time {row['time']}")
        print(f"u={world}: FP8 errors {row['fp8']}")
    print("tiny models, FP8 vs exact:", results["models"])
