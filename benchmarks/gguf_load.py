"""A GGUF transformer loaded with ``shard_weights``: each rank's own memory while loading, mapped vs copied.

``hfpatch.from_pretrained(folder, parallel=N, single_files={"transformer": "x.gguf"}, shard_weights=True)`` reads
the file through a private mapping (:mod:`hfpatch.loading.gguf_files`): every quantized weight is a view of it
until ``shard_weights`` copies this rank's rows. With ``check_files="sampled"`` it takes diffusers' own path
(``load_gguf_checkpoint`` copies every tensor out of the file), the reference here. A stock
``WanTransformer3DModel`` at width 512, 8 blocks, ``ffn_dim`` 2048 (as ``benchmarks/fsdp.py``'s resident-set
checkpoint), written as GGUF Q8_0 (``hfpatch.testing.quantized.write_gguf``), in a ``WanPipeline`` folder, loaded
at N = 2 and 4 CPU ranks. Every rank reports:

- **peak anonymous memory while loading** above what it held before (``RssAnon`` of ``/proc/self/status``,
  sampled every millisecond by a thread; after a first load has paid the imports): the process's own memory,
  where ``VmRSS`` would also count the file's pages in the page cache that the mapping shows, which the node's
  ranks share and the kernel can drop;
- the quantized bytes it keeps after the load (``hfpatch.patches.fsdp.parameter_bytes`` of the GGUF weights);

against the file's quantized bytes. Writes ``benchmarks/results/gguf_load.json`` and ``.png`` (needs ``[quant]``
and ``[bench]``); about a minute on two CPU cores.

    python benchmarks/gguf_load.py
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

import hfpatch
from hfpatch.patches.fsdp import parameter_bytes
from hfpatch.testing.runner import RankPool

WORLDS = (2, 4)
MB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"mapped": "full", "copied (diffusers)": "sampled"}  # mode -> check_files that selects it


def _anonymous() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("no RssAnon in /proc/self/status")


def anonymous_peak(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the peak of this process's anonymous resident memory while it ran, above where it started."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _anonymous()
    peak, stop = [base], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _anonymous())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = fn()
    finally:
        stop.set()
        sampler.join()
    return out, max(peak[0], _anonymous()) - base


def save(folder: Path) -> tuple[str, int]:
    """The pipeline folder and its transformer as a GGUF Q8_0 file; the file's quantized bytes."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        GGUFQuantizationConfig,
        WanPipeline,
        WanTransformer3DModel,
    )

    from hfpatch.distributed.stored import quantized_kind
    from hfpatch.testing import tiny_t5_encoder, tiny_t5_tokenizer, tiny_wan_transformer, tiny_wan_vae
    from hfpatch.testing.quantized import write_gguf

    transformer = tiny_wan_transformer(num_heads=8, head_dim=64, num_layers=8, ffn_dim=2048)
    pipe = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=tiny_t5_encoder(),
        vae=tiny_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        transformer=transformer,
    )
    pipe.save_pretrained(folder)
    gguf = str(folder / "transformer-Q8_0.gguf")
    write_gguf(transformer, gguf, "Q8_0")
    loaded = WanTransformer3DModel.from_single_file(
        gguf,
        config=str(folder),
        subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32,
    )
    return gguf, parameter_bytes([p for p in loaded.parameters() if quantized_kind(p) is not None])


def measure(folder: str, gguf: str) -> dict[str, Any]:
    """One rank: the peak anonymous memory of each load and the quantized bytes it keeps."""
    import torch.distributed as dist

    from hfpatch.distributed.stored import quantized_kind

    torch.set_num_threads(1)
    world = dist.get_world_size()

    def load(check: str) -> Any:
        return hfpatch.from_pretrained(
            folder, parallel=world, single_files={"transformer": gguf}, shard_weights=True, check_files=check
        )

    pipe, patch = load("full")  # imports and first calls, outside the figures
    patch.remove()
    del pipe, patch
    out: dict[str, Any] = {}
    for mode, check in MODES.items():
        weights: list[torch.Tensor] = []
        (pipe, patch), peak = anonymous_peak(lambda check=check: load(check))
        weights = [p for p in pipe.transformer.parameters() if quantized_kind(p) is not None]
        out[mode] = {"peak": peak, "kept": parameter_bytes(weights), "plan": repr(patch.plan)}
        patch.remove()
        del pipe, patch, weights
    return out


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))

    rows = results["rows"]
    ns = [r["N"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in zip(MODES, "os"):
        ax.plot(
            ns, [r[mode]["peak_over_file"] for r in rows], f"{marker}-", label=f"peak while loading, {mode}"
        )
    ax.plot(ns, [r["mapped"]["kept_over_file"] for r in rows], "^--", label="quantized bytes kept")
    ax.plot(ns, [1 / n for n in ns], ":", color="gray", label="1/N")
    ax.set(xlabel="ranks N", ylabel="per-rank bytes / the file's quantized bytes", xticks=ns, ylim=(0, None))
    ax.set_title(f"GGUF Q8_0 transformer ({results['quantized_bytes'] / MB:.0f} MiB) with shard_weights")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        gguf, quantized = save(folder)
        results: dict[str, Any] = {
            "model": "diffusers WanTransformer3DModel (width 512, 8 blocks, ffn 2048) as GGUF Q8_0",
            "quantized_bytes": quantized,
            "file_bytes": Path(gguf).stat().st_size,
            "rows": [],
        }
        for world in WORLDS:
            with RankPool(world, timeout_s=600) as pool:
                per_rank = pool.run(measure, str(folder), gguf)
            row: dict[str, Any] = {"N": world, "plan": per_rank[0]["mapped"]["plan"]}
            for mode in MODES:
                peak = max(r[mode]["peak"] for r in per_rank)
                kept = max(r[mode]["kept"] for r in per_rank)
                row[mode] = {
                    "peak_max": peak,
                    "kept_max": kept,
                    "peak_over_file": peak / quantized,
                    "kept_over_file": kept / quantized,
                }
            results["rows"].append(row)
            print(
                f"N={world} {row['plan']}: peak anonymous memory while loading, per rank: mapped "
                f"{row['mapped']['peak_max'] / MB:.1f} MiB ({row['mapped']['peak_over_file']:.3f} of the "
                f"{quantized / MB:.1f} MiB quantized), copied {row['copied (diffusers)']['peak_max'] / MB:.1f} MiB "
                f"({row['copied (diffusers)']['peak_over_file']:.3f}); kept {row['mapped']['kept_over_file']:.3f}"
            )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gguf_load.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "gguf_load.png")
    return results


if __name__ == "__main__":
    main()
