"""``hfpatch demo`` and ``hfpatch selftest``: multi-rank checks of the installation on N local CPU ranks.

``demo``: every rank builds the same tiny random-weight ``WanPipeline`` (seeded), runs it unpatched as the
reference, then with ``hfpatch.apply(pipe, parallel=N)``, and reports per rank the largest difference of the
final latents and of the video, peak activation memory, the bytes it sent and the time of the unpatched and
the patched call, then how exact each parallel path of the plan is. ``parallel=N`` gives a guiding pipeline
CFG parallel first, so at 2 ranks its plan has no sequence parallelism: the demo then also runs a plan of
sequence parallelism alone (``ParallelConfig(ulysses=2)``). The report is the README's first command.

``selftest``: the building blocks alone, in seconds: uneven ``all_gather``, ``all_to_all``, and
``usp_attention`` (Ulysses, Ring, and both when N factors) against SDPA on the full sequence.

Importing this module imports no torch (the ``hfpatch`` command's parser reads its constants); the rank
functions import it.

>>> from hfpatch.cli.demo import DemoResult, format_report
>>> rows = [DemoResult(0, 3e-7, "ParallelConfig(cfg=2, vae=2)", 2048, 1024, 512, 0.5, 0.0, "parallel=2", 0.4)]
>>> for line in format_report(rows, nproc=2, steps=2, atol=2e-4).splitlines()[2:]:
...     print(line)
plan 1: hfpatch.apply(pipe, parallel=2)
plan: ParallelConfig(cfg=2, vae=2)
rank  latents |diff|  video |diff|   peak activations unpatched -> patched  bytes sent  unpatched  patched
   0         0.0e+00       3.0e-07                      2.0 KiB -> 1.0 KiB      0.5 KiB      0.40s    0.50s
exactness of the paths in this plan:
  CFG parallel (cond and uncond calls on different ranks): bit-exact, each call is the unpatched one
  split VAE (precise, 2 row shards): equal up to fp32 reassociation (conv sums ordered per shard shape)
<BLANKLINE>
times: a tiny model on CPU processes, where collectives and scheduling outweigh milliseconds of
compute: the patched call is not faster here (speed-ups at real sizes: docs/performance.md)
<BLANKLINE>
verdict: PASS, every rank's video is within atol of the unpatched one (max abs diff 3.0e-07 <= 2.0e-04)
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_ATOL",
    "MAX_DEMO_NPROC",
    "MAX_SELFTEST_NPROC",
    "DemoResult",
    "demo_limit_reason",
    "demo_rank",
    "exactness_lines",
    "format_report",
    "format_selftest",
    "run_demo",
    "run_selftest",
    "selftest_rank",
    "sequence_parallel_plan",
]

#: Pixel tolerance (video in [0, 1]). What differs from the unpatched run is only the order of fp32 sums
#: (see :func:`exactness_lines`): measured max abs diffs are 0 to 7.5e-7 for 1-4 ranks with AVX-512, AVX2
#: and non-vectorised (``ATEN_CPU_CAPABILITY=default``) CPU kernels. 2e-4 leaves two orders of magnitude for
#: other CPUs, BLAS and oneDNN versions, whose kernels group sums differently (the random-weight transformer's
#: outputs reach ~50, which amplifies rounding), and stays far below what a real bug gives: without its halo
#: rows (``vae_mode="approx"``) the split VAE alone moves pixels by 0.35.
DEFAULT_ATOL = 2e-4
HEIGHT = WIDTH = 32
FRAMES = 5
#: Spatial factor of the tiny Wan 2.1 VAE (``vae_scale_factor_spatial`` of ``tiny_wan_pipe``).
VAE_SPATIAL_FACTOR = 8
#: Most ranks the demo can use: ``parallel=N`` splits the VAE decode over all N ranks by latent rows, the
#: 32x32 video has 32 / 8 = 4 of them and the split gives every rank at least one (its largest conv halo at
#: latent resolution). The transformer is not the limit: 4 heads, and Ring takes any remaining factor.
MAX_DEMO_NPROC = HEIGHT // VAE_SPATIAL_FACTOR
#: Most ranks ``hfpatch selftest`` starts. Nothing in the checks limits N (the sequence grows with N, ranks may
#: hold no head and, from 5 ranks on, only padding rows); this bounds how many local processes one command
#: starts, each a separate Python process that imports torch (about 0.2 GiB of memory each on CPU).
MAX_SELFTEST_NPROC = 64


def demo_limit_reason() -> str:
    """Why the demo stops at :data:`MAX_DEMO_NPROC` ranks (the CLI's error message says it)."""
    return (
        f"the demo's {HEIGHT}x{WIDTH} video has {HEIGHT // VAE_SPATIAL_FACTOR} latent rows ({HEIGHT} pixels / "
        f"the VAE's {VAE_SPATIAL_FACTOR}x spatial factor) and parallel=N splits the VAE decode over all N "
        "ranks with at least one latent row each"
    )


@dataclass(frozen=True)
class DemoResult:
    """What one rank measured (plain data, so it crosses process boundaries).

    ``max_abs_diff`` compares the videos (pixels in ``[0, 1]``), ``max_latent_diff`` the latents the
    denoising loop ends with (before the VAE decode), both against the unpatched run on the same rank.
    ``seconds``/``seconds_unpatched`` time one call each, without the memory and byte counters.
    """

    rank: int
    max_abs_diff: float
    plan: str
    peak_unpatched: int
    peak_patched: int
    bytes_sent: int
    seconds: float
    max_latent_diff: float | None = None
    #: How ``apply`` was called (``"parallel=2"``, ``"parallel=hfpatch.ParallelConfig(ulysses=2)"``).
    call: str = ""
    #: Time of the unpatched call on this rank (the same call, before ``apply``).
    seconds_unpatched: float | None = None


def _run(pipe: Any, steps: int) -> tuple[Any, Any]:
    """``(video, final latents)`` of one seeded call of the tiny pipeline."""
    import torch

    from ..testing.models import wan_prompt_embeds

    final = {}

    def keep_latents(pipe, step, timestep, kwargs):
        final["latents"] = kwargs["latents"]
        return {}

    video = pipe(
        prompt_embeds=wan_prompt_embeds(),
        negative_prompt_embeds=wan_prompt_embeds(seed=2),
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=steps,
        guidance_scale=5.0,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=keep_latents,
        callback_on_step_end_tensor_inputs=["latents"],
    ).frames
    return video, final["latents"]


def sequence_parallel_plan(nproc: int, heads: int = 4) -> dict[str, int]:
    """Degrees of sequence parallelism alone over ``nproc`` ranks: Ulysses up to the head count, Ring the rest.

    >>> sequence_parallel_plan(2), sequence_parallel_plan(6)
    ({'ulysses': 2}, {'ring': 3, 'ulysses': 2})
    """
    ulysses = max(d for d in range(1, nproc + 1) if nproc % d == 0 and heads % d == 0)
    return {k: v for k, v in (("ring", nproc // ulysses), ("ulysses", ulysses)) if v > 1}


def demo_rank(nproc: int, steps: int) -> list[DemoResult]:
    """One rank of the demo (runs under :func:`hfpatch.testing.run_ranks`): one result per plan."""
    import hfpatch

    from ..distributed import runtime
    from ..distributed.collectives import count_comm
    from ..testing.memory import track_memory
    from ..testing.models import tiny_wan_pipe

    pipe = tiny_wan_pipe()
    with track_memory() as mem_ref:
        reference, reference_latents = _run(pipe, steps)
    unpatched = _timed(pipe, steps)
    calls: list[tuple[str, Any]] = [(f"parallel={nproc}", nproc)]
    results = []
    for call, parallel in calls:
        patch = hfpatch.apply(pipe, parallel=parallel)
        with track_memory() as mem, count_comm() as comm:
            out, latents = _run(pipe, steps)
        seconds = _timed(pipe, steps)
        patch.remove()
        results.append(
            DemoResult(
                rank=runtime.rank(),
                max_abs_diff=(out - reference).abs().max().item(),
                plan=str(patch.plan),
                peak_unpatched=mem_ref.peak_bytes,
                peak_patched=mem.peak_bytes,
                bytes_sent=comm.bytes_sent,
                seconds=seconds,
                max_latent_diff=(latents - reference_latents).abs().max().item(),
                call=call,
                seconds_unpatched=unpatched,
            )
        )
        if len(calls) == 1 and patch.plan.sequence_parallel == 1 and nproc > 1:
            # parallel=N gave the ranks to CFG: show sequence parallelism too, on every rank.
            degrees = sequence_parallel_plan(nproc, pipe.transformer.config.num_attention_heads)
            text = ", ".join(f"{k}={v}" for k, v in degrees.items())
            calls.append((f"parallel=hfpatch.ParallelConfig({text})", hfpatch.ParallelConfig(**degrees)))
    return results


def _timed(pipe: Any, steps: int) -> float:
    """Seconds of one call of the demo's pipeline call (no counters)."""
    start = time.perf_counter()
    _run(pipe, steps)
    return time.perf_counter() - start


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _degrees(plan: str) -> dict[str, int]:
    """The degrees in a ``ParallelConfig`` repr; the ones it leaves out are 1."""
    degrees = dict.fromkeys(("data", "cfg", "ring", "ulysses", "vae"), 1)
    degrees.update({k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", plan)})
    return degrees


def exactness_lines(plan: str) -> list[str]:
    """How exact each parallel path of ``plan`` (a ``ParallelConfig`` repr) is against the unpatched run.

    Only the two-call CFG split is bit-exact: each rank makes one of the stock calls unchanged and the
    prediction is moved, not recomputed. Everything that splits a tensor computes the same sums on shards,
    and fp32 addition is not associative: sequence-parallel projections and attention run on sequence
    shards (Ring also merges per-block softmax partials), and the split VAE convolves row shards whose CPU
    conv kernels may order the ``C_in x k^3`` products differently from the full map (VAEs with GroupNorm,
    e.g. ``AutoencoderKL``, also sum their statistics across ranks). So those paths are equal up to fp32
    reassociation (the demo measures ~1e-7..1e-6 in pixels), not bit-exact.

    >>> exactness_lines("ParallelConfig(data=1, cfg=1, ring=3, ulysses=1, vae=3)")[1]
    '  sequence parallel (Ring 3): equal up to fp32 reassociation (projections and attention on sequence shards)'
    """
    d = _degrees(plan)
    lines = []
    if d["data"] > 1:
        lines.append(
            f"  data parallel ({d['data']} prompt groups): each group's calls are the unpatched ones"
        )
    if d["cfg"] > 1:
        lines.append(
            "  CFG parallel (cond and uncond calls on different ranks): bit-exact, each call is the unpatched one"
        )
    sp = [f"{name} {d[key]}" for name, key in (("Ulysses", "ulysses"), ("Ring", "ring")) if d[key] > 1]
    if sp:
        lines.append(
            f"  sequence parallel ({' x '.join(sp)}): equal up to fp32 reassociation "
            "(projections and attention on sequence shards)"
        )
    if d["vae"] > 1:
        lines.append(
            f"  split VAE (precise, {d['vae']} row shards): equal up to fp32 reassociation "
            "(conv sums ordered per shard shape)"
        )
    if not lines:
        lines.append("  one rank: nothing is split, the patched call is the unpatched computation")
    return ["exactness of the paths in this plan:", *lines]


def _plan_section(rows: list[DemoResult], index: int, nproc: int) -> list[str]:
    """Lines of one plan: how ``apply`` was called, the plan, one row per rank, the exactness of its paths."""
    lines = [f"plan {index}: hfpatch.apply(pipe, {rows[0].call})"]
    if index == 2:
        lines.append(
            f"  (sequence parallelism alone: parallel={nproc} gave the ranks to CFG, as the call guides)"
        )
    lines += [
        f"plan: {rows[0].plan}",
        f"{'rank':>4}  {'latents |diff|':>14}  {'video |diff|':>12}  {'peak activations unpatched -> patched':>38}  "
        f"{'bytes sent':>10}  {'unpatched':>9}  {'patched':>8}",
    ]
    for r in rows:
        peaks = f"{_mib(r.peak_unpatched)} -> {_mib(r.peak_patched)}"
        latent = "n/a" if r.max_latent_diff is None else f"{r.max_latent_diff:.1e}"
        before = "n/a" if r.seconds_unpatched is None else f"{r.seconds_unpatched:.2f}s"
        lines.append(
            f"{r.rank:>4}  {latent:>14}  {r.max_abs_diff:>12.1e}  {peaks:>38}  {_mib(r.bytes_sent):>10}  "
            f"{before:>9}  {r.seconds:>7.2f}s"
        )
    return lines + exactness_lines(rows[0].plan)


def format_report(results: list[DemoResult], nproc: int, steps: int, atol: float) -> str:
    """The demo's printed report: per plan one line per rank and the exactness of its paths; a verdict."""
    lines = [
        f"hfpatch demo: tiny WanPipeline, {FRAMES}x{HEIGHT}x{WIDTH} video, {steps} steps, CFG 5.0, "
        f"{nproc} CPU rank{'s' if nproc > 1 else ''} (gloo), fp32"
    ]
    calls = list(dict.fromkeys(r.call for r in results))
    for index, call in enumerate(calls, start=1):
        rows = [r for r in results if r.call == call]
        plans = {r.plan for r in rows}
        lines.append("")
        if len(plans) > 1:
            lines.append(f"verdict: FAIL, ranks planned differently: {sorted(plans)}")
            return "\n".join(lines)
        lines += _plan_section(rows, index, nproc)
    if nproc > 1:
        lines += [
            "",
            "times: a tiny model on CPU processes, where collectives and scheduling outweigh milliseconds of",
            "compute: the patched call is not faster here (speed-ups at real sizes: docs/performance.md)",
        ]
    worst = max(r.max_abs_diff for r in results)
    lines.append("")
    if worst <= atol:
        every = " in every plan" if len(calls) > 1 else ""
        lines.append(
            f"verdict: PASS, every rank's video is within atol of the unpatched one{every} "
            f"(max abs diff {worst:.1e} <= {atol:.1e})"
        )
    else:
        lines.append(f"verdict: FAIL, max abs diff {worst:.1e} > {atol:.1e}")
    return "\n".join(lines)


def run_demo(nproc: int = 2, steps: int = 2, atol: float = DEFAULT_ATOL) -> tuple[bool, str]:
    """Run the demo on ``nproc`` local gloo ranks; return ``(passed, report)``.

    Raises:
        ValueError: ``nproc`` not in ``1..MAX_DEMO_NPROC`` or ``steps`` below 1 (before starting any rank).
    """
    if not 1 <= nproc <= MAX_DEMO_NPROC or steps < 1:
        raise ValueError(
            f"nproc must be in 1..{MAX_DEMO_NPROC} ({demo_limit_reason()}) and steps >= 1, "
            f"got nproc={nproc}, steps={steps}"
        )
    from ..testing.runner import run_ranks

    results = [row for rows in run_ranks(nproc, demo_rank, nproc, steps, timeout_s=300.0) for row in rows]
    rows = sorted(results, key=lambda r: ([r.call for r in results].index(r.call), r.rank))
    same = all(len({r.plan for r in rows if r.call == call}) == 1 for call in {r.call for r in rows})
    passed = same and max(r.max_abs_diff for r in rows) <= atol
    return passed, format_report(rows, nproc, steps, atol)


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
    import torch
    import torch.nn.functional as F

    from ..attention import usp_attention
    from ..attention.layout import group_rank, shard_len, shard_sequence, sp_index
    from ..core.config import ParallelConfig
    from ..distributed import runtime
    from ..distributed.collectives import all_gather, all_to_all

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
        # From 5 ranks on, the last shards of the 3N + 1 rows hold padding only: nothing of theirs to compare.
        error = (out[:, :real] - ref[:, :real]).abs().max().item() if real else 0.0
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
        ValueError: ``nproc`` not in ``1..MAX_SELFTEST_NPROC`` (before starting any rank).
    """
    if not 1 <= nproc <= MAX_SELFTEST_NPROC:
        raise ValueError(f"nproc must be in 1..{MAX_SELFTEST_NPROC}, got {nproc}")
    from ..testing.runner import run_ranks

    return format_selftest(run_ranks(nproc, selftest_rank, nproc, timeout_s=120.0))
