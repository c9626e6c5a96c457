"""Pure geometry of a height-split VAE: shard rows, per-conv halos, analytic halo bytes. No HF imports.

A VAE maps ``latent rows x f`` pixel rows (``f`` = total spatial factor, 8 for Wan 2.1). hfpatch splits the
*latent* rows over the ranks and scales them by each feature map's factor, so every stride-2 downsample,
``patchify``, ``AvgDown3D`` or ``DupUp3D`` boundary falls on a shard boundary and no op sees a partial window.

A conv with kernel ``k``, stride ``s`` and top padding ``p`` needs, to produce the output rows of an aligned
shard, ``p`` rows from the previous rank and ``k - s - p`` rows from the next one (the halo). At the global
borders the rows come from the conv's own zero padding instead.

>>> split_rows(10, 4)
[3, 3, 2, 2]
>>> conv_halo(kernel=3, stride=1, pad_top=1)   # 3x3 conv, padding 1
(1, 1)
>>> conv_halo(kernel=3, stride=2, pad_top=0)   # ZeroPad2d((0, 1, 0, 1)) + stride-2 conv: one-sided
(0, 1)
>>> halo_bytes(rank=1, world=3, before=1, after=1, row_numel=16 * 64, itemsize=4)  # interior: both sides
8192
"""

from __future__ import annotations

from ...distributed.collectives import even_sizes

__all__ = ["conv_halo", "halo_bytes", "row_offsets", "scaled_sizes", "split_rows"]


def split_rows(total: int, world: int, min_rows: int = 1) -> list[int]:
    """Split ``total`` latent rows over ``world`` ranks, sizes differing by at most one, larger first.

    Args:
        total: Latent rows (the coarsest feature map of the VAE).
        world: Number of ranks.
        min_rows: Fewest latent rows a rank may hold (the largest halo at latent resolution).

    Raises:
        ValueError: If ``total < world * min_rows``.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if total < world * min_rows:
        raise ValueError(
            f"a latent height of {total} rows cannot be split over {world} ranks with at least {min_rows} "
            f"row(s) each; use at most {max(total // max(min_rows, 1), 1)} ranks for the VAE or a larger image"
        )
    return even_sizes(total, world)


def row_offsets(sizes: list[int]) -> list[int]:
    """Start row of each shard: ``[0, s0, s0 + s1, ...]`` (length ``len(sizes) + 1``)."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def scaled_sizes(latent_rows: list[int], local_rows: int, rank: int) -> list[int]:
    """Every rank's rows of a feature map whose local height on ``rank`` is ``local_rows``.

    Every feature map holds ``latent_rows[r] * f`` rows on rank ``r`` for one integer factor ``f``.

    Raises:
        ValueError: If ``local_rows`` is not a multiple of this rank's latent rows (a misaligned map).
    """
    mine = latent_rows[rank]
    if mine <= 0 or local_rows % mine:
        raise ValueError(
            f"feature map with {local_rows} local rows is not aligned to this rank's {mine} latent rows"
        )
    factor = local_rows // mine
    return [rows * factor for rows in latent_rows]


def conv_halo(kernel: int, stride: int, pad_top: int) -> tuple[int, int]:
    """Rows ``(before, after)`` an aligned shard needs from its neighbours for one conv along height.

    ``before`` comes from the previous rank (the conv's top padding), ``after`` from the next rank
    (``kernel - stride - pad_top``, never negative). Shard sizes must be multiples of ``stride``.
    """
    if kernel < 1 or stride < 1 or pad_top < 0:
        raise ValueError(f"invalid conv geometry kernel={kernel}, stride={stride}, pad_top={pad_top}")
    return pad_top, max(kernel - stride - pad_top, 0)


def halo_bytes(rank: int, world: int, before: int, after: int, row_numel: int, itemsize: int) -> int:
    """Bytes ``rank`` sends for one halo exchange: its last ``before`` rows to the next rank and its first
    ``after`` rows to the previous one (none across the global borders).

    Args:
        row_numel: Elements in one row of the exchanged tensor (``B x C x T x W`` for a video map).
        itemsize: Bytes per element.
    """
    rows = (before if rank < world - 1 else 0) + (after if rank > 0 else 0)
    return rows * row_numel * itemsize
