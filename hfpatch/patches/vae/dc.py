"""Height-split encode/decode for diffusers ``AutoencoderDC`` (Sana's deep-compression autoencoder, DC-AE).

Applied by :func:`hfpatch.apply` when more than one rank is used; see :mod:`hfpatch.patches.vae.family` for the
mechanics. Row-coupling layers and how they are handled:

- ``Conv2d`` 3x3 (``ResBlock``, ``conv_in``/``conv_out``), the depthwise 3x3 of ``GLUMBConv`` and the depthwise
  5x5 multi-scale projections of the attention: halo rows from the neighbours (two for the 5x5), zero rows at
  the global border only; the stride-2 3x3 of ``DCDownBlock2d`` (``downsample_block_type="Conv"``): shards start
  on even rows, one halo row from the previous rank.
- Pixel (un)shuffle, 2x nearest interpolation and the channel-averaging shortcuts: row-local once shards are
  aligned to the spatial factor. ``RMSNorm`` is per position; ``BatchNorm2d`` (the decoder's ``batch_norm``
  blocks) is per channel in eval mode and merges its batch statistics over the ranks in training mode
  (:func:`hfpatch.patches.vae.layers.batch_norm_forward`).
- ``SanaMultiscaleLinearAttention``, ReLU linear attention: ``out_q = (V' K^T) q / ...`` with ``V'`` the values
  padded with a row of ones. ``V' K^T`` (``(d + 1) x d`` per head) is a sum over every position: each rank
  computes it over its rows and the sums are added over the ranks
  (:func:`hfpatch.patches.vae.layers.sum_over_ranks`); queries stay local, nothing of size ``H x W`` crosses the
  wire. The stock processor picks linear attention when ``H x W > head_dim`` of the *whole* map (quadratic
  ReLU attention below that, for tiny maps): the split decides on the global size, and its quadratic branch
  gathers the (few) keys and values.

>>> import torch, hfpatch
>>> from hfpatch.testing.models import tiny_model
>>> vae = tiny_model("autoencoder_dc")
>>> with hfpatch.apply(vae) as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 4, 4)).sample.shape)
(1, 3, 8, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...distributed.collectives import all_gather
from .family import VAEParallelFamily, check_conv2d
from .layers import batch_norm_forward, sum_over_ranks
from .state import VAEShardState

__all__ = ["DCAEParallel"]


def _linear_attention_forward(attn: Any, state: VAEShardState) -> Callable:
    """``SanaMultiscaleLinearAttention.forward`` (its ``SanaMultiscaleAttnProcessor2_0``) on height shards."""
    original = attn.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not state.sharding:
            return original(hidden_states)
        batch_size, _, height, width = hidden_states.shape
        use_linear_attention = sum(state.sizes(height)) * width > attn.attention_head_dim
        residual, original_dtype = hidden_states, hidden_states.dtype

        hidden_states = hidden_states.movedim(1, -1)
        qkv = torch.cat([attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)], dim=3)
        qkv = qkv.movedim(-1, 1)
        hidden_states = torch.cat([qkv] + [block(qkv) for block in attn.to_qkv_multiscale], dim=1)
        if use_linear_attention:
            hidden_states = hidden_states.to(dtype=torch.float32)
        hidden_states = hidden_states.reshape(batch_size, -1, 3 * attn.attention_head_dim, height * width)
        query, key, value = hidden_states.chunk(3, dim=2)
        query, key = attn.nonlinearity(query), attn.nonlinearity(key)

        if use_linear_attention:
            value = F.pad(value, (0, 0, 0, 1), mode="constant", value=1)
            scores = sum_over_ranks(torch.matmul(value, key.transpose(-1, -2)), state)  # (B, h, d + 1, d)
            hidden_states = torch.matmul(scores, query).to(dtype=torch.float32)
            hidden_states = hidden_states[:, :, :-1] / (hidden_states[:, :, -1:] + attn.eps)
            hidden_states = hidden_states.to(dtype=original_dtype)
        else:  # the whole map has at most head_dim positions: gather them
            tokens = [rows * width for rows in state.sizes(height)]
            kv = all_gather(torch.cat([key, value], 2), 3, state.group, tokens, backward="reduce_scatter")
            key, value = kv.chunk(2, dim=2)
            scores = torch.matmul(key.transpose(-1, -2), query).to(dtype=torch.float32)
            scores = scores / (torch.sum(scores, dim=2, keepdim=True) + attn.eps)
            hidden_states = torch.matmul(value, scores.to(value.dtype))

        hidden_states = torch.reshape(hidden_states, (batch_size, -1, height, width))
        hidden_states = attn.to_out(hidden_states.movedim(1, -1)).movedim(-1, 1)
        if attn.norm_type == "rms_norm":
            hidden_states = attn.norm_out(hidden_states.movedim(1, -1)).movedim(-1, 1)
        else:
            hidden_states = attn.norm_out(hidden_states)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states

    return forward


def _check_attention(path: str, attn: Any) -> None:
    """The split re-implements the stock processor: a custom one is refused (checked at apply and each call)."""
    from diffusers.models.attention_processor import SanaMultiscaleAttnProcessor2_0

    if type(attn.processor) is not SanaMultiscaleAttnProcessor2_0:
        raise TypeError(
            f"{path}: attention processor {type(attn.processor).__name__} is not supported by the VAE split; "
            "use the stock SanaMultiscaleAttnProcessor2_0"
        )


class DCAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderDC``: height split over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange; attention sums and batch statistics stay global). Inference only.
        vae_output: ``"full"`` (default) or ``"shard"`` (this rank's rows).
    """

    name = "dc_ae"

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models.attention_processor import (
            SanaMultiscaleAttentionProjection,
            SanaMultiscaleLinearAttention,
        )
        from diffusers.models.autoencoders import autoencoder_dc as dc
        from diffusers.models.normalization import RMSNorm
        from diffusers.models.transformers.sana_transformer import GLUMBConv

        return (
            dc.Encoder,
            dc.Decoder,
            dc.ResBlock,
            dc.EfficientViTBlock,
            dc.DCDownBlock2d,
            dc.DCUpBlock2d,
            SanaMultiscaleLinearAttention,
            SanaMultiscaleAttentionProjection,
            GLUMBConv,
            RMSNorm,
            torch.nn.Conv2d,
            torch.nn.BatchNorm2d,
            torch.nn.Linear,
            torch.nn.ModuleList,
            torch.nn.Sequential,
            torch.nn.Identity,
            torch.nn.SiLU,
            torch.nn.ReLU,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        from diffusers.models.attention_processor import SanaMultiscaleLinearAttention
        from diffusers.models.autoencoders import autoencoder_dc as dc

        if type(module) is torch.nn.Conv2d:
            check_conv2d(path, module)
        elif type(module) is dc.DCUpBlock2d and module.interpolate and module.interpolation_mode != "nearest":
            raise TypeError(
                f"{path}: DCUpBlock2d with {module.interpolation_mode!r} interpolation is not supported by the "
                "split (only nearest 2x upsampling is row-local)"
            )
        elif type(module) is SanaMultiscaleLinearAttention:
            _check_attention(path, module)

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.attention_processor import SanaMultiscaleLinearAttention

        for path, module in target.named_modules():
            if type(module) is torch.nn.Conv2d:
                self.patch_conv2d(patch, module, state)
            elif type(module) is torch.nn.BatchNorm2d:
                patch.set_attr(module, "forward", batch_norm_forward(module, state))
            elif type(module) is SanaMultiscaleLinearAttention:
                patch.set_attr(module, "forward", _linear_attention_forward(module, state))
                state.checks.append(lambda p=path, m=module: _check_attention(p, m))
        self.wrap_entries(patch, target, state, target.spatial_compression_ratio)
