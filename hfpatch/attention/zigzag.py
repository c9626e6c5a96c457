"""A balanced layout for causal Ring attention: each rank holds one early and one late chunk (the zigzag order).

With the contiguous layout of :mod:`hfpatch.attention.layout`, causal Ring attention is unbalanced: rank 0's
queries see only its own keys, the last rank's see every key, and a Ring step runs at the speed of its busiest
rank (about twice the balanced time at large N). The zigzag order (Megatron's context parallel,
ring-flash-attention) cuts the sequence, padded at its END to a multiple of ``2N``, into ``2N`` chunks and
gives rank ``p`` chunks ``p`` and ``2N - 1 - p``: every rank then owns ``2N + 1`` chunk-sized blocks of causal
work (``p + 1`` for its early chunk, ``2N - p`` for its late one).

The attention kernels do not change: they run in LAYOUT coordinates (rank ``p``'s shard is layout positions
``[p * 2c, (p + 1) * 2c)``), and :class:`ZigzagMask` answers their tile questions by mapping layout positions
back to the original ones (end padding: positions ``>= length``, never attended, never attending). Its
``segment`` (the chunk) tells :func:`hfpatch.attention.masked.masked_usp_attention` to cut tiles at chunk
edges, so a causal tile is skipped, fully computed or on the diagonal, never straddling two chunks.

>>> import torch
>>> layout = ZigzagLayout(length=7, world=2)                 # 2N = 4 chunks of 2 tokens, 1 pad at the end
>>> x = torch.arange(7)[None]
>>> [layout.shard(x, 1, p, fill=-1).tolist() for p in range(2)]
[[[0, 1, 6, -1]], [[2, 3, 4, 5]]]
>>> layout.unshard(torch.cat([layout.shard(x, 1, p) for p in range(2)], 1), 1).tolist()
[[0, 1, 2, 3, 4, 5, 6]]
>>> layout.runs(1, 4)                                        # layout [1, 5): (offset, original start, count)
[(0, 1, 1), (1, 6, 2), (3, 2, 1)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ZigzagLayout", "ZigzagMask"]


@dataclass(frozen=True)
class ZigzagLayout:
    """The zigzag order of a ``length``-token sequence over ``world`` ranks (see the module docstring)."""

    length: int
    world: int

    def __post_init__(self) -> None:
        if not (
            isinstance(self.length, int)
            and self.length >= 1
            and isinstance(self.world, int)
            and self.world >= 1
        ):
            raise ValueError(
                f"ZigzagLayout needs length >= 1 and world >= 1, got {self.length}, {self.world}"
            )

    @property
    def chunk(self) -> int:
        """Tokens per chunk: ``ceil(length / 2N)``."""
        return -(-self.length // (2 * self.world))

    @property
    def shard_len(self) -> int:
        """Tokens per rank (two chunks)."""
        return 2 * self.chunk

    @property
    def padded_len(self) -> int:
        """The layout's length: ``2N`` chunks."""
        return 2 * self.world * self.chunk

    def chunks(self, index: int) -> tuple[int, int]:
        """The original chunks shard ``index`` holds, in its order: ``(index, 2N - 1 - index)``."""
        if not 0 <= index < self.world:
            raise ValueError(f"shard index must be in [0, {self.world}), got {index}")
        return index, 2 * self.world - 1 - index

    def runs(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """Layout positions ``[start, start + count)`` as runs contiguous in the original order:
        ``(offset in the range, original start, tokens)``. Original positions ``>= length`` are padding."""
        runs, pos, end = [], start, start + count
        while pos < end:
            shard, within = divmod(pos, self.shard_len)
            half, at = divmod(within, self.chunk)
            tokens = min(self.chunk - at, end - pos)
            runs.append((pos - start, self.chunks(shard)[half] * self.chunk + at, tokens))
            pos += tokens
        return runs

    def positions(self, index: int) -> torch.Tensor:
        """Original positions held by shard ``index`` (``>= length``: padding).

        >>> ZigzagLayout(8, 2).positions(0).tolist()
        [0, 1, 6, 7]
        """
        return torch.cat([torch.arange(c * self.chunk, (c + 1) * self.chunk) for c in self.chunks(index)])

    def shard(self, x: torch.Tensor, dim: int, index: int, fill: Any = 0) -> torch.Tensor:
        """Shard ``index`` of the full sequence ``x`` (``length`` tokens along ``dim``), padding filled with
        ``fill``; a new tensor (the full one stays freeable). Differentiable."""
        dim %= x.dim()
        if x.shape[dim] != self.length:
            raise ValueError(
                f"ZigzagLayout.shard: x has {x.shape[dim]} tokens along dim {dim}, not {self.length}"
            )
        pieces = []
        for c in self.chunks(index):
            start = min(c * self.chunk, self.length)
            real = max(0, min(self.chunk, self.length - start))
            pieces.append(x.narrow(dim, start, real))
            if real < self.chunk:
                shape = list(x.shape)
                shape[dim] = self.chunk - real
                pieces.append(x.new_full(shape, fill))
        return torch.cat(pieces, dim)

    def unshard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The original order, without padding, of ``x``: every shard concatenated in rank order along ``dim``
        (``padded_len`` tokens). Differentiable."""
        dim %= x.dim()
        if x.shape[dim] != self.padded_len:
            raise ValueError(
                f"ZigzagLayout.unshard: x has {x.shape[dim]} tokens along dim {dim}, not {self.padded_len}"
            )
        order: list[torch.Tensor] = [x] * (2 * self.world)
        for p in range(self.world):
            early, late = self.chunks(p)
            order[early] = x.narrow(dim, p * self.shard_len, self.chunk)
            order[late] = x.narrow(dim, p * self.shard_len + self.chunk, self.chunk)
        return torch.cat(order, dim).narrow(dim, 0, self.length)


@dataclass(frozen=True)
class ZigzagMask:
    """A :class:`hfpatch.attention.masked.TileMask` in layout coordinates over ``inner``, a tile mask in
    original positions; padding (original positions ``>= layout.length``) neither attends nor is attended.

    >>> from hfpatch.attention.masked import CausalMask
    >>> mask = ZigzagMask(CausalMask(), ZigzagLayout(8, 2))          # chunks of 2: shards [0 1 6 7], [2 3 4 5]
    >>> mask.tile(2, 2, 0, 2), mask.tile(0, 2, 4, 2), mask.segment    # 6-7 see 0-1; 0-1 do not see 2-3
    (True, False, 2)
    """

    inner: Any
    layout: ZigzagLayout

    @property
    def segment(self) -> int:
        """Tiles never cross a multiple of this (layout positions): a chunk edge."""
        return self.layout.chunk

    def tile(self, q_start: int, q_len: int, k_start: int, k_len: int) -> bool | torch.Tensor:
        length = self.layout.length
        q_runs, k_runs = self.layout.runs(q_start, q_len), self.layout.runs(k_start, k_len)
        whole = all(s + n <= length for _, s, n in q_runs + k_runs)
        blocks = []
        for q_at, q_orig, q_n in q_runs:
            q_real = max(0, min(q_n, length - q_orig))
            for k_at, k_orig, k_n in k_runs:
                k_real = max(0, min(k_n, length - k_orig))
                part = (
                    False if q_real == 0 or k_real == 0 else self.inner.tile(q_orig, q_real, k_orig, k_real)
                )
                blocks.append((q_at, q_real, k_at, k_real, part))
        if all(p is False for *_, p in blocks):
            return False
        if whole and all(p is True for *_, p in blocks):
            return True
        tensors = [p for *_, p in blocks if isinstance(p, torch.Tensor)]
        batch = max((t.shape[0] for t in tensors), default=1)
        device = tensors[0].device if tensors else getattr(self.inner, "device", None)
        out = torch.zeros(batch, 1, q_len, k_len, dtype=torch.bool, device=device)
        for q_at, q_real, k_at, k_real, part in blocks:
            if part is not False:
                out[:, :, q_at : q_at + q_real, k_at : k_at + k_real] = part
        return out
