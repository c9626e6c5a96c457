"""Local kernels, the backend registry, the online-softmax merge and single-process ring attention.

Tolerances: fp32 kernels vs SDPA differ only in summation order (1e-6 on O(1) values); gradcheck runs in
float64 with its default tolerances.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hfpatch.attention import merge_blocks, ring_attention, usp_attention
from hfpatch.attention.local import (
    AttentionBackend,
    available_backends,
    local_attention,
    local_attention_backward,
    register_backend,
    resolve_backend,
)

CPU_BACKENDS = ["math", "flash_cpu"]


def _qkv(sq=5, sk=7, heads=3, dim=8, dtype=torch.float32, seed=0, layout="bhsd"):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, s, dim) if layout == "bhsd" else (2, s, heads, dim) for s in (sq, sk, sk)]
    return [torch.randn(*shape, generator=g, dtype=dtype) for shape in shapes]


def _sdpa_bshd(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def test_available_backends_on_cpu_lists_math_and_flash():
    assert set(CPU_BACKENDS) <= set(available_backends("cpu", torch.float32))
    assert resolve_backend("auto", "cpu", torch.float32).name == "flash_cpu"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_local_attention_backend_matches_sdpa_and_logsumexp(backend):
    q, k, v = _qkv()
    out, lse = local_attention(q, k, v, scale=0.3, backend=backend)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.3
    assert (out - F.scaled_dot_product_attention(q, k, v, scale=0.3)).abs().max() <= 1e-6
    assert lse.dtype == torch.float32 and (lse - scores.logsumexp(-1)).abs().max() <= 1e-6


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_local_attention_backward_blocks_sum_to_autograd_grads(backend):
    q, k, v = (t.requires_grad_(True) for t in _qkv(sk=9))
    ref = F.scaled_dot_product_attention(q, k, v)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref.backward(dout)
    with torch.no_grad():
        out, lse = local_attention(q, k, v, backend=backend)
        parts = [local_attention_backward(dout, q, k[:, :, s], v[:, :, s], out, lse, backend=backend) for s in
                 (slice(0, 4), slice(4, 9))]  # fmt: skip

    # Per-block recompute of the probabilities (exp(s - lse)) and the sum of two partial dq's reassociate a
    # few fp32 roundings per element: 16 ulps of the largest gradient (measured 2-6 ulps over seeds).
    def tol(grad):
        return 16 * torch.finfo(torch.float32).eps * grad.abs().max()

    assert (sum(p[0] for p in parts) - q.grad).abs().max() <= tol(q.grad)
    assert (torch.cat([p[1] for p in parts], 2) - k.grad).abs().max() <= tol(k.grad)
    assert (torch.cat([p[2] for p in parts], 2) - v.grad).abs().max() <= tol(v.grad)


def test_local_attention_flash_cpu_bfloat16_close_to_float32():
    q, k, v = _qkv()
    out, lse = local_attention(*(t.bfloat16() for t in (q, k, v)), backend="flash_cpu")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # bf16 inputs carry ~3 significant digits; 3e-2 on O(1) outputs.
    assert (out.float() - F.scaled_dot_product_attention(q, k, v)).abs().max() <= 3e-2


def test_resolve_backend_unknown_or_unsupported_raises_with_choices():
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'; registered: auto, "):
        resolve_backend("flash3", "cpu", torch.float32)
    with pytest.raises(
        ValueError, match="'efficient_cuda' cannot run on cpu .* available there: math, flash_cpu"
    ):
        resolve_backend("efficient_cuda", "cpu", torch.float32)


def test_register_backend_taken_name_raises():
    backend = AttentionBackend("math", lambda *a: None, lambda *a: None, lambda device, dtype: True)
    with pytest.raises(ValueError, match="'math' is reserved or taken"):
        register_backend(backend)


def test_merge_blocks_any_split_equals_one_block():
    q, k, v = _qkv(sk=10)
    ref, ref_lse = local_attention(q, k, v)
    for cuts in ([0, 10], [0, 3, 10], [0, 1, 2, 7, 10]):
        blocks = [local_attention(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
        out, lse = merge_blocks(blocks[::-1])  # order only changes rounding
        assert (out - ref).abs().max() <= 1e-6 and (lse - ref_lse).abs().max() <= 1e-6


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ring_attention_single_rank_gradcheck_with_joint_and_padding(backend):
    q, k, v = (
        t.requires_grad_(True) for t in _qkv(sq=6, sk=6, heads=2, dim=4, dtype=torch.float64, layout="bshd")
    )
    jq, jk, jv = (
        t.requires_grad_(True)
        for t in _qkv(sq=3, sk=3, heads=2, dim=4, dtype=torch.float64, seed=1, layout="bshd")
    )

    def fn(q, k, v, jq, jk, jv):
        return ring_attention(
            q, k, v, group=None, valid_len=4, joint_query=jq, joint_key=jk, joint_value=jv, backend=backend
        )

    assert torch.autograd.gradcheck(fn, (q, k, v, jq, jk, jv))
    out, joint_out = fn(q, k, v, jq, jk, jv)
    ref = _sdpa_bshd(torch.cat([jq, q], 1), torch.cat([jk, k[:, :4]], 1), torch.cat([jv, v[:, :4]], 1))
    assert (torch.cat([joint_out, out], 1) - ref).abs().max() <= 1e-12


def test_usp_attention_degree_one_joint_back_equals_sdpa():
    q, k, v = _qkv(sq=5, sk=5, layout="bshd")
    jq, jk, jv = _qkv(sq=2, sk=2, seed=1, layout="bshd")
    out, joint_out = usp_attention(
        q, k, v, ulysses_group=None, ring_group=None, joint_query=jq, joint_key=jk, joint_value=jv,
        joint_position="back",
    )  # fmt: skip
    ref = _sdpa_bshd(torch.cat([q, jq], 1), torch.cat([k, jk], 1), torch.cat([v, jv], 1))
    assert (torch.cat([out, joint_out], 1) - ref).abs().max() <= 1e-6


def test_ring_attention_bfloat16_accumulates_in_float32():
    q, k, v = (t.requires_grad_(True) for t in _qkv(sq=6, sk=6, layout="bshd"))
    ref = _sdpa_bshd(q, k, v)
    ref.sum().backward()
    low = [t.detach().bfloat16().requires_grad_(True) for t in (q, k, v)]
    out, _ = ring_attention(*low, group=None, valid_len=None)
    out.float().sum().backward()
    assert out.dtype == low[0].grad.dtype == torch.bfloat16
    # bf16 inputs carry ~3 significant digits; softmax statistics and accumulators are float32: 3e-2.
    assert (out.float() - ref).abs().max() <= 3e-2
    for mine, full in zip(low, (q, k, v)):
        assert (mine.grad.float() - full.grad).abs().max() <= 3e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["efficient_cuda", "xformers"])
def test_cuda_backend_matches_math_forward_and_block_backward(name):
    if name not in available_backends("cuda", torch.bfloat16):
        pytest.skip(f"{name} is not available here")
    q, k, v = (t.cuda().bfloat16() for t in _qkv(sq=70, sk=90, heads=2, dim=64))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    out, lse = local_attention(q, k, v, backend=name)
    ref, ref_lse = local_attention(q, k, v, backend="math")
    # bf16 outputs (~3 significant digits); lse is float32 in both: 2e-2 and 1e-3.
    assert (out.float() - ref.float()).abs().max() <= 2e-2 and (lse - ref_lse).abs().max() <= 1e-3
    cut = 40  # a block backward with the global out/lse must give that block's share
    for s in (slice(0, cut), slice(cut, 90)):
        mine = local_attention_backward(dout, q, k[:, :, s], v[:, :, s], ref, ref_lse, backend=name)
        theirs = local_attention_backward(dout, q, k[:, :, s], v[:, :, s], ref, ref_lse, backend="math")
        for a, b in zip(mine, theirs):
            assert (a.float() - b.float()).abs().max() <= 5e-2
