"""The messages of the Ulysses exchange (:mod:`hfpatch.attention.exchange`): who sends which rows to whom.

The geometry of one Ulysses group, the FP8 wire format, the sequence -> heads (q, k, v) and heads -> sequence
(output) message plans with their start, finish and backward halves, and the autograd functions that finish
them. Pure data movement over :func:`hfpatch.distributed.collectives.start_p2p`; the configuration, the plan
builders and the public functions are in :mod:`hfpatch.attention.exchange`, whose docstring gives the layouts
and the analytic minimum of the bytes copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed.collectives import PendingP2P, even_sizes, start_p2p
from .layout import group_rank, group_size, head_sizes, valid_prefix

Tensor = torch.Tensor
#: The wire dtype of the low-precision exchange and its largest finite value.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


# ----------------------------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class _Geometry:
    """Who holds what in one Ulysses group: shapes, head split, real rows per shard."""

    group: dist.ProcessGroup
    world: int
    me: int
    heads: int
    sizes: tuple[int, ...]  # heads per rank
    starts: tuple[int, ...]  # first head of each rank
    local: int  # S_local: tokens per shard (padding included)
    real: tuple[int, ...]  # real (unpadded) tokens of each rank's shard
    batch: int
    dim: int

    @property
    def total(self) -> int:
        """Real tokens over the group (padding is at the end, so shard ``i``'s rows start at ``i * local``)."""
        return sum(self.real)


def _geometry(
    batch: int, local: int, dim: int, group, heads: int, valid_len: int | None, first_shard: int
) -> _Geometry:
    world, me = group_size(group), group_rank(group)
    sizes = head_sizes(heads, world)
    starts = [sum(sizes[:i]) for i in range(world)]
    real = [valid_prefix((first_shard + i) * local, local, valid_len) for i in range(world)]
    return _Geometry(group, world, me, heads, tuple(sizes), tuple(starts), local, tuple(real), batch, dim)


def _chunks(geo: _Geometry, chunks: int) -> list[list[slice]]:
    """Per chunk, per rank: the slice of that rank's heads (global head indices) the chunk covers."""
    per_rank = [even_sizes(size, chunks) for size in geo.sizes]
    out = []
    for c in range(chunks):
        row = []
        for r in range(geo.world):
            start = geo.starts[r] + sum(per_rank[r][:c])
            row.append(slice(start, start + per_rank[r][c]))
        out.append(row)
    return out


def _width(s: slice) -> int:
    return s.stop - s.start


# ----------------------------------------------------------------------------------------------- FP8
def _scales(piece: Tensor, scale: str) -> Tensor:
    """float32 ``[B, H]`` scales ``amax / 448`` of a ``[B, S, H, D]`` piece (1 where it is all zeros)."""
    amax = piece.detach().abs().amax(dim=(1, 3)).float()  # [B, H]
    if scale == "tensor":
        amax = amax.amax(dim=1, keepdim=True).expand_as(amax)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).contiguous()


def _quantize_into(wire: Tensor, piece: Tensor, scales: Tensor) -> None:
    """``wire`` (uint8, shaped like ``piece``) <- e4m3 of ``piece / scales`` (``scales``: ``[B, H]``)."""
    wire.view(FP8).copy_(piece.float().div(scales[:, None, :, None]))


def _dequantize_into(dest: Tensor, wire: Tensor, scales: Tensor) -> None:
    """``dest`` <- ``e4m3(wire) * scales`` (``scales``: ``[B, H]``), computed in float32."""
    dest.copy_(wire.view(FP8).float().mul_(scales[:, None, :, None]))


# ----------------------------------------------------------------------------------------------- q, k, v
@dataclass(frozen=True)
class _InPlan:
    """One sequence -> heads exchange of several tensors (q, k, v) for one chunk of heads.

    The kernel's buffer of each tensor is ``[B, rows, h, D]`` (``h``: this rank's heads of the chunk): shard
    ``i``'s real rows at ``image + i * local`` (``trim``: padding rows absent, ``rows`` counts real tokens only;
    otherwise present and zero), the text rows (if joined) at ``text``.
    """

    geo: _Geometry
    heads: tuple[slice, ...]  # per rank: its heads in this chunk
    rows: int
    image: int
    text: int | None
    text_len: int
    trim: bool
    wire: tuple[torch.dtype | None, ...]  # per tensor: None (own dtype) or FP8
    scale: str

    @property
    def mine(self) -> slice:
        return self.heads[self.geo.me]

    @property
    def full(self) -> bool:
        """Whether the chunk covers every head."""
        return all(_width(h) == n for h, n in zip(self.heads, self.geo.sizes))


class _PendingIn:
    """Started messages of an :class:`_InPlan`; :meth:`finish` returns the kernel's buffers, filled."""

    def __init__(self, plan: _InPlan, out: list[Tensor], p2p: list[PendingP2P], fp8: list) -> None:
        self.plan, self.out, self.p2p, self.fp8 = plan, out, p2p, fp8

    def finish(self) -> list[Tensor]:
        for pending in self.p2p:
            pending.wait()
        geo = self.plan.geo
        for t, wires, scales in self.fp8:  # received FP8 messages: dequantised into the kernel's rows
            for src, wire in wires:
                rows = slice(
                    self.plan.image + src * geo.local, self.plan.image + src * geo.local + geo.real[src]
                )
                _dequantize_into(self.out[t][:, rows], wire, scales[src])
        out, self.out, self.fp8, self.p2p = self.out, [], [], []
        return out


def _start_in(
    plan: _InPlan, xs: Sequence[Tensor], joints: Sequence[Tensor | None], window: int = 2
) -> _PendingIn:
    """Pack and post the messages of ``xs`` (``[B, S_local, H, D]``), place this rank's own piece and the text.

    Tensor by tensor, at most ``window`` of them in flight: the next one is packed while the previous travels,
    and a send buffer is released once its messages are out (with ``window=2`` the exchange never holds more
    than two send buffers, so its peak stays below the attention's).
    """
    geo, mine = plan.geo, plan.mine
    me, h = geo.me, _width(mine)
    outs, fp8, started = [], [], []
    with torch.no_grad():
        for t, (x, joint, wire) in enumerate(zip(xs, joints, plan.wire)):
            sends, recvs = [], []
            x = x.detach()
            out = x.new_empty(geo.batch, plan.rows, h, geo.dim)
            outs.append(out)
            mine_rows = slice(plan.image + me * geo.local, plan.image + me * geo.local + geo.real[me])
            if not plan.trim and geo.real[me] < geo.local:  # this shard's padding rows (ring blocks)
                out[:, mine_rows.stop : plan.image + (me + 1) * geo.local].zero_()
            out[:, mine_rows].copy_(x[:, : geo.real[me], mine])
            if joint is not None:  # the replicated text: this rank's heads into its rows
                out[:, plan.text : plan.text + plan.text_len].copy_(joint.detach()[:, :, mine])
            scale_sends, wires, scales = [], [], {}
            for peer in range(geo.world):
                if peer == me:
                    continue
                piece = x[:, : geo.real[me], plan.heads[peer]]
                if piece.numel():
                    if wire is None:
                        buf = (
                            piece.contiguous()
                        )  # the one copy of this element (a view if already contiguous)
                    else:
                        s = _scales(piece, plan.scale)
                        buf = torch.empty(piece.shape, dtype=torch.uint8, device=x.device)
                        _quantize_into(buf, piece, s)
                        scale_sends.append((s, peer))
                    sends += [(buf[b], peer) for b in range(geo.batch)]
                    del buf
                start = plan.image + peer * geo.local
                if not plan.trim and geo.real[peer] < geo.local:
                    out[:, start + geo.real[peer] : start + geo.local].zero_()
                rows = slice(start, start + geo.real[peer])
                if geo.real[peer] and h:
                    if wire is None:
                        recvs += [(out[b, rows], peer) for b in range(geo.batch)]
                    else:
                        w = torch.empty(
                            geo.batch, geo.real[peer], h, geo.dim, dtype=torch.uint8, device=x.device
                        )
                        wires.append((peer, w))
                        recvs += [(w[b], peer) for b in range(geo.batch)]
                        scales[peer] = x.new_empty(geo.batch, h, dtype=torch.float32)
                        recvs.append((scales[peer], peer))
            sends += scale_sends
            if wire is not None:
                fp8.append((t, wires, scales))
            started.append(start_p2p(sends, recvs, geo.group, "all_to_all"))
            del sends, recvs, scale_sends
            if len(started) - sum(p.done for p in started) >= window:
                next(p for p in started if not p.done).wait()  # frees its send buffer before the next pack
    return _PendingIn(plan, outs, started, fp8)


def _in_backward(plan: _InPlan, grads: Sequence[Tensor], like: Sequence[tuple], joined: Sequence[bool]):
    """Adjoint of :func:`_start_in`: each shard's rows of the buffers' gradients back to their owner (exact,
    in the gradients' dtype), this rank's text heads zero-padded to every head. ``like``: ``(shape, device)`` of
    every input. Returns ``(dx, djoint)`` per tensor.
    """
    geo, mine = plan.geo, plan.mine
    me = geo.me
    sends, recvs, unpacks, results = [], [], [], []
    for g, (shape, device), has_text in zip(grads, like, joined):
        # Zeros where this chunk's heads or real rows do not reach (padding, other chunks' heads).
        whole = geo.real[me] == geo.local and plan.full
        dx = (torch.empty if whole else torch.zeros)(shape, dtype=g.dtype, device=device)
        g = g.contiguous()
        own = plan.image + me * geo.local
        dx[:, : geo.real[me], mine].copy_(g[:, own : own + geo.real[me]])
        for peer in range(geo.world):
            if peer == me:
                continue
            start = plan.image + peer * geo.local
            if geo.real[peer] and _width(mine):
                sends += [(g[b, start : start + geo.real[peer]], peer) for b in range(geo.batch)]
            piece = dx[:, : geo.real[me], plan.heads[peer]]
            if piece.numel():
                buf = torch.empty(piece.shape, dtype=g.dtype, device=g.device)
                recvs += [(buf[b], peer) for b in range(geo.batch)]
                unpacks.append((piece, buf))
        djoint = None
        if has_text:
            djoint = g.new_zeros(geo.batch, plan.text_len, geo.heads, geo.dim)
            djoint[:, :, mine].copy_(g[:, plan.text : plan.text + plan.text_len])
        results.append((dx, djoint))
    start_p2p(sends, recvs, geo.group, "all_to_all").wait()
    for piece, buf in unpacks:
        piece.copy_(buf)
    return results


# ----------------------------------------------------------------------------------------------- output
@dataclass(frozen=True)
class _OutPlan:
    """One heads -> sequence exchange of one chunk of heads into the final ``[B, rows, H, D]`` buffer.

    Sources (kernel outputs, ``[B, *, h, D]``, ``h`` this rank's heads of the chunk): the image rows of shard
    ``i`` at ``image + i * local`` of source ``image_source``, the text rows at ``text`` of source
    ``text_source``. In the final buffer this rank's tokens sit at ``final_image``, the text at ``final_text``.
    """

    geo: _Geometry
    heads: tuple[slice, ...]
    image_source: int
    image: int
    text_source: int | None
    text: int
    text_len: int
    final_image: int
    final_text: int
    wire: torch.dtype | None
    scale: str

    @property
    def mine(self) -> slice:
        return self.heads[self.geo.me]


class _PendingOut:
    """Started messages of an :class:`_OutPlan`; :meth:`finish` unpacks what arrived into the final buffer."""

    def __init__(self, plan: _OutPlan, final: Tensor, p2p: list[PendingP2P], unpacks: list) -> None:
        self.plan, self.final, self.p2p, self.unpacks = plan, final, p2p, unpacks

    def finish(self) -> None:
        for pending in self.p2p:
            pending.wait()
        for dest, buf, scales in self.unpacks:
            if scales is None:
                dest.copy_(buf)
            else:
                _dequantize_into(dest, buf, scales)
        self.unpacks = []


def _start_out(plan: _OutPlan, sources: Sequence[Tensor], final: Tensor) -> _PendingOut:
    """Post the output rows of every shard to its owner (and the text heads to everyone); place this rank's own."""
    geo, mine = plan.geo, plan.mine
    me, h = geo.me, _width(mine)
    sends, recvs, unpacks = [], [], []
    text_sends, text_recvs = [], []
    with torch.no_grad():
        image = sources[plan.image_source].detach()
        own = plan.image + me * geo.local
        fi = plan.final_image
        final[:, fi : fi + geo.real[me], mine].copy_(image[:, own : own + geo.real[me]])
        for peer in range(geo.world):
            if peer == me:
                continue
            start = plan.image + peer * geo.local
            if geo.real[peer] and h:
                rows = image[:, start : start + geo.real[peer]]
                if plan.wire is None:
                    rows = rows if rows[0].is_contiguous() else rows.contiguous()
                    sends += [(rows[b], peer) for b in range(geo.batch)]
                else:
                    s = _scales(rows, plan.scale)
                    wire = torch.empty(rows.shape, dtype=torch.uint8, device=rows.device)
                    _quantize_into(wire, rows, s)
                    sends += [(wire[b], peer) for b in range(geo.batch)] + [(s, peer)]
            width = _width(plan.heads[peer])
            if geo.real[me] and width:
                dest = final[:, fi : fi + geo.real[me], plan.heads[peer]]
                if plan.wire is None:
                    buf = torch.empty(dest.shape, dtype=final.dtype, device=final.device)
                    recvs += [(buf[b], peer) for b in range(geo.batch)]
                    unpacks.append((dest, buf, None))
                else:
                    buf = torch.empty(dest.shape, dtype=torch.uint8, device=final.device)
                    scales = torch.empty(geo.batch, width, dtype=torch.float32, device=final.device)
                    recvs += [(buf[b], peer) for b in range(geo.batch)] + [(scales, peer)]
                    unpacks.append((dest, buf, scales))
        if plan.text_source is not None:
            text = sources[plan.text_source].detach()[:, plan.text : plan.text + plan.text_len]
            ft = slice(plan.final_text, plan.final_text + plan.text_len)
            if plan.wire is None:
                final[:, ft, mine].copy_(text)
                rows = text if text[0].is_contiguous() else text.contiguous()
                text_sends += [
                    (rows[b], p) for p in range(geo.world) if p != me and h for b in range(geo.batch)
                ]
            else:  # every rank, this one included, uses the values the others receive
                s = _scales(text, plan.scale)
                wire = torch.empty(text.shape, dtype=torch.uint8, device=text.device)
                _quantize_into(wire, text, s)
                _dequantize_into(final[:, ft, mine], wire, s)
                for p in range(geo.world):
                    if p != me and h:
                        text_sends += [(wire[b], p) for b in range(geo.batch)] + [(s, p)]
            for peer in range(geo.world):
                width = _width(plan.heads[peer])
                if peer == me or not width:
                    continue
                dest = final[:, ft, plan.heads[peer]]
                if plan.wire is None:
                    buf = torch.empty(dest.shape, dtype=final.dtype, device=final.device)
                    text_recvs += [(buf[b], peer) for b in range(geo.batch)]
                    unpacks.append((dest, buf, None))
                else:
                    buf = torch.empty(dest.shape, dtype=torch.uint8, device=final.device)
                    scales = torch.empty(geo.batch, width, dtype=torch.float32, device=final.device)
                    text_recvs += [(buf[b], peer) for b in range(geo.batch)] + [(scales, peer)]
                    unpacks.append((dest, buf, scales))
    p2p = [start_p2p(sends, recvs, geo.group, "all_to_all")]
    if plan.text_source is not None:  # the joint (text) heads: an all-gather
        p2p.append(start_p2p(text_sends, text_recvs, geo.group, "all_gather"))
    return _PendingOut(plan, final, p2p, unpacks)


def _out_backward(plan: _OutPlan, grad: Tensor, sources: Sequence[tuple]) -> dict[int, Tensor]:
    """Adjoint of :func:`_start_out` for one chunk: the gradient of each source (exact, in the gradient's dtype).

    ``sources``: ``(shape, dtype, device)`` of every source. Image rows go back to the rank that computed them;
    the text heads' gradients are reduce-scattered (summed over the ranks in rank order).
    """
    geo, mine = plan.geo, plan.mine
    me, h = geo.me, _width(mine)
    shape, dtype, device = sources[plan.image_source]
    grads = {plan.image_source: torch.zeros(shape, dtype=grad.dtype, device=device)}
    if plan.text_source is not None and plan.text_source != plan.image_source:
        shape_t, _, _ = sources[plan.text_source]
        grads[plan.text_source] = torch.zeros(shape_t, dtype=grad.dtype, device=device)
    d_image = grads[plan.image_source]
    fi = plan.final_image
    own = plan.image + me * geo.local
    d_image[:, own : own + geo.real[me]].copy_(grad[:, fi : fi + geo.real[me], mine])
    sends, recvs, sums = [], [], []
    packs = []
    for peer in range(geo.world):
        if peer == me:
            continue
        width = _width(plan.heads[peer])
        if geo.real[me] and width:
            packs.append(grad[:, fi : fi + geo.real[me], plan.heads[peer]].contiguous())
            sends += [(packs[-1][b], peer) for b in range(geo.batch)]
        start = plan.image + peer * geo.local
        if geo.real[peer] and h:
            recvs += [(d_image[b, start : start + geo.real[peer]], peer) for b in range(geo.batch)]
    pending = [start_p2p(sends, recvs, geo.group, "all_to_all")]
    if plan.text_source is not None:  # the adjoint of the text heads' all-gather: a reduce-scatter
        ft = slice(plan.final_text, plan.final_text + plan.text_len)
        parts = grad.new_empty(geo.world, geo.batch, plan.text_len, h, geo.dim)
        parts[me].copy_(grad[:, ft, mine])
        text_sends, text_recvs = [], []
        for peer in range(geo.world):
            if peer == me:
                continue
            if _width(plan.heads[peer]):
                packs.append(grad[:, ft, plan.heads[peer]].contiguous())
                text_sends += [(packs[-1][b], peer) for b in range(geo.batch)]
            if h:
                text_recvs += [(parts[peer, b], peer) for b in range(geo.batch)]
        sums.append(parts)
        pending.append(start_p2p(text_sends, text_recvs, geo.group, "reduce_scatter"))
    for p2p in pending:
        p2p.wait()
    if plan.text_source is not None:
        d_text = grads[plan.text_source]
        d_text[:, plan.text : plan.text + plan.text_len].add_(sums[0].sum(0))
    return grads


# ----------------------------------------------------------------------------------------------- autograd
class _In(torch.autograd.Function):
    """Finishes a started sequence -> heads exchange (:func:`_start_in`); backward sends the gradients home."""

    @staticmethod
    def forward(ctx, plan: _InPlan, pending: _PendingIn, *inputs: Tensor | None):
        n = len(plan.wire)
        ctx.plan = plan
        ctx.like = [(x.shape, x.device) for x in inputs[:n]]
        ctx.joined = [j is not None for j in inputs[n:]]
        return tuple(pending.finish())

    @staticmethod
    def backward(ctx, *grads: Tensor):
        results = _in_backward(ctx.plan, grads, ctx.like, ctx.joined)
        return (None, None, *[dx for dx, _ in results], *[dj for _, dj in results])


class _Out(torch.autograd.Function):
    """Finishes started heads -> sequence exchanges (:func:`_start_out`, one per chunk) into their final buffer."""

    @staticmethod
    def forward(ctx, plans: Sequence[_OutPlan], pendings: Sequence[_PendingOut], *sources: Tensor):
        for pending in pendings:
            pending.finish()
        ctx.plans = plans
        ctx.meta = [(t.shape, t.dtype, t.device) for t in sources]
        return pendings[0].final

    @staticmethod
    def backward(ctx, grad: Tensor):
        totals: list[Tensor | None] = [None] * len(ctx.meta)
        for plan in ctx.plans:
            for i, g in _out_backward(plan, grad, ctx.meta).items():
                totals[i] = g if totals[i] is None else totals[i] + g
        return (None, None, *totals)
