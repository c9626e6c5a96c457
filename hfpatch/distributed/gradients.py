"""Gradient reduction for models whose work is split over ranks (sequence-parallel DiTs, patch-parallel VAEs)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_reduce_gradients"]


def _group_of(patch: Any) -> Any:
    from .runtime import get_mesh

    plan = patch.plan
    if plan is None or plan.world_size == 1:
        return None
    axis = "sp" if plan.sequence_parallel > 1 else "vae"
    return get_mesh(plan).group(axis)


def all_reduce_gradients(
    tensors: torch.nn.Module | Iterable[torch.Tensor | torch.nn.Module], group_or_patch: Any = None
) -> None:
    """Sum the ``.grad`` of ``tensors`` (or of modules' parameters) over a process group, in place.

    After ``loss.backward()`` on a model patched to split its work (sequence-parallel transformer,
    patch-parallel VAE) every rank holds its shard's share of each gradient; their SUM over the group that
    split the work is the unpatched gradient, for parameters and inputs alike. Call this once before the
    optimizer step (it is linear, so gradient accumulation is fine). One flat all-reduce per dtype.

    Args:
        tensors: A module, or an iterable of tensors/modules whose ``.grad`` to reduce.
        group_or_patch: A process group, or the :class:`hfpatch.Patch` returned by ``apply`` (its ``sp``
            group when sequence-parallel, else its ``vae`` group), or ``None``: the live patch of ``tensors``
            when it is a patched module, else nothing to do.

    >>> import torch
    >>> from hfpatch.distributed.gradients import all_reduce_gradients
    >>> layer = torch.nn.Linear(2, 2)
    >>> all_reduce_gradients(layer, None)  # one rank: nothing to reduce
    """
    if group_or_patch is None and isinstance(tensors, torch.nn.Module):
        from ..core.apply import get_patch

        group_or_patch = get_patch(tensors)
    group = group_or_patch
    if hasattr(group_or_patch, "plan"):
        group = _group_of(group_or_patch)
    if group is None:
        return
    items = [tensors] if isinstance(tensors, torch.nn.Module) else list(tensors)
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for item in items:
        params = item.parameters() if isinstance(item, torch.nn.Module) else [item]
        for p in params:
            if p.grad is not None:
                by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_kind.values():
        # One flat buffer per dtype: a single collective instead of one per parameter.
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
