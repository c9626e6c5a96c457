"""Local kernels, the backend registry, the online-softmax merge and single-process ring attention.

Tolerances (``hfpatch.testing.tolerance``): a kernel against SDPA, or key blocks merged against one block,
computes the same attention in another summation order, so forward results are compared within
``attention_tol`` (the two-order bound of every sum: ulps of the scores and values times the number of keys
and channels). Backward chains are longer, so gradients are compared within ``reassociation_tol`` of the
fp32 SDPA gradients' own rounding noise against fp64. bf16 results are compared with exact (fp64) attention
of the same bf16-rounded inputs, within the bf16 roundings the kernel makes (``eps(bfloat16)`` times the
magnitudes each rounding scales). gradcheck runs in float64 with its default tolerances.
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
from hfpatch.testing.tolerance import (
    FLOOR_ULPS,
    attention_tol,
    eps,
    reassociation_tol,
    rel_error,
    rounding_noise,
)

CPU_BACKENDS = ["math", "flash_cpu"]


def _qkv(sq=5, sk=7, heads=3, dim=8, dtype=torch.float32, seed=0, layout="bhsd"):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, s, dim) if layout == "bhsd" else (2, s, heads, dim) for s in (sq, sk, sk)]
    return [torch.randn(*shape, generator=g, dtype=dtype) for shape in shapes]


def _sdpa_bshd(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def _bhsd(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def _bf16_grad_bounds(q, k, v, dout, out=None, lse=None, scale=None) -> tuple[float, float, float]:
    """Largest errors of bf16 ``(dq, dk, dv)`` of one key block against exact attention of the same bf16 values.

    bhsd tensors; ``out``/``lse`` are the global forward results (default: this block's own). A bf16 flash
    backward accumulates in fp32 but rounds to bf16 (``u = eps / 2`` relative each): the probabilities ``P``,
    ``dS = P (dO v^T - delta)``, and the outputs; ``delta = rowsum(dO * out)`` uses the bf16-rounded ``out``.
    So ``|error dS| <= E = 2u |dS| + u P rowsum(|dO| |out|)`` and, with ``dq = scale dS k``,
    ``dk = scale dS^T q``, ``dv = P^T dO``: ``|error| <= scale E |k| + u |dq|``, ``scale E^T |q| + u |dk|``,
    ``u P^T |dO| + u |dv|``, computed here in fp64. (fp32 accumulation adds ``(n + D) eps(fp32)`` of the same
    magnitudes: ~1e-4 of these bounds, left out.)
    """
    u = eps(torch.bfloat16) / 2
    q, k, v, dout = (t.detach().double() for t in (q, k, v, dout))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.mT * scale
    lse = scores.logsumexp(-1) if lse is None else lse.double()
    probs = (scores - lse.unsqueeze(-1)).exp()
    out = probs @ v if out is None else out.detach().double()
    dscores = probs * (dout @ v.mT - (dout * out).sum(-1, keepdim=True))
    error = 2 * u * dscores.abs() + u * probs * (dout.abs() * out.abs()).sum(-1, keepdim=True)
    dq, dk, dv = scale * dscores @ k, scale * dscores.mT @ q, probs.mT @ dout
    bounds = (
        scale * error @ k.abs() + u * dq.abs(),
        scale * error.mT @ q.abs() + u * dk.abs(),
        u * probs.mT @ dout.abs() + u * dv.abs(),
    )
    return tuple(b.max().item() for b in bounds)


def test_available_backends_on_cpu_lists_math_and_flash():
    assert set(CPU_BACKENDS) <= set(available_backends("cpu", torch.float32))
    assert resolve_backend("auto", "cpu", torch.float32).name == "flash_cpu"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_local_attention_backend_matches_sdpa_and_logsumexp(backend):
    q, k, v = _qkv()
    out, lse = local_attention(q, k, v, scale=0.3, backend=backend)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.3
    out_tol, lse_tol = attention_tol(q, k, v, scale=0.3)  # same attention, other summation order
    out_err = (out - F.scaled_dot_product_attention(q, k, v, scale=0.3)).abs().max().item()
    lse_err = (lse - scores.logsumexp(-1)).abs().max().item()
    print(f"{backend}: out {out_err:.2e} / {out_tol:.2e}, lse {lse_err:.2e} / {lse_tol:.2e}")
    assert out_err <= out_tol
    assert lse.dtype == torch.float32 and lse_err <= lse_tol


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_local_attention_backward_blocks_sum_to_autograd_grads(backend):
    q, k, v = (t.requires_grad_(True) for t in _qkv(sk=9))
    ref = F.scaled_dot_product_attention(q, k, v)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref.backward(dout)
    exact = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    F.scaled_dot_product_attention(*exact).backward(dout.double())
    with torch.no_grad():
        out, lse = local_attention(q, k, v, backend=backend)
        parts = [local_attention_backward(dout, q, k[:, :, s], v[:, :, s], out, lse, backend=backend) for s in
                 (slice(0, 4), slice(4, 9))]  # fmt: skip

    # Per-block recompute of the probabilities (exp(s - lse)) and the sum of two partial dq's only reorder
    # fp32 sums: each gradient within reassociation_tol of the SDPA gradient's own fp32-vs-fp64 noise.
    blocks = (
        sum(p[0] for p in parts),
        torch.cat([p[1] for p in parts], 2),
        torch.cat([p[2] for p in parts], 2),
    )
    for name, got, mine, full in zip(("dq", "dk", "dv"), blocks, (q, k, v), exact):
        error, tol = rel_error(got, mine.grad), reassociation_tol(rounding_noise(mine.grad, full.grad))
        print(f"{backend} {name}: {error:.2e} / {tol:.2e}")
        assert error <= tol, (name, error, tol)


def test_local_attention_flash_cpu_bfloat16_close_to_float32():
    q, k, v = (t.bfloat16() for t in _qkv())
    out, lse = local_attention(q, k, v, backend="flash_cpu")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # Against exact attention of the same bf16 values: the kernel accumulates in fp32 and rounds twice to
    # bf16, the probabilities before P @ v and the output, each by u = eps(bf16) / 2 of at most max|v|; plus
    # its fp32 reassociation (attention_tol).
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    tol = eps(torch.bfloat16) * v.abs().max().item() + attention_tol(q, k, v)[0]
    error = (out.double() - exact).abs().max().item()
    print(f"bf16 out {error:.2e} / {tol:.2e}")
    assert error <= tol


def test_resolve_backend_unknown_or_unsupported_raises_with_choices():
    with pytest.raises(ValueError, match="unknown attention backend 'flash2'; registered: auto, "):
        resolve_backend("flash2", "cpu", torch.float32)
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
    out_tol, lse_tol = attention_tol(q, k, v)  # merging blocks reorders the sums over keys
    for cuts in ([0, 10], [0, 3, 10], [0, 1, 2, 7, 10]):
        blocks = [local_attention(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
        out, lse = merge_blocks(blocks[::-1])  # order only changes rounding
        assert (out - ref).abs().max() <= out_tol and (lse - ref_lse).abs().max() <= lse_tol


def test_merge_two_blocks_error_does_not_grow_with_lse():
    """One merge of two fp32 blocks errs by a few eps of the values, whatever the size of the log-sum-exps.

    Logits of a model without qk-norm reach |lse| ~ 650 (tiny SD3), where one ulp of the lse is 6e-5: weights
    ``exp(lse_i - new_lse)`` carried the merged lse's rounding into both blocks alike (the output scaled by
    ``1 + eps * |lse|``: ~250 eps here, 2000 eps at |lse| = 5000); weights from the lse difference do not.
    (A third block meets the *rounded* running lse: a relative weight error of ``eps * |lse|`` that scales
    only ``w (1 - w) |o_i - o_j|``, inherent to an fp32 ``(out, lse)`` state, like the kernels' own lse.)
    The reference is the fp64 merge of the same fp32 blocks: only the merge rounds.
    """
    g = torch.Generator().manual_seed(0)
    for offset in (0.0, 650.0, -650.0, 5000.0):
        blocks = [
            (torch.rand(2, 3, 64, 8, generator=g) * 2 - 1, offset + 3 * torch.randn(2, 3, 64, generator=g))
            for _ in range(2)
        ]
        ref, ref_lse = merge_blocks([(o.double(), lse.double()) for o, lse in blocks])
        out, lse = merge_blocks([(o.clone(), lse) for o, lse in blocks])
        assert out.dtype == lse.dtype == torch.float32
        assert rel_error(out, ref, scale=1.0) <= FLOOR_ULPS * eps()  # max|v| = 1; no |lse| term
        assert rel_error(lse, ref_lse) <= FLOOR_ULPS * eps()


def test_merge_blocks_without_keys_on_either_side():
    """A block with no keys (zeros, lse -inf) merged with another such block stays empty (no nan), and a
    real block merged after them gives that block."""
    out0, lse0 = torch.zeros(1, 2, 3, 4), torch.full((1, 2, 3), float("-inf"))
    block = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3)
    out, lse = merge_blocks([(out0.clone(), lse0.clone()), (out0.clone(), lse0.clone())])
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    out, lse = merge_blocks(
        [(out0.clone(), lse0.clone()), (out0.clone(), lse0.clone()), (block[0].clone(), block[1])]
    )
    assert torch.equal(out, block[0]) and torch.equal(lse, block[1])


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
    cat = (torch.cat([jq, q], 1), torch.cat([jk, k[:, :4]], 1), torch.cat([jv, v[:, :4]], 1))
    ref = _sdpa_bshd(*cat)
    tol, _ = attention_tol(*_bhsd(*cat))  # float64: another summation order, eps = 2.2e-16
    assert (torch.cat([joint_out, out], 1) - ref).abs().max() <= tol


def test_usp_attention_degree_one_joint_back_equals_sdpa():
    q, k, v = _qkv(sq=5, sk=5, layout="bshd")
    jq, jk, jv = _qkv(sq=2, sk=2, seed=1, layout="bshd")
    out, joint_out = usp_attention(
        q, k, v, ulysses_group=None, ring_group=None, joint_query=jq, joint_key=jk, joint_value=jv,
        joint_position="back",
    )  # fmt: skip
    cat = (torch.cat([q, jq], 1), torch.cat([k, jk], 1), torch.cat([v, jv], 1))
    ref = _sdpa_bshd(*cat)
    tol, _ = attention_tol(*_bhsd(*cat))  # the joint block merged after the image block: another order
    assert (torch.cat([out, joint_out], 1) - ref).abs().max() <= tol


def test_ring_attention_bfloat16_accumulates_in_float32():
    low = [t.bfloat16().requires_grad_(True) for t in _qkv(sq=6, sk=6, layout="bshd")]
    out, _ = ring_attention(*low, group=None, valid_len=None)
    out.float().sum().backward()
    assert out.dtype == low[0].grad.dtype == torch.bfloat16
    # Against exact (fp64) attention of the same bf16 values. Softmax statistics and accumulators are fp32,
    # so only roundings to bf16 remain: forward, the probabilities, the block output and the merged output,
    # each u = eps(bf16) / 2 of at most max|v| (plus fp32 reassociation, attention_tol); backward, the
    # roundings _bf16_grad_bounds counts. With fp32 accumulators bf16 rounding would be 100x these.
    exact = [t.detach().double().requires_grad_(True) for t in low]
    ref = _sdpa_bshd(*exact)
    ref.sum().backward()
    bhsd = _bhsd(*low)
    out_tol = 1.5 * eps(torch.bfloat16) * low[2].abs().max().item() + attention_tol(*bhsd)[0]
    out_err = (out.double() - ref).abs().max().item()
    print(f"bf16 ring out {out_err:.2e} / {out_tol:.2e}")
    assert out_err <= out_tol
    bounds = _bf16_grad_bounds(*bhsd, torch.ones_like(bhsd[0]), out=out.transpose(1, 2))
    for name, mine, full, tol in zip(("dq", "dk", "dv"), low, exact, bounds):
        error = (mine.grad.double() - full.grad).abs().max().item()
        print(f"bf16 ring {name} {error:.2e} / {tol:.2e}")
        assert error <= tol, (name, error, tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["cudnn", "flash", "efficient_cuda", "flash3", "xformers"])
def test_cuda_backend_matches_math_forward_and_block_backward(name):
    if name not in available_backends("cuda", torch.bfloat16):
        pytest.skip(f"{name} is not available here")
    q, k, v = (t.cuda().bfloat16() for t in _qkv(sq=70, sk=90, heads=2, dim=64))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    out, lse = local_attention(q, k, v, backend=name)
    ref, ref_lse = local_attention(q, k, v, backend="math")
    # Same bf16 inputs, fp32 accumulation in both (attention_tol); bf16 roundings of u = eps(bf16) / 2 of at
    # most max|v|: the kernel's probabilities and output, math's output. lse is fp32 in both.
    out_tol, lse_tol = attention_tol(q, k, v)
    out_tol += 1.5 * eps(torch.bfloat16) * v.abs().max().item()
    assert (out.float() - ref.float()).abs().max() <= out_tol and (lse - ref_lse).abs().max() <= lse_tol
    cut = 40  # a block backward with the global out/lse must give that block's share
    for s in (slice(0, cut), slice(cut, 90)):
        mine = local_attention_backward(dout, q, k[:, :, s], v[:, :, s], ref, ref_lse, backend=name)
        theirs = local_attention_backward(dout, q, k[:, :, s], v[:, :, s], ref, ref_lse, backend="math")
        # The kernel's bf16 roundings (_bf16_grad_bounds) plus math's one rounding of its fp32 result.
        bounds = _bf16_grad_bounds(q, k[:, :, s], v[:, :, s], dout, out=ref, lse=ref_lse)
        for a, b, tol in zip(mine, theirs, bounds):
            tol += eps(torch.bfloat16) / 2 * b.float().abs().max().item()
            assert (a.float() - b.float()).abs().max() <= tol
