"""The sharding layout shared by the attention functions, the model patches and the tests."""

from __future__ import annotations

import pytest
import torch

from hfpatch.attention.layout import (
    head_sizes,
    padded_len,
    shard_len,
    shard_positions,
    shard_sequence,
    sp_index,
    unshard_sequence,
    valid_prefix,
)


@pytest.mark.parametrize("seq_len,world", [(12, 4), (10, 4), (7, 3), (5, 1), (3, 4)])
def test_shard_sequence_round_trip_pads_at_end(seq_len, world):
    x = torch.arange(2 * seq_len).view(2, seq_len, 1)
    shards = [shard_sequence(x, 1, world, p) for p in range(world)]
    assert all(s.shape[1] == shard_len(seq_len, world) for s in shards)
    assert torch.equal(unshard_sequence(shards, 1, seq_len), x)
    assert torch.equal(
        torch.cat(shards, 1)[:, seq_len:], torch.zeros(2, padded_len(seq_len, world) - seq_len, 1)
    )
    positions = torch.cat([shard_positions(seq_len, world, p) for p in range(world)])
    assert torch.equal(positions, torch.arange(padded_len(seq_len, world)))


@pytest.mark.parametrize("seq_len,world", [(10, 4), (9, 4), (12, 3)])
def test_valid_prefix_counts_each_real_token_once(seq_len, world):
    length = shard_len(seq_len, world)
    counts = [valid_prefix(p * length, length, seq_len) for p in range(world)]
    assert sum(counts) == seq_len and counts == sorted(counts, reverse=True)


def test_sp_index_ulysses_innermost_and_head_sizes_uneven():
    assert [sp_index(r, u, 3) for r in range(2) for u in range(3)] == list(range(6))
    assert (
        head_sizes(6, 4) == [2, 2, 1, 1] and head_sizes(3, 4) == [1, 1, 1, 0] and sum(head_sizes(7, 3)) == 7
    )


def test_shard_sequence_bad_index_or_length_raises():
    with pytest.raises(ValueError, match=r"shard index must be in \[0, 2\), got 2"):
        shard_sequence(torch.zeros(4), 0, 2, 2)
    with pytest.raises(ValueError, match="seq_len >= 1"):
        padded_len(0, 2)
