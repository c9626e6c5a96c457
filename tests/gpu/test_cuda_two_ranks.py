"""The GPU lane, two ranks on ONE GPU: the multi-rank CUDA paths, over gloo. Skipped without a CUDA device.

NCCL refuses two ranks on one device, so these tests run two gloo ranks that both hold CUDA tensors on
``cuda:0``: gloo's collectives copy CUDA tensors through pinned host memory themselves, and hfpatch's
point-to-point sends and receives (Ulysses' exchange, Ring's K/V passes, the VAE's halos) go through host memory
over gloo (:func:`hfpatch.distributed.collectives.start_p2p`). So a machine with one GPU checks what the
CPU suite cannot: the CUDA kernels (cuDNN, flash, efficient) inside the sequence-parallel paths, forward and
backward, with real shards, and the split VAE's CUDA convolutions and halos.

Checked (one ``pool.run``; ``HFPATCH_GPU_LANE_DEVICE=cpu`` dry-runs the same code on the CPU kernels, as CI does):

* ``usp_attention`` at Ulysses 2 (the exchange into the kernel's buffers; default, overlapped, FP8) and Ring 2 (the
  lse kernels: ``auto`` and ``flash`` by name in bf16), fp32 and bf16, batch 2, joint text with a key mask,
  a padded sequence: the output against fp64 attention of the same inputs within the roundings the kernels make
  (``_bound`` of ``test_cuda_world1.py``); fp32 gradients within ``reassociation_tol`` of one-GPU SDPA's own noise;
  the overlapped exchange bit-identical to the default one; FP8 within 0.1 of the largest value of the exact
  exchange's output (measured about 0.01: a sanity bound, the CPU suite checks FP8 against its emulation).
* a tiny ``FluxTransformer2DModel`` patched with Ulysses 2 and Ring 2: output and parameter gradients (after the
  documented MEAN over the group) against the unpatched model on the same GPU, fp32.
* the split ``AutoencoderKL`` decode (precise mode: halos and GroupNorm statistics across the ranks) against the
  unpatched decode on the same GPU, fp32.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.attention import usp_attention
from hfpatch.attention.layout import group_rank, shard_sequence, sp_index
from hfpatch.distributed.runtime import get_mesh
from hfpatch.testing.tolerance import eps, reassociation_tol, rel_error, rounding_noise, to_fp64

DEVICE = os.environ.get("HFPATCH_GPU_LANE_DEVICE", "cuda:0")
pytestmark = pytest.mark.skipif(
    torch.device(DEVICE).type == "cuda" and not torch.cuda.is_available(),
    reason="the GPU lane needs a CUDA device",
)
# 301 tokens: the second shard is padded; the CPU dry run checks the same code on fewer tokens and channels.
SEQ, HEADS, DIM, TEXT = (301, 4, 64, 17) if torch.device(DEVICE).type == "cuda" else (41, 4, 16, 7)


def _bound(dtype: torch.dtype, scale: float, roundings: float = 3.0) -> float:
    """``roundings`` roundings of ``dtype`` of ``scale`` plus fp32 accumulation (``test_cuda_world1.py``)."""
    return roundings * eps(dtype) / 2 * scale + 1e3 * eps(torch.float32) * scale


def _inputs(device, dtype):
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(2, SEQ, HEADS, DIM, generator=gen).to(device, dtype) for _ in range(3)]
    joint = [torch.randn(2, TEXT, HEADS, DIM, generator=gen).to(device, dtype) for _ in range(3)]
    mask = torch.ones(2, TEXT, dtype=torch.bool, device=device)
    mask[0, TEXT // 2 :] = False
    weights = [
        torch.randn(2, SEQ, HEADS, DIM, generator=gen).to(device),
        torch.randn(2, TEXT, HEADS, DIM, generator=gen).to(device),
    ]
    return full, joint, mask, weights


def _sdpa(full, joint, mask, dtype):
    """One-process attention over the whole sequence (text in front, masked keys dropped per sample)."""
    outs = []
    for b in range(2):
        keep = mask[b]
        q = torch.cat([joint[0][b : b + 1], full[0][b : b + 1]], 1)
        k, v = (torch.cat([j[b : b + 1][:, keep], x[b : b + 1]], 1) for j, x in zip(joint[1:], full[1:]))
        outs.append(
            F.scaled_dot_product_attention(*(t.to(dtype).transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        )
    out = torch.cat(outs)
    return out[:, TEXT:], out[:, :TEXT]


def _usp_cases(device: torch.device) -> dict:
    results = {}
    for ring, ulysses in ((1, 2), (2, 1)):
        mesh = get_mesh(ParallelConfig(ring=ring, ulysses=ulysses))
        ring_group, ulysses_group = mesh.group("ring"), mesh.group("ulysses")
        index = sp_index(group_rank(ring_group), group_rank(ulysses_group), ulysses)
        for dtype in (torch.float32, torch.bfloat16):
            full, joint, mask, weights = _inputs(device, dtype)
            named = "flash" if device.type == "cuda" else "flash_cpu"  # Ring's kernel by name (CPU: dry run)
            backends = ["auto"] + ([named] if dtype == torch.bfloat16 else [])
            ref64, ref64_text = _sdpa(
                [t.double() for t in full], [t.double() for t in joint], mask, torch.float64
            )
            scale = max(t.abs().max().item() for t in full)
            default_out = None
            for backend in backends:
                exchanges = [None] + (["overlap", "fp8"] if ulysses > 1 and backend == "auto" else [])
                for exchange in exchanges:
                    grad = exchange != "fp8"  # FP8 is refused under training unless asked for by name
                    leaves = [shard_sequence(t, 1, 2, index).detach().requires_grad_(grad) for t in full]
                    texts = [t.detach().clone().requires_grad_(grad) for t in joint]
                    with torch.set_grad_enabled(grad):
                        out, text_out = usp_attention(
                            *leaves, ulysses_group=ulysses_group, ring_group=ring_group, valid_len=SEQ,
                            joint_query=texts[0], joint_key=texts[1], joint_value=texts[2], joint_key_mask=mask,
                            backend=backend, exchange=exchange,
                        )  # fmt: skip
                    name = f"ring {ring} ulysses {ulysses} {dtype} {backend} exchange={exchange}"
                    real = out.shape[1] if index == 0 else SEQ - out.shape[1]
                    mine = shard_sequence(ref64, 1, 2, index)[:, :real]
                    err = max((out[:, :real].double() - mine).abs().max().item(),
                              (text_out.double() - ref64_text).abs().max().item())  # fmt: skip
                    if exchange == "fp8":
                        # Against the exact exchange, over the largest value (the output averages values): measured
                        # about 0.01 (docs/capabilities/dit-sequence-parallel.md); a wrong row or head is O(1).
                        fp8_err = (out[:, :real].double() - default_out[:, :real].double()).abs().max().item()
                        results[name] = {"out": (fp8_err / full[2].abs().max().item(), 0.1)}
                        continue
                    results[name] = {"out": (err, _bound(dtype, scale))}
                    if exchange == "overlap":
                        results[name]["same_as_default"] = torch.equal(out, default_out)
                        continue
                    default_out = out.detach()
                    loss = (out.float() * shard_sequence(weights[0], 1, 2, index)).sum() + (
                        text_out.float() * weights[1]
                    ).sum() / 2  # each rank's share of the text term: summed over the ranks, one term
                    loss.backward()
                    if dtype == torch.float32:
                        results[name]["grads"] = _grad_errors(
                            full, joint, mask, weights, leaves, texts, index
                        )
                    results[name]["finite"] = all(bool(t.grad.isfinite().all()) for t in leaves + texts)
    return results


def _grad_errors(full, joint, mask, weights, leaves, texts, index):
    """fp32 gradients of the shards (and of the text after the SUM over ranks) against one-process SDPA."""

    def reference(dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in full + joint]
        out, text_out = _sdpa(inputs[:3], inputs[3:], mask, dtype)
        ((out * weights[0].to(dtype)).sum() + (text_out * weights[1].to(dtype)).sum()).backward()
        return [t.grad for t in inputs]

    ref32, ref64 = reference(torch.float32), reference(torch.float64)
    noise = max(rounding_noise(a, b) for a, b in zip(ref32, ref64))
    errors = []
    for mine, ref in zip(leaves, ref64[:3]):
        errors.append(
            rel_error(mine.grad, shard_sequence(ref, 1, 2, index)[:, : mine.shape[1]], ref.abs().max().item())
        )
    for mine, ref in zip(texts, ref64[3:]):
        total = mine.grad.clone()
        dist.all_reduce(total)
        errors.append(rel_error(total, ref))
    return max(errors), reassociation_tol(noise)


def _flux_case(device: torch.device) -> dict:
    from hfpatch.testing import tiny_flux_transformer

    model = tiny_flux_transformer().to(device)
    gen = torch.Generator().manual_seed(1)
    grid = torch.stack(torch.meshgrid(torch.arange(5), torch.arange(5), indexing="ij"), -1).reshape(25, 2)
    kwargs = dict(
        hidden_states=torch.randn(1, 25, 16, generator=gen).to(device),
        encoder_hidden_states=torch.randn(1, 7, 16, generator=gen).to(device),
        pooled_projections=torch.randn(1, 16, generator=gen).to(device),
        timestep=torch.tensor([0.7], device=device),
        img_ids=torch.cat([torch.zeros(25, 1), grid.float()], 1).to(device),
        txt_ids=torch.zeros(7, 3, device=device),
    )

    def step(m, inputs):
        m.zero_grad(set_to_none=True)
        out = m(**inputs).sample
        out.square().mean().backward()
        return out.detach(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    ref, ref_grad = step(model, kwargs)
    ref64, ref64_grad = step(to_fp64(model), to_fp64(kwargs))
    tol = reassociation_tol(max(rounding_noise(ref, ref64), rounding_noise(ref_grad, ref64_grad)))
    results = {}
    for config in (ParallelConfig(ulysses=2), ParallelConfig(ring=2)):
        with hfpatch.apply(model, parallel=config):
            out, grad = step(model, kwargs)
        grad = grad.clone()
        dist.all_reduce(grad)
        results[str(config)] = (max(rel_error(out, ref), rel_error(grad / 2, ref_grad)), tol)
    return results


def _vae_case(device: torch.device) -> tuple[float, float]:
    from hfpatch.testing import tiny_autoencoder_kl

    vae = tiny_autoencoder_kl().to(device)
    z = torch.randn(1, 4, 5, 3, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        ref = vae.decode(z).sample
        ref64 = to_fp64(vae).decode(z.double()).sample
        with hfpatch.apply(vae):
            out = vae.decode(z).sample
    return rel_error(out, ref), reassociation_tol(rounding_noise(ref, ref64))


def _two_ranks(device_name: str) -> dict:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # fp32 convolutions and matmuls in fp32 (not TF32): the references are fp32 and fp64
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return {"usp": _usp_cases(device), "flux": _flux_case(device), "vae": _vae_case(device)}


def test_two_ranks_on_one_device_usp_ring_flux_and_split_vae(rank_pool):
    per_rank = rank_pool(2).run(_two_ranks, DEVICE)
    for rank, result in enumerate(per_rank):
        for name, checks in result["usp"].items():
            err, tol = checks["out"]
            assert err <= tol, (rank, name, err, tol)
            assert checks.get("finite", True), (rank, name)
            assert checks.get("same_as_default", True), (rank, name, "overlapped != default")
            if "grads" in checks:
                assert checks["grads"][0] <= checks["grads"][1], (rank, name, checks["grads"])
        for name, (err, tol) in result["flux"].items():
            assert err <= tol, (rank, name, err, tol)
        err, tol = result["vae"]
        assert err <= tol, (rank, "vae decode", err, tol)
