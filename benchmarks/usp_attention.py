"""Per-rank activation memory and bytes sent of sequence-parallel attention (Ulysses, Ring, USP) vs N.

One long sequence (S=4096, H=8, D=64, fp32, batch 1) is sharded over N = 1, 2, 4 gloo ranks with the
shared layout; every rank runs ``usp_attention`` on its shard under ``no_grad`` (inference) and reports

- peak live bytes of tensors created during the call (``hfpatch.testing.memory.track_memory``; the
  rank's q/k/v shards are inputs and not counted, as in the single-rank baseline);
- bytes it sent (``count_comm``) vs the analytic minimum: Ulysses ``4 (u-1)/u`` of the local tensor
  (q, k, v in, out back), Ring ``(r-1)`` K/V block sends.

The single-rank baseline is stock ``F.scaled_dot_product_attention`` on the whole sequence in the layout a
diffusers processor gives it (``[B, S, H, D]`` transposed; the CPU kernel copies q/k/v into its layout),
and ``usp_attention`` with no groups (same figure). Target: per-rank peak <= 1.2/N of it. Writes
``benchmarks/results/usp_attention.json`` and ``.png``; about a minute on two CPU cores.

    python benchmarks/usp_attention.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from hfpatch.attention import usp_attention
from hfpatch.attention.layout import group_rank, shard_len, sp_index
from hfpatch.core.config import ParallelConfig
from hfpatch.distributed.collectives import count_comm
from hfpatch.distributed.runtime import get_mesh
from hfpatch.testing import RankPool
from hfpatch.testing.memory import track_memory

RESULTS = Path(__file__).parent / "results"
SEQ, HEADS, DIM = 4096, 8, 64
MB = 2**20
# (name, ring, ulysses) per world size.
CONFIGS = {
    1: [("single", 1, 1)],
    2: [("ulysses", 1, 2), ("ring", 2, 1)],
    4: [("ulysses", 1, 4), ("ring", 4, 1), ("usp 2x2", 2, 2)],
}


def _measure(ring: int, ulysses: int) -> dict:
    """On every rank: peak bytes and bytes sent of one inference ``usp_attention`` call on its shard."""
    world = ring * ulysses
    mesh = get_mesh(ParallelConfig(ring=ring, ulysses=ulysses))
    ring_group, ulysses_group = mesh.group("ring"), mesh.group("ulysses")
    index = sp_index(group_rank(ring_group), group_rank(ulysses_group), ulysses)
    gen = torch.Generator().manual_seed(index)
    q, k, v = (torch.randn(1, shard_len(SEQ, world), HEADS, DIM, generator=gen) for _ in range(3))
    with torch.no_grad():
        with count_comm() as comm, track_memory() as mem:
            usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group)
        result = {"peak_bytes": mem.peak_bytes, "sent": comm.by_op}
        if world == 1:
            with track_memory() as mem:
                F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
            result["sdpa_peak_bytes"] = mem.peak_bytes
    local = q.numel() * q.element_size()  # one [B, S/N, H, D] tensor; a ring block has the same size
    result["analytic"] = {"all_to_all": 4 * (ulysses - 1) * local // ulysses, "ring": (ring - 1) * 2 * local}
    return result


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results["baseline_peak_bytes"] / MB
    fig, (ax_mem, ax_comm) = plt.subplots(1, 2, figsize=(11, 4.2))
    ns = [1, 2, 4]
    ax_mem.plot(ns, [base / n for n in ns], "k:", label="ideal 1/N")
    ax_mem.plot(ns, [1.2 * base / n for n in ns], "k--", alpha=0.5, label="target 1.2/N")
    for name, marker in (("ulysses", "o-"), ("ring", "s-"), ("usp 2x2", "^")):
        rows = [r for r in results["runs"] if r["name"] in (name, "single")]
        ax_mem.plot([r["N"] for r in rows], [r["peak_bytes_max"] / MB for r in rows], marker, label=name)
    ax_mem.set(xlabel="ranks N", ylabel="per-rank peak activation (MiB)", xticks=ns, yscale="log")
    ax_mem.set_title(f"attention S={SEQ}, H={HEADS}, D={DIM}, fp32, inference")
    ax_mem.legend(fontsize=8)
    runs = [r for r in results["runs"] if r["N"] > 1]
    labels = [f"{r['name']}\nN={r['N']}" for r in runs]
    x = range(len(runs))
    ax_comm.bar([i - 0.2 for i in x], [r["sent_bytes_max"] / MB for r in runs], 0.4, label="measured")
    ax_comm.bar([i + 0.2 for i in x], [r["analytic_bytes"] / MB for r in runs], 0.4, label="analytic minimum")
    ax_comm.set_xticks(list(x), labels, fontsize=8)
    ax_comm.set(ylabel="bytes sent per rank, forward (MiB)")
    ax_comm.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> dict:
    runs, baseline = [], None
    for world, configs in CONFIGS.items():
        with RankPool(world, timeout_s=600) as pool:
            for name, ring, ulysses in configs:
                per_rank = pool.run(_measure, ring, ulysses)
                if world == 1:
                    baseline = per_rank[0]["sdpa_peak_bytes"]
                sent = [sum(r["sent"].values()) for r in per_rank]
                analytic = sum(per_rank[0]["analytic"].values())
                runs.append(
                    {
                        "name": name,
                        "N": world,
                        "ring": ring,
                        "ulysses": ulysses,
                        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
                        "peak_bytes_max": max(r["peak_bytes"] for r in per_rank),
                        "sent_by_op_rank0": per_rank[0]["sent"],
                        "sent_bytes_max": max(sent),
                        "analytic_bytes": analytic,
                        "sent_over_analytic": max(sent) / analytic if analytic else None,
                    }
                )
    for run in runs:
        run["peak_over_baseline"] = run["peak_bytes_max"] / baseline
        run["peak_target"] = 1.2 / run["N"]
    results = {"seq": SEQ, "heads": HEADS, "dim": DIM, "baseline_peak_bytes": baseline, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "usp_attention.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "usp_attention.png")
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import _measure from this file
    from usp_attention import main as _main  # noqa: E402  (the importable copy of this module)

    for run in _main()["runs"]:
        ratio = run["sent_over_analytic"]
        print(
            f"{run['name']:8s} N={run['N']}: peak {run['peak_bytes_max'] / MB:6.2f} MiB "
            f"= {run['peak_over_baseline']:.3f} x single (target <= {run['peak_target']:.3f}); "
            f"sent {run['sent_bytes_max'] / MB:6.2f} MiB"
            + (f" = {ratio:.3f} x analytic" if ratio else "")
        )
