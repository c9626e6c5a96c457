"""The decode of each streamed block in :mod:`hfpatch.streaming.pipeline`: a block's latents to pixel frames
through the streaming Wan decoder, run inline, or on a side CUDA stream so that the next block's denoising
overlaps it (:class:`InlineDecode`, :class:`SideStreamDecode`), and the choice between the two for a device
(:func:`decode_runner`).
"""

from __future__ import annotations

from typing import Any

import torch

from .vae import StreamingWanDecoder


def _pixel_frames(decoder: StreamingWanDecoder, vae_dtype, x0, mean, std) -> torch.Tensor:
    """Decoded frames ``[B, f, 3, H, W]`` in ``[0, 1]`` of a block's clean latents."""
    z = x0.to(vae_dtype) * std.to(x0) + mean.to(x0)
    return (decoder.decode(z) / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)


class InlineDecode:
    """Decode a block when it is done, on the current stream (CPU, or ``overlap_decode=False``)."""

    deferred = False

    def __init__(self, decoder: StreamingWanDecoder, vae_dtype: torch.dtype, mean, std) -> None:
        self.decoder, self.vae_dtype, self.mean, self.std = decoder, vae_dtype, mean, std

    def submit(self, x0: torch.Tensor) -> Any:
        return _pixel_frames(self.decoder, self.vae_dtype, x0, self.mean, self.std)

    def result(self, job: Any) -> torch.Tensor:
        return job


class SideStreamDecode(InlineDecode):
    """Decode on a second CUDA stream, so the VAE runs while the transformer works on the next block.

    The side stream waits for the block's latents (an event recorded on the current stream), and the
    current stream waits for the decode before the frames are handed out; ``record_stream`` tells the
    caching allocator which stream uses each tensor (the latents on the side stream, the frames on the
    current one), so neither is reused while the other stream may still read it. The decoder's causal frame
    cache lives on the side stream only.
    """

    deferred = True

    def __init__(self, decoder: StreamingWanDecoder, vae_dtype: torch.dtype, mean, std) -> None:
        super().__init__(decoder, vae_dtype, mean, std)
        self.side = torch.cuda.Stream(device=decoder.vae.device)

    def submit(self, x0: torch.Tensor) -> Any:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(x0.device))
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)
            x0.record_stream(self.side)
            frames = super().submit(x0)
            done = torch.cuda.Event()
            done.record(self.side)
        return frames, done

    def result(self, job: Any) -> torch.Tensor:
        frames, done = job
        current = torch.cuda.current_stream(frames.device)
        current.wait_event(done)
        frames.record_stream(current)
        return frames


def decode_runner(device: torch.device, overlap_decode: bool) -> type[InlineDecode]:
    """How a stream decodes its blocks: on a side CUDA stream (``overlap_decode`` on CUDA) or in line."""
    return SideStreamDecode if overlap_decode and device.type == "cuda" else InlineDecode
