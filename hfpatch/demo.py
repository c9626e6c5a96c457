"""``hfpatch demo``: the tiny Wan pipeline, unpatched and with ``hfpatch.apply(pipe, parallel=N)``, on N CPU ranks.

Every rank builds the same tiny random-weight ``WanPipeline`` (seeded), runs it unpatched as the
reference, then patched, and reports the largest difference, the plan, its peak activation memory and the
bytes it sent. The report is the README's first command and a multi-rank self-test of the installation.

>>> from hfpatch.demo import DemoResult, format_report
>>> rows = [DemoResult(0, 0.0, "ParallelConfig(cfg=2)", 2048, 1024, 512, 1.0)]
>>> print(format_report(rows, nproc=1, steps=2, atol=2e-4).splitlines()[-1])
verdict: PASS, every rank returns the unpatched output (max abs diff 0.0e+00 <= 2.0e-04)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["DemoResult", "demo_rank", "format_report", "run_demo"]

#: Pixel tolerance: batch/sequence splits reorder fp32 sums in a random-weight model whose transformer
#: outputs reach ~50; 2 steps and the VAE bring that to ~1e-5..1e-4 in [0, 1] pixels.
DEFAULT_ATOL = 2e-4
HEIGHT = WIDTH = 32
FRAMES = 5


@dataclass(frozen=True)
class DemoResult:
    """What one rank measured (plain data, so it crosses process boundaries)."""

    rank: int
    max_abs_diff: float
    plan: str
    peak_unpatched: int
    peak_patched: int
    bytes_sent: int
    seconds: float


def _run(pipe, steps: int) -> torch.Tensor:
    from .testing.models import wan_prompt_embeds

    return pipe(
        prompt_embeds=wan_prompt_embeds(),
        negative_prompt_embeds=wan_prompt_embeds(seed=2),
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=steps,
        guidance_scale=5.0,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames


def demo_rank(nproc: int, steps: int) -> DemoResult:
    """One rank of the demo (runs under :func:`hfpatch.testing.run_ranks`)."""
    import hfpatch

    from .distributed import runtime
    from .distributed.collectives import count_comm
    from .testing.memory import track_memory
    from .testing.models import tiny_wan_pipe

    pipe = tiny_wan_pipe()
    with track_memory() as mem_ref:
        reference = _run(pipe, steps)
    patch = hfpatch.apply(pipe, parallel=nproc)
    start = time.perf_counter()
    with track_memory() as mem, count_comm() as comm:
        out = _run(pipe, steps)
    seconds = time.perf_counter() - start
    patch.remove()
    return DemoResult(
        rank=runtime.rank(),
        max_abs_diff=(out - reference).abs().max().item(),
        plan=str(patch.plan),
        peak_unpatched=mem_ref.peak_bytes,
        peak_patched=mem.peak_bytes,
        bytes_sent=comm.bytes_sent,
        seconds=seconds,
    )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def format_report(results: list[DemoResult], nproc: int, steps: int, atol: float) -> str:
    """The demo's printed report: one line per rank and a verdict."""
    worst = max(r.max_abs_diff for r in results)
    lines = [
        f"hfpatch demo: tiny WanPipeline, {FRAMES}x{HEIGHT}x{WIDTH} video, {steps} steps, CFG 5.0, "
        f"{nproc} CPU rank{'s' if nproc > 1 else ''} (gloo), fp32",
        f"plan: {results[0].plan}",
        f"{'rank':>4}  {'max|diff|':>9}  {'peak activations unpatched -> patched':>38}  {'bytes sent':>10}  "
        f"{'patched call':>12}",
    ]
    for r in results:
        peaks = f"{_mib(r.peak_unpatched)} -> {_mib(r.peak_patched)}"
        lines.append(
            f"{r.rank:>4}  {r.max_abs_diff:>9.1e}  {peaks:>38}  {_mib(r.bytes_sent):>10}  {r.seconds:>11.2f}s"
        )
    plans = {r.plan for r in results}
    if len(plans) > 1:
        lines.append(f"verdict: FAIL, ranks planned differently: {sorted(plans)}")
    elif worst <= atol:
        lines.append(
            f"verdict: PASS, every rank returns the unpatched output (max abs diff {worst:.1e} <= {atol:.1e})"
        )
    else:
        lines.append(f"verdict: FAIL, max abs diff {worst:.1e} > {atol:.1e}")
    return "\n".join(lines)


def run_demo(nproc: int = 2, steps: int = 2, atol: float = DEFAULT_ATOL) -> tuple[bool, str]:
    """Run the demo on ``nproc`` local gloo ranks; return ``(passed, report)``.

    Raises:
        ValueError: ``nproc`` or ``steps`` below 1.
    """
    if nproc < 1 or steps < 1:
        raise ValueError(f"nproc and steps must be >= 1, got nproc={nproc}, steps={steps}")
    from .testing.runner import run_ranks

    results = run_ranks(nproc, demo_rank, nproc, steps, timeout_s=300.0)
    passed = len({r.plan for r in results}) == 1 and max(r.max_abs_diff for r in results) <= atol
    return passed, format_report(results, nproc, steps, atol)
