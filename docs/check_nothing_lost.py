"""One-off check for issue 28: everything the old README said can be found again in README.md or docs/.

The README of main before the docs/ move (1430 lines, commit 5aeac19) is read with ``git show``. Checked, each
against the new README.md plus every docs/**/*.md, with whitespace collapsed (lines were re-wrapped):

* every figure: a number (``3.3e-07``, ``0.500``, ``202,752``), with its unit when it has one (``4.59 MiB``,
  ``51.1 dB``, ``1.28x``, ``0.5%``);
* every inline code span (a backticked identifier, option, command or path);
* every table row (the whole row, cells as written);
* every line of every fenced code block.

It is not a test: the old README is history, and the pages will keep changing after the move. Run it from the
repository root: ``python docs/check_nothing_lost.py [REV]`` (default ``5aeac19``); it prints what is missing and
exits 1 if anything is.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT = r"(?:\s?(?:MiB|GiB|KiB|MB|GB|B|ms|us|s|dB|x|%|GPU|GPUs|frames|tokens|ranks|steps|blocks))?"
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?" + UNIT + r"(?![\w])")


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _sections(text: str) -> tuple[str, list[str]]:
    """(the text outside fenced blocks, the lines inside them)."""
    prose, code, fenced = [], [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return "\n".join(prose), [c.strip() for c in code if c.strip()]


def main(rev: str = "5aeac19") -> int:
    old = subprocess.run(
        ["git", "show", f"{rev}:README.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    new = _flat("\n".join(p.read_text() for p in pages if "_build" not in p.parts))
    prose, code_lines = _sections(old)
    flat_prose = _flat(prose)

    spans = sorted(set(re.findall(r"`([^`]+)`", flat_prose)))
    figures = sorted(set(NUMBER.findall(flat_prose)))
    rows = [_flat(r.strip()) for r in prose.split("\n") if r.startswith("|") and not r.startswith("|---")]
    checks = {
        "inline code spans": [s for s in spans if f"`{s}`" not in new and s not in new],
        "figures (numbers with their units)": [f for f in figures if f not in new],
        "table rows": [r for r in rows if r not in new],
        "code block lines": [c for c in code_lines if _flat(c) not in new],
    }
    counts = {
        "inline code spans": len(spans),
        "figures (numbers with their units)": len(figures),
        "table rows": len(rows),
        "code block lines": len(code_lines),
    }
    missing = 0
    for kind, lost in checks.items():
        print(f"{kind}: {counts[kind] - len(lost)} of {counts[kind]} found")
        for item in lost:
            print(f"    missing: {item}")
        missing += len(lost)
    print("nothing lost" if not missing else f"{missing} item(s) not found")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
