"""Block-causal streaming patch for WanTransformer3DModel: cached forward vs full block-causal forward (fp32)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.streaming import StreamingConfig, StreamingKVCache
from hfpatch.streaming.transformer import WanStreamingPatch
from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

# Tolerances: same weights and inputs on both sides; only the order of sums differs (keys read from the
# cache or the input, attention and GEMMs over other lengths, rotary tables computed at other positions),
# so every comparison allows reassociation_tol of the reference forward's own fp32-vs-fp64 noise (the same
# forward of an fp64 copy of the model), relative to the reference's largest magnitude: see _tol.

CONFIGS = {
    "global": StreamingConfig(num_frame_per_block=2),
    "window_sink": StreamingConfig(num_frame_per_block=2, local_attn_size=6, sink_size=2),
    "window_no_sink": StreamingConfig(num_frame_per_block=3, local_attn_size=6),
    "frame_blocks": StreamingConfig(num_frame_per_block=1, local_attn_size=4, sink_size=1),
}

# Sink frames plus the last (local_attn_size - sink_size) frames stay cached; the rest were evicted.
CACHED_AFTER_12_FRAMES = {
    "global": list(range(12)),
    "window_sink": [0, 1, 8, 9, 10, 11],
    "window_no_sink": [6, 7, 8, 9, 10, 11],
    "frame_blocks": [0, 9, 10, 11],
}


def _inputs(frames: int = 12, batch: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, frames, 4, 4, generator=gen)
    timestep = torch.randint(0, 1000, (batch, frames), generator=gen).float()
    return x, timestep, wan_prompt_embeds(batch=batch)


def _cached(model, config, x, timestep, prompt, offset: int = 0):
    cache = StreamingKVCache(config, len(model.blocks))
    n = config.num_frame_per_block
    outs = []
    for s in range(0, x.shape[2], n):
        outs.append(
            model(
                x[:, :, s : s + n], timestep[:, s : s + n], prompt, kv_cache=cache, frame_offset=offset + s
            ).sample
        )
    return torch.cat(outs, dim=2), cache


@pytest.fixture(scope="module")
def model():
    return tiny_wan_transformer()


@pytest.fixture(scope="module")
def model64(model):
    """An fp64 copy of the (unpatched) model: the rounding scale of its fp32 forwards."""
    return to_fp64(model)


def _tol(model64, reference, x, timestep, prompt, config=None, **kwargs) -> float:
    """reassociation_tol of the fp32 ``reference`` against the same forward of ``model64`` (patched with
    ``config`` for the duration, stock if ``None``) on fp64 copies of the inputs."""
    patched = contextlib.nullcontext() if config is None else hfpatch.apply(model64, streaming=config)
    with torch.no_grad(), patched:
        exact = model64(x.double(), timestep, prompt.double(), **kwargs).sample
    return reassociation_tol(rounding_noise(reference, exact))


def _assert_close(actual, reference, tol: float, what: str = "") -> None:
    error = rel_error(actual, reference)
    print(f"{what}: {error:.2e} / {tol:.2e}")
    assert error <= tol, f"{what}: relative error {error:.3e} > {tol:.3e}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_forward_block_by_block_equals_block_causal_full_forward(model, model64, name):
    config = CONFIGS[name]
    x, timestep, prompt = _inputs(batch=2)
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        full = model(x, timestep, prompt).sample
        cached, cache = _cached(model, config, x, timestep, prompt)
        whole_input_cached = model(
            x, timestep, prompt, kv_cache=StreamingKVCache(config, len(model.blocks))
        ).sample
    tol = _tol(model64, full, x, timestep, prompt, config)
    _assert_close(cached, full, tol, f"{name} cached")
    _assert_close(whole_input_cached, full, tol, f"{name} whole input cached")
    assert cache.frames() == CACHED_AFTER_12_FRAMES[name]


def test_cached_forward_with_frame_offset_equals_full_forward_at_that_offset(model, model64):
    config = CONFIGS["window_sink"]
    x, timestep, prompt = _inputs(frames=8)
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        full = model(x, timestep, prompt, frame_offset=70).sample  # past rope_max_seq_len=64: no length limit
        cached, _ = _cached(model, config, x, timestep, prompt, offset=70)
        at_zero = model(x, timestep, prompt).sample
    tol = _tol(model64, full, x, timestep, prompt, config, frame_offset=70)
    _assert_close(cached, full, tol, "cached at 70")
    # Rotary attention sees relative positions only: shifting every frame by 70 changes nothing, which
    # also checks the positions computed past the stock table (their cos/sin round differently: the fp64
    # forward, whose temporal rotary table is fp64, measures that rounding too).
    _assert_close(at_zero, full, tol, "at 0 vs at 70")


def test_cached_forward_without_rope_offset_breaks_equality(model, model64, monkeypatch):
    config = CONFIGS["window_sink"]
    x, timestep, prompt = _inputs()
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        full = model(x, timestep, prompt).sample
        cached, _ = _cached(model, config, x, timestep, prompt)
        # The stock rope restarts temporal positions at 0 in every call (undone before the patch is removed).
        with monkeypatch.context() as m:
            m.setattr(model.rope, "forward", type(model.rope).forward.__get__(model.rope))
            no_offset, _ = _cached(model, config, x, timestep, prompt)
    tol = _tol(model64, full, x, timestep, prompt, config)
    _assert_close(cached, full, tol, "cached")
    first_block = slice(0, config.num_frame_per_block)
    _assert_close(no_offset[:, :, first_block], full[:, :, first_block], tol, "first block without offset")
    # Later blocks at the wrong positions: O(1e-1) off on outputs of magnitude ~4, far beyond rounding.
    assert (no_offset - full).abs().max() > 1e-2


def _rope_at(model, frames: int, offset: int):
    from hfpatch.streaming.attention_processors import StreamingCall as _Call

    state = model.blocks[0].attn1.processor.state
    state.call = _Call(tokens_per_frame=4, positions=torch.arange(offset, offset + frames))
    try:
        return model.rope(torch.zeros(1, 4, frames, 4, 4))
    finally:
        state.call = None


def test_rope_with_offset_equals_stock_table_rows_and_has_no_length_limit(model):
    stock = tiny_wan_transformer().rope  # rope_max_seq_len=64
    ref_cos, ref_sin = stock(torch.zeros(1, 4, 64, 4, 4))
    with hfpatch.apply(model, streaming=CONFIGS["global"]):
        cos, sin = _rope_at(model, frames=3, offset=5)
        long_cos, long_sin = _rope_at(model, frames=70, offset=0)
    # Exact: the same fp64 recipe, elementwise (no sum), then one rounding to fp32, at the same positions.
    assert torch.equal(cos, ref_cos[:, 5 * 4 : 8 * 4]) and torch.equal(sin, ref_sin[:, 5 * 4 : 8 * 4])
    assert long_cos.shape == (1, 70 * 4, 1, 8)
    assert torch.equal(long_cos[:, : 64 * 4], ref_cos) and torch.equal(long_sin[:, : 64 * 4], ref_sin)


def test_single_block_patched_forward_equals_stock_forward(model, model64):
    x, _, prompt = _inputs(frames=6)
    stock_model = tiny_wan_transformer()
    with torch.no_grad():
        reference = stock_model(x, torch.tensor([321.0]), prompt).sample
        with hfpatch.apply(model, streaming=StreamingConfig(num_frame_per_block=6)):
            scalar = model(x, torch.tensor([321.0]), prompt).sample
            per_frame = model(x, torch.full((1, 6), 321.0), prompt).sample
    # Per-frame timesteps embed 6 rows instead of 1, and the rope is computed on the fly: other GEMM shapes.
    tol = _tol(model64, reference, x, torch.tensor([321.0]), prompt)  # the stock forward's noise
    _assert_close(scalar, reference, tol, "scalar timestep")
    _assert_close(per_frame, reference, tol, "per-frame timestep")


def test_block_causal_forward_later_frames_do_not_change_earlier_blocks(model):
    config = CONFIGS["window_sink"]
    x, timestep, prompt = _inputs()
    y = x.clone()
    y[:, :, 6:] += 1.0
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        a, b = model(x, timestep, prompt).sample, model(y, timestep, prompt).sample
    # Exact: the first 6 frames' rows go through the same kernels with the same shapes and values (row-wise
    # GEMMs, attention over the same visible keys); the later frames move O(1e-1), far beyond rounding.
    assert torch.equal(a[:, :, :6], b[:, :, :6]) and (a[:, :, 6:] - b[:, :, 6:]).abs().max() > 1e-2


def test_kv_cache_bytes_constant_once_allocated_and_analytic(model):
    config = CONFIGS["window_sink"]
    x, timestep, prompt = _inputs(frames=16)
    sizes = []
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        cache = StreamingKVCache(config, len(model.blocks))
        for s in range(0, 16, 2):
            model(x[:, :, s : s + 2], timestep[:, s : s + 2], prompt, kv_cache=cache, frame_offset=s)
            sizes.append(cache.nbytes)
    inner = model.config.num_attention_heads * model.config.attention_head_dim
    # k and v, layers, frames, 4 tokens per frame, channels, fp32
    self_attn = 2 * len(model.blocks) * config.cache_frames * 4 * inner * 4
    cross = 2 * len(model.blocks) * prompt.shape[1] * inner * 4
    assert sizes == [self_attn + cross] * len(sizes)
    assert cache.frames() == [0, 1, 12, 13, 14, 15]


def test_cross_attention_cache_reused_per_prompt_tensor(model):
    config = CONFIGS["global"]
    x, timestep, prompt = _inputs(frames=4)
    other = wan_prompt_embeds(seed=7)
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        cache = StreamingKVCache(config, len(model.blocks))
        model(x[:, :, :2], timestep[:, :2], prompt, kv_cache=cache)
        first = cache.cross[0].key
        model(x[:, :, 2:], timestep[:, 2:], prompt, kv_cache=cache, frame_offset=2)
        assert cache.cross[0].key is first and cache.cross[0].source is prompt
        cache.reset()
        model(x[:, :, :2], timestep[:, :2], other, kv_cache=cache)
        assert cache.cross[0].source is other and not torch.equal(cache.cross[0].key, first)


def test_cross_attention_cache_prompt_modified_in_place_is_recomputed(model):
    config = CONFIGS["global"]
    x, timestep, _ = _inputs(frames=4)
    prompt, other = wan_prompt_embeds(), wan_prompt_embeds(seed=7)
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        edited, cache = prompt.clone(), StreamingKVCache(config, len(model.blocks))
        model(x[:, :, :2], timestep[:, :2], edited, kv_cache=cache)
        edited.copy_(other)  # same tensor object, new values: the cached text keys/values are stale
        stale_or_not = model(x[:, :, 2:], timestep[:, 2:], edited, kv_cache=cache, frame_offset=2).sample
        fresh = StreamingKVCache(config, len(model.blocks))
        model(x[:, :, :2], timestep[:, :2], prompt, kv_cache=fresh)
        fresh.reset_cross_attention()
        expected = model(x[:, :, 2:], timestep[:, 2:], other, kv_cache=fresh, frame_offset=2).sample
    assert torch.equal(stale_or_not, expected)  # same kernels on the same values in the same shapes: exact
    # Exact: to_k of the same prompt values, same kernel and shapes.
    assert cache.cross[0].source is edited and torch.equal(cache.cross[0].key, fresh.cross[0].key)


def test_cross_attention_cache_inference_tensor_prompt_is_recomputed(model):
    # Inference tensors keep no version counter, so an in-place edit could not be seen: never reused.
    config = CONFIGS["global"]
    x, timestep, prompt = _inputs(frames=4)
    with hfpatch.apply(model, streaming=config), torch.inference_mode():
        frozen = prompt.clone()  # an inference tensor
        cache = StreamingKVCache(config, len(model.blocks))
        model(x[:, :, :2], timestep[:, :2], frozen, kv_cache=cache)
        first = cache.cross[0].key
        model(x[:, :, 2:], timestep[:, 2:], frozen, kv_cache=cache, frame_offset=2)
        # Recomputed (a new tensor) from the same values by the same kernel: exact.
        assert cache.cross[0].key is not first and torch.equal(cache.cross[0].key, first)


def test_cross_attention_cache_weights_updated_in_place_are_recomputed():
    # An optimizer step between blocks (streaming training) changes to_k/to_v in place: the text keys/values
    # cached from the old weights must not serve the next block.
    model, config = tiny_wan_transformer(), CONFIGS["global"]
    x, timestep, prompt = _inputs(frames=4)
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        cache = StreamingKVCache(config, len(model.blocks))
        model(x[:, :, :2], timestep[:, :2], prompt, kv_cache=cache)
        first = cache.cross[0].key
        model.blocks[0].attn2.to_k.weight.mul_(1.5)  # what optimizer.step() does
        model(x[:, :, 2:], timestep[:, 2:], prompt, kv_cache=cache, frame_offset=2)
        fresh = StreamingKVCache(config, len(model.blocks))  # text keys computed by the new weights
        model(x[:, :, :2], timestep[:, :2], prompt, kv_cache=fresh)
    assert cache.cross[0].key is not first
    assert torch.equal(cache.cross[0].key, fresh.cross[0].key)  # same weights, prompt and kernel: exact
    assert not torch.equal(first, fresh.cross[0].key)


def test_cached_forward_failing_part_way_forgets_the_block(model, monkeypatch):
    # Layers before the failure already wrote the block's slots: the cache must not keep claiming the frames
    # those slots held, or a retry would read keys of the failed block as if they were the evicted frames.
    config = CONFIGS["window_no_sink"]  # 3-frame blocks in a 6-frame window: block 2 evicts block 0
    x, timestep, prompt = _inputs(frames=9)
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        cache = StreamingKVCache(config, len(model.blocks))
        for s in (0, 3):
            model(x[:, :, s : s + 3], timestep[:, s : s + 3], prompt, kv_cache=cache, frame_offset=s)
        assert cache.frames() == [0, 1, 2, 3, 4, 5]
        last = model.blocks[-1]
        monkeypatch.setattr(last, "forward", lambda *a, **k: (_ for _ in ()).throw(MemoryError("simulated")))
        with pytest.raises(MemoryError, match="simulated"):
            model(x[:, :, 6:9], timestep[:, 6:9], prompt, kv_cache=cache, frame_offset=6)
    assert cache.frames() == [3, 4, 5], "the slots of frames 0-2 were overwritten by the failed block"


# The visible key frames of each 2-frame query block under window_sink (local_attn_size=6, sink_size=2),
# written out by hand: the sink frames 0-1, plus the last 4 frames up to the end of the block.
WINDOW_SINK_VISIBLE = {
    0: [0, 1],
    1: [0, 1, 2, 3],
    2: [0, 1, 2, 3, 4, 5],
    3: [0, 1, 4, 5, 6, 7],
    4: [0, 1, 6, 7, 8, 9],
    5: [0, 1, 8, 9, 10, 11],
}


class _MaskedStockProcessor:
    """The stock ``WanAttnProcessor`` of ``attn1``, given a fixed boolean attention mask (True: attend)."""

    def __init__(self, stock, mask: torch.Tensor) -> None:
        self.stock, self.mask = stock, mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.stock(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


def test_window_sink_streaming_equals_stock_transformer_with_hand_built_mask(model):
    # An independent reference: the stock, unpatched transformer with the same weights, its stock attention
    # restricted by a token mask built from WINDOW_SINK_VISIBLE, not from hfpatch's visible_frames().
    config = CONFIGS["window_sink"]
    x, timestep, prompt = _inputs(frames=12, batch=2)
    tokens_per_frame = 4  # 4x4 latents, patch 2x2
    frame_of_token = torch.arange(12 * tokens_per_frame) // tokens_per_frame
    visible = torch.zeros(12, 12, dtype=torch.bool)  # [query frame, key frame]
    for block, frames in WINDOW_SINK_VISIBLE.items():
        visible[2 * block : 2 * block + 2, frames] = True
    mask = visible[frame_of_token][:, frame_of_token][None, None]  # [1, 1, S, S]
    stock = tiny_wan_transformer()
    stock.load_state_dict(model.state_dict())
    for block in stock.blocks:
        block.attn1.set_processor(_MaskedStockProcessor(block.attn1.processor, mask))
    per_token = timestep.repeat_interleave(tokens_per_frame, dim=1)
    with torch.no_grad():
        # The stock per-token timestep path (Wan 2.2 style): [B, S], each frame's value on its tokens.
        reference = stock(x, per_token, prompt).sample
        with hfpatch.apply(model, streaming=config):
            full = model(x, timestep, prompt).sample
            cached, _ = _cached(model, config, x, timestep, prompt)
        # The masked stock reference's own noise: the same masked stock model in fp64.
        exact = to_fp64(stock)(x.double(), per_token, prompt.double()).sample
    tol = reassociation_tol(rounding_noise(reference, exact))
    _assert_close(full, reference, tol, "full vs masked stock")
    _assert_close(cached, reference, tol, "cached vs masked stock")


def test_cached_forward_skipped_block_raises(model):
    config = CONFIGS["window_sink"]
    x, timestep, prompt = _inputs(frames=6)
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        cache = StreamingKVCache(config, len(model.blocks))
        model(x[:, :, :2], timestep[:, :2], prompt, kv_cache=cache)
        with pytest.raises(ValueError, match=r"frames \[2, 3\] are visible .* but not cached"):
            model(x[:, :, 4:6], timestep[:, 4:6], prompt, kv_cache=cache, frame_offset=4)


def test_forward_misaligned_offset_or_timestep_raises(model):
    x, timestep, prompt = _inputs(frames=4)
    with hfpatch.apply(model, streaming=CONFIGS["global"]), torch.no_grad():
        with pytest.raises(ValueError, match="multiples of 2"):
            model(x, timestep, prompt, frame_offset=1)
        with pytest.raises(ValueError, match="multiples of 2"):
            model(x[:, :, :3], timestep[:, :3], prompt)
        with pytest.raises(ValueError, match=r"per frame \[batch, num_frames\] = \[1, 4\]"):
            model(x, timestep[:, :3], prompt)


def test_streaming_config_invalid_window_raises():
    with pytest.raises(
        ValueError, match="local_attn_size=4 must be -1 .* at least sink_size \\+ num_frame_per_block = 5"
    ):
        StreamingConfig(num_frame_per_block=3, local_attn_size=4, sink_size=2)


def test_apply_without_streaming_leaves_model_untouched(model):
    processors = [b.attn1.processor for b in model.blocks]
    with hfpatch.apply(model) as patch:
        assert [b.attn1.processor for b in model.blocks] == processors
        assert "forward" not in vars(model) and not any("processor" in e for e in patch.entries())


def test_apply_wrong_streaming_type_raises_before_mutation(model):
    before = dict(vars(model))
    with pytest.raises(
        TypeError, match="streaming must be an hfpatch.streaming.StreamingConfig or None, got str"
    ):
        hfpatch.apply(model, streaming="yes")
    assert dict(vars(model)) == before


@pytest.mark.parametrize(
    ("parallel", "options", "message"),
    [
        (ParallelConfig(cfg=2), {}, "StreamingWanPipeline runs CFG-parallel itself"),
        (ParallelConfig(pipefusion=2), {}, "does not run under PipeFusion"),
        (ParallelConfig(data=2), {}, "leaves nothing to split"),
        (ParallelConfig(ulysses=2), {"compile": True}, "runs eagerly"),
    ],
)
def test_validate_streaming_with_unsupported_parallel_raises(model, parallel, options, message):
    config = StreamingConfig(num_frame_per_block=2, **options)
    with pytest.raises(ValueError, match=message):
        WanStreamingPatch().validate(model, parallel, {"streaming": config, "check_inputs": True})


@pytest.mark.parametrize(
    "parallel", [ParallelConfig(ulysses=2), ParallelConfig(ring=3), ParallelConfig(data=2, ring=2)]
)
def test_validate_streaming_with_sequence_parallel_passes(model, parallel):
    WanStreamingPatch().validate(model, parallel, {"streaming": CONFIGS["global"], "check_inputs": True})


def test_streaming_replaces_the_dit_family_and_refuses_its_options(model):
    """With streaming= the streaming family runs the split itself: the DiT family is dropped, and an option only
    it takes would do nothing, so it is refused (before any mutation)."""
    assert WanStreamingPatch().supersedes({"streaming": CONFIGS["global"], "check_inputs": True}) == {
        "dit_usp"
    }
    assert WanStreamingPatch().supersedes({"streaming": None, "check_inputs": True}) == frozenset()
    before = dict(vars(model))
    with pytest.raises(TypeError, match=r"'compile' .*wan_streaming replaces dit_usp"):
        hfpatch.apply(model, streaming=CONFIGS["global"], compile=True)
    assert dict(vars(model)) == before
    with hfpatch.apply(model, streaming=CONFIGS["global"]) as patch:
        assert "streaming" in patch.options and "compile" not in patch.options


def test_validate_streaming_with_vae_parallel_only_passes(model):
    WanStreamingPatch().validate(
        model, ParallelConfig(vae=2), {"streaming": CONFIGS["global"], "check_inputs": True}
    )


def test_validate_image_to_video_transformer_raises():
    i2v = tiny_wan_transformer(image_dim=8, added_kv_proj_dim=32)
    with pytest.raises(ValueError, match="text-to-video WanTransformer3DModel only"):
        hfpatch.apply(i2v, streaming=CONFIGS["global"])


def test_apply_twice_same_options_returns_live_patch_different_raises(model):
    with hfpatch.apply(model, streaming=CONFIGS["global"]) as patch:
        assert hfpatch.apply(model, streaming=CONFIGS["global"]) is patch
        with pytest.raises(ValueError, match="already patched"):
            hfpatch.apply(model, streaming=CONFIGS["window_sink"])


def test_remove_restores_every_submodule_by_identity():
    model = tiny_wan_transformer()
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    x, timestep, prompt = _inputs(frames=4)
    patch = hfpatch.apply(model, streaming=CONFIGS["window_sink"])
    assert "streaming" in repr(patch) and "processor" in patch.describe()
    with torch.no_grad():
        _cached(model, CONFIGS["window_sink"], x, timestep, prompt)
    patch.remove()
    after = {name: dict(vars(m)) for name, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name].keys() == before[name].keys(), name
        assert all(after[name][k] is v for k, v in before[name].items()), name


def test_forward_with_gradient_checkpointing_under_grad_raises():
    model = tiny_wan_transformer()
    model.enable_gradient_checkpointing()
    x, timestep, prompt = _inputs(frames=2)
    with hfpatch.apply(model, streaming=CONFIGS["global"]):
        with pytest.raises(ValueError, match="does not support gradient checkpointing yet"):
            model(x, timestep, prompt)
        with torch.no_grad():
            assert model(x, timestep, prompt).sample.shape == x.shape


def test_cached_forward_gradients_flow_through_current_block_only(model):
    config = CONFIGS["window_sink"]
    x, timestep, prompt = _inputs(frames=4)
    x = x.requires_grad_()
    with hfpatch.apply(model, streaming=config):
        cache = StreamingKVCache(config, len(model.blocks))
        first = model(x[:, :, :2], timestep[:, :2], prompt, kv_cache=cache).sample
        second = model(x[:, :, 2:], timestep[:, 2:], prompt, kv_cache=cache, frame_offset=2).sample
    (grad,) = torch.autograd.grad(second.sum(), x)
    # Exact zero: no graph path from the first frames to the second block (not a rounding question).
    assert grad[:, :, :2].abs().max() == 0 and grad[:, :, 2:].abs().max() > 0  # cached K/V are detached
    assert first.requires_grad and all(k.grad_fn is None for k in cache.keys)
