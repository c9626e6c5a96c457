"""diffusers pipelines: CFG parallel and data parallel, by patching the pipeline's denoiser calls.

Patches any ``DiffusionPipeline``: each transformer call's batch (or its cond/uncond branch) is divided over
the ``cfg`` and ``data`` mesh axes and the outputs all-gathered. :mod:`.cfg_data` holds the design notes,
the CFG tables and the split of an unknown denoiser's call, :mod:`.calls` the replacement ``forward``,
:mod:`.family` the family. Exports the family (:class:`PipelineParallel`), its tables and the per-call split.
"""

from .cfg_data import (
    BATCHED_CFG_PIPELINES,
    DENOISER_NAMES,
    PER_SAMPLE_ARGS,
    TWO_CALL_CFG_PIPELINES,
    generic_split,
)
from .family import PipelineParallel

__all__ = [
    "BATCHED_CFG_PIPELINES",
    "DENOISER_NAMES",
    "PER_SAMPLE_ARGS",
    "PipelineParallel",
    "TWO_CALL_CFG_PIPELINES",
    "generic_split",
]
