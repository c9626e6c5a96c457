"""Redraw every benchmark figure from its JSON in ``benchmarks/results`` without measuring again.

Each benchmark script writes ``results/NAME.json`` and draws ``results/NAME.png`` from it; after a change to a
plot function (or to ``figures.mplstyle``), this redraws them all in seconds, with the figures' numbers unchanged.
Not a benchmark itself (``hfpatch bench`` skips ``_``-prefixed scripts).

    python benchmarks/_redraw.py            # every figure whose JSON exists
    python benchmarks/_redraw.py fsdp       # some
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"


def _redraw(name: str) -> bool:
    """Draw ``results/NAME.png`` from ``results/NAME.json``; False when there is no JSON."""
    data_path = RESULTS / f"{name}.json"
    if not data_path.exists():
        return False
    data = json.loads(data_path.read_text())
    script = "gradcache_memory" if name.startswith("gradcache_memory") else name
    module = importlib.import_module(script)
    png = RESULTS / f"{name}.png"
    if script == "gradcache_memory":
        chunk = data["summary"]["chunk"]
        module.plot(data["rows"], data["chunk_sweep"], chunk, png)
    elif script == "vae_memory":
        module._plot(data)
    else:
        (getattr(module, "plot", None) or module._plot)(data, png)
    return True


def main(names: list[str]) -> None:
    sys.path.insert(0, str(HERE))
    names = names or sorted(p.stem for p in RESULTS.glob("*.json"))
    for name in names:
        print(f"{name}: {'redrawn' if _redraw(name) else 'no results/' + name + '.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])
