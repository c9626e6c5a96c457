"""Gradient reduction for models whose work is split over ranks (sequence-parallel DiTs, patch-parallel VAEs)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_reduce_gradients"]


_FROM_PATCH = object()


def all_reduce_gradients(
    tensors: torch.nn.Module | Iterable[torch.Tensor | torch.nn.Module], group_or_patch: Any = _FROM_PATCH
) -> None:
    """Sum the ``.grad`` of ``tensors`` (or of modules' parameters) over a process group, in place.

    After ``loss.backward()`` on a model patched to split its work (sequence-parallel transformer,
    patch-parallel VAE) every rank holds its shard's share of each gradient; their SUM over the group that
    split the work is the unpatched gradient, for parameters and inputs alike. Call this once before the
    optimizer step (it is linear, so gradient accumulation is fine). One flat all-reduce per dtype.

    Args:
        tensors: A module, or an iterable of tensors/modules whose ``.grad`` to reduce.
        group_or_patch: A process group, or the :class:`hfpatch.Patch` of the module (its ``reduce_group``:
            the ``sp`` group of a sequence-parallel transformer, the ``vae`` group of a split VAE), or
            ``None`` (a degree-1 mesh axis: nothing to do). Default: the live patch of the modules given,
            found through DDP/FSDP/DataParallel and ``torch.compile`` wrappers (what
            ``accelerator.prepare`` returns works as it is).

    Raises:
        ValueError: torch.distributed runs more than one rank but no group could be found (an unpatched
            module and no group given), or the ranks disagree on the gradients to reduce.

    >>> import torch
    >>> from hfpatch.distributed.gradients import all_reduce_gradients
    >>> layer = torch.nn.Linear(2, 2)
    >>> all_reduce_gradients(layer)  # not patched, one process: nothing to reduce
    """
    items = [tensors] if isinstance(tensors, torch.nn.Module) else list(tensors)
    group = _resolve_group(items, group_or_patch)
    if group is None:
        return
    # Every tensor that requires grad takes part in the layout check; one that has a grad on some rank is
    # reduced everywhere (a missing grad counts as zeros), one that has none on any rank keeps .grad None,
    # as in the unpatched step (an optimizer skips it rather than decaying it).
    params = [
        p for item in items for p in (item.parameters() if isinstance(item, torch.nn.Module) else [item])
    ]
    params = [p for p in params if p.requires_grad]
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), group_params in by_kind.items():
        sizes = torch.tensor([len(group_params), sum(p.numel() for p in group_params)], device=device)
        if dist.get_world_size(group) > 1:
            seen = [torch.empty_like(sizes) for _ in range(dist.get_world_size(group))]
            dist.all_gather(seen, sizes, group=group)
            if any(not torch.equal(s, sizes) for s in seen):
                raise ValueError(
                    f"all_reduce_gradients: ranks pass different {dtype} parameters (count, elements): "
                    f"{[tuple(s.tolist()) for s in seen]}; pass the same model on every rank"
                )
        has_grad = torch.tensor([p.grad is not None for p in group_params], dtype=torch.int32, device=device)
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
        group_params = [p for p, used in zip(group_params, has_grad.tolist()) if used]
        if not group_params:
            continue
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group_params]
        )
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for p in group_params:
            reduced = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.copy_(reduced)


def _resolve_group(items: list[Any], group_or_patch: Any) -> Any:
    if group_or_patch is not _FROM_PATCH:
        return getattr(group_or_patch, "reduce_group", group_or_patch)
    from ..core.apply import get_patch
    from ..core.wrappers import unwrap_model

    # DDP/FSDP (accelerator.prepare) and torch.compile wrap the patched module: look the patch up inside.
    patches = [get_patch(unwrap_model(item)) for item in items]
    groups = {id(p.reduce_group): p.reduce_group for p in patches if p is not None}
    if len(groups) > 1:
        raise ValueError(
            "all_reduce_gradients: the modules are split over different groups; reduce each on its own"
        )
    if groups:
        return next(iter(groups.values()))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "all_reduce_gradients: none of the given modules is patched by hfpatch.apply and no group was given; "
            "pass the Patch or a process group"
        )
    return None
