"""Per-rank activation memory and bytes sent of a sequence-parallel TRAINING step of stock transformers decoders.

A stock ``Qwen3ForCausalLM`` (hidden ``C = 128``, 8 query heads and 4 key/value heads of 16, MLP 512, 2 layers,
vocabulary 2048) takes one training step (forward with ``labels``, backward) on ONE sample of
``S = 4096`` tokens in fp32, unpatched on one process, then with ``hfpatch.apply(model, parallel=...)`` on
N = 2 and 4 gloo ranks: Ulysses N, Ring N, Ulysses 2 x Ring 2, with the outputs gathered
(``sp_output="full"``, the default) and sharded (``sp_output="shard"``: sharded logits, loss summed over
ranks). Two inputs: one causal sequence, and 4 packed samples of 1024 tokens (position ids that restart:
transformers' packed mask, read tile by tile). Every rank reports:

- its peak live bytes during the step (``hfpatch.testing.memory.track_memory``: tensors created inside the
  step, so weights and inputs are not counted; parameter gradients are), over the unpatched peak;
- the loss and parameter-gradient error against the unpatched step (gradients averaged over the group);
- bytes sent per collective (``count_comm``) against the analytic minimum of the algorithm, per layer and
  step (forward + backward, ``L = ceil(S / N)`` tokens per rank, ``D`` head size, ``H``/``H_kv`` heads, key/value
  heads repeated to ``H_kv' = H_kv * kv_repeats``): Ulysses sends ``(u - 1) / u * L * D * (2 H + 2 H_kv')``
  values in forward (q, k, v in, output back) and the same in backward; Ring ``(r - 1)`` key/value blocks in
  forward, ``(r - 1)`` blocks plus ``r`` key/value gradient blocks in backward; the gather of the final hidden
  states ``(N - 1) * L * C`` (``sp_output="full"``) or of the per-rank loss sums ``(N - 1)`` values
  (``"shard"``); the same-input check one fixed table per step.

Qwen3-VL rows: ``Qwen3VLForConditionalGeneration`` (the same text model, a 2-layer vision tower of width 64)
on one sample with a 32-frame video (8192 patches, 2048 merged tokens) and an image, with the vision tower
split by frames over the ranks (``sp_vision="split"``, the default: the merged and DeepStack features are
all-gathered, their gradients reduce-scattered) and replicated (``"replicate"``); the vision tower's peak is
reported on its own.

Writes ``benchmarks/results/decoder_sp.json`` and ``.png``; a few minutes on two CPU cores.

    python benchmarks/decoder_sp.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import hfpatch
from hfpatch import ParallelConfig, all_reduce_gradients
from hfpatch.attention.layout import shard_len
from hfpatch.attention.masked import kv_repeats
from hfpatch.distributed.agreement import bytes_per_check
from hfpatch.distributed.collectives import count_comm
from hfpatch.testing import RankPool
from hfpatch.testing.memory import track_memory

RESULTS = Path(__file__).parent / "results"
MB = 2**20
TEXT = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=8192,
)
SEQ = 4096
PACKED = 4  # samples of SEQ / PACKED tokens in the packed input
VIDEO = (32, 16, 16)  # temporal patches, height and width patches: 8192 patches, 2048 merged tokens
CONFIGS = {2: [("ulysses", 2, 1), ("ring", 1, 2)], 4: [("ulysses", 4, 1), ("ring", 1, 4), ("2x2", 2, 2)]}


def build(kind: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The benchmark model (same weights on every rank) and its training inputs."""
    from hfpatch.testing import qwen3_vl_inputs, tiny_qwen3_causal_lm, tiny_qwen3_vl

    gen = torch.Generator().manual_seed(1)
    if kind == "vl":
        text = {k: v for k, v in TEXT.items() if k != "max_position_embeddings"}
        model = tiny_qwen3_vl(causal_lm=True, vision_overrides=dict(hidden_size=64, intermediate_size=128, out_hidden_size=128),
                              max_position_embeddings=8192, **text)  # fmt: skip
        batch = qwen3_vl_inputs([[("video", VIDEO), ("image", (1, 16, 16))]], text_len=64, seed=1)
        batch["labels"] = batch["input_ids"].clone()
        return model.train(), batch
    model = tiny_qwen3_causal_lm(**TEXT).train()
    ids = torch.randint(1, TEXT["vocab_size"], (1, SEQ), generator=gen)
    if kind == "causal":
        return model, dict(input_ids=ids, labels=ids, use_cache=False)
    positions = torch.arange(SEQ // PACKED).repeat(PACKED)[None]
    return model, dict(input_ids=ids, labels=ids, position_ids=positions, use_cache=False)


def step(model: torch.nn.Module, kwargs: dict[str, Any], patched: bool) -> dict[str, Any]:
    """One training step: peak bytes, bytes sent, loss, gradients, time (and the vision tower's peak)."""
    model.zero_grad(set_to_none=True)
    vision = getattr(getattr(model, "model", None), "visual", None)
    inside: dict[str, int] = {}
    with count_comm() as comm, track_memory() as mem:
        handles = []
        if vision is not None:

            def enter(_m, _a):
                inside["entry"] = mem.live_bytes
                inside["saved_peak"] = mem.peak_bytes
                mem.reset_peak()

            def leave(_m, _a, _o):
                inside["peak"] = mem.peak_bytes - inside["entry"]
                mem.peak_bytes = max(mem.peak_bytes, inside.pop("saved_peak"))

            handles = [vision.register_forward_pre_hook(enter), vision.register_forward_hook(leave)]
        start = time.perf_counter()
        loss = model(**kwargs).loss
        loss.backward()
        seconds = time.perf_counter() - start
        for handle in handles:
            handle.remove()
    if patched:
        all_reduce_gradients(model)  # what DDP does: not part of the sequence-parallel cost
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "peak": mem.peak_bytes,
        "vision_peak": inside.get("peak"),
        "sent": dict(comm.by_op),
        "loss": loss.item(),
        "grads": grads,
        "seconds": seconds,
    }


def measure(
    kind: str, ulysses: int, ring: int, output: str, vision: str, reference: dict[str, Any]
) -> dict[str, Any]:
    """On every rank: the patched step against the unpatched ``reference`` (loss, gradients)."""
    model, kwargs = build(kind)
    parallel = ParallelConfig(ulysses=ulysses, ring=ring)
    with hfpatch.apply(model, parallel=parallel, sp_output=output, sp_vision=vision):
        step(model, kwargs, patched=True)  # warm-up (first-call allocations, lazy imports)
        result = step(model, kwargs, patched=True)
    grads = result.pop("grads")
    scale = max(g.abs().max().item() for g in reference["grads"].values())
    result["grad_rel_error"] = (
        max((grads[n] - g).abs().max().item() for n, g in reference["grads"].items()) / scale
    )
    result["loss_rel_error"] = abs(result["loss"] - reference["loss"]) / abs(reference["loss"])
    return result


def tokens(kind: str) -> int:
    return build(kind)[1]["input_ids"].shape[1] if kind == "vl" else SEQ


def vision_rows(world: int) -> list[list[int]]:
    """Per vision call that ``sp_vision="split"`` cuts (a call with fewer frames than ranks runs replicated and
    sends nothing): the merged tokens each rank encodes."""
    from hfpatch.patches.decoder import frame_split

    batch = build("vl")[1]
    calls = []
    for key in ("image_grid_thw", "video_grid_thw"):
        grids = batch[key].tolist()
        pieces = frame_split(grids, world)
        if pieces is not None:
            calls.append([sum(n * grids[i][1] * grids[i][2] for i, _, n in run) // 4 for run in pieces])
    return calls


def analytic_bytes(
    kind: str, ulysses: int, ring: int, output: str, vision: str = "replicate"
) -> dict[str, int]:
    """Minimum bytes one rank sends in a training step, per collective kind (fp32)."""
    world, layers, d = ulysses * ring, TEXT["num_hidden_layers"], TEXT["head_dim"]
    heads, kv = TEXT["num_attention_heads"], TEXT["num_key_value_heads"]
    local = shard_len(tokens(kind), world)
    kv_expanded = kv * kv_repeats(heads, kv, ulysses)
    sent = {
        "all_to_all": 2 * layers * (ulysses - 1) * local * d * (2 * heads + 2 * kv_expanded) // ulysses * 4,
        # The ring passes [B, u L, H_kv' / u, D] key and value blocks: (r - 1) in forward, (r - 1) again plus
        # r gradient blocks in backward.
        "ring": layers * (3 * ring - 2) * 2 * local * kv_expanded * d * 4 if ring > 1 else 0,
        "all_gather": (world - 1) * (local * TEXT["hidden_size"] if output == "full" else 1) * 4,
        "guard": bytes_per_check(world),
    }
    if kind == "vl" and vision == "split":
        # The merged features and DeepStack's (one merger per deepstack index) all-gathered in forward, their
        # gradients reduce-scattered in backward: each rank sends every other rank's rows once each way.
        row_bytes = (
            TEXT["hidden_size"] * 4 * 2
        )  # the merger's output and the tiny tower's one DeepStack feature
        calls = vision_rows(world)
        sent["all_gather"] += (
            max(sum((world - 1) * rows[r] for rows in calls) for r in range(world)) * row_bytes
        )
        sent["reduce_scatter"] = (
            max(sum(sum(rows) - rows[r] for rows in calls) for r in range(world)) * row_bytes
        )
    return sent


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    fig, axes = plt.subplots(2, 1, figsize=(9, 8.6))
    ns = [1, 2, 4]
    ax = axes[0]
    ax.plot(ns, [1 / n for n in ns], "k:", label="ideal 1/N")
    series = [("causal", "full", None), ("causal", "shard", None), ("packed", "shard", None)]
    series += [("vl", "shard", "split"), ("vl", "shard", "replicate")]
    for (kind, output, vision), color in zip(series, ("C0", "C1", "C2", "C3", "C4")):
        for name, marker in (("ulysses", "o-"), ("ring", "s--"), ("2x2", "^")):
            key = (kind, output, vision, name)
            rows = [r for r in results["runs"] if (r["kind"], r["output"], r["sp_vision"], r["name"]) == key]
            if rows:
                label = f"{kind} {output}" + (f" vision {vision}" if vision else "") + f" {name}"
                ns_run = [1] + [r["N"] for r in rows]
                peaks = [1.0] + [r["peak_over_unpatched"] for r in rows]
                ax.plot(ns_run, peaks, marker, color=color, label=label)
    ax.set(xlabel="ranks N", ylabel="per-rank peak / unpatched (training step)", xticks=ns, yscale="log")
    ax.set_title(f"stock Qwen3ForCausalLM (S={SEQ}) / Qwen3-VL (video), C=128, 2 layers, fp32")
    ax.legend(ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=9)
    ax = axes[1]
    runs = [r for r in results["runs"] if r["kind"] in ("causal", "vl") and r["sp_vision"] != "replicate"]
    x = list(range(len(runs)))
    bottom = [0.0] * len(runs)
    ops = (
        ("all_to_all", "C0"),
        ("ring", "C1"),
        ("all_gather", "C2"),
        ("reduce_scatter", "C4"),
        ("guard", "C3"),
    )
    for op, color in ops:
        heights = [r["sent_by_op_max"].get(op, 0) / MB for r in runs]
        ax.bar([i - 0.2 for i in x], heights, 0.4, bottom=bottom, color=color, label=f"measured {op}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.bar([i + 0.2 for i in x], [r["analytic"] / MB for r in runs], 0.4, color="0.6", label="analytic")
    labels = [f"{r['kind']} {r['output']} {r['name']}, N={r['N']}" for r in runs]
    ax.set_xticks(x, labels, rotation=60, ha="right")
    ax.set(ylabel="bytes sent per rank, one training step (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    runs, unpatched = [], {}
    references = {}
    for kind in ("causal", "packed", "vl"):
        model, kwargs = build(kind)
        step(model, kwargs, patched=False)  # warm-up
        references[kind] = step(model, kwargs, patched=False)
        ref = references[kind]
        unpatched[kind] = {
            "tokens": tokens(kind),
            "peak": ref["peak"],
            "vision_peak": ref["vision_peak"],
            "seconds": ref["seconds"],
            "loss": ref["loss"],
            "full_hidden_bytes": tokens(kind) * TEXT["hidden_size"] * 4,
            "full_logits_bytes": tokens(kind) * TEXT["vocab_size"] * 4,
        }
    for world, configs in CONFIGS.items():
        with RankPool(world, timeout_s=900) as pool:
            for kind, output, vision in [
                ("causal", "full", "split"),
                ("causal", "shard", "split"),
                ("packed", "shard", "split"),
                ("vl", "shard", "split"),
                ("vl", "shard", "replicate"),
            ]:
                if True:
                    for name, ulysses, ring in configs:
                        per_rank = pool.run(measure, kind, ulysses, ring, output, vision, references[kind])
                        analytic = analytic_bytes(kind, ulysses, ring, output, vision)
                        ops = sorted({op for r in per_rank for op in r["sent"]} | set(analytic))
                        sent = max(sum(r["sent"].values()) for r in per_rank)
                        peak = max(r["peak"] for r in per_rank)
                        runs.append(
                            {
                                "kind": kind,
                                "output": output,
                                "sp_vision": vision if kind == "vl" else None,
                                "name": name,
                                "N": world,
                                "ulysses": ulysses,
                                "ring": ring,
                                "peak_per_rank": [r["peak"] for r in per_rank],
                                "peak_max": peak,
                                "peak_over_unpatched": peak / unpatched[kind]["peak"],
                                "vision_peak": per_rank[0]["vision_peak"],
                                "loss_rel_error": max(r["loss_rel_error"] for r in per_rank),
                                "grad_rel_error": max(r["grad_rel_error"] for r in per_rank),
                                "seconds_max": max(r["seconds"] for r in per_rank),
                                "sent_by_op_max": {
                                    op: max(r["sent"].get(op, 0) for r in per_rank) for op in ops
                                },
                                "sent_max": sent,
                                "analytic_by_op": analytic,
                                "analytic": sum(analytic.values()),
                                "sent_over_analytic": sent / sum(analytic.values()),
                            }
                        )
    results = {
        "model": "transformers Qwen3ForCausalLM / Qwen3VLForConditionalGeneration (hfpatch.testing tiny builders)",
        "config": {
            **TEXT,
            "seq": SEQ,
            "packed_samples": PACKED,
            "video_grid": list(VIDEO),
            "dtype": "float32",
        },
        "mode": "training step: forward with labels + backward (+ all_reduce_gradients when patched)",
        "unpatched": unpatched,
        "runs": runs,
        "note": "seconds are wall time on a shared 2-core CPU with N gloo processes: not a speed claim",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decoder_sp.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "decoder_sp.png")
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import measure from this file
    from decoder_sp import main as _main  # noqa: E402  (the importable copy of this module)

    res = _main()
    for kind, ref in res["unpatched"].items():
        print(f"{kind}: S={ref['tokens']}, unpatched peak {ref['peak'] / MB:.2f} MiB"
              + (f" (vision tower {ref['vision_peak'] / MB:.2f} MiB)" if ref["vision_peak"] else ""))  # fmt: skip
    for run in res["runs"]:
        print(
            f"{run['kind']:6s} {run['output']:5s} {str(run['sp_vision']):9s} {run['name']:7s} N={run['N']}: peak "
            f"{run['peak_over_unpatched']:.3f} x unpatched; loss err {run['loss_rel_error']:.1e}, grad err "
            f"{run['grad_rel_error']:.1e}; sent {run['sent_max'] / MB:6.2f} MiB = {run['sent_over_analytic']:.3f} x "
            f"analytic {run['sent_by_op_max']}"
        )
