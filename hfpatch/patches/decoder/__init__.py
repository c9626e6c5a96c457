"""transformers decoders: sequence parallelism for text LLMs (Qwen3, Llama) and Qwen2/2.5/3-VL.

Patches the decoder's attention through transformers' attention interface, its mask (evaluated on tiles of
global positions), the split and gather of its token sequence and, for a VLM, its vision tower
(:mod:`.family`, with the design notes; the split itself is :mod:`.sharding`). Exports the family
(:class:`DecoderUSP`), its table and the sharding helpers.
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

__all__ = [
    "DECODERS",
    "ORDERS",
    "DecoderUSP",
    "ModelMask",
    "decoder_of",
    "frame_split",
    "output_shard",
    "sequence_order",
    "sequence_sum",
    "shard_tokens",
    "vision_of",
]
