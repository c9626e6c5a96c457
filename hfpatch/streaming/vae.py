"""Streaming decode for the stock ``AutoencoderKLWan``: decode latent frames as they arrive.

The Wan VAE decoder is causal in time: ``AutoencoderKLWan._decode`` runs the decoder one latent frame at a
time and carries, per causal convolution, the last two input frames in a feature cache (``feat_cache``).
:class:`StreamingWanDecoder` keeps that cache *between* calls instead of clearing it, so decoding a video
in pieces gives the same pixels as decoding it whole, with memory bounded by one frame of activations
plus two frames per convolution. The VAE itself is not modified and its own cache is not touched.

>>> import torch
>>> from hfpatch.streaming import StreamingWanDecoder
>>> from hfpatch.testing import tiny_wan_vae
>>> vae = tiny_wan_vae("2.1")
>>> z = torch.randn(1, 4, 4, 4, 4)
>>> decoder = StreamingWanDecoder(vae)
>>> with torch.no_grad():
...     parts = [decoder.decode(z[:, :, :1]), decoder.decode(z[:, :, 1:])]
...     whole = vae.decode(z).sample
>>> [tuple(p.shape) for p in parts], torch.allclose(torch.cat(parts, 2), whole, atol=1e-5)
([(1, 3, 1, 32, 32), (1, 3, 12, 32, 32)], True)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StreamingWanDecoder"]


class StreamingWanDecoder:
    """Decode latents of one video piece by piece with the causal temporal cache kept between calls.

    Args:
        vae: A stock ``AutoencoderKLWan`` (Wan 2.1 or 2.2). Tiling is not supported while streaming, nor a VAE
            split over ranks by ``hfpatch.apply`` (the decoder is called directly, outside the split).

    The first latent frame of a stream decodes to one pixel frame, each later one to
    ``vae.config.scale_factor_temporal`` frames. Call :meth:`reset` before a new video. A call that raises
    (out of memory) resets the cache: nothing stays allocated, and the next call starts a new video.
    """

    def __init__(self, vae: Any) -> None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

        if getattr(vae, "use_tiling", False):
            raise ValueError("StreamingWanDecoder does not support tiling; call vae.disable_tiling() first")
        _check_not_split(vae)
        self.vae = vae
        self._num_convs = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        self.reset()

    def reset(self) -> None:
        """Start a new video: drop the temporal cache."""
        self._feat_map: list[Any] = [None] * self._num_convs
        self._first = True

    @property
    def nbytes(self) -> int:
        """Bytes held by the temporal cache (two frames per causal convolution at most)."""
        return sum(t.nbytes for t in self._feat_map if isinstance(t, torch.Tensor))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Decode the next latent frames ``z`` ([B, C, f, h, w], unnormalised as for ``vae.decode``).

        Returns:
            Pixel frames ``[B, 3, f', H, W]`` clamped to ``[-1, 1]``, as ``vae.decode(...).sample`` would
            give for these frames of the whole video.
        """
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        _check_not_split(self.vae)  # every rank would decode the whole frame: refuse rather than waste memory
        x = self.vae.post_quant_conv(z)  # a 1x1x1 convolution: frame-local, no cache needed
        outs = []
        try:
            for i in range(x.shape[2]):
                outs.append(
                    self.vae.decoder(
                        x[:, :, i : i + 1], feat_cache=self._feat_map, feat_idx=[0], first_chunk=self._first
                    )
                )
                self._first = False
        except BaseException:
            self.reset()  # a frame half-way through the convolutions: the cache is neither kept nor valid
            raise
        out = torch.cat(outs, dim=2)
        if self.vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=self.vae.config.patch_size)
        return out.clamp(-1.0, 1.0)


def _check_not_split(vae: Any) -> None:
    from ..core.patch import get_patch

    patch = get_patch(vae)
    if patch is not None and getattr(patch.plan, "vae", 1) > 1:
        raise ValueError(
            f"StreamingWanDecoder does not support a VAE split over ranks (hfpatch plan {patch.plan}): it calls the "
            "decoder frame by frame, outside the split, so every rank would decode the whole frame. Decode with "
            "vae.decode(...) (split) or remove the VAE patch for streaming decode."
        )
