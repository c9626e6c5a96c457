"""PipeFusion (xDiT) for DiT transformers: the blocks split over ranks, the tokens pipelined as patches.

Patches ``WanTransformer3DModel`` (:mod:`.wan`) and ``FluxTransformer2DModel`` (:mod:`.flux`) on the machinery
they share: the stages and the design notes (:mod:`.stages`), the K/V streams and the attention (:mod:`.state`),
the geometry, pure (:mod:`.layout`). Exports the Wan family, the shared state and processor base, the options and
their check.
"""

from .stages import PIPEFUSION_OPTIONS, check_pipefusion_options
from .state import PipeFusionAttnProcessor, PipeFusionState, parameter_bytes
from .wan import PipeFusionWanAttnProcessor, WanPipeFusion

__all__ = [
    "PIPEFUSION_OPTIONS",
    "PipeFusionState",
    "PipeFusionAttnProcessor",
    "PipeFusionWanAttnProcessor",
    "WanPipeFusion",
    "check_pipefusion_options",
    "parameter_bytes",
]
