"""The sequence -> heads exchange of q, k, v: packed once, received where the attention kernel reads them.

Each element is copied once, into a send buffer (the heads of rank ``j``, ``[B, S_local, H_j, D]``
contiguous), or, for this rank's own heads, straight into the kernel's buffer. What rank ``i`` sends lands,
with no copy, in the rows of shard ``i`` of the buffer the kernel reads
(:class:`~hfpatch.attention.exchange.plans.InPlan` says which rows), the replicated text tokens in front or at
the back where the stock model has them. Padding rows are never sent: the receiver of a padded shard zeroes
them, or has no rows for them (``trim``).

An exchange has two halves, so the caller computes while it travels: :func:`start_in` packs, posts the
messages (:func:`hfpatch.distributed.collectives.start_p2p`) and places this rank's own heads and the text;
:func:`finish_in` waits, dequantises what came in FP8 (:mod:`hfpatch.attention.exchange.wire`) and returns
the kernel's buffers, differentiable: the backward sends each shard's gradient rows home, exact.
:class:`PendingExchange` is the started exchange of one tensor, as
:func:`hfpatch.attention.exchange.overlap.start_sequence_to_heads` returns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...distributed.collectives import PendingP2P, start_p2p
from .geometry import width
from .plans import InPlan
from .wire import dequantize_into, quantize

Tensor = torch.Tensor


@dataclass(eq=False)
class PendingIn:
    """Started messages of an :class:`~hfpatch.attention.exchange.plans.InPlan`; :meth:`finish` returns the
    kernel's buffers, filled."""

    plan: InPlan
    out: list[Tensor]
    p2p: list[PendingP2P]
    fp8: list

    def finish(self) -> list[Tensor]:
        """Wait for the messages, dequantise the FP8 ones into their rows; the buffers (once only)."""
        for pending in self.p2p:
            pending.wait()
        geo = self.plan.geo
        for t, wires, scales in self.fp8:  # received FP8 messages: dequantised into the kernel's rows
            for src, wire in wires:
                rows = slice(
                    self.plan.image + src * geo.local, self.plan.image + src * geo.local + geo.real[src]
                )
                dequantize_into(self.out[t][:, rows], wire, scales[src])
        out, self.out, self.fp8, self.p2p = self.out, [], [], []
        return out


def start_in(
    plan: InPlan, xs: Sequence[Tensor], joints: Sequence[Tensor | None], window: int = 2
) -> PendingIn:
    """Pack and post the messages of ``xs`` (``[B, S_local, H, D]``), place this rank's own piece and the text.

    Tensor by tensor, at most ``window`` of them in flight: the next one is packed while the previous travels,
    and a send buffer is released once its messages are out (with ``window=2`` the exchange never holds more
    than two send buffers, so its peak stays below the attention's).
    """
    geo, mine = plan.geo, plan.mine
    me, h = geo.me, width(mine)
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
                        buf, s = quantize(piece, plan.scale)
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
    return PendingIn(plan, outs, started, fp8)


def _in_backward(plan: InPlan, grads: Sequence[Tensor], like: Sequence[tuple], joined: Sequence[bool]):
    """Adjoint of :func:`start_in`: each shard's rows of the buffers' gradients back to their owner (exact,
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
            if geo.real[peer] and width(mine):
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


class _In(torch.autograd.Function):
    """Finishes a started sequence -> heads exchange (:func:`start_in`); backward sends the gradients home."""

    @staticmethod
    def forward(ctx, plan: InPlan, pending: PendingIn, *inputs: Tensor | None):
        n = len(plan.wire)
        ctx.plan = plan
        ctx.like = [(x.shape, x.device) for x in inputs[:n]]
        ctx.joined = [j is not None for j in inputs[n:]]
        return tuple(pending.finish())

    @staticmethod
    def backward(ctx, *grads: Tensor):
        results = _in_backward(ctx.plan, grads, ctx.like, ctx.joined)
        return (None, None, *[dx for dx, _ in results], *[dj for _, dj in results])


def finish_in(plan: InPlan, pending: PendingIn, xs: Sequence[Tensor], joints: Sequence[Tensor | None]):
    """The kernel's buffers of a started exchange (differentiable)."""
    return _In.apply(plan, pending, *xs, *joints)


# ----------------------------------------------------------------------------------------------- one tensor
class PendingExchange:
    """A started sequence -> heads exchange of one tensor
    (:func:`~hfpatch.attention.exchange.overlap.start_sequence_to_heads`); :meth:`wait` returns its result."""

    def __init__(self, plan: InPlan, pending: PendingIn | None, x: Tensor) -> None:
        self._plan, self._pending, self._x = plan, pending, x

    def wait(self) -> Tensor:
        """``[B, u * S_local, H_r, D]`` (padding rows zero), differentiable; once only."""
        if self._pending is None:
            raise RuntimeError("PendingExchange.wait() was already called")
        pending, self._pending = self._pending, None
        x, self._x = self._x, None
        return finish_in(self._plan, pending, [x], [None])[0]
