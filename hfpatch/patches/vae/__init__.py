"""VAEs (diffusers): encode/decode split by height over ranks (patch parallel), one module per VAE family.

Patches ``AutoencoderKLWan`` (:mod:`.wan`), ``AutoencoderKL`` and ``AutoencoderKLFlux2`` (:mod:`.kl`),
``AutoencoderKLQwenImage`` and ``AutoencoderKLQwenImage21`` (:mod:`.qwenimage`), ``AutoencoderKLHunyuanImage``
and its refiner (:mod:`.hunyuanimage`) and ``AutoencoderDC`` (:mod:`.dc`) on the machinery they share: the
family base and the mechanics (:mod:`.family`), the per-layer forwards (:mod:`.layers`), the shard state and its
row collectives (:mod:`.state`), the row geometry, pure (:mod:`.halo`). Which classes are split and why the
others are not: :mod:`.support`. Exports the two first families and the shared family base and state.
"""

from .family import VAEParallelFamily
from .kl import KLVAEParallel
from .state import VAEShardState
from .wan import WanVAEParallel

__all__ = ["KLVAEParallel", "VAEParallelFamily", "VAEShardState", "WanVAEParallel"]
