"""The exchanges a caller overlaps with its own projections, one tensor at a time.

* :func:`start_sequence_to_heads` starts the sequence -> heads exchange of one tensor and returns a
  :class:`~hfpatch.attention.exchange.to_heads.PendingExchange`: the exchange of ``q`` runs while ``k`` is
  projected, and so on; ``wait()`` gives the resharded tensor.
* :func:`project_heads_to_sequence` is ``heads_to_sequence(x).flatten(2) @ weight.T + bias`` without the
  joined output: the heads go in chunks (:func:`hfpatch.attention.exchange.plans.head_chunks`); each chunk's
  rows travel while the previous chunk is projected, and the rows a rank receives are multiplied by their
  columns of ``weight`` where they arrived (no unpacking copy; with one chunk no copy at all). The projection
  is a sum over the chunks: equal to the one-matmul result up to float reassociation. The backward sends each
  rank's gradient rows back over the same messages, exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...distributed.collectives import start_p2p
from ..layout import group_rank, group_size
from .config import ExchangeConfig
from .geometry import Geometry, geometry, head_geometry, width
from .plans import head_chunks, in_plans
from .to_heads import PendingExchange, start_in

Tensor = torch.Tensor


def start_sequence_to_heads(
    x_bshd: Tensor,
    group: dist.ProcessGroup | None,
    heads: int,
    *,
    valid_len: int | None = None,
    exchange: ExchangeConfig | str | None = None,
) -> PendingExchange:
    """Start :func:`hfpatch.attention.ulysses.sequence_to_heads` of ``x_bshd``; compute, then ``.wait()``.

    The messages travel while the caller computes (the next projection): on NCCL on the communication stream,
    on gloo on gloo's threads. ``valid_len`` (real tokens of the group's sequence): padding rows are not sent
    and come back as zeros. ``exchange`` (:class:`~hfpatch.attention.exchange.config.ExchangeConfig`): only its
    ``dtype``/``scale`` apply here (FP8 on the wire; refused under training unless ``training=True``).

    >>> import torch
    >>> x = torch.randn(1, 4, 2, 8)
    >>> pending = start_sequence_to_heads(x, None, 2)   # no group: nothing to exchange
    >>> torch.equal(pending.wait(), x)
    True
    """
    config = ExchangeConfig.parse(exchange)
    if group is None or group_size(group) == 1:
        return _Ready(x_bshd)
    if config is not None:
        config.check([x_bshd], "start_sequence_to_heads")
    geo = geometry(x_bshd, group, heads, valid_len)
    plan = in_plans(
        geo, 1, config=None if config is None else ExchangeConfig(dtype=config.dtype, scale=config.scale)
    )[0]
    return PendingExchange(plan, start_in(plan, [x_bshd], [None]), x_bshd)


class _Ready(PendingExchange):
    """A finished exchange (no group)."""

    def __init__(self, x: Tensor) -> None:
        self._x = x

    def wait(self) -> Tensor:
        return self._x


def project_heads_to_sequence(
    x_bshd: Tensor,
    group: dist.ProcessGroup | None,
    heads: int,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    valid_len: int | None = None,
    chunks: int = 1,
) -> Tensor:
    """``heads_to_sequence(x).flatten(2) @ weight.T + bias`` with the exchange overlapped by the projection.

    ``x_bshd``: ``[B, u * S_local, H_r, D]`` (this rank's heads of the group's tokens, as after
    :func:`hfpatch.attention.ulysses.sequence_to_heads`); ``weight``: ``[C_out, H * D]`` (an output projection's).
    The heads go in ``chunks`` parts; each part's rows travel while the previous part is projected, and each
    rank's received heads are multiplied by their columns of ``weight`` where they arrived (no unpacking copy;
    with one chunk no copy at all). The projection is a sum over the parts: equal to the one-matmul result up to
    float reassociation. Returns ``[B, S_local, C_out]`` (padding rows: the bias).

    >>> import torch
    >>> x, w = torch.randn(1, 4, 2, 8), torch.randn(5, 16)
    >>> y = project_heads_to_sequence(x, None, 2, w)
    >>> bool(torch.allclose(y, x.flatten(2) @ w.T, atol=1e-5))
    True
    """
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"project_heads_to_sequence: chunks must be an int >= 1, got {chunks!r}")
    if weight.dim() != 2 or weight.shape[1] != heads * x_bshd.shape[3]:
        raise ValueError(
            f"project_heads_to_sequence: weight must be [C_out, H * D = {heads * x_bshd.shape[3]}], got "
            f"{tuple(weight.shape)}"
        )
    if group is None or group_size(group) == 1:
        out = x_bshd.flatten(2) @ weight.T
        return out if bias is None else out + bias
    world, me = group_size(group), group_rank(group)
    local = x_bshd.shape[1] // world
    geo = head_geometry(x_bshd, group, heads, valid_len)
    plans = head_chunks(geo, chunks)
    dim = geo.dim
    starts = [_start_projected(geo, heads_c, x_bshd) for heads_c in plans[:1]]
    y = None
    for c, heads_c in enumerate(plans):
        if c + 1 < len(plans):
            starts.append(_start_projected(geo, plans[c + 1], x_bshd))
        # ``link``: a zero that keeps the exchange in the graph on every rank, so its backward (which every rank's
        # peers wait for) runs even where this rank received nothing.
        link, *received = _Projected.apply(geo, tuple(heads_c), starts[c], x_bshd)
        starts[c] = None
        peers = [p for p in range(world) if p != me and geo.real[me] and width(heads_c[p])]
        parts = [(me, x_bshd[:, me * local : me * local + geo.real[me], _local(heads_c[me], geo)])]
        parts += list(zip(peers, received))
        for p, rows in parts:
            if not rows.numel():
                continue
            cols = slice(heads_c[p].start * dim, heads_c[p].stop * dim)
            term = rows.flatten(2) @ weight[:, cols].T
            y = term if y is None else y + term
        y = link if y is None else y + link
    if y.dim() == 0:  # no head of any rank reached this rank's tokens (no real token here)
        y = y + x_bshd.new_zeros(geo.batch, geo.real[me], weight.shape[0])
    if bias is not None:
        y = y + bias
    if geo.real[me] < local:
        y = torch.nn.functional.pad(y, (0, 0, 0, local - geo.real[me]))
    return y


def _start_projected(geo: Geometry, heads: Sequence[slice], x: Tensor):
    """Post this rank's heads (chunk ``heads``) of every other shard's rows; receive mine from every rank."""
    me, world = geo.me, geo.world
    mine = heads[me]
    sends, recvs, received = [], [], []
    with torch.no_grad():
        xd = x.detach()
        for peer in range(world):
            if peer == me:
                continue
            start = peer * geo.local
            if geo.real[peer] and width(mine):
                rows = xd[:, start : start + geo.real[peer], _local(mine, geo)]
                rows = rows.contiguous()  # one copy when the chunk is not all of this rank's heads
                sends += [(rows[b], peer) for b in range(geo.batch)]
            theirs = width(heads[peer])
            if geo.real[me] and theirs:
                buf = x.new_empty(geo.batch, geo.real[me], theirs, geo.dim)
                recvs += [(buf[b], peer) for b in range(geo.batch)]
                received.append(buf)
    return start_p2p(sends, recvs, geo.group, "all_to_all"), received


def _local(heads: slice, geo: Geometry) -> slice:
    """``heads`` (global head indices of this rank's) as indices into this rank's ``H_r`` heads."""
    return slice(heads.start - geo.starts[geo.me], heads.stop - geo.starts[geo.me])


class _Projected(torch.autograd.Function):
    """Finishes :func:`_start_projected`: ``(zero link, *rows received from each other rank)``."""

    @staticmethod
    def forward(ctx, geo: Geometry, heads: tuple[slice, ...], started, x: Tensor):
        pending, received = started
        pending.wait()
        ctx.geo, ctx.heads, ctx.like = geo, heads, (x.shape, x.dtype, x.device)
        return (x.new_zeros(()), *received)

    @staticmethod
    def backward(ctx, _dlink: Tensor, *grads: Tensor):
        geo, heads = ctx.geo, ctx.heads
        shape, dtype, device = ctx.like
        me, mine = geo.me, heads[geo.me]
        dx = torch.zeros(shape, dtype=dtype, device=device)
        peers = [p for p in range(geo.world) if p != me and geo.real[me] and width(heads[p])]
        sends = [(g.contiguous()[b], p) for p, g in zip(peers, grads) for b in range(geo.batch)]
        recvs, unpacks = [], []
        for peer in range(geo.world):
            if peer == me or not (geo.real[peer] and width(mine)):
                continue
            dest = dx[:, peer * geo.local : peer * geo.local + geo.real[peer], _local(mine, geo)]
            buf = torch.empty(dest.shape, dtype=dtype, device=device)
            recvs += [(buf[b], peer) for b in range(geo.batch)]
            unpacks.append((dest, buf))
        start_p2p(sends, recvs, geo.group, "all_to_all").wait()
        for dest, buf in unpacks:
            dest.copy_(buf)
        return None, None, None, dx
