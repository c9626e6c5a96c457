"""Height-split encode/decode for diffusers ``AutoencoderKLQwenImage`` and ``AutoencoderKLQwenImage21``.

Both VAEs are the Wan VAE's architecture copied class by class (``QwenImageCausalConv3d`` for
``WanCausalConv3d``, ...), so they run on :class:`~hfpatch.patches.vae.wan.WanVAEParallel` with their own module
and class prefix; see :mod:`hfpatch.patches.vae.wan` for the row-coupling layers.

- ``AutoencoderKLQwenImage`` (QwenImage, Krea 2, NucleusMoE): Wan 2.1's form, causal 3D convs with the frame
  cache, per-frame mid-block attention (keys/values gathered over the ranks, queries local).
- ``AutoencoderKLQwenImage21`` (Qwen-Image 2.1): Wan 2.2's residual form (``AvgDown3D``/``DupUp3D`` shortcuts,
  optional ``patchify``) for single images: its ``QwenImage21CausalConv3d`` is a 2D conv that pads height and
  width itself (``F.pad``) and refuses a frame cache. The split exchanges its halo rows and pads only at the
  global border (:func:`hfpatch.patches.vae.layers.halo_pad`).

>>> import torch, hfpatch
>>> from hfpatch.testing.models import tiny_model
>>> vae = tiny_model("qwenimage_vae")
>>> with hfpatch.apply(vae) as patch:   # one rank: the stock VAE runs
...     tuple(vae.decode(torch.zeros(1, 4, 1, 4, 4)).sample.shape)
(1, 3, 1, 8, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .halo import conv_halo
from .layers import halo_pad
from .state import VAEShardState
from .wan import WanVAEParallel

__all__ = ["QwenImage21VAEParallel", "QwenImageVAEParallel"]


class QwenImageVAEParallel(WanVAEParallel):
    """Patch family for ``diffusers.AutoencoderKLQwenImage``: the Wan 2.1 split on QwenImage's classes."""

    name = "qwenimage_vae"
    module = "diffusers.models.autoencoders.autoencoder_kl_qwenimage"
    prefix = "QwenImage"


def _image_conv_forward(conv: torch.nn.Conv2d, state: VAEShardState) -> Callable:
    """``QwenImage21CausalConv3d.forward``: ``conv2d(F.pad(x[:, :, 0], conv._padding))`` on height shards."""
    original = conv.forward
    before, after = state.halos[id(conv)]

    def forward(x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if not state.sharding or state.approx or cache_x is not None:
            return original(x, cache_x)  # the stock layer raises for a cache
        padded = halo_pad(x.squeeze(2), state, before, after, list(conv._padding))
        out = F.conv2d(padded, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)
        return out.unsqueeze(2)

    return forward


class QwenImage21VAEParallel(WanVAEParallel):
    """Patch family for ``diffusers.AutoencoderKLQwenImage21``: the Wan 2.2 split on Qwen-Image 2.1's classes,
    with its single-frame causal conv (a ``Conv2d`` padding itself) halo-wrapped."""

    name = "qwenimage21_vae"
    module = "diffusers.models.autoencoders.autoencoder_kl_qwenimage21"
    prefix = "QwenImage21"

    def check_causal_conv(self, path: str, conv: torch.nn.Module) -> None:
        if conv._padding[2] != conv._padding[3] or conv.dilation[0] != 1 or conv.padding_mode != "zeros":
            raise TypeError(
                f"{path}: {type(conv).__name__} with asymmetric height padding, dilation or non-zero padding "
                "is not supported"
            )

    def install_causal_conv(self, patch: Any, conv: torch.nn.Module, state: VAEShardState) -> None:
        kernel, stride = conv.kernel_size[0], conv.stride[0]
        if kernel > 1 or stride > 1:
            state.halos[id(conv)] = conv_halo(kernel, stride, conv._padding[2])
            patch.set_attr(conv, "forward", _image_conv_forward(conv, state))
