"""The plans of the Ulysses exchange: per chunk of heads, which rows each message carries and where they land.

A plan is everything one exchange of one chunk of heads needs besides the tensors: the
:class:`~hfpatch.attention.exchange.geometry.Geometry`, the chunk's heads of every rank, and the rows of the
buffers at both ends. :class:`InPlan` is the sequence -> heads exchange of q, k, v
(:mod:`hfpatch.attention.exchange.to_heads` runs it), :class:`OutPlan` the heads -> sequence exchange of the
output (:mod:`hfpatch.attention.exchange.to_sequence`). Without ``overlap`` there is one chunk (every head);
with it :func:`head_chunks` cuts each rank's heads in ``chunks`` parts, so that part ``c + 1`` travels while
part ``c`` attends.

>>> from hfpatch.attention.exchange.geometry import Geometry
>>> geo = Geometry.of(batch=1, local=4, dim=8, group=None, heads=5, valid_len=None, first_shard=0)
>>> head_chunks(geo, 2)  # per chunk, per rank: its heads in the chunk
[[slice(0, 3, None)], [slice(3, 5, None)]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...distributed.collectives import even_sizes
from .config import ExchangeConfig
from .geometry import Geometry, width


def head_chunks(geo: Geometry, chunks: int) -> list[list[slice]]:
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


# ----------------------------------------------------------------------------------------------- q, k, v
@dataclass(frozen=True)
class InPlan:
    """One sequence -> heads exchange of several tensors (q, k, v) for one chunk of heads.

    The kernel's buffer of each tensor is ``[B, rows, h, D]`` (``h``: this rank's heads of the chunk): shard
    ``i``'s real rows at ``image + i * local`` (``trim``: padding rows absent, ``rows`` counts real tokens only;
    otherwise present and zero), the text rows (if joined) at ``text``.
    """

    geo: Geometry
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
        """This rank's heads in the chunk."""
        return self.heads[self.geo.me]

    @property
    def full(self) -> bool:
        """Whether the chunk covers every head."""
        return all(width(h) == n for h, n in zip(self.heads, self.geo.sizes))


def _wires(config: ExchangeConfig | None, n: int, keys: int | None) -> tuple[torch.dtype | None, ...]:
    if config is None or not config.lossy:
        return (None,) * n
    return tuple(None if (config.exact_keys and i == keys) else config.dtype for i in range(n))


def in_plans(
    geo: Geometry,
    n: int,
    *,
    text_len: int = 0,
    front: bool = True,
    trim: bool = False,
    config: ExchangeConfig | None = None,
    keys: int | None = None,
) -> list[InPlan]:
    """The sequence -> heads plans of ``n`` tensors, one per chunk of heads (one chunk without ``overlap``).

    ``trim``: the kernel's buffers hold the real tokens only, ``text_len`` text rows in front (``front``) or
    behind them; otherwise every shard's rows (padding zeroed) and no text. ``keys``: which tensor is the key
    (kept exact under ``exact_keys``).
    """
    blocks = geo.total if trim else geo.world * geo.local
    rows, image, text = text_len + blocks, (text_len if front else 0), (0 if front else blocks)
    chunks = head_chunks(geo, config.chunks) if config is not None and config.overlap else head_chunks(geo, 1)
    scale = "head" if config is None else config.scale
    return [
        InPlan(
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


# ----------------------------------------------------------------------------------------------- output
@dataclass(frozen=True)
class OutPlan:
    """One heads -> sequence exchange of one chunk of heads into the final ``[B, rows, H, D]`` buffer.

    Sources (kernel outputs, ``[B, *, h, D]``, ``h`` this rank's heads of the chunk): the image rows of shard
    ``i`` at ``image + i * local`` of source ``image_source``, the text rows at ``text`` of source
    ``text_source``. In the final buffer this rank's tokens sit at ``final_image``, the text at ``final_text``.
    """

    geo: Geometry
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
        """This rank's heads in the chunk."""
        return self.heads[self.geo.me]


def out_plans(
    geo: Geometry,
    *,
    image_rows: int,
    text_len: int = 0,
    kernel_front: bool = True,
    final_front: bool = True,
    joined_sources: bool = True,
    config: ExchangeConfig | None = None,
) -> list[OutPlan]:
    """The heads -> sequence plans, one per chunk (as :func:`in_plans`).

    Sources: with ``joined_sources`` chunk ``c``'s kernel output holds its ``image_rows`` image rows and the text
    rows (in front if ``kernel_front``); otherwise source 0 holds the image rows and source 1 the text rows. The
    final buffer is ``[B, text_len + S_local, H, D]``, text in front if ``final_front``.
    """
    chunks = head_chunks(geo, config.chunks) if config is not None and config.overlap else head_chunks(geo, 1)
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
            OutPlan(
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
