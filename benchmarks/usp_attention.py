"""Per-rank activation memory and bytes sent of sequence-parallel attention (Ulysses, Ring, USP) vs N.

One long sequence (S=4096, H=8, D=64, fp32, batch 1) is sharded over N = 1, 2, 4 gloo ranks with the
shared layout; every rank runs, under ``no_grad`` (inference), on its shard:

- ``usp_attention`` alone, counting bytes sent (``count_comm``) against the analytic minimum: Ulysses
  ``4 (u-1)/u`` of the local ``[B, S/N, H, D]`` tensor (q, k, v in, out back), Ring ``(r-1)`` K/V block
  sends (a block has the size of the local tensor);
- a DiT-style block (pre-norm attention through ``usp_attention`` + output projection, pre-norm 4x GELU
  MLP, ``C = H * D = 512``): per-rank peak activation bytes vs the unpatched block on one rank (stock
  ``F.scaled_dot_product_attention``). Target: at most 1.2/N.

Peaks are live bytes of tensors created during the call (``hfpatch.testing.memory.track_memory``; inputs
and weights are not counted). The attention op alone is reported too: its only unpatched activation is the
output, while sequence parallelism must hold resharded q/k/v (Ulysses) or the K/V block in flight and an
accumulator (Ring), so at the op level the per-rank figure is about 4/N of the single-rank one; in a block
those buffers are smaller than the MLP activations and the per-rank peak scales as 1/N.

Writes ``benchmarks/results/usp_attention.json`` and ``.png``; a minute or two on two CPU cores.

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
MARKERS = {"ulysses": "o-", "ring": "s-", "usp 2x2": "^"}


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unpatched attention as a diffusers processor calls it on ``[B, S, H, D]`` tensors."""
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def _block(x: torch.Tensor, weights: list[torch.Tensor], attention) -> torch.Tensor:
    """A DiT-style block on ``[B, S, C]`` tokens: pre-norm attention, then a pre-norm 4x GELU MLP."""
    wq, wk, wv, wo, w1, w2 = weights
    h = F.layer_norm(x, x.shape[-1:])
    q, k, v = ((h @ w).unflatten(-1, (HEADS, DIM)) for w in (wq, wk, wv))
    out = attention(q, k, v)
    x = x + out.flatten(2) @ wo
    return x + F.gelu(F.layer_norm(x, x.shape[-1:]) @ w1) @ w2


def _measure(ring: int, ulysses: int) -> dict:
    """On every rank: peak bytes and bytes sent of inference attention and of a DiT block on its shard."""
    world = ring * ulysses
    mesh = get_mesh(ParallelConfig(ring=ring, ulysses=ulysses))
    ring_group, ulysses_group = mesh.group("ring"), mesh.group("ulysses")
    index = sp_index(group_rank(ring_group), group_rank(ulysses_group), ulysses)
    gen = torch.Generator().manual_seed(index)
    length, width = shard_len(SEQ, world), HEADS * DIM
    q, k, v = (torch.randn(1, length, HEADS, DIM, generator=gen) for _ in range(3))
    x = torch.randn(1, length, width, generator=gen)
    weights = [torch.randn(width, width * m, generator=torch.Generator().manual_seed(i)) / width**0.5
               for i, m in enumerate((1, 1, 1, 1, 4))]  # fmt: skip
    weights.append(
        torch.randn(4 * width, width, generator=torch.Generator().manual_seed(9)) / (4 * width) ** 0.5
    )

    def usp(q, k, v):
        return usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group)[0]

    result = {}
    with torch.no_grad():
        with count_comm() as comm, track_memory() as mem:
            usp(q, k, v)
        result.update(attention=mem.peak_bytes, sent=comm.by_op)
        with track_memory() as mem:
            _block(x, weights, usp)
        result["block"] = mem.peak_bytes
        if world == 1:  # the unpatched baselines
            with track_memory() as mem:
                _sdpa(q, k, v)
            result["attention_unpatched"] = mem.peak_bytes
            with track_memory() as mem:
                _block(x, weights, _sdpa)
            result["block_unpatched"] = mem.peak_bytes
    local = q.numel() * q.element_size()  # one [B, S/N, H, D] tensor; a ring block has the same size
    result["analytic"] = {"all_to_all": 4 * (ulysses - 1) * local // ulysses, "ring": (ring - 1) * 2 * local}
    return result


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    base = results["block_unpatched"] / MB
    ns = [1, 2, 4]
    fig, (ax_mem, ax_op, ax_comm) = plt.subplots(3, 1, figsize=(9, 12.9))
    ax_mem.plot(ns, [base / n for n in ns], "k:", label="ideal 1/N")
    ax_mem.plot(ns, [1.2 * base / n for n in ns], "k--", alpha=0.5, label="target 1.2/N")
    single = [r for r in results["runs"] if r["N"] == 1]
    for name, marker in MARKERS.items():
        rows = single + [r for r in results["runs"] if r["name"] == name]
        ax_mem.plot([r["N"] for r in rows], [r["block_peak_max"] / MB for r in rows], marker, label=name)
    ax_mem.set(xlabel="ranks N", ylabel="per-rank peak activation (MiB)", xticks=ns, yscale="log")
    ax_mem.set_title(f"DiT block, S={SEQ}, H={HEADS}, D={DIM}, fp32, inference", fontsize=10)
    ax_mem.legend()
    op_base = results["attention_unpatched"] / MB
    ax_op.axhline(op_base, color="k", ls=":", label="unpatched (output only)")
    for name, marker in MARKERS.items():
        rows = single + [r for r in results["runs"] if r["name"] == name]
        ax_op.plot([r["N"] for r in rows], [r["attention_peak_max"] / MB for r in rows], marker, label=name)
    ax_op.set(xlabel="ranks N", ylabel="per-rank peak activation (MiB)", xticks=ns)
    ax_op.set_title("attention op alone: resharded q/k/v or K/V in flight", fontsize=10)
    ax_op.legend()
    runs = [r for r in results["runs"] if r["N"] > 1]
    x = list(range(len(runs)))
    ax_comm.bar([i - 0.2 for i in x], [r["sent_max"] / MB for r in runs], 0.4, label="measured")
    ax_comm.bar([i + 0.2 for i in x], [r["analytic"] / MB for r in runs], 0.4, label="analytic minimum")
    ax_comm.set_xticks(x, [f"{r['name']}\nN={r['N']}" for r in runs])
    ax_comm.set(ylabel="bytes sent per rank, attention forward (MiB)")
    ax_comm.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> dict:
    runs, unpatched = [], {}
    for world, configs in CONFIGS.items():
        with RankPool(world, timeout_s=600) as pool:
            for name, ring, ulysses in configs:
                per_rank = pool.run(_measure, ring, ulysses)
                if world == 1:
                    unpatched = {key: per_rank[0][f"{key}_unpatched"] for key in ("attention", "block")}
                sent = max(sum(r["sent"].values()) for r in per_rank)
                analytic = sum(per_rank[0]["analytic"].values())
                runs.append(
                    {
                        "name": name,
                        "N": world,
                        "ring": ring,
                        "ulysses": ulysses,
                        "block_peak_per_rank": [r["block"] for r in per_rank],
                        "block_peak_max": max(r["block"] for r in per_rank),
                        "attention_peak_max": max(r["attention"] for r in per_rank),
                        "sent_by_op_rank0": per_rank[0]["sent"],
                        "sent_max": sent,
                        "analytic": analytic,
                        "sent_over_analytic": sent / analytic if analytic else None,
                    }
                )
    for run in runs:
        run["block_over_unpatched"] = run["block_peak_max"] / unpatched["block"]
        run["attention_over_unpatched"] = run["attention_peak_max"] / unpatched["attention"]
        run["target"] = 1.2 / run["N"]
    results = {
        "seq": SEQ,
        "heads": HEADS,
        "dim": DIM,
        "block_unpatched": unpatched["block"],
        "attention_unpatched": unpatched["attention"],
        "runs": runs,
    }
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
            f"{run['name']:8s} N={run['N']}: block peak {run['block_peak_max'] / MB:6.1f} MiB = "
            f"{run['block_over_unpatched']:.3f} x unpatched (target <= {run['target']:.2f}); attention alone "
            f"{run['attention_over_unpatched']:.2f} x; sent {run['sent_max'] / MB:5.2f} MiB"
            + (f" = {ratio:.3f} x analytic" if ratio else "")
        )
