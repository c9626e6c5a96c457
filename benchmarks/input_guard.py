"""Cost of the same-input guard per split call (USP transformer, CFG-parallel pipeline, split VAE), vs 2%.

hfpatch checks at every split call that the ranks sharing it were given identical arguments
(``hfpatch.distributed.agreement.check_same_inputs``: exact 128-bit content digests of every argument, one
fixed-size table all-gathered). This script times each call with ``hfpatch.apply(..., check_inputs=True)``
and ``check_inputs=False`` on CPU gloo ranks, one torch thread per rank, the two settings interleaved
(alternating order), and reports per case:

- ``t_off``/``t_on``: time of one call, the slowest rank's, minimum over the repeats, as CPU time
  (``time.process_time``, the headline: the ranks share two loaded cores, so wall time mostly measures the
  scheduler) and as wall time between two barriers;
- ``diff_fraction = (t_on - t_off) / t_off``: the guard's cost seen in the call (noisy: a few tenths of a
  percent of a call is inside the run-to-run spread);
- ``direct_fraction``: the guard's own time, measured directly by replaying ``check_same_inputs`` on the
  exact arguments each guard of the call saw (recorded on a check-on call), minimum over repeats, over
  ``t_off`` (much less noisy), split into its local part (``describe_inputs``: the digests) and the rest
  (the all-gather of the table and the comparison);
- the guard checks per call and the bytes they send (``count_comm``: ``calls["guard"]``, ``by_op["guard"]``).

Cases (N = 2, then 4): the ``usp_transformer.py`` model and latent (``[1, 4, 16, 32, 32]``, 4096 tokens) at
Ulysses 2, Ring 2 and USP 2x2; a tiny stock ``WanPipeline`` (``tiny_wan_pipe``, 128x128, 9 frames, 4 steps,
``output_type="pt"``) at cfg=2 (N = 4: cfg=2 x ulysses=2; its VAE decode is split too); the ``vae_memory.py``
split decode at its largest size (latent ``[1, 4, 2, 32, 8]``, full output gathered). Writes
``benchmarks/results/input_guard.json`` and ``.png``; 3-5 minutes on two (shared) CPU cores.

    python benchmarks/input_guard.py
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.distributed.agreement import inputs as agreement  # check_same_inputs and its callers by name
from hfpatch.distributed.collectives import count_comm
from hfpatch.patches.dit import sequence_parallel as _sequence_parallel
from hfpatch.patches.vae import layers as vae_layers
from hfpatch.testing import RankPool, tiny_wan_pipe, tiny_wan_vae, wan_prompt_embeds

sys.path.insert(0, str(Path(__file__).parent))  # the benchmark model of usp_transformer.py
from usp_transformer import LATENT, build  # noqa: E402

RESULTS = Path(__file__).parent / "results"
REPEATS = 9  # per setting, interleaved
TARGET = 0.02
PIPE_CALL = dict(height=128, width=128, num_frames=9, num_inference_steps=4, output_type="pt")
VAE_LATENT = (1, 4, 2, 32, 8)  # vae_memory.py: latent frames 2, width 8, largest height 32
# (case, kind, ParallelConfig kwargs) per world size.
CASES = {
    2: [
        ("transformer ulysses 2", "transformer", dict(ulysses=2)),
        ("transformer ring 2", "transformer", dict(ring=2)),
        ("pipeline cfg 2", "pipeline", dict(cfg=2)),
        ("vae decode", "vae", dict(vae=2)),
    ],
    4: [
        ("transformer usp 2x2", "transformer", dict(ring=2, ulysses=2)),
        ("pipeline cfg 2 x ulysses 2", "pipeline", dict(cfg=2, ulysses=2)),
        ("vae decode", "vae", dict(vae=4)),
    ],
}


# ----------------------------------------------------------------------------------------------- cases
def _make(kind: str) -> tuple[Any, Callable[[], Any], dict[str, Any]]:
    """An unpatched model of ``kind`` (same weights on every rank), its call, and the input sizes."""
    if kind == "transformer":
        model, kwargs = build()
        sizes = {k: list(v.shape) for k, v in kwargs.items()}
        return model, lambda: model(**kwargs).sample, sizes
    if kind == "pipeline":
        pipe = tiny_wan_pipe()
        embeds, negative = wan_prompt_embeds(), wan_prompt_embeds(seed=2)

        def call() -> Any:
            generator = torch.Generator().manual_seed(0)  # the same noise on every rank
            return pipe(
                prompt_embeds=embeds, negative_prompt_embeds=negative, generator=generator, **PIPE_CALL
            )

        return pipe, call, {"prompt_embeds": list(embeds.shape), **PIPE_CALL}
    vae = tiny_wan_vae("2.1")
    z = torch.randn(*VAE_LATENT, generator=torch.Generator().manual_seed(0))
    return vae, lambda: vae.decode(z).sample, {"latent": list(VAE_LATENT)}


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


@contextmanager
def _record_guards() -> Iterator[list[tuple[dict[str, Any], Any, str]]]:
    """Record (arguments, group, what) of every guard check that ran (sent its table) inside the block."""
    original = agreement.check_same_inputs
    checks: list[tuple[dict[str, Any], Any, str]] = []

    def recording(named, group, *, what, enabled=True, hint=""):
        with count_comm() as comm:
            original(named, group, what=what, enabled=enabled, hint=hint)
        if comm.calls.get("guard"):
            checks.append((_clone(dict(named)), group, what))

    modules = (agreement, _sequence_parallel, vae_layers)  # every module that calls it by name
    for module in modules:
        module.check_same_inputs = recording
    try:
        yield checks
    finally:
        for module in modules:
            module.check_same_inputs = original


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(CPU seconds of this rank, wall seconds between barriers) of ``fn()``."""
    gc.collect()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        fn()
    cpu = time.process_time() - cpu
    dist.barrier()
    return cpu, time.perf_counter() - wall


def measure(kind: str, degrees: dict[str, int], repeats: int) -> dict[str, Any]:
    """On every rank: per-repeat times of the call with the guard on and off, of the guard alone (and of its
    local part, the digests), and the guard's checks and bytes per call.

    One model instance, patched anew for each call with ``check_inputs`` on or off (outside the timing): the
    two settings run the same weights at the same addresses, only the guard differs.
    """
    config = ParallelConfig(**degrees)
    target, call, sizes = _make(kind)

    def timed_call(check: bool) -> tuple[float, float]:
        with hfpatch.apply(target, parallel=config, check_inputs=check):
            return _timed(call)

    for check in (True, False):  # warm-up
        timed_call(check)
    with hfpatch.apply(target, parallel=config, check_inputs=True), torch.no_grad():
        with count_comm() as comm_on, _record_guards() as checks:
            call()
    with hfpatch.apply(target, parallel=config, check_inputs=False), torch.no_grad():
        with count_comm() as comm_off:
            call()

    def replay() -> None:
        for named, group, what in checks:
            agreement.check_same_inputs(named, group, what=what)

    def digests() -> None:
        for named, _, _ in checks:
            agreement.describe_inputs(named)

    times: dict[str, list[tuple[float, float]]] = {"on": [], "off": [], "guard": [], "describe": []}
    for i in range(repeats):
        for check in (True, False) if i % 2 else (False, True):
            times["on" if check else "off"].append(timed_call(check))
        times["guard"].append(_timed(replay))
        times["describe"].append(_timed(digests))
    return {
        "times": times,
        "sizes": sizes,
        "guard_calls": comm_on.calls.get("guard", 0),
        "guard_bytes": comm_on.by_op.get("guard", 0),
        "guard_calls_off": comm_off.calls.get("guard", 0),
        "bytes_on": comm_on.bytes_sent,
        "checks": [what for _, _, what in checks],
        "check_arguments": [sorted(named) for named, _, _ in checks[:1]],
    }


# ----------------------------------------------------------------------------------------------- report
def _summary(per_rank: list[dict[str, Any]], key: str, clock: int) -> float:
    """Slowest rank per repeat, then the minimum over repeats."""
    repeats = len(per_rank[0]["times"][key])
    return min(max(r["times"][key][i][clock] for r in per_rank) for i in range(repeats))


def _row(name: str, kind: str, world: int, degrees: dict[str, int], per_rank: list[dict[str, Any]]) -> dict:
    row: dict[str, Any] = {
        "case": name,
        "kind": kind,
        "N": world,
        "parallel": degrees,
        "sizes": per_rank[0]["sizes"],
        "repeats": len(per_rank[0]["times"]["on"]),
    }
    for clock, label in ((0, "cpu"), (1, "wall")):
        off, on = _summary(per_rank, "off", clock), _summary(per_rank, "on", clock)
        guard = _summary(per_rank, "guard", clock)
        row[label] = {
            "t_off_s": off,
            "t_on_s": on,
            "guard_s": guard,
            "guard_per_check_s": guard / max(len(per_rank[0]["checks"]), 1),
            "digests_s": _summary(per_rank, "describe", clock),  # the local part: describe_inputs only
            "diff_fraction": (on - off) / off,
            "direct_fraction": guard / off,
        }
    row["guard_calls_per_call"] = max(r["guard_calls"] for r in per_rank)
    row["guard_bytes_per_call"] = max(r["guard_bytes"] for r in per_rank)
    row["guard_bytes_per_check"] = agreement.bytes_per_check(world)
    row["guard_calls_with_check_inputs_false"] = max(r["guard_calls_off"] for r in per_rank)
    row["bytes_sent_per_call"] = max(r["bytes_on"] for r in per_rank)
    row["guard_share_of_bytes"] = row["guard_bytes_per_call"] / max(row["bytes_sent_per_call"], 1)
    row["checks_rank0"] = per_rank[0]["checks"]
    row["first_check_arguments"] = per_rank[0]["check_arguments"]
    row["meets_target"] = row["cpu"]["direct_fraction"] <= TARGET
    row["raw_rank0"] = per_rank[0]["times"]
    return row


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    rows = result["rows"]
    x = list(range(len(rows)))
    bars = (
        ("cpu", "direct_fraction", "direct, CPU time", "C0"),
        ("cpu", "diff_fraction", "(t_on - t_off) / t_off, CPU", "C1"),
        ("wall", "direct_fraction", "direct, wall time", "C2"),
        ("wall", "diff_fraction", "(t_on - t_off) / t_off, wall", "C3"),
    )
    width = 0.2
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for j, (clock, key, label, color) in enumerate(bars):
        heights = [100 * r[clock][key] for r in rows]
        ax.bar([i + (j - 1.5) * width for i in x], heights, width, color=color, label=label)
    ax.axhline(100 * TARGET, color="k", ls="--", label="target 2%")
    ax.axhline(0, color="k", lw=0.5)
    labels = [f"{r['case']}, N={r['N']} ({r['guard_calls_per_call']} checks)" for r in rows]
    ax.set_xticks(x, labels, rotation=30, ha="right")
    ax.set(
        ylabel="guard time / call time (%)", title="same-input guard per split call (CPU gloo, 1 thread/rank)"
    )
    ax.legend(loc="lower left", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    rows = []
    for world, cases in CASES.items():
        with RankPool(world, timeout_s=600) as pool:
            for name, kind, degrees in cases:
                per_rank = pool.run(measure, kind, degrees, REPEATS)
                rows.append(_row(name, kind, world, degrees, per_rank))
    result = {
        "what": "same-input guard (hfpatch.distributed.agreement.check_same_inputs) per split call",
        "target_fraction": TARGET,
        "headline": "direct_fraction of CPU time (the guard replayed alone on the call's arguments / t_off)",
        "max_direct_fraction_cpu": max(r["cpu"]["direct_fraction"] for r in rows),
        "max_diff_fraction_cpu": max(r["cpu"]["diff_fraction"] for r in rows),
        "setup": {
            "backend": "gloo, CPU, spawned ranks (hfpatch.testing.RankPool), 1 torch thread per rank",
            "timing": (
                f"{REPEATS} repeats per setting, check_inputs on/off interleaved in alternating order on one "
                "model instance re-patched per call, gc.collect and a barrier before each call; per repeat the slowest rank, then the minimum over repeats. CPU "
                "time (process_time, whole process incl. gloo threads) is the headline because the ranks share "
                "two loaded cores; wall time is between barriers."
            ),
            "transformer": "usp_transformer.py model: tiny_wan_transformer 8 heads x 16, 2 layers, ffn 4C, "
            f"latent {list(LATENT)}, 4096 tokens, fp32, no_grad",
            "pipeline": f"tiny_wan_pipe (WanPipeline, tiny transformer + tiny Wan 2.1 VAE), {PIPE_CALL}",
            "vae": f"tiny_wan_vae('2.1') decode, latent {list(VAE_LATENT)} (vae_memory.py largest), "
            "vae_output='full'",
        },
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "input_guard.json").write_text(json.dumps(result, indent=2))
    _plot(result, RESULTS / "input_guard.png")
    return result


if __name__ == "__main__":
    from input_guard import main as _main  # the importable copy of this module (spawned ranks use it)

    res = _main()
    print(
        f"{'case':27s} N t_off(s) t_on(s)  diff     direct  per-check  | wall: diff    direct | checks bytes"
    )
    for r in res["rows"]:
        c, w = r["cpu"], r["wall"]
        print(
            f"{r['case']:27s} {r['N']} {c['t_off_s']:.4f}  {c['t_on_s']:.4f}  {c['diff_fraction']:+.2%}  "
            f"{c['direct_fraction']:.2%}  {1e3 * c['guard_per_check_s']:.2f} ms  | {w['diff_fraction']:+.2%}  "
            f"{w['direct_fraction']:.2%} | {r['guard_calls_per_call']:3d} {r['guard_bytes_per_call']}"
        )
    print(f"max direct fraction (CPU): {res['max_direct_fraction_cpu']:.2%} (target {TARGET:.0%})")
