"""Gradients of models whose work is split over ranks (sequence-parallel DiTs, patch-parallel VAEs).

The convention (the one Megatron-LM's context parallelism uses): the ranks of a split group compute ONE
result together and every rank computes the same loss from the full output. The gradient entering the
split model's output is multiplied by the group size ``N`` (:func:`grad_scaled_by_group`), so each rank's
parameter gradient is ``N`` times its shard's share, and the **mean** over the group is the unpatched
gradient. Floating inputs that require grad (text embeddings from a trained text encoder, latents from a
generator) have their gradient averaged over the group at the model's input (:func:`grad_averaged_over_group`),
so whatever feeds the split model receives the full gradient on every rank.

Replicated streams. A split model also computes some tensors whole on every rank (the text stream, the
timestep embedding, image conditions, refiners) and hands them to the split computation (joint or cross
attention, modulation of the sharded tokens). What comes back to such a tensor is this rank's share of its
gradient, ``N`` times over; running the replicated part's backward on each share and averaging the results
afterwards is the unpatched gradient only in exact arithmetic: a model that rounds inside the replicated part
(Kandinsky 5's rotary rounds q/k to bf16 even in fp32) rounds each share instead of their sum. So the tensor
enters the split computation through :func:`grads_averaged_over_group` (Megatron's "copy to the parallel region":
identity forward, all-reduce of the gradient backward): the MEAN of the ``N`` shares, which is the full gradient,
reaches the replicated part on every rank, and each rank runs the unpatched backward of it. The convention holds
unchanged (a replicated parameter's gradient is then the full one on every rank, whose mean is itself), and every
later mean is one of equal values. Cost: one all-reduce of the stream's activation gradient per boundary, in
backward; what it buys is that the replicated part's backward sees exactly the unpatched gradient.

Why a mean and not a sum of shares: a mean is what DDP and FSDP2 already compute, and it is idempotent, so
every training-script setup is right with no extra line:

* DDP (``accelerator.prepare``) averages each gradient over all ``data x N`` ranks: the mean over a group is
  the group's gradient, the mean over groups averages the data replicas.
* Gradient accumulation with DDP syncing at every micro-step (diffusers' scripts pass a *list* to
  ``accelerator.accumulate``, so DDP never enters ``no_sync``): the already-averaged gradient of the first
  micro-step is identical on every rank and averages to itself; only the new share is combined. A sum would
  count the first micro-step ``N`` times.
* A trained module upstream of the split model (a LoRA text encoder) gets the full gradient on every rank,
  under DDP or in a plain loop.
* FSDP2's reduce-scatter averages the same way.

Without DDP/FSDP (a plain loop), :func:`all_reduce_gradients` averages the split model's parameter
gradients over its group once before the optimizer step. Calling it under DDP is harmless (the mean of
equal values), only wasted bandwidth.

>>> import torch
>>> from hfpatch.distributed.gradients import grad_scaled_by_group
>>> x = torch.ones(2, requires_grad=True)
>>> grad_scaled_by_group(x, None).sum().backward()   # no group (one rank): the identity
>>> x.grad
tensor([1., 1.])
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_gradients",
    "grad_averaged_over_group",
    "grad_scaled_by_group",
    "grads_averaged_over_group",
    "register_ddp_hook",
]


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


# ----------------------------------------------------------------------------------------------- boundaries
class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _AverageGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        from .collectives import all_reduce_mean

        return all_reduce_mean(grad, ctx.group), None


def grad_scaled_by_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity at a split model's OUTPUT; backward multiplies the gradient by the size of ``group``.

    Every rank of ``group`` computes the same loss from the output, so the gradient arriving here is the
    full one on each rank; scaled by ``N``, the shard-local backward that follows leaves ``N`` times the
    rank's share in every parameter gradient, whose mean over the group is the unpatched gradient.
    """
    size = _group_size(group)
    if size == 1 or not x.requires_grad:
        return x
    return _ScaleGrad.apply(x, float(size))


def grad_averaged_over_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity at a split model's INPUT; backward averages the gradient over ``group`` (one all-reduce).

    The gradient of a replicated input is ``N`` times this rank's share (see :func:`grad_scaled_by_group`);
    its mean over the group is the full gradient, which every rank then passes on to whatever produced the
    input (a trained text encoder), so nothing upstream needs a reduction of its own.
    """
    if _group_size(group) == 1 or not x.requires_grad:
        return x
    return _AverageGrad.apply(x, group)


class _AverageGrads(torch.autograd.Function):
    """Identity on several tensors; backward: ONE all-reduce (mean) of their gradients, flattened together."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        ctx.shapes = [(x.shape, x.dtype) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        from .collectives import all_reduce_mean

        # A gradient autograd leaves out (an output no path used) is zeros here: every rank sends the same buffer.
        full = [
            torch.zeros(shape, dtype=dtype, device=_device(grads)) if g is None else g
            for g, (shape, dtype) in zip(grads, ctx.shapes)
        ]
        out: list[torch.Tensor] = [None] * len(full)  # type: ignore[list-item]
        for dtype in dict.fromkeys(
            g.dtype for g in full
        ):  # one collective per dtype (in order of appearance)
            index = [i for i, g in enumerate(full) if g.dtype == dtype]
            flat = all_reduce_mean(torch.cat([full[i].reshape(-1) for i in index]), ctx.group)
            for i, part in zip(index, flat.split([full[i].numel() for i in index])):
                out[i] = part.view(full[i].shape)
        return (None, *out)


def _device(tensors: Any) -> torch.device:
    return next(t.device for t in tensors if t is not None)


def grads_averaged_over_group(tensors: Iterable[torch.Tensor], group: Any) -> tuple[torch.Tensor, ...]:
    """:func:`grad_averaged_over_group` on several tensors at once: ONE all-reduce of their gradients in backward.

    Where replicated tensors (the same value on every rank of ``group``) enter a split computation: each rank's
    backward hands back its share of their gradient, and the mean over the group, the full gradient, is what the
    replicated computation that made them then runs its backward on (module docstring, "Replicated streams").
    Tensors that do not require grad pass through as they are.

    >>> import torch
    >>> text, temb = torch.ones(2, requires_grad=True), torch.zeros(3)
    >>> out = grads_averaged_over_group([text, temb], None)   # no group (one rank): the tensors themselves
    >>> out[0] is text and out[1] is temb
    True
    """
    tensors = tuple(tensors)
    if _group_size(group) == 1 or not torch.is_grad_enabled():
        return tensors
    index = [i for i, t in enumerate(tensors) if t.requires_grad]
    if not index:
        return tensors
    averaged = _AverageGrads.apply(group, *(tensors[i] for i in index))
    out = list(tensors)
    for i, t in zip(index, averaged):
        out[i] = t
    return tuple(out)


def average_input_gradients(tree: Any, group: Any) -> Any:
    """``tree`` (args, kwargs: nested tuples, lists, dicts) with :func:`grad_averaged_over_group` on every
    floating tensor that requires grad; the same structure, other leaves untouched."""
    if _group_size(group) == 1 or not torch.is_grad_enabled():
        return tree
    from torch.utils._pytree import tree_map

    def wrap(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return grad_averaged_over_group(value, group)
        return value

    return tree_map(wrap, tree)


# ----------------------------------------------------------------------------------------------- plain loops
_FROM_PATCH = object()


def all_reduce_gradients(
    tensors: torch.nn.Module | Iterable[torch.Tensor | torch.nn.Module], group_or_patch: Any = _FROM_PATCH
) -> None:
    """Average the ``.grad`` of ``tensors`` (or of modules' parameters) over a process group, in place.

    After ``loss.backward()`` on a model patched to split its work, each rank's parameter gradients are
    ``N`` times its shard's share (module docstring); their MEAN over the group that split the work is the
    unpatched gradient. Call this once before the optimizer step in a loop without DDP/FSDP (under DDP or
    FSDP2 it is not needed: they average already, and averaging again changes nothing). Linear, so gradient
    accumulation is fine. One flat all-reduce per dtype and device.

    Args:
        tensors: A module, or an iterable of tensors/modules whose ``.grad`` to average.
        group_or_patch: A process group, or the :class:`hfpatch.Patch` of the module (its ``reduce_group``:
            the ``sp`` group of a sequence-parallel transformer, the ``vae`` group of a split VAE), or
            ``None`` (a degree-1 mesh axis: nothing to do). Default: the live patch of the modules given,
            found through DDP/FSDP/DataParallel and ``torch.compile`` wrappers (what
            ``accelerator.prepare`` returns works as it is).

    Raises:
        ValueError: torch.distributed runs more than one rank but no group could be found (an unpatched
            module and no group given), or the ranks disagree on the gradients to average.
        TypeError: The parameters are sharded by FSDP2 (DTensor): its reduce-scatter has averaged them.

    >>> import torch
    >>> from hfpatch.distributed.gradients import all_reduce_gradients
    >>> layer = torch.nn.Linear(2, 2)
    >>> all_reduce_gradients(layer)  # not patched, one process: nothing to average
    """
    items = [tensors] if isinstance(tensors, torch.nn.Module) else list(tensors)
    params = [
        p for item in items for p in (item.parameters() if isinstance(item, torch.nn.Module) else [item])
    ]
    params = [p for p in params if p.requires_grad]
    if any(type(p).__name__ == "DTensor" for p in params):
        raise TypeError(
            "all_reduce_gradients: these parameters are sharded by FSDP2 (DTensor); its reduce-scatter already "
            "averaged their gradients over the mesh, which is what hfpatch's convention needs. Drop the call."
        )
    group = _resolve_group(items, group_or_patch)
    if group is None:
        return
    world = dist.get_world_size(group)
    # Every tensor that requires grad takes part in the layout check; one that has a grad on some rank is
    # averaged everywhere (a missing grad counts as zeros), one that has none on any rank keeps .grad None,
    # as in the unpatched step (an optimizer skips it rather than decaying it).
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), group_params in by_kind.items():
        sizes = torch.tensor([len(group_params), sum(p.numel() for p in group_params)], device=device)
        if world > 1:
            seen = [torch.empty_like(sizes) for _ in range(world)]
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
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)  # gloo has no AVG: sum, then divide
        flat.div_(world)
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
    from ..core.patch import get_patch
    from ..core.wrappers import unwrap_model

    # DDP/FSDP (accelerator.prepare) and torch.compile wrap the patched module: look the patch up inside.
    patches = [get_patch(unwrap_model(item)) for item in items]
    groups = {id(p.reduce_group): p.reduce_group for p in patches if p is not None}
    if len(groups) > 1:
        raise ValueError(
            "all_reduce_gradients: the modules are split over different groups; average each on its own"
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
def _find_ddp(model: Any) -> Any:
    """The ``DistributedDataParallel`` layer among ``model``'s wrappers (compile around DDP too), or None."""
    from torch.nn.parallel import DistributedDataParallel

    from ..core.wrappers import unwrap_once

    while isinstance(model, torch.nn.Module):
        if isinstance(model, DistributedDataParallel):
            return model
        inner = unwrap_once(model)
        if inner is None:
            return None
        model = inner
    return None


def register_ddp_hook(model: torch.nn.Module) -> torch.nn.Module:
    """Deprecated and unnecessary: DDP's own gradient averaging is right for hfpatch models; returns ``model``.

    Earlier versions installed a comm hook that SUMMED the shares of a sequence-parallel group. Gradients are
    now scaled so that DDP's stock mean is right (module docstring), which also keeps gradient accumulation
    with a sync at every micro-step and trained modules upstream of the patched model exact. This function
    only checks what it can (a DDP over the patch's world) and warns; remove the call.

    Raises:
        ValueError: DDP's process group does not span the ranks of the patch's plan (each group would then
            average over the wrong ranks).

    >>> import torch, warnings
    >>> from hfpatch.distributed.gradients import register_ddp_hook
    >>> layer = torch.nn.Linear(2, 2)
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     register_ddp_hook(layer) is layer
    True
    """
    from ..core.patch import get_patch
    from ..core.wrappers import unwrap_model

    warnings.warn(
        "hfpatch.register_ddp_hook is no longer needed: DDP's own gradient averaging is right for models "
        "patched by hfpatch (gradients are scaled so that the mean over a sequence-parallel group is the "
        "full gradient). Remove the call; it does nothing.",
        FutureWarning,
        stacklevel=2,
    )
    ddp = _find_ddp(model)
    patch = get_patch(unwrap_model(model))
    if ddp is not None and patch is not None and patch.plan.world_size > 1:
        ddp_world = dist.get_world_size(ddp.process_group)
        if ddp_world % patch.plan.world_size:
            raise ValueError(
                f"register_ddp_hook: DDP averages over {ddp_world} ranks, which is not a whole number of "
                f"{patch.plan} replicas; build DDP over every rank (accelerate does)"
            )
    return model
