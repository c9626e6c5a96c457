"""PipeFusion geometry, pure: which blocks each stage holds, which tokens each patch covers, and the bytes a
stage sends per transformer call. No torch.distributed and no Hugging Face imports.

>>> from hfpatch.patches.pipefusion.layout import patch_ranges, stage_ranges
>>> stage_ranges(5, 3)                 # uneven: the first stages take one block more
[(0, 2), (2, 4), (4, 5)]
>>> stage_ranges(5, 2, counts=(1, 4))  # explicit blocks per stage
[(0, 1), (1, 5)]
>>> patch_ranges(10, 4)
[(0, 3), (3, 6), (6, 8), (8, 10)]
>>> stage_ranges(6, 2, weights=[24, 24, 24, 10, 10, 10])  # Flux: dual-stream blocks weigh 2.4x single ones
[(0, 2), (2, 6)]
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "SequenceShardLayout",
    "balanced_stage_counts",
    "check_stage_counts",
    "patch_ranges",
    "stage_bytes_per_call",
    "stage_ranges",
]


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_stage_counts(num_blocks: int, stages: int, counts: Sequence[int] | None, where: str) -> None:
    """Raise ``ValueError`` unless ``stages`` stages can split ``num_blocks`` blocks (``counts`` per stage)."""
    if stages > num_blocks:
        raise ValueError(
            f"pipefusion={stages} stages but {where} has only {num_blocks} transformer blocks: every stage needs "
            f"at least one block; use pipefusion <= {num_blocks} (put the other ranks into cfg or data)"
        )
    if counts is None:
        return
    if (
        not isinstance(counts, (tuple, list))
        or len(counts) != stages
        or not all(_positive_int(c) for c in counts)
        or sum(counts) != num_blocks
    ):
        raise ValueError(
            f"pipefusion_blocks must be {stages} positive ints (blocks per stage) summing to the {num_blocks} "
            f"blocks of {where}, got {counts!r}"
        )


def stage_ranges(
    num_blocks: int,
    stages: int,
    counts: Sequence[int] | None = None,
    weights: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """``[(first, end), ...]`` block ranges of the ``stages`` stages, in order.

    Without ``counts``: with ``weights`` (bytes per block), :func:`balanced_stage_counts`; else blocks are
    dealt as evenly as possible, the first ``num_blocks % stages`` stages taking one more (when every block has
    the same size, as in Wan, both give this).
    """
    check_stage_counts(num_blocks, stages, counts, "the model")
    if counts is None and weights is not None:
        counts = balanced_stage_counts(weights, stages)
    if counts is None:
        base, extra = divmod(num_blocks, stages)
        counts = [base + (s < extra) for s in range(stages)]
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def balanced_stage_counts(weights: Sequence[int], stages: int) -> list[int]:
    """Blocks per stage for contiguous stages of blocks weighing ``weights`` (e.g. parameter bytes): the
    largest stage is as light as possible; among such splits, the sum of squared stage weights is smallest
    (the others are balanced too); then the earlier stages take more blocks. Exact (dynamic programming).

    >>> balanced_stage_counts([1, 1, 1, 1, 1], 3)    # equal blocks: as stage_ranges deals them
    [2, 2, 1]
    >>> balanced_stage_counts([24, 24, 24, 10, 10, 10], 3)
    [2, 1, 3]
    """
    n = len(weights)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} blocks into {stages} stages of at least one block")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + int(w))

    def weight(start: int, end: int) -> int:
        return prefix[end] - prefix[start]

    # 1. the lightest possible largest stage: best[j][i] for the first i blocks in j stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for j in range(1, stages + 1):
        for i in range(j, n + 1):
            best[j][i] = min(max(best[j - 1][k], weight(k, i)) for k in range(j - 1, i))
    limit = best[stages][n]
    # 2. under that limit: the smallest sum of squares, then the larger earlier stages (lexicographic)
    keys: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {(0, 0): (0, ())}
    for j in range(1, stages + 1):
        for i in range(j, n + 1):
            options = [
                (keys[j - 1, k][0] + weight(k, i) ** 2, (*keys[j - 1, k][1], -(i - k)))
                for k in range(j - 1, i)
                if (j - 1, k) in keys and weight(k, i) <= limit
            ]
            if options:
                keys[j, i] = min(options)
    return [-c for c in keys[stages, n][1]]


def patch_ranges(tokens: int, patches: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` token ranges of ``patches`` contiguous patches of ``tokens`` tokens.

    The first ``tokens % patches`` patches take one token more. Patches are contiguous runs of the model's
    flattened token order (Wan: frame, then row, then column), so a patch is a band of rows of one frame or
    several whole frames.

    Raises:
        ValueError: ``patches`` is not in ``1..tokens``.
    """
    if not _positive_int(patches) or patches > tokens:
        raise ValueError(
            f"pipefusion_patches={patches!r} does not fit a sequence of {tokens} tokens: use 1 <= "
            f"pipefusion_patches <= {tokens} (fewer patches, or a larger resolution / more frames)"
        )
    base, extra = divmod(tokens, patches)
    ranges, start = [], 0
    for p in range(patches):
        size = base + (p < extra)
        ranges.append((start, start + size))
        start += size
    return ranges


def stage_bytes_per_call(stage: int, stages: int, hidden_bytes: int, output_bytes: int) -> int:
    """Bytes stage ``stage`` sends in one transformer call (warm-up or pipelined alike).

    A stage before the last sends its blocks' output of every patch once to the next stage: all patches
    together are one ``[B, S, C]`` hidden-state tensor (``hidden_bytes``), whatever the number of patches.
    The last stage sends the model output (``output_bytes``) to each of the other ``stages - 1`` ranks, so
    every rank returns the full output.

    >>> stage_bytes_per_call(0, 2, hidden_bytes=1024, output_bytes=256), stage_bytes_per_call(1, 2, 1024, 256)
    (1024, 256)
    """
    if stages == 1:
        return 0
    return hidden_bytes if stage < stages - 1 else (stages - 1) * output_bytes


class SequenceShardLayout:
    """Where the tokens of PipeFusion's patches live when a stage's ranks also split them (``sp`` ranks:
    ``ring x ulysses``, ``sp index = ring_index * ulysses + ulysses_index``), as in xDiT's hybrid.

    Each patch of ``L`` tokens is padded at its end to a multiple of ``sp`` and cut into ``sp`` equal
    shards (the layout of :mod:`hfpatch.attention.layout`, per patch); shard ``index`` of every patch lives
    on this rank. Its local rows are those shards, patch after patch (``local_rows``: ``(first, end)`` of each
    patch's rows, ``local_index``: the global token of every row, padding rows repeating the patch's last
    token). After the Ulysses all-to-all a rank holds, for its heads, the ring block ``ring_index`` of every
    padded patch: ``ulysses`` consecutive shards. Its K/V buffer holds those blocks patch after patch
    (``kv_rows``); ``valid_keys[s]`` lists the real (not padding) rows of ring rank ``s``'s buffer (``None``:
    all real). ``sync_order``: the buffer rows taken from the all-to-all output of every local row at once
    (rows ordered by Ulysses source, then patch), so a synchronous call fills the same buffer.
    ``global_rows``: the rows of the ``sp`` ranks' local rows gathered (rank after rank) holding tokens
    ``0..S-1``, in order.

    >>> layout = SequenceShardLayout([(0, 3), (3, 8)], world=2, index=1, ulysses=2)
    >>> layout.shard, layout.local_rows, layout.local_index
    ([2, 3], [(0, 2), (2, 5)], [2, 2, 6, 7, 7])
    >>> layout.kv_rows, layout.valid_keys       # ulysses=2, one ring rank: both shards of each patch
    ([(0, 4), (4, 10)], [[0, 1, 2, 4, 5, 6, 7, 8]])
    >>> layout.global_rows
    [0, 1, 5, 2, 3, 4, 7, 8]
    """

    def __init__(self, patches: Sequence[tuple[int, int]], world: int, index: int, ulysses: int) -> None:
        if world % ulysses or not 0 <= index < world:
            raise ValueError(f"sp index {index} and ulysses={ulysses} do not fit {world} sp ranks")
        self.patches = list(patches)
        self.world, self.index, self.ulysses = world, index, ulysses
        self.ring = world // ulysses
        lengths = [end - start for start, end in self.patches]
        self.shard = [-(-n // world) for n in lengths]  # tokens per shard of each patch (padded)
        self.local_rows: list[tuple[int, int]] = []
        self.local_index: list[int] = []
        self.kv_rows: list[tuple[int, int]] = []
        rows = kv = 0
        for (start, end), size in zip(self.patches, self.shard):
            self.local_rows.append((rows, rows + size))
            rows += size
            first = start + index * size
            self.local_index += [min(first + i, end - 1) for i in range(size)]
            self.kv_rows.append((kv, kv + ulysses * size))
            kv += ulysses * size
        self.rows, self.kv_len = rows, kv
        self.valid_keys: list[list[int] | None] = []
        for source in range(self.ring):
            keep: list[int] = []
            for (first, _), size, n in zip(self.kv_rows, self.shard, lengths):
                block = ulysses * size
                keep += [first + i for i in range(max(0, min(block, n - source * block)))]
            self.valid_keys.append(None if len(keep) == kv else keep)
        # all-to-all output of every local row: row (u, r) for Ulysses source u and local row r
        self.sync_order = [
            u * rows + lo + i
            for (lo, _), size in zip(self.local_rows, self.shard)
            for u in range(ulysses)
            for i in range(size)
        ]
        self.global_rows = [
            (j // size) * rows + lo + j % size
            for (start, end), (lo, _), size in zip(self.patches, self.local_rows, self.shard)
            for j in range(end - start)
        ]
