"""The heads -> sequence exchange of the attention's output: sent as the kernel wrote it, unpacked once.

The kernel's output rows of shard ``i`` (:class:`~hfpatch.attention.exchange.plans.OutPlan` says where) are
sent to rank ``i`` as they are (contiguous views); what arrives is copied once into its heads of the final
``[B, T + S_local, H, D]``, the text heads (all-gathered) included, so the caller gets the joined output with
no concatenation. This shard's padding rows of the final buffer are zero (:func:`final_buffer`).

Two halves, so several chunks overlap: :func:`start_out` posts the messages
(:func:`hfpatch.distributed.collectives.start_p2p`) and places this rank's own heads; :func:`finish_out` waits
for the started chunks, unpacks (dequantising what came in FP8: :mod:`hfpatch.attention.exchange.wire`) and
returns the final buffer, differentiable: the backward sends the gradient rows back to the rank that computed
them and reduce-scatters the text heads' gradients, exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...distributed.collectives import PendingP2P, start_p2p
from .geometry import Geometry, width
from .plans import OutPlan
from .wire import dequantize_into, quantize

Tensor = torch.Tensor


def final_buffer(geo: Geometry, like: Tensor, text_len: int, front: bool) -> Tensor:
    """The joined output ``[B, text_len + S_local, H, D]``; this shard's padding rows zeroed."""
    final = like.new_empty(geo.batch, text_len + geo.local, geo.heads, geo.dim)
    pad = geo.local - geo.real[geo.me]
    if pad:
        start = (text_len if front else 0) + geo.real[geo.me]
        final[:, start : start + pad].zero_()
    return final


@dataclass(eq=False)
class PendingOut:
    """Started messages of an :class:`OutPlan`; :meth:`finish` unpacks what arrived into the final buffer."""

    plan: OutPlan
    final: Tensor
    p2p: list[PendingP2P]
    unpacks: list

    def finish(self) -> None:
        """Wait for the messages and unpack (dequantise) them into their heads of the final buffer."""
        for pending in self.p2p:
            pending.wait()
        for dest, buf, scales in self.unpacks:
            if scales is None:
                dest.copy_(buf)
            else:
                dequantize_into(dest, buf, scales)
        self.unpacks = []


def _receive_into(
    dest: Tensor, fp8: bool, heads: int, peer: int, recvs: list[tuple], unpacks: list[tuple]
) -> None:
    """Post the receives of ``dest``'s rows from ``peer`` (one per sample; on the FP8 wire, bytes and the
    ``heads`` per-head scales) into new buffers, and note where :func:`finish_out` unpacks them."""
    batch = dest.shape[0]
    if not fp8:
        buf = torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)
        recvs += [(buf[b], peer) for b in range(batch)]
        unpacks.append((dest, buf, None))
    else:
        buf = torch.empty(dest.shape, dtype=torch.uint8, device=dest.device)
        scales = torch.empty(batch, heads, dtype=torch.float32, device=dest.device)
        recvs += [(buf[b], peer) for b in range(batch)] + [(scales, peer)]
        unpacks.append((dest, buf, scales))


def start_out(
    plan: OutPlan, sources: Sequence[Tensor], final: Tensor | None, front: bool = True
) -> PendingOut:
    """Post the output rows of every shard to its owner (and the text heads to everyone); place this rank's own.

    Into ``final`` (``None``: a new :func:`final_buffer`, text in front if ``front``; allocated only now, after
    the attention).
    """
    if final is None:
        final = final_buffer(plan.geo, sources[plan.image_source], plan.text_len, front)
    geo, mine = plan.geo, plan.mine
    me, h = geo.me, width(mine)
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
                    wire, s = quantize(rows, plan.scale)
                    sends += [(wire[b], peer) for b in range(geo.batch)] + [(s, peer)]
            theirs = width(plan.heads[peer])
            if geo.real[me] and theirs:
                dest = final[:, fi : fi + geo.real[me], plan.heads[peer]]
                _receive_into(dest, plan.wire is not None, theirs, peer, recvs, unpacks)
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
                wire, s = quantize(text, plan.scale)
                dequantize_into(final[:, ft, mine], wire, s)
                for p in range(geo.world):
                    if p != me and h:
                        text_sends += [(wire[b], p) for b in range(geo.batch)] + [(s, p)]
            for peer in range(geo.world):
                theirs = width(plan.heads[peer])
                if peer == me or not theirs:
                    continue
                dest = final[:, ft, plan.heads[peer]]
                _receive_into(dest, plan.wire is not None, theirs, peer, text_recvs, unpacks)
    p2p = [start_p2p(sends, recvs, geo.group, "all_to_all")]
    if plan.text_source is not None:  # the joint (text) heads: an all-gather
        p2p.append(start_p2p(text_sends, text_recvs, geo.group, "all_gather"))
    return PendingOut(plan, final, p2p, unpacks)


def _out_backward(plan: OutPlan, grad: Tensor, sources: Sequence[tuple]) -> dict[int, Tensor]:
    """Adjoint of :func:`start_out` for one chunk: the gradient of each source (exact, in the gradient's dtype).

    ``sources``: ``(shape, dtype, device)`` of every source. Image rows go back to the rank that computed them;
    the text heads' gradients are reduce-scattered (summed over the ranks in rank order).
    """
    geo, mine = plan.geo, plan.mine
    me, h = geo.me, width(mine)
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
        theirs = width(plan.heads[peer])
        if geo.real[me] and theirs:
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
            if width(plan.heads[peer]):
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


class _Out(torch.autograd.Function):
    """Finishes started heads -> sequence exchanges (:func:`start_out`, one per chunk) into their final buffer."""

    @staticmethod
    def forward(ctx, plans: Sequence[OutPlan], pendings: Sequence[PendingOut], *sources: Tensor):
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


def finish_out(plans: Sequence[OutPlan], pendings: Sequence[PendingOut], sources: Sequence[Tensor]) -> Tensor:
    """The final buffer of started output exchanges (differentiable)."""
    return _Out.apply(plans, pendings, *sources)
