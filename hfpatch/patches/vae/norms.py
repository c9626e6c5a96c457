"""The normalisations of :mod:`hfpatch.patches.vae.layers` on height shards, with their statistics taken over every
rank: GroupNorm (:func:`~hfpatch.patches.vae.layers.group_norm_forward`, its fp16/bf16 statistics upcast by two
autograd Functions), BatchNorm in training mode (:func:`~hfpatch.patches.vae.layers.batch_norm_forward`, the
moments merged exactly) and the plain sum over the ranks they build on
(:func:`~hfpatch.patches.vae.layers.sum_over_ranks`). :mod:`hfpatch.patches.vae.layers` re-exports every name
here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .state import VAEShardState, all_reduce_stats


class _UpcastVarMean(torch.autograd.Function):
    """``torch.var_mean(x.float(), dim=-1, correction=0)`` that keeps ``x`` in its own dtype for backward.

    Autograd would save the upcast copy (two bytes per bf16 byte) until backward. Backward, in the upcast
    dtype: ``d mean / dx = 1 / n``, ``d var / dx = 2 (x - mean) / n`` (the biased variance).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        var, mean = torch.var_mean(x.to(_compute_dtype(x.dtype)), dim=-1, correction=0)
        ctx.save_for_backward(x, mean)
        return var, mean

    @staticmethod
    def backward(ctx, grad_var: torch.Tensor, grad_mean: torch.Tensor) -> torch.Tensor:
        x, mean = ctx.saved_tensors
        n = x.shape[-1]
        grad = x.to(mean.dtype) - mean.unsqueeze(-1)  # a new tensor: safe to update in place
        grad.mul_(grad_var.unsqueeze(-1) * (2 / n)).add_(grad_mean.unsqueeze(-1) / n)
        return grad.to(x.dtype)


class _UpcastScaleShift(torch.autograd.Function):
    """``(x.to(scale.dtype) * scale + shift).to(x.dtype)`` that keeps ``x`` in its own dtype for backward.

    ``scale`` and ``shift`` broadcast against ``x``. The arithmetic stays in ``scale``'s (fp32) dtype: with
    a bf16 shift, ``|mean| >> std`` would lose the result to cancellation. Backward recomputes the upcast
    ``x`` for the scale gradient instead of saving it.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, scale)
        ctx.shift_shape = shift.shape
        return torch.addcmul(shift, x.to(scale.dtype), scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, scale = ctx.saved_tensors
        grad = grad.to(scale.dtype)
        grad_x = grad_scale = grad_shift = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad * scale).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_scale = x.to(scale.dtype, copy=True).mul_(grad).sum_to_size(scale.shape)
        if ctx.needs_input_grad[2]:
            grad_shift = grad.sum_to_size(ctx.shift_shape)
        return grad_x, grad_scale, grad_shift


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """GroupNorm statistics and normalisation run in at least fp32 (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def group_norm_forward(norm: torch.nn.GroupNorm, state: VAEShardState) -> Callable:
    """Forward for ``nn.GroupNorm`` on height shards: statistics over all ranks, one small all-gather.

    Each rank reduces its rows to (count, mean, M2) per group; these merge exactly (Chan et al.'s
    parallel variance), so there is no ``E[x^2] - E[x]^2`` cancellation. The normalisation is one fused
    ``x * scale + shift`` in fp32 (or wider), and autograd keeps only ``x`` itself: in fp32 the stock ops
    already do; for bf16/fp16 inputs :class:`_UpcastVarMean` and :class:`_UpcastScaleShift` save ``x``
    rather than the two fp32 copies that plain autograd would keep (4x a bf16 input's bytes per norm).
    """
    original = norm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding:
            return original(x)
        b, c = x.shape[:2]
        groups = norm.num_groups
        compute = _compute_dtype(x.dtype)
        grouped = x.reshape(b, groups, -1)
        if x.dtype == torch.float32:
            var_local, mean_local = torch.var_mean(grouped, dim=-1, correction=0)
        else:
            var_local, mean_local = _UpcastVarMean.apply(grouped)
        counts = torch.tensor(state.sizes(grouped.shape[-1]), dtype=torch.float64, device=x.device)
        stats = all_reduce_stats(torch.stack([mean_local, var_local]), state).double()  # (world, 2, b, g)
        weights = (counts / counts.sum()).view(-1, 1, 1)
        mean = (weights * stats[:, 0]).sum(0)
        var = (weights * (stats[:, 1] + (stats[:, 0] - mean) ** 2)).sum(0)
        scale = torch.rsqrt(var + norm.eps).to(compute).repeat_interleave(c // groups, dim=1)  # (b, c)
        shift = -mean.to(compute).repeat_interleave(c // groups, dim=1) * scale
        if norm.affine:
            # Upcast once: the weight's two gradient terms cancel when |mean| >> std, so they must be summed
            # in fp32 before the one rounding to the parameter's dtype (a no-op for fp32 parameters).
            weight, bias = norm.weight.to(compute), norm.bias.to(compute)
            scale, shift = scale * weight, shift * weight + bias
        view = (b, c) + (1,) * (x.dim() - 2)
        if x.dtype == torch.float32:
            return torch.addcmul(shift.view(view), x, scale.view(view))
        return _UpcastScaleShift.apply(x, scale.view(view), shift.view(view))

    return forward


def sum_over_ranks(x: torch.Tensor, state: VAEShardState) -> torch.Tensor:
    """``sum_r x_r``, identical on every rank (the ranks' terms added in rank order); differentiable.

    For small per-rank sums (DC-AE's linear-attention ``V K^T``): one all-gather of ``x``, then a local sum.
    Backward: each rank's gradient summed over the ranks (every rank's output used the sum).
    """
    return all_reduce_stats(x, state).sum(0)


def _merged_moments(
    mean: torch.Tensor, var: torch.Tensor, count: int, state: VAEShardState
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(mean, biased variance, total count) over every rank from each rank's (mean, var, count), merged exactly
    (Chan et al.), in fp64; differentiable."""
    counts = torch.tensor(state.sizes(count), dtype=torch.float64, device=mean.device)
    stats = all_reduce_stats(torch.stack([mean, var]), state).double()  # (world, 2, ...)
    weights = (counts / counts.sum()).view(-1, *([1] * mean.dim()))
    merged_mean = (weights * stats[:, 0]).sum(0)
    merged_var = (weights * (stats[:, 1] + (stats[:, 0] - merged_mean) ** 2)).sum(0)
    return merged_mean, merged_var, counts.sum().item()


def batch_norm_forward(norm: torch.nn.BatchNorm2d, state: VAEShardState) -> Callable:
    """Forward for ``nn.BatchNorm2d`` on height shards (DC-AE's decoder).

    In eval mode (running statistics) it is per position and runs as it is. With batch statistics (training
    mode) the per-channel mean and variance over ``(N, H, W)`` are merged over the ranks (one small all-gather)
    and the running statistics are updated as the stock layer updates them (unbiased variance, momentum or
    cumulative average), identically on every rank.
    """
    original = norm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        batch_stats = norm.training or (norm.running_mean is None and norm.running_var is None)
        if not state.sharding or not batch_stats:
            return original(x)
        factor = 0.0
        if norm.training and norm.track_running_stats and norm.num_batches_tracked is not None:
            norm.num_batches_tracked.add_(1)
            factor = 1.0 / float(norm.num_batches_tracked) if norm.momentum is None else norm.momentum
        compute = _compute_dtype(x.dtype)
        per_channel = x.transpose(0, 1).reshape(x.shape[1], -1).to(compute)  # (C, N x H_local x W)
        var_local, mean_local = torch.var_mean(per_channel, dim=-1, correction=0)
        mean, var, count = _merged_moments(mean_local, var_local, per_channel.shape[-1], state)
        if norm.training and norm.track_running_stats and norm.running_mean is not None:
            with torch.no_grad():
                norm.running_mean.mul_(1 - factor).add_(factor * mean.to(norm.running_mean.dtype))
                unbiased = var * count / max(count - 1, 1)
                norm.running_var.mul_(1 - factor).add_(factor * unbiased.to(norm.running_var.dtype))
        scale = torch.rsqrt(var + norm.eps).to(compute)
        shift = -mean.to(compute) * scale
        if norm.affine:
            scale, shift = (
                scale * norm.weight.to(compute),
                shift * norm.weight.to(compute) + norm.bias.to(compute),
            )
        view = (1, -1) + (1,) * (x.dim() - 2)
        return torch.addcmul(shift.view(view), x.to(compute), scale.view(view)).to(x.dtype)

    return forward
