"""StreamingWanPipeline on the tiny stock WanPipeline: shapes, determinism, cache == recompute, recache."""

from __future__ import annotations

import copy

import pytest
import torch

import hfpatch.streaming.pipeline as streaming_pipeline
from hfpatch.streaming import StreamingConfig, StreamingKVCache, StreamingWanPipeline, recache
from hfpatch.testing import tiny_wan_pipe, wan_prompt_embeds

CONFIG = StreamingConfig(num_frame_per_block=2, local_attn_size=6, sink_size=2)
KWARGS = dict(height=16, width=32, denoising_step_list=(1000, 600, 300), context_noise=50)
# Cached and recomputed runs differ only in which tensors the keys are read from (same values) and in
# the length of the attention calls: fp32 reassociation, 1e-5 on latents of magnitude ~4.
ATOL = 1e-5


@pytest.fixture(scope="module")
def stream():
    pipe = StreamingWanPipeline.from_pipe(tiny_wan_pipe(), CONFIG)
    yield pipe
    pipe.remove()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_stream_yields_decoded_blocks_with_expected_shapes_and_is_deterministic(stream):
    chunks = list(stream.stream(wan_prompt_embeds(), 4, generator=_gen(), **KWARGS))
    assert [c.block_index for c in chunks] == [0, 1, 2, 3] and [c.frame_offset for c in chunks] == [
        0,
        2,
        4,
        6,
    ]
    assert [tuple(c.latents.shape) for c in chunks] == [(1, 4, 2, 2, 4)] * 4
    assert [tuple(c.frames.shape) for c in chunks] == [(1, 5, 3, 16, 32)] + [(1, 8, 3, 16, 32)] * 3
    assert all(0 <= c.frames.min() and c.frames.max() <= 1 for c in chunks)
    latents, frames = stream(wan_prompt_embeds(), 4, generator=_gen(), **KWARGS)
    assert torch.equal(latents, torch.cat([c.latents for c in chunks], 2))
    assert torch.equal(frames, torch.cat([c.frames for c in chunks], 1))
    assert frames.shape[1] == 1 + 4 * (8 - 1)


def test_stream_frames_equal_decoding_all_latents_at_once(stream):
    latents, frames = stream(wan_prompt_embeds(), 3, generator=_gen(), **KWARGS)
    vae = stream.vae
    with torch.no_grad():
        whole = vae.decode(latents).sample  # tiny VAE: latents_mean 0, latents_std 1
    torch.testing.assert_close(
        frames, (whole / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4), atol=ATOL, rtol=0
    )


def test_stream_with_cache_equals_uncached_recompute(stream):
    cached, _ = stream(wan_prompt_embeds(), 5, generator=_gen(), output_type="latent", **KWARGS)
    recomputed, _ = stream(
        wan_prompt_embeds(), 5, generator=_gen(), output_type="latent", use_cache=False, **KWARGS
    )
    torch.testing.assert_close(cached, recomputed, atol=ATOL, rtol=0)


def test_prompt_switch_recaches_and_changes_only_later_blocks(stream, monkeypatch):
    first, second = wan_prompt_embeds(), wan_prompt_embeds(seed=5)
    captured = []

    def spy(transformer, cache, latents, prompt_embeds, frame_offset, context_timestep=0.0):
        recache(transformer, cache, latents, prompt_embeds, frame_offset, context_timestep)
        captured.append(
            (copy.deepcopy(cache), latents.clone(), prompt_embeds, frame_offset, context_timestep)
        )

    monkeypatch.setattr(streaming_pipeline, "recache", spy)
    plain, _ = stream(first, 6, generator=_gen(), output_type="latent", **KWARGS)
    switched_chunks = list(
        stream.stream([(0, first), (4, second)], 6, generator=_gen(), output_type="latent", **KWARGS)
    )
    switched = torch.cat([c.latents for c in switched_chunks], 2)
    assert [c.prompt_index for c in switched_chunks] == [0, 0, 0, 0, 1, 1]
    assert torch.equal(switched[:, :, :8], plain[:, :, :8])
    assert (switched[:, :, 8:] - plain[:, :, 8:]).abs().max() > 1e-2

    # Recache ran once at the switch, over the last (cache_frames - block) = 4 frames before frame 8 ...
    ((cache, frames, prompt, offset, context_t),) = captured
    assert prompt is second and offset == 4 and frames.shape[2] == 4 and context_t == 50
    # ... and left exactly the cache built from scratch over the same frames under the new prompt.
    scratch = StreamingKVCache(CONFIG, len(stream.transformer.blocks))
    with torch.no_grad():
        for s in range(0, 4, 2):
            stream.transformer(
                frames[:, :, s : s + 2],
                torch.tensor([50.0]),
                second,
                kv_cache=scratch,
                frame_offset=offset + s,
            )
    assert cache.frames() == scratch.frames() == [4, 5, 6, 7]
    for layer in range(len(scratch.keys)):
        assert torch.equal(cache.keys[layer], scratch.keys[layer])
        assert torch.equal(cache.values[layer], scratch.values[layer])
        assert torch.equal(cache.cross[layer].key, scratch.cross[layer].key)
    # The cache before the switch (prompt 1) differs: the recache did change it.
    before = StreamingKVCache(CONFIG, len(stream.transformer.blocks))
    with torch.no_grad():
        for s in range(0, 4, 2):
            stream.transformer(
                frames[:, :, s : s + 2], torch.tensor([50.0]), first, kv_cache=before, frame_offset=offset + s
            )
    assert not torch.equal(before.keys[1], scratch.keys[1])


def test_stream_invalid_arguments_raise(stream):
    with pytest.raises(ValueError, match="must start at block 0"):
        next(stream.stream([(1, wan_prompt_embeds())], 2, **KWARGS))
    with pytest.raises(ValueError, match="use_cache=False is a reference for a single prompt"):
        next(
            stream.stream([(0, wan_prompt_embeds()), (1, wan_prompt_embeds())], 2, use_cache=False, **KWARGS)
        )
    with pytest.raises(ValueError, match="multiples of 16"):
        next(stream.stream(wan_prompt_embeds(), 2, height=24, width=32))


def test_from_pipe_two_transformers_raises():
    with pytest.raises(ValueError, match="transformer_2"):
        StreamingWanPipeline.from_pipe(tiny_wan_pipe(two_transformers=True), CONFIG)
