"""The code blocks of README.md and docs/: every one runs, or says why it cannot.

Rules, per Markdown file (README.md and docs/**/*.md):

* Every fenced block names its language. ``text`` blocks are program output and MyST directives (``{toctree}``)
  are not code; every other block is code.
* A ``python`` block runs, in file order, in one namespace per file: as a doctest when it starts with ``>>>``
  (outputs compared, ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``), else executed as it is.
* A block preceded by ``<!-- run: torchrun --nproc-per-node N -->`` is a whole script: it is written to a file
  and launched with ``torchrun --standalone --nproc-per-node N`` on CPU (gloo), as a user would launch it, and must
  exit 0.
* Any other block (shell commands, fragments of a training script, a real checkpoint that needs the hub and
  GPUs) is preceded by ``<!-- norun: REASON -->`` with the reason it does not run here; a block that neither
  runs nor gives a reason fails the test.

The scripts are tiny random-weight models on 2 CPU ranks; the whole file runs in well under a minute.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FILES = [f for f in FILES if "_build" not in f.parts]
NOT_CODE = {"text"}
MARKER = re.compile(r"^<!--\s*(norun|run):\s*(.*?)\s*-->$")
TORCHRUN = re.compile(r"^torchrun --nproc-per-node (\d+)$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    marker: tuple[str, str] | None  # ("norun", reason) or ("run", "torchrun --nproc-per-node N")

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file (backtick fences of 3 or more, nested longer fences respected)."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening.group(1), opening.group(2).strip()
        end = i + 1
        while end < len(lines) and not re.match(rf"^{fence}\s*$", lines[end]):
            end += 1
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(previous)
        found.append(
            Block(
                path,
                i + 1,
                info.split()[0] if info else "",
                "\n".join(lines[i + 1 : end]) + "\n",
                (marker.group(1), marker.group(2)) if marker else None,
            )
        )
        i = end + 1
    return found


def _is_code(block: Block) -> bool:
    return block.language not in NOT_CODE and not block.language.startswith("{")


def _run_python(block: Block, namespace: dict) -> None:
    if block.code.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(
            block.code, namespace, str(block), str(block.path), block.line
        )
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test, out=lambda text: print(text, end=""), clear_globs=False)
        namespace.update(test.globs)  # doctest runs on a copy; later blocks of the page see its names
        assert runner.failures == 0, f"{block}: {runner.failures} doctest example(s) failed (output above)"
    else:
        exec(compile(block.code, str(block), "exec"), namespace)


def _run_script(block: Block, nproc: int, tmp_path: Path) -> None:
    script = tmp_path / f"block_{block.line}.py"
    script.write_text(block.code)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(OMP_NUM_THREADS="1", HFPATCH_TIMEOUT_S="120")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(script),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"{block} failed under torchrun ({nproc} ranks):\n{done.stdout}\n{done.stderr}"
    )


@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(ROOT)) for f in FILES])
def test_code_blocks_run_or_say_why_not(path: Path, tmp_path: Path) -> None:
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for block in blocks(path):
        assert block.language, f"{block}: a fenced block without a language (use `text` for output)"
        if not _is_code(block):
            continue
        if block.marker and block.marker[0] == "norun":
            assert len(block.marker[1]) > 10, f"{block}: `norun` needs a reason"
            continue
        if block.marker and block.marker[0] == "run":
            launch = TORCHRUN.match(block.marker[1])
            assert launch and block.language == "python", f"{block}: unknown run marker {block.marker[1]!r}"
            _run_script(block, int(launch.group(1)), tmp_path)
            continue
        assert block.language == "python", (
            f"{block}: a {block.language!r} block is not run here: add `<!-- norun: REASON -->` above it"
        )
        _run_python(block, namespace)


def test_marker_parsing() -> None:
    """The parser sees fences, languages and the marker on the line above (a test of the test)."""
    import tempfile

    text = "intro\n\n<!-- norun: needs eight GPUs -->\n```python\nx = 1\n```\n\n```text\nout\n```\n"
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "page.md"
        page.write_text(text)
        found = blocks(page)
    assert [(b.language, b.marker, b.code) for b in found] == [
        ("python", ("norun", "needs eight GPUs"), "x = 1\n"),
        ("text", None, "out\n"),
    ]


def test_readme_links_point_to_existing_files() -> None:
    """README.md is outside the Sphinx build (which checks the links of docs/): its relative links are checked here."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links to its docs pages"
    assert [link for link in local if not (ROOT / link).exists()] == []
