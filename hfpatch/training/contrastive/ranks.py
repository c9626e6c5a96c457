"""The cross-rank exchange of the losses of :mod:`hfpatch.training.contrastive`: the ranks that take part
(:func:`cross_rank_world`), the agreement of every rank's inputs (:func:`agree`: one gathered table of every
rank's metadata, before any other collective, and the wording of a disagreement, the same on every rank), one
all-gather of the candidates' columns (:func:`gather_columns`), and the route back of their gradients (one
reduce-scatter) with the value and the scalars' gradients (one all-reduce; :func:`route_back`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["agree", "cross_rank_world", "gather_columns", "route_back"]

#: Inputs (embeddings and guide embeddings together) described in the metadata row every rank exchanges.
_MAX_INPUTS = 32
_HEADER = 6  # n_reps, n_guides, working dtype, settings digest, too many inputs, with gradients
_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in _DTYPES.items()}


def cross_rank_world(group: Any = None) -> int:
    """Ranks whose embeddings ``cross_rank=True`` gathers: ``group``'s size, or 1 in a single process.

    One process (no process group, no launcher) is a world of one: the same script runs unchanged before it
    is launched on several. Launched on several without a process group is an error (nothing to gather with).

    >>> cross_rank_world()
    1
    """
    from hfpatch.distributed import runtime

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    if runtime.launched_world_size() > 1:
        raise ValueError(
            "cross_rank=True in a run launched on several processes needs the torch.distributed process group: "
            "initialise it (torch.distributed.init_process_group, or let accelerate/Trainer do it) first."
        )
    return 1


def _metadata(loss: nn.Module, embeddings: Sequence[Any], guides: Sequence[Any], grad: bool) -> list[int]:
    """This rank's row of the table :func:`agree` gathers: the header (:data:`_HEADER` fields), then batch size,
    width and number of dimensions of each input (-1: not a tensor)."""
    inputs = [*embeddings, *guides]
    work = [
        torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else None
        for t in inputs
        if isinstance(t, torch.Tensor)
    ]
    dtype = 0
    if len(work) == len(inputs) and work and None not in work and len(set(work)) == 1:
        dtype = _DTYPES[work[0]]
    elif work and None not in work and len(work) == len(inputs):
        dtype = -1  # mixed precisions
    settings = repr(sorted(loss._settings().items()))
    digest = zlib.crc32(f"{type(loss).__name__}{settings}".encode()) - 2**31
    row = [len(embeddings), len(guides), dtype, digest, int(len(inputs) > _MAX_INPUTS), int(grad)]
    for t in inputs[:_MAX_INPUTS]:
        if isinstance(t, torch.Tensor):
            row += [t.shape[0] if t.ndim else -1, t.shape[-1] if t.ndim else -1, t.ndim]
        else:
            row += [-1, -1, -1]
    return row + [0] * (_HEADER + 3 * _MAX_INPUTS - len(row))


def agree(
    loss: nn.Module, embeddings: Sequence[Any], guides: Sequence[Any], world: int, group: Any, grad: bool
) -> list[int]:
    """Check every rank's inputs to ``loss`` (a :class:`~hfpatch.training.contrastive.base.ContrastiveLoss`)
    from every rank's metadata; return each rank's batch size.

    One all-gather of a fixed-size row of metadata over ``group`` (none with ``world == 1``); any problem with
    any rank's inputs raises the same ``ValueError`` on every rank.

    >>> import torch
    >>> from hfpatch.training.contrastive import InfoNCELoss
    >>> agree(InfoNCELoss(), [torch.randn(3, 4), torch.randn(3, 4)], [], 1, None, False)
    [3]
    """
    row = _metadata(loss, embeddings, guides, grad)
    if world == 1:
        table = [row]
    else:
        from hfpatch.distributed.collectives import all_gather

        device = torch.device("cpu")  # the same on every rank, whatever a bad input's device
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        local = torch.tensor(row, dtype=torch.int64, device=device)[None]
        table = all_gather(local, 0, group).tolist()
    problem = _problem(type(loss).__name__, loss, table)
    if problem is not None:
        raise ValueError(problem)
    return [r[_HEADER] for r in table]


def gather_columns(reps, guides, gathered, guide_gathered, sizes, group):
    """One all-gather of every gathered input (embeddings and guides, flat): their global rows."""
    from hfpatch.distributed.collectives import all_gather

    parts = [reps[k] for k in gathered] + [guides[k] for k in guide_gathered]
    widths = [p.shape[-1] for p in parts]
    flat = torch.cat([p.reshape(-1) for p in parts])
    full = all_gather(flat, 0, group, [s * sum(widths) for s in sizes])
    per_rank = full.split([s * sum(widths) for s in sizes])
    pieces = [seg.split([s * w for w in widths]) for seg, s in zip(per_rank, sizes)]
    merged = [
        torch.cat([pieces[r][j].view(sizes[r], widths[j]) for r in range(len(sizes))])
        for j in range(len(parts))
    ]
    columns = [None] * len(reps)
    for k, m in zip(gathered, merged[: len(gathered)]):
        columns[k] = m
    guide_columns = [None] * len(guides)
    for k, m in zip(guide_gathered, merged[len(gathered) :]):
        guide_columns[k] = m
    return columns, guide_columns


def route_back(value, d_scalars, d_columns, gathered, sizes, group, grad):
    """One reduce-scatter of the candidates' gradients to their ranks, one all-reduce of the value and the
    scalars' gradients (sums over ranks)."""
    from hfpatch.distributed.collectives import all_reduce_sum, reduce_scatter

    me = dist.get_rank(group)
    d_local: list[torch.Tensor | None] = [None] * len(d_columns)
    if grad:
        keys = [k for k in gathered if d_columns[k] is not None]
        if keys:
            widths = [d_columns[k].shape[-1] for k in keys]
            per_rank = [
                torch.cat([d_columns[k][sum(sizes[:r]) : sum(sizes[: r + 1])].reshape(-1) for k in keys])
                for r in range(len(sizes))
            ]
            flat = torch.cat(per_rank)
            del per_rank
            mine = reduce_scatter(flat, 0, group, [s * sum(widths) for s in sizes])
            for k, part in zip(keys, mine.split([sizes[me] * w for w in widths])):
                d_local[k] = part.view(sizes[me], -1)
    present = [k for k, d in enumerate(d_scalars) if d is not None]
    sums = all_reduce_sum(torch.stack([value, *(d_scalars[k] for k in present)]), group)
    totals = list(d_scalars)
    for k, total in zip(present, sums[1:]):
        totals[k] = total
    return sums[0], totals, d_local


def _problem(name: str, loss: nn.Module, table: list[list[int]]) -> str | None:
    """The first problem with any rank's inputs, worded the same on every rank (``None``: all fine)."""
    world = len(table)
    on = (lambda r: f" on rank {r}") if world > 1 else (lambda r: "")
    for r, row in enumerate(table):
        n_reps, n_guides, dtype, _, too_many, _ = row[:_HEADER]
        inputs = [
            tuple(row[_HEADER + 3 * k : _HEADER + 3 * k + 3])
            for k in range(min(n_reps + n_guides, _MAX_INPUTS))
        ]
        if too_many:
            return f"{name}: at most {_MAX_INPUTS} inputs (embeddings and guides), got {n_reps + n_guides}{on(r)}."
        hi = loss.max_inputs
        if n_reps < loss.min_inputs or (hi is not None and n_reps > hi):
            want = (
                f"{loss.min_inputs}"
                if hi == loss.min_inputs
                else f"{loss.min_inputs} to {hi}"
                if hi
                else f"at least {loss.min_inputs}"
            )
            return f"{name} takes {want} embedding inputs (row i of each belongs to pair i), got {n_reps}{on(r)}."
        guide_problem = loss._check_guides(n_reps, n_guides)
        if guide_problem:
            return f"{name} {guide_problem}{on(r)}."
        for k, (_, _, ndim) in enumerate(inputs):
            if ndim != 2:
                what = "embedding input" if k < n_reps else "guide embedding"
                idx = k if k < n_reps else k - n_reps
                shape = "not a tensor" if ndim == -1 else f"{ndim}-D"
                return f"{name}: {what} {idx} is {shape}{on(r)}; expected a [batch, dim] tensor."
        if dtype == 0:
            return f"{name}: the embeddings must be floating-point tensors{on(r)}."
        if dtype == -1:
            return f"{name}: the inputs mix float dtypes{on(r)}; give every embedding (and guide) one dtype."
        batches = [b for b, _, _ in inputs]
        if len(set(batches)) != 1:
            return (
                f"{name} pairs row i of every input, but the inputs have batch sizes {batches[:n_reps]}"
                + (f" (guides {batches[n_reps:]})" if n_guides else "")
                + f"{on(r)}; give every tower (and guide) the same number of rows."
            )
        widths = [d for _, d, _ in inputs[:n_reps]]
        if len(set(widths)) != 1:
            return f"{name}: the embeddings have different widths {widths}{on(r)}; every input must be [batch, D] with one D."
        guide_widths = [d for _, d, _ in inputs[n_reps:]]
        if len(set(guide_widths)) > 1:
            return f"{name}: the guide embeddings have different widths {guide_widths}{on(r)}."
    if world > 1:
        for field, what in ((0, "numbers of embedding inputs"), (1, "numbers of guide inputs")):
            values = [row[field] for row in table]
            if len(set(values)) != 1:
                return f"{name}: the ranks disagree on their {what}: {values} (rank 0, 1, ...); cross-rank negatives need the same inputs on every rank."
        widths = [row[_HEADER + 1] for row in table]
        if len(set(widths)) != 1:
            return f"{name}: the ranks' embeddings have different widths {widths} (rank 0, 1, ...); cross-rank negatives need one D."
        n = table[0][0] + table[0][1]
        if n > table[0][0]:
            guide_widths = [row[_HEADER + 3 * table[0][0] + 1] for row in table]
            if len(set(guide_widths)) != 1:
                return f"{name}: the ranks' guide embeddings have different widths {guide_widths} (rank 0, 1, ...)."
        dtypes = [row[2] for row in table]
        if len(set(dtypes)) != 1:
            names = [_DTYPE_NAMES.get(d, "?") for d in dtypes]
            return f"{name}: the ranks compute in different dtypes {names} (rank 0, 1, ...); give every rank the same dtype."
        grads = [row[5] for row in table]
        if len(set(grads)) != 1:
            return (
                f"{name}: some ranks compute gradients and others do not ({['yes' if g else 'no' for g in grads]}, "
                "rank 0, 1, ...); call the loss under torch.no_grad() on every rank or on none."
            )
        digests = [row[3] for row in table]
        if len(set(digests)) != 1:
            return (
                f"{name}: the ranks use different loss settings (ranks "
                f"{[r for r, d in enumerate(digests) if d != table[0][3]]} differ from rank 0 in "
                f"{', '.join(loss._settings())}); build the loss with the same arguments on every rank."
            )
    return None
