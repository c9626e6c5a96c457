"""VAEs (diffusers): encode/decode split by height over ranks (patch parallel), one module per VAE family.

Patches ``AutoencoderKLWan`` (:mod:`.wan`), ``AutoencoderKL`` and ``AutoencoderKLFlux2`` (:mod:`.kl`), the image
VAEs ``AutoencoderKLQwenImage`` and ``AutoencoderKLQwenImage21`` (:mod:`.qwenimage`), ``AutoencoderKLHunyuanImage``
and its refiner (:mod:`.hunyuanimage`) and ``AutoencoderDC`` (:mod:`.dc`), and the video VAEs: HunyuanVideo 1
(:mod:`.hunyuan_video`) and 1.5 (:mod:`.hunyuan_video15`), LTX-Video and LTX-2 (:mod:`.ltx`), CogVideoX
(:mod:`.cogvideox`), Mochi (:mod:`.mochi`), Allegro (:mod:`.allegro`) and Cosmos (:mod:`.cosmos`), on the machinery
they share: the family base and the mechanics (:mod:`.family`), the per-layer forwards (:mod:`.layers`), attention
over the rows of every rank (:mod:`.attention`), noise drawn whole and sliced (:mod:`.noise`), the shard state and
its row collectives (:mod:`.state`), the row geometry, pure (:mod:`.halo`). Which classes are split and why the
others are not: :mod:`.support`. Exports the families and the shared family base and state.
"""

from .allegro import AllegroVAEParallel
from .cogvideox import CogVideoXVAEParallel
from .cosmos import CosmosVAEParallel
from .family import VAEParallelFamily
from .hunyuan_video import HunyuanVideoVAEParallel
from .hunyuan_video15 import HunyuanVideo15VAEParallel
from .kl import KLVAEParallel
from .ltx import LTXVideoVAEParallel
from .mochi import MochiVAEParallel
from .state import VAEShardState
from .wan import WanVAEParallel

__all__ = [
    "AllegroVAEParallel",
    "CogVideoXVAEParallel",
    "CosmosVAEParallel",
    "HunyuanVideo15VAEParallel",
    "HunyuanVideoVAEParallel",
    "KLVAEParallel",
    "LTXVideoVAEParallel",
    "MochiVAEParallel",
    "VAEParallelFamily",
    "VAEShardState",
    "WanVAEParallel",
]
