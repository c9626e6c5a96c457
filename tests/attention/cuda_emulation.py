"""torch's CUDA attention kernels emulated on CPU: their call contracts, computed in fp64.

No GPU here, so the CUDA backends of :mod:`hfpatch.attention.local` (cuDNN, flash, efficient) are run on CPU
tensors under :class:`CudaKernelEmulator`, a ``TorchDispatchMode`` that answers the six aten ops they call.
Each answer is exact attention (fp64, rounded to the output dtype) in the shapes, dtypes and memory layouts
the real kernels return (torch 2.11-2.13; ``torch/_meta_registrations.py``), after checking what the real
kernels assume of their inputs and silently get wrong when it does not hold:

- every kernel: a unit stride on the head dim; dropout 0, no mask, not causal (hfpatch never asks more);
- flash/cuDNN backward: ``cum_seq_q``/``cum_seq_k`` undefined (a defined one selects the varlen/nested
  path) and ``max_q``/``max_k`` equal to the lengths (cuDNN uses them as the sequence lengths);
- cuDNN backward: the stats ``[B, H, S, 1]`` fp32 contiguous, ``out`` in the memory layout of ``query``
  (the cuDNN graph is built from the query's layout);
- flash backward: the lse ``[B, H, S]`` fp32 contiguous;
- efficient backward: the lse ``[B, H, ceil32(S)]``, and ``out`` read with a sequence stride of ``H * D``
  (``[B, S, H, D]`` memory, whatever its strides say): the kernel contract behind the garbage gradients
  measured on an H100 with a ``[B, H, S, D]``-contiguous ``out``. The emulator raises where the kernel
  would have read the wrong memory.

What this proves: hfpatch's plumbing around the kernels (argument order, lse shapes and padding, layouts,
scaling) is exact for every input layout. What it cannot: the kernels' own numerics (the GPU lane does).
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HALF = (torch.float16, torch.bfloat16)


class KernelContractError(AssertionError):
    """An input the real CUDA kernel would have mis-read (silently, on the GPU)."""


def exact_attention(q, k, v, scale):
    """fp64 ``(out, lse)`` of ``[B, H, S, D]`` tensors."""
    s = q.double() @ k.double().mT * scale
    lse = s.logsumexp(-1)
    return (s - lse.unsqueeze(-1)).exp() @ v.double(), lse


def exact_block_grads(dout, q, k, v, out, lse, scale):
    """fp64 ``(dq, dk, dv)`` of one key block given the global ``out``/``lse`` (as the kernels compute them)."""
    q, k, v, dout, out, lse = (t.double() for t in (q, k, v, dout, out, lse))
    probs = (q @ k.mT * scale - lse.unsqueeze(-1)).exp()
    dscores = probs * (dout @ v.mT - (dout * out).sum(-1, keepdim=True)) * scale
    return dscores @ k, dscores.mT @ q, probs.mT @ dout


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise KernelContractError(message)


def _common(name, dtypes, *tensors):
    for t in tensors:
        _require(t.dtype in dtypes, f"{name}: dtype {t.dtype} not in {dtypes}")
        _require(t.stride(-1) == 1 or t.shape[-1] == 1, f"{name}: head dim stride {t.stride(-1)} != 1")


def _like_layout(x: torch.Tensor, shape) -> torch.Tensor:
    """An empty tensor of ``shape`` in the dim order of ``x`` (torch's ``alloc_with_matching_layout``)."""
    order = sorted(range(4), key=lambda i: x.stride(i), reverse=True)
    return torch.empty([shape[i] for i in order], dtype=x.dtype).permute(*[order.index(i) for i in range(4)])


def _bshd_empty(shape, dtype) -> torch.Tensor:
    b, h, s, d = shape
    return torch.empty(b, s, h, d, dtype=dtype).transpose(1, 2)


def _rng():
    return torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


def _fill(empty: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return empty.copy_(value.to(empty.dtype))


def cudnn_fwd(
    q,
    k,
    v,
    attn_bias,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    _common("cudnn", HALF, q, k, v)
    _require(attn_bias is None and dropout_p == 0 and not is_causal and compute_log_sumexp, "cudnn: options")
    out, lse = exact_attention(q, k, v, _scale(q, scale))
    b, h, s, _ = q.shape
    return (_fill(_like_layout(q, out.shape), out), lse.float().reshape(b, h, s, 1), None, None, s, k.shape[2],
            *_rng(), None)  # fmt: skip


def cudnn_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    seed,
    offset,
    attn_bias,
    cum_q,
    cum_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    _common("cudnn backward", HALF, dout, q, k, v, out)
    _require(cum_q is None and cum_k is None, "cudnn backward: cum_seq_q/k defined selects the nested path")
    _require((max_q, max_k) == (q.shape[2], k.shape[2]), f"cudnn backward: max_q/max_k {max_q}/{max_k}")
    _require(attn_bias is None and dropout_p == 0 and not is_causal, "cudnn backward: options")
    _require(lse.dtype == torch.float32 and tuple(lse.shape) == (*q.shape[:3], 1) and lse.is_contiguous(),
             f"cudnn backward: stats {tuple(lse.shape)} {lse.dtype}")  # fmt: skip
    _require(out.stride() == _like_layout(q, out.shape).stride(), "cudnn backward: out not in query's layout")
    grads = exact_block_grads(dout, q, k, v, out, lse.squeeze(-1), _scale(q, scale))
    return tuple(_fill(torch.empty_like(t), g) for t, g in zip((q, k, v), grads))


def flash_fwd(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    _common("flash", HALF, q, k, v)
    _require(dropout_p == 0 and not is_causal, "flash: options")
    out, lse = exact_attention(q, k, v, _scale(q, scale))
    return (_fill(torch.empty_like(q), out), lse.float(), None, None, q.shape[2], k.shape[2],
            torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype))  # fmt: skip


def flash_bwd(
    dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale=None
):
    _common("flash backward", HALF, dout, q, k, v, out)
    _require(cum_q is None and cum_k is None, "flash backward: cum_seq_q/k defined selects the varlen path")
    _require((max_q, max_k) == (q.shape[2], k.shape[2]), f"flash backward: max_q/max_k {max_q}/{max_k}")
    _require(dropout_p == 0 and not is_causal, "flash backward: options")
    _require(lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:3]) and lse.is_contiguous(),
             f"flash backward: lse {tuple(lse.shape)} {lse.dtype}")  # fmt: skip
    grads = exact_block_grads(dout, q, k, v, out, lse, _scale(q, scale))
    return tuple(_fill(torch.empty_like(t), g) for t, g in zip((q, k, v), grads))


def efficient_fwd(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    _common("efficient", (torch.float32, *HALF), q, k, v)
    _require(
        attn_bias is None and dropout_p == 0 and not is_causal and compute_log_sumexp, "efficient: options"
    )
    out, lse = exact_attention(q, k, v, _scale(q, scale))
    b, h, s, _ = q.shape
    padded = torch.full((b, h, math.ceil(s / 32) * 32), float("inf"))  # the tile padding is not a result
    padded[..., :s] = lse
    return _fill(_bshd_empty(q.shape, q.dtype), out), padded, *_rng()


def efficient_bwd(
    dout,
    q,
    k,
    v,
    attn_bias,
    out,
    lse,
    seed,
    offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    _common("efficient backward", (torch.float32, *HALF), dout, q, k, v, out)
    _require(attn_bias is None and dropout_p == 0 and not is_causal, "efficient backward: options")
    b, h, s, d = q.shape
    _require(
        tuple(lse.shape) == (b, h, math.ceil(s / 32) * 32), f"efficient backward: lse {tuple(lse.shape)}"
    )
    _require(s == 1 or out.stride(2) == h * d, f"efficient backward: out read with sequence stride {h * d}, "
             f"its strides are {out.stride()}")  # fmt: skip
    _require(h == 1 or out.stride(1) == d, f"efficient backward: out head stride {out.stride(1)} != {d}")
    grads = exact_block_grads(dout, q, k, v, out, lse[..., :s], _scale(q, scale))
    return (*(_fill(_bshd_empty(t.shape, t.dtype), g) for t, g in zip((q, k, v), grads)), None)


HANDLERS = {
    "_scaled_dot_product_cudnn_attention": cudnn_fwd,
    "_scaled_dot_product_cudnn_attention_backward": cudnn_bwd,
    "_scaled_dot_product_flash_attention": flash_fwd,
    "_scaled_dot_product_flash_attention_backward": flash_bwd,
    "_scaled_dot_product_efficient_attention": efficient_fwd,
    "_scaled_dot_product_efficient_attention_backward": efficient_bwd,
}


class CudaKernelEmulator(TorchDispatchMode):
    """Answers torch's CUDA attention ops on CPU tensors (see the module docstring); counts the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        handler = HANDLERS.get(func.overloadpacket.__name__)
        if handler is None:
            return func(*args, **(kwargs or {}))
        self.calls.append(func.overloadpacket.__name__)
        return handler(*args, **(kwargs or {}))
