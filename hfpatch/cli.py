"""The ``hfpatch`` command: ``hfpatch demo`` (multi-rank self-test on tiny models) and ``hfpatch info``.

>>> from hfpatch.cli import build_parser
>>> build_parser().parse_args(["demo", "--nproc", "4"]).nproc
4
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "info_lines", "main"]

_PACKAGES = ("hfpatch", "torch", "diffusers", "transformers", "peft", "accelerate", "xformers")


def build_parser() -> argparse.ArgumentParser:
    from .demo import DEFAULT_ATOL

    parser = argparse.ArgumentParser(
        prog="hfpatch", description="Patch stock Hugging Face models to scale across GPUs and fit in memory."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="run the tiny Wan pipeline unpatched and with hfpatch.apply(pipe, parallel=N) on N CPU ranks",
        description="Run the tiny Wan pipeline unpatched and with hfpatch.apply(pipe, parallel=N) on N local "
        "CPU processes (gloo); report the difference, the plan, peak activation memory and bytes sent per rank. "
        "Exits with status 1 when an output differs from the unpatched one by more than --atol.",
    )
    demo.add_argument("--nproc", type=int, default=2, help="number of local ranks (default: 2)")
    demo.add_argument("--steps", type=int, default=2, help="denoising steps (default: 2)")
    demo.add_argument(
        "--atol", type=float, default=DEFAULT_ATOL, help=f"pixel tolerance (default: {DEFAULT_ATOL})"
    )
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
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hfpatch`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "info":
        print("\n".join(info_lines()))
        return 0
    from .demo import run_demo

    passed, report = run_demo(nproc=args.nproc, steps=args.steps, atol=args.atol)
    print(report)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
