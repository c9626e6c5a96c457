"""PipeFusion (xDiT) for DiT transformers: the blocks split over ranks, the tokens pipelined as patches.

Patches ``WanTransformer3DModel`` (:mod:`.wan`) and ``FluxTransformer2DModel`` (:mod:`.flux`); the stage and
patch geometry is pure (:mod:`.layout`). Exports the Wan family, the shared state and processor base, the
options and their check.
"""

from .wan import (
    PIPEFUSION_OPTIONS,
    PipeFusionAttnProcessor,
    PipeFusionState,
    PipeFusionWanAttnProcessor,
    WanPipeFusion,
    check_pipefusion_options,
    parameter_bytes,
)

__all__ = [
    "PIPEFUSION_OPTIONS",
    "PipeFusionState",
    "PipeFusionAttnProcessor",
    "PipeFusionWanAttnProcessor",
    "WanPipeFusion",
    "check_pipefusion_options",
    "parameter_bytes",
]
