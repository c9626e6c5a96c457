"""VAEs (diffusers): encode/decode split by height over ranks (patch parallel), one module per VAE family.

Patches ``AutoencoderKLWan`` (:mod:`.wan`) and ``AutoencoderKL`` (:mod:`.kl`) on the machinery they share
(:mod:`.common`: the shard state, the per-layer halo exchanges, the family base; :mod:`.halo`: the row
geometry, pure). Exports the two families and the shared family base and state.
"""

from .common import VAEParallelFamily, VAEShardState
from .kl import KLVAEParallel
from .wan import WanVAEParallel

__all__ = ["KLVAEParallel", "VAEParallelFamily", "VAEShardState", "WanVAEParallel"]
