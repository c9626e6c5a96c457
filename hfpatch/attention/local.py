"""Local attention kernels that return the log-sum-exp, behind a small backend registry.

Sequence-parallel attention computes attention block by block and merges the blocks with their
log-sum-exp (:mod:`hfpatch.attention.merge`), so a local kernel must return ``(out, lse)`` and must have a
*block* backward: given the merged (global) ``out`` and ``lse``, it returns the gradient contributions of
one key/value block. Kernels are plain functions registered by name; which ones can run is checked when a
backend is resolved (on first use), never at import.

Layouts: ``q_bshd`` ``[B, S_q, H, D]``, ``k_bshd``/``v_bshd`` ``[B, S_k, H, D]``, ``out_bshd`` like ``q``,
``lse_bhs`` ``[B, H, S_q]`` in float32.

Built-in backends:

- ``"flash_cpu"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ its backward): fused, O(S) memory,
  CPU float32/float64/bfloat16/float16.
- ``"efficient_cuda"``: ``aten._scaled_dot_product_efficient_attention`` with ``compute_log_sumexp``: CUDA,
  fused, float32/float16/bfloat16.
- ``"xformers"``: ``xformers.ops.fmha.memory_efficient_attention_forward_requires_grad`` and
  ``memory_efficient_attention_backward``: CUDA, when xformers is importable.
- ``"math"``: explicit matmuls in float32 on any device (materialises ``[B, H, S_q, S_k]``; reference).

``"auto"`` picks xformers, then efficient_cuda on CUDA; flash_cpu on CPU; math otherwise.

>>> import torch
>>> q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
>>> out, lse = local_attention(q, k, v, scale=8**-0.5)
>>> ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
>>> bool(torch.allclose(out, ref.transpose(1, 2), atol=1e-6)), tuple(lse.shape)
(True, (1, 2, 5))
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "AttentionBackend",
    "available_backends",
    "local_attention",
    "local_attention_backward",
    "register_backend",
    "resolve_backend",
]

Tensor = torch.Tensor
ForwardFn = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
BackwardFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class AttentionBackend:
    """A local attention kernel.

    Attributes:
        name: Registry key.
        forward: ``(q_bshd, k_bshd, v_bshd, scale) -> (out_bshd, lse_bhs float32)``.
        backward: ``(dout, q, k, v, out, lse, scale) -> (dq, dk, dv)`` for one key block, where ``out`` and
            ``lse`` are the merged values over *all* key blocks (so the result is that block's contribution).
        supports: ``(device, dtype) -> bool``; may import optional packages (it runs on first use only).
    """

    name: str
    forward: ForwardFn
    backward: BackwardFn
    supports: Callable[[torch.device, torch.dtype], bool]


_BACKENDS: dict[str, AttentionBackend] = {}
#: Preference order of ``backend="auto"``.
_AUTO_ORDER = ("xformers", "efficient_cuda", "flash_cpu", "math")


def register_backend(backend: AttentionBackend) -> None:
    """Add ``backend`` to the registry (a name may be registered once; ``"auto"`` is reserved)."""
    if backend.name == "auto" or backend.name in _BACKENDS:
        raise ValueError(
            f"attention backend name {backend.name!r} is reserved or taken; registered: {sorted(_BACKENDS)}"
        )
    _BACKENDS[backend.name] = backend


def available_backends(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list[str]:
    """Names of the registered backends that run on ``device`` with ``dtype``."""
    device = torch.device(device)
    return [name for name, b in _BACKENDS.items() if b.supports(device, dtype)]


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """The backend called ``name`` (or the best one for ``"auto"``) for ``device``/``dtype``.

    Raises:
        ValueError: Unknown name, or a backend that cannot run on this device/dtype.
    """
    device = torch.device(device)
    if name == "auto":
        for candidate in _AUTO_ORDER:
            if candidate in _BACKENDS and _BACKENDS[candidate].supports(device, dtype):
                return _BACKENDS[candidate]
        name = "math"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: auto, {', '.join(sorted(_BACKENDS))}")
    backend = _BACKENDS[name]
    if not backend.supports(device, dtype):
        raise ValueError(
            f"attention backend {name!r} cannot run on {device.type} with {dtype}; available there: "
            f"{', '.join(available_backends(device, dtype))} (or pass backend='auto')"
        )
    return backend


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Softmax attention of ``q_bshd`` over ``k_bshd``/``v_bshd``, returning ``(out_bshd, lse_bhs)``.

    Not differentiable by itself: the sequence-parallel autograd functions call
    :func:`local_attention_backward` per block. ``lse`` is float32 whatever the input dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[2] == 0:  # an idle Ulysses rank (fewer heads than ranks): nothing to compute
        return torch.empty_like(q), q.new_empty(q.shape[0], 0, q.shape[1], dtype=torch.float32)
    return resolve_backend(backend, q.device, q.dtype).forward(q, k, v, scale)


def local_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of one key/value block, given the merged ``out``/``lse`` of all blocks."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return resolve_backend(backend, q.device, q.dtype).backward(dout, q, k, v, out, lse, scale)


# ------------------------------------------------------------------------------------------------ math
def _math_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    lse = scores.logsumexp(dim=-1)
    probs = (scores - lse.unsqueeze(-1)).exp_()
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, scale):
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
    probs = (torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale - lse.unsqueeze(-1)).exp_()
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, dof)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", dof, vf)
    # d softmax: dS = P * (dP - rowsum(dO * O)); with the global O this is exactly this block's share.
    delta = (dof * out.float()).sum(-1).transpose(1, 2).unsqueeze(-1)
    dscores = probs.mul_(dprobs.sub_(delta)).mul_(scale)
    dq = torch.einsum("bhqk,bkhd->bqhd", dscores, kf)
    dk = torch.einsum("bhqk,bqhd->bkhd", dscores, qf)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ------------------------------------------------------------------------------------------------ CPU flash
def _bhsd(*tensors: Tensor) -> list[Tensor]:
    return [t.transpose(1, 2) for t in tensors]


def _flash_cpu_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_bhsd(q, k, v), scale=scale)
    return out.transpose(1, 2), lse.float()


def _flash_cpu_backward(dout, q, k, v, out, lse, scale):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_bhsd(dout.contiguous(), q, k, v, out), lse.contiguous(), 0.0, False, scale=scale
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ------------------------------------------------------------------------------------------------ CUDA
def _efficient_forward(q, k, v, scale):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        *_bhsd(q, k, v), None, True, scale=scale
    )
    # The kernel may round the lse length up to its tile size; the extra entries are not results.
    return out.transpose(1, 2), lse[..., : q.shape[1]].float()


def _efficient_backward(dout, q, k, v, out, lse, scale):
    empty = torch.empty(0, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        *_bhsd(dout.contiguous(), q, k, v), None, out.transpose(1, 2), lse.contiguous(), empty, empty,
        0.0, [True, True, True, False], scale=scale,
    )  # fmt: skip
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _xformers_forward(q, k, v, scale):
    from xformers.ops import fmha

    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, scale=scale)
    return out, lse[..., : q.shape[1]].float()


def _xformers_backward(dout, q, k, v, out, lse, scale):
    from xformers.ops import fmha

    return fmha.memory_efficient_attention_backward(dout.contiguous(), out, lse.contiguous(), q, k, v, scale=scale)


def _cuda_dtypes(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in (torch.float32, torch.float16, torch.bfloat16)


def _xformers_supports(device: torch.device, dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16) and device.type == "cuda" and (
        importlib.util.find_spec("xformers") is not None
    )


register_backend(AttentionBackend("math", _math_forward, _math_backward, lambda device, dtype: True))
register_backend(
    AttentionBackend(
        "flash_cpu",
        _flash_cpu_forward,
        _flash_cpu_backward,
        lambda device, dtype: device.type == "cpu"
        and dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    )
)
register_backend(AttentionBackend("efficient_cuda", _efficient_forward, _efficient_backward, _cuda_dtypes))
register_backend(AttentionBackend("xformers", _xformers_forward, _xformers_backward, _xformers_supports))
