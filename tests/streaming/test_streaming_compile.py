"""Compiled streaming: ``StreamingConfig(compile=True)``, the decode overlapped with the next block, the cache reused.

The cached block forward has static shapes (every block attends to the whole preallocated cache, the slots it
may not see masked out; no mask once the window is full), so a whole stream runs on two compiled graphs: the
warm-up blocks and the steady blocks, each compiled once. Checked over 10 blocks of 3 denoising steps plus the
context pass each (40 transformer calls): no graph break (``torch._dynamo.explain`` of the exact function the
patch compiles, in the exact call state), no recompilation (``error_on_recompile``), two graphs, and outputs
equal to the eager forward bit for bit (the ``eager``-style backend runs the traced torch ops: the same kernels
on the same values). The one inductor test (C++ kernels: slow to build on a 2-core CPU) runs the steady graph
only and compares within the reassociation tolerance of the eager forward's own fp32 noise.
"""

from __future__ import annotations

import pytest
import torch

import hfpatch
import hfpatch.streaming.pipeline as streaming_pipeline
import hfpatch.streaming.transformer as wan_streaming
from hfpatch.core.compile import fresh_copy
from hfpatch.streaming import StreamingConfig, StreamingKVCache, StreamingWanPipeline
from hfpatch.testing import tiny_wan_pipe, tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

WINDOW = dict(num_frame_per_block=2, local_attn_size=6, sink_size=2)  # every slot visible from block 2 on
STEPS = (1000.0, 600.0, 300.0)
KWARGS = dict(height=16, width=32, denoising_step_list=STEPS, context_noise=50, output_type="latent")


def _recording_backend(graphs: list):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward  # run the traced torch ops as they are (what the "eager" backend does)

    return backend


def _explaining(monkeypatch) -> dict:
    """Replace the patch's compiled_variant by ``torch._dynamo.explain`` of the very function it would compile,
    run at the first call of each kind, in that call's state (then the function runs eagerly). explain resets
    dynamo's caches, so this is a pass of its own, apart from the compiled runs that count graphs."""
    explained: dict = {}

    def compiled_variant(fn, tag, **options):
        def run(*args):
            if tag not in explained:  # writes this block's cache slots; fn then writes the same values again
                explained[tag] = torch._dynamo.explain(fresh_copy(fn, f"explain {tag}"))(*args)
            return fn(*args)

        return run

    monkeypatch.setattr(wan_streaming, "compiled_variant", compiled_variant)
    return explained


def test_compiled_stream_two_graphs_no_break_no_recompile_equals_eager(monkeypatch):
    pipe = tiny_wan_pipe()
    stream = StreamingWanPipeline.from_pipe(pipe, StreamingConfig(**WINDOW))
    eager = list(stream.stream(wan_prompt_embeds(), 10, generator=torch.Generator().manual_seed(0), **KWARGS))
    stream.remove()

    with monkeypatch.context() as m:  # what each kind of block compiles: no graph break
        explained = _explaining(m)
        stream = StreamingWanPipeline.from_pipe(pipe, StreamingConfig(**WINDOW, compile=True))
        try:
            list(stream.stream(wan_prompt_embeds(), 3, generator=torch.Generator().manual_seed(0), **KWARGS))
        finally:
            stream.remove()
    assert sorted(explained) == ["wan streaming steady", "wan streaming warmup"]
    assert [e.graph_break_count for e in explained.values()] == [0, 0]
    assert [e.graph_count for e in explained.values()] == [1, 1]

    graphs: list = []
    config = StreamingConfig(**WINDOW, compile=True, compile_backend=_recording_backend(graphs))
    stream = StreamingWanPipeline.from_pipe(pipe, config)
    try:
        torch._dynamo.reset()
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled = list(
                stream.stream(wan_prompt_embeds(), 10, generator=torch.Generator().manual_seed(0), **KWARGS)
            )
            cache = stream.cache
            # A second stream reuses the cache's buffers (reset, same addresses) and the same two graphs.
            again = list(
                stream.stream(wan_prompt_embeds(), 3, generator=torch.Generator().manual_seed(0), **KWARGS)
            )
    finally:
        stream.remove()
    # 10 blocks x (3 steps + context pass) = 40 calls: the first allocates the cache (eager), blocks 0-1 see
    # part of the cache (warm-up graph), blocks 2-9 all of it (steady graph).
    assert len(graphs) == 2
    for a, b in zip(eager, compiled):
        assert torch.equal(a.latents, b.latents), a.block_index  # same kernels, same values: exact
    assert stream.cache is cache and all(torch.equal(a.latents, b.latents) for a, b in zip(compiled, again))


def test_compiled_block_forward_with_autograd_is_its_own_graph_and_equals_eager():
    # Streaming training calls the transformer with a graph at a block's exit step: another kind of call
    # (autograd on), compiled once; gradients reach the block's own keys/values only, as in eager mode.
    model = tiny_wan_transformer()
    x = torch.randn(1, 4, 8, 4, 4, generator=torch.Generator().manual_seed(3))
    prompt = wan_prompt_embeds()
    results = []
    graphs: list = []
    for config in (
        StreamingConfig(**WINDOW),
        StreamingConfig(**WINDOW, compile=True, compile_backend=_recording_backend(graphs)),
    ):
        torch._dynamo.reset()
        with hfpatch.apply(model, streaming=config), torch._dynamo.config.patch(error_on_recompile=True):
            cache = StreamingKVCache(config, len(model.blocks))
            grads = []
            for s in range(0, 8, 2):
                with torch.no_grad():  # the earlier denoising steps: no graph
                    model(x[:, :, s : s + 2], torch.tensor([900.0]), prompt, kv_cache=cache, frame_offset=s)
                leaf = x[:, :, s : s + 2].clone().requires_grad_()
                out = model(leaf, torch.tensor([400.0]), prompt, kv_cache=cache, frame_offset=s).sample
                grads.append(
                    torch.autograd.grad(out.square().sum(), [leaf, model.blocks[0].attn1.to_k.weight])
                )
            results.append(grads)
    # Kinds met: warm-up without and with autograd, steady without and with (the cache is full from block 2).
    assert len(graphs) == 4
    for eager, compiled in zip(*results):
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_compile_options_are_checked():
    with pytest.raises(ValueError, match="set compile=True too"):
        StreamingConfig(cuda_graphs=True)
    with pytest.raises(ValueError, match="unknown compile_backend 'inductr'"):
        StreamingConfig(compile=True, compile_backend="inductr")
    with pytest.raises(ValueError, match="needs compile_backend='inductor'|use 'inductor'"):
        StreamingConfig(compile=True, compile_backend="aot_eager", cuda_graphs=True)
    with pytest.raises(ValueError, match="compile must be a bool"):
        StreamingConfig(compile="yes")


def test_cuda_graphs_on_a_cpu_model_raise_before_any_work():
    model = tiny_wan_transformer()
    config = StreamingConfig(**WINDOW, compile=True, cuda_graphs=True)
    with hfpatch.apply(model, streaming=config), torch.no_grad():
        cache = StreamingKVCache(config, len(model.blocks))
        with pytest.raises(
            ValueError, match="cuda_graphs=True captures CUDA graphs, but the model runs on cpu"
        ):
            model(torch.randn(1, 4, 2, 4, 4), torch.tensor([500.0]), wan_prompt_embeds(), kv_cache=cache)
    assert cache.keys is None and cache.frames() == []  # nothing ran, nothing was written


class _DeferredInline(streaming_pipeline._InlineDecode):
    """The side-stream schedule on CPU: a block's frames are handed out after the next block is queued."""

    deferred = True
    log: list = []

    def submit(self, x0):
        self.log.append("decode")
        return super().submit(x0)


def test_overlapped_decode_yields_every_block_in_order_after_the_next_block_is_queued(monkeypatch):
    stream = StreamingWanPipeline.from_pipe(tiny_wan_pipe(), StreamingConfig(**WINDOW))
    kwargs = {**KWARGS, "output_type": "pt"}
    try:
        inline = list(
            stream.stream(wan_prompt_embeds(), 4, generator=torch.Generator().manual_seed(0), **kwargs)
        )
        log = _DeferredInline.log = []
        monkeypatch.setattr(streaming_pipeline, "_decode_runner", lambda device, overlap: _DeferredInline)
        real_forward = stream.transformer.forward
        monkeypatch.setattr(
            stream.transformer,
            "forward",
            lambda *a, **k: (log.append("transformer"), real_forward(*a, **k))[1],
        )
        overlapped = []
        for out in stream.stream(
            wan_prompt_embeds(), 4, generator=torch.Generator().manual_seed(0), **kwargs
        ):
            log.append(f"yield {out.block_index}")
            overlapped.append(out)
    finally:
        monkeypatch.undo()
        stream.remove()
    assert [o.block_index for o in overlapped] == [0, 1, 2, 3]
    for a, b in zip(inline, overlapped):
        assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames)
    # Block k is yielded after block k + 1's transformer calls (3 steps + the context pass) were queued.
    calls = [entry for entry in log if entry != "decode"]
    per_block = ["transformer"] * len(STEPS) + ["transformer"]
    assert calls == per_block + per_block + ["yield 0"] + per_block + ["yield 1"] + per_block + [
        "yield 2",
        "yield 3",
    ]


def test_overlap_decode_on_cpu_decodes_in_line():
    assert streaming_pipeline._decode_runner(torch.device("cpu"), True) is streaming_pipeline._InlineDecode
    assert (
        streaming_pipeline._decode_runner(torch.device("cuda"), True) is streaming_pipeline._SideStreamDecode
    )
    assert streaming_pipeline._decode_runner(torch.device("cuda"), False) is streaming_pipeline._InlineDecode


def test_inductor_compiled_steady_block_equals_eager_within_reassociation():
    # The one inductor test (C++ kernels built on the CPU): a window that is full from the first block on
    # (window = block), one layer, so one graph is built; the first call allocates the cache eagerly.
    config = dict(num_frame_per_block=2, local_attn_size=2)
    model = tiny_wan_transformer(num_layers=1)
    model64 = to_fp64(model)
    x = torch.randn(1, 4, 8, 4, 4, generator=torch.Generator().manual_seed(5))
    prompt = wan_prompt_embeds()
    outs = {}
    for name, net, options in (
        ("eager", model, {}),
        ("inductor", model, {"compile": True}),
        ("fp64", model64, {}),
    ):
        torch._dynamo.reset()
        with hfpatch.apply(net, streaming=StreamingConfig(**config, **options)), torch.no_grad():
            with torch._dynamo.config.patch(error_on_recompile=True):
                cache = StreamingKVCache(StreamingConfig(**config), len(net.blocks))
                xs, p = (x.double(), prompt.double()) if name == "fp64" else (x, prompt)
                outs[name] = torch.cat(
                    [
                        net(
                            xs[:, :, s : s + 2], torch.tensor([700.0]), p, kv_cache=cache, frame_offset=s
                        ).sample
                        for s in range(0, 8, 2)
                    ],
                    dim=2,
                )
    tol = reassociation_tol(rounding_noise(outs["eager"], outs["fp64"]))
    error = rel_error(outs["inductor"], outs["eager"])
    print(f"inductor vs eager: {error:.2e} / {tol:.2e}")
    assert error <= tol
