"""Local attention kernels that return the log-sum-exp, behind a small backend registry.

Sequence-parallel attention computes attention block by block and merges the blocks with their
log-sum-exp (:mod:`hfpatch.attention.merge`), so a local kernel must return ``(out, lse)`` and must have a
*block* backward: given the merged (global) ``out`` and ``lse``, it returns the gradient contributions of
one key/value block. Kernels are plain functions registered by name; which ones can run is checked when a
backend is resolved (on first use), never at import.

Layouts are SDPA's: ``q_bhsd`` ``[B, H, S_q, D]``, ``k_bhsd``/``v_bhsd`` ``[B, H, S_k, D]``, ``out_bhsd`` like
``q``, ``lse_bhs`` ``[B, H, S_q]`` in float32 (float64 for float64 inputs: :func:`accum_dtype`). Like SDPA,
the kernels take strided views, e.g. ``x_bshd.transpose(1, 2)`` (the sequence-parallel functions keep
``[B, S, H, D]`` memory and pass such views: no copies).

Built-in backends:

- ``"flash_cpu"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ its backward): fused, O(S) memory,
  CPU float32/float64/bfloat16/float16.
- ``"efficient_cuda"``: ``aten._scaled_dot_product_efficient_attention`` with ``compute_log_sumexp``: CUDA,
  fused, float32/float16/bfloat16.
- ``"xformers"``: ``xformers.ops.fmha.memory_efficient_attention_forward_requires_grad`` and
  ``memory_efficient_attention_backward``: CUDA float16/bfloat16, when xformers is importable.
- ``"math"``: explicit matmuls in float32 (float64 for float64) on any device; materialises
  ``[B, H, S_q, S_k]`` (reference).

``"auto"`` picks xformers, then efficient_cuda on CUDA; flash_cpu on CPU; math otherwise.

>>> import torch
>>> q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
>>> out, lse = local_attention(q, k, v, scale=8**-0.5)
>>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
>>> bool(torch.allclose(out, ref, atol=1e-6)), tuple(lse.shape)
(True, (1, 2, 5))
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "AttentionBackend",
    "accum_dtype",
    "available_backends",
    "local_attention",
    "local_attention_backward",
    "register_backend",
    "resolve_backend",
]

Tensor = torch.Tensor
ForwardFn = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
BackwardFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor, Tensor]]


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of softmax statistics and accumulators: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class AttentionBackend:
    """A local attention kernel.

    Attributes:
        name: Registry key.
        forward: ``(q_bhsd, k_bhsd, v_bhsd, scale) -> (out_bhsd, lse_bhs)``, lse in :func:`accum_dtype`.
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
        raise ValueError(
            f"unknown attention backend {name!r}; registered: auto, {', '.join(sorted(_BACKENDS))}"
        )
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
    """Softmax attention of ``q_bhsd`` over ``k_bhsd``/``v_bhsd``, returning ``(out_bhsd, lse_bhs)``.

    Not differentiable by itself: the sequence-parallel autograd functions call
    :func:`local_attention_backward` per block. ``lse`` is in :func:`accum_dtype` (float32 for half inputs).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[1] == 0:  # an idle Ulysses rank (fewer heads than ranks): nothing to compute
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=accum_dtype(q.dtype))
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
    if q.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return resolve_backend(backend, q.device, q.dtype).backward(dout, q, k, v, out, lse, scale)


# ------------------------------------------------------------------------------------------------ math
def _math_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    acc = accum_dtype(q.dtype)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), k.to(acc)) * scale
    lse = scores.logsumexp(dim=-1)
    probs = (scores - lse.unsqueeze(-1)).exp_()
    return torch.einsum("bhqk,bhkd->bhqd", probs, v.to(acc)).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, scale):
    acc = accum_dtype(q.dtype)
    qf, kf, vf, dof = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    probs = (torch.einsum("bhqd,bhkd->bhqk", qf, kf) * scale - lse.unsqueeze(-1)).exp_()
    dv = torch.einsum("bhqk,bhqd->bhkd", probs, dof)
    dprobs = torch.einsum("bhqd,bhkd->bhqk", dof, vf)
    # d softmax: dS = P * (dP - rowsum(dO * O)); with the global O this is exactly this block's share.
    delta = (dof * out.to(acc)).sum(-1, keepdim=True)
    dscores = probs.mul_(dprobs.sub_(delta)).mul_(scale)
    dq = torch.einsum("bhqk,bhkd->bhqd", dscores, kf)
    dk = torch.einsum("bhqk,bhqd->bhkd", dscores, qf)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ------------------------------------------------------------------------------------------------ CPU flash
def _flash_cpu_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
    return out, lse.to(accum_dtype(q.dtype))


def _flash_cpu_backward(dout, q, k, v, out, lse, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.to(accum_dtype(q.dtype)), 0.0, False, scale=scale
    )


# ------------------------------------------------------------------------------------------------ CUDA
def _efficient_forward(q, k, v, scale):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)
    # The kernel may round the lse length up to its tile size; the extra entries are not results.
    return out, lse[..., : q.shape[2]].to(accum_dtype(q.dtype))


def _efficient_backward(dout, q, k, v, out, lse, scale):
    empty = torch.empty(0, device=q.device)
    # Give the lse back the forward's shape: its length rounded up to the kernel's 32-row alignment.
    lse = torch.nn.functional.pad(lse.float(), (0, -lse.shape[-1] % 32))
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, k, v, None, out, lse, empty, empty,
        0.0, [True, True, True, False], scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _bshd(*tensors: Tensor) -> list[Tensor]:
    return [t.transpose(1, 2) for t in tensors]


def _xformers_forward(q, k, v, scale):
    from xformers.ops import fmha

    # xformers takes [B, S, H, D]: pass transposed views, return to SDPA's layout the same way.
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(*_bshd(q, k, v), scale=scale)
    return out.transpose(1, 2), lse[..., : q.shape[2]].to(accum_dtype(q.dtype))


def _xformers_backward(dout, q, k, v, out, lse, scale):
    from xformers.ops import fmha

    grads = fmha.memory_efficient_attention_backward(
        *(t.contiguous() for t in _bshd(dout, out)), lse.float().contiguous(), *_bshd(q, k, v), scale=scale
    )
    return tuple(g.transpose(1, 2) for g in grads)


def _cuda_dtypes(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in (torch.float32, torch.float16, torch.bfloat16)


def _xformers_supports(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        dtype in (torch.float16, torch.bfloat16)
        and device.type == "cuda"
        and (importlib.util.find_spec("xformers") is not None)
    )


register_backend(AttentionBackend("math", _math_forward, _math_backward, lambda device, dtype: True))
register_backend(
    AttentionBackend(
        "flash_cpu",
        _flash_cpu_forward,
        _flash_cpu_backward,
        lambda device, dtype: (
            device.type == "cpu" and dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        ),
    )
)
register_backend(AttentionBackend("efficient_cuda", _efficient_forward, _efficient_backward, _cuda_dtypes))
register_backend(AttentionBackend("xformers", _xformers_forward, _xformers_backward, _xformers_supports))
