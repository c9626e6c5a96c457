"""Height-split encode/decode for diffusers ``AutoencoderKLWan`` (Wan 2.1 and Wan 2.2 forms).

Applied by :func:`hfpatch.apply` to an ``AutoencoderKLWan`` (or a pipeline holding one) when more than one
rank is used. Each rank holds ``1/N`` of the rows of every feature map; the result equals the unsplit VAE
(``vae_mode="precise"``, default) or skips the conv halo exchange (``vae_mode="approx"``). See
:mod:`hfpatch.patches.vae.family` for the mechanics.

Row-coupling layers and how they are handled:

- ``WanCausalConv3d`` (3x3x3): one halo row from each neighbour; the causal frame cache keeps the halo rows
  of its cached frames, so each frame's rows cross the wire once.
- ``WanResample`` downsample (``ZeroPad2d((0, 1, 0, 1))`` + stride-2 conv): shards start on even rows, the
  halo is one row from the next rank, the zero row is added only at the global bottom.
- nearest-exact 2x upsampling, ``patchify``, ``AvgDown3D``, ``DupUp3D``: row-local once shards are aligned
  to the spatial factor (latent rows are split, then scaled).
- ``WanAttentionBlock`` (per-frame spatial attention): keys/values gathered, queries local.
- ``WanRMS_norm``: per position, nothing to do.

>>> import torch, hfpatch
>>> from hfpatch.testing import tiny_wan_vae
>>> vae = tiny_wan_vae("2.1")
>>> with hfpatch.apply(vae) as patch:   # one rank: nothing to split, the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 1, 4, 4)).sample.shape)
(1, 3, 1, 32, 32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...distributed.collectives import all_gather
from .family import VAEParallelFamily, check_conv2d
from .halo import conv_halo
from .layers import causal_conv3d_forward, coder_forward, session_forward, tile_boundary, tiled_forward
from .state import VAEShardState

__all__ = ["WanVAEParallel"]


def _zero_pad_forward(pad: torch.nn.ZeroPad2d, state: VAEShardState) -> Callable:
    """The downsample's ``ZeroPad2d((0, 1, 0, 1))`` pads width only; its bottom row is the conv's border pad."""
    original = pad.forward
    left, right = pad.padding[0], pad.padding[1]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding or state.approx:
            return original(x)
        return F.pad(x, (left, right, 0, 0))

    return forward


def _attention_forward(block: Any, state: VAEShardState) -> Callable:
    """``WanAttentionBlock.forward`` with keys/values gathered over the ranks (same maths, local queries)."""
    original = block.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding:
            return original(x)
        identity = x
        b, c, t, h, w = x.size()
        x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        x = block.norm(x)
        qkv = block.to_qkv(x).reshape(b * t, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
        q, kv = qkv[..., :c], qkv[..., c:].contiguous()  # (bt, 1, h*w, c) and (bt, 1, h*w, 2c)
        tokens = [rows * w for rows in state.sizes(h)]
        kv = all_gather(kv, 2, state.group, tokens, backward="reduce_scatter")
        k, v = kv.chunk(2, dim=-1)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w)
        x = block.proj(x)
        return x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4) + identity

    return forward


class WanVAEParallel(VAEParallelFamily):
    """Patch family for ``diffusers.AutoencoderKLWan``: height split over the ``"vae"`` ranks.

    Options:
        vae_mode: ``"precise"`` (default; equal to one device, differentiable) or ``"approx"`` (no conv halo
            exchange: each shard pads itself; attention stays global). Inference only.
        vae_output: ``"full"`` (default; every rank gets the whole output) or ``"shard"`` (this rank's rows,
            see :func:`hfpatch.patches.vae.family.local_rows`).

    The QwenImage VAEs copy this architecture class by class (``QwenImage...`` for ``Wan...``):
    :mod:`hfpatch.patches.vae.qwenimage` reuses the family with their module and prefix.
    """

    name = "wan_vae"
    #: The diffusers module defining the architecture and the prefix of its class names.
    module = "diffusers.models.autoencoders.autoencoder_kl_wan"
    prefix = "Wan"

    def classes(self) -> Any:
        """The architecture's classes by their Wan suffix (``classes().CausalConv3d``); absent ones are ``None``."""
        import importlib
        from types import SimpleNamespace

        source = importlib.import_module(self.module)
        names = (
            "Encoder3d Decoder3d MidBlock ResidualBlock ResidualDownBlock ResidualUpBlock UpBlock Resample "
            "Upsample AttentionBlock RMS_norm CausalConv3d AvgDown3D DupUp3D"
        ).split()
        # Wan's AvgDown3D/DupUp3D carry no prefix (QwenImage 2.1's do).
        found = {name: getattr(source, self.prefix + name, getattr(source, name, None)) for name in names}
        return SimpleNamespace(**found, CACHE_T=getattr(source, "CACHE_T", None))

    def audited_types(self) -> tuple[type, ...]:
        found = tuple(c for c in vars(self.classes()).values() if isinstance(c, type))
        return found + (
            torch.nn.Conv2d,
            torch.nn.ZeroPad2d,
            torch.nn.Sequential,
            torch.nn.ModuleList,
            torch.nn.Dropout,
            torch.nn.Identity,
            torch.nn.SiLU,
        )

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        wan = self.classes()
        if type(module) is torch.nn.Conv2d:
            check_conv2d(path, module)
        elif type(module) is wan.CausalConv3d:
            self.check_causal_conv(path, module)
        elif type(module) is wan.Upsample:
            if tuple(module.scale_factor) != (2.0, 2.0) or module.mode not in ("nearest", "nearest-exact"):
                raise TypeError(f"{path}: only 2x nearest upsampling is row-local; got {module}")

    def check_causal_conv(self, path: str, conv: torch.nn.Module) -> None:
        if conv._padding[2] != conv._padding[3] or conv.dilation[1] != 1:
            raise TypeError(
                f"{path}: {type(conv).__name__} with asymmetric height padding or dilation is not supported"
            )

    def install_causal_conv(self, patch: Any, conv: torch.nn.Module, state: VAEShardState) -> None:
        """Halo-wrap one causal conv that couples rows (Wan's: a ``Conv3d`` with the frame cache)."""
        kernel, stride = conv.kernel_size[1], conv.stride[1]
        if kernel > 1 or stride > 1:
            state.halos[id(conv)] = conv_halo(kernel, stride, conv._padding[2])
            patch.set_attr(conv, "forward", causal_conv3d_forward(conv, state, self.classes().CACHE_T))

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        wan = self.classes()
        handled: set[int] = set()
        downsamples = 0
        for module in target.modules():
            if isinstance(module, wan.Resample) and module.mode.startswith("downsample"):
                pad, conv = module.resample[0], module.resample[1]
                _, _, pad_top, pad_bottom = pad.padding
                patch.set_attr(pad, "forward", _zero_pad_forward(pad, state))
                self.patch_conv2d(patch, conv, state, pad_top + conv.padding[0], pad_bottom + conv.padding[0])
                handled.add(id(conv))
                if any(module is m for m in target.encoder.modules()):
                    downsamples += 1
            elif type(module) is wan.CausalConv3d:
                self.install_causal_conv(patch, module, state)
                handled.add(id(module))
            elif type(module) is wan.AttentionBlock:
                patch.set_attr(module, "forward", _attention_forward(module, state))
        for module in target.modules():
            if type(module) is torch.nn.Conv2d and id(module) not in handled:
                self.patch_conv2d(patch, module, state)

        patch.wrap_method(target.encoder, "forward", lambda f: coder_forward(f, state, 2**downsamples))
        patch.wrap_method(target.decoder, "forward", lambda f: coder_forward(f, state, 1))
        # An error mid-call (out of memory) leaves no frame cache behind: clear_cache releases it.
        patch.wrap_method(
            target, "_encode", lambda f: session_forward(f, state, "encode", target.clear_cache)
        )
        patch.wrap_method(
            target, "_decode", lambda f: session_forward(f, state, "decode", target.clear_cache)
        )
        patch.wrap_method(target, "tiled_encode", lambda f: tiled_forward(f, state, per_call=False))
        patch.wrap_method(target, "tiled_decode", lambda f: tiled_forward(f, state, per_call=False))
        patch.wrap_method(target, "clear_cache", lambda f: tile_boundary(f, state))
