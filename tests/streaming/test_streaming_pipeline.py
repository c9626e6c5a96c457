"""StreamingWanPipeline on the tiny stock WanPipeline: shapes, determinism, cache == recompute, recache."""

from __future__ import annotations

import pytest
import torch

import hfpatch.streaming.pipeline as streaming_pipeline
from hfpatch.streaming import StreamingConfig, StreamingWanPipeline, recache
from hfpatch.testing import tiny_wan_pipe, wan_prompt_embeds
from hfpatch.testing.tolerance import eps, reassociation_tol, rel_error, rounding_noise

CONFIG = StreamingConfig(num_frame_per_block=2, local_attn_size=6, sink_size=2)
KWARGS = dict(height=16, width=32, denoising_step_list=(1000, 600, 300), context_noise=50)
# Tolerances: cached and recomputed runs differ only in which tensors the keys are read from (same values)
# and in the length of the attention calls and GEMMs (fp32 reassociation), and streamed decoding differs
# from a whole decode in the frame count of some convolutions: each is compared within reassociation_tol of
# the reference computation's own fp32-vs-fp64 noise (the same pipeline in fp64, same weights and draws).


@pytest.fixture(scope="module")
def stream():
    pipe = StreamingWanPipeline.from_pipe(tiny_wan_pipe(), CONFIG)
    yield pipe
    pipe.remove()


@pytest.fixture(scope="module")
def stream64():
    """The same stream in fp64 (the tiny pipe's weights are seeded): the fp32 stream's rounding scale."""
    pipe = tiny_wan_pipe()
    pipe.transformer.double()
    pipe.vae.double()
    stream = StreamingWanPipeline.from_pipe(pipe, CONFIG)
    yield stream
    stream.remove()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _run_fp64(stream64, num_blocks: int, **kwargs):
    """``stream64(...)`` with every random draw made in fp32 and cast, as the fp32 stream draws it: the same
    noise values (an fp64 draw would consume the generator differently and give other numbers)."""
    real = torch.randn

    def randn(*args, dtype=None, **kw):
        noise = real(*args, **kw)
        return noise if dtype is None else noise.to(dtype)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "randn", randn)
        return stream64(wan_prompt_embeds().double(), num_blocks, generator=_gen(), **KWARGS, **kwargs)


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
    # Exact: the same computation repeated (same seed, same kernels on the same values in the same order).
    assert torch.equal(latents, torch.cat([c.latents for c in chunks], 2))
    assert torch.equal(frames, torch.cat([c.frames for c in chunks], 1))
    assert frames.shape[1] == 1 + 4 * (8 - 1)


def test_stream_frames_equal_decoding_all_latents_at_once(stream, stream64):
    latents, frames = stream(wan_prompt_embeds(), 3, generator=_gen(), **KWARGS)
    with torch.no_grad():
        whole = stream.vae.decode(latents).sample  # tiny VAE: latents_mean 0, latents_std 1
        noise = rounding_noise(whole, stream64.vae.decode(latents.double()).sample)
    # frames = (decode / 2 + 0.5).clamp(0, 1): half the decode's error (clamping only shrinks it), plus one
    # rounding of the + 0.5 (eps absolute): relative to half the decode's scale.
    scale = whole.abs().max().item() / 2
    tol = reassociation_tol(noise) + eps() / scale
    error = rel_error(frames, (whole / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4), scale)
    print(f"frames: {error:.2e} / {tol:.2e}")
    assert error <= tol


def test_stream_with_cache_equals_uncached_recompute(stream, stream64):
    cached, _ = stream(wan_prompt_embeds(), 5, generator=_gen(), output_type="latent", **KWARGS)
    recomputed, _ = stream(
        wan_prompt_embeds(), 5, generator=_gen(), output_type="latent", use_cache=False, **KWARGS
    )
    exact, _ = _run_fp64(stream64, 5, output_type="latent", use_cache=False)
    tol = reassociation_tol(rounding_noise(recomputed, exact))
    error = rel_error(cached, recomputed)
    print(f"cache vs recompute: {error:.2e} / {tol:.2e}")
    assert error <= tol


def test_prompt_switch_recaches_and_changes_only_later_blocks(stream, monkeypatch):
    first, second = wan_prompt_embeds(), wan_prompt_embeds(seed=5)
    captured = []

    def spy(
        transformer, cache, latents, prompt_embeds, frame_offset, context_timestep=0.0, *, global_sink=True
    ):
        captured.append((latents.clone(), prompt_embeds, frame_offset, context_timestep, global_sink))
        recache(
            transformer,
            cache,
            latents,
            prompt_embeds,
            frame_offset,
            context_timestep,
            global_sink=global_sink,
        )

    monkeypatch.setattr(streaming_pipeline, "recache", spy)
    plain, _ = stream(first, 6, generator=_gen(), output_type="latent", **KWARGS)
    runs = {}
    for global_sink in (True, False):
        chunks = list(
            stream.stream(
                [(0, first), (4, second)],
                6,
                generator=_gen(),
                output_type="latent",
                global_sink=global_sink,
                **KWARGS,
            )
        )
        runs[global_sink] = torch.cat([c.latents for c in chunks], 2), stream.cache.frames()
        assert [c.prompt_index for c in chunks] == [0, 0, 0, 0, 1, 1]
    for global_sink, (switched, frames) in runs.items():
        # Exact: before the switch both runs make the same calls on the same values.
        assert torch.equal(switched[:, :, :8], plain[:, :, :8])
        # After it, another prompt: O(1e-1) apart on latents of magnitude ~4, not rounding (~1e-6 relative).
        assert (switched[:, :, 8:] - plain[:, :, 8:]).abs().max() > 1e-2
        # The sink is frames 0, 1 still (global sink), or the first recached frames 2, 3 (the stream restarted).
        assert frames == ([0, 1] if global_sink else [2, 3]) + [8, 9, 10, 11]
    # The sink settings differ after the switch (the sink keys came from another prompt, or other frames).
    assert (runs[True][0][:, :, 8:] - runs[False][0][:, :, 8:]).abs().max() > 1e-2

    # Recache ran once per run at the switch, over the newest cache_frames = 6 clean latents (frames 2..7, exact:
    # the yielded x0 themselves), at the context timestep.
    assert [c[4] for c in captured] == [True, False]
    for frames, prompt, offset, context_t, _ in captured:
        assert prompt is second and offset == 2 and context_t == 50
        assert torch.equal(frames, plain[:, :, 2:8])


def test_context_pass_and_recache_run_clean_x0_at_timestep_context_noise(stream, monkeypatch):
    """The context pass writes the clean x0 of each block at timestep ``context_noise`` (Self-Forcing's and
    LongLive's inference: no re-noising), and so does the re-encode at a prompt switch."""
    calls = []
    forward = stream.transformer.forward

    def spy(hidden_states, timestep, prompt, *args, **kwargs):
        calls.append((hidden_states.clone(), torch.as_tensor(timestep).clone(), kwargs))
        return forward(hidden_states, timestep, prompt, *args, **kwargs)

    monkeypatch.setattr(stream.transformer, "forward", spy)
    schedule = [(0, wan_prompt_embeds()), (2, wan_prompt_embeds(seed=5))]
    chunks = list(stream.stream(schedule, 4, generator=_gen(), output_type="latent", **KWARGS))
    steps = len(KWARGS["denoising_step_list"])
    recaches = [i for i, (_, _, kwargs) in enumerate(calls) if kwargs.get("recache")]
    assert recaches == [2 * (steps + 1)]  # before block 2's first step
    ((hidden, timestep, kwargs),) = [calls.pop(i) for i in recaches]
    # Frames 0..3 generated; with the global sink (frames 0, 1) the window frames 2, 3 are re-encoded.
    assert kwargs["frame_offset"] == 2 and torch.equal(hidden, chunks[1].latents)
    assert torch.equal(timestep, torch.full((1,), 50.0))
    assert len(calls) == 4 * (steps + 1)
    for block, chunk in enumerate(chunks):
        hidden, timestep, kwargs = calls[block * (steps + 1) + steps]  # after the block's denoising steps
        assert kwargs["frame_offset"] == chunk.frame_offset and kwargs["kv_cache"] is stream.cache
        assert torch.equal(hidden, chunk.latents)  # exact: the yielded x0 itself, not re-noised
        assert torch.equal(timestep, torch.full((1,), 50.0))


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


def test_guidance_with_negative_equal_to_prompt_is_the_unguided_stream_exactly(stream):
    """``v_u + g (v_c - v_u)`` with an unconditional branch that computes what the conditional one does (its
    own cache, the same values): exactly the unguided stream, however large ``g``."""
    plain, _ = stream(wan_prompt_embeds(), 4, generator=_gen(), output_type="latent", **KWARGS)
    guided, _ = stream(
        wan_prompt_embeds(), 4, generator=_gen(), output_type="latent", guidance_scale=7.0,
        negative_prompt_embeds=wan_prompt_embeds(), **KWARGS,
    )  # fmt: skip
    assert torch.equal(guided, plain)
    assert stream.uncond_cache is not None and stream.uncond_cache is not stream.cache
    assert stream.uncond_cache.frames() == stream.cache.frames()


def test_guided_stream_with_cache_equals_uncached_recompute(stream, stream64):
    """Both branches read their own cache; recomputing every earlier frame instead gives the same video."""
    guided = dict(guidance_scale=4.0, negative_prompt_embeds=wan_prompt_embeds(seed=9))
    cached, _ = stream(wan_prompt_embeds(), 4, generator=_gen(), output_type="latent", **guided, **KWARGS)
    recomputed, _ = stream(
        wan_prompt_embeds(), 4, generator=_gen(), output_type="latent", use_cache=False, **guided, **KWARGS
    )
    plain, _ = stream(wan_prompt_embeds(), 4, generator=_gen(), output_type="latent", **KWARGS)
    exact, _ = _run_fp64(
        stream64, 4, output_type="latent", use_cache=False, guidance_scale=4.0,
        negative_prompt_embeds=wan_prompt_embeds(seed=9).double(),
    )  # fmt: skip
    tol = reassociation_tol(rounding_noise(recomputed, exact))
    error = rel_error(cached, recomputed)
    print(f"guided cache vs recompute: {error:.2e} / {tol:.2e}")
    assert error <= tol
    assert (cached - plain).abs().max() > 1e-2  # guidance changes the video, far beyond rounding


def test_guidance_arguments_raise(stream):
    with pytest.raises(ValueError, match="pass negative_prompt_embeds"):
        next(stream.stream(wan_prompt_embeds(), 2, guidance_scale=3.0, **KWARGS))
    with pytest.raises(ValueError, match="negative_prompt_embeds must be"):
        next(
            stream.stream(
                wan_prompt_embeds(), 2, guidance_scale=3.0, negative_prompt_embeds=wan_prompt_embeds(batch=2),
                **KWARGS,
            )
        )  # fmt: skip
