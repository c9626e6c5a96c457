"""Height-split encode/decode for diffusers ``AutoencoderKLMochi`` (Mochi 1).

Applied by :func:`hfpatch.apply` to an ``AutoencoderKLMochi`` (or a pipeline holding one) when more than one rank
is used; see :mod:`hfpatch.patches.vae.family` for the mechanics. Row-coupling layers:

- ``CogVideoXCausalConv3d`` in replicate mode (``F.pad`` replicate in time, rows and columns): halo rows from the
  neighbours, replicate padding at the global border only (:func:`hfpatch.patches.vae.cogvideox.causal_conv_forward`);
  the encoder's 2x2 stride-2 down-convs tile the rows exactly (row-local on aligned shards).
- ``MochiChunkedGroupNorm3D`` (a GroupNorm per frame): statistics merged over the ranks, frame chunk by chunk.
- The encoder's attention runs over the frames of each position (``B x H x W`` sequences, causal): row-local.
- ``MochiUpBlock3D`` (a linear projection, then depth-to-space), the Fourier features: row-local.

Mochi's framewise decoding (``_enable_framewise_decoding``) switches the convs to constant padding on convs built
with none: the stock decode then loses two rows per conv (and fails on small latents), so the split refuses it.
Spatial tiling composes with the split (tiles spread over the ranks, inference only).

>>> import torch, hfpatch
>>> from hfpatch.testing.models import tiny_model
>>> vae = tiny_model("mochi_vae")
>>> with hfpatch.apply(vae) as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 2, 2, 2)).sample.shape)
(1, 3, 3, 4, 4)
"""

from __future__ import annotations

from typing import Any

import torch

from .cogvideox import causal_conv_forward, check_causal_conv
from .family import VAEParallelFamily, check_no_checkpointing, encoder_unit
from .layers import coder_forward, group_norm_forward, session_forward, tiled_forward
from .state import VAEShardState

__all__ = ["MochiVAEParallel"]


def _new_tile(args: tuple, kwargs: dict) -> bool:
    """A tile starts with a call given no ``conv_cache`` (every call of the one-pass tiled decode)."""
    return kwargs.get("conv_cache", args[0] if args else None) is None


class MochiVAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKLMochi``: height split over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange; GroupNorm statistics stay global). Inference only.
        vae_output: ``"full"`` (default) or ``"shard"`` (this rank's rows).
    """

    name = "mochi_vae"

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models.attention_processor import Attention
        from diffusers.models.autoencoders import autoencoder_kl_cogvideox as cog
        from diffusers.models.autoencoders import autoencoder_kl_mochi as mochi
        from diffusers.models.normalization import LpNorm

        return (
            mochi.MochiEncoder3D,
            mochi.MochiDecoder3D,
            mochi.MochiDownBlock3D,
            mochi.MochiMidBlock3D,
            mochi.MochiUpBlock3D,
            mochi.MochiResnetBlock3D,
            mochi.MochiChunkedGroupNorm3D,
            mochi.FourierFeatures,
            cog.CogVideoXCausalConv3d,
            cog.CogVideoXSafeConv3d,
            Attention,
            LpNorm,
            torch.nn.Conv3d,
            torch.nn.GroupNorm,
            torch.nn.Linear,
            torch.nn.ModuleList,
            torch.nn.Dropout,
            torch.nn.SiLU,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        from diffusers.models.attention_processor import Attention, MochiVaeAttnProcessor2_0
        from diffusers.models.autoencoders import autoencoder_kl_cogvideox as cog

        if type(module) is cog.CogVideoXCausalConv3d:
            check_causal_conv(path, module)
        elif type(module) is torch.nn.Conv3d and (module.kernel_size[1] != 1 or module.stride[1] != 1):
            raise TypeError(f"{path}: a Conv3d outside a causal conv must be 1 x 1 along height")
        elif type(module) is Attention and type(module.processor) is not MochiVaeAttnProcessor2_0:
            # The stock processor attends over the frames of one position: row-local. Another may not be.
            raise TypeError(
                f"{path}: attention processor {type(module.processor).__name__} is not supported by the VAE split; "
                "Mochi's MochiVaeAttnProcessor2_0 (attention over frames, per position) is"
            )

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.attention_processor import Attention
        from diffusers.models.autoencoders import autoencoder_kl_cogvideox as cog

        for path, module in target.named_modules():
            if type(module) is cog.CogVideoXCausalConv3d:
                forward = causal_conv_forward(module, state)
                if forward is not None:
                    patch.set_attr(module, "forward", forward)
                state.checks.append(lambda p=path, m=module: check_causal_conv(p, m))
            elif type(module) is torch.nn.GroupNorm:
                patch.set_attr(module, "forward", group_norm_forward(module, state))
            elif type(module) is Attention:
                state.checks.append(lambda p=path, m=module: self.check_module(p, m))
        state.checks.append(lambda: check_no_checkpointing(target))
        unit = encoder_unit(
            target.encoder, lambda m: m.spatial_expansion if hasattr(m, "spatial_expansion") else 1
        )
        patch.wrap_method(target.encoder, "forward", lambda f: coder_forward(f, state, unit))
        patch.wrap_method(target.decoder, "forward", lambda f: coder_forward(f, state, 1))
        patch.wrap_method(target, "_encode", lambda f: session_forward(f, state, "encode"))
        patch.wrap_method(target, "_decode", lambda f: session_forward(f, state, "decode"))
        patch.wrap_method(target, "tiled_encode", lambda f: tiled_forward(f, state, False, _new_tile))
        patch.wrap_method(target, "tiled_decode", lambda f: tiled_forward(f, state, False, _new_tile))
