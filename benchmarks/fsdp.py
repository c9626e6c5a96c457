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

**Loading** (``load_rows``): the same transformer and text encoder saved in a ``WanPipeline`` folder
(``save_pretrained(max_shard_size="1MB")``: the transformer in 9 safetensors shards with an index) and loaded with
``hfpatch.from_pretrained(folder, N, shard_weights=True)`` at N = 2, 3, 4: every rank's peak host bytes during
the load, measured as the peak of live tensor bytes (``hfpatch.testing.memory``'s tracker, DTensor local shards
and the slices read included: they are plain tensors, no file is mapped), against ``1.2 / N`` of the two models
plus their largest tensor, and the shards each rank keeps. The N = 1 row is the whole of the two models: what
every rank holds when it loads whole and then shards (``DiffusionPipeline.from_pretrained`` + ``hfpatch.apply``).
The VAE, scheduler and tokenizer load whole on every rank either way and are in neither figure.

**Resident set and the full check** (``resident_rows``): the measure users see, on a checkpoint large enough for
it (the same classes at width 512, 8 blocks, ``ffn_dim`` 2048: a 142 MiB transformer in 20 MB shards, and the
text encoder): the process's peak resident set (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``, above
the resident set before the call, after a first load has paid the imports) of ``hfpatch.from_pretrained(folder,
N, shard_weights=True)`` and of loading whole then sharding (``DiffusionPipeline.from_pretrained`` +
``hfpatch.apply``), against ``1.2 / N`` of the two models plus their largest tensor plus what loading the other
components costs in the same measure (the pipeline loaded without the transformer and encoder); and the time of
the full same-bytes check (``check_files="full"``: ``hfpatch.loading.files.agree_contents``, the slowest rank;
the node's ranks split the files) per GB of the files checked, the files in the page cache (a cold read adds the
disk's time), with one process hashing them all (``sha256_file``) for reference.

Writes ``benchmarks/results/fsdp.json`` and ``.png``; a few minutes on two CPU cores.

    python benchmarks/fsdp.py
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hfpatch
from hfpatch.patches.fsdp import GatheredPeak, parameter_bytes, shard_units
from hfpatch.testing import RankPool, tiny_t5_encoder, tiny_wan_transformer
from hfpatch.testing.memory import MemoryTracker, resident_peak, track_memory

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
        storages = [ref() for ref, _ in list(self._seen.values())]
        self.live_bytes = sum(storage.nbytes() for storage in storages if storage is not None)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out

    def _release(self, key: int) -> None:  # live_bytes is recomputed from the storages that remain
        self._seen.pop(key, None)


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


# ----------------------------------------------------------------------------------------------- loading
class _LargestRead:
    """The largest slice read by a ``CheckpointSource`` while open (wraps ``read_rows``)."""

    def __enter__(self) -> _LargestRead:
        from hfpatch.patches.checkpoint import CheckpointSource

        self.largest, self.original = 0, CheckpointSource.read_rows
        original = self.original

        def read_rows(source: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = original(source, *args, **kwargs)
            self.largest = max(self.largest, source.largest_read)
            return out

        CheckpointSource.read_rows = read_rows
        return self

    def __exit__(self, *exc: Any) -> None:
        from hfpatch.patches.checkpoint import CheckpointSource

        CheckpointSource.read_rows = self.original


def save_pipeline(folder: Path) -> None:
    """The benchmark's transformer and text encoder in a ``WanPipeline`` folder, the transformer in 1 MB shards."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from hfpatch.testing import tiny_t5_tokenizer, tiny_wan_vae

    transformer, encoder, _, _ = build()
    pipe = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=encoder,
        vae=tiny_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        transformer=transformer,
    )
    pipe.save_pretrained(folder, max_shard_size="1MB")


def measure_load(folder: str) -> dict[str, Any]:
    """One rank: the peak host bytes of ``hfpatch.from_pretrained(..., shard_weights=True)`` and what it keeps."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    with _LargestRead() as reads, track_memory() as memory:
        pipe, patch = hfpatch.from_pretrained(folder, plan(dist.get_world_size()), shard_weights=True)
    kept = parameter_bytes(pipe.transformer) + parameter_bytes(pipe.text_encoder)
    patch.remove()
    return {
        "peak": memory.peak_bytes,
        "tracked": memory.peak_bytes,
        "read": reads.largest,
        "kept": kept,
    }


def load_rows(folder: Path) -> dict[str, Any]:
    """The loading rows (see the module docstring): N = 1 (the whole) and N = 2, 3, 4 (sharded loading)."""
    transformer, encoder, _, _ = build()
    whole = parameter_bytes(transformer) + parameter_bytes(encoder)
    largest = max(p.numel() * p.element_size() for m in (transformer, encoder) for p in m.parameters())
    rows = [{"N": 1, "peak_max": whole, "kept_max": whole, "bound": whole + largest}]
    for world in WORLDS:
        with RankPool(world, timeout_s=600) as pool:
            per_rank = pool.run(measure_load, str(folder))
        row = {"N": world, "bound": int(1.2 * whole / world + largest)}
        for key in ("peak", "tracked", "read", "kept"):
            row[f"{key}_max"] = max(r[key] for r in per_rank)
        row["peak_over_whole"] = row["peak_max"] / whole
        rows.append(row)
        print(
            f"load N={world}: peak {row['peak_max'] / MB:.3f} MiB per rank ({row['peak_over_whole']:.3f} of the "
            f"{whole / MB:.2f} MiB whole; bound 1.2/N + largest tensor = {row['bound'] / MB:.3f} MiB), keeps "
            f"{row['kept_max'] / MB:.3f} MiB"
        )
    return {"whole": whole, "largest_tensor": largest, "rows": rows}


# ----------------------------------------------------------------------------------------------- resident set
def save_large_pipeline(folder: Path) -> None:
    """The resident-set checkpoint: the benchmark's classes at width 512 and 8 blocks, in 20 MB shards."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from hfpatch.testing import tiny_t5_tokenizer, tiny_wan_vae

    transformer = tiny_wan_transformer(num_heads=8, head_dim=64, num_layers=8, ffn_dim=2048, text_dim=TEXT)
    pipe = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=build()[1],
        vae=tiny_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        transformer=transformer,
    )
    pipe.save_pretrained(folder, max_shard_size="20MB")


def measure_resident(folder: str) -> dict[str, Any]:
    """One rank: the peak resident set of the sharded load, of load-whole-then-shard and of the other
    components, and the time of the full check."""
    import time

    import torch.distributed as dist
    from diffusers import DiffusionPipeline, WanPipeline

    import hfpatch.loading.files as loading_files

    torch.set_num_threads(1)
    world = dist.get_world_size()
    pipe, patch = hfpatch.from_pretrained(folder, plan(world), shard_weights=True)  # imports, first calls
    patch.remove()
    del pipe, patch
    rest, unsharded = resident_peak(
        lambda: WanPipeline.from_pretrained(folder, transformer=None, text_encoder=None)
    )
    del rest
    timed, original = [], loading_files.agree_contents

    def agree_contents(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args)
        finally:
            timed.append(time.perf_counter() - start)

    loading_files.agree_contents = agree_contents
    try:
        (pipe, patch), peak = resident_peak(
            lambda: hfpatch.from_pretrained(folder, plan(world), shard_weights=True)
        )
    finally:
        loading_files.agree_contents = original
    models = (pipe.transformer, pipe.text_encoder)
    kept = sum(parameter_bytes(m) for m in models)
    patch.remove()
    whole = sum(parameter_bytes(m) for m in models)
    largest = max(p.numel() * p.element_size() for m in models for p in m.parameters())
    del pipe, patch, models

    def whole_then_shard() -> Any:
        reference = DiffusionPipeline.from_pretrained(folder)
        return reference, hfpatch.apply(reference, plan(world), shard_weights=True)

    (reference, reference_patch), peak_whole = resident_peak(whole_then_shard)
    reference_patch.remove()
    return {
        "peak": peak,
        "peak_whole_then_shard": peak_whole,
        "unsharded": unsharded,
        "kept": kept,
        "whole": whole,
        "largest": largest,
        "check_s": timed[0],
    }


def resident_rows(folder: Path) -> dict[str, Any]:
    """The resident-set rows and the full check's cost (see the module docstring)."""
    import time

    from hfpatch.loading.files import sha256_file

    files = sorted(
        str(p) for name in ("transformer", "text_encoder") for p in (folder / name).glob("*.safetensors")
    )
    checked = sum(os.path.getsize(f) for f in files)
    start = time.perf_counter()
    for f in files:
        sha256_file(f)
    one_process = time.perf_counter() - start
    rows = []
    for world in WORLDS:
        with RankPool(world, timeout_s=900) as pool:
            per_rank = pool.run(measure_resident, str(folder))
        first = per_rank[0]
        row: dict[str, Any] = {"N": world, "whole": first["whole"], "largest": first["largest"]}
        for key in ("peak", "peak_whole_then_shard", "unsharded", "kept", "check_s"):
            row[f"{key}_max"] = max(r[key] for r in per_rank)
        row["bound"] = int(1.2 * row["whole"] / world + row["largest"] + row["unsharded_max"])
        row["peak_over_whole"] = row["peak_max"] / row["whole"]
        row["whole_then_shard_over_whole"] = row["peak_whole_then_shard_max"] / row["whole"]
        row["bound_over_whole"] = row["bound"] / row["whole"]
        row["check_s_per_gb"] = row["check_s_max"] / (checked / 1e9)
        rows.append(row)
        print(
            f"resident N={world}: peak {row['peak_max'] / MB:.1f} MiB per rank ({row['peak_over_whole']:.3f} of the "
            f"{row['whole'] / MB:.1f} MiB models; bound {row['bound_over_whole']:.3f}; load whole then shard "
            f"{row['whole_then_shard_over_whole']:.3f}); full check {row['check_s_max']:.3f} s for "
            f"{checked / 1e9:.3f} GB ({row['check_s_per_gb']:.2f} s/GB)"
        )
    return {
        "checked_bytes": checked,
        "files": len(files),
        "one_process_hash_s": one_process,
        "one_process_hash_s_per_gb": one_process / (checked / 1e9),
        "rows": rows,
    }


# ----------------------------------------------------------------------------------------------- report
def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    runs = results["runs"]
    ns = [1] + [r["N"] for r in runs]
    fig, (ax_rest, ax_peak, ax_comm, ax_load, ax_rss) = plt.subplots(5, 1, figsize=(9, 21.5))
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
    load = results["load"]
    ns = [r["N"] for r in load["rows"]]
    ax_load.plot(ns, [r["peak_max"] / MB for r in load["rows"]], "o-", label="hfpatch.from_pretrained: peak")
    ax_load.plot(ns, [r["kept_max"] / MB for r in load["rows"]], "x:", ms=9, label="  of which shards kept")
    ax_load.plot(
        ns, [r["bound"] / MB for r in load["rows"]], "--", color="gray", label="1.2/N + largest tensor"
    )
    ax_load.axhline(load["whole"] / MB, color="C3", alpha=0.5, label="load whole, then shard (every rank)")
    ax_load.set(xlabel="ranks N", ylabel="per-rank peak host bytes while loading (MiB)", xticks=ns)
    ax_load.set_title("loading the transformer + text encoder from 1 MB safetensors shards")
    ax_load.legend()
    rss = results["resident"]["rows"]
    ns = [r["N"] for r in rss]
    ax_rss.plot(ns, [r["peak_over_whole"] for r in rss], "o-", label="hfpatch.from_pretrained")
    ax_rss.plot(ns, [r["whole_then_shard_over_whole"] for r in rss], "s-", label="load whole, then shard")
    ax_rss.plot(ns, [r["bound_over_whole"] for r in rss], "--", color="gray", label="1.2/N + largest + rest")
    ax_rss.set(xlabel="ranks N", ylabel="per-rank peak resident set / models", xticks=ns, ylim=(0, None))
    ax_rss.set_title(f"peak resident set (VmHWM) while loading the {rss[0]['whole'] / MB:.0f} MiB checkpoint")
    ax_rss.legend()
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
    with tempfile.TemporaryDirectory() as tmp:
        save_pipeline(Path(tmp) / "wan")
        results["load"] = load_rows(Path(tmp) / "wan")
        save_large_pipeline(Path(tmp) / "large")
        results["resident"] = resident_rows(Path(tmp) / "large")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fsdp.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "fsdp.png")
    return results


if __name__ == "__main__":
    main()
