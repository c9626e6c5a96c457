"""Backend selection (``"auto"`` and names, with CUDA availability faked), input layouts, and the CUDA
backends' forward and block backward on CPU through :mod:`tests.attention.cuda_emulation`.

Tolerances. The emulated kernels compute in fp64 and round once to the output dtype, so a backend whose
plumbing is right is within one rounding (``u = eps / 2`` of the largest magnitude) of fp64 attention of the
same inputs; any slip (a wrong lse row, a missing scale, a transposed layout, a block's lse used where the
global one belongs) is O(1). The real CPU kernels (math, flash_cpu) on other layouts are compared with the
contiguous call within ``attention_tol``/``reassociation_tol`` (same attention, another summation order).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from cuda_emulation import CudaKernelEmulator, KernelContractError, exact_attention, exact_block_grads
from torch.nn.attention import SDPBackend, sdpa_kernel

import hfpatch.attention.local as local
from hfpatch.attention import ring_attention, usp_attention
from hfpatch.attention.local import (
    available_backends,
    local_attention,
    local_attention_backward,
    resolve_backend,
    to_layout,
)
from hfpatch.testing.tolerance import attention_tol, eps

CUDA = torch.device("cuda")
CUDA_KERNELS = ("cudnn", "flash", "efficient_cuda")


# ------------------------------------------------------------------------------------------------ selection
def _h100_sdpa(device, dtype, head_dim):
    """torch's SDPA selector on an H100 with cuDNN >= 9.9 (torch 2.11-2.13, dense, unmasked, with grad):
    cuDNN first for half precision (``check_prefer_cudnn_attention``), then flash, efficient, math; each
    behind its ``torch.backends.cuda.enable_*_sdp`` switch, which ``sdpa_kernel(...)`` sets."""
    cuda = torch.backends.cuda
    half = dtype in (torch.float16, torch.bfloat16)
    if cuda.cudnn_sdp_enabled() and half and head_dim % 8 == 0 and head_dim <= 256:
        return "CUDNN_ATTENTION"
    if cuda.flash_sdp_enabled() and half and head_dim % 8 == 0 and head_dim <= 256:
        return "FLASH_ATTENTION"
    if cuda.mem_efficient_sdp_enabled() and head_dim % (8 if half else 4) == 0:
        return "EFFICIENT_ATTENTION"
    return "MATH"


def _a100_sdpa(device, dtype, head_dim):
    """The same selector on an A100 (sm80: no cuDNN preference): flash, efficient, math."""
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return _h100_sdpa(device, dtype, head_dim)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(selector)``: torch's SDPA selector answers as ``selector`` (no CUDA device needed)."""

    def install(selector):
        local._cached_sdpa_choice.cache_clear()
        monkeypatch.setattr(local, "_probe_sdpa", selector)

    yield install
    local._cached_sdpa_choice.cache_clear()


@pytest.mark.parametrize(
    "gpu, dtype, head_dim, expected",
    [
        (_h100_sdpa, torch.bfloat16, 128, "cudnn"),  # Wan, Flux, QwenImage heads
        (_h100_sdpa, torch.float16, 64, "cudnn"),
        (_h100_sdpa, torch.bfloat16, 256, "cudnn"),
        (_h100_sdpa, torch.bfloat16, 512, "efficient_cuda"),  # beyond cuDNN's and flash's head dims
        (_h100_sdpa, torch.bfloat16, 100, "math"),  # no fused kernel takes it: SDPA runs math, so do we
        (_h100_sdpa, torch.float32, 128, "efficient_cuda"),  # fp32: no cuDNN/flash
        (_h100_sdpa, torch.float32, 6, "math"),
        (_a100_sdpa, torch.bfloat16, 128, "flash"),
        (_a100_sdpa, torch.float16, 96, "flash"),
        (_a100_sdpa, torch.float32, 64, "efficient_cuda"),
    ],
)
def test_auto_on_cuda_picks_the_lse_form_of_what_sdpa_runs(fake_gpu, gpu, dtype, head_dim, expected):
    fake_gpu(gpu)
    assert resolve_backend("auto", CUDA, dtype, head_dim).name == expected


def test_auto_on_cuda_follows_the_sdpa_kernel_context(fake_gpu):
    """``sdpa_kernel(...)`` restricts the stock model's SDPA; "auto" follows it (the choice is cached per
    switch state, so a context never leaks into the next call)."""
    fake_gpu(_h100_sdpa)
    assert resolve_backend("auto", CUDA, torch.bfloat16, 128).name == "cudnn"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert resolve_backend("auto", CUDA, torch.bfloat16, 128).name == "flash"
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert resolve_backend("auto", CUDA, torch.bfloat16, 128).name == "efficient_cuda"
    assert resolve_backend("auto", CUDA, torch.bfloat16, 128).name == "cudnn"


def test_auto_on_cuda_without_an_lse_form_of_sdpas_choice_takes_the_fastest_that_fits(fake_gpu):
    fake_gpu(lambda device, dtype, head_dim: "OVERRIDEABLE")  # a kernel hfpatch has no lse form of
    assert resolve_backend("auto", CUDA, torch.bfloat16, 128).name == "cudnn"
    assert resolve_backend("auto", CUDA, torch.bfloat16, 512).name == "efficient_cuda"
    assert resolve_backend("auto", CUDA, torch.float32, 64).name == "efficient_cuda"
    assert resolve_backend("auto", CUDA, torch.float64, 64).name == "math"


def test_auto_on_cpu_is_what_sdpa_runs_there_for_every_float_dtype():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        q = torch.empty(1, 8, 2, 16, dtype=dtype).transpose(1, 2)
        assert SDPBackend(torch._fused_sdp_choice(q, q, q)).name == "FLASH_ATTENTION"  # torch's own answer
        assert resolve_backend("auto", "cpu", dtype, 16).name == "flash_cpu"


def test_named_backends_refuse_what_they_cannot_run_by_name(monkeypatch):
    with pytest.raises(ValueError, match="'cudnn' cannot run on cuda with torch.float32; available there: "):
        resolve_backend("cudnn", CUDA, torch.float32, 64)
    with pytest.raises(
        ValueError, match="'flash' cannot take head dim 512 with torch.bfloat16; available: .*efficient_cuda"
    ):
        resolve_backend("flash", CUDA, torch.bfloat16, 512)
    with pytest.raises(ValueError, match="'cudnn' cannot run on cpu"):
        resolve_backend("cudnn", "cpu", torch.bfloat16, 64)
    # FlashAttention-3 and xformers run only where installed (looked up at resolution, never imported early)
    monkeypatch.setattr(local, "_installed", lambda module: False)
    assert not {"flash3", "xformers"} & set(available_backends(CUDA, torch.bfloat16, 128))
    with pytest.raises(ValueError, match="'flash3' cannot run on cuda with torch.bfloat16"):
        resolve_backend("flash3", CUDA, torch.bfloat16, 128)
    monkeypatch.setattr(local, "_installed", lambda module: True)
    assert {"flash3", "xformers"} <= set(available_backends(CUDA, torch.bfloat16, 128))
    assert resolve_backend("flash3", CUDA, torch.bfloat16, 128).name == "flash3"
    assert "flash3" not in available_backends(CUDA, torch.float32, 128)


def test_importing_hfpatch_attention_imports_no_optional_kernel_package():
    import subprocess
    import sys

    code = "import hfpatch.attention, sys; print([m for m in ('flash_attn_interface', 'xformers') if m in sys.modules])"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "[]"
    )


# ------------------------------------------------------------------------------------------------ layouts
def _layouts(shape: tuple[int, int, int, int], dtype, gen) -> dict[str, torch.Tensor]:
    """The same values in every memory layout a caller may hand over, as [B, H, S, D] tensors."""
    b, h, s, d = shape
    base = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64).to(dtype)
    wide = torch.zeros(b, h, s, 2 * d, dtype=dtype)
    wide[..., ::2] = base
    longer = torch.zeros(b, s + 3, h, d, dtype=dtype)
    longer[:, :s] = base.transpose(1, 2)
    return {
        "bhsd contiguous": base.contiguous(),
        "bshd (a [B, S, H, D] tensor transposed)": base.transpose(1, 2).contiguous().transpose(1, 2),
        "sliced sequence of a longer bshd tensor": longer[:, :s].transpose(1, 2),
        "strided head dim": wide[..., ::2],
        "sbhd (sequence-major)": base.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3),
    }


def test_to_layout_copies_only_what_is_not_in_the_layout():
    gen = torch.Generator().manual_seed(0)
    for name, x in _layouts((2, 3, 5, 4), torch.float32, gen).items():
        for layout in ("strided", "bshd"):
            y = to_layout(x, layout)
            assert torch.equal(y, x) and y.stride(-1) == 1, name
            assert layout == "strided" or y.transpose(1, 2).is_contiguous(), name
            assert (y is x) == (local._in_layout(x, layout)), name
    with pytest.raises(ValueError, match="layout must be one of"):
        to_layout(x, "bsd")


@pytest.mark.parametrize("backend", ["math", "flash_cpu"])
def test_cpu_backends_accept_every_input_layout(backend):
    """Forward and block backward of every layout equal the contiguous call within reassociation."""
    gen = torch.Generator().manual_seed(1)
    qs, ks, vs, dos = (_layouts((2, 3, s, 8), torch.float32, gen) for s in (6, 9, 9, 6))
    ref_q, ref_k, ref_v, ref_do = (next(iter(t.values())) for t in (qs, ks, vs, dos))
    ref_out, ref_lse = local_attention(ref_q, ref_k, ref_v, backend="math")
    exact = exact_attention(ref_q, ref_k, ref_v, 8**-0.5)
    grads = exact_block_grads(ref_do, ref_q, ref_k[:, :, :4], ref_v[:, :, :4], ref_out, ref_lse, 8**-0.5)
    out_tol, lse_tol = attention_tol(ref_q, ref_k, ref_v)
    for name in qs:
        out, lse = local_attention(qs[name], ks[name], vs[name], backend=backend)
        assert (out.double() - exact[0]).abs().max() <= out_tol, name
        assert (lse.double() - exact[1]).abs().max() <= lse_tol, name
        layout_out = to_layout(ref_out, "bshd") if "bshd" in name else ref_out
        mine = local_attention_backward(
            dos[name], qs[name], ks[name][:, :, :4], vs[name][:, :, :4], layout_out, ref_lse, backend=backend
        )
        for g, r in zip(mine, grads):
            assert (g.double() - r).abs().max() <= 64 * eps() * r.abs().max() * 9, name  # 9 keys' sums


def test_local_attention_refuses_shapes_by_name():
    q = torch.randn(1, 2, 5, 8)
    cases = [
        ((q[0], q, q), "q must be a floating \\[B, H, S, D\\] tensor, got \\(2, 5, 8\\)"),
        ((q, q.double(), q), "q, k and v must share dtype and device"),
        ((q, q[..., :4], q[..., :4]), "k and v must be \\[B=1, H=2, S_k, D=8\\] like q"),
        ((q, q[:, :1], q[:, :1]), "grouped-query heads are not expanded here"),
        ((q, q, q[:, :, :3]), "k and v must be"),
        ((q.long(), q, q), "q must be a floating"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            local_attention(*args)
    out, lse = local_attention(q, q, q)
    with pytest.raises(ValueError, match="lse must be a floating \\[B, H, S_q\\] = \\(1, 2, 5\\) tensor"):
        local_attention_backward(q, q, q, q, out, lse[..., :4])
    with pytest.raises(ValueError, match="dout must be shaped like q"):
        local_attention_backward(q[:, :, :4], q, q, q, out, lse)


def test_local_attention_without_keys_contributes_nothing():
    q = torch.randn(1, 2, 5, 8)
    out, lse = local_attention(q, q[:, :, :0], q[:, :, :0])
    assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isneginf(lse).all())


# ------------------------------------------------------------------------------------------------ CUDA, emulated
@pytest.fixture
def emulated(monkeypatch):
    """The CUDA backends run on CPU tensors: their kernels answered by the emulator, resolution allowed."""
    for name in CUDA_KERNELS:
        backend = local._BACKENDS[name]
        monkeypatch.setitem(
            local._BACKENDS,
            name,
            dataclasses.replace(backend, supports=lambda device, dtype, b=backend: b.supports(CUDA, dtype)),
        )
    with CudaKernelEmulator() as mode:
        yield mode


def _rounding(dtype: torch.dtype, reference: torch.Tensor) -> float:
    return eps(dtype) / 2 * reference.abs().max().item() * 1.001


@pytest.mark.parametrize("name, dtype", [("cudnn", torch.bfloat16), ("flash", torch.float16),
                                         ("efficient_cuda", torch.bfloat16), ("efficient_cuda", torch.float32)])  # fmt: skip
def test_cuda_backend_forward_and_block_backward_exact_for_every_layout(emulated, name, dtype):
    """Every layout of q/k/v/dout, and the global out in the layout Ring and the sharded-keys path pass
    ([B, S, H, D] memory and [B, H, S, D]-contiguous: the latter gave nan with the efficient kernel before)."""
    gen = torch.Generator().manual_seed(2)
    qs, ks, vs, dos = (_layouts((2, 3, s, 16), dtype, gen) for s in (70, 90, 90, 70))
    first = next(iter(qs))
    scale = 16**-0.5
    glob_out, glob_lse = local_attention(qs[first], ks[first], vs[first], backend="math")  # the merged result
    for layout in qs:
        q, k, v, dout = qs[layout], ks[layout], vs[layout], dos[layout]
        out, lse = local_attention(q, k, v, backend=name)
        assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        ref_out, ref_lse = exact_attention(q, k, v, scale)
        assert (out.double() - ref_out).abs().max() <= _rounding(dtype, ref_out), layout
        assert (lse.double() - ref_lse).abs().max() <= 1e-5 * ref_lse.abs().max(), layout
        for out_layout in (glob_out, to_layout(glob_out, "bshd")):
            for keys in (slice(0, 40), slice(40, 90)):  # one key block, the global out/lse
                mine = local_attention_backward(
                    dout, q, k[:, :, keys], v[:, :, keys], out_layout, glob_lse, backend=name
                )
                ref = exact_block_grads(dout, q, k[:, :, keys], v[:, :, keys], glob_out, glob_lse, scale)
                for which, g, r in zip(("dq", "dk", "dv"), mine, ref):
                    assert g.dtype == dtype and g.shape == r.shape
                    assert (g.double() - r).abs().max() <= _rounding(dtype, r), (layout, which)
    assert {
        "_scaled_dot_product_" + n for n in ("cudnn_attention", "flash_attention", "efficient_attention")
    } & set(emulated.calls)


def test_emulator_catches_the_efficient_backward_layout_bug(emulated):
    """The contract the fix rests on: the kernel called with a [B, H, S, D]-contiguous ``out`` (what hfpatch
    did before) is what produced garbage on the GPU; the emulator refuses it."""
    q, k, v = (torch.randn(1, 3, 40, 16).bfloat16() for _ in range(3))
    out, lse = local_attention(q, k, v, backend="math")
    with pytest.raises(KernelContractError, match="out read with sequence stride 48"):
        local._efficient_backward(q, q, k, v, out.contiguous(), lse, 0.25)


@pytest.mark.parametrize("name", CUDA_KERNELS)
def test_cuda_backend_in_ring_matches_fp64_with_joint_padding_and_masked_text(emulated, name):
    """Ring's single-rank path (the block backward with the global out/lse, joint text with a per-sample key
    mask, padded keys) on each CUDA backend: outputs and gradients within bf16 rounding of fp64 SDPA."""
    dtype = torch.float32 if name == "efficient_cuda" else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 12, 2, 16, generator=g).to(dtype).requires_grad_() for _ in range(3))
    jq, jk, jv = (torch.randn(2, 5, 2, 16, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    out, joint_out = ring_attention(q, k, v, group=None, valid_len=10, joint_query=jq, joint_key=jk,
                                    joint_value=jv, joint_key_mask=mask, backend=name)  # fmt: skip
    dout = torch.randn(out.shape, generator=g).to(dtype)
    djoint = torch.randn(joint_out.shape, generator=g).to(dtype)
    torch.autograd.backward((out, joint_out), (dout, djoint))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, jq, jk, jv)]
    ref_out, ref_joint = [], []
    for b in range(2):  # fp64 SDPA per sample: the masked text keys left out
        keep = mask[b].nonzero().squeeze(1)
        cat = [torch.cat([j[b : b + 1], x[b : b + 1, : (12 if i == 0 else 10)]], 1) for i, (j, x) in
               enumerate(zip(leaves[3:], leaves[:3]))]  # fmt: skip
        cat[1] = torch.cat([leaves[4][b : b + 1, keep], leaves[1][b : b + 1, :10]], 1)
        cat[2] = torch.cat([leaves[5][b : b + 1, keep], leaves[2][b : b + 1, :10]], 1)
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in cat)).transpose(1, 2)
        ref_joint.append(o[:, :5])
        ref_out.append(o[:, 5:])
    ref_out, ref_joint = torch.cat(ref_out), torch.cat(ref_joint)
    torch.autograd.backward((ref_out, ref_joint), (dout.double(), djoint.double()))
    # bf16: the merge and the block outputs round to bf16 once each (1.5 u of max|v|), the gradients a few
    # roundings of their own magnitude (the kernels' bf16 outputs summed over up to 3 blocks).
    u = eps(dtype) / 2
    assert (out.double() - ref_out).abs().max() <= 3 * u * v.abs().max().item() + 1e-6
    assert (joint_out.double() - ref_joint).abs().max() <= 3 * u * jv.abs().max().item() + 1e-6
    for mine, ref in zip((q, k, v, jq, jk, jv), leaves):
        scale = ref.grad.abs().max().item()
        assert (mine.grad.double() - ref.grad).abs().max() <= 8 * u * scale + 1e-6


@pytest.mark.parametrize("name", CUDA_KERNELS)
def test_cuda_backend_calls_fit_the_real_aten_schemas(name):
    """The backends' calls on meta tensors: torch's own op schemas and meta kernels check the argument list
    and types, and the shapes/dtypes hfpatch returns (no emulator involved)."""
    backend = local._BACKENDS[name]
    dtype = torch.float32 if name == "efficient_cuda" else torch.bfloat16
    q = torch.empty(2, 70, 3, 64, device="meta", dtype=dtype).transpose(1, 2)
    k = torch.empty(2, 90, 3, 64, device="meta", dtype=dtype).transpose(1, 2)
    out, lse = backend.forward(q, k, k, 0.125)
    assert (
        out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 3, 70) and lse.dtype == torch.float32
    )
    dq, dk, dv = backend.backward(to_layout(out, "bshd"), q, k, k, to_layout(out, "bshd"), lse, 0.125)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


# ------------------------------------------------------------------------------------------------ ring degree 1
class _CountSDPA(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.masks.append(kwargs.get("attn_mask"))
        return func(*args, **kwargs)


def test_ring_degree_one_is_one_sdpa_call_like_the_stock_model(monkeypatch):
    """No lse needed: Ulysses alone calls F.scaled_dot_product_attention once over the joined sequence (the
    padded keys cut off, the text key mask as SDPA's mask), no hfpatch kernel; forward and backward exact."""
    monkeypatch.setattr(
        local, "local_attention", lambda *a, **k: pytest.fail("no lse kernel at ring degree 1")
    )
    g = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(2, 7, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    jq, jk, jv = (
        torch.randn(2, 3, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    mask = torch.tensor([[True, False, True], [True, True, True]])
    with _CountSDPA() as calls:
        out, joint_out = usp_attention(q, k, v, ulysses_group=None, ring_group=None, valid_len=5,
                                       joint_query=jq, joint_key=jk, joint_value=jv, joint_key_mask=mask,
                                       joint_position="back")  # fmt: skip
    assert (
        len(calls.masks) == 1 and calls.masks[0].shape == (2, 1, 1, 8) and calls.masks[0].dtype == torch.bool
    )
    assert torch.equal(out[:, 5:], torch.zeros_like(out[:, 5:]))  # padded query rows
    cat = [torch.cat([x[:, :5], j], 1).transpose(1, 2) for x, j in zip((q, k, v), (jq, jk, jv))]
    bias = torch.cat([torch.ones(2, 5, dtype=torch.bool), mask], 1)[:, None, None, :]
    ref = F.scaled_dot_product_attention(*cat, attn_mask=bias).transpose(1, 2)
    assert torch.allclose(torch.cat([out[:, :5], joint_out], 1), ref, atol=1e-12, rtol=0)
    torch.autograd.gradcheck(
        lambda *t: usp_attention(*t[:3], ulysses_group=None, ring_group=None, valid_len=5, joint_query=t[3],
                                 joint_key=t[4], joint_value=t[5], joint_key_mask=mask),
        (q, k, v, jq, jk, jv),
    )  # fmt: skip


def test_sdpa_choice_needs_no_gpu_to_import_and_is_cached_per_state(fake_gpu):
    calls = []
    fake_gpu(lambda device, dtype, head_dim: calls.append(head_dim) or "FLASH_ATTENTION")
    for _ in range(3):
        assert resolve_backend("auto", CUDA, torch.bfloat16, 64).name == "flash"
    assert calls == [64]
    assert math.isfinite(local._cached_sdpa_choice.cache_info().hits)
