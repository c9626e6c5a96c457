"""The halo exchange: a shard extended with its neighbours' boundary rows along one dimension (the split VAE's
convolutions), whose backward returns the halo gradients to their owners.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .groups import ProcessGroup, check_sizes, rank_in, size_of
from .p2p import start_p2p

__all__ = ["halo_exchange"]


def _halo_forward(
    x: torch.Tensor, dim: int, before: int, after: int, group
) -> tuple[torch.Tensor, torch.Tensor]:
    world, me = size_of(group), rank_in(group)
    length = x.shape[dim]
    sends, recvs = [], []
    top_shape, bottom_shape = list(x.shape), list(x.shape)
    top_shape[dim], bottom_shape[dim] = (before if me > 0 else 0), (after if me < world - 1 else 0)
    top = x.new_empty(top_shape)
    bottom = x.new_empty(bottom_shape)
    if me > 0 and after:  # my first rows are the previous rank's "after" halo
        sends.append((x.narrow(dim, 0, after).contiguous(), me - 1))
    if me < world - 1 and before:  # my last rows are the next rank's "before" halo
        sends.append((x.narrow(dim, length - before, before).contiguous(), me + 1))
    if top.numel():
        recvs.append((top, me - 1))
    if bottom.numel():
        recvs.append((bottom, me + 1))
    start_p2p(sends, recvs, group, "halo").wait()
    return top, bottom


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, before, after, group):
        ctx.args = (dim, before, after, group, x.shape[dim])
        top, bottom = _halo_forward(x, dim, before, after, group)
        return torch.cat([top, x, bottom], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        dim, before, after, group, length = ctx.args
        world, me = size_of(group), rank_in(group)
        n_top = before if me > 0 else 0
        n_bottom = after if me < world - 1 else 0
        g_top = grad.narrow(dim, 0, n_top).contiguous()
        g_x = grad.narrow(dim, n_top, length).clone()
        g_bottom = grad.narrow(dim, n_top + length, n_bottom).contiguous()
        # Halo gradients go back to their owners: my top halo came from the previous rank's last rows.
        sends, recvs = [], []
        if n_top:
            sends.append((g_top, me - 1))
        if n_bottom:
            sends.append((g_bottom, me + 1))
        from_next_shape, from_prev_shape = list(grad.shape), list(grad.shape)
        from_next_shape[dim] = after if me > 0 else 0  # the previous rank's bottom halo = my first rows
        from_prev_shape[dim] = before if me < world - 1 else 0
        g_first = grad.new_empty(from_next_shape)
        g_last = grad.new_empty(from_prev_shape)
        if g_first.numel():
            recvs.append((g_first, me - 1))
        if g_last.numel():
            recvs.append((g_last, me + 1))
        start_p2p(sends, recvs, group, "halo").wait()
        if g_first.shape[dim]:
            g_x.narrow(dim, 0, g_first.shape[dim]).add_(g_first)
        if g_last.shape[dim]:
            g_x.narrow(dim, length - g_last.shape[dim], g_last.shape[dim]).add_(g_last)
        return g_x, None, None, None, None


def halo_exchange(
    x: torch.Tensor,
    dim: int,
    before: int,
    after: int,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Extend the local shard with its neighbours' boundary rows along ``dim``; differentiable.

    Rank ``r`` receives the last ``before`` rows of rank ``r-1`` and the first ``after`` rows of rank
    ``r+1`` and returns ``cat([those_before, x, those_after], dim)``. At the global borders nothing is
    added (the caller pads there as the unsharded op would). Backward returns the halo gradients to their
    owners, who add them to their boundary rows. Shards may be uneven but must hold at least
    ``max(before, after)`` rows.

    Pass ``sizes`` (every rank's shard length along ``dim``) to have every rank check every shard, so a
    too-short shard raises the same error on all ranks instead of on its owner only.

    Bytes sent per rank (interior): ``(before + after) * (x.numel() / x.shape[dim]) * x.element_size()``.
    """
    world = size_of(group)
    dim %= x.dim()
    if before < 0 or after < 0:
        raise ValueError(f"halo sizes must be >= 0, got before={before}, after={after}")
    if world == 1 or (before == 0 and after == 0):
        return x
    shortest = min(check_sizes("sizes", sizes, world)) if sizes is not None else x.shape[dim]
    if shortest < max(before, after):
        raise ValueError(
            f"halo_exchange: a shard has {shortest} rows along dim {dim} but a halo of "
            f"{max(before, after)} rows is needed; use fewer ranks or a larger input"
        )
    return _HaloExchange.apply(x, dim, before, after, group)
