"""Gradient reduction for models whose work is split over ranks (sequence-parallel DiTs, patch-parallel VAEs).

Two ways, one per kind of training loop; use exactly one:

* plain loop (no DDP): :func:`all_reduce_gradients` after ``backward`` sums the per-rank shares;
* DDP / ``accelerator.prepare``: :func:`register_ddp_hook` once after wrapping; DDP's own gradient
  all-reduce then sums the shares of each group and averages over the data replicas, with no manual scaling.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_reduce_gradients", "register_ddp_hook"]

#: Attribute marking a DDP module whose gradients :func:`register_ddp_hook` already reduces.
_HOOKED = "_hfpatch_ddp_hook"


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
    for item in items:
        if isinstance(item, torch.nn.Module) and _find_ddp(item, hooked_only=True) is not None:
            raise ValueError(
                "all_reduce_gradients: this DDP model's gradients are already summed over its sequence-parallel "
                "group by hfpatch's DDP comm hook (register_ddp_hook); reducing again would double them. "
                "Drop the all_reduce_gradients call."
            )
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


# ----------------------------------------------------------------------------------------------- DDP
def _find_ddp(model: Any, hooked_only: bool = False) -> Any:
    """The ``DistributedDataParallel`` layer among ``model``'s wrappers (compile around DDP too), or None."""
    from torch.nn.parallel import DistributedDataParallel

    from ..core.wrappers import unwrap_once

    while isinstance(model, torch.nn.Module):
        if isinstance(model, DistributedDataParallel) and (not hooked_only or model.__dict__.get(_HOOKED)):
            return model
        inner = unwrap_once(model)
        if inner is None:
            return None
        model = inner
    return None


class _ShareSum:
    """State of the DDP comm hook: divides each bucket by the number of data replicas, then sums it."""

    def __init__(self, module: torch.nn.Module, group: Any) -> None:
        self.module = module
        self.group = group
        self.world = dist.get_world_size(group)

    def divisor(self) -> int:
        from ..core.apply import get_patch

        # Read at every step: after patch.remove() or inside patch.disabled() each rank holds a whole
        # gradient again, and DDP's plain mean is right.
        patch = get_patch(self.module)
        if patch is None or patch.is_disabled or patch.reduce_group is None:
            return self.world
        return self.world // dist.get_world_size(patch.reduce_group)


def _share_sum_hook(state: _ShareSum, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    tensor = bucket.buffer()
    divisor = state.divisor()
    if divisor != 1:
        tensor.div_(divisor)  # before the sum, as DDP's default hook does (no overflow in half precision)
    work = dist.all_reduce(tensor, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks the hook's annotations by identity; ``from __future__ import annotations`` made them strings.
_share_sum_hook.__annotations__.update(
    {"state": _ShareSum, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


def register_ddp_hook(model: torch.nn.Module) -> torch.nn.Module:
    """Make DDP's gradient all-reduce right for a model hfpatch splits over ranks; returns ``model``.

    Call once on what ``accelerator.prepare`` (or ``DistributedDataParallel(...)``) returned. DDP then sums
    every bucket over its process group and divides by the number of data replicas (DDP's group size over
    the size of the patch's ``reduce_group``) instead of by the group size: the per-rank shares of one
    sequence-parallel group add up to that group's gradient, and the groups are averaged, as one process
    training on the whole global batch with a mean loss would. No manual loss scaling, no
    :func:`all_reduce_gradients` call (it refuses a hooked model rather than double the gradients); gradient
    accumulation (``no_sync``, ``accelerator.accumulate``) and ``accelerator.clip_grad_norm_`` see full
    gradients as usual.

    Why a comm hook (and not DDP over the data group plus a separate sum over the ``sp`` group): accelerate
    builds the DDP itself in ``prepare`` from ``DistributedDataParallelKwargs``, which has no process group
    and only built-in hook types (fp16/bf16 compression, PowerSGD), and accelerate's ``ParallelismConfig``
    has no axis for "these ranks share one sample": ``tp`` replaces DDP by tensor parallelism, ``cp`` is
    FSDP2-only and ``sp`` DeepSpeed-only. A hook on the DDP accelerate returned keeps ``prepare``,
    ``accumulate``, ``clip_grad_norm_`` and ``save_state``/``load_state`` exactly as they are, and costs
    nothing extra: the one all-reduce DDP already does carries the sum.

    Args:
        model: A DDP module (possibly inside ``torch.compile``) around a model patched by ``hfpatch.apply``.

    Raises:
        TypeError: ``model`` is not DDP-wrapped in a run of several processes (then call
            :func:`all_reduce_gradients` after backward). In one process it is returned as it is.
        ValueError: The inner model is not patched, DDP's group is not the patch's world, or a hook was
            registered already.

    >>> import torch
    >>> from hfpatch.distributed.gradients import register_ddp_hook
    >>> layer = torch.nn.Linear(2, 2)
    >>> register_ddp_hook(layer) is layer  # one process: accelerate returns the model unwrapped; no-op
    True
    """
    from ..core.apply import get_patch
    from ..core.wrappers import unwrap_model

    ddp = _find_ddp(model)
    if ddp is None and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return model  # one process (accelerate does not wrap it): nothing to reduce, the same script runs
    if ddp is None:
        raise TypeError(
            f"register_ddp_hook: {type(model).__name__} is not wrapped in DistributedDataParallel; without DDP "
            "call hfpatch.all_reduce_gradients(model) after backward instead"
        )
    if ddp.__dict__.get(_HOOKED):
        raise ValueError("register_ddp_hook: this DDP model already has hfpatch's comm hook")
    inner = unwrap_model(ddp)
    patch = get_patch(inner)
    if patch is None:
        raise ValueError(
            f"register_ddp_hook: {type(inner).__name__} inside DDP is not patched by hfpatch.apply (DDP's own "
            "averaging is already right for it); apply hfpatch before accelerator.prepare / DDP"
        )
    state = _ShareSum(inner, ddp.process_group)
    if patch.plan.world_size > 1 and patch.plan.world_size != state.world:
        raise ValueError(
            f"register_ddp_hook: DDP reduces over {state.world} ranks but {patch.plan} spans "
            f"{patch.plan.world_size}; build DDP over every rank of the plan (accelerate does)"
        )
    ddp.register_comm_hook(state, _share_sum_hook)
    ddp.__dict__[_HOOKED] = True
    return model
