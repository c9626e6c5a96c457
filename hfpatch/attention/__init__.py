"""Sequence-parallel attention maths (no model code): local kernels, online-softmax merge, Ulysses, Ring, USP.

Every function takes its process groups as arguments (``None`` = an axis of degree 1); there is no global
state. The sharding layout shared by these functions, the model patches and the tests is
:mod:`hfpatch.attention.layout`.
"""

from .layout import (
    head_sizes,
    padded_len,
    shard_len,
    shard_positions,
    shard_sequence,
    sp_index,
    unshard_sequence,
)
from .local import AttentionBackend, available_backends, local_attention, register_backend
from .merge import merge_attention, merge_blocks
from .ring import ring_attention
from .usp import ulysses_attention, usp_attention

__all__ = [
    "AttentionBackend",
    "available_backends",
    "head_sizes",
    "local_attention",
    "merge_attention",
    "merge_blocks",
    "padded_len",
    "register_backend",
    "ring_attention",
    "shard_len",
    "shard_positions",
    "shard_sequence",
    "sp_index",
    "ulysses_attention",
    "unshard_sequence",
    "usp_attention",
]
