"""Pure halo geometry: shard splits, per-conv halos and analytic byte counts, checked against brute force."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hfpatch.patches.vae.halo import conv_halo, halo_bytes, row_offsets, scaled_sizes, split_rows
from hfpatch.testing.tolerance import summation_tol


def test_split_rows_uneven_total_sizes_differ_by_at_most_one():
    for total in range(4, 30):
        for world in range(1, 5):
            sizes = split_rows(total, world)
            assert (
                sum(sizes) == total and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            )


def test_split_rows_too_few_rows_raises_with_advice():
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        split_rows(3, 4)
    with pytest.raises(ValueError, match="at least 2"):
        split_rows(5, 3, min_rows=2)


def test_scaled_sizes_misaligned_map_raises():
    assert scaled_sizes([3, 2], 24, 0) == [24, 16]
    with pytest.raises(ValueError, match="not aligned"):
        scaled_sizes([3, 2], 25, 0)


@pytest.mark.parametrize(
    ("kernel", "stride", "pad_top", "pad_bottom"),
    [(3, 1, 1, 1), (3, 2, 0, 1), (3, 2, 1, 1), (1, 2, 0, 0), (5, 1, 2, 2)],
)
def test_conv_halo_aligned_shards_reproduce_unsplit_conv(kernel, stride, pad_top, pad_bottom):
    """Each shard, extended by the halo rows (zero rows at the borders), convolves to its slice of the output."""
    height, sizes = 24, [stride * s for s in split_rows(24 // stride, 3, 1)]
    x = torch.randn(1, 2, height, 5, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(3, 2, kernel, 1, generator=torch.Generator().manual_seed(1))
    reference = F.conv2d(F.pad(x, (0, 0, pad_top, pad_bottom)), weight, stride=(stride, 1))
    before, after = conv_halo(kernel, stride, pad_top)
    padded = F.pad(x, (0, 0, before, after))  # zero rows beyond the borders, as the last rank pads
    offsets, pieces = row_offsets(sizes), []
    for r in range(3):
        lo, hi = offsets[r], offsets[r + 1]
        pieces.append(F.conv2d(padded[:, :, lo : hi + before + after], weight, stride=(stride, 1)))
    assert after <= max(pad_bottom, 0) or kernel - stride - pad_top <= pad_bottom
    # Each output sums 2 x kernel products; a shorter input may make the conv kernel sum them in another
    # order: bounded by the summation bound times the sum of the products' magnitudes.
    magnitudes = F.conv2d(F.pad(x.abs(), (0, 0, pad_top, pad_bottom)), weight.abs(), stride=(stride, 1))
    atol = summation_tol(2 * kernel) * magnitudes.max().item()
    torch.testing.assert_close(
        torch.cat(pieces, 2), reference[:, :, : sum(p.shape[2] for p in pieces)], rtol=0, atol=atol
    )
    assert sum(p.shape[2] for p in pieces) == reference.shape[2]


def test_halo_bytes_borders_send_one_side():
    kwargs = dict(before=1, after=2, row_numel=10, itemsize=4)
    assert [halo_bytes(r, 3, **kwargs) for r in range(3)] == [40, 120, 80]
    assert halo_bytes(0, 1, **kwargs) == 0
