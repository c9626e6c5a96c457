"""Height-split encode/decode for diffusers ``AutoencoderKLHunyuanVideo`` (HunyuanVideo 1, Kandinsky 5, Framepack).

Applied by :func:`hfpatch.apply` to an ``AutoencoderKLHunyuanVideo`` (or a pipeline holding one) when more than one
rank is used; see :mod:`hfpatch.patches.vae.family` for the mechanics. Row-coupling layers:

- ``HunyuanVideoCausalConv3d`` (``F.pad`` replicate, then a conv with no padding): halo rows from the
  neighbours, replicate padding at the global border only (:func:`hfpatch.patches.vae.layers.conv3d_rows`);
  the stride-2 downsamples need the previous rank's last row only.
- ``GroupNorm`` (over channels x frames x rows x columns; the mid-block attention's too): statistics merged
  over the ranks.
- mid-block ``Attention`` over all ``T x H x W`` tokens with the frame-causal mask: ring attention over the
  ranks with the mask as a block rule (:mod:`hfpatch.patches.vae.attention`); the stock
  ``prepare_causal_attention_mask`` (a ``(THW)^2`` tensor) is never built.
- 2x nearest upsampling (first frame spatially only): row-local.

The framewise (``use_framewise_decoding``: overlapping frame tiles, blended) and tiled modes compose with the
split: each frame tile is a split call of its own; spatial tiles are spread over the ranks (inference only).

>>> import torch, hfpatch
>>> from hfpatch.testing.models import tiny_model
>>> vae = tiny_model("hunyuanvideo_vae")
>>> with hfpatch.apply(vae) as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 2, 2, 2)).sample.shape)
(1, 3, 5, 16, 16)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .attention import check_diffusers_attention, diffusers_attention
from .family import (
    VAEParallelFamily,
    check_no_checkpointing,
    check_padded_conv,
    encoder_unit,
    patch_padded_conv,
)
from .layers import coder_forward, group_norm_forward, session_forward, tiled_forward
from .state import VAEShardState

__all__ = ["HunyuanVideoVAEParallel"]


def _mid_block_forward(block: Any, state: VAEShardState) -> Callable:
    """``HunyuanVideoMidBlock3D.forward`` with its attention over the ranks under the frame-causal rule."""
    original = block.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not state.sharding:
            return original(hidden_states)
        hidden_states = block.resnets[0](hidden_states)
        for attn, resnet in zip(block.attentions, block.resnets[1:]):
            if attn is not None:
                _, _, frames, rows, width = hidden_states.shape
                tokens = hidden_states.permute(0, 2, 3, 4, 1).flatten(1, 3)
                tokens = diffusers_attention(
                    attn, tokens, state, frames=frames, rows=rows, width=width, causal_frames=True
                )
                hidden_states = tokens.unflatten(1, (frames, rows, width)).permute(0, 4, 1, 2, 3)
            hidden_states = resnet(hidden_states)
        return hidden_states

    return forward


def _mid_block_calls(block: Any, x: torch.Tensor) -> list[tuple[int, ...]]:
    """The attentions of one mid-block call on a ``[B, C, T, H, W]`` map (:func:`~.family.analytic_split_bytes`)."""
    b, _, t, h, w = x.shape
    return [(b, t, h, w, attn.inner_dim) for attn in block.attentions if attn is not None]


class HunyuanVideoVAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKLHunyuanVideo``: height split over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange: each shard pads itself; GroupNorm and attention stay global). Inference only.
        vae_output: ``"full"`` (default) or ``"shard"`` (this rank's rows).
    """

    name = "hunyuanvideo_vae"

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models.attention_processor import Attention
        from diffusers.models.autoencoders import autoencoder_kl_hunyuan_video as hv

        return (
            hv.HunyuanVideoEncoder3D,
            hv.HunyuanVideoDecoder3D,
            hv.HunyuanVideoDownBlock3D,
            hv.HunyuanVideoUpBlock3D,
            hv.HunyuanVideoMidBlock3D,
            hv.HunyuanVideoResnetBlockCausal3D,
            hv.HunyuanVideoDownsampleCausal3D,
            hv.HunyuanVideoUpsampleCausal3D,
            hv.HunyuanVideoCausalConv3d,
            Attention,
            torch.nn.Conv3d,
            torch.nn.GroupNorm,
            torch.nn.Linear,
            torch.nn.ModuleList,
            torch.nn.Dropout,
            torch.nn.SiLU,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        from diffusers.models.attention_processor import Attention
        from diffusers.models.autoencoders import autoencoder_kl_hunyuan_video as hv

        if type(module) is hv.HunyuanVideoCausalConv3d:
            check_padded_conv(path, module)
        elif type(module) is hv.HunyuanVideoUpsampleCausal3D and tuple(module.upsample_factor[1:]) not in (
            (1, 1),
            (2, 2),
        ):
            raise TypeError(
                f"{path}: only 1x or 2x spatial upsampling is row-local; got {module.upsample_factor}"
            )
        elif type(module) is Attention:
            check_diffusers_attention(path, module)

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.attention_processor import Attention
        from diffusers.models.autoencoders import autoencoder_kl_hunyuan_video as hv

        for path, module in target.named_modules():
            if type(module) is hv.HunyuanVideoCausalConv3d:
                patch_padded_conv(patch, module, state)
            elif type(module) is torch.nn.GroupNorm:
                patch.set_attr(module, "forward", group_norm_forward(module, state))
            elif type(module) is hv.HunyuanVideoMidBlock3D:
                patch.set_attr(module, "forward", _mid_block_forward(module, state))
                state.attentions.append((module, lambda x, m=module: _mid_block_calls(m, x)))
            elif type(module) is Attention:
                state.checks.append(lambda p=path, m=module: check_diffusers_attention(p, m))
        state.checks.append(lambda: check_no_checkpointing(target))
        unit = encoder_unit(target.encoder, stride_of=_spatial_stride)
        patch.wrap_method(target.encoder, "forward", lambda f: coder_forward(f, state, unit))
        patch.wrap_method(target.decoder, "forward", lambda f: coder_forward(f, state, 1))
        patch.wrap_method(target, "_encode", lambda f: session_forward(f, state, "encode"))
        patch.wrap_method(target, "_decode", lambda f: session_forward(f, state, "decode"))
        patch.wrap_method(target, "tiled_encode", lambda f: tiled_forward(f, state, per_call=True))
        patch.wrap_method(target, "tiled_decode", lambda f: tiled_forward(f, state, per_call=True))


def _spatial_stride(module: torch.nn.Module) -> int:
    from diffusers.models.autoencoders import autoencoder_kl_hunyuan_video as hv

    if type(module) is hv.HunyuanVideoCausalConv3d:
        return module.conv.stride[1]
    return 1
