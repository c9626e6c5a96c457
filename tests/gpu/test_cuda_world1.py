"""The GPU lane: each capability at world 1 on CUDA, fp32 and bf16. Skipped without a CUDA device.

Run on a GPU machine with ``python -m pytest tests/gpu -q`` (a minute or two on one GPU; ``bash .ci/gpu`` runs it
and ``benchmarks/gpu.py`` in one command). NCCL refuses two ranks on one GPU, so the multi-rank paths run with two
gloo ranks on the one GPU in ``test_cuda_two_ranks.py``; what runs here is every per-rank CUDA path:
the attention kernels (forward, Ring's block backward, every input layout), the ring-degree-1 SDPA path, the
streaming pipeline and training seeded by CPU and CUDA generators, the chunked pixel loss (also a video chunked
over time), GradCache, the row-blocked contrastive losses, and the Wan VAE's frame cache after an
out-of-memory error.

Tolerances: fp32 results against fp64 within ``reassociation_tol`` of the fp32 computation's own noise, or a
stated multiple of fp32 eps; bf16 results against fp64 attention of the same bf16 inputs within the bf16
roundings the kernels make (``u = eps(bf16) / 2`` of the magnitudes each rounding scales; see
``tests/attention/test_local.py``).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn.functional as F

import hfpatch
from hfpatch.attention import ring_attention, usp_attention
from hfpatch.attention.local import available_backends, local_attention, local_attention_backward, to_layout
from hfpatch.testing.tolerance import eps, low_precision_tol, reassociation_tol, rel_error, to_fp64

#: ``HFPATCH_GPU_LANE_DEVICE=cpu`` dry-runs the lane's code on the CPU kernels (to check the tests themselves).
CUDA = torch.device(os.environ.get("HFPATCH_GPU_LANE_DEVICE", "cuda:0"))
pytestmark = pytest.mark.skipif(
    CUDA.type == "cuda" and not torch.cuda.is_available(), reason="the GPU lane needs a CUDA device"
)
DTYPES = [torch.float32, torch.bfloat16]


def _exact(q, k, v, scale):
    s = q.double() @ k.double().mT * scale
    lse = s.logsumexp(-1)
    return (s - lse.unsqueeze(-1)).exp() @ v.double(), lse


def _exact_block_grads(dout, q, k, v, out, lse, scale):
    q, k, v, dout, out, lse = (t.double() for t in (q, k, v, dout, out, lse))
    p = (q @ k.mT * scale - lse.unsqueeze(-1)).exp()
    ds = p * (dout @ v.mT - (dout * out).sum(-1, keepdim=True)) * scale
    return ds @ k, ds.mT @ q, p.mT @ dout


def _grad_bounds(dtype, q, k, v, dout, out, lse, scale) -> tuple[float, float, float]:
    """Largest errors of a kernel's ``(dq, dk, dv)`` of one key block against fp64 (``_bf16_grad_bounds`` of
    ``tests/attention/test_local.py``): it rounds the probabilities ``P``, ``dS`` and its outputs to
    ``dtype`` (``u`` relative each) and reads ``out`` rounded; plus fp32 accumulation."""
    u = eps(dtype) / 2 + 64 * eps(torch.float32)
    q, k, v, dout, out, lse = (t.detach().double() for t in (q, k, v, dout, out, lse))
    p = (q @ k.mT * scale - lse.unsqueeze(-1)).exp()
    ds = p * (dout @ v.mT - (dout * out).sum(-1, keepdim=True))
    err = 2 * u * ds.abs() + u * p * (dout.abs() * out.abs()).sum(-1, keepdim=True)
    dq, dk, dv = scale * ds @ k, scale * ds.mT @ q, p.mT @ dout
    bounds = (scale * err @ k.abs() + u * dq.abs(), scale * err.mT @ q.abs() + u * dk.abs(),
              u * p.mT @ dout.abs() + u * dv.abs())  # fmt: skip
    return tuple(2 * b.max().item() for b in bounds)


def _bound(dtype: torch.dtype, scale: float, roundings: float = 2.0) -> float:
    """``roundings`` roundings of ``dtype`` of ``scale``, plus fp32 accumulation over up to ~10^3 terms."""
    return roundings * eps(dtype) / 2 * scale + 1e3 * eps(torch.float32) * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_cuda_kernel_forward_and_block_backward_for_every_layout(dtype):
    kernels = [k for k in available_backends(CUDA, dtype, 64) if k != "math"]
    assert kernels, "no fused attention kernel fits"  # efficient_cuda at least, for both dtypes
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, s, 64, generator=gen).to(CUDA, dtype) for s in (333, 1000, 1000, 333))
    layouts = {
        "bhsd": lambda x: x.contiguous(),
        "bshd": lambda x: to_layout(x, "bshd"),
        "sliced": lambda x: torch.cat([x, x[:, :, :5]], 2)[:, :, : x.shape[2]],
    }
    glob_out, glob_lse = local_attention(q, k, v, backend="math")
    for name in kernels:
        for layout, make in layouts.items():
            qq, kk, vv, dd = (make(t) for t in (q, k, v, dout))
            out, lse = local_attention(qq, kk, vv, backend=name)
            ref, ref_lse = _exact(q, k, v, 64**-0.5)
            assert (out.double() - ref).abs().max() <= _bound(dtype, v.abs().max().item()), (name, layout)
            assert (lse.double() - ref_lse).abs().max() <= 1e-3, (name, layout)
            for out_layout in (glob_out.contiguous(), to_layout(glob_out, "bshd")):
                for keys in (slice(0, 400), slice(400, 1000)):
                    mine = local_attention_backward(
                        dd, qq, kk[:, :, keys], vv[:, :, keys], out_layout, glob_lse, backend=name
                    )
                    block = (q, k[:, :, keys], v[:, :, keys], dout, glob_out, glob_lse, 64**-0.5)
                    exact = _exact_block_grads(block[3], *block[:3], *block[4:])
                    for g, r, bound in zip(mine, exact, _grad_bounds(dtype, *block)):
                        assert torch.isfinite(g).all(), (name, layout)
                        assert (g.double() - r).abs().max() <= bound, (name, layout)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_path_and_ring_degree_one_match_sdpa_with_joint_padding_and_mask(dtype):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 300, 4, 64, generator=gen).to(CUDA, dtype).requires_grad_() for _ in range(3))
    jq, jk, jv = (torch.randn(2, 17, 4, 64, generator=gen).to(CUDA, dtype).requires_grad_() for _ in range(3))
    mask = torch.ones(2, 17, dtype=torch.bool, device=CUDA)
    mask[0, 9:] = False
    for path in ("ring", "degree 1"):
        kwargs = dict(valid_len=280, joint_query=jq, joint_key=jk, joint_value=jv, joint_key_mask=mask)
        if path == "ring":
            out, jout = ring_attention(q, k, v, group=None, **kwargs)
        else:
            out, jout = usp_attention(q, k, v, ulysses_group=None, ring_group=None, **kwargs)
        refs = []
        for b in range(2):
            keep = mask[b]
            cat = [
                torch.cat([j[b : b + 1], x[b : b + 1, :280]], 1).double()
                for j, x in zip((jq, jk, jv), (q, k, v))
            ]
            cat[1], cat[2] = (
                torch.cat([j[b : b + 1][:, keep], x[b : b + 1, :280]], 1).double()
                for j, x in ((jk, k), (jv, v))
            )
            refs.append(F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in cat)).transpose(1, 2))
        ref = torch.cat(refs)
        mine = torch.cat([jout, out[:, :280]], 1).double()
        assert (mine - ref).abs().max() <= _bound(dtype, v.abs().max().item(), 3), path


@pytest.mark.parametrize("dtype", DTYPES)
def test_streaming_pipeline_and_training_seeded_by_cpu_and_cuda_generators(dtype):
    from hfpatch.streaming import StreamingConfig, StreamingTrainingModel, StreamingWanPipeline
    from hfpatch.testing import tiny_wan_pipe, tiny_wan_transformer, wan_prompt_embeds

    config = StreamingConfig(num_frame_per_block=2, local_attn_size=6, sink_size=2)
    pipe = tiny_wan_pipe().to(CUDA)
    pipe.transformer.to(dtype)
    stream = StreamingWanPipeline.from_pipe(pipe, config)
    kwargs = dict(height=16, width=32, denoising_step_list=(1000, 600, 300), output_type="pt")
    prompt = wan_prompt_embeds().to(CUDA, dtype)
    try:
        runs = {}
        for name, make in (("cpu", lambda: torch.Generator().manual_seed(0)),
                           ("cuda", lambda: torch.Generator(CUDA).manual_seed(0))):  # fmt: skip
            first = list(stream.stream(prompt, 3, generator=make(), **kwargs))
            again = list(stream.stream(prompt, 3, generator=make(), **kwargs))
            for a, b in zip(first, again):  # seeded: the same draws (kernels may reorder sums run to run)
                assert torch.allclose(
                    a.latents, b.latents, rtol=0, atol=8 * eps(dtype) * b.latents.abs().max()
                ), name
            assert all(torch.isfinite(c.frames).all() for c in first), name
            runs[name] = first
        batch = list(stream.stream(wan_prompt_embeds(batch=2).to(CUDA, dtype), 2,
                                   generator=[torch.Generator().manual_seed(s) for s in (0, 1)], **kwargs))  # fmt: skip
        assert batch[-1].latents.shape[0] == 2
    finally:
        stream.remove()
    model = tiny_wan_transformer().to(CUDA, dtype)
    with hfpatch.apply(model, streaming=config):
        trainer = StreamingTrainingModel(
            model, config, chunk_size=6, min_new_frames=2, denoising_step_list=(1000, 500)
        )
        trainer.setup_sequence(wan_prompt_embeds().to(CUDA, dtype), latent_shape=(4, 4, 4), max_length=14)
        chunk, _ = trainer.generate_next_chunk(requires_grad=True, generator=torch.Generator().manual_seed(0))
        chunk.float().square().mean().backward()
        assert chunk.device.type == CUDA.type and torch.isfinite(chunk).all()


def _order_tol(dtype: torch.dtype, noise: float) -> float:
    """Two results that differ only in summation order: ``reassociation_tol`` of the fp32 reference's own
    noise against fp64, or ``low_precision_tol`` of the bf16 one's."""
    return reassociation_tol(noise) if dtype == torch.float32 else low_precision_tol(noise, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_pixel_loss_equals_one_shot(dtype):
    from hfpatch.testing import tiny_autoencoder_kl
    from hfpatch.training import chunked_pixel_loss

    vae32 = tiny_autoencoder_kl().to(CUDA).requires_grad_(False)
    gen = torch.Generator().manual_seed(2)
    latents = torch.randn(4, 4, 16, 16, generator=gen).to(CUDA)
    targets = torch.rand(4, 3, 32, 32, generator=gen).to(CUDA) * 2 - 1

    def step(vae, dtype, **options):
        leaf = latents.to(dtype, copy=True).requires_grad_()
        loss = chunked_pixel_loss(vae, leaf, targets.to(dtype), **options)
        loss.backward()
        return torch.cat([loss.detach().double().reshape(1), leaf.grad.double().flatten()])

    exact = step(to_fp64(vae32), torch.float64, reference=True)
    vae = vae32.to(dtype)
    one_shot = step(vae, dtype, reference=True)
    chunked = step(vae, dtype, chunk_size=1)
    assert rel_error(chunked, one_shot) <= _order_tol(dtype, rel_error(one_shot, exact))


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_pixel_loss_video_time_chunks_equal_one_shot_and_bounded(dtype):
    # The Wan VAE given itself: one video decoded one latent frame at a time under causal_checkpoint (RNG and
    # autocast state replayed on the device). Loss and latent gradient as the one-shot step; on CUDA, the
    # allocator's peak grows at most 2x from 4 to 16 latent frames (the one-shot step's about 4.5x).
    from hfpatch.testing import tiny_wan_vae
    from hfpatch.training import chunked_pixel_loss

    vae32 = tiny_wan_vae("2.1").to(CUDA).requires_grad_(False)
    vae64, vae = to_fp64(vae32), vae32.to(dtype)
    peaks = {}

    def step(vae, dtype, latents, targets, **options):
        leaf = latents.to(dtype, copy=True).requires_grad_()
        if CUDA.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        loss = chunked_pixel_loss(vae, leaf, targets.to(dtype), **options)
        loss.backward()
        if CUDA.type == "cuda":
            torch.cuda.synchronize()
            peaks[latents.shape[2], options.get("reference", False)] = (
                torch.cuda.max_memory_allocated() - base
            )
        return torch.cat([loss.detach().double().reshape(1), leaf.grad.double().flatten()])

    for frames in (4, 16):
        gen = torch.Generator().manual_seed(frames)
        inputs = (
            torch.randn(1, 4, frames, 4, 4, generator=gen).to(CUDA),
            torch.rand(1, 3, 1 + 4 * (frames - 1), 32, 32, generator=gen).to(CUDA) * 2 - 1,
        )
        one_shot = step(vae, dtype, *inputs, reference=True)
        chunked = step(vae, dtype, *inputs)
    exact = step(vae64, torch.float64, *inputs, reference=True)
    assert rel_error(chunked, one_shot) <= _order_tol(dtype, rel_error(one_shot, exact))
    if CUDA.type == "cuda":
        assert peaks[16, False] <= 2 * peaks[4, False], peaks
        assert peaks[16, True] >= 3 * peaks[4, True], peaks


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradcache_step_equals_the_plain_step(dtype):
    from hfpatch.testing import tiny_bert
    from hfpatch.training import GradCache

    gen = torch.Generator().manual_seed(3)
    inputs = [{"input_ids": torch.randint(1, 64, (8, 12), generator=gen).to(CUDA),
               "attention_mask": torch.ones(8, 12, dtype=torch.long, device=CUDA)} for _ in range(2)]  # fmt: skip

    def info_nce(a, b):
        logits = F.normalize(a.float(), dim=-1) @ F.normalize(b.float(), dim=-1).T / 0.05
        return F.cross_entropy(logits, torch.arange(len(a), device=a.device))

    def pool(out, chunk):
        mask = chunk["attention_mask"].unsqueeze(-1).to(out.last_hidden_state.dtype)
        return (out.last_hidden_state * mask).sum(1) / mask.sum(1)

    def grads(model):
        flat = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return flat

    model = tiny_bert().to(CUDA).eval()  # no dropout: the two steps compute the same function
    model64 = to_fp64(model)
    info_nce(*(pool(model64(**x), x) for x in inputs)).backward()
    exact = grads(model64)
    low = dtype if dtype != torch.float32 else None
    with torch.autocast(CUDA.type, dtype=dtype, enabled=low is not None):
        info_nce(*(pool(model(**x), x) for x in inputs)).backward()
    plain = grads(model)
    GradCache(model, info_nce, chunk_size=2, rep_fn=pool, autocast_dtype=low).step(*inputs)
    assert rel_error(grads(model), plain) <= _order_tol(dtype, rel_error(plain, exact))


def _clip_plain(i, t, logit_scale):
    logits = logit_scale.exp() * F.normalize(i, dim=-1) @ F.normalize(t, dim=-1).T
    labels = torch.arange(len(i), device=i.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _siglip_plain(x, y, logit_scale, logit_bias):
    logits = logit_scale.exp() * F.normalize(x, dim=-1) @ F.normalize(y, dim=-1).T + logit_bias
    labels = 2 * torch.eye(len(x), dtype=logits.dtype, device=x.device) - 1
    return -F.logsigmoid(labels * logits).sum() / len(x)


def _mnrl_plain(q, d, negative, scale=20.0):
    logits = scale * F.normalize(q, dim=-1) @ F.normalize(torch.cat([d, negative]), dim=-1).T
    return F.cross_entropy(logits, torch.arange(len(q), device=q.device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_blocked_losses_equal_the_unchunked_ones(dtype):
    # 300 rows in blocks of 64 (a ragged last block of 44); embeddings in ``dtype``, the loss computes in fp32
    # either way: against the unchunked loss on the same values upcast to fp32 (gradients rounded to ``dtype``
    # alike), within reassociation_tol of the fp32 computation's noise against fp64. On CUDA the loss stage's
    # peak at batch 8192 stays within its 16 MiB budget plus the O(B x D) embeddings (unchunked: 3 x 256 MiB).
    from hfpatch.training import CLIPLoss, InfoNCELoss, SigLIPLoss

    gen = torch.Generator().manual_seed(4)
    embeddings = [torch.randn(300, 32, generator=gen).to(CUDA, dtype) for _ in range(3)]
    clip, siglip = CLIPLoss(block_size=64).to(CUDA), SigLIPLoss(logit_bias=-2.0, block_size=64).to(CUDA)
    cases = [
        (clip, lambda i, t: _clip_plain(i, t, clip.logit_scale), 2),
        (siglip, lambda x, y: _siglip_plain(x, y, siglip.logit_scale, siglip.logit_bias), 2),
        (InfoNCELoss(block_size=64), _mnrl_plain, 3),
    ]

    def run(fn, n, params, inputs_dtype):
        leaves = [x.detach().to(inputs_dtype, copy=True).requires_grad_() for x in embeddings[:n]]
        value = fn(*leaves)
        value.backward()
        grads = [leaf.grad for leaf in leaves] + [p.grad for p in params]
        for p in params:
            p.grad = None
        return torch.cat([value.detach().double().reshape(1), *(g.double().flatten() for g in grads)])

    def upcast(fn):  # what the row-blocked losses do with bf16 embeddings: compute in fp32
        return lambda *x: fn(*(v if v.dtype == torch.float64 else v.float() for v in x))

    for loss, plain, n in cases:
        params = list(loss.parameters())
        got = run(loss, n, params, dtype)
        reference = run(upcast(plain), n, params, dtype)
        # the fp32 computation's noise, on the same (bf16-representable) values held in fp32
        noise = rel_error(
            run(upcast(plain), n, params, torch.float32), run(upcast(plain), n, params, torch.float64)
        )
        tol = reassociation_tol(noise) * reference.abs().max()
        # bf16 embeddings get their gradients rounded to bf16 after the fp32 maths: a reassociation may flip one
        # rounding, one bf16 ulp (at most eps(bf16) of the element); value and temperature gradients stay fp32.
        ulp = eps(dtype) * reference.abs() if dtype != torch.float32 else 0
        error = ((got - reference).abs() - ulp).max().item()
        print(f"{type(loss).__name__} {dtype}: {error:.2e} beyond one rounding (tol {tol:.2e})")
        assert error <= tol
    if CUDA.type == "cuda" and dtype == torch.float32:
        reps = [torch.randn(8192, 64, device=CUDA, requires_grad=True) for _ in range(2)]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        CLIPLoss(block_bytes=16 * 2**20).to(CUDA)(*reps).backward()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base <= 16 * 2**20 + 24 * 8192 * 64 * 4


@pytest.mark.skipif(CUDA.type != "cuda", reason="measures CUDA's allocator")
def test_wan_vae_error_mid_decode_releases_the_frame_cache_memory():
    from hfpatch.testing import tiny_wan_vae
    from hfpatch.training import chunked_pixel_loss

    vae = tiny_wan_vae("2.1").to(CUDA).requires_grad_(False)
    latents = torch.randn(1, 4, 5, 16, 16, device=CUDA, requires_grad=True)
    targets = torch.rand(1, 3, 17, 128, 128, device=CUDA) * 2 - 1
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    calls = []

    def fail_at_third(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = vae.decoder.conv_out.register_forward_pre_hook(fail_at_third)
    raised = False
    try:  # not pytest.raises: its traceback would keep the failed call's frames (and tensors) alive
        chunked_pixel_loss(vae, latents, targets, reference=True)
    except torch.OutOfMemoryError:
        raised = True
    handle.remove()
    gc.collect()
    torch.cuda.synchronize()
    assert raised
    assert all(t is None for t in vae._feat_map)
    assert torch.cuda.memory_allocated() == before  # nothing of the failed decode stays allocated
    chunked_pixel_loss(vae, latents, targets, chunk_size=1).backward()  # and the retry runs
