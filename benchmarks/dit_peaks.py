"""Forward peak per rank of every supported DiT class under sequence parallelism at world 2, on its tests' configs.

For each class of :data:`hfpatch.patches.dit.PLANS` the tiny stock model and inputs its fidelity tests run
(``tests/patches/test_dit_usp.py``'s ``build``: the :data:`hfpatch.testing.dits.TINY_DITS` rows and the families
built there, read from the tests themselves so the two cannot drift) run unpatched and then patched with Ulysses 2
and Ring 2 on two gloo ranks, in fp32 under ``torch.no_grad()``. Every rank measures its peak live tensor bytes
(:func:`hfpatch.testing.memory.track_memory`: tensors created during the call, weights and inputs excluded) and
reports patched / unpatched, and the module running when each peak was reached (``peak_at``, rank 0: where a
class above the target spends it). The table (the larger of the two ranks, per plan) is what ``docs/models.md`` quotes:
a class above ``TARGET`` has its reason there.

Writes ``benchmarks/results/dit_peaks.json`` and ``.png``; about three minutes on two CPU cores.

    python benchmarks/dit_peaks.py
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
TESTS = Path(__file__).parents[1] / "tests" / "patches"
#: The forward peak per rank at world 2 every supported class should stay under (patched / unpatched).
TARGET = 0.75
#: (name, ring, ulysses) at world 2.
CONFIGS = [("ulysses", 1, 2), ("ring", 2, 1)]
#: Test config of the classes that are not rows of TINY_DITS (test_dit_usp.py builds them by these names).
BUILT_IN_TESTS = {
    "WanTransformer3DModel": "wan21",
    "FluxTransformer2DModel": "flux",
    "SD3Transformer2DModel": "sd3",
    "CogVideoXTransformer3DModel": "cogvideox",
    "QwenImageTransformer2DModel": "qwenimage",
    "Flux2Transformer2DModel": "flux2",
    "LTXVideoTransformer3DModel": "ltx",
    "ChronoEditTransformer3DModel": "chronoedit",
    "WanVACETransformer3DModel": "wan_vace",
    "HunyuanVideoTransformer3DModel": "hunyuanvideo",
    "HunyuanVideo15Transformer3DModel": "hunyuanvideo15",
    "LTX2VideoTransformer3DModel": "ltx2",
    "MiniMaxH3Transformer3DModel": "minimax_h3",
    "HunyuanDiT2DModel": "hunyuandit",
    "PixArtTransformer2DModel": "pixart",
}


def test_names() -> dict[str, str]:
    """Class name -> the test config it is measured on (the first TINY_DITS row of the class, or the built one)."""
    from hfpatch.patches.dit.plans import PLANS
    from hfpatch.testing.dits import TINY_DITS

    names = dict(BUILT_IN_TESTS)
    for name, row in TINY_DITS.items():
        names.setdefault(row.cls, name)
    classes = sorted(key.removeprefix("diffusers.") for key in PLANS)
    missing = [c for c in classes if c not in names]
    if missing:
        raise RuntimeError(f"no test config for {missing}: add one to BUILT_IN_TESTS")
    return {c: names[c] for c in classes}


def _peak_tracker():
    """A :class:`~hfpatch.testing.memory.MemoryTracker` that also records the module running at its peak."""
    from hfpatch.testing.memory import MemoryTracker

    class WhereTracker(MemoryTracker):
        def __post_init__(self) -> None:
            super().__post_init__()
            self.modules: list[str] = []  # the module call stack (paths), kept by the global hooks below
            self.at = ""

        def _track(
            self, tensor: torch.Tensor, inputs: list[torch.Tensor], ptrs: set[int] | None
        ) -> set[int] | None:
            before = self.peak_bytes
            ptrs = super()._track(tensor, inputs, ptrs)
            if self.peak_bytes > before:
                self.at = self.modules[-1] if self.modules else "(the model)"
            return ptrs

    return WhereTracker()


def _measured(model: torch.nn.Module, inputs: Callable[[], dict[str, Any]]) -> tuple[int, str, Any]:
    """(peak live bytes, the module running at the peak, output) of one forward on fresh ``inputs()`` (inputs are
    not counted), caches filled by a first call."""
    paths = {m: p or "(the model)" for p, m in model.named_modules()}
    tracker = None

    def enter(module, _args):
        if tracker is not None:
            tracker.modules.append(paths.get(module, type(module).__name__))

    def leave(_module, _args, _out):
        if tracker is not None and tracker.modules:
            tracker.modules.pop()

    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(enter),
        torch.nn.modules.module.register_module_forward_hook(leave, always_call=True),
    ]
    try:
        with torch.no_grad():
            model(**inputs())  # stock caches (rotary tables) filled before measuring
            kwargs = inputs()
            # Python's collector (reference cycles holding tensors) then runs at the same points of every call,
            # whatever this process ran before: the peak of a class does not depend on the classes measured first.
            gc.collect()
            tracker = _peak_tracker()
            with tracker:
                out = model(**kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return tracker.peak_bytes, tracker.at, out


def measure(names: list[str]) -> dict[str, dict[str, Any]]:
    """On every rank: per test config, ``{plan: patched peak / unpatched peak}`` (forward, no grad), and where
    (the innermost module running) each peak sits."""
    from test_dit_usp import build

    import hfpatch
    from hfpatch import ParallelConfig

    results = {}
    for name in names:
        model, _, _ = build(name)
        inputs = lambda name=name: build(name)[1]  # noqa: E731  (fresh tensors: the inputs are not counted)
        unpatched, where, _ = _measured(model, inputs)
        row: dict[str, Any] = {"unpatched_bytes": unpatched, "peak_at": {"unpatched": where}}
        for plan, ring, ulysses in CONFIGS:
            with hfpatch.apply(model, parallel=ParallelConfig(ring=ring, ulysses=ulysses)):
                peak, where, _ = _measured(model, inputs)
            row[plan] = peak / unpatched
            row["peak_at"][plan] = where
        results[name] = row
    return results


def _plot(
    results: dict[str, Any],
    path: Path,
    *,
    label: Callable[[str], str] = str,
    xlabel: str = "forward peak per rank / unpatched (world 2, fp32, no grad)",
    height: tuple[float, float] = (0.22, 1.2),
    legend: dict[str, Any] | None = None,
) -> None:
    """Draw the table of ``results`` (this script's JSON, or ``dit_peaks_long.py``'s) to ``path``: one bar per
    class and plan, the target and 1/N marked. ``label`` names a class's row, ``height`` is (inches per class,
    margin), ``legend`` the legend's keyword arguments."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width
    table = results["classes"]
    plans = list(results["configs"])
    classes = list(table)
    fig, ax = plt.subplots(figsize=(8, height[0] * len(classes) + height[1]))
    for offset, plan in zip((-0.2, 0.2), plans):
        ax.barh([i + offset for i in range(len(classes))], [table[c][plan] for c in classes], 0.4, label=plan)
    ax.axvline(results["target"], color="k", linestyle="--", linewidth=1, label=f"target {results['target']}")
    ax.axvline(0.5, color="grey", linestyle=":", linewidth=1, label="1/N")
    ax.set_yticks(range(len(classes)), [label(c) for c in classes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(**(legend or {"fontsize": 7, "loc": "lower right"}))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> dict[str, Any]:
    from hfpatch.testing import RankPool

    names = test_names()
    pool = RankPool(2, timeout_s=1800)
    try:
        per_rank = pool.run(measure, list(names.values()))
    finally:
        pool.close()
    table = {}
    for cls, name in names.items():
        rows = [rank[name] for rank in per_rank]
        table[cls] = {
            "test": name,
            "unpatched_bytes": rows[0]["unpatched_bytes"],
            **{plan: max(r[plan] for r in rows) for plan, _, _ in CONFIGS},
            "peak_at": rows[0]["peak_at"],  # rank 0's
        }
    over = {c: round(max(row[p] for p, _, _ in CONFIGS), 3) for c, row in table.items()}
    results = {
        "target": TARGET,
        "configs": {plan: {"ring": ring, "ulysses": ulysses} for plan, ring, ulysses in CONFIGS},
        "classes": table,
        "above_target": {c: v for c, v in over.items() if v > TARGET},
        "torch": torch.__version__,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dit_peaks.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "dit_peaks.png")
    for cls, row in table.items():
        flag = f"  > target (peak in {row['peak_at']})" if over[cls] > TARGET else ""
        print(f"{cls:40s} {row['test']:24s} ulysses {row['ulysses']:.3f}  ring {row['ring']:.3f}{flag}")
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))  # spawned ranks import build from the tests (PYTHONPATH carries it)
    import os

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    main()
