"""Streaming decode of AutoencoderKLWan: decoding latents in pieces equals decoding them whole (fp32)."""

from __future__ import annotations

import pytest
import torch

from hfpatch.streaming import StreamingWanDecoder
from hfpatch.testing import tiny_wan_vae

# Identical ops on identical frames (the causal cache carries the same two frames per conv): exact in
# practice; 1e-5 leaves room for a backend that blocks convolutions differently for a different frame count.
ATOL = 1e-5


@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_streaming_decode_in_pieces_equals_whole_decode(version):
    vae = tiny_wan_vae(version)
    z = torch.randn(1, 4, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = vae.decode(z).sample
        for pieces in ([1, 1, 1, 1], [1, 3], [2, 2]):
            decoder = StreamingWanDecoder(vae)
            outs, start = [], 0
            for size in pieces:
                outs.append(decoder.decode(z[:, :, start : start + size]))
                start += size
            assert [o.shape[2] for o in outs] == [4 * size - 3 * (i == 0) for i, size in enumerate(pieces)]
            torch.testing.assert_close(torch.cat(outs, dim=2), whole, atol=ATOL, rtol=0)


def test_streaming_decode_reset_starts_a_new_video_and_cache_is_bounded():
    vae = tiny_wan_vae("2.1")
    z = torch.randn(1, 4, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    decoder = StreamingWanDecoder(vae)
    with torch.no_grad():
        first = torch.cat([decoder.decode(z[:, :, i : i + 1]) for i in range(3)], dim=2)
        sizes = [decoder.nbytes]
        decoder.decode(z[:, :, :2])
        sizes.append(decoder.nbytes)
        decoder.reset()
        again = torch.cat([decoder.decode(z[:, :, :2]), decoder.decode(z[:, :, 2:])], dim=2)
    assert torch.equal(first, again)
    assert sizes[0] == sizes[1] > 0  # two frames per causal conv, whatever the video length


def test_streaming_decoder_rejects_tiling():
    vae = tiny_wan_vae("2.1")
    vae.enable_tiling()
    with pytest.raises(ValueError, match="does not support tiling"):
        StreamingWanDecoder(vae)


def _split_vae_case() -> tuple[str, str]:
    import hfpatch

    vae = tiny_wan_vae("2.1")
    decoder = StreamingWanDecoder(vae)  # built before the split: decode() checks again
    messages = []
    with hfpatch.apply(vae):  # the world (2 ranks) splits the VAE
        for attempt in (lambda: StreamingWanDecoder(vae), lambda: decoder.decode(torch.zeros(1, 4, 1, 4, 4))):
            try:
                attempt()
                messages.append("no error")
            except ValueError as error:
                messages.append(str(error))
    return tuple(messages)


def test_streaming_decoder_rejects_a_split_vae(rank_pool):
    for messages in rank_pool(2).run(_split_vae_case):
        for message in messages:
            assert "does not support a VAE split over ranks" in message
