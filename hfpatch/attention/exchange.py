"""The Ulysses exchange with the fewest copies, overlapped with computation, optionally in FP8.

Ulysses reshards ``[B, S_local, H, D]`` (this rank's tokens, all heads) into ``[B, S, H_r, D]`` (the group's
tokens, this rank's heads) and back. Heads sit inside each token's row, so one side of every exchange is
strided: the rows this rank sends to rank ``j`` (its heads ``H_j`` of every local token) are not contiguous in
``q``, and what it receives from rank ``i`` for the output lands strided among the heads of the final
``[B, S_local, H, D]``. Moving every element once across that stride is the least any exchange can do; this
module does exactly that, and nothing more:

* **q, k, v** (sequence -> heads): each element is copied once, into a send buffer (the heads of rank ``j``,
  ``[B, S_local, H_j, D]`` contiguous), or, for this rank's own heads, straight into the kernel's buffer. What
  rank ``i`` sends lands, with no copy, in the rows of shard ``i`` of the buffer the attention kernel reads:
  ``[B, T + S, H_r, D]`` in ``[B, S, H, D]`` memory, the replicated text tokens (``T``) in front or at the back
  where the stock model has them, so the kernel sees the stock call for its heads with no concatenation. With a
  batch of ``B > 1`` each sample's rows are their own message (a sample's rows are contiguous, a shard's rows of
  several samples are not).
* **the output** (heads -> sequence): the kernel's output rows of shard ``i`` are sent as they are (contiguous
  views); what arrives is copied once into its heads of the final ``[B, T + S_local, H, D]``, text heads
  (all-gathered) included, so the caller gets the joined output with no concatenation either.
* **padding** (tokens padded to a multiple of the ranks, :mod:`hfpatch.attention.layout`) is never sent: each
  shard sends its real rows; the receiver of a padded shard writes zeros there (or, at a ring degree of 1, has
  no rows for them at all: the kernel reads the real tokens only).

Analytic minimum of the bytes copied per attention call (``e`` bytes per element, ``n_r`` real tokens of this
rank's shard, ``T`` text tokens): ``e * B * D * (4 n_r H + 3 T H_r + T H)``: one copy of q, k, v and the output,
the text heads of q, k, v into the kernel's buffers and the text output heads into the joined output
(:func:`copy_minimum`; ``benchmarks/ulysses_exchange.py`` measures it with :func:`hfpatch.testing.memory.count_copies`).
Bytes sent are unchanged: ``(u - 1) / u`` of each local tensor (the analytic minimum of an all-to-all).

Transport: point-to-point sends and receives in one batch (:func:`hfpatch.distributed.collectives.start_p2p`;
NCCL groups them into one launch, as its ``all_to_all_single`` does internally), because only messages of their
own let the receives land in the kernel's layout and the own piece skip the wire. Each exchange has two halves,
*start* (pack, post the messages) and *finish* (wait, place the text heads or unpack), so a caller can compute
between them:

* :func:`start_sequence_to_heads` returns a :class:`PendingExchange` whose ``wait()`` gives the resharded
  tensor: the exchange of ``q`` runs while ``k`` is projected (:class:`ExchangeConfig` ``overlap``);
* with ``overlap`` :func:`hfpatch.attention.usp.usp_attention` pipelines its heads in ``chunks``: the exchange
  of chunk ``c + 1`` and the output exchange of chunk ``c - 1`` run while chunk ``c`` attends;
* :func:`project_heads_to_sequence` returns the output exchange already multiplied by an output projection,
  chunk by chunk over the heads: each chunk's product is computed while the next chunk travels, and the
  received rows are multiplied where they arrived (no unpacking copy).

On NCCL the messages run on the communication stream and ``wait()`` makes the compute stream wait for them;
on gloo they run on gloo's threads while Python computes. Overlapped results equal the blocking ones (the same
elements computed by the same kernels per head; :func:`project_heads_to_sequence` sums the projection over
head chunks, a reassociation).

**FP8** (:class:`ExchangeConfig` ``dtype=torch.float8_e4m3fn``, opt-in): q, k, v and the output travel as
e4m3 bytes with a float32 scale per sample and head (``scale="head"``) or per sample (``scale="tensor"``) of
each message, ``amax / 448``; keys may stay in their dtype (``exact_keys``). Half the bytes of bf16 (plus the
scales: ``4 B H_j`` bytes per message); this rank's own heads never travel and stay exact. The text output
heads are gathered in FP8 too and every rank, their owner included, uses the same dequantised values, so the
replicated text stream stays identical on every rank. The error is an input perturbation of about ``2^-4``
relative per element (3 mantissa bits): measured figures in ``docs/capabilities/dit-sequence-parallel.md``.
Refused under training (autograd recording with inputs that require grad) unless ``training=True``; then the
backward exchanges the gradients exactly (straight-through: the rounding's derivative taken as 1).

>>> import torch
>>> from hfpatch.attention.exchange import ExchangeConfig, copy_minimum
>>> ExchangeConfig.parse("fp8")
ExchangeConfig(overlap=False, chunks=2, dtype=torch.float8_e4m3fn, scale='head', exact_keys=False, training=False)
>>> copy_minimum(batch=1, local=4, heads=4, local_heads=2, dim=8, text=0, element_size=4)  # 4 x one local q
2048
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed.collectives import start_p2p
from .exchange_messages import (
    FP8,
    _chunks,
    _Geometry,
    _geometry,
    _In,
    _InPlan,
    _Out,
    _OutPlan,
    _PendingIn,
    _PendingOut,
    _start_in,
    _start_out,
    _width,
)
from .layout import group_rank, group_size

__all__ = [
    "ExchangeConfig",
    "PendingExchange",
    "copy_minimum",
    "project_heads_to_sequence",
    "start_sequence_to_heads",
]

Tensor = torch.Tensor
_SCALES = ("head", "tensor")


# ----------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class ExchangeConfig:
    """How the Ulysses exchange runs. The default (``ExchangeConfig()`` or ``None``) is exact and blocking.

    Args:
        overlap: Pipeline the exchange with the attention: the heads in ``chunks`` parts, each part's exchange
            running while the previous part attends (same results, bit for bit on the kernels tested).
        chunks: Head chunks when overlapping (at least 2).
        dtype: Wire dtype of q, k, v and the output: ``None`` (their own, exact) or ``torch.float8_e4m3fn``.
        scale: FP8 scales per sample and head of each message (``"head"``) or per sample (``"tensor"``).
        exact_keys: With FP8, send the keys in their own dtype (the scores are most sensitive to them).
        training: Allow the FP8 exchange while autograd records with inputs that require grad (asked for by
            name: the forward is perturbed, the backward exchanges exact gradients).

    >>> ExchangeConfig(overlap=True, chunks=4).lossy
    False
    """

    overlap: bool = False
    chunks: int = 2
    dtype: torch.dtype | None = None
    scale: str = "head"
    exact_keys: bool = False
    training: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.overlap, bool) or not isinstance(self.training, bool):
            raise ValueError(
                f"ExchangeConfig: overlap and training must be bools, got {self.overlap!r}, {self.training!r}"
            )
        if not isinstance(self.exact_keys, bool):
            raise ValueError(f"ExchangeConfig: exact_keys must be a bool, got {self.exact_keys!r}")
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 2:
            raise ValueError(f"ExchangeConfig: chunks must be an int >= 2, got {self.chunks!r}")
        if self.dtype not in (None, FP8):
            raise ValueError(
                f"ExchangeConfig: dtype must be None (exact) or torch.float8_e4m3fn, got {self.dtype!r}"
            )
        if self.scale not in _SCALES:
            raise ValueError(f"ExchangeConfig: scale must be one of {_SCALES}, got {self.scale!r}")

    @property
    def lossy(self) -> bool:
        """Whether values are rounded on the wire (FP8)."""
        return self.dtype is not None

    @classmethod
    def parse(cls, value: ExchangeConfig | str | None) -> ExchangeConfig | None:
        """``None``, an :class:`ExchangeConfig`, or a name: ``"exact"``, ``"overlap"``, ``"fp8"``, ``"fp8+overlap"``.

        Raises:
            ValueError: Anything else.
        """
        if value is None or isinstance(value, cls):
            return value
        names = {
            "exact": None,
            "overlap": cls(overlap=True),
            "fp8": cls(dtype=FP8),
            "fp8+overlap": cls(overlap=True, dtype=FP8),
        }
        if isinstance(value, str) and value in names:
            return names[value]
        raise ValueError(
            f"exchange must be None, an hfpatch.attention.exchange.ExchangeConfig or one of {sorted(names)}, "
            f"got {value!r}"
        )

    def check(self, tensors: Sequence[Tensor | None], where: str) -> None:
        """Refuse the FP8 exchange under training unless ``training=True``.

        Depends only on this rank's inputs, which every rank has alike: all ranks raise before any collective.
        """
        if not self.lossy:
            return
        present = [t for t in tensors if t is not None]
        if not self.training and torch.is_grad_enabled() and any(t.requires_grad for t in present):
            raise ValueError(
                f"{where}: the FP8 exchange rounds q, k, v and the output (about 2^-4 relative per element); it is "
                "refused while autograd records inputs that require grad. Run inference under torch.no_grad(), or "
                "ask for it by name: ExchangeConfig(dtype=torch.float8_e4m3fn, training=True)"
            )


def copy_minimum(
    batch: int, local: int, heads: int, local_heads: int, dim: int, text: int, element_size: int
) -> int:
    """Analytic minimum of the bytes one attention call copies: one copy of q, k, v and the output (``local``
    real tokens of this rank, all ``heads``), the ``text`` tokens' heads of q, k, v into the kernel's buffers
    (``local_heads``) and the text output heads into the joined output (module docstring)."""
    return element_size * batch * dim * (4 * local * heads + 3 * text * local_heads + text * heads)


# ----------------------------------------------------------------------------------------------- plans
def _wires(config: ExchangeConfig | None, n: int, keys: int | None) -> tuple[torch.dtype | None, ...]:
    if config is None or not config.lossy:
        return (None,) * n
    return tuple(None if (config.exact_keys and i == keys) else config.dtype for i in range(n))


def in_plans(
    geo: _Geometry,
    n: int,
    *,
    text_len: int = 0,
    front: bool = True,
    trim: bool = False,
    config: ExchangeConfig | None = None,
    keys: int | None = None,
) -> list[_InPlan]:
    """The sequence -> heads plans of ``n`` tensors, one per chunk of heads (one chunk without ``overlap``).

    ``trim``: the kernel's buffers hold the real tokens only, ``text_len`` text rows in front (``front``) or
    behind them; otherwise every shard's rows (padding zeroed) and no text. ``keys``: which tensor is the key
    (kept exact under ``exact_keys``).
    """
    blocks = geo.total if trim else geo.world * geo.local
    rows, image, text = text_len + blocks, (text_len if front else 0), (0 if front else blocks)
    chunks = _chunks(geo, config.chunks) if config is not None and config.overlap else _chunks(geo, 1)
    scale = "head" if config is None else config.scale
    return [
        _InPlan(
            geo,
            tuple(c),
            rows,
            image,
            text if text_len else None,
            text_len,
            trim,
            _wires(config, n, keys),
            scale,
        )
        for c in chunks
    ]


def out_plans(
    geo: _Geometry,
    *,
    image_rows: int,
    text_len: int = 0,
    kernel_front: bool = True,
    final_front: bool = True,
    joined_sources: bool = True,
    config: ExchangeConfig | None = None,
) -> list[_OutPlan]:
    """The heads -> sequence plans, one per chunk (as :func:`in_plans`).

    Sources: with ``joined_sources`` chunk ``c``'s kernel output holds its ``image_rows`` image rows and the text
    rows (in front if ``kernel_front``); otherwise source 0 holds the image rows and source 1 the text rows. The
    final buffer is ``[B, text_len + S_local, H, D]``, text in front if ``final_front``.
    """
    chunks = _chunks(geo, config.chunks) if config is not None and config.overlap else _chunks(geo, 1)
    wire = None if config is None else config.dtype
    scale = "head" if config is None else config.scale
    plans = []
    for c, heads in enumerate(chunks):
        if joined_sources:
            image_source, text_source = c, (c if text_len else None)
            image, text = (text_len, 0) if kernel_front else (0, image_rows)
        else:
            image_source, text_source, image, text = 0, (1 if text_len else None), 0, 0
        final_image, final_text = (text_len, 0) if final_front else (0, geo.local)
        plans.append(
            _OutPlan(
                geo,
                tuple(heads),
                image_source,
                image,
                text_source,
                text,
                text_len,
                final_image,
                final_text,
                wire,
                scale,
            )  # fmt: skip
        )
    return plans


def final_buffer(geo: _Geometry, like: Tensor, text_len: int, front: bool) -> Tensor:
    """The joined output ``[B, text_len + S_local, H, D]``; this shard's padding rows zeroed."""
    final = like.new_empty(geo.batch, text_len + geo.local, geo.heads, geo.dim)
    pad = geo.local - geo.real[geo.me]
    if pad:
        start = (text_len if front else 0) + geo.real[geo.me]
        final[:, start : start + pad].zero_()
    return final


def geometry(x: Tensor, group, heads: int, valid_len: int | None = None, first_shard: int = 0) -> _Geometry:
    """The exchange geometry of ``x`` (``[B, S_local, H, D]``) over ``group`` (shards ``first_shard + i``)."""
    return _geometry(x.shape[0], x.shape[1], x.shape[3], group, heads, valid_len, first_shard)


def head_geometry(x: Tensor, group, heads: int, valid_len: int | None = None) -> _Geometry:
    """The exchange geometry of a head-sharded ``x`` (``[B, u * S_local, H_r, D]``) over ``group``."""
    return _geometry(x.shape[0], x.shape[1] // group_size(group), x.shape[3], group, heads, valid_len, 0)


def start_in(
    plan: _InPlan, xs: Sequence[Tensor], joints: Sequence[Tensor | None], window: int = 2
) -> _PendingIn:
    """:func:`_start_in` (pack, post, place; at most ``window`` tensors in flight)."""
    return _start_in(plan, xs, joints, window)


def finish_in(plan: _InPlan, pending: _PendingIn, xs: Sequence[Tensor], joints: Sequence[Tensor | None]):
    """The kernel's buffers of a started exchange (differentiable)."""
    return _In.apply(plan, pending, *xs, *joints)


def start_out(
    plan: _OutPlan, sources: Sequence[Tensor], final: Tensor | None, front: bool = True
) -> _PendingOut:
    """:func:`_start_out` (post, place this rank's own rows) into ``final`` (``None``: a new
    :func:`final_buffer`, text in front if ``front``; allocated only now, after the attention)."""
    if final is None:
        final = final_buffer(plan.geo, sources[plan.image_source], plan.text_len, front)
    return _start_out(plan, sources, final)


def finish_out(
    plans: Sequence[_OutPlan], pendings: Sequence[_PendingOut], sources: Sequence[Tensor]
) -> Tensor:
    """The final buffer of started output exchanges (differentiable)."""
    return _Out.apply(plans, pendings, *sources)


# ----------------------------------------------------------------------------------------------- public
class PendingExchange:
    """A started sequence -> heads exchange (:func:`start_sequence_to_heads`); :meth:`wait` returns its result."""

    def __init__(self, plan: _InPlan, pending: _PendingIn | None, x: Tensor) -> None:
        self._plan, self._pending, self._x = plan, pending, x

    def wait(self) -> Tensor:
        """``[B, u * S_local, H_r, D]`` (padding rows zero), differentiable; once only."""
        if self._pending is None:
            raise RuntimeError("PendingExchange.wait() was already called")
        pending, self._pending = self._pending, None
        x, self._x = self._x, None
        return finish_in(self._plan, pending, [x], [None])[0]


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
    and come back as zeros. ``exchange`` (:class:`ExchangeConfig`): only its ``dtype``/``scale`` apply here
    (FP8 on the wire; refused under training unless ``training=True``).

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
    plans = _chunks(geo, chunks)
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
        peers = [p for p in range(world) if p != me and geo.real[me] and _width(heads_c[p])]
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


def _start_projected(geo: _Geometry, heads: Sequence[slice], x: Tensor):
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
            if geo.real[peer] and _width(mine):
                rows = xd[:, start : start + geo.real[peer], _local(mine, geo)]
                rows = rows.contiguous()  # one copy when the chunk is not all of this rank's heads
                sends += [(rows[b], peer) for b in range(geo.batch)]
            width = _width(heads[peer])
            if geo.real[me] and width:
                buf = x.new_empty(geo.batch, geo.real[me], width, geo.dim)
                recvs += [(buf[b], peer) for b in range(geo.batch)]
                received.append(buf)
    return start_p2p(sends, recvs, geo.group, "all_to_all"), received


def _local(heads: slice, geo: _Geometry) -> slice:
    """``heads`` (global head indices of this rank's) as indices into this rank's ``H_r`` heads."""
    return slice(heads.start - geo.starts[geo.me], heads.stop - geo.starts[geo.me])


class _Projected(torch.autograd.Function):
    """Finishes :func:`_start_projected`: ``(zero link, *rows received from each other rank)``."""

    @staticmethod
    def forward(ctx, geo: _Geometry, heads: tuple[slice, ...], started, x: Tensor):
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
        peers = [p for p in range(geo.world) if p != me and geo.real[me] and _width(heads[p])]
        sends = [(g.contiguous()[b], p) for p, g in zip(peers, grads) for b in range(geo.batch)]
        recvs, unpacks = [], []
        for peer in range(geo.world):
            if peer == me or not (geo.real[peer] and _width(mine)):
                continue
            dest = dx[:, peer * geo.local : peer * geo.local + geo.real[peer], _local(mine, geo)]
            buf = torch.empty(dest.shape, dtype=dtype, device=device)
            recvs += [(buf[b], peer) for b in range(geo.batch)]
            unpacks.append((dest, buf))
        start_p2p(sends, recvs, geo.group, "all_to_all").wait()
        for dest, buf in unpacks:
            dest.copy_(buf)
        return None, None, None, dx
