"""Cost of the same-weights check on a Wan 2.1 1.3B-shaped transformer: at ``apply``, and per patched call.

``hfpatch.apply`` compares every parameter and buffer over the ranks before it patches anything
(:func:`hfpatch.distributed.agreement.weight_digests`: one :func:`~hfpatch.distributed.agreement.bulk_digest` per
tensor, folded into one digest that rides in ``apply``'s handshake), and a
:class:`~hfpatch.distributed.agreement.WeightWatch` keeps that fingerprint in every later same-input check. This
script measures, on one CPU process (no process group: the check's collectives are the handshake and the
same-input table, which exist anyway), on a stock ``WanTransformer3DModel`` with the configuration of
``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` (1.42 B parameters, 825 parameter tensors; built on the meta device, then
materialised and filled):

- the digest of every tensor at ``apply``, fp32 and bf16, with 1 torch thread and with all of them (minimum
  over 3 repeats), as seconds and GB/s, beside BLAKE2b (``content_digest``'s CPU path, what the same-input
  guard uses for inputs) on 256 MiB;
- per patched call: :meth:`WeightWatch.row` when nothing was registered since (the common case), after one
  module was built anywhere in the process (the watch re-reads the tensor names), and at the first call after a
  peft LoRA (r=16 on ``to_q/to_k/to_v/to_out.0`` of every block) was added (it digests the new tensors only).

Writes ``benchmarks/results/weight_check.json`` and ``.png``; about 2 minutes on two shared CPU cores
(``--plot-only`` redraws the figure from the JSON).

    python benchmarks/weight_check.py
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hfpatch.distributed.agreement import WeightWatch, content_digest, weight_digests

RESULTS = Path(__file__).parent / "results"
#: transformer/config.json of Wan-AI/Wan2.1-T2V-1.3B-Diffusers.
WAN_1_3B = dict(
    attention_head_dim=128,
    cross_attn_norm=True,
    eps=1e-6,
    ffn_dim=8960,
    freq_dim=256,
    in_channels=16,
    num_attention_heads=12,
    num_layers=30,
    out_channels=16,
    patch_size=(1, 2, 2),
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=1024,
    text_dim=4096,
)
REPEATS = 3


def build(dtype: torch.dtype) -> torch.nn.Module:
    """The 1.3B-shaped transformer in ``dtype`` on the CPU, every tensor written (pages touched)."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**WAN_1_3B)
    model = model.to_empty(device="cpu").to(dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.uniform_(-0.05, 0.05, generator=generator)
    return model


def _best(fn: Any, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def at_apply(model: torch.nn.Module, threads: int) -> dict[str, Any]:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = _best(lambda: weight_digests([("", model)]))
    finally:
        torch.set_num_threads(saved)
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {"threads": threads, "seconds": seconds, "bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9}


def per_call(model: torch.nn.Module) -> dict[str, Any]:
    """Costs of :meth:`WeightWatch.row` in the three situations a patched call meets."""
    from peft import LoraConfig

    digests = weight_digests([("", model)])
    watch = WeightWatch([("", model)], "WanTransformer3DModel", digests)
    try:
        watch.row()
        samples = []
        for _ in range(2000):
            start = time.perf_counter()
            watch.row()
            samples.append(time.perf_counter() - start)
        quiet = statistics.median(samples)

        rereads = []
        for _ in range(5):
            torch.nn.Linear(2, 2)  # registers two parameters somewhere else in the process
            start = time.perf_counter()
            watch.row()
            rereads.append(time.perf_counter() - start)
        reread = min(rereads)

        tensors_before = len(watch.digests())
        torch.manual_seed(0)
        model.add_adapter(
            LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
        )
        start = time.perf_counter()
        watch.row()
        lora = time.perf_counter() - start
        new = len(watch.digests()) - tensors_before
        new_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    finally:
        watch.close()
    return {
        "no_registration_s": quiet,
        "after_a_registration_s": reread,
        "first_call_after_lora_s": lora,
        "lora_tensors": new,
        "lora_bytes": new_bytes,
        "tensors": tensors_before,
    }


def blake2b_gb_per_s() -> float:
    x = torch.randn(64 * 2**20, generator=torch.Generator().manual_seed(0))  # 256 MiB
    return x.numel() * 4 / _best(lambda: content_digest(x)) / 1e9


def main() -> dict[str, Any]:
    result: dict[str, Any] = {
        "model": "WanTransformer3DModel, Wan2.1-T2V-1.3B config",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in WAN_1_3B.items()},
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "threads": torch.get_num_threads(),
        "blake2b_gb_per_s": blake2b_gb_per_s(),
        "apply": {},
    }
    for dtype in (torch.float32, torch.bfloat16):
        model = build(dtype)
        name = str(dtype).split(".")[1]
        result["parameters"] = sum(p.numel() for p in model.parameters())
        result["apply"][name] = [at_apply(model, 1), at_apply(model, torch.get_num_threads())]
        if dtype == torch.bfloat16:
            result["per_call"] = per_call(model)
        del model
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "weight_check.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "weight_check.png")
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    """One panel: seconds of each situation, log scale, the value written on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for dtype, runs in result["apply"].items():
        for run in runs:
            gib = run["bytes"] / 2**30
            threads = f"{run['threads']} thread" + ("s" if run["threads"] > 1 else "")
            rows.append((f"apply, {dtype} ({gib:.1f} GiB), {threads}", run["seconds"]))
    calls = result["per_call"]
    rows += [
        ("per call: nothing registered since", calls["no_registration_s"]),
        ("per call: a module built elsewhere", calls["after_a_registration_s"]),
        (f"first call after a LoRA (+{calls['lora_tensors']} tensors)", calls["first_call_after_lora_s"]),
    ]
    fig, ax = plt.subplots(figsize=(9, 4.4))
    labels, seconds = zip(*rows)
    bars = ax.barh(range(len(rows)), seconds, color=["#4c72b0"] * (len(rows) - 3) + ["#55a868"] * 3)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), labels, fontsize=11)
    ax.invert_yaxis()
    for bar, value in zip(bars, seconds):
        if value < 1e-6:
            text = f"{value * 1e9:.0f} ns"
        elif value < 1e-3:
            text = f"{value * 1e6:.0f} µs"
        else:
            text = f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"
        ax.text(bar.get_width() * 1.3, bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=11)
    ax.set_xlim(min(seconds) / 3, max(seconds) * 30)
    ax.tick_params(axis="x", labelsize=10)
    ax.set_xlabel("seconds (log scale), one CPU process", fontsize=11)
    ax.set_title(
        f"same-weights check, Wan 1.3B config ({result['parameters'] / 1e9:.2f} B parameters)", fontsize=12
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--plot-only"]:  # redraw from the last results
        plot(json.loads((RESULTS / "weight_check.json").read_text()), RESULTS / "weight_check.png")
    else:
        print(json.dumps(main(), indent=2))
