"""Streaming decode for the stock ``AutoencoderKLWan``: decode latent frames as they arrive.

The Wan VAE decoder is causal in time: ``AutoencoderKLWan._decode`` runs the decoder one latent frame at a
time and carries, per causal convolution, the last two input frames in a feature cache (``feat_cache``).
:class:`StreamingWanDecoder` keeps that cache *between* calls instead of clearing it, so decoding a video
in pieces gives the same pixels as decoding it whole, with memory bounded by one frame of activations
plus two frames per convolution. The VAE itself is not modified and its own cache is not touched.

A VAE split over ranks by ``hfpatch.apply`` (:mod:`hfpatch.patches.vae.wan`) decodes each piece as one split
session (:class:`hfpatch.training.video_vae.WanFrames`): every rank decodes its rows and keeps the causal cache
of its rows, the output rows are gathered (or kept, with ``vae_output="shard"``), and every rank must pass the
same latents (checked at each call). The halo rows of the two cached frames are exchanged again at each piece.

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

from ..training.video_vae import WanFrames

__all__ = ["StreamingWanDecoder"]


class StreamingWanDecoder:
    """Decode latents of one video piece by piece with the causal temporal cache kept between calls.

    Args:
        vae: A stock ``AutoencoderKLWan`` (Wan 2.1 or 2.2), split over ranks by ``hfpatch.apply`` or not.
            Tiling is not supported while streaming.

    The first latent frame of a stream decodes to one pixel frame, each later one to
    ``vae.config.scale_factor_temporal`` frames. Call :meth:`reset` before a new video. A call that raises
    (out of memory) resets the cache: nothing stays allocated, and the next call starts a new video.
    """

    def __init__(self, vae: Any) -> None:
        if getattr(vae, "use_tiling", False):
            raise ValueError("StreamingWanDecoder does not support tiling; call vae.disable_tiling() first")
        self.vae = vae
        self.reset()

    @property
    def split(self) -> bool:
        """Whether the VAE is split over ranks (each call is then a collective of its ranks)."""
        return WanFrames(self.vae).state is not None

    def reset(self) -> None:
        """Start a new video: drop the temporal cache."""
        self._feat_map: list[Any] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the temporal cache (two frames per causal convolution at most; this rank's rows of
        them on a split VAE)."""
        return sum(t.nbytes for t in self._feat_map or () if isinstance(t, torch.Tensor))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Decode the next latent frames ``z`` ([B, C, f, h, w], unnormalised as for ``vae.decode``).

        Returns:
            Pixel frames ``[B, 3, f', H, W]`` clamped to ``[-1, 1]``, as ``vae.decode(...).sample`` would
            give for these frames of the whole video (this rank's rows with a split VAE's
            ``vae_output="shard"``).

        Raises:
            InputMismatchError: With a split VAE, when the ranks passed different latents (on every rank).
        """
        frames = WanFrames(self.vae)  # read at each call: the VAE may have been split or unsplit since
        z = frames.enter(z, "decode (streaming)")
        try:
            out, self._feat_map = frames.decode(self._feat_map, z, first=self._feat_map is None)
        except BaseException:
            self.reset()  # a frame half-way through the convolutions: the cache is neither kept nor valid
            raise
        return out
