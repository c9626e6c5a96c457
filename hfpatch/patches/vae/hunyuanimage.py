"""Height-split encode/decode for diffusers ``AutoencoderKLHunyuanImage`` and ``AutoencoderKLHunyuanImageRefiner``.

Applied by :func:`hfpatch.apply` when more than one rank is used; see :mod:`hfpatch.patches.vae.family` for the
mechanics. Row-coupling layers and how they are handled:

- ``AutoencoderKLHunyuanImage`` (HunyuanImage 2.1, 2D): 3x3 ``Conv2d`` (one halo row from each neighbour, zero
  rows at the global border only); ``GroupNorm`` (32 groups: statistics merged over the ranks); the
  pixel-(un)shuffle ``HunyuanImageDownsample``/``Upsample`` and the channel-averaging shortcuts are row-local
  once shards are aligned to the spatial factor; the mid-block ``HunyuanImageAttentionBlock`` attends over
  ``H x W``: keys/values gathered over the ranks, queries local.
- ``AutoencoderKLHunyuanImageRefiner`` (the HunyuanImage refiner, 3D causal): ``HunyuanImageRefinerCausalConv3d``
  pads height with *replicated* rows (``F.pad(..., mode="replicate")``): halo rows from the neighbours, the
  replicated row only at the global border (:func:`hfpatch.patches.vae.layers.causal_pad_conv3d_forward`); RMS
  norms are per position; the DCAE (un)shuffles are row-local; the mid-block attention over ``T x H x W``
  gathers keys/values, queries local.

Mid-block attention gathers the full keys/values of its one layer (memory replicated for K/V only, at the latent
resolution); the ring attention over the shards of issue 36's video work replaces it when it lands.

>>> import torch, hfpatch
>>> from hfpatch.testing.models import tiny_model
>>> vae = tiny_model("hunyuanimage_vae")
>>> with hfpatch.apply(vae) as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 4, 4)).sample.shape)
(1, 3, 8, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .family import VAEParallelFamily, check_conv2d
from .halo import conv_halo
from .layers import causal_pad_conv3d_forward, gathered_kv_attention, group_norm_forward
from .state import VAEShardState

__all__ = ["HunyuanImageRefinerVAEParallel", "HunyuanImageVAEParallel"]


def _attention_forward(block: Any, state: VAEShardState, proj: str) -> Callable:
    """``x + proj(attention(to_q(n), to_k(n), to_v(n)))`` with ``n = norm(x)``: one head over every position,
    keys/values gathered over the ranks (HunyuanImage's and its refiner's mid-block attention)."""
    original = block.forward
    out_proj = getattr(block, proj)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding:
            return original(x)
        normed = block.norm(x)
        out = gathered_kv_attention(block.to_q(normed), block.to_k(normed), block.to_v(normed), state)
        return out_proj(out) + x

    return forward


class HunyuanImageVAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKLHunyuanImage``: height split over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange; GroupNorm statistics and attention stay global). Inference only.
        vae_output: ``"full"`` (default) or ``"shard"`` (this rank's rows).
    """

    name = "hunyuanimage_vae"

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage as hy

        return (
            hy.HunyuanImageEncoder2D,
            hy.HunyuanImageDecoder2D,
            hy.HunyuanImageMidBlock,
            hy.HunyuanImageResnetBlock,
            hy.HunyuanImageAttentionBlock,
            hy.HunyuanImageDownsample,
            hy.HunyuanImageUpsample,
            torch.nn.Conv2d,
            torch.nn.GroupNorm,
            torch.nn.ModuleList,
            torch.nn.SiLU,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        if type(module) is torch.nn.Conv2d:
            check_conv2d(path, module)

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage as hy

        for module in target.modules():
            if type(module) is torch.nn.Conv2d:
                self.patch_conv2d(patch, module, state)
            elif type(module) is torch.nn.GroupNorm:
                patch.set_attr(module, "forward", group_norm_forward(module, state))
            elif type(module) is hy.HunyuanImageAttentionBlock:
                patch.set_attr(module, "forward", _attention_forward(module, state, "proj"))
        downsamples = sum(isinstance(m, hy.HunyuanImageDownsample) for m in target.encoder.modules())
        self.refuse_gradient_checkpointing(target, state)
        self.wrap_entries(patch, target, state, 2**downsamples)


class HunyuanImageRefinerVAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKLHunyuanImageRefiner``: height split over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange: each shard replicates its own edge rows; attention stays global). Inference only.
        vae_output: ``"full"`` (default) or ``"shard"`` (this rank's rows).
    """

    name = "hunyuanimage_refiner_vae"

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage_refiner as hy

        return (
            hy.HunyuanImageRefinerEncoder3D,
            hy.HunyuanImageRefinerDecoder3D,
            hy.HunyuanImageRefinerDownBlock3D,
            hy.HunyuanImageRefinerUpBlock3D,
            hy.HunyuanImageRefinerMidBlock,
            hy.HunyuanImageRefinerResnetBlock,
            hy.HunyuanImageRefinerAttnBlock,
            hy.HunyuanImageRefinerDownsampleDCAE,
            hy.HunyuanImageRefinerUpsampleDCAE,
            hy.HunyuanImageRefinerRMS_norm,
            hy.HunyuanImageRefinerCausalConv3d,
            torch.nn.Conv3d,
            torch.nn.ModuleList,
            torch.nn.SiLU,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage_refiner as hy

        if type(module) is hy.HunyuanImageRefinerCausalConv3d:
            conv, pad = module.conv, module.time_causal_padding
            if (
                module.pad_mode not in ("replicate", "constant")
                or tuple(conv.padding) != (0, 0, 0)
                or conv.dilation[1] != 1
                or pad[2] != pad[3]
            ):
                raise TypeError(
                    f"{path}: {type(module).__name__}(kernel={conv.kernel_size}, stride={conv.stride}, padding="
                    f"{conv.padding}, dilation={conv.dilation}, pad_mode={module.pad_mode!r}) is not supported by "
                    "the VAE split; it handles its own symmetric height padding, dilation 1"
                )
        elif type(module) is torch.nn.Conv3d and not path.endswith(".conv"):
            if module.kernel_size[1] != 1 or module.stride[1] != 1 or module.padding[1] != 0:
                raise TypeError(f"{path}: a Conv3d coupling rows outside a causal conv is not supported")

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage_refiner as hy

        for module in target.modules():
            if type(module) is hy.HunyuanImageRefinerCausalConv3d:
                kernel, stride = module.conv.kernel_size[1], module.conv.stride[1]
                if kernel > 1 or stride > 1:
                    state.halos[id(module)] = conv_halo(kernel, stride, module.time_causal_padding[2])
                    patch.set_attr(module, "forward", causal_pad_conv3d_forward(module, state))
            elif type(module) is hy.HunyuanImageRefinerAttnBlock:
                patch.set_attr(module, "forward", _attention_forward(module, state, "proj_out"))
        downsamples = sum(
            isinstance(m, hy.HunyuanImageRefinerDownsampleDCAE) for m in target.encoder.modules()
        )
        self.refuse_gradient_checkpointing(target, state)
        self.wrap_entries(patch, target, state, 2**downsamples)
