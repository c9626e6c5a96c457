"""The ``hfpatch`` command: ``demo``, ``selftest``, ``bench`` and ``info``.

* ``hfpatch demo [--nproc N]``: the tiny Wan pipeline unpatched vs ``hfpatch.apply(pipe, parallel=N)``.
* ``hfpatch selftest [--nproc N]``: collectives and ``usp_attention`` exactness on N local gloo ranks.
* ``hfpatch bench [NAME]``: list, or run, the scripts in ``benchmarks/`` of a source checkout.
* ``hfpatch info``: versions, device, world size and the registered patch families.
* ``hfpatch --version``.

Each prints its report and exits with status 0 on success, 1 on a failed check, 2 on a usage error
(arguments are checked before any rank starts). Parsing imports no torch, so ``--help`` is instant.

>>> from hfpatch.cli import build_parser
>>> build_parser().parse_args(["selftest", "--nproc", "4"]).nproc
4
"""

from __future__ import annotations

import argparse
import importlib
import math
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import __version__

__all__ = ["benchmark_dir", "benchmarks", "build_parser", "info_lines", "main"]

_PACKAGES = ("hfpatch", "torch", "diffusers", "transformers", "peft", "accelerate", "xformers")


def _int_in_range(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse ``type=``: an int ``>= low`` (and ``<= high``, the reason for that bound in ``why``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}: {why}")
        return value

    return parse


def _tolerance(text: str) -> float:
    """An argparse ``type=``: a finite float ``>= 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``hfpatch`` argument parser (imports no torch)."""
    from .demo import DEFAULT_ATOL, MAX_DEMO_NPROC, MAX_SELFTEST_NPROC, demo_limit_reason

    parser = argparse.ArgumentParser(
        prog="hfpatch", description="Patch stock Hugging Face models to scale across GPUs and fit in memory."
    )
    parser.add_argument("--version", action="version", version=f"hfpatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="run the tiny Wan pipeline unpatched and with hfpatch.apply(pipe, parallel=N) on N CPU ranks",
        description="Run the tiny Wan pipeline unpatched and with hfpatch.apply(pipe, parallel=N) on N local "
        "CPU processes (gloo); report the difference, the plan and how exact each of its paths is, peak "
        "activation memory and bytes sent per rank. Exits with status 1 when an output differs from the "
        "unpatched one by more than --atol.",
    )
    demo.add_argument(
        "--nproc",
        type=_int_in_range(1, MAX_DEMO_NPROC, demo_limit_reason()),
        default=2,
        help=f"number of local ranks, 1 to {MAX_DEMO_NPROC} (default: 2); more ranks than CPU cores is fine, "
        "they share the cores",
    )
    demo.add_argument("--steps", type=_int_in_range(1), default=2, help="denoising steps, >= 1 (default: 2)")
    demo.add_argument(
        "--atol",
        type=_tolerance,
        default=DEFAULT_ATOL,
        help=f"pixel tolerance, >= 0 (default: {DEFAULT_ATOL}; the outputs differ by fp32 reassociation only)",
    )
    selftest = commands.add_parser(
        "selftest",
        help="check the collectives and usp_attention against one-process results on N CPU ranks (seconds)",
        description="On N local CPU processes (gloo): uneven all_gather and all_to_all (exact), and "
        "usp_attention with Ulysses, Ring (and both when N factors) against SDPA on the full sequence. Prints "
        "PASS/FAIL per check; exits with status 1 when one fails.",
    )
    selftest.add_argument(
        "--nproc",
        type=_int_in_range(
            1,
            MAX_SELFTEST_NPROC,
            "selftest starts one local Python process per rank (each imports torch, about 0.2 GiB of memory) "
            f"and caps them at {MAX_SELFTEST_NPROC}; the checks themselves work for any number of ranks",
        ),
        default=2,
        help=f"number of local ranks, 1 to {MAX_SELFTEST_NPROC} (default: 2); more ranks than CPU cores is "
        "fine, they share the cores",
    )
    bench = commands.add_parser(
        "bench",
        help="list, or run, the benchmark scripts of an hfpatch source checkout",
        description="Without NAME: list the scripts in benchmarks/ of the source checkout hfpatch runs "
        "from. With NAME: run benchmarks/NAME.py there (it writes benchmarks/results/NAME.json and .png) "
        "and exit with its status.",
    )
    bench.add_argument("name", nargs="?", help="benchmark to run (file name without .py); omit to list")
    commands.add_parser(
        "info",
        help="versions, device, world size and the registered patch families",
        description="Print "
        "package versions, the device and backend, the world size and the patch families per class.",
    )
    return parser


def _version(package: str) -> str:
    try:
        module = importlib.import_module(package)
    except Exception as exc:  # xformers raises more than ImportError when its build does not match torch
        return f"not available ({type(exc).__name__})"
    return getattr(module, "__version__", "unknown")


def info_lines() -> list[str]:
    """The lines ``hfpatch info`` prints."""
    import torch

    from .distributed import runtime
    from .patches import BUILTIN_FAMILIES

    lines = [f"python        {platform.python_version()} ({platform.system()} {platform.machine()})"]
    lines += [f"{package:<13} {_version(package)}" for package in _PACKAGES]
    if torch.cuda.is_available():
        device = f"cuda x {torch.cuda.device_count()} ({torch.cuda.get_device_name(0)}), backend nccl"
    else:
        device = "cpu, backend gloo"
    lines.append(f"device        {device}")
    lines.append(f"world size    {runtime.launched_world_size()} (rank {runtime.rank()})")
    lines.append("patch families (class: family [options]):")
    for key, entry in BUILTIN_FAMILIES:
        module, _, attr = entry.partition(":")
        try:
            family = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            lines.append(f"  {key}: {entry} unavailable ({exc})")
            continue
        options = ", ".join(f"{k}={v!r}" for k, v in family.options.items()) or "no options"
        lines.append(f"  {key}: {family.name} ({family.role}) [{options}]")
    try:
        from .patches.dit.family import support_table

        rows = support_table()
    except ImportError as exc:
        lines.append(f"sequence parallel by diffusers transformer class: unavailable ({exc})")
    else:
        lines.append("sequence parallel by diffusers transformer class:")
        lines += [f"  {name}: {how}" for name, how in rows]
    try:
        from .patches.vae.support import support_table as vae_support_table

        rows = vae_support_table()
    except ImportError as exc:
        lines.append(f"VAE split by diffusers autoencoder class: unavailable ({exc})")
    else:
        lines.append("VAE split by diffusers autoencoder class:")
        lines += [f"  {name}: {how}" for name, how in rows]
    return lines


def benchmark_dir() -> Path | None:
    """``benchmarks/`` of the source checkout: next to the ``hfpatch`` package (editable install), or in the
    current directory; ``None`` for an installed wheel run elsewhere (the scripts are not packaged)."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "benchmarks").is_dir() and (root / "hfpatch").is_dir():
            return root / "benchmarks"
    return None


def benchmarks(directory: Path) -> dict[str, str]:
    """Benchmark name -> first line of its docstring, for every ``*.py`` script in ``directory``."""
    import ast

    found = {}
    for script in sorted(directory.glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        found[script.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def _bench(name: str | None, directory: Path | None) -> int:
    if directory is None:
        print(
            "hfpatch bench: no benchmarks/ directory found next to the hfpatch package or in the current "
            "directory; the benchmark scripts ship with the source, not the wheel: clone the hfpatch repository, "
            "`pip install -e .` it and run `hfpatch bench` there",
            file=sys.stderr,
        )
        return 2
    found = benchmarks(directory)
    if name is None:
        print(f"benchmarks in {directory} (run: hfpatch bench NAME):")
        print("\n".join(f"  {n:<22} {doc}" for n, doc in found.items()))
        return 0
    if name not in found:
        print(
            f"hfpatch bench: no benchmark {name!r} in {directory}; available: {', '.join(found)}",
            file=sys.stderr,
        )
        return 2
    # From the checkout root, as the scripts document (``python benchmarks/NAME.py``).
    return subprocess.run([sys.executable, str(directory / f"{name}.py")], cwd=directory.parent).returncode


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hfpatch`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "info":
        print("\n".join(info_lines()))
        return 0
    if args.command == "bench":
        return _bench(args.name, benchmark_dir())
    if args.command == "selftest":
        from .demo import run_selftest

        passed, report = run_selftest(nproc=args.nproc)
    else:
        from .demo import run_demo

        passed, report = run_demo(nproc=args.nproc, steps=args.steps, atol=args.atol)
    print(report)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
