"""Height-split encode/decode for diffusers ``AutoencoderKL`` (SD, SDXL, SD3, Flux VAEs) and
``AutoencoderKLFlux2`` (Flux.2, Ernie-Image, Bria Fibo 2, Ideogram 4: the same encoder and decoder).

Applied by :func:`hfpatch.apply` to an ``AutoencoderKL`` (or a pipeline holding one) when more than one rank
is used; see :mod:`hfpatch.patches.vae.family` for the mechanics. Row-coupling layers:

- ``Conv2d`` 3x3: one halo row from each neighbour, zero rows only at the global border.
- ``Downsample2D`` (``F.pad((0, 1, 0, 1))`` + stride-2 conv): shards start on even rows; one halo row from
  the next rank; the zero row only at the global bottom.
- ``Upsample2D`` (2x nearest): row-local.
- ``GroupNorm`` (every resnet, the attention's norm, the output norm): statistics merged over all ranks.
- mid-block ``Attention``: keys/values gathered over the ranks, queries stay local.

>>> import torch, hfpatch
>>> from hfpatch.testing import tiny_autoencoder_kl
>>> vae = tiny_autoencoder_kl()
>>> with hfpatch.apply(vae, vae_mode="precise") as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 4, 4)).sample.shape)
(1, 3, 8, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .family import VAEParallelFamily, check_conv2d
from .layers import coder_forward, gather_tokens_forward, group_norm_forward, session_forward, tiled_forward
from .state import VAEShardState

__all__ = ["Flux2VAEParallel", "KLVAEParallel"]


def _downsample_forward(module: Any, state: VAEShardState) -> Callable:
    """``Downsample2D.forward`` (conv, ``padding=0``) whose bottom zero row is added at the global border only."""
    original = module.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not state.sharding or state.approx:
            return original(hidden_states, *args, **kwargs)
        if module.norm is not None:
            hidden_states = module.norm(hidden_states.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return module.conv(F.pad(hidden_states, (0, 1, 0, 0)))

    return forward


class KLVAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKL``: height split over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange; GroupNorm statistics and attention stay global). Inference only.
        vae_output: ``"full"`` (default) or ``"shard"`` (this rank's rows).
    """

    name = "kl_vae"

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models.attention_processor import Attention
        from diffusers.models.autoencoders.vae import Decoder, Encoder
        from diffusers.models.downsampling import Downsample2D
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.unets.unet_2d_blocks import DownEncoderBlock2D, UNetMidBlock2D, UpDecoderBlock2D
        from diffusers.models.upsampling import Upsample2D

        return (
            Encoder,
            Decoder,
            DownEncoderBlock2D,
            UpDecoderBlock2D,
            UNetMidBlock2D,
            ResnetBlock2D,
            Downsample2D,
            Upsample2D,
            Attention,
            torch.nn.Conv2d,
            torch.nn.GroupNorm,
            torch.nn.Linear,
            torch.nn.ModuleList,
            torch.nn.Dropout,
            torch.nn.SiLU,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        from diffusers.models.attention_processor import Attention
        from diffusers.models.downsampling import Downsample2D
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.upsampling import Upsample2D

        if type(module) is torch.nn.Conv2d:
            check_conv2d(path, module)
        elif type(module) is ResnetBlock2D and (module.upsample is not None or module.downsample is not None):
            raise TypeError(
                f"{path}: ResnetBlock2D with built-in up/downsampling is not supported by the split"
            )
        elif type(module) is Upsample2D and (module.use_conv_transpose or not module.interpolate):
            raise TypeError(
                f"{path}: only Upsample2D with 2x nearest interpolation is supported by the split"
            )
        elif type(module) is Downsample2D and not module.use_conv:
            raise TypeError(
                f"{path}: Downsample2D without conv (average pooling) is not supported by the split"
            )
        elif type(module) is Attention:
            _check_attention(path, module)

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.attention_processor import Attention
        from diffusers.models.downsampling import Downsample2D

        handled: set[int] = set()
        for path, module in target.named_modules():
            if type(module) is Downsample2D and module.padding == 0:
                patch.set_attr(module, "forward", _downsample_forward(module, state))
                self.patch_conv2d(patch, module.conv, state, 0, 1)
                handled.add(id(module.conv))
            elif type(module) is torch.nn.GroupNorm:
                patch.set_attr(module, "forward", group_norm_forward(module, state))
            elif type(module) is Attention:
                for projection in (module.to_k, module.to_v):
                    patch.set_attr(projection, "forward", gather_tokens_forward(projection, state))
                state.checks.append(lambda p=path, m=module: _check_attention(p, m))
        for module in target.modules():
            if type(module) is torch.nn.Conv2d and id(module) not in handled:
                self.patch_conv2d(patch, module, state)

        def check_checkpointing() -> None:
            if torch.is_grad_enabled() and (
                target.encoder.gradient_checkpointing or target.decoder.gradient_checkpointing
            ):
                raise ValueError(
                    f"{type(target).__name__}: gradient checkpointing re-runs blocks outside the split; call "
                    "vae.disable_gradient_checkpointing() (the split already divides activation memory by N)"
                )

        state.checks.append(check_checkpointing)
        factor = 2 ** (len(target.config.block_out_channels) - 1)
        patch.wrap_method(target.encoder, "forward", lambda f: coder_forward(f, state, factor))
        patch.wrap_method(target.decoder, "forward", lambda f: coder_forward(f, state, 1))
        patch.wrap_method(target, "_encode", lambda f: session_forward(f, state, "encode"))
        patch.wrap_method(target, "_decode", lambda f: session_forward(f, state, "decode"))
        patch.wrap_method(target, "_tiled_encode", lambda f: tiled_forward(f, state, per_call=True))
        patch.wrap_method(target, "tiled_decode", lambda f: tiled_forward(f, state, per_call=True))


def _check_attention(path: str, attention: Any) -> None:
    """Keys/values are gathered at ``to_k``/``to_v``: only processors that call them on the local rows work."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    if type(attention.processor) not in (AttnProcessor, AttnProcessor2_0):
        raise TypeError(
            f"{path}: attention processor {type(attention.processor).__name__} is not supported by the VAE split; "
            "use AttnProcessor2_0 (vae.set_default_attn_processor()) and unfused projections"
        )
    if attention.spatial_norm is not None or attention.norm_cross:
        raise TypeError(f"{path}: spatial-norm or cross attention is not supported by the VAE split")


class Flux2VAEParallel(KLVAEParallel):
    """Patch family for ``diffusers.AutoencoderKLFlux2`` (Flux.2, Ernie-Image, Bria Fibo 2, Ideogram 4).

    The same encoder and decoder as ``AutoencoderKL`` (GroupNorm, mid-block attention), split the same way. Its
    ``bn`` (a ``BatchNorm2d`` over the patchified latents) is not called by encode or decode: the pipelines
    normalise the latents with its running statistics outside the VAE, so it is left as it is.
    """

    name = "flux2_vae"

    def audited_types(self) -> tuple[type, ...]:
        return super().audited_types() + (torch.nn.BatchNorm2d,)

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        if type(module) is torch.nn.BatchNorm2d and path != "bn":
            raise TypeError(
                f"{path}: a BatchNorm2d inside the encoder or decoder is not supported by the split"
            )
        super().check_module(path, module)
