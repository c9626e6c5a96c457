"""Height-split encode/decode for diffusers ``AutoencoderKLAllegro`` (Allegro).

Allegro's VAE encodes and decodes only through its tiles (``use_tiling`` is required: cubes of 24 frames x
320 x 320 pixels, blended). Applied by :func:`hfpatch.apply` with more than one rank, every tile's encoder/decoder
call is split by height on its own and gathered on its way out, so the stock tile loop and blend run unchanged
on every rank and the result equals one device's, gradients included. Row-coupling layers:

- ``Conv2d`` 3x3 (per frame), ``Downsample2D`` (``F.pad((0, 1, 0, 1))`` + stride-2 conv), ``Upsample2D`` (2x
  nearest + conv), the 3x3 convs of ``AllegroTemporalConvLayer``'s ``Conv3d`` (frames x 3 x 3): halo rows, zero
  padding at the global border only.
- ``GroupNorm`` (per frame in the resnets, over frames in the temporal convs): statistics merged over the ranks.
- mid-block ``Attention`` over each frame's ``H x W`` tokens: ring attention over the ranks
  (:mod:`hfpatch.patches.vae.attention`).

The output is whole on every rank (``vae_output="shard"`` is refused: the tiles are blended whole).

>>> import torch, hfpatch
>>> from hfpatch.testing.models import tiny_model
>>> vae = tiny_model("allegro_vae")
>>> with hfpatch.apply(vae) as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 2, 5, 5)).sample.shape)
(1, 4, 3, 10, 10)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...core.config import ParallelConfig
from .attention import attention_forward, check_diffusers_attention
from .family import VAEParallelFamily, check_conv2d, check_conv3d, check_no_checkpointing, encoder_unit
from .halo import conv_halo
from .layers import (
    coder_gather_forward,
    conv_inplace_forward,
    group_norm_forward,
    session_forward,
)
from .state import VAEShardState

__all__ = ["AllegroVAEParallel"]


def _downsample_forward(module: Any, state: VAEShardState) -> Callable:
    """``Downsample2D.forward`` (``F.pad((0, 1, 0, 1))``, conv) with the bottom zero row at the global border only."""
    original = module.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not state.sharding or state.approx:
            return original(hidden_states, *args, **kwargs)
        return module.conv(F.pad(hidden_states, (0, 1, 0, 0)))

    return forward


class AllegroVAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKLAllegro``: every tile split by height over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange; GroupNorm statistics and attention stay global). Inference only.
        vae_output: ``"full"`` only (each tile is gathered before the stock blend).
    """

    name = "allegro_vae"

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        super().validate(target, config, options)
        if config.vae > 1 and options["vae_output"] != "full":
            raise ValueError(
                f"vae_output={options['vae_output']!r} is not available for {type(target).__name__}: it decodes "
                "tile by tile and blends whole tiles, so every rank gets the whole output (vae_output='full')"
            )

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models.attention_processor import Attention
        from diffusers.models.autoencoders import autoencoder_kl_allegro as allegro
        from diffusers.models.downsampling import Downsample2D
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.upsampling import Upsample2D

        return (
            allegro.AllegroEncoder3D,
            allegro.AllegroDecoder3D,
            allegro.AllegroDownBlock3D,
            allegro.AllegroUpBlock3D,
            allegro.AllegroMidBlock3DConv,
            allegro.AllegroTemporalConvLayer,
            ResnetBlock2D,
            Downsample2D,
            Upsample2D,
            Attention,
            torch.nn.Conv2d,
            torch.nn.Conv3d,
            torch.nn.GroupNorm,
            torch.nn.Linear,
            torch.nn.Sequential,
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
        elif type(module) is torch.nn.Conv3d:
            check_conv3d(path, module)
            if module.padding_mode != "zeros":
                raise TypeError(f"{path}: only zero-padded Conv3d is supported by the Allegro split")
        elif type(module) is ResnetBlock2D and (module.upsample is not None or module.downsample is not None):
            raise TypeError(
                f"{path}: ResnetBlock2D with built-in up/downsampling is not supported by the split"
            )
        elif type(module) is Upsample2D and (module.use_conv_transpose or not module.interpolate):
            raise TypeError(
                f"{path}: only Upsample2D with 2x nearest interpolation is supported by the split"
            )
        elif type(module) is Downsample2D and (
            not module.use_conv or module.padding != 0 or module.norm is not None
        ):
            raise TypeError(f"{path}: only Downsample2D with a conv and padding 0 is supported by the split")
        elif type(module) is Attention:
            check_diffusers_attention(path, module)

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.attention_processor import Attention
        from diffusers.models.downsampling import Downsample2D

        handled: set[int] = set()
        for path, module in target.named_modules():
            if type(module) is Downsample2D:
                patch.set_attr(module, "forward", _downsample_forward(module, state))
                self.patch_conv2d(patch, module.conv, state, 0, 1)
                handled.add(id(module.conv))
            elif type(module) is torch.nn.Conv3d and (module.kernel_size[1] > 1 or module.stride[1] > 1):
                state.halos[id(module)] = conv_halo(
                    module.kernel_size[1], module.stride[1], module.padding[1]
                )
                state.exchanges.append((module, state.halos[id(module)], None))
                patch.set_attr(module, "forward", conv_inplace_forward(module, state))
            elif type(module) is torch.nn.GroupNorm:
                patch.set_attr(module, "forward", group_norm_forward(module, state))
            elif type(module) is Attention:
                patch.set_attr(module, "forward", attention_forward(module, state))
                state.attentions.append(
                    (module, lambda x, m=module: [(x.shape[0], 1, *x.shape[2:], m.inner_dim)])
                )
                state.checks.append(lambda p=path, m=module: check_diffusers_attention(p, m))
        for module in target.modules():
            if type(module) is torch.nn.Conv2d and id(module) not in handled:
                kernel, stride, pad = module.kernel_size[0], module.stride[0], module.padding[0]
                if kernel > 1 or stride > 1:  # zero-padded alike above and below: no padded copy of the input
                    state.halos[id(module)] = conv_halo(kernel, stride, pad)
                    state.exchanges.append((module, state.halos[id(module)], None))
                    patch.set_attr(module, "forward", conv_inplace_forward(module, state))
        state.checks.append(lambda: check_no_checkpointing(target))
        unit = encoder_unit(target.encoder, lambda m: 2 if type(m) is Downsample2D else 1)
        state.gathers += [target.encoder, target.decoder]
        patch.wrap_method(target.encoder, "forward", lambda f: coder_gather_forward(f, state, unit))
        patch.wrap_method(target.decoder, "forward", lambda f: coder_gather_forward(f, state, 1))
        patch.wrap_method(target, "_encode", lambda f: session_forward(f, state, "encode", gathered=True))
        patch.wrap_method(target, "_decode", lambda f: session_forward(f, state, "decode", gathered=True))
