"""The process group a collective of :mod:`hfpatch.distributed.collectives` runs over: its size and this rank's
place in it (``None`` is the default group, and one process without a default group is a world of one), the
name by which the compiled custom ops pass it, and how a dimension splits over its ranks (:func:`even_sizes`,
:func:`check_sizes`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

__all__ = [
    "ProcessGroup",
    "check_sizes",
    "even_sizes",
    "global_rank_of",
    "group_name",
    "rank_in",
    "resolve_group",
    "size_of",
]

ProcessGroup = dist.ProcessGroup


def size_of(group: ProcessGroup | None) -> int:
    """The number of ranks of ``group`` (``None``: the default group; 1 without one: nothing to communicate).

    >>> import torch.distributed as dist
    >>> dist.is_initialized() or size_of(None) == 1
    True
    """
    # One process without a default group is a world of one: nothing to communicate.
    return 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)


def rank_in(group: ProcessGroup | None) -> int:
    """This rank's index in ``group`` (``None``: the default group; 0 without one)."""
    return 0 if group is None and not dist.is_initialized() else dist.get_rank(group)


def global_rank_of(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of rank ``group_rank`` of ``group`` (``None``: the default group, the same number)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def group_name(group: ProcessGroup | None) -> str:
    """The name a custom op is given for ``group`` (``None``: the default group)."""
    return (dist.group.WORLD if group is None else group).group_name


def resolve_group(name: str) -> ProcessGroup:
    """The process group registered under ``name`` (:func:`group_name`)."""
    return dist.distributed_c10d._resolve_process_group(name)


def even_sizes(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` sizes that differ by at most one, larger ones first.

    >>> even_sizes(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def check_sizes(name: str, sizes: Sequence[int], world: int, total: int | None = None) -> list[int]:
    """``sizes`` (the argument ``name`` of a collective) as ints, checked: one non-negative size per rank of a
    group of ``world``, adding up to ``total`` when given.

    >>> check_sizes("sizes", [2, 1], 2, total=3)
    [2, 1]
    """
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes):
        raise ValueError(f"{name} must list {world} non-negative sizes (one per rank), got {sizes}")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"{name}={sizes} must add up to the dimension size {total}")
    return sizes
