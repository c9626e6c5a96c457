"""Unified sequence parallelism (USP): Ulysses inside, Ring outside, on any ``ring x ulysses`` mesh.

1. All-to-all over the Ulysses group: sequence shards -> head shards (:mod:`hfpatch.attention.ulysses`);
   the rank now holds the contiguous block ``ring_index`` of the global sequence for its heads.
2. Ring attention over the Ring group on those blocks (:mod:`hfpatch.attention.ring`); with a ring degree
   of 1 the rank holds the whole sequence of its heads and no log-sum-exp is needed: one call of the same
   ``F.scaled_dot_product_attention`` the stock model makes (``dense``), so SDPA picks the same kernel.
3. The inverse all-to-all; joint (text) output heads are all-gathered over the Ulysses group.

Axes of degree 1 (``None`` groups) skip their communication entirely; with both ``None`` this is plain
local attention. The sharding layout is :mod:`hfpatch.attention.layout`.

Gradient convention (sum of losses). The objective is the SUM over ranks of each rank's loss, where a rank's
loss depends on the model only through what the rank computes for its own shard. That is the case when
every rank computes the same loss from an output gathered with a ``"slice"`` backward (the gradient of a
rank's shard is its slice of the loss gradient). Then:

- ``query``/``key``/``value`` (sharded) get exactly their shard of the full gradient (padded rows: 0);
- the replicated ``joint_*`` inputs get this rank's *share*; the shares sum over the sp group to the full
  gradient, and everything computed replicated upstream inherits the same rule (no extra communication:
  the joint output's all-gather has a reduce-scatter backward, the joint head slice a zero-padding one);
- hence parameter gradients (and gradients of any replicated input) must be all-reduced with SUM over the
  ``"sp"`` group (ring x ulysses) to equal the single-process gradients.

The models patched by :func:`hfpatch.apply` wrap this function in boundaries that scale the output gradient
by the group size, so that a MEAN over the group (DDP's, FSDP2's, :func:`hfpatch.all_reduce_gradients`) is
right instead (:mod:`hfpatch.distributed.gradients`); calling it directly, the SUM above applies.

A loss term on a replicated output (say the text tokens) is seen in full by every rank: count it on one
rank only, or scale it by ``1 / sp_size``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .exchange import ExchangeConfig
from .exchange.geometry import geometry
from .exchange.plans import in_plans, out_plans
from .exchange.to_heads import finish_in, start_in
from .exchange.to_sequence import finish_out, start_out
from .layout import group_rank, group_size
from .ring import ring_attention
from .ulysses import gather_joint_heads, heads_to_sequence, sequence_to_heads, slice_joint_heads

__all__ = ["sdpa_bshd", "ulysses_attention", "usp_attention", "usp_attention_joined"]

Tensor = torch.Tensor
_JOINT_POSITIONS = ("front", "back")
#: ``(q_bshd, k_bshd, v_bshd, key_mask | None, scale) -> out_bshd``: one attention over a whole sequence.
DenseAttention = Callable[[Tensor, Tensor, Tensor, "Tensor | None", "float | None"], Tensor]


def sdpa_bshd(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, scale: float | None) -> Tensor:
    """``F.scaled_dot_product_attention`` on ``[B, S, H, D]`` tensors, as a stock DiT processor calls it."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask, scale=scale
    )
    return out.transpose(1, 2)


def _dense_attention(q, k, v, joint, joint_position, joint_key_mask, valid_len, scale, attend):
    """Ring degree 1: the whole (head-sharded) sequence is here, so one ``attend`` call computes it.

    The joint tokens are joined where the stock model has them and padded keys are cut off, so ``attend``
    sees exactly the call the unpatched model makes, for this rank's heads; padded query rows output zeros.
    """
    if q.shape[2] == 0:  # an idle Ulysses rank (fewer heads than ranks): empty outputs, still in the graph
        # (every input takes part, so the backward runs the same collectives as on the other ranks)
        link = sum(t.sum() for t in (k, v, *(joint or ())))
        return q + link, None if joint is None else joint[0] + link
    length = q.shape[1]
    n = length if valid_len is None else valid_len
    q, k, v = (t if n == length else t[:, :n] for t in (q, k, v))
    mask = None
    if joint is not None:
        front = joint_position == "front"

        def join(text: Tensor, image: Tensor) -> Tensor:
            return torch.cat([text, image] if front else [image, text], dim=1)

        q, k, v = (join(t, x) for t, x in zip(joint, (q, k, v)))
        if joint_key_mask is not None:
            mask = join(joint_key_mask, joint_key_mask.new_ones(joint_key_mask.shape[0], n))[:, None, None, :]
    out = attend(q, k, v, mask, scale)
    joint_out = None
    if joint is not None:
        text = joint[0].shape[1]
        joint_out, out = (out[:, :text], out[:, text:]) if front else (out[:, n:], out[:, :n])
    if n < length:
        out = F.pad(out, (0, 0, 0, 0, 0, length - n))
    return out, joint_out


def _check_inputs(query, key, value, joint, joint_position, valid_len, world, joint_key_mask=None) -> None:
    """Every check depends only on local shapes, so all ranks raise the same error before any collective."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"usp_attention: {name} must be a [B, S_local, H, D] tensor, got {got}")
    if key.shape != query.shape or value.shape != query.shape:
        raise ValueError(
            "usp_attention: query, key and value must have the same [B, S_local, H, D] shape (self-attention over "
            f"one sharded sequence), got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"usp_attention: q/k/v dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if query.shape[1] < 1 or query.shape[2] < 1:
        raise ValueError(
            f"usp_attention: need at least one token and one head per rank, got {tuple(query.shape)}"
        )
    if joint_position not in _JOINT_POSITIONS:
        raise ValueError(f"usp_attention: joint_position must be 'front' or 'back', got {joint_position!r}")
    given = [t is not None for t in joint]
    if any(given) and not all(given):
        raise ValueError("usp_attention: pass all of joint_query, joint_key, joint_value or none of them")
    if all(given):
        jq = joint[0]
        b, _, h, d = query.shape
        for name, t in zip(("joint_query", "joint_key", "joint_value"), joint):
            if (
                t.dim() != 4
                or t.shape != jq.shape
                or (t.shape[0], t.shape[2], t.shape[3]) != (b, h, d)
                or t.shape[1] < 1
            ):
                raise ValueError(
                    f"usp_attention: {name} must be [B={b}, S_txt >= 1, H={h}, D={d}] like the other joint "
                    f"tensors, got {tuple(t.shape)} (pass joint_*=None for no joint tokens)"
                )
            if t.dtype != query.dtype:
                raise ValueError(
                    f"usp_attention: {name} dtype {t.dtype} differs from query dtype {query.dtype}"
                )
    if joint_key_mask is not None:
        if not all(given):
            raise ValueError("usp_attention: joint_key_mask masks joint keys; pass joint_query/key/value too")
        b, text = query.shape[0], joint[1].shape[1]
        if (
            not isinstance(joint_key_mask, torch.Tensor)
            or joint_key_mask.dtype != torch.bool
            or joint_key_mask.dim() != 2
            or joint_key_mask.shape[0] not in (1, b)
            or joint_key_mask.shape[1] != text
        ):
            got = (
                f"{tuple(joint_key_mask.shape)} {joint_key_mask.dtype}"
                if isinstance(joint_key_mask, torch.Tensor)
                else type(joint_key_mask).__name__
            )
            raise ValueError(
                f"usp_attention: joint_key_mask must be a bool [B={b} or 1, S_txt={text}] tensor (True: the key "
                f"takes part), got {got}"
            )
    total = query.shape[1] * world
    if valid_len is not None and not (isinstance(valid_len, int) and 1 <= valid_len <= total):
        raise ValueError(
            f"usp_attention: valid_len must be an int in [1, {total}] (S_local={query.shape[1]} x {world} ranks), "
            f"got {valid_len!r}"
        )


def usp_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    valid_len: int | None = None,
    joint_query: Tensor | None = None,
    joint_key: Tensor | None = None,
    joint_value: Tensor | None = None,
    joint_position: str = "front",
    joint_key_mask: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    dense: DenseAttention | None = None,
    exchange: ExchangeConfig | str | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Exact softmax attention over a sequence sharded across ``ring x ulysses`` ranks.

    Equals ``F.scaled_dot_product_attention`` on the full unpadded sequence (joint tokens concatenated in
    front or at the back) up to float reassociation, forward and backward.

    Args:
        query, key, value: ``[B, S_local, H, D]``, this rank's shard (shard index
            ``ring_index * ulysses + ulysses_index``; see :mod:`hfpatch.attention.layout`).
        ulysses_group: Ulysses process group, ``None`` for degree 1.
        ring_group: Ring process group, ``None`` for degree 1.
        valid_len: Real tokens in the global (padded) sequence; keys at positions ``>= valid_len`` are
            masked. ``None``: no padding.
        joint_query, joint_key, joint_value: ``[B, S_txt, H, D]`` replicated on every rank (Flux/SD3 text).
        joint_position: Whether the joint tokens come logically before (``"front"``) or after (``"back"``)
            the sharded tokens. Softmax attention is invariant to the order of the keys, so this changes
            nothing in the result; it documents the caller's layout.
        joint_key_mask: ``[B or 1, S_txt]`` bool, ``True`` where a joint key takes part (a padded prompt's
            mask; replicated like the joint tokens). Masked joint keys get no attention weight and no gradient;
            queries (sharded and joint) are never masked, as in SDPA with a key mask. ``None``: all keys.
        scale: Softmax scale (default ``D ** -0.5``).
        backend: Local kernel of Ring's blocks (:mod:`hfpatch.attention.local`), ``"auto"`` by default: the
            kernel the unpatched model's SDPA would run, in its form that returns the log-sum-exp.
        dense: The attention of a ring degree of 1 (Ulysses alone, or one rank) with ``backend="auto"``,
            where no log-sum-exp is needed: one call over the whole sequence of this rank's heads,
            ``(q, k, v, key_mask, scale)`` on ``[B, S, H, D]`` (``key_mask``: ``[B or 1, 1, 1, S_k]`` bool or
            ``None``). Default :func:`sdpa_bshd`: the same ``F.scaled_dot_product_attention`` the stock model
            calls, so SDPA picks the same kernel. A named ``backend`` runs Ring's path instead.
        exchange: How the Ulysses exchange runs (:class:`hfpatch.attention.exchange.ExchangeConfig` or a name:
            ``"overlap"``, ``"fp8"``, ``"fp8+overlap"``). Default ``None``: exact and blocking. Whatever it is,
            the exchange copies every element once (:mod:`hfpatch.attention.exchange`).

    Returns:
        ``(out [B, S_local, H, D], joint_out [B, S_txt, H, D] or None)``; ``joint_out`` is identical on
        every rank of the sp group. Gradients follow the sum-of-losses convention of this module: all-reduce
        parameter grads with SUM over the sp group (patched models: a mean, see the module docstring).

    Raises:
        ValueError: Inconsistent shapes, dtypes, ``joint_position`` or ``valid_len``; an FP8 ``exchange`` under
            training without ``training=True`` (before any collective).

    >>> import torch
    >>> q, k, v = (torch.randn(1, 6, 2, 8) for _ in range(3))
    >>> tq, tk, tv = (torch.randn(1, 3, 2, 8) for _ in range(3))
    >>> out, txt = usp_attention(q, k, v, ulysses_group=None, ring_group=None,
    ...                          joint_query=tq, joint_key=tk, joint_value=tv)
    >>> bshd = lambda *ts: [torch.cat(ts, 1).transpose(1, 2)]
    >>> ref = torch.nn.functional.scaled_dot_product_attention(
    ...     *bshd(tq, q), *bshd(tk, k), *bshd(tv, v)).transpose(1, 2)
    >>> bool(torch.allclose(torch.cat([txt, out], 1), ref, atol=1e-6))
    True
    """
    out, joint_out, _ = _usp(
        query, key, value, ulysses_group, ring_group, valid_len, (joint_query, joint_key, joint_value),
        joint_position, joint_key_mask, scale, backend, dense, exchange,
    )  # fmt: skip
    return out, joint_out


def usp_attention_joined(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    valid_len: int | None = None,
    joint_query: Tensor | None = None,
    joint_key: Tensor | None = None,
    joint_value: Tensor | None = None,
    joint_position: str = "front",
    joint_key_mask: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    dense: DenseAttention | None = None,
    exchange: ExchangeConfig | str | None = None,
) -> Tensor:
    """:func:`usp_attention`'s output joined with the joint output where the stock model has it: ``[B, T + S_local,
    H, D]`` (text in front) or ``[B, S_local + T, H, D]`` (``joint_position="back"``); ``out`` alone without joint
    tokens. Under Ulysses the exchange writes the joined tensor directly (no concatenation)."""
    out, joint_out, joined = _usp(
        query, key, value, ulysses_group, ring_group, valid_len, (joint_query, joint_key, joint_value),
        joint_position, joint_key_mask, scale, backend, dense, exchange,
    )  # fmt: skip
    if joined is not None:
        return joined
    if joint_out is None:
        return out
    return torch.cat([joint_out, out] if joint_position == "front" else [out, joint_out], dim=1)


def _usp(query, key, value, ulysses_group, ring_group, valid_len, joint, joint_position, joint_key_mask, scale,
         backend, dense, exchange):  # fmt: skip
    """``(out, joint_out, joined or None)``: :func:`usp_attention`, and the joined output when the exchange made it."""
    world = group_size(ulysses_group) * group_size(ring_group)
    _check_inputs(query, key, value, joint, joint_position, valid_len, world, joint_key_mask)
    config = ExchangeConfig.parse(exchange)
    if config is not None:
        config.check([query, key, value, *joint], "usp_attention")
    heads = query.shape[2]
    if group_size(ulysses_group) > 1 and not torch.compiler.is_compiling():
        has_joint = joint[0] is not None
        if group_size(ring_group) == 1 and backend == "auto":
            joined = _ulysses_dense(
                query, key, value, joint if has_joint else None, joint_position, joint_key_mask, valid_len,
                scale, sdpa_bshd if dense is None else dense, ulysses_group, config,
            )  # fmt: skip
        else:
            joined = _ulysses_ring(
                query, key, value, joint if has_joint else None, joint_position, joint_key_mask, valid_len,
                scale, backend, ulysses_group, ring_group, config,
            )  # fmt: skip
        if not has_joint:
            return joined, None, joined
        text, local = joint[0].shape[1], query.shape[1]
        if joint_position == "front":
            return joined[:, text:], joined[:, :text], joined
        return joined[:, :local], joined[:, local:], joined
    if config is not None and config.lossy and group_size(ulysses_group) > 1:
        raise ValueError(
            "usp_attention: the FP8 exchange runs in eager mode only; compiled code exchanges exactly (drop "
            "exchange= or compile=)"
        )
    # No Ulysses exchange (or compiled code: the all-to-all custom ops, one node each in the graph).
    q, k, v = (sequence_to_heads(t, ulysses_group, heads) for t in (query, key, value))
    jq, jk, jv = (None if t is None else slice_joint_heads(t, ulysses_group) for t in joint)
    if group_size(ring_group) == 1 and backend == "auto":
        out, joint_out = _dense_attention(
            q, k, v, None if jq is None else (jq, jk, jv), joint_position, joint_key_mask, valid_len, scale,
            sdpa_bshd if dense is None else dense,
        )  # fmt: skip
    else:
        out, joint_out = ring_attention(
            q, k, v, group=ring_group, valid_len=valid_len, joint_query=jq, joint_key=jk, joint_value=jv,
            joint_key_mask=joint_key_mask, scale=scale, backend=backend,
        )  # fmt: skip
    del q, k, v, jq, jk, jv  # without autograd, free the resharded inputs before resharding the output
    out = heads_to_sequence(out, ulysses_group, heads)
    if joint_out is not None:
        joint_out = gather_joint_heads(joint_out, ulysses_group, heads)
    return out, joint_out, None


def _joined_mask(joint_key_mask: Tensor | None, tokens: int, front: bool) -> Tensor | None:
    """SDPA's ``[B|1, 1, 1, T + tokens]`` key mask: the joint key mask beside ``tokens`` unmasked image keys."""
    if joint_key_mask is None:
        return None
    image = joint_key_mask.new_ones(joint_key_mask.shape[0], tokens)
    return torch.cat([joint_key_mask, image] if front else [image, joint_key_mask], dim=1)[:, None, None, :]


def _ulysses_dense(q, k, v, joint, joint_position, joint_key_mask, valid_len, scale, attend, group, config):
    """Ring degree 1 under Ulysses: the exchange writes each head chunk's q/k/v straight into the joined buffers
    the kernel reads (real tokens only, text where the stock model has it), ``attend`` runs once per chunk, and
    the output exchange writes the joined ``[B, T + S_local, H, D]`` output (:mod:`hfpatch.attention.exchange`).
    With ``overlap`` the exchange of chunk ``c + 1`` and the output of chunk ``c - 1`` travel while chunk ``c``
    attends."""
    front = joint_position == "front"
    text = 0 if joint is None else joint[0].shape[1]
    joints = (None, None, None) if joint is None else joint
    geo = geometry(q, group, q.shape[2], valid_len)
    plans = in_plans(geo, 3, text_len=text, front=front, trim=True, config=config, keys=1)
    back_plans = out_plans(
        geo, image_rows=geo.total, text_len=text, kernel_front=front, final_front=front, config=config
    )
    mask = _joined_mask(joint_key_mask, geo.total, front)
    window = 3 if len(plans) > 1 else 2  # overlapped: a chunk's q, k and v all in flight
    started = [start_in(plans[0], (q, k, v), joints, window)]
    outs, pending, final = [], [], None
    for c, plan in enumerate(plans):
        if c + 1 < len(plans):
            started.append(start_in(plans[c + 1], (q, k, v), joints, window))
        q_c, k_c, v_c = finish_in(plan, started[c], (q, k, v), joints)
        started[c] = None
        # An idle chunk (no head of this rank in it) keeps its empty buffer as output: it stays in the graph, so
        # the backward runs the same exchanges as on the other ranks.
        outs.append(q_c if q_c.shape[2] == 0 else attend(q_c, k_c, v_c, mask, scale))
        del q_c, k_c, v_c  # without autograd, free this chunk's buffers before the next one
        pending.append(start_out(back_plans[c], outs, final, front))
        final = pending[-1].final
    return finish_out(back_plans, pending, outs)


def _ulysses_ring(q, k, v, joint, joint_position, joint_key_mask, valid_len, scale, backend, ulysses_group,
                  ring_group, config):  # fmt: skip
    """Ring degree > 1 (or a named kernel) under Ulysses: the exchange gives Ring its block of every shard's rows
    (padding zeroed), the text stays whole (a view of this rank's heads), the output exchange joins the text."""
    front = joint_position == "front"
    text = 0 if joint is None else joint[0].shape[1]
    ulysses = group_size(ulysses_group)
    serial = None if config is None else ExchangeConfig(dtype=config.dtype, scale=config.scale,
                                                        exact_keys=config.exact_keys, training=config.training)  # fmt: skip
    geo = geometry(q, ulysses_group, q.shape[2], valid_len, group_rank(ring_group) * ulysses)
    plan = in_plans(geo, 3, config=serial, keys=1)[0]
    none = (None, None, None)
    q_h, k_h, v_h = finish_in(plan, start_in(plan, (q, k, v), none), (q, k, v), none)
    jq, jk, jv = none if joint is None else (slice_joint_heads(t, ulysses_group) for t in joint)
    out, joint_out = ring_attention(
        q_h, k_h, v_h, group=ring_group, valid_len=valid_len, joint_query=jq, joint_key=jk, joint_value=jv,
        joint_key_mask=joint_key_mask, scale=scale, backend=backend,
    )  # fmt: skip
    del q_h, k_h, v_h, jq, jk, jv
    out_plan = out_plans(
        geo, image_rows=geo.world * geo.local, text_len=text, final_front=front, joined_sources=False,
        config=serial,
    )[0]  # fmt: skip
    sources = [out] if joint_out is None else [out, joint_out]
    return finish_out([out_plan], [start_out(out_plan, sources, None, front)], sources)


def ulysses_attention(
    query: Tensor, key: Tensor, value: Tensor, *, group: dist.ProcessGroup | None, **kwargs
) -> tuple[Tensor, Tensor | None]:
    """:func:`usp_attention` with Ulysses only (``ring_group=None``); same arguments otherwise."""
    return usp_attention(query, key, value, ulysses_group=group, ring_group=None, **kwargs)
