"""Height-split encode/decode for diffusers ``AutoencoderKLLTXVideo`` (LTX-Video) and ``AutoencoderKLLTX2Video`` (LTX-2).

Applied by :func:`hfpatch.apply` to either VAE (or a pipeline holding one) when more than one rank is used; see
:mod:`hfpatch.patches.vae.family` for the mechanics. Row-coupling layers:

- ``LTXVideoCausalConv3d``/``LTX2VideoCausalConv3d`` (frames repeated in front, causal, or at both ends, then a
  conv padding rows and columns with zeros, or reflecting them: LTX-2's decoder): halo rows from the
  neighbours, the row padding at the global border only, the frames padded on the shard
  (:func:`hfpatch.patches.vae.layers.padded_conv_forward`). The stride-2 downsamples need the previous rank's
  last row only.
- Noise injection (``decoder_inject_noise``: ``torch.randn(H, W)`` inside the resnets): every rank draws the
  full plane from the same generator and keeps its rows (:mod:`hfpatch.patches.vae.noise`), so the result
  equals one device for the same RNG state; the global RNG state is checked alike on every rank with the inputs.
- ``RMSNorm``/``PerChannelRMSNorm``/``LayerNorm`` normalise each position over its channels; patchify,
  space-to-depth downsamplers and depth-to-space upsamplers move 2 x 2 (or ``p x p``) blocks of rows: row-local
  once shards are aligned to the spatial factor. Timestep conditioning is per sample.

The framewise (overlapping frame tiles, blended) and tiled modes compose with the split: each frame tile is a
split call; spatial tiles are spread over the ranks (inference only).

>>> import torch, hfpatch
>>> from hfpatch.testing.models import tiny_model
>>> vae = tiny_model("ltx_vae")
>>> with hfpatch.apply(vae) as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 8, 2, 1, 1)).sample.shape)
(1, 3, 9, 32, 32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .family import VAEParallelFamily, check_conv3d, check_no_checkpointing, encoder_unit
from .layers import coder_forward, padded_conv_forward, session_forward, tiled_forward
from .noise import noise_forward, rng_state
from .state import VAEShardState

__all__ = ["LTXVideoVAEParallel"]


def _time_pad(kernel: int, causal: bool) -> tuple[int, int]:
    """Frames the stock causal conv repeats in front and at the back (first/last frame)."""
    return (kernel - 1, 0) if causal else ((kernel - 1) // 2, (kernel - 1) // 2)


def _conv_pad(module: Any, ltx2: bool) -> Callable[..., tuple[int, int, int, int, int, int]]:
    """The ``F.pad`` tuple of one call: the frames the wrapper repeats, the rows and columns the conv pads."""
    conv = module.conv
    _, ph, pw = conv.padding
    kernel = module.kernel_size[0]
    if ltx2:

        def pad(causal: bool = True) -> tuple[int, int, int, int, int, int]:
            return (pw, pw, ph, ph, *_time_pad(kernel, causal))

        return pad
    fixed = (pw, pw, ph, ph, *_time_pad(kernel, module.is_causal))
    return lambda: fixed


class LTXVideoVAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKLLTXVideo`` and ``AutoencoderKLLTX2Video``: height split over the
    ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange: each shard pads itself). Inference only.
        vae_output: ``"full"`` (default) or ``"shard"`` (this rank's rows).
    """

    name = "ltx_vae"

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models import embeddings, normalization
        from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
        from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2

        return (
            ltx.LTXVideoEncoder3d,
            ltx.LTXVideoDecoder3d,
            ltx.LTXVideoDownBlock3D,
            ltx.LTXVideo095DownBlock3D,
            ltx.LTXVideoMidBlock3d,
            ltx.LTXVideoUpBlock3d,
            ltx.LTXVideoResnetBlock3d,
            ltx.LTXVideoDownsampler3d,
            ltx.LTXVideoUpsampler3d,
            ltx.LTXVideoCausalConv3d,
            ltx2.LTX2VideoEncoder3d,
            ltx2.LTX2VideoDecoder3d,
            ltx2.LTX2VideoDownBlock3D,
            ltx2.LTX2VideoMidBlock3d,
            ltx2.LTX2VideoUpBlock3d,
            ltx2.LTX2VideoResnetBlock3d,
            ltx2.LTX2VideoDownsampler3d,
            ltx2.LTX2VideoUpsampler3d,
            ltx2.LTX2VideoCausalConv3d,
            ltx2.PerChannelRMSNorm,
            normalization.RMSNorm,
            embeddings.PixArtAlphaCombinedTimestepSizeEmbeddings,
            embeddings.TimestepEmbedding,
            embeddings.Timesteps,
            torch.nn.Conv3d,
            torch.nn.LayerNorm,
            torch.nn.Linear,
            torch.nn.ModuleList,
            torch.nn.Dropout,
            torch.nn.SiLU,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
        from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2

        if type(module) in (ltx.LTXVideoCausalConv3d, ltx2.LTX2VideoCausalConv3d):
            check_conv3d(path, module.conv)
            if module.conv.padding[0] != 0:
                raise TypeError(f"{path}: a causal conv padding frames itself is not supported by the split")
        elif type(module) is torch.nn.Conv3d and not path.endswith(".conv"):
            if module.kernel_size[1] != 1 or module.stride[1] != 1:  # LTX-2's 1x1x1 shortcuts
                raise TypeError(f"{path}: a Conv3d outside a causal conv must be 1 x 1 along height")

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
        from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2

        noisy = False
        for module in target.modules():
            kind = type(module)
            if kind in (ltx.LTXVideoCausalConv3d, ltx2.LTX2VideoCausalConv3d):
                pad = _conv_pad(module, ltx2=kind is ltx2.LTX2VideoCausalConv3d)
                forward = padded_conv_forward(
                    module, module.conv, state, pad, module.conv.padding_mode, time_mode="replicate"
                )
                if forward is not None:
                    patch.set_attr(module, "forward", forward)
            elif kind in (ltx.LTXVideoResnetBlock3d, ltx2.LTX2VideoResnetBlock3d):
                if module.per_channel_scale1 is not None:
                    patch.set_attr(module, "forward", noise_forward(module, state))
                    noisy = True
        state.checks.append(lambda: check_no_checkpointing(target))
        unit = encoder_unit(target.encoder, _spatial_stride, patch=target.encoder.patch_size)
        patch.wrap_method(target.encoder, "forward", lambda f: coder_forward(f, state, unit))
        patch.wrap_method(target.decoder, "forward", lambda f: coder_forward(f, state, 1))
        patch.wrap_method(target, "_encode", lambda f: session_forward(f, state, "encode"))
        # A decoder that draws noise from the global RNG needs the same RNG state on every rank.
        same = (lambda: rng_state(_device(target))) if noisy else None
        patch.wrap_method(target, "_decode", lambda f: session_forward(f, state, "decode", same_state=same))
        patch.wrap_method(target, "tiled_encode", lambda f: tiled_forward(f, state, per_call=True))
        patch.wrap_method(target, "tiled_decode", lambda f: tiled_forward(f, state, per_call=True))


def _spatial_stride(module: torch.nn.Module) -> int:
    from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
    from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2

    kind = type(module)
    if kind in (ltx.LTXVideoCausalConv3d, ltx2.LTX2VideoCausalConv3d):
        return module.conv.stride[1]
    if kind in (ltx.LTXVideoDownsampler3d, ltx2.LTX2VideoDownsampler3d):
        return module.stride[1]
    return 1


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device
