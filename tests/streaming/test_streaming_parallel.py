"""Streaming under sequence parallelism: every rank equals one process (frames, CFG, gradients), caches are 1/N.

One ``pool.run`` per world runs every case of that world on its ranks and returns the results; the one-process
references are computed here, once per latent size, and compared with every rank's result:

* world 2, Ulysses 2 (and ``cfg=2`` alone): 32x32 pixels, 4 tokens per latent frame;
* world 3, Ring 3: 48x48 pixels, 9 tokens per frame (a third of every frame on each rank); plus Ulysses 3 over 4
  heads (uneven: 2, 1, 1) at 4 tokens per frame (padded to 6) for the transformer's cached forward;
* world 4, Ulysses 2 x Ring 2 (and ``cfg=2`` x Ulysses 2): 32x32 pixels.

Tolerances: the split computes the same function as one process with sums in other orders (attention over head
or token shards merged by their log-sum-exp, GEMMs over fewer rows, the VAE's convs over row shards, gradients
summed over ranks), so every comparison allows reassociation_tol of the one-process computation's own
fp32-vs-fp64 noise (the same computation in fp64 on the same weights and random draws), relative to the
reference's largest magnitude. Bytes (cache and communication) are integers, compared exactly.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.streaming import (
    StreamingConfig,
    StreamingKVCache,
    StreamingTrainingModel,
    StreamingWanPipeline,
    recache,
)
from hfpatch.streaming.sequence_parallel import (
    block_bytes,
    contiguous_layout,
    frame_layout,
    ring_block_tokens,
)
from hfpatch.testing import tiny_wan_pipe, tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

CONFIG = StreamingConfig(num_frame_per_block=2, local_attn_size=6, sink_size=2)
BLOCKS, SWITCH = 5, 3  # frame 6 (block 3) evicts frame 2: the switch comes after eviction has started
KWARGS = dict(denoising_step_list=(1000, 500), context_noise=50)
GUIDANCE = 3.0
CHUNK = 6  # latent frames of the training chunk without a cache (3 blocks)


def _prompts(seed: int = 1) -> list[tuple[int, torch.Tensor]]:
    return [(0, wan_prompt_embeds(seed=seed)), (SWITCH, wan_prompt_embeds(seed=seed + 4))]


def _negative() -> torch.Tensor:
    return wan_prompt_embeds(seed=9)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ----------------------------------------------------------------------------------------------- one process
def _stream(stream, size: int, output_type: str, guidance: float = 1.0, cast=None) -> dict:
    prompts = _prompts()
    negative = _negative() if guidance > 1 else None
    if cast is not None:
        prompts = [(b, p.to(cast)) for b, p in prompts]
        negative = None if negative is None else negative.to(cast)
    latents, frames = stream(
        prompts, BLOCKS, size, size, generator=_gen(), output_type=output_type, guidance_scale=guidance,
        negative_prompt_embeds=negative, **KWARGS,
    )  # fmt: skip
    return {"latents": latents, "frames": frames, "cache_bytes": stream.cache.nbytes}


def _fp64_draws():
    """``torch.randn`` drawing fp32 values and casting: the fp64 stream then gets the fp32 stream's noise."""
    real = torch.randn

    def randn(*args, dtype=None, **kw):
        noise = real(*args, **kw)
        return noise if dtype is None else noise.to(dtype)

    return pytest.MonkeyPatch.context(), randn


@functools.cache
def _reference(size: int, output_type: str, guidance: float = 1.0) -> tuple[dict, dict]:
    """(fp32 one-process stream, its tolerances by key) of the tiny Wan pipe at ``size`` pixels."""
    stream = StreamingWanPipeline.from_pipe(tiny_wan_pipe(), CONFIG, parallel=1)
    ref = _stream(stream, size, output_type, guidance)
    pipe64 = tiny_wan_pipe()
    pipe64.transformer.double()
    pipe64.vae.double()
    stream64 = StreamingWanPipeline.from_pipe(pipe64, CONFIG, parallel=1)
    context, randn = _fp64_draws()
    with context as m:
        m.setattr(torch, "randn", randn)
        exact = _stream(stream64, size, output_type, guidance, cast=torch.float64)
    tol = {
        k: reassociation_tol(rounding_noise(ref[k], exact[k]))
        for k in ("latents", "frames")
        if ref[k] is not None
    }
    return ref, tol


def _training(model, chunk_x, chunk_t, weight, prompt):
    """Gradients of a loss on a block-causal chunk without a cache, then on a StreamingTrainingModel chunk
    (generated against the cache, a graph at each block's exit step): parameters, and the prompt's."""
    out = {}
    model.zero_grad()
    y = model(chunk_x, chunk_t, prompt).sample
    (y * weight).sum().backward()
    out["chunk"] = [p.grad.clone() for p in model.parameters()]
    out["prompt"] = prompt.grad.clone()
    model.zero_grad()
    trainer = StreamingTrainingModel(
        model, CONFIG, chunk_size=4, min_new_frames=2, denoising_step_list=(1000, 750, 500), seed=3
    )
    trainer.setup_sequence(wan_prompt_embeds().to(chunk_x.dtype), latent_shape=(4, 4, 4), max_length=12)
    gen = _gen()
    trainer.generate_next_chunk(requires_grad=False, generator=gen)  # fills the cache and the overlap
    chunk, info = trainer.generate_next_chunk(requires_grad=True, generator=gen)
    (chunk * weight[:, :, :4] * info.gradient_mask[:, None, :, None, None]).sum().backward()
    out["train"] = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return out


def _training_inputs():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4, CHUNK, 4, 4, generator=gen)
    t = torch.randint(0, 1000, (1, CHUNK), generator=gen).float()
    weight = torch.randn(1, 4, CHUNK, 4, 4, generator=gen)
    return x, t, weight


@functools.cache
def _training_reference() -> tuple[dict, dict]:
    x, t, weight = _training_inputs()
    model = tiny_wan_transformer()
    with hfpatch.apply(model, streaming=CONFIG, parallel=1):
        ref = _training(model, x, t, weight, wan_prompt_embeds().requires_grad_(True))
    model64 = to_fp64(model)
    context, randn = _fp64_draws()
    with context as m, hfpatch.apply(model64, streaming=CONFIG, parallel=1):
        m.setattr(torch, "randn", randn)
        exact = _training(
            model64, x.double(), t, weight.double(), wan_prompt_embeds().double().requires_grad_(True)
        )
    tol = {"prompt": reassociation_tol(rounding_noise(ref["prompt"], exact["prompt"]))}
    for key in ("chunk", "train"):
        tol[key] = [reassociation_tol(rounding_noise(a, b)) for a, b in zip(ref[key], exact[key])]
    return ref, tol


def _cached_transformer(model, x, t, prompt) -> torch.Tensor:
    """Every block of ``x`` through the cache (past the window), then a re-encode under another prompt and one
    more block: the transformer-level cached path, recache included."""
    cache = StreamingKVCache(CONFIG, len(model.blocks))
    frames = x.shape[2]
    with torch.no_grad():
        outs = [
            model(x[:, :, s : s + 2], t[:, s : s + 2], prompt, kv_cache=cache, frame_offset=s).sample
            for s in range(0, frames, 2)
        ]
        other = wan_prompt_embeds(seed=3).to(prompt.dtype)
        recache(model, cache, x[:, :, -6:], other, frame_offset=frames - 6)
        outs.append(model(x[:, :, :2], t[:, :2], other, kv_cache=cache, frame_offset=frames).sample)
    return torch.cat(outs, 2)


def _cached_inputs():
    gen = torch.Generator().manual_seed(7)
    return torch.randn(1, 4, 10, 4, 4, generator=gen), torch.randint(0, 1000, (1, 10), generator=gen).float()


# ----------------------------------------------------------------------------------------------- on the ranks
def _rank_cases(world: str) -> dict:
    """Every case of one world, on every rank (see the module docstring)."""
    import torch.distributed as dist

    from hfpatch.distributed.agreement import InputMismatchError
    from hfpatch.distributed.collectives import count_comm

    rank, out = dist.get_rank(), {}
    plan, size, cfg_plan = {
        "2": (ParallelConfig(ulysses=2), 32, ParallelConfig(cfg=2)),
        "3": (ParallelConfig(ring=3), 48, None),
        "4": (ParallelConfig(ring=2, ulysses=2), 32, ParallelConfig(cfg=2, ulysses=2)),
    }[world]

    stream = StreamingWanPipeline.from_pipe(tiny_wan_pipe(), CONFIG, parallel=plan)
    out["stream"] = _stream(stream, size, "pt")
    # One more cached denoising step on the full window, counted: bytes by collective.
    latent = size // 8
    with count_comm() as counter, torch.no_grad():
        stream.transformer(
            torch.randn(1, 4, 2, latent, latent, generator=_gen()), torch.tensor([500.0]), _prompts()[1][1],
            kv_cache=stream.cache, frame_offset=2 * BLOCKS,
        )  # fmt: skip
    out["block_bytes"] = dict(counter.by_op)
    if world != "3":
        guided = _stream(stream, size, "latent", GUIDANCE)
        out["guided"] = {**guided, "uncond_cache_bytes": stream.uncond_cache.nbytes}
    # A rank fed another prompt raises on every rank, at the stream and at a transformer call (nothing has run:
    # the stream checks its arguments first, the transformer before its first collective).
    prompt = wan_prompt_embeds(seed=1 if rank != 1 else 2)
    for name, call in (
        ("stream", lambda: next(stream.stream(prompt, 2, size, size, generator=_gen(), **KWARGS))),
        ("transformer", lambda: stream.transformer(
            torch.zeros(1, 4, 2, 4, 4), torch.tensor([500.0]), prompt, kv_cache=StreamingKVCache(CONFIG, 2))),
    ):  # fmt: skip
        try:
            call()
            out[f"mismatch_{name}"] = "no error"
        except InputMismatchError as error:
            out[f"mismatch_{name}"] = str(error)
    stream.remove()
    if cfg_plan is not None:
        stream = StreamingWanPipeline.from_pipe(tiny_wan_pipe(), CONFIG, parallel=cfg_plan)
        out["cfg_parallel"] = _stream(stream, size, "latent", GUIDANCE)
        stream.remove()

    x, t, weight = _training_inputs()
    model = tiny_wan_transformer()
    with hfpatch.apply(model, streaming=CONFIG, parallel=plan):
        grads = _training(model, x, t, weight, wan_prompt_embeds().requires_grad_(True))
        for key in ("chunk", "train"):  # the mean over the sp group (what DDP would do): one process's
            for p, g in zip(model.parameters(), grads[key]):
                p.grad = g
            hfpatch.all_reduce_gradients(model)
            grads[key] = [p.grad.clone() for p in model.parameters()]
        out["grads"] = grads

    if world == "3":  # uneven heads (2, 1, 1 of 4) and padded frames (4 tokens in pieces of 2)
        with hfpatch.apply(model, streaming=CONFIG, parallel=ParallelConfig(ulysses=3)):
            out["uneven"] = _cached_transformer(model, *_cached_inputs(), wan_prompt_embeds())

    return out


# ----------------------------------------------------------------------------------------------- checks
def _close(actual, reference, tol: float, what: str) -> None:
    error = rel_error(actual, reference)
    assert error <= tol, f"{what}: relative error {error:.3e} > {tol:.3e}"


def _check_world(results: list[dict], world: int, size: int, sp: tuple[int, int], cfg_parallel: bool) -> None:
    ulysses, ring = sp
    ref, tol = _reference(size, "pt")
    for rank, r in enumerate(results):
        stream = r["stream"]
        # Frames (split VAE decode included) and latents equal one process; every rank holds the same.
        _close(stream["latents"], ref["latents"], tol["latents"], f"rank {rank} latents")
        _close(stream["frames"], ref["frames"], tol["frames"], f"rank {rank} frames")
        assert torch.equal(stream["frames"], results[0]["stream"]["frames"])
        # A rank caches 1/N of every frame (tokens divide here) and of the text: exactly 1/N of the bytes.
        assert stream["cache_bytes"] * world == ref["cache_bytes"], (
            rank,
            stream["cache_bytes"],
            ref["cache_bytes"],
        )
        # Bytes sent by one cached step over the full window: the analytic count of every collective.
        latent_tokens = (size // 16) ** 2
        assert r["block_bytes"] == block_bytes(
            batch=1, frames=2, tokens_per_frame=latent_tokens, heads=4, head_dim=8, layers=2, text_tokens=6,
            visible_frames=CONFIG.cache_frames, out_channels=16, ulysses=ulysses, ring=ring, rank=rank,
        ), rank  # fmt: skip
        # A rank fed another prompt: the same error on every rank, naming the argument, before any work.
        for name, argument in (
            ("stream", "'prompt_embeds': differs"),
            ("transformer", "'encoder_hidden_states': differs"),
        ):
            assert argument in r[f"mismatch_{name}"], (rank, name, r[f"mismatch_{name}"])

    if "guided" in results[0]:
        ref_g, tol_g = _reference(size, "latent", GUIDANCE)
        plain, _ = _reference(size, "latent")
        # Guidance changes the video (O(1e-1) on latents of magnitude ~4, far above rounding).
        assert (ref_g["latents"] - plain["latents"]).abs().max() > 1e-2
        for rank, r in enumerate(results):
            _close(r["guided"]["latents"], ref_g["latents"], tol_g["latents"], f"rank {rank} guided")
            assert r["guided"]["uncond_cache_bytes"] * world == ref["cache_bytes"]
            if cfg_parallel:  # each half of the ranks runs one branch, exchanged per step
                _close(r["cfg_parallel"]["latents"], ref_g["latents"], tol_g["latents"], f"rank {rank} cfg=2")

    tref, ttol = _training_reference()
    for rank, r in enumerate(results):
        grads = r["grads"]
        _close(grads["prompt"], tref["prompt"], ttol["prompt"], f"rank {rank} prompt grad")
        for key in ("chunk", "train"):
            for i, (g, gref, t) in enumerate(zip(grads[key], tref[key], ttol[key])):
                _close(g, gref, t, f"rank {rank} {key} grad {i}")


@pytest.mark.parametrize("layout", [frame_layout, contiguous_layout])
@pytest.mark.parametrize(("tokens_per_frame", "world"), [(4, 2), (5, 2), (9, 3), (4, 3), (5, 4), (1, 4)])
def test_layouts_hold_every_token_once_and_ring_blocks_pad_at_the_end(layout, tokens_per_frame, world):
    """Pure geometry: the ranks' real tokens are every token of the call exactly once; the real tokens of the
    ring blocks are full blocks, then one partial block, then empty ones (what ``valid_len`` masks)."""
    frames = 3
    real_tokens = torch.cat(
        [i[r] for i, r in (layout(frames, tokens_per_frame, world, p) for p in range(world))]
    )
    assert sorted(real_tokens.tolist()) == list(range(frames * tokens_per_frame))
    for ulysses in [u for u in range(1, world + 1) if world % u == 0]:
        real = ring_block_tokens(tokens_per_frame, ulysses, world // ulysses)
        block = ulysses * -(-tokens_per_frame // world)
        assert sum(real) == tokens_per_frame
        partial = [r for r in real if 0 < r < block]
        assert len(partial) <= 1 and real == sorted(real, reverse=True), real


def test_streaming_ulysses2_and_cfg2_equal_one_process(rank_pool):
    results = rank_pool(2).run(_rank_cases, "2")
    _check_world(results, 2, 32, (2, 1), cfg_parallel=True)


def test_streaming_ring3_and_uneven_ulysses3_equal_one_process(rank_pool):
    results = rank_pool(3).run(_rank_cases, "3")
    _check_world(results, 3, 48, (1, 3), cfg_parallel=False)
    x, t = _cached_inputs()
    model = tiny_wan_transformer()
    with hfpatch.apply(model, streaming=CONFIG, parallel=1):
        ref = _cached_transformer(model, x, t, wan_prompt_embeds())
    model64 = to_fp64(model)
    with hfpatch.apply(model64, streaming=CONFIG, parallel=1):
        exact = _cached_transformer(model64, x.double(), t, wan_prompt_embeds().double())
    tol = reassociation_tol(rounding_noise(ref, exact))
    for rank, r in enumerate(results):
        _close(r["uneven"], ref, tol, f"rank {rank} uneven heads")


def test_streaming_ulysses2_ring2_and_cfg2_ulysses2_equal_one_process(rank_pool):
    results = rank_pool(4).run(_rank_cases, "4")
    _check_world(results, 4, 32, (2, 2), cfg_parallel=True)
