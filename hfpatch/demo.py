"""``hfpatch demo`` and ``hfpatch selftest``: multi-rank checks of the installation on N local CPU ranks.

``demo``: every rank builds the same tiny random-weight ``WanPipeline`` (seeded), runs it unpatched as the
reference, then with ``hfpatch.apply(pipe, parallel=N)``, and reports the largest difference, the plan, its
peak activation memory and the bytes it sent. The report is the README's first command.

``selftest``: the building blocks alone, in seconds: uneven ``all_gather``, ``all_to_all``, and
``usp_attention`` (Ulysses, Ring, and both when N factors) against SDPA on the full sequence.

>>> from hfpatch.demo import DemoResult, format_report
>>> rows = [DemoResult(0, 0.0, "ParallelConfig(cfg=2)", 2048, 1024, 512, 1.0)]
>>> print(format_report(rows, nproc=1, steps=2, atol=2e-4).splitlines()[-1])
verdict: PASS, every rank returns the unpatched output (max abs diff 0.0e+00 <= 2.0e-04)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = [
    "DemoResult",
    "demo_rank",
    "format_report",
    "format_selftest",
    "run_demo",
    "run_selftest",
    "selftest_rank",
]

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


#: usp_attention vs SDPA on the full sequence: fp32, O(1) values, only the order of float sums differs.
SELFTEST_ATOL = 2e-5


def _sp_layouts(nproc: int) -> list[tuple[int, int]]:
    """(ring, ulysses) degrees to check on ``nproc`` ranks: all Ulysses, all Ring, and one mix if any."""
    layouts = [(1, nproc), (nproc, 1)] if nproc > 1 else [(1, 1)]
    mixed = next((r for r in range(2, nproc) if nproc % r == 0), None)
    return layouts + ([(mixed, nproc // mixed)] if mixed else [])


def selftest_rank(nproc: int) -> dict[str, tuple[float, float]]:
    """One rank of the self-test (runs under :func:`hfpatch.testing.run_ranks`): (max abs error, atol) per check.

    Collectives move values without arithmetic: their tolerance is 0.
    """
    import torch.nn.functional as F

    from .attention import usp_attention
    from .attention.layout import group_rank, shard_len, shard_sequence, sp_index
    from .core.config import ParallelConfig
    from .distributed import runtime
    from .distributed.collectives import all_gather, all_to_all

    rank, errors = runtime.rank(), {}
    mesh = runtime.get_mesh(ParallelConfig(data=nproc)) if nproc > 1 else None
    group = None if mesh is None else mesh.group("data")
    # Uneven all_gather: rank r holds r + 1 rows filled with r.
    sizes = [r + 1 for r in range(nproc)]
    gathered = all_gather(torch.full((rank + 1, 3), float(rank)), dim=0, group=group, sizes=sizes)
    expected = torch.cat([torch.full((n, 3), float(r)) for r, n in enumerate(sizes)])
    errors["all_gather (uneven)"] = ((gathered - expected).abs().max().item(), 0.0)
    # all_to_all: rank r holds rows 100 r + j; it receives chunk r of every rank, concatenated along dim 1.
    mine = lambda r: (100 * r + torch.arange(2 * nproc, dtype=torch.float32)).view(2 * nproc, 1)  # noqa: E731
    exchanged = all_to_all(mine(rank), scatter_dim=0, gather_dim=1, group=group)
    expected = torch.cat([mine(r).chunk(nproc, dim=0)[rank] for r in range(nproc)], dim=1)
    errors["all_to_all"] = ((exchanged - expected).abs().max().item(), 0.0)

    seq, heads = 3 * nproc + 1, 2  # uneven sequence (padded shards); heads split unevenly over ulysses
    gen = torch.Generator().manual_seed(0)  # the same full q, k, v on every rank
    full = [torch.randn(1, seq, heads, 8, generator=gen) for _ in range(3)]
    reference = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in full)).transpose(1, 2)
    for ring, ulysses in _sp_layouts(nproc):
        sp_mesh = runtime.get_mesh(ParallelConfig(ring=ring, ulysses=ulysses)) if nproc > 1 else None
        ring_group = None if sp_mesh is None else sp_mesh.group("ring")
        ulysses_group = None if sp_mesh is None else sp_mesh.group("ulysses")
        index = sp_index(group_rank(ring_group), group_rank(ulysses_group), ulysses)
        q, k, v = (shard_sequence(t, 1, nproc, index) for t in full)
        out, _ = usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group, valid_len=seq)
        real = max(0, min(shard_len(seq, nproc), seq - index * shard_len(seq, nproc)))  # rows, not padding
        ref = shard_sequence(reference, 1, nproc, index)
        error = (out[:, :real] - ref[:, :real]).abs().max().item()
        errors[f"usp_attention ring={ring} ulysses={ulysses}"] = (error, SELFTEST_ATOL)
    return errors


def format_selftest(results: list[dict[str, tuple[float, float]]]) -> tuple[bool, str]:
    """``(passed, report)``: per check the worst error over ranks against its tolerance, and a verdict.

    >>> passed, report = format_selftest([{"all_to_all": (0.0, 0.0)}, {"all_to_all": (1.0, 0.0)}])
    >>> passed, report.splitlines()[-1]
    (False, 'verdict: FAIL (1 of 1 checks)')
    """
    lines = [f"hfpatch selftest: {len(results)} CPU rank{'s' if len(results) > 1 else ''} (gloo), fp32"]
    failed = 0
    for check in results[0]:
        worst, atol = max(r[check][0] for r in results), results[0][check][1]
        ok = worst <= atol
        failed += not ok
        lines.append(f"{'PASS' if ok else 'FAIL'}  {check:<36} max abs err {worst:.1e} (atol {atol:.0e})")
    lines.append("verdict: PASS" if not failed else f"verdict: FAIL ({failed} of {len(results[0])} checks)")
    return not failed, "\n".join(lines)


def run_selftest(nproc: int = 2) -> tuple[bool, str]:
    """Run the self-test on ``nproc`` local gloo ranks; return ``(passed, report)``.

    Raises:
        ValueError: ``nproc`` below 1.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    from .testing.runner import run_ranks

    return format_selftest(run_ranks(nproc, selftest_rank, nproc, timeout_s=120.0))
