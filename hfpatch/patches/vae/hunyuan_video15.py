"""Height-split encode/decode for diffusers ``AutoencoderKLHunyuanVideo15`` (HunyuanVideo 1.5).

Applied by :func:`hfpatch.apply` to an ``AutoencoderKLHunyuanVideo15`` (or a pipeline holding one) when more than one
rank is used; see :mod:`hfpatch.patches.vae.family` for the mechanics. Row-coupling layers:

- ``HunyuanVideo15CausalConv3d`` (``F.pad`` replicate, then a conv with no padding): halo rows from the
  neighbours, replicate padding at the global border only.
- ``HunyuanVideo15AttnBlock`` (mid-block, over all ``T x H x W`` tokens, frame-causal mask): ring attention over
  the ranks with the mask as a block rule (:mod:`hfpatch.patches.vae.attention`); the stock
  ``prepare_causal_attention_mask`` (a ``(THW)^2`` tensor, filled row by row in Python) is never built.
- ``HunyuanVideo15Upsample``/``Downsample`` (pixel shuffles of 2 x 2 rows and columns): row-local once shards are
  aligned to the spatial factor. ``HunyuanVideo15RMS_norm`` normalises each position over its channels.

No GroupNorm: the only statistics are per position. Spatial tiling composes with the split (tiles spread over
the ranks, inference only).

>>> import torch, hfpatch
>>> from hfpatch.testing.models import tiny_model
>>> vae = tiny_model("hunyuanvideo15_vae")
>>> with hfpatch.apply(vae) as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 2, 2, 2)).sample.shape)
(1, 3, 5, 8, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .attention import sharded_attention
from .family import (
    VAEParallelFamily,
    check_no_checkpointing,
    check_padded_conv,
    encoder_unit,
    patch_padded_conv,
)
from .layers import coder_forward, session_forward, tiled_forward
from .state import VAEShardState

__all__ = ["HunyuanVideo15VAEParallel"]


def _attention_forward(block: Any, state: VAEShardState) -> Callable:
    """``HunyuanVideo15AttnBlock.forward`` over the ranks (one head of all channels, frame-causal)."""
    original = block.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding:
            return original(x)
        identity = x
        x = block.norm(x)
        b, c, frames, rows, width = x.shape
        q, k, v = (
            proj(x).reshape(b, c, frames * rows * width).transpose(1, 2).unsqueeze(2)  # [B, L, 1 head, C]
            for proj in (block.to_q, block.to_k, block.to_v)
        )
        out = sharded_attention(q, k, v, state, frames=frames, rows=rows, width=width, causal_frames=True)
        out = out.squeeze(2).reshape(b, frames, rows, width, c).permute(0, 4, 1, 2, 3)
        return block.proj_out(out) + identity

    return forward


class HunyuanVideo15VAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKLHunyuanVideo15``: height split over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange; attention stays global). Inference only.
        vae_output: ``"full"`` (default) or ``"shard"`` (this rank's rows).
    """

    name = "hunyuanvideo15_vae"

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hv

        return (
            hv.HunyuanVideo15Encoder3D,
            hv.HunyuanVideo15Decoder3D,
            hv.HunyuanVideo15DownBlock3D,
            hv.HunyuanVideo15UpBlock3D,
            hv.HunyuanVideo15MidBlock,
            hv.HunyuanVideo15ResnetBlock,
            hv.HunyuanVideo15Downsample,
            hv.HunyuanVideo15Upsample,
            hv.HunyuanVideo15AttnBlock,
            hv.HunyuanVideo15RMS_norm,
            hv.HunyuanVideo15CausalConv3d,
            torch.nn.Conv3d,
            torch.nn.ModuleList,
            torch.nn.SiLU,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hv

        if type(module) is hv.HunyuanVideo15CausalConv3d:
            check_padded_conv(path, module)
        elif type(module) is torch.nn.Conv3d and not path.endswith(
            ".conv"
        ):  # shortcuts, attention projections
            if module.kernel_size[1] != 1 or module.stride[1] != 1:
                raise TypeError(f"{path}: a Conv3d outside a causal conv must be 1 x 1 along height")

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hv

        for module in target.modules():
            if type(module) is hv.HunyuanVideo15CausalConv3d:
                patch_padded_conv(patch, module, state)
            elif type(module) is hv.HunyuanVideo15AttnBlock:
                patch.set_attr(module, "forward", _attention_forward(module, state))
                state.attentions.append((module, lambda x: [(x.shape[0], *x.shape[2:], x.shape[1])]))
        state.checks.append(lambda: check_no_checkpointing(target))
        unit = encoder_unit(target.encoder, lambda m: 2 if type(m) is hv.HunyuanVideo15Downsample else 1)
        patch.wrap_method(target.encoder, "forward", lambda f: coder_forward(f, state, unit))
        patch.wrap_method(target.decoder, "forward", lambda f: coder_forward(f, state, 1))
        patch.wrap_method(target, "_encode", lambda f: session_forward(f, state, "encode"))
        patch.wrap_method(target, "_decode", lambda f: session_forward(f, state, "decode"))
        patch.wrap_method(target, "tiled_encode", lambda f: tiled_forward(f, state, per_call=True))
        patch.wrap_method(target, "tiled_decode", lambda f: tiled_forward(f, state, per_call=True))
