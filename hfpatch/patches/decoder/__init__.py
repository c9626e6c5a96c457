"""transformers decoders: sequence parallelism for text LLMs and VLMs (Qwen3, Llama, Qwen2/2.5/3-VL, Qwen3-VL-MoE,
Gemma 3/4, Mistral, Ministral, Ministral 3, Mistral 3, GLM-4.1V/4.5V/4.6V, InternVL).

Patches the decoder's attention through transformers' attention interface, its mask (evaluated on tiles of
global positions), the split and gather of its token sequence and, for a VLM, its vision tower
(:mod:`.family`, with the design notes; the split itself is :mod:`.sharding`). Which classes, where their decoders
are and what each needs is data (:mod:`.table`); the needs are installed by :mod:`.adapt`, the MoE load-balancing
loss is computed exactly by :mod:`.moe`. Exports the family (:class:`DecoderUSP`), its tables and the sharding
helpers.
"""

from .family import DecoderUSP
from .sharding import (
    DECODERS,
    ORDERS,
    ModelMask,
    decoder_of,
    frame_split,
    output_shard,
    sequence_order,
    sequence_sum,
    shard_tokens,
    vision_of,
)
from .table import REFUSED, TARGETS, support_table

__all__ = [
    "DECODERS",
    "ORDERS",
    "REFUSED",
    "TARGETS",
    "DecoderUSP",
    "ModelMask",
    "decoder_of",
    "frame_split",
    "output_shard",
    "sequence_order",
    "sequence_sum",
    "shard_tokens",
    "support_table",
    "vision_of",
]
