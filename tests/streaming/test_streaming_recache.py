"""Prompt-switch recache and context pass against a LongLive-style reference on the stock Wan transformer.

The reference (:class:`LongLiveReference`) is written from the description of LongLive 1.0's interactive
inference (``pipeline/interactive_causal_inference.py``, ``_recache_after_switch``, and the KV cache of
``wan/modules/causal_model.py``), not from hfpatch: it runs the *unpatched* ``WanTransformer3DModel`` with a
test processor that attends to explicitly given key/value tensors, keeps LongLive's linear cache (sink entries
first, window entries after, a new block rolls the oldest window entries out) and rebuilds it at a switch:

* the newest ``min(local_attn_size, frames so far)`` clean frames run in one forward at timestep
  ``context_noise`` under the new prompt, every query seeing the whole chunk (no block mask);
* ``global_sink=True``: the sink entries (encoded under the old prompt) are kept and attended; the chunk's
  newest ``cache entries - sink`` frames provide the keys and overwrite the window entries; its older frames
  are queries only;
* ``global_sink=False``: the cache is cleared and the whole chunk provides the keys and the new entries, so
  its first ``sink_size`` frames become the sink.

Tolerances: hfpatch and the reference compute the same function with sums in other orders (cached keys read
from slot buffers in another order, attention over other lengths, the rotary table built on the fly instead
of sliced from the stock table), so outputs agree to reassociation_tol of the reference's own fp32-vs-fp64
noise (the same reference in fp64 on the same weights and the same random draws), relative to the
reference's largest magnitude. Cache slots that must not change are compared exactly (untouched memory).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hfpatch
from hfpatch.streaming import StreamingConfig, StreamingKVCache, StreamingWanPipeline, recache
from hfpatch.testing import tiny_wan_pipe, wan_prompt_embeds
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

SINK, WINDOW, BLOCK = 3, 12, 3  # LongLive 1.0's released sink_size and local_attn_size, in blocks of 3
CONFIG = StreamingConfig(num_frame_per_block=BLOCK, local_attn_size=WINDOW, sink_size=SINK)
STEPS, CONTEXT_NOISE = (1000, 600, 300), 50
HEIGHT = WIDTH = 32  # latents 4 x 4, 4 tokens per frame (patch 1 x 2 x 2)
# (config, switch block, blocks): the switch comes after eviction has started (sink 3 / window 12 / block 3:
# frame 12 takes the slot of frame 3, so by the switch at frame 18 frames 3..8 are gone). The second case
# has a window of 8 frames that is not whole blocks: the global-sink recache starts mid-block (frame 7).
CASES = {
    "sink3_window12_block3": (CONFIG, 6, 8),
    "window_not_whole_blocks": (
        StreamingConfig(num_frame_per_block=3, local_attn_size=10, sink_size=2),
        5,
        7,
    ),
}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding (pairs of channels rotated by the table's angles)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class _ExplicitKVSelfAttention:
    """``attn1`` processor: the queries attend to ``ref.prefix[layer]`` plus the call's own keys/values, from
    own frame ``ref.skip`` on (earlier own frames are queries only); the own keys/values are kept per frame."""

    def __init__(self, ref: LongLiveReference, layer: int) -> None:
        self.ref, self.layer = ref, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        tpf = self.ref.tokens_per_frame
        self.ref.own[self.layer] = list(zip(k.split(tpf, 1), v.split(tpf, 1)))
        prefix = self.ref.prefix[self.layer]
        keys = torch.cat([e[0] for e in prefix] + [k[:, self.ref.skip * tpf :]], 1)
        values = torch.cat([e[1] for e in prefix] + [v[:, self.ref.skip * tpf :]], 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2, 3).type_as(q)))


class LongLiveReference:
    """LongLive 1.0 interactive inference (block loop, context pass, sink + rolling window cache, recache
    after a prompt switch) on a stock ``WanTransformer3DModel``, written from its description.

    ``entries[layer]`` is LongLive's per-layer cache: one ``(key, value)`` per frame, in buffer order, at most
    ``window`` of them, the first ``sink`` being the sink; ``frames`` names the frame of each entry. Rotary
    positions are absolute (LongLive's ``causal_rope_apply`` from ``current_start``): the stock table rows of
    the input's frames, taken from the stock rope of a longer dummy input.
    """

    def __init__(self, model, sink: int, window: int, block: int, num_train_timesteps: int = 1000) -> None:
        self.model, self.sink, self.window, self.block = model, sink, window, block
        self.num_train_timesteps = num_train_timesteps
        layers = len(model.blocks)
        self.entries: list[list] = [[] for _ in range(layers)]
        self.frames: list[int] = []
        self.prefix: list[list] = [[] for _ in range(layers)]
        self.own: list[list] = [[] for _ in range(layers)]
        self.skip = self.offset = 0
        self.tokens_per_frame = 0
        for i, b in enumerate(model.blocks):
            b.attn1.set_processor(_ExplicitKVSelfAttention(self, i))
        stock_rope = type(model.rope).forward.__get__(model.rope)  # not an earlier reference's wrapper

        def rope_at_offset(hidden_states):
            b, c, f, h, w = hidden_states.shape
            cos, sin = stock_rope(hidden_states.new_empty(b, c, self.offset + f, h, w))
            tokens = f * self.tokens_per_frame
            return cos[:, -tokens:], sin[:, -tokens:]

        model.rope.forward = rope_at_offset

    def forward(self, x, t: float, prompt, offset: int, keep: list[int], skip: int = 0) -> torch.Tensor:
        """The model's prediction for ``x`` (frames from ``offset``) attending to the cache entries ``keep``
        and to its own frames from ``skip`` on; its own keys/values are left in ``self.own``."""
        _, p_h, p_w = self.model.config.patch_size
        self.tokens_per_frame = (x.shape[3] // p_h) * (x.shape[4] // p_w)
        self.offset, self.skip = offset, skip
        self.prefix = [[layer[j] for j in keep] for layer in self.entries]
        timestep = torch.full((x.shape[0],), float(t), dtype=x.dtype)
        return self.model(x, timestep, prompt, return_dict=False)[0]

    def _rolled(self, new_frames: int) -> list[int]:
        """Entries left when ``new_frames`` are appended: the oldest window entries roll out (sink kept)."""
        overflow = len(self.frames) + new_frames - self.window
        everything = list(range(len(self.frames)))
        return everything if overflow <= 0 else everything[: self.sink] + everything[self.sink + overflow :]

    def recache(self, output: torch.Tensor, prompt, current: int, context_noise: float, global_sink: bool):
        """LongLive's ``_recache_after_switch`` at frame ``current`` over the clean latents ``output``."""
        count = min(self.window, current)
        chunk = output[:, :, current - count : current]
        local_end = len(self.frames)  # LongLive's local_end_index: the recache keeps it
        assert local_end == count
        if global_sink:  # the sink entries stay (old prompt); the chunk's newest frames rewrite the window
            keep, write_from = list(range(self.sink)), count - (local_end - self.sink)
        else:  # cleared: the whole chunk rewrites every entry
            keep, write_from = [], 0
        self.forward(chunk, context_noise, prompt, current - count, keep, skip=write_from)
        self.entries = [
            [layer[j] for j in keep] + own[write_from:] for layer, own in zip(self.entries, self.own)
        ]
        self.frames = [self.frames[j] for j in keep] + list(range(current - count + write_from, current))

    def generate(
        self, schedule, num_blocks, steps, context_noise, generator, global_sink, dtype=torch.float32
    ):
        """Clean latents of every block (draws made in fp32 and cast, as the fp32 pipeline draws them)."""
        output, prompt_index = [], 0
        for block in range(num_blocks):
            offset = block * self.block
            if prompt_index + 1 < len(schedule) and schedule[prompt_index + 1][0] == block:
                prompt_index += 1
                self.recache(
                    torch.cat(output, 2), schedule[prompt_index][1], offset, context_noise, global_sink
                )
            prompt = schedule[prompt_index][1]
            keep = self._rolled(self.block)
            x = torch.randn((1, 4, self.block, HEIGHT // 8, WIDTH // 8), generator=generator).to(dtype)
            for i, t in enumerate(steps):
                x0 = x - (t / self.num_train_timesteps) * self.forward(x, t, prompt, offset, keep)
                if i + 1 < len(steps):
                    sigma = steps[i + 1] / self.num_train_timesteps
                    x = (1 - sigma) * x0 + sigma * torch.randn(x0.shape, generator=generator).to(dtype)
            self.forward(x0, context_noise, prompt, offset, keep)  # context pass: clean x0 at context_noise
            self.entries = [[layer[j] for j in keep] + own for layer, own in zip(self.entries, self.own)]
            self.frames = [self.frames[j] for j in keep] + list(range(offset, offset + self.block))
            output.append(x0)
        return torch.cat(output, 2)


def _prompts(switch: int, dtype=torch.float32):
    return [(0, wan_prompt_embeds().to(dtype)), (switch, wan_prompt_embeds(seed=5).to(dtype))]


def _reference(model, config, switch, num_blocks, global_sink, dtype=torch.float32):
    ref = LongLiveReference(model, config.sink_size, config.local_attn_size, config.num_frame_per_block)
    with torch.no_grad():
        latents = ref.generate(
            _prompts(switch, dtype),
            num_blocks,
            STEPS,
            CONTEXT_NOISE,
            torch.Generator().manual_seed(0),
            global_sink,
            dtype,
        )
    return latents, ref


@pytest.mark.parametrize("global_sink", [True, False], ids=["global_sink", "new_sink"])
@pytest.mark.parametrize("case", list(CASES))
def test_post_switch_blocks_equal_longlive_reference(case, global_sink):
    """Blocks after a switch once eviction has started equal the LongLive-style reference, for both sink
    settings; so do the blocks before it (same cache geometry), and the cache ends with LongLive's frames."""
    config, switch, num_blocks = CASES[case]
    pipe = tiny_wan_pipe()
    stock = copy.deepcopy(pipe.transformer)
    stream = StreamingWanPipeline.from_pipe(pipe, config)
    try:
        actual, _ = stream(
            _prompts(switch),
            num_blocks,
            HEIGHT,
            WIDTH,
            denoising_step_list=STEPS,
            context_noise=CONTEXT_NOISE,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
            global_sink=global_sink,
        )
        frames = stream.cache.frames()
    finally:
        stream.remove()
    expected, ref = _reference(stock, config, switch, num_blocks, global_sink)
    exact, _ = _reference(to_fp64(stock), config, switch, num_blocks, global_sink, torch.float64)
    other, _ = _reference(stock, config, switch, num_blocks, not global_sink)
    assert frames == sorted(ref.frames)
    current = switch * config.num_frame_per_block  # the sink: the stream's first frames, or the chunk's
    first = 0 if global_sink else current - config.local_attn_size
    assert ref.frames[: config.sink_size] == list(range(first, first + config.sink_size))

    before, after = slice(0, current), slice(current, None)
    tol_before = reassociation_tol(rounding_noise(expected[:, :, before], exact[:, :, before]))
    tol = reassociation_tol(rounding_noise(expected[:, :, after], exact[:, :, after]))
    error_before = rel_error(actual[:, :, before], expected[:, :, before])
    error = rel_error(actual[:, :, after], expected[:, :, after])
    # The two sink settings give other post-switch blocks (O(1e-2)): the check tells them apart.
    apart = rel_error(other[:, :, after], expected[:, :, after])
    print(
        f"{case}: before {error_before:.2e} / {tol_before:.2e}; after {error:.2e} / {tol:.2e}; "
        f"other sink setting {apart:.2e}"
    )
    assert error_before <= tol_before
    assert error <= tol
    assert apart > 100 * tol


def _stream_cache(model, x, prompt, frames: int) -> StreamingKVCache:
    """A cache holding ``frames`` frames of ``x`` written block by block at the context timestep."""
    cache = StreamingKVCache(CONFIG, len(model.blocks))
    with torch.no_grad():
        for s in range(0, frames, BLOCK):
            model(x[:, :, s : s + BLOCK], torch.tensor([50.0]), prompt, kv_cache=cache, frame_offset=s)
    return cache


def _cached_entries(cache: StreamingKVCache, frames: list[int], dtype=torch.float32) -> list[list]:
    """Per layer, the cached ``(key, value)`` of each of ``frames`` (read from its slot)."""
    tpf = cache.tokens_per_frame
    tokens = [slice(cache.slot(f) * tpf, (cache.slot(f) + 1) * tpf) for f in frames]
    return [
        [(k[:, t].to(dtype), v[:, t].to(dtype)) for t in tokens] for k, v in zip(cache.keys, cache.values)
    ]


def _stacked(entries: list, index: int) -> torch.Tensor:
    return torch.cat([e[index] for e in entries], 1)


@pytest.mark.parametrize("global_sink", [True, False], ids=["global_sink", "new_sink"])
def test_recache_keeps_the_sink_and_rewrites_the_window_in_one_chunk(global_sink):
    """After 18 frames (sink 0..2, window 9..17: frames 3..8 evicted), ``recache`` of the newest 12 frames
    (6..17) under a new prompt. With a global sink the sink slots are untouched and frames 9..17 hold the keys
    and values of one chunk that sees the old sink and itself whole; without, the chunk 6..17 runs from an
    empty cache and frames 6..8 are the new sink. Either way the slots equal the LongLive-style reference."""
    pipe = tiny_wan_pipe()
    model, stock = pipe.transformer, copy.deepcopy(pipe.transformer)
    x = torch.randn(1, 4, 18, 4, 4, generator=torch.Generator().manual_seed(3))
    old, new = wan_prompt_embeds(), wan_prompt_embeds(seed=5)
    with hfpatch.apply(model, streaming=CONFIG):
        cache = _stream_cache(model, x, old, 18)
        before = copy.deepcopy(cache)
        recache(
            model, cache, x[:, :, 6:], new, frame_offset=6, context_timestep=50.0, global_sink=global_sink
        )
        # The same recache with the newest frame changed: in one unmasked chunk the oldest frame sees it.
        changed = copy.deepcopy(before)
        x_changed = x.clone()
        x_changed[:, :, 17] += 1
        recache(model, changed, x_changed[:, :, 6:], new, 6, 50.0, global_sink=global_sink)
    assert before.frames() == [0, 1, 2, *range(9, 18)]  # eviction has started

    refs = []
    for transformer, dtype in ((stock, torch.float32), (to_fp64(stock), torch.float64)):
        ref = LongLiveReference(transformer, SINK, WINDOW, BLOCK)
        ref.tokens_per_frame = cache.tokens_per_frame
        ref.frames, ref.entries = before.frames(), _cached_entries(before, before.frames(), dtype)
        with torch.no_grad():
            ref.recache(x.to(dtype), new.to(dtype), 18, 50.0, global_sink)
        refs.append(ref)
    ref, ref64 = refs
    new_sink = [0, 1, 2] if global_sink else [6, 7, 8]
    assert ref.frames == new_sink + list(range(9, 18)) and cache.frames() == sorted(ref.frames)
    assert cache.start == new_sink[0]

    rewritten = slice(0 if not global_sink else SINK, None)  # entries the recache wrote (reference order)
    actual, old_entries = _cached_entries(cache, ref.frames), _cached_entries(before, ref.frames)
    for layer in range(len(cache.keys)):
        if global_sink:  # exact: the recache never wrote the sink slots
            for got, kept in zip(actual[layer][:SINK], old_entries[layer][:SINK]):
                assert torch.equal(got[0], kept[0]) and torch.equal(got[1], kept[1])
        for index, what in ((0, "keys"), (1, "values")):
            got = _stacked(actual[layer][rewritten], index)
            expected = _stacked(ref.entries[layer][rewritten], index)
            exact = _stacked(ref64.entries[layer][rewritten], index)
            tol = reassociation_tol(rounding_noise(expected, exact))
            error = rel_error(got, expected)
            print(f"layer {layer} {what}: {error:.2e} / {tol:.2e}")
            assert error <= tol
            if layer > 0:  # under the new prompt (layer 0 has seen no text yet): far beyond rounding
                assert rel_error(actual[layer][-1][index], old_entries[layer][-1][index]) > 1e3 * tol
    # One chunk without a block mask: frame 9 (the oldest window frame) sees frame 17 from layer 1 on, far
    # beyond rounding; its layer-0 keys come from frame 9 alone (exact: same inputs, same shapes).
    key9 = [layer[0][0] for layer in _cached_entries(cache, [9])]
    key9_changed = [layer[0][0] for layer in _cached_entries(changed, [9])]
    assert torch.equal(key9_changed[0], key9[0])
    assert rel_error(key9_changed[1], key9[1]) > 1e-3


def test_recache_errors():
    model = tiny_wan_pipe().transformer
    x, prompt = torch.randn(1, 4, 18, 4, 4), wan_prompt_embeds()
    with hfpatch.apply(model, streaming=CONFIG), torch.no_grad():
        cache = _stream_cache(model, x, prompt, 18)
        with pytest.raises(ValueError, match="latents end at frame 14, the cache at frame 17"):
            recache(model, cache, x[:, :, 3:15], prompt, frame_offset=3)
        with pytest.raises(ValueError, match="pass kv_cache="):
            model(x[:, :, :3], torch.tensor([0.0]), prompt, recache=True)
        # 10 non-sink frames do not fit the 9 window slots together.
        with pytest.raises(ValueError, match="do not fit the cache together"):
            model(x[:, :, 8:18], torch.tensor([0.0]), prompt, kv_cache=cache, frame_offset=8, recache=True)
        # A chunk that leaves a visible frame uncached (frames 9, 10 are gone after a reset).
        cache.reset()
        model(x[:, :, :3], torch.tensor([0.0]), prompt, kv_cache=cache, frame_offset=0)
        with pytest.raises(ValueError, match=r"frames \[9, 10\] are visible from the chunk 11..17"):
            model(x[:, :, 11:18], torch.tensor([0.0]), prompt, kv_cache=cache, frame_offset=11, recache=True)
