"""Weights sharded over ranks (``shard_weights=True``, FSDP2): per-rank parameter bytes, peak memory and
all-gather bytes of one transformer forward, vs N, against the analytic figures.

A stock ``WanTransformer3DModel`` (``hfpatch.testing.tiny_wan_transformer``: 8 heads of 16, hidden ``C = 128``,
``ffn_dim = 4 C``, 8 blocks, text width 128) and a stock ``T5EncoderModel`` text encoder (``d_model = 128``,
``d_ff = 512``, 4 blocks) run in fp32 under ``torch.no_grad()`` on N = 2, 3 and 4 gloo ranks, the
transformer with ``hfpatch.apply(model, parallel=N)`` (Ulysses up to the 8 heads, the rest Ring: N = 3 is
Ring 3) with and without ``shard_weights=True``, on a latent ``[1, 4, 4, 16, 16]`` (256 tokens). Every rank
reports:

- **parameter bytes at rest** (``hfpatch.patches.fsdp.parameter_bytes``: the local shard storage, FSDP2's
  padding included) against the analytic ``sum_p ceil(rows_p / N) * row_bytes_p`` (FSDP2 shards dim 0 and
  pads it to a multiple of N) and the ideal ``1/N``;
- **peak memory of one forward**: the weights at rest plus the peak of every tensor the call creates
  (all-gathered blocks and activations; ``hfpatch.testing.memory``'s tracker, counting each storage at its
  current size because FSDP2 frees a gathered block by resizing its storages to 0), sharded and not;
- **gathered parameter bytes**: the most full (all-gathered) parameter bytes held at any module entry/exit,
  against the analytic bound ``padded(root unit) + padded(largest block)``;
- **all-gather bytes sent** in one forward (FSDP2's ``_allgather_base_`` calls, seen by a dispatch mode:
  ``(N - 1)`` times each rank's input) against the analytic ``(N - 1) * at rest`` (every unit gathered once);
- whether the sharded output equals the unsharded one bit for bit.

Writes ``benchmarks/results/fsdp.json`` and ``.png``; about a minute on two CPU cores.

    python benchmarks/fsdp.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hfpatch
from hfpatch.patches.fsdp import GatheredPeak, parameter_bytes, shard_units
from hfpatch.testing import RankPool, tiny_t5_encoder, tiny_wan_transformer
from hfpatch.testing.memory import MemoryTracker, track_memory

RESULTS = Path(__file__).parent / "results"
HEADS, HEAD_DIM, LAYERS, TEXT = 8, 16, 8, 128
HIDDEN = HEADS * HEAD_DIM
LATENT = (1, 4, 4, 16, 16)  # [B, C, F, H, W] -> 4 * 8 * 8 = 256 tokens
WORLDS = (2, 3, 4)
MB = 2**20


def build() -> tuple[torch.nn.Module, torch.nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    """The transformer and the text encoder (same weights on every rank), the forward kwargs, token ids."""
    transformer = tiny_wan_transformer(
        num_heads=HEADS, head_dim=HEAD_DIM, num_layers=LAYERS, ffn_dim=4 * HIDDEN, text_dim=TEXT
    )
    encoder = tiny_t5_encoder(d_model=TEXT, d_kv=32, d_ff=4 * TEXT, num_layers=4, num_heads=4)
    ids = torch.randint(2, encoder.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        text = encoder(ids).last_hidden_state
    kwargs = dict(
        hidden_states=torch.randn(*LATENT, generator=torch.Generator().manual_seed(1)),
        timestep=torch.tensor([500]),
        encoder_hidden_states=text,
    )
    return transformer, encoder, kwargs, ids


# ----------------------------------------------------------------------------------------------- analytic
def _padded(params: list[torch.nn.Parameter], n: int) -> int:
    """Bytes of ``params`` as FSDP2 holds them gathered over ``n`` ranks: dim 0 padded to a multiple of ``n``."""
    return sum(-(-p.shape[0] // n) * n * (p.numel() // p.shape[0]) * p.element_size() for p in params)


def analytic(model: torch.nn.Module, n: int) -> dict[str, int]:
    """Per-rank bytes at rest, the gathered bound (root unit + largest block) and all-gather bytes sent."""
    units = [list(unit.parameters()) for _, unit in shard_units(model)]
    inside = {id(p) for unit in units for p in unit}
    root = [p for p in model.parameters() if id(p) not in inside]
    at_rest = _padded(list(model.parameters()), n) // n
    return {
        "at_rest": at_rest,
        "gathered_bound": _padded(root, n) + max(_padded(u, n) for u in units),
        "all_gather_sent": (n - 1) * at_rest,  # every unit gathered once per forward, ring all-gather
    }


# ----------------------------------------------------------------------------------------------- measuring
class _AllGatherBytes(TorchDispatchMode):
    """Bytes this rank sends in the all-gathers over ``model``'s shard group (FSDP2's ``_allgather_base_``;
    hfpatch's own collectives run over other groups): ``(N - 1)`` times its input, per call."""

    def __init__(self, model: torch.nn.Module) -> None:
        import torch.distributed as dist

        super().__init__()
        group = next(model.parameters()).device_mesh.get_group()
        self.name, self.world, self.sent, self.calls = group.group_name, dist.get_world_size(group), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch.distributed as dist

        if "_allgather_base_" in str(func) and dist.ProcessGroup.unbox(args[2]).group_name == self.name:
            self.sent += (self.world - 1) * args[1].numel() * args[1].element_size()
            self.calls += 1
        return func(*args, **(kwargs or {}))


class _ResizeAwareTracker(MemoryTracker):
    """:class:`hfpatch.testing.memory.MemoryTracker` that counts each tracked storage at its CURRENT size.

    FSDP2 frees a gathered block by resizing its storages to 0 and re-grows them for the next gather
    (``untyped_storage().resize_``, which no dispatch mode sees), so a tracker that counts a storage from its
    creation to its destruction would keep every gathered block alive. After every op this one sums the
    current sizes of the storages it tracks (a re-grown storage is seen at the copy that fills it).
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.live_bytes = sum(storage.nbytes() for storage in list(self._seen.keys()))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out

    def _release(self, nbytes: int) -> None:  # live_bytes is recomputed from the storages that remain
        pass


def _forward(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[torch.Tensor, int]:
    with torch.no_grad(), _ResizeAwareTracker() as mem:
        out = model(**kwargs).sample
    return out, mem.peak_bytes


def plan(world: int) -> hfpatch.ParallelConfig:
    """Sequence parallel over every rank: Ulysses where it divides the heads, else Ring."""
    return hfpatch.ParallelConfig(ulysses=world) if HEADS % world == 0 else hfpatch.ParallelConfig(ring=world)


def measure() -> dict[str, Any]:
    """One rank: a ``WanPipeline`` holding the transformer and the text encoder, with and without
    ``shard_weights``; one transformer forward and one text-encoder forward measured."""
    import torch.distributed as dist
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from hfpatch.testing import tiny_t5_tokenizer, tiny_wan_vae

    torch.set_num_threads(1)
    world = dist.get_world_size()
    transformer, encoder, kwargs, ids = build()
    pipe = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=encoder,
        vae=tiny_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        transformer=transformer,
    )
    full = {"transformer": parameter_bytes(transformer), "text_encoder": parameter_bytes(encoder)}
    expected = {"transformer": analytic(transformer, world), "text_encoder": analytic(encoder, world)}
    with hfpatch.apply(pipe, parallel=plan(world)):
        unsharded, unsharded_peak = _forward(transformer, kwargs)
    with hfpatch.apply(pipe, parallel=plan(world), shard_weights=True):
        at_rest = parameter_bytes(transformer)
        encoder_at_rest = parameter_bytes(encoder)
        peaks = GatheredPeak(transformer)
        with _AllGatherBytes(transformer) as comm:
            out, sharded_peak = _forward(transformer, kwargs)
        gathered = peaks.close()
        with _AllGatherBytes(encoder) as encoder_comm, torch.no_grad():
            encoder(ids)
    return {
        "plan": repr(plan(world)),
        "exact": bool(torch.equal(out, unsharded)),
        "transformer": {
            "full": full["transformer"],
            "at_rest": at_rest,
            "analytic": expected["transformer"],
            "peak_unsharded": full["transformer"] + unsharded_peak,
            "peak_sharded": at_rest + sharded_peak,
            "call_peak_unsharded": unsharded_peak,
            "call_peak_sharded": sharded_peak,
            "gathered": gathered,
            "all_gather_sent": comm.sent,
            "all_gathers": comm.calls,
        },
        "text_encoder": {
            "full": full["text_encoder"],
            "at_rest": encoder_at_rest,
            "analytic": expected["text_encoder"],
            "all_gather_sent": encoder_comm.sent,
            "all_gathers": encoder_comm.calls,
        },
    }


# ----------------------------------------------------------------------------------------------- report
def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    runs = results["runs"]
    ns = [1] + [r["N"] for r in runs]
    fig, (ax_rest, ax_peak, ax_comm) = plt.subplots(3, 1, figsize=(9, 12.9))
    for model, color in (("transformer", "C0"), ("text_encoder", "C1")):
        whole = results["unsharded"][model] / MB
        ax_rest.plot(ns, [whole / n for n in ns], ":", color=color, label=f"{model}: ideal 1/N")
        ax_rest.plot(
            ns,
            [whole] + [r[model]["analytic"]["at_rest"] / MB for r in runs],
            "x",
            color=color,
            ms=9,
            label=f"{model}: analytic (padded)",
        )
        ax_rest.plot(
            ns,
            [whole] + [r[model]["at_rest_max"] / MB for r in runs],
            "o-",
            color=color,
            alpha=0.7,
            label=f"{model}: measured",
        )
    ax_rest.set(xlabel="ranks N", ylabel="parameter bytes per rank, at rest (MiB)", xticks=ns, yscale="log")
    ax_rest.set_title("stock Wan transformer (8 blocks, C=128) + T5 encoder (4 blocks), fp32")
    ax_rest.legend()
    t = "transformer"
    ax_peak.plot(
        ns,
        [results["unsharded"]["peak"] / MB] + [r[t]["peak_unsharded_max"] / MB for r in runs],
        "s-",
        label="sequence parallel, weights replicated",
    )
    ax_peak.plot(
        ns,
        [results["unsharded"]["peak"] / MB] + [r[t]["peak_sharded_max"] / MB for r in runs],
        "o-",
        label="sequence parallel + shard_weights",
    )
    ax_peak.plot(
        ns[1:], [r[t]["at_rest_max"] / MB for r in runs], "o:", alpha=0.6, label="  of which weights at rest"
    )
    ax_peak.set(xlabel="ranks N", ylabel="per-rank peak: weights + one forward (MiB)", xticks=ns)
    ax_peak.set_title(f"one transformer forward, {LATENT} latent (256 tokens)")
    ax_peak.legend()
    x = list(range(len(runs)))
    for offset, (model, color) in zip((-0.2, 0.2), (("transformer", "C0"), ("text_encoder", "C1"))):
        ax_comm.bar(
            [i + offset - 0.1 for i in x],
            [r[model]["all_gather_sent_max"] / MB for r in runs],
            0.2,
            color=color,
            label=f"{model}: measured",
        )
        ax_comm.bar(
            [i + offset + 0.1 for i in x],
            [r[model]["analytic"]["all_gather_sent"] / MB for r in runs],
            0.2,
            color=color,
            alpha=0.4,
            label=f"{model}: analytic",
        )
    ax_comm.set_xticks(x, [f"N={r['N']}" for r in runs])
    ax_comm.set(ylabel="all-gather bytes sent per rank, one forward (MiB)")
    ax_comm.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    transformer, encoder, kwargs, _ = build()
    with torch.no_grad(), track_memory() as mem:
        transformer(**kwargs)
    results: dict[str, Any] = {
        "model": f"diffusers WanTransformer3DModel (C={HIDDEN}, {LAYERS} blocks) + transformers T5EncoderModel",
        "latent": list(LATENT),
        "unsharded": {
            "transformer": parameter_bytes(transformer),
            "text_encoder": parameter_bytes(encoder),
            "call_peak": mem.peak_bytes,
            "peak": parameter_bytes(transformer) + mem.peak_bytes,
        },
        "runs": [],
    }
    for world in WORLDS:
        with RankPool(world, timeout_s=600) as pool:
            per_rank = pool.run(measure)
        row: dict[str, Any] = {
            "N": world,
            "plan": per_rank[0]["plan"],
            "exact": all(r["exact"] for r in per_rank),
        }
        for model in ("transformer", "text_encoder"):
            first = per_rank[0][model]
            summary = {"analytic": first["analytic"], "full": first["full"]}
            for key, value in first.items():
                if isinstance(value, int) and key != "full":
                    summary[f"{key}_max"] = max(r[model][key] for r in per_rank)
            summary["at_rest_over_full"] = summary["at_rest_max"] / first["full"]
            summary["at_rest_over_analytic"] = summary["at_rest_max"] / first["analytic"]["at_rest"]
            summary["all_gather_over_analytic"] = (
                summary["all_gather_sent_max"] / first["analytic"]["all_gather_sent"]
            )
            row[model] = summary
        t = row["transformer"]
        t["gathered_over_bound"] = t["gathered_max"] / t["analytic"]["gathered_bound"]
        t["peak_sharded_over_unsharded"] = t["peak_sharded_max"] / t["peak_unsharded_max"]
        results["runs"].append(row)
        print(
            f"N={world} {row['plan']}: transformer at rest {t['at_rest_max'] / MB:.3f} MiB "
            f"({t['at_rest_over_full']:.3f} of {t['full'] / MB:.2f}; analytic x{t['at_rest_over_analytic']:.3f}), "
            f"gathered {t['gathered_max'] / MB:.3f} MiB (bound x{t['gathered_over_bound']:.3f}), peak "
            f"{t['peak_unsharded_max'] / MB:.2f} -> {t['peak_sharded_max'] / MB:.2f} MiB, all-gather "
            f"{t['all_gather_sent_max'] / MB:.3f} MiB (analytic x{t['all_gather_over_analytic']:.3f}); text encoder "
            f"at rest {row['text_encoder']['at_rest_over_full']:.3f}; exact {row['exact']}"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fsdp.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "fsdp.png")
    return results


if __name__ == "__main__":
    main()
