"""The ``hfpatch`` command: ``generate``, ``serve``, ``demo``, ``selftest``, ``bench`` and ``info``.

* ``hfpatch generate MODEL --prompt ... --out FILE``: a diffusers checkpoint on every launched rank
  (``torchrun --nproc-per-node N -m hfpatch generate ...``), see :mod:`hfpatch.cli.generate`.
* ``hfpatch serve MODEL --port 8000``: the same pipeline kept loaded on every launched rank behind an HTTP API on
  rank 0 (``[serve]`` extra), see :mod:`hfpatch.cli.serve`.
* ``hfpatch demo [--nproc N]``: the tiny Wan pipeline unpatched vs ``hfpatch.apply(pipe, parallel=N)``.
* ``hfpatch selftest [--nproc N]``: collectives and ``usp_attention`` exactness on N local gloo ranks.
* ``hfpatch bench [NAME]``: list, or run, the scripts in ``benchmarks/`` of a source checkout.
* ``hfpatch info [--classes]``: versions, device, world size and a summary of the patch families.
* ``hfpatch --version``.

Each prints its report and exits with status 0 on success, 1 on a failed check, 2 on a usage error
(arguments are checked before any rank starts). Parsing imports no torch, so ``--help`` is instant.

This package is the command (its parser, ``info``, ``bench`` and the dispatch); the commands with a body of their
own are modules of it: :mod:`hfpatch.cli.generate` (with its options, :mod:`hfpatch.cli.arguments`, and what a
run writes, :mod:`hfpatch.cli.outputs`) and :mod:`hfpatch.cli.demo` (``demo`` and ``selftest``).

>>> from hfpatch.cli import build_parser
>>> build_parser().parse_args(["selftest", "--nproc", "4"]).nproc
4
"""

from __future__ import annotations

import argparse
import importlib
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import __version__

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
    from .arguments import _finite_float

    return _finite_float(text, at_least=0.0)


def build_parser() -> argparse.ArgumentParser:
    """The ``hfpatch`` argument parser (imports no torch)."""
    from .demo import DEFAULT_ATOL, MAX_DEMO_NPROC, MAX_SELFTEST_NPROC, demo_limit_reason

    parser = argparse.ArgumentParser(
        prog="hfpatch", description="Patch stock Hugging Face models to scale across GPUs and fit in memory."
    )
    parser.add_argument("--version", action="version", version=f"hfpatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    from .generate import add_arguments as add_generate_arguments

    add_generate_arguments(
        commands.add_parser(
            "generate",
            help="run a diffusers checkpoint on every launched rank: torchrun --nproc-per-node N -m hfpatch generate",
            description="Load a diffusers pipeline (a local folder or a hub id), hfpatch.apply it over the ranks "
            "torchrun launched (or one process) and write its output from rank 0. Every rank runs the same "
            "command and computes the unpatched pipeline's output; what can be checked without the weights "
            "(degrees vs the world size, output suffixes, the model's classes) is a usage error (exit status 2) "
            "before any weight loads.",
        )
    )
    from .serve import add_serve_arguments

    add_serve_arguments(
        commands.add_parser(
            "serve",
            help="keep a diffusers checkpoint loaded on every launched rank behind an HTTP API on rank 0: torchrun "
            "--nproc-per-node N -m hfpatch serve MODEL --port 8000 (needs hfpatch[serve])",
            description="Load and patch a diffusers pipeline on every rank as hfpatch generate does, then answer "
            "OpenAI-style requests (POST /v1/images/generations, /v1/videos/generations; GET /health, /metrics) "
            "from rank 0, every rank running each request's call in step. The generate options fix the pipeline; "
            "the call's options are the defaults of every request.",
        )
    )
    from .plan import add_arguments as add_plan_arguments

    add_plan_arguments(
        commands.add_parser(
            "plan",
            help="the plan parallel=N*G gets on N nodes of G GPUs, and the bytes each rank sends per step inside a "
            "node and across nodes (reads configs only)",
            description="Build the pipeline from its configs on the meta device (no weights, no process group), "
            "plan it as hfpatch.apply would on --nodes x --gpus-per-node ranks (Ulysses inside a node; CFG, "
            "data and Ring across nodes), and print the bytes each rank sends in one denoising step, inside its "
            "node and across nodes (Wan and Flux token layouts).",
        )
    )
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
    info = commands.add_parser(
        "info",
        help="versions, device, world size and the registered patch families",
        description="Print package versions, the device and backend, the world size, and a summary of the patch "
        "families (what each patches, for how many classes, its options).",
    )
    info.add_argument(
        "--classes",
        action="store_true",
        help="list every registered class with its families and options, and every diffusers transformer class "
        "with how hfpatch splits its sequence (or why it does not)",
    )
    return parser


def _version(package: str) -> str:
    try:
        module = importlib.import_module(package)
    except Exception as exc:  # xformers raises more than ImportError when its build does not match torch
        return f"not available ({type(exc).__name__})"
    return getattr(module, "__version__", "unknown")


def _wrapped(label: str, items: Sequence[str], indent: int = 6, width: int = 110) -> list[str]:
    """``label`` then ``items`` joined by commas, wrapped under it."""
    import textwrap

    return textwrap.wrap(
        label + ", ".join(items), width=width, subsequent_indent=" " * indent, break_on_hyphens=False
    )


def info_lines(classes: bool = False) -> list[str]:
    """The lines ``hfpatch info`` prints (``classes``: every class, as ``hfpatch info --classes``).

    By default each patch family is one entry (the VAE families, one per VAE kind, together): what it patches,
    the classes it is registered for (counted, the first few named) and its options, once; ``classes=True``
    lists every class with its families.
    """
    import torch

    from ..distributed import runtime
    from ..patches import BUILTIN_FAMILIES

    lines = [f"python        {platform.python_version()} ({platform.system()} {platform.machine()})"]
    lines += [f"{package:<13} {_version(package)}" for package in _PACKAGES]
    if torch.cuda.is_available():
        device = f"cuda x {torch.cuda.device_count()} ({torch.cuda.get_device_name(0)}), backend nccl"
    else:
        device = "cpu, backend gloo"
    lines.append(f"device        {device}")
    lines.append(f"world size    {runtime.launched_world_size()} (rank {runtime.rank()})")

    families: dict[tuple[str, str, str], list[str]] = {}  # (name, role, options) -> class keys
    missing: list[str] = []
    for key, entry in BUILTIN_FAMILIES:
        module, _, attr = entry.partition(":")
        try:
            family = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            missing.append(f"  {key}: {entry} unavailable ({exc})")
            continue
        options = ", ".join(f"{k}={v!r}" for k, v in family.options.items()) or "no options"
        families.setdefault((family.name, family.role, options), []).append(key)
    if classes:
        lines.append("patch families by class (class: family (role) [options]):")
        for (name, role, options), keys in families.items():
            lines += [f"  {key}: {name} ({role}) [{options}]" for key in keys]
    else:
        vae_families = sum(1 for _, role, _ in families if role == "vae")
        grouping = f", the {vae_families} VAE families as one entry" if vae_families > 1 else ""
        lines.append(
            f"patch families ({len(families)}{grouping}; `hfpatch info --classes` lists every class),"
        )
        lines.append("  in parentheses the kind of object each patches:")
        # The VAE families (one per VAE architecture, the same options) make one entry.
        grouped: dict[tuple[str, str, str], tuple[list[str], list[str]]] = {}
        for (name, role, options), keys in families.items():
            label = "VAE height split" if role == "vae" else name
            names, all_keys = grouped.setdefault((label, role, options), ([], []))
            names.append(name)
            all_keys += keys
        for (label, role, options), (names, keys) in grouped.items():
            short = [key.split(".", 1)[1] for key in keys]
            count = f"{len(keys)} classes" if len(keys) > 1 else "1 class"
            shown = short if len(short) <= 6 else [*short[:5], f"... ({len(short) - 5} more)"]
            lines += _wrapped(f"  {label} ({role}), {count}: ", shown)
            if len(names) > 1:
                lines += _wrapped("      families: ", names)
            lines += _wrapped("      options: ", [options])
    lines += missing
    lines += _support_lines(
        "hfpatch.patches.dit.family",
        "sequence parallel by diffusers transformer class",
        lambda how: not how.startswith("not supported"),
        "sequence parallel: {} of the {} diffusers transformer classes ",
        "(`hfpatch info --classes` gives each one's plan, or why it is not split)",
        classes,
    )
    lines += _support_lines(
        "hfpatch.patches.vae.support",
        "VAE split by diffusers autoencoder class",
        lambda how: how.startswith("split"),
        "VAE split by height: {} of the {} diffusers autoencoder classes ",
        "(`hfpatch info --classes` says why the others are not split)",
        classes,
    )
    lines += _support_lines(
        "hfpatch.patches.decoder.table",
        "sequence parallel by transformers decoder class",
        lambda how: not how.startswith("refused"),
        "sequence-parallel decoders: {} of {} transformers classes ",
        "(`hfpatch info --classes` gives each one's split, or why it is refused)",
        classes,
    )
    return lines


def _support_lines(
    module: str,
    title: str,
    counts: Callable[[str], bool],
    summary: str,
    hint: str,
    classes: bool,
) -> list[str]:
    """``module``'s ``support_table()``: every class with ``classes``, else how many ``counts`` (``summary`` takes
    the count and the total) and the ``hint``; a table whose diffusers classes fail to import says so."""
    try:
        rows = importlib.import_module(module).support_table()
    except ImportError as exc:
        return [f"{title}: unavailable ({exc})"]
    rows = [row[-2:] for row in rows]  # (name, how); the decoder table leads with the family
    if classes:
        return [f"{title}:", *(f"  {name}: {how}" for name, how in rows)]
    counted = sum(1 for _, how in rows if counts(how))
    return _wrapped(summary.format(counted, len(rows)), [hint], indent=2)


def benchmark_dir() -> Path | None:
    """``benchmarks/`` of the source checkout: next to the ``hfpatch`` package (editable install), or in the
    current directory; ``None`` for an installed wheel run elsewhere (the scripts are not packaged)."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "benchmarks").is_dir() and (root / "hfpatch").is_dir():
            return root / "benchmarks"
    return None


def benchmarks(directory: Path) -> dict[str, str]:
    """Benchmark name -> the first paragraph of its docstring (one line), for every ``*.py`` script in
    ``directory`` (``_``-prefixed modules are helpers, not benchmarks)."""
    import ast

    found = {}
    for script in sorted(directory.glob("*.py")):
        if script.name.startswith("_"):
            continue
        doc = (ast.get_docstring(ast.parse(script.read_text())) or "").strip()
        found[script.stem] = " ".join(doc.split("\n\n")[0].split())
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
        import textwrap

        print(f"benchmarks in {directory} (run: hfpatch bench NAME):")
        for n, doc in found.items():
            wrapped = textwrap.wrap(doc, width=110, initial_indent=f"  {n:<20} ", subsequent_indent=" " * 23)
            print("\n".join(wrapped or [f"  {n}"]))
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
    if args.command == "generate":
        from .generate import main as generate

        return generate(args)
    if args.command == "serve":
        from .serve import main as serve

        return serve(args)
    if args.command == "plan":
        from .plan import main as plan

        return plan(args)
    if args.command == "info":
        print("\n".join(info_lines(classes=args.classes)))
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
