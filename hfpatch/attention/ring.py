"""Ring attention: K/V blocks travel rank to rank over P2P while each rank attends to the block it holds.

Each of the ``r`` ranks of the ring group holds a contiguous block of ``L`` query/key/value tokens: block
``i`` covers global positions ``[i * L, (i + 1) * L)`` (see :mod:`hfpatch.attention.layout`). In ``r``
steps every rank sees every K/V block, merging the partial results with their log-sum-exp
(:mod:`hfpatch.attention.merge`); the send of the next block is started before the current block is
computed, so communication overlaps computation. Keys at global positions ``>= valid_len`` are padding:
padding sits at the global end, so masking it is truncating each block to its real prefix.

Joint tokens (Flux/SD3 text) are replicated on every rank: the joint keys/values take part once, in the
local step, and the joint queries attend to the joint keys and to every image block as it passes. Each
rank merges the joint queries' partials in the same canonical order (joint keys, then blocks 0..r-1), so
the joint output is bitwise identical on every rank of the ring. A key mask on the joint tokens (padded
prompts: QwenImage's ``encoder_hidden_states_mask``) is exact too: per sample, the joint block keeps only
its unmasked keys (a sample with none contributes nothing: ``lse = -inf``), in forward and backward.

The backward is a custom :class:`torch.autograd.Function`: nothing ``O(S^2)`` is saved; each block's
gradient contribution is recomputed from the saved global ``out``/``lse``. K/V blocks go round the ring
again, and the dK/dV accumulators travel with them, arriving back at their owner after ``r`` hops.

Gradient convention (same as :func:`hfpatch.attention.usp.usp_attention`): the objective is the SUM of the
ranks' losses. Gradients of the sharded q/k/v are exact shard gradients; gradients of the replicated joint
q/k/v are this rank's share, and the shares sum over the ring group to the full gradient.

Layout: tensors are ``[B, S, H, D]`` in memory (what DiT processors produce and P2P sends without a copy);
the kernels get ``[B, H, S, D]`` views of them (:mod:`hfpatch.attention.local`).

Bytes sent per rank: forward ``(r - 1)`` K/V blocks; backward ``(r - 1)`` K/V blocks plus ``r`` dK/dV blocks.
Extra memory per rank: the K/V block in flight and the output accumulator (plus one block's output).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.collectives import ring_shift
from .layout import group_rank, group_size, valid_prefix
from .local import accum_dtype, local_attention, local_attention_backward, resolve_backend, to_layout
from .merge import merge_attention, merge_blocks

__all__ = ["ring_attention"]

Tensor = torch.Tensor


def _h(x: Tensor) -> Tensor:
    """The kernels' ``[B, H, S, D]`` view of a ``[B, S, H, D]`` tensor (no copy)."""
    return x.transpose(1, 2)


def _kept_keys(mask: Tensor | None, batch: int) -> list[Tensor | None] | None:
    """Per sample, the indices of the unmasked joint keys (``None``: all of them); ``None`` without a mask."""
    if mask is None:
        return None
    kept = [None if bool(row.all()) else row.nonzero().squeeze(1) for row in mask.expand(batch, -1)]
    return None if all(idx is None for idx in kept) else kept


def _joint_block(q, jk, jv, kept, scale, backend):
    """``local_attention`` of ``q`` (bshd) over the joint keys, keeping per sample only the ``kept`` keys."""
    if kept is None:
        return local_attention(_h(q), _h(jk), _h(jv), scale, backend)
    outs, lses = [], []
    for b, idx in enumerate(kept):
        qb, kb, vb = q[b : b + 1], jk[b : b + 1], jv[b : b + 1]
        if idx is not None:
            kb, vb = kb.index_select(1, idx), vb.index_select(1, idx)
        if kb.shape[1] == 0:  # every joint key of this sample is masked: the block contributes nothing
            outs.append(torch.zeros_like(_h(qb)))
            lses.append(
                torch.full(_h(qb).shape[:3], float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
            )
            continue
        out_b, lse_b = local_attention(_h(qb), _h(kb), _h(vb), scale, backend)
        outs.append(out_b)
        lses.append(lse_b)
    return torch.cat(outs), torch.cat(lses)


def _ring_forward(q, k, v, jq, jk, jv, group, valid_len, scale, backend, kept=None):
    """Returns ``(out_bhsd, lse, joint_out_bhsd | None, joint_lse | None)`` in the accumulator dtype."""
    world, me, block = group_size(group), group_rank(group), k.shape[1]
    out = lse = None
    joint_parts: list[tuple[Tensor, Tensor]] = []
    if jk is not None:  # the joint keys take part once, here
        out, lse = merge_attention(out, lse, *_joint_block(q, jk, jv, kept, scale, backend))
        if jq is not None:
            joint_parts.append(_joint_block(jq, jk, jv, kept, scale, backend))
    by_source: dict[int, tuple[Tensor, Tensor]] = {}
    k_cur, v_cur = k, v
    for step in range(world):
        source = (me - step) % world
        if step < world - 1:  # start passing the block on before computing with it
            (k_next, v_next), wait = ring_shift([k_cur, v_cur], group)
        n = valid_prefix(source * block, block, valid_len)
        if n > 0:
            k_blk, v_blk = _h(k_cur[:, :n]), _h(v_cur[:, :n])
            out, lse = merge_attention(out, lse, *local_attention(_h(q), k_blk, v_blk, scale, backend))
            if jq is not None:
                by_source[source] = local_attention(_h(jq), k_blk, v_blk, scale, backend)
        if step < world - 1:
            wait()
            k_cur, v_cur = k_next, v_next
    assert out is not None and lse is not None  # every rank sees block 0, which holds position 0 < valid_len
    joint_out = joint_lse = None
    if jq is not None:
        joint_out, joint_lse = merge_blocks(joint_parts + [by_source[s] for s in sorted(by_source)])
    return out, lse, joint_out, joint_lse


class _RingAttention(torch.autograd.Function):
    """Ring attention on ``[B, S, H, D]`` tensors (k/v contiguous); backward recomputes block by block."""

    @staticmethod
    def forward(ctx, q, k, v, jq, jk, jv, group, valid_len, scale, backend, joint_mask):
        kept = None if jk is None else _kept_keys(joint_mask, q.shape[0])
        out, lse, joint_out, joint_lse = _ring_forward(
            q, k, v, jq, jk, jv, group, valid_len, scale, backend, kept
        )
        out = _h(out).to(q.dtype)
        joint_out = None if joint_out is None else _h(joint_out).to(jq.dtype)
        ctx.save_for_backward(q, k, v, jq, jk, jv, out, lse, joint_out, joint_lse)
        ctx.args = (group, valid_len, scale, backend, kept)
        return out, joint_out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, djoint_out):
        q, k, v, jq, jk, jv, out, lse, joint_out, joint_lse = ctx.saved_tensors
        group, valid_len, scale, backend, kept = ctx.args
        world, me, block = group_size(group), group_rank(group), k.shape[1]
        acc = accum_dtype(q.dtype)
        dout = torch.zeros_like(out) if dout is None else dout
        has_joint_q = jq is not None
        if has_joint_q and djoint_out is None:
            djoint_out = torch.zeros_like(joint_out)
        # Into the kernel's memory layout once, not once per block (a no-op for the tensors already there).
        layout = resolve_backend(backend, q.device, q.dtype).layout
        q, out, dout = (_h(to_layout(_h(t), layout)) for t in (q, out, dout))
        if has_joint_q:
            jq, joint_out, djoint_out = (_h(to_layout(_h(t), layout)) for t in (jq, joint_out, djoint_out))

        def block_grads(k_blk, v_blk, b=slice(None)):
            """``[B, H, S, D]`` (dq, dk, dv, djq) contributions of one K/V block (image and joint queries);
            ``b`` restricts the queries to a batch slice matching ``k_blk``/``v_blk``."""
            dq, dk, dv = local_attention_backward(
                _h(dout[b]), _h(q[b]), _h(k_blk), _h(v_blk), _h(out[b]), lse[b], scale, backend
            )
            djq = None
            if has_joint_q:
                djq, dk_j, dv_j = local_attention_backward(
                    _h(djoint_out[b]), _h(jq[b]), _h(k_blk), _h(v_blk), _h(joint_out[b]), joint_lse[b],
                    scale, backend,
                )  # fmt: skip
                dk, dv = dk.to(acc).add_(dk_j), dv.to(acc).add_(dv_j)
            return dq, dk, dv, djq

        def joint_block_grads(jk, jv):
            """:func:`block_grads` of the joint keys, per sample over its unmasked keys only (``kept``)."""
            if kept is None:
                return block_grads(jk, jv)
            dq_j = torch.zeros(_h(q).shape, dtype=acc, device=q.device)
            dk_j = torch.zeros(_h(jk).shape, dtype=acc, device=q.device)
            dv_j = torch.zeros(_h(jv).shape, dtype=acc, device=q.device)
            djq_j = torch.zeros(_h(jq).shape, dtype=acc, device=q.device) if has_joint_q else None
            for i, idx in enumerate(kept):
                b = slice(i, i + 1)
                kb, vb = jk[b], jv[b]
                if idx is not None:
                    kb, vb = kb.index_select(1, idx), vb.index_select(1, idx)
                if kb.shape[1] == 0:  # no joint key of this sample took part: no gradient through them
                    continue
                dq_b, dk_b, dv_b, djq_b = block_grads(kb, vb, b)
                dq_j[b] += dq_b
                if idx is None:
                    dk_j[b] += dk_b
                    dv_j[b] += dv_b
                else:
                    dk_j[b].index_add_(2, idx, dk_b.to(acc))
                    dv_j[b].index_add_(2, idx, dv_b.to(acc))
                if has_joint_q:
                    djq_j[b] += djq_b
            return dq_j, dk_j, dv_j, djq_j

        # Accumulators are [B, S, H, D] in memory, like their tensors; kernels' grads are added through views.
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        djq = torch.zeros(jq.shape, dtype=acc, device=q.device) if has_joint_q else None
        djk = djv = None
        if jk is not None:
            dq_j, djk_h, djv_h, djq_j = joint_block_grads(jk, jv)
            _h(dq).add_(dq_j)
            djk, djv = _h(djk_h), _h(djv_h)
            if has_joint_q:
                _h(djq).add_(djq_j)

        k_cur, v_cur = k, v
        dkv_cur = None  # (dk, dv) accumulators of the block held now; they travel with it
        wait_dkv = in_flight = None
        for step in range(world):
            source = (me - step) % world
            if step < world - 1:
                (k_next, v_next), wait_kv = ring_shift([k_cur, v_cur], group)
            n = valid_prefix(source * block, block, valid_len)
            grads = block_grads(k_cur[:, :n], v_cur[:, :n]) if n > 0 else None
            if wait_dkv is not None:  # the accumulators of this block arrived while we computed
                wait_dkv()
                in_flight = None
            if dkv_cur is None:
                dkv_cur = [torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(2)]
            if grads is not None:
                dq_b, dk_b, dv_b, djq_b = grads
                _h(dq).add_(dq_b)
                _h(dkv_cur[0][:, :n]).add_(dk_b)
                _h(dkv_cur[1][:, :n]).add_(dv_b)
                if has_joint_q:
                    _h(djq).add_(djq_b)
            if world > 1:  # pass the accumulators on; after r hops they are back at their owner
                in_flight = dkv_cur  # keep the send buffers alive until the transfer completes
                dkv_cur, wait_dkv = ring_shift(in_flight, group)
            if step < world - 1:
                wait_kv()
                k_cur, v_cur = k_next, v_next
        if wait_dkv is not None:
            wait_dkv()
            in_flight = None
        dk, dv = dkv_cur

        def cast(grad, like):
            return None if grad is None else grad.to(like.dtype)

        return (
            cast(dq, q), cast(dk, k), cast(dv, v), cast(djq, jq), cast(djk, jk), cast(djv, jv),
            None, None, None, None, None,
        )  # fmt: skip


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: dist.ProcessGroup | None,
    valid_len: int | None = None,
    joint_query: Tensor | None = None,
    joint_key: Tensor | None = None,
    joint_value: Tensor | None = None,
    joint_key_mask: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Attention of this rank's query block over the keys of all ring ranks (plus replicated joint tokens).

    Shapes are not validated here (use :func:`hfpatch.attention.usp.usp_attention`, which checks every input
    before any communication).

    Args:
        query, key, value: ``[B, L, H, D]``, this rank's block (global positions ``[i*L, (i+1)*L)`` for ring
            index ``i``). ``key``/``value`` are made contiguous for P2P (no copy if they already are).
        group: The ring process group; ``None`` means degree 1 (no communication).
        valid_len: Real tokens in the global sequence; keys at positions ``>= valid_len`` are masked.
        joint_query, joint_key, joint_value: ``[B, S_txt, H, D]`` replicated tokens, or ``None``.
        joint_key_mask: ``[B or 1, S_txt]`` bool, ``True`` where a joint key takes part (replicated, like the
            joint tokens); ``None``: all of them.
        scale: Softmax scale (default ``D ** -0.5``).
        backend: Local kernel (:mod:`hfpatch.attention.local`).

    Returns:
        ``(out [B, L, H, D], joint_out [B, S_txt, H, D] or None)``; differentiable.

    >>> import torch
    >>> q, k, v = (torch.randn(1, 6, 2, 8) for _ in range(3))
    >>> out, _ = ring_attention(q, k, v, group=None, valid_len=4)  # the last two keys are padding
    >>> ref = torch.nn.functional.scaled_dot_product_attention(
    ...     q.transpose(1, 2), k[:, :4].transpose(1, 2), v[:, :4].transpose(1, 2)).transpose(1, 2)
    >>> bool(torch.allclose(out, ref, atol=1e-6))
    True
    """
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    # One kernel for every block, forward and backward ("auto" resolved once, here, on every rank alike).
    backend = resolve_backend(backend, query.device, query.dtype, query.shape[-1]).name
    if group is not None:
        key, value = key.contiguous(), value.contiguous()
    return _RingAttention.apply(
        query,
        key,
        value,
        joint_query,
        joint_key,
        joint_value,
        group,
        valid_len,
        scale,
        backend,
        joint_key_mask,
    )
