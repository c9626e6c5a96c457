"""Streaming decode of AutoencoderKLWan: decoding latents in pieces equals decoding them whole (fp32)."""

from __future__ import annotations

import pytest
import torch

from hfpatch.streaming import StreamingWanDecoder
from hfpatch.testing import tiny_wan_vae
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64


def _whole_decode(vae, z: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(``vae.decode(z)``, tolerance relative to its largest magnitude for a decode of ``z`` in pieces).

    The decoder runs frame by frame either way (the causal cache carries the same two frames per conv), but
    ``post_quant_conv`` and the cache's concatenations see another frame count, and a CPU backend may block
    a convolution of another shape differently (another summation order), which the decoder then carries
    on: so the tolerance is reassociation_tol of the whole decode's own fp32-vs-fp64 noise.
    """
    whole = vae.decode(z).sample
    noise = rounding_noise(whole, to_fp64(vae).decode(z.double()).sample)
    return whole, reassociation_tol(noise)


@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_streaming_decode_in_pieces_equals_whole_decode(version):
    vae = tiny_wan_vae(version)
    z = torch.randn(1, 4, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole, tol = _whole_decode(vae, z)
        for pieces in ([1, 1, 1, 1], [1, 3], [2, 2]):
            decoder = StreamingWanDecoder(vae)
            outs, start = [], 0
            for size in pieces:
                outs.append(decoder.decode(z[:, :, start : start + size]))
                start += size
            assert [o.shape[2] for o in outs] == [4 * size - 3 * (i == 0) for i, size in enumerate(pieces)]
            error = rel_error(torch.cat(outs, dim=2), whole)
            assert error <= tol, (pieces, error, tol)


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
        _, tol = _whole_decode(vae, z)
    # Other pieces ([2, 1] after [1, 1, 1]): the same reassociation as pieces against the whole decode. A
    # cache left over from the first video would put other frames into the first ones: O(1) off.
    error = rel_error(again, first)
    assert error <= tol, (error, tol)
    assert sizes[0] == sizes[1] > 0  # two frames per causal conv, whatever the video length


def test_streaming_decoder_rejects_tiling():
    vae = tiny_wan_vae("2.1")
    vae.enable_tiling()
    with pytest.raises(ValueError, match="does not support tiling"):
        StreamingWanDecoder(vae)


def _split_vae_case(z: torch.Tensor, other: torch.Tensor) -> dict:
    """On every rank: a VAE split over the 2 ranks, streamed in pieces [1, 3] (the decoder is built before the
    split: it reads the split at each call); then one rank passes other latents."""
    import torch.distributed as dist

    import hfpatch
    from hfpatch.distributed.agreement import InputMismatchError

    vae = tiny_wan_vae("2.1")
    decoder = StreamingWanDecoder(vae)
    out = {}
    with hfpatch.apply(vae), torch.no_grad():  # the world (2 ranks) splits the VAE
        out["split"] = decoder.split
        out["frames"] = torch.cat([decoder.decode(z[:, :, :1]), decoder.decode(z[:, :, 1:])], dim=2)
        out["cache_bytes"] = decoder.nbytes
        decoder.reset()
        try:
            decoder.decode(other if dist.get_rank() == 1 else z[:, :, :1])
        except InputMismatchError as error:
            out["mismatch"] = str(error)
    return out


def test_streaming_decoder_on_a_split_vae_equals_one_process_and_holds_its_rows(rank_pool):
    """Each piece is one split session: the frames equal the one-process streaming decode within the whole
    decode's reassociation tolerance (the halo exchange changes no arithmetic, the convs see other row counts),
    and each rank's causal cache holds its rows (half of the frame here: 2 latent rows of 4 per rank)."""
    vae = tiny_wan_vae("2.1")
    z = torch.randn(1, 4, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    decoder = StreamingWanDecoder(vae)
    with torch.no_grad():
        reference = torch.cat([decoder.decode(z[:, :, :1]), decoder.decode(z[:, :, 1:])], dim=2)
        _, tol = _whole_decode(vae, z)
    results = rank_pool(2).run(_split_vae_case, z, z[:, :, 1:2])
    for r in results:
        assert r["split"]
        error = rel_error(r["frames"], reference)
        assert error <= tol, (error, tol)
        assert r["cache_bytes"] == decoder.nbytes // 2
        assert "'x': differs" in r["mismatch"]
