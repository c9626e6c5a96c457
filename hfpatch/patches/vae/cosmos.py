"""Height-split encode/decode for diffusers ``AutoencoderKLCosmos`` (Cosmos 1 video tokenizer).

Applied by :func:`hfpatch.apply` to an ``AutoencoderKLCosmos`` (or a pipeline holding one) when more than one rank
is used; see :mod:`hfpatch.patches.vae.family` for the mechanics. Row-coupling layers:

- ``CosmosCausalConv3d`` (first frame repeated in front, rows and columns zero-padded by ``F.pad``): halo rows
  from the neighbours, the row padding at the global border only.
- ``CosmosDownsample3d`` (``F.pad((0, 1, 0, 1))``, a stride-2 conv plus a 2x2 average pool): one halo row from
  the next rank for the conv, the zero row at the global bottom only; the pool never reads that row.
- ``CosmosCausalGroupNorm`` (a GroupNorm per frame, one group): statistics merged over the ranks.
- ``CosmosCausalAttention`` with the spatial processor (each frame's ``H x W`` tokens): ring attention over the
  ranks (:mod:`hfpatch.patches.vae.attention`); with the temporal processor (the frames of each position,
  causal): row-local.
- The Haar-wavelet patchify/unpatchify (2-tap filters, stride 2, reflect padding the even rows never read) and
  the 2x upsampling: row-local on aligned shards.

>>> import torch, hfpatch
>>> from hfpatch.testing.models import tiny_model
>>> vae = tiny_model("cosmos_vae")
>>> with hfpatch.apply(vae) as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 2, 2, 2)).sample.shape)
(1, 3, 5, 8, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .attention import sharded_attention
from .family import VAEParallelFamily, check_no_checkpointing, encoder_unit
from .halo import conv_halo
from .layers import coder_forward, conv3d_rows, group_norm_forward, session_forward
from .state import VAEShardState

__all__ = ["CosmosVAEParallel"]


def _conv_forward(conv: Any, state: VAEShardState) -> Callable | None:
    """``CosmosCausalConv3d.forward`` on height shards (``None``: row-local, a 1 x 1 or frames-only conv)."""
    kernel, stride, top = conv.kernel_size[1], conv.stride[1], conv.spatial_pad[2]
    if kernel == 1 and stride == 1 and top == 0:
        return None
    state.halos[id(conv)] = conv_halo(kernel, stride, top)
    state.exchanges.append((conv, state.halos[id(conv)], None))
    original = conv.forward
    pad = (*conv.spatial_pad, conv.temporal_pad, 0)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not state.sharding:
            return original(hidden_states)
        return conv3d_rows(hidden_states, conv, state, pad, conv.pad_mode, time_mode="replicate")

    return forward


def _downsample_forward(module: Any, state: VAEShardState) -> Callable:
    """``CosmosDownsample3d.forward`` whose bottom zero row is added at the global border only."""
    original = module.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not state.sharding or state.approx or not module.spatial_downsample:
            return original(hidden_states)
        hidden_states = F.pad(hidden_states, (0, 1, 0, 0, 0, 0))
        conv_out = conv3d_rows(hidden_states, module.conv1, state, (0, 0, 0, 1, 0, 0), "constant")
        pool_out = F.avg_pool3d(hidden_states, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        hidden_states = conv_out + pool_out
        if module.temporal_downsample:
            hidden_states = torch.cat([hidden_states[:, :, :1, ...], hidden_states], dim=2)
            hidden_states = module.conv2(hidden_states) + F.avg_pool3d(
                hidden_states, kernel_size=(2, 1, 1), stride=(2, 1, 1)
            )
        return module.conv3(hidden_states)

    return forward


def _spatial_attention_forward(attn: Any, state: VAEShardState) -> Callable:
    """``CosmosCausalAttention.forward`` with the spatial processor: each frame's tokens over the ranks."""
    original = attn.forward

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if not state.sharding:
            return original(hidden_states, attention_mask)
        if attention_mask is not None:
            raise ValueError(f"{state.name}: the split spatial attention takes no mask")
        b, _, frames, rows, width = hidden_states.shape
        residual = hidden_states
        hidden_states = attn.norm(hidden_states)
        heads = attn.num_attention_heads
        q, k, v = (
            proj(hidden_states).permute(0, 2, 3, 4, 1).flatten(2, 3).flatten(0, 1).unflatten(2, (heads, -1))
            for proj in (attn.to_q, attn.to_k, attn.to_v)
        )  # [B*T, rows*W, heads, head_dim]
        out = sharded_attention(q, k, v, state, frames=1, rows=rows, width=width)
        out = out.flatten(2, 3).type_as(q).unflatten(1, (rows, width)).unflatten(0, (b, frames))
        out = attn.to_out[1](attn.to_out[0](out.permute(0, 4, 1, 2, 3)))
        return out + residual

    return forward


def _per_frame_calls(x: torch.Tensor) -> list[tuple[int, ...]]:
    """One attention per frame of a ``[B, C, T, H, W]`` map (:func:`~.family.analytic_split_bytes`)."""
    b, c, t, h, w = x.shape
    return [(b * t, 1, h, w, c)]


class CosmosVAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKLCosmos``: height split over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange; GroupNorm statistics and attention stay global). Inference only.
        vae_output: ``"full"`` (default) or ``"shard"`` (this rank's rows).
    """

    name = "cosmos_vae"

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models.autoencoders import autoencoder_kl_cosmos as cosmos

        return (
            cosmos.CosmosEncoder3d,
            cosmos.CosmosDecoder3d,
            cosmos.CosmosDownBlock3d,
            cosmos.CosmosUpBlock3d,
            cosmos.CosmosMidBlock3d,
            cosmos.CosmosResnetBlock3d,
            cosmos.CosmosDownsample3d,
            cosmos.CosmosUpsample3d,
            cosmos.CosmosConvProjection3d,
            cosmos.CosmosCausalConv3d,
            cosmos.CosmosCausalGroupNorm,
            cosmos.CosmosCausalAttention,
            cosmos.CosmosPatchEmbed3d,
            cosmos.CosmosUnpatcher3d,
            torch.nn.GroupNorm,
            torch.nn.ModuleList,
            torch.nn.Dropout,
            torch.nn.Identity,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_cosmos as cosmos

        if type(module) is cosmos.CosmosCausalConv3d:
            pad = module.spatial_pad
            if (
                module.pad_mode not in ("constant", "replicate", "reflect")
                or pad[2] != pad[3]
                or module.dilation[1] != 1
            ):
                raise TypeError(
                    f"{path}: CosmosCausalConv3d padding {pad} ({module.pad_mode!r}) is not supported"
                )
        elif type(module) is cosmos.CosmosCausalAttention and type(module.processor) not in (
            cosmos.CosmosSpatialAttentionProcessor2_0,
            cosmos.CosmosTemporalAttentionProcessor2_0,
        ):
            raise TypeError(f"{path}: attention processor {type(module.processor).__name__} is not supported")
        elif type(module) is cosmos.CosmosPatchEmbed3d and module.patch_method not in ("haar", "rearrange"):
            raise TypeError(f"{path}: patch method {module.patch_method!r} is not supported by the split")

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_cosmos as cosmos

        handled: set[int] = set()
        for module in target.modules():
            if type(module) is cosmos.CosmosDownsample3d and module.spatial_downsample:
                conv = module.conv1
                state.halos[id(conv)] = conv_halo(conv.kernel_size[1], conv.stride[1], 0)
                state.exchanges.append((conv, state.halos[id(conv)], None))
                patch.set_attr(module, "forward", _downsample_forward(module, state))
                handled.add(id(conv))
        for module in target.modules():
            if type(module) is cosmos.CosmosCausalConv3d and id(module) not in handled:
                forward = _conv_forward(module, state)
                if forward is not None:
                    patch.set_attr(module, "forward", forward)
            elif type(module) is torch.nn.GroupNorm:
                patch.set_attr(module, "forward", group_norm_forward(module, state))
            elif type(module) is cosmos.CosmosCausalAttention and isinstance(
                module.processor, cosmos.CosmosSpatialAttentionProcessor2_0
            ):
                patch.set_attr(module, "forward", _spatial_attention_forward(module, state))
                state.attentions.append((module, _per_frame_calls))
        state.checks.append(lambda: check_no_checkpointing(target))

        def stride(module: torch.nn.Module) -> int:
            spatial = type(module) is cosmos.CosmosDownsample3d and module.spatial_downsample
            return 2 if spatial else 1

        unit = encoder_unit(target.encoder, stride, patch=target.encoder.patch_embed.patch_size)
        patch.wrap_method(target.encoder, "forward", lambda f: coder_forward(f, state, unit))
        patch.wrap_method(target.decoder, "forward", lambda f: coder_forward(f, state, 1))
        patch.wrap_method(target, "_encode", lambda f: session_forward(f, state, "encode"))
        patch.wrap_method(target, "_decode", lambda f: session_forward(f, state, "decode"))
