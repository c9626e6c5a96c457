"""Weights sharded over ranks with FSDP2 (``shard_weights=True``): a pipeline's transformers and encoders.

Patches a ``DiffusionPipeline`` or a DiT transformer: every block a model declares becomes an FSDP2 unit, and
``patch.remove()`` restores the original parameters exactly (:mod:`.sharding`); quantized weights whose storage
splits by rows are sharded as quantized rows outside FSDP2, the others refused by name (:mod:`.quantized`); which
units, over which ranks, and the byte counters are pure (:mod:`.units`). Exports the family (:class:`WeightSharding`), its options, the
unit choice and the byte counters the tests and benchmarks use.
"""

from .sharding import SHARD_OPTIONS, WeightSharding, sharded_models
from .units import GatheredPeak, gathered_parameter_bytes, parameter_bytes, shard_axes, shard_units

__all__ = [
    "SHARD_OPTIONS",
    "GatheredPeak",
    "WeightSharding",
    "gathered_parameter_bytes",
    "parameter_bytes",
    "shard_axes",
    "shard_units",
    "sharded_models",
]
