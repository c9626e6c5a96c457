"""Height-split encode/decode for diffusers ``AutoencoderKLCogVideoX`` (CogVideoX, ConsisID).

Applied by :func:`hfpatch.apply` to an ``AutoencoderKLCogVideoX`` (or a pipeline holding one) when more than one
rank is used; see :mod:`hfpatch.patches.vae.family` for the mechanics. The stock VAE encodes 8 frames and decodes
2 latent frames per call, carrying a ``conv_cache`` (the last frames of every causal conv's input) from one call
to the next; split, each rank's cache holds its own rows, and each call exchanges the halo rows of the frames it
convolves (cached ones included). Row-coupling layers:

- ``CogVideoXCausalConv3d`` (frames from the cache or the first frame repeated; rows and columns zero-padded by
  the conv; or everything replicate-padded, Mochi's form): halo rows from the neighbours, padding at the global
  border only. Its ``CogVideoXSafeConv3d`` still cuts inputs over 2 GiB into frame chunks, decided on the full
  (unsplit) size so that every rank cuts alike.
- ``CogVideoXDownsample3D`` (``F.pad((0, 1, 0, 1))`` + a stride-2 conv): one halo row from the next rank, the zero
  row at the global bottom only. ``CogVideoXUpsample3D``: 2x nearest (row-local) + a 3x3 conv (halo rows).
- ``GroupNorm`` (every resnet; inside ``CogVideoXSpatialNorm3D`` too): statistics merged over the ranks; the
  spatial norm's nearest resize of the latents to the feature map is row-local on aligned shards.

Tiled decoding composes with the split: a tile (its frame batches, with their cache) is computed on one rank,
tiles are spread over the ranks (inference only).

>>> import torch, hfpatch
>>> from hfpatch.testing.models import tiny_model
>>> vae = tiny_model("cogvideox_vae")
>>> with hfpatch.apply(vae) as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 3, 2, 2)).sample.shape)
(1, 3, 5, 4, 4)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .family import VAEParallelFamily, check_conv2d, check_no_checkpointing, encoder_unit
from .halo import conv_halo
from .layers import coder_forward, conv3d_rows, group_norm_forward, session_forward, tiled_forward
from .state import VAEShardState

__all__ = ["CogVideoXVAEParallel", "causal_conv_forward", "check_causal_conv"]

#: ``CogVideoXSafeConv3d`` cuts its input into frame chunks above this many GiB (at 2 bytes per element).
_SAFE_GIB = 2


def _safe_conv(conv: Any, x: torch.Tensor, state: VAEShardState, pad: tuple, mode: str) -> torch.Tensor:
    """``CogVideoXSafeConv3d``'s frame chunking around :func:`conv3d_rows`, decided on the unsplit size."""
    rows = sum(state.sizes(x.shape[-2]))
    gib = x.numel() // x.shape[-2] * rows * 2 / 1024**3
    if gib <= _SAFE_GIB:
        return conv3d_rows(x, conv, state, pad, mode)
    kernel = conv.kernel_size[0]
    chunks = list(torch.chunk(x, int(gib / _SAFE_GIB) + 1, dim=2))
    if kernel > 1:
        chunks = [chunks[0]] + [
            torch.cat((chunks[i - 1][:, :, -kernel + 1 :], chunks[i]), dim=2) for i in range(1, len(chunks))
        ]
    return torch.cat([conv3d_rows(c, conv, state, pad, mode) for c in chunks], dim=2)


def causal_conv_forward(module: Any, state: VAEShardState) -> Callable | None:
    """``CogVideoXCausalConv3d.forward`` on height shards, either padding mode (read at call time: Mochi switches
    it), the ``conv_cache`` holding this rank's rows. ``None`` for a row-local conv (one row, stride 1, or a
    kernel that tiles the rows exactly: Mochi's stride-2 2x2 down-convs)."""
    conv = module.conv
    kernel, stride = conv.kernel_size[1], conv.stride[1]
    halo = conv_halo(kernel, stride, module.height_pad)
    if halo == (0, 0):
        return None
    state.halos[id(conv)] = halo
    # Exchanged: the layer's input (replicate mode), or the conv's, after the cached frames (constant mode).
    state.exchanges.append((module, halo, lambda: module.pad_mode == "replicate"))
    state.exchanges.append((conv, halo, lambda: module.pad_mode != "replicate"))
    original = module.forward

    def forward(inputs: torch.Tensor, conv_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        if not state.sharding:
            return original(inputs, conv_cache)
        if module.pad_mode == "replicate":
            return _safe_conv(conv, inputs, state, tuple(module.time_causal_padding), "replicate"), None
        inputs = module.fake_context_parallel_forward(inputs, conv_cache)  # frames only: row-local
        cache = inputs[:, :, -module.time_kernel_size + 1 :].clone()
        _, hp, wp = conv.padding  # the conv pads rows and columns itself in this mode
        return _safe_conv(conv, inputs, state, (wp, wp, hp, hp, 0, 0), "constant"), cache

    return forward


def check_causal_conv(path: str, module: Any) -> None:
    """The padding a ``CogVideoXCausalConv3d`` applies must be the one its conv was built for: a conv built for
    replicate padding (``padding=0``) and switched to ``pad_mode="constant"`` (Mochi's framewise decoding) pads no
    rows at all, and the stock decode shrinks every frame by two rows per conv (it fails on small latents)."""
    conv = module.conv
    expected = (0, 0, 0) if module.pad_mode == "replicate" else (0, module.height_pad, module.width_pad)
    if tuple(conv.padding) != expected or conv.dilation[1] != 1 or conv.padding_mode != "zeros":
        raise TypeError(
            f"{path}: CogVideoXCausalConv3d with pad_mode={module.pad_mode!r} over a conv padded {conv.padding} is "
            "not supported by the VAE split (the stock layer pads no rows this way: Mochi's framewise decoding "
            "switches replicate-built convs to constant padding); decode in one pass (the default)"
        )


def _downsample_forward(module: Any, state: VAEShardState) -> Callable:
    """``CogVideoXDownsample3D.forward`` whose bottom zero row is added at the global border only."""
    original = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding or state.approx:
            return original(x)
        if module.compress_time:  # frames only: the stock code on the shard, without its padding
            b, c, t, h, w = x.shape
            x = x.permute(0, 3, 4, 1, 2).reshape(b * h * w, c, t)
            if x.shape[-1] % 2 == 1:
                first, rest = x[..., 0], x[..., 1:]
                if rest.shape[-1] > 0:
                    rest = F.avg_pool1d(rest, kernel_size=2, stride=2)
                x = torch.cat([first[..., None], rest], dim=-1)
            else:
                x = F.avg_pool1d(x, kernel_size=2, stride=2)
            x = x.reshape(b, h, w, c, x.shape[-1]).permute(0, 3, 4, 1, 2)
        x = F.pad(x, (0, 1, 0, 0))
        b, c, t, h, w = x.shape
        x = module.conv(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        return x.reshape(b, t, *x.shape[1:]).permute(0, 2, 1, 3, 4)

    return forward


def _new_tile(args: tuple, kwargs: dict) -> bool:
    """A tile starts with the call given no ``conv_cache`` (the stock tiled loop's first frame batch)."""
    cache = kwargs.get("conv_cache", args[1] if len(args) > 1 else None)
    return cache is None


class CogVideoXVAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKLCogVideoX``: height split over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange; GroupNorm statistics stay global). Inference only.
        vae_output: ``"full"`` (default) or ``"shard"`` (this rank's rows).
    """

    name = "cogvideox_vae"

    def audited_types(self) -> tuple[type, ...]:
        from diffusers.models.autoencoders import autoencoder_kl_cogvideox as cog
        from diffusers.models.downsampling import CogVideoXDownsample3D
        from diffusers.models.upsampling import CogVideoXUpsample3D

        return (
            cog.CogVideoXEncoder3D,
            cog.CogVideoXDecoder3D,
            cog.CogVideoXDownBlock3D,
            cog.CogVideoXUpBlock3D,
            cog.CogVideoXMidBlock3D,
            cog.CogVideoXResnetBlock3D,
            cog.CogVideoXSpatialNorm3D,
            cog.CogVideoXCausalConv3d,
            cog.CogVideoXSafeConv3d,
            CogVideoXDownsample3D,
            CogVideoXUpsample3D,
            torch.nn.Conv2d,
            torch.nn.GroupNorm,
            torch.nn.Linear,
            torch.nn.ModuleList,
            torch.nn.Dropout,
            torch.nn.SiLU,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_cogvideox as cog
        from diffusers.models.downsampling import CogVideoXDownsample3D

        if type(module) is torch.nn.Conv2d:
            check_conv2d(path, module)
        elif type(module) is cog.CogVideoXCausalConv3d:
            check_causal_conv(path, module)
        elif type(module) is cog.CogVideoXSafeConv3d and not path.endswith(".conv"):
            if module.kernel_size[1] != 1 or module.stride[1] != 1:  # shortcuts, quant convs
                raise TypeError(
                    f"{path}: a CogVideoXSafeConv3d outside a causal conv must be 1 x 1 along height"
                )
        elif type(module) is CogVideoXDownsample3D and module.conv.padding[0] != 0:
            raise TypeError(f"{path}: CogVideoXDownsample3D with a padded conv is not supported by the split")

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        from diffusers.models.autoencoders import autoencoder_kl_cogvideox as cog
        from diffusers.models.downsampling import CogVideoXDownsample3D

        handled: set[int] = set()
        for path, module in target.named_modules():
            if type(module) is cog.CogVideoXCausalConv3d:
                forward = causal_conv_forward(module, state)
                if forward is not None:
                    patch.set_attr(module, "forward", forward)
                state.checks.append(lambda p=path, m=module: check_causal_conv(p, m))
            elif type(module) is CogVideoXDownsample3D:
                patch.set_attr(module, "forward", _downsample_forward(module, state))
                self.patch_conv2d(patch, module.conv, state, 0, 1)
                handled.add(id(module.conv))
            elif type(module) is torch.nn.GroupNorm:
                patch.set_attr(module, "forward", group_norm_forward(module, state))
        for module in target.modules():
            if type(module) is torch.nn.Conv2d and id(module) not in handled:
                self.patch_conv2d(patch, module, state)
        state.checks.append(lambda: check_no_checkpointing(target))
        unit = encoder_unit(target.encoder, lambda m: 2 if type(m) is CogVideoXDownsample3D else 1)
        patch.wrap_method(target.encoder, "forward", lambda f: coder_forward(f, state, unit))
        patch.wrap_method(target.decoder, "forward", lambda f: coder_forward(f, state, 1))
        patch.wrap_method(target, "_encode", lambda f: session_forward(f, state, "encode"))
        patch.wrap_method(target, "_decode", lambda f: session_forward(f, state, "decode"))
        patch.wrap_method(target, "tiled_encode", lambda f: tiled_forward(f, state, False, _new_tile))
        patch.wrap_method(target, "tiled_decode", lambda f: tiled_forward(f, state, False, _new_tile))
