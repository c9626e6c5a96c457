"""Local attention kernels that return the log-sum-exp, behind a small backend registry.

Ring attention computes attention block by block and merges the blocks with their log-sum-exp
(:mod:`hfpatch.attention.merge`), so a local kernel must return ``(out, lse)`` and must have a *block*
backward: given the merged (global) ``out`` and ``lse``, it returns the gradient contributions of one
key/value block. Kernels are plain functions registered by name; optional packages (FlashAttention-3,
xformers) are imported when a kernel is resolved or called, never at import.

Layouts are SDPA's: ``q_bhsd`` ``[B, H, S_q, D]``, ``k_bhsd``/``v_bhsd`` ``[B, H, S_k, D]``, ``out_bhsd`` like
``q``, ``lse_bhs`` ``[B, H, S_q]`` in float32 (float64 for float64 inputs: :func:`accum_dtype`). Any memory
layout is accepted: each backend declares the one its kernel reads (:attr:`AttentionBackend.layout`) and
:func:`local_attention` / :func:`local_attention_backward` copy an input into it only when it is not there
already. ``"bshd"`` is ``[B, S, H, D]`` memory, what ``x_bshd.transpose(1, 2)`` gives and what the stock
model's own SDPA call hands the CUDA kernels (Ring keeps its tensors so: no copies); ``"strided"`` is any
strides with a unit last stride. Shapes, dtypes and devices that do not fit are refused by name
(``ValueError``), never computed.

Built-in backends:

- ``"cudnn"``: ``aten._scaled_dot_product_cudnn_attention`` (+ its backward): CUDA, float16/bfloat16,
  head dim a multiple of 8 up to 256. What SDPA runs on Hopper/Blackwell with a recent cuDNN.
- ``"flash"``: ``aten._scaled_dot_product_flash_attention`` (+ backward): CUDA, float16/bfloat16, head dim a
  multiple of 8 up to 256. (With torch's FlashAttention-3 implementation activated, that is FA3.)
- ``"efficient_cuda"``: ``aten._scaled_dot_product_efficient_attention`` (+ backward): CUDA,
  float32/float16/bfloat16.
- ``"flash3"``: FlashAttention-3 (``flash_attn_interface``), when installed: CUDA float16/bfloat16.
- ``"xformers"``: ``xformers.ops.fmha`` memory-efficient attention, when installed: CUDA float16/bfloat16.
- ``"flash_cpu"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward): CPU, what SDPA runs
  there for every floating dtype.
- ``"math"``: explicit matmuls in float32 (float64 for float64) on any device; materialises
  ``[B, H, S_q, S_k]`` (reference).

``"auto"`` picks the kernel the unpatched model's ``F.scaled_dot_product_attention`` would run for this
device, dtype and head dim (torch's own selector, honouring ``torch.nn.attention.sdpa_kernel`` and the
``torch.backends.cuda.enable_*_sdp`` switches): cuDNN, then flash, on recent GPUs for half precision;
efficient (or math) for float32 on CUDA; ``flash_cpu`` on CPU. Masks never reach these kernels: hfpatch
turns key masks into per-sample key truncation, so a masked model gets the same fast kernel as an unmasked
one. FlashAttention-3 and xformers are never picked by ``"auto"`` (the stock model does not run them):
name them, or choose diffusers' ``_flash_3``/``xformers`` attention backend.

>>> import torch
>>> q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
>>> out, lse = local_attention(q, k, v, scale=8**-0.5)
>>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
>>> bool(torch.allclose(out, ref, atol=1e-6)), tuple(lse.shape)
(True, (1, 2, 5))
>>> resolve_backend("auto", "cpu", torch.float32, head_dim=8).name
'flash_cpu'
"""

from __future__ import annotations

import functools
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
    "to_layout",
]

Tensor = torch.Tensor
ForwardFn = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
BackwardFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor, Tensor]]
LAYOUTS = ("strided", "bshd")
HALF = (torch.float16, torch.bfloat16)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of softmax statistics and accumulators: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _any_head_dim(head_dim: int, dtype: torch.dtype) -> bool:
    return True


@dataclass(frozen=True)
class AttentionBackend:
    """A local attention kernel.

    Attributes:
        name: Registry key.
        forward: ``(q_bhsd, k_bhsd, v_bhsd, scale) -> (out_bhsd, lse_bhs)``, lse in :func:`accum_dtype`.
        backward: ``(dout, q, k, v, out, lse, scale) -> (dq, dk, dv)`` for one key block, where ``out`` and
            ``lse`` are the merged values over *all* key blocks (so the result is that block's contribution).
        supports: ``(device, dtype) -> bool``; may look for optional packages (it runs on resolution only).
        layout: The memory layout the kernel reads (``"strided"`` or ``"bshd"``); inputs are copied into it
            only when they are not in it (:func:`to_layout`).
        head_dims: ``(head_dim, dtype) -> bool``: the head dims the kernel takes.
    """

    name: str
    forward: ForwardFn
    backward: BackwardFn
    supports: Callable[[torch.device, torch.dtype], bool]
    layout: str = "strided"
    head_dims: Callable[[int, torch.dtype], bool] = _any_head_dim

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"AttentionBackend {self.name!r}: layout must be one of {LAYOUTS}, got {self.layout!r}"
            )

    def fits(self, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> bool:
        """Whether this kernel runs on ``device`` with ``dtype`` (and ``head_dim``, when given)."""
        return self.supports(device, dtype) and (head_dim is None or self.head_dims(head_dim, dtype))


_BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> None:
    """Add ``backend`` to the registry (a name may be registered once; ``"auto"`` is reserved)."""
    if backend.name == "auto" or backend.name in _BACKENDS:
        raise ValueError(
            f"attention backend name {backend.name!r} is reserved or taken; registered: {sorted(_BACKENDS)}"
        )
    _BACKENDS[backend.name] = backend


def available_backends(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, head_dim: int | None = None
) -> list[str]:
    """Names of the registered backends that run on ``device`` with ``dtype`` (and ``head_dim``)."""
    device = torch.device(device)
    return [name for name, b in _BACKENDS.items() if b.fits(device, dtype, head_dim)]


# ------------------------------------------------------------------------------------------------ auto
#: torch's SDPA backends -> the hfpatch kernel computing the same attention with the log-sum-exp.
_FROM_SDPA = {
    "CUDNN_ATTENTION": "cudnn",
    "FLASH_ATTENTION": "flash",
    "EFFICIENT_ATTENTION": "efficient_cuda",
    "MATH": "math",
}
#: Where SDPA's choice has no lse form here (or cannot take this head dim): the next ones, fastest first.
_FALLBACK = {"cuda": ("cudnn", "flash", "efficient_cuda", "math"), "cpu": ("flash_cpu", "math")}


def _sdpa_state() -> tuple:
    """The global switches SDPA's selector reads (a cache key: ``sdpa_kernel(...)`` changes them)."""
    cuda = torch.backends.cuda
    flags = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
    order = getattr(torch._C, "_get_sdp_priority_order", lambda: ())()
    return (*flags, cuda.math_sdp_enabled(), tuple(order))


def _probe_sdpa(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Ask torch's SDPA selector (``torch._fused_sdp_choice``, what ``F.scaled_dot_product_attention`` runs)."""
    # The layout a DiT hands SDPA (a [B, S, H, D] tensor transposed); requires_grad: a kernel that can also
    # run the block backward. 64 tokens: no selector rule depends on the length for dense, unmasked calls.
    q = torch.empty(1, 64, 1, head_dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    return torch.nn.attention.SDPBackend(torch._fused_sdp_choice(q, q, q)).name


@functools.lru_cache(maxsize=256)
def _cached_sdpa_choice(device: torch.device, dtype: torch.dtype, head_dim: int, state: tuple) -> str:
    return _probe_sdpa(device, dtype, head_dim)


def _sdpa_choice(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The name of the ``SDPBackend`` that ``F.scaled_dot_product_attention`` picks for such a call."""
    return _cached_sdpa_choice(device, dtype, head_dim, _sdpa_state())


def _auto(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str:
    """``"auto"``: the kernel SDPA would run for the unpatched model, else the fastest one that fits."""
    order = _FALLBACK.get(device.type, ("math",))
    if device.type == "cpu":
        preferred = "flash_cpu"  # SDPA's CPU selector: flash for every floating dtype
    elif device.type == "cuda" and head_dim is not None:
        preferred = _FROM_SDPA.get(_sdpa_choice(device, dtype, head_dim), order[0])
    else:
        preferred = order[0]
    for name in (preferred, *order):
        backend = _BACKENDS.get(name)
        if backend is not None and backend.fits(device, dtype, head_dim):
            return name
    return "math"


def resolve_backend(
    name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None
) -> AttentionBackend:
    """The backend called ``name`` (or the one ``"auto"`` picks) for ``device``/``dtype``/``head_dim``.

    Raises:
        ValueError: Unknown name, or a backend that cannot run on this device/dtype/head dim.
    """
    device = torch.device(device)
    if name == "auto":
        name = _auto(device, dtype, head_dim)
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; registered: auto, {', '.join(sorted(_BACKENDS))}"
        )
    backend = _BACKENDS[name]
    if not backend.supports(device, dtype):
        raise ValueError(
            f"attention backend {name!r} cannot run on {device.type} with {dtype}; available there: "
            f"{', '.join(available_backends(device, dtype, head_dim))} (or pass backend='auto')"
        )
    if head_dim is not None and not backend.head_dims(head_dim, dtype):
        raise ValueError(
            f"attention backend {name!r} cannot take head dim {head_dim} with {dtype}; available: "
            f"{', '.join(available_backends(device, dtype, head_dim))} (or pass backend='auto')"
        )
    return backend


# ------------------------------------------------------------------------------------------------ layouts
def _in_layout(x: Tensor, layout: str) -> bool:
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return False
    return layout == "strided" or x.transpose(1, 2).is_contiguous()


def to_layout(x_bhsd: Tensor, layout: str) -> Tensor:
    """``x_bhsd`` itself if its memory is in ``layout``, else a copy that is (same values, same shape).

    ``"bshd"``: ``[B, S, H, D]`` memory, the result a ``[B, H, S, D]`` view of it; ``"strided"``: any strides
    with a unit last stride (a broadcast or sliced last dim is copied).

    >>> x = torch.randn(2, 3, 4, 8)                      # [B, H, S, D] memory
    >>> y = to_layout(x, "bshd")
    >>> y.shape == x.shape, torch.equal(y, x), y.transpose(1, 2).is_contiguous()
    (True, True, True)
    >>> to_layout(y, "bshd") is y
    True
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if _in_layout(x_bhsd, layout):
        return x_bhsd
    if layout == "strided":
        return x_bhsd.contiguous()
    return x_bhsd.transpose(1, 2).contiguous().transpose(1, 2)


def _describe(t: object) -> str:
    if not isinstance(t, Tensor):
        return type(t).__name__
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, where: str) -> None:
    """Refuse, by name, inputs no kernel computes correctly (the layout is not checked: it is normalised)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{where}: {name} must be a floating [B, H, S, D] tensor, got {_describe(t)}")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError(
            f"{where}: q, k and v must share dtype and device, got {_describe(q)}, {_describe(k)}, {_describe(v)}"
        )
    b, h, _, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d) or v.shape != k.shape:
        raise ValueError(
            f"{where}: k and v must be [B={b}, H={h}, S_k, D={d}] like q (same batch, heads and head dim; "
            f"grouped-query heads are not expanded here), got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )


def _check_backward(dout: Tensor, q: Tensor, out: Tensor, lse: Tensor, where: str) -> None:
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, Tensor) or tuple(t.shape) != tuple(q.shape) or t.device != q.device:
            raise ValueError(f"{where}: {name} must be shaped like q {tuple(q.shape)}, got {_describe(t)}")
    if not isinstance(lse, Tensor) or tuple(lse.shape) != tuple(q.shape[:3]) or not lse.is_floating_point():
        raise ValueError(
            f"{where}: lse must be a floating [B, H, S_q] = {tuple(q.shape[:3])} tensor, got {_describe(lse)}"
        )


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Softmax attention of ``q_bhsd`` over ``k_bhsd``/``v_bhsd``, returning ``(out_bhsd, lse_bhs)``.

    Not differentiable by itself: the sequence-parallel autograd functions call
    :func:`local_attention_backward` per block. ``lse`` is in :func:`accum_dtype` (float32 for half inputs).
    No key (``S_k = 0``) gives zeros and ``lse = -inf`` (a block that contributes nothing to a merge).

    Raises:
        ValueError: Inputs that are not ``[B, H, S, D]`` tensors of one dtype and device with matching
            batch, heads and head dim; or a backend that cannot run them.
    """
    _check_qkv(q, k, v, "local_attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[1] == 0 or k.shape[2] == 0:  # an idle Ulysses rank, or no key in this block
        lse = torch.full(q.shape[:3], float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
        return torch.zeros_like(q), lse
    kernel = resolve_backend(backend, q.device, q.dtype, q.shape[-1])
    q, k, v = (to_layout(t, kernel.layout) for t in (q, k, v))
    return kernel.forward(q, k, v, scale)


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
    """Gradients ``(dq, dk, dv)`` of one key/value block, given the merged ``out``/``lse`` of all blocks.

    Any memory layout of the inputs is accepted (each is brought into the kernel's layout, copied only when
    it is not there); shapes are checked as in :func:`local_attention`, plus ``dout``/``out`` shaped like
    ``q`` and ``lse`` ``[B, H, S_q]``.
    """
    _check_qkv(q, k, v, "local_attention_backward")
    _check_backward(dout, q, out, lse, "local_attention_backward")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[1] == 0 or k.shape[2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kernel = resolve_backend(backend, q.device, q.dtype, q.shape[-1])
    if kernel.layout == "bshd":  # the fused kernels read dout and out in the inputs' dtype
        dout, out = dout.to(q.dtype), out.to(q.dtype)
    dout, q, k, v, out = (to_layout(t, kernel.layout) for t in (dout, q, k, v, out))
    return kernel.backward(dout, q, k, v, out, lse, scale)


# ------------------------------------------------------------------------------------------------ math
def _math_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    acc = accum_dtype(q.dtype)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), k.to(acc)) * scale
    lse = scores.logsumexp(dim=-1)
    probs = (scores - lse.unsqueeze(-1)).exp_()
    return torch.einsum("bhqk,bhkd->bhqd", probs, v.to(acc)).to(q.dtype), lse


def math_backward(dout, q, k, v, out, lse, scale, mask=None):
    """``(dq, dk, dv)`` from the merged ``out``/``lse``, in the accumulation dtype; ``mask`` (bool, True = attend)
    as in the forward (:mod:`hfpatch.attention.masked` passes its tiles' masks)."""
    acc = accum_dtype(q.dtype)
    qf, kf, vf, dof = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    scores = torch.einsum("bhqd,bhkd->bhqk", qf, kf).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = scores.sub_(lse.to(acc).unsqueeze(-1)).exp_()
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
        dout, q, k, v, out, lse.to(accum_dtype(q.dtype)).contiguous(), 0.0, False, scale=scale
    )


# ------------------------------------------------------------------------------------------------ CUDA (aten)
# Call signatures as verified on an H100 with torch 2.11 (reference scripts); inputs arrive in [B, S, H, D]
# memory (layout "bshd"): what the stock model's SDPA call hands these kernels. Dropout is 0 throughout, so
# the random-state tensors (philox seed/offset) are never read by the backward kernels: empty ones are
# passed. ``cum_seq_q``/``cum_seq_k`` must be *undefined* (None): a defined tensor selects the varlen path.
def _unused_rng_state(device: torch.device) -> Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


def _cudnn_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, False, False, scale=scale
    )[:2]
    return out, lse.reshape(q.shape[:3]).float()  # [B, H, S, 1] (torch >= 2.9) -> [B, H, S]


def _cudnn_backward(dout, q, k, v, out, lse, scale):
    stats = lse.float().reshape(*q.shape[:3], 1).contiguous()
    rng = _unused_rng_state(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, stats, rng, rng, None, None, None, q.shape[2], k.shape[2], 0.0, False, scale=scale
    )
    return dq, dk, dv


def _flash_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    return out, lse.float()


def _flash_backward(dout, q, k, v, out, lse, scale):
    rng = _unused_rng_state(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.float().contiguous(), None, None, q.shape[2], k.shape[2], 0.0, False, rng, rng,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _efficient_forward(q, k, v, scale):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)
    # The kernel rounds the lse length up to its 32-row tile; the extra entries are not results.
    return out, lse[..., : q.shape[2]].to(accum_dtype(q.dtype))


def _efficient_backward(dout, q, k, v, out, lse, scale):
    # The kernel reads ``out`` with a sequence stride of H * D ([B, S, H, D] memory), whatever its strides
    # say: a [B, H, S, D]-contiguous ``out`` gave garbage gradients (9e-2 to nan) on an H100. Layout "bshd"
    # (to_layout in local_attention_backward) is what makes this call exact.
    rng = _unused_rng_state(q.device)
    # The lse back in the forward's shape: its length rounded up to the kernel's 32-row alignment.
    lse = torch.nn.functional.pad(lse.float(), (0, -lse.shape[-1] % 32))
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, rng, rng, 0.0, [True, True, True, False], scale=scale
    )
    return dq, dk, dv


def _bshd(*tensors: Tensor) -> list[Tensor]:
    return [t.transpose(1, 2) for t in tensors]


# ------------------------------------------------------------------------------------------------ optional
def _flash3_forward(q, k, v, scale):
    import flash_attn_interface

    # [B, S, H, D] in and out; with return_attn_probs the public function also returns the lse [B, H, S].
    out, lse = flash_attn_interface.flash_attn_func(
        *_bshd(q, k, v), softmax_scale=scale, causal=False, return_attn_probs=True
    )[:2]
    return out.transpose(1, 2), lse.float()


def _flash3_backward(dout, q, k, v, out, lse, scale):
    import flash_attn_interface

    q_, k_, v_ = _bshd(q, k, v)
    dq, dk, dv = (torch.empty_like(t) for t in (q_, k_, v_))
    flash_attn_interface._flash_attn_backward(
        *_bshd(dout),
        q_,
        k_,
        v_,
        *_bshd(out),
        lse.float().contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        softmax_scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _xformers_forward(q, k, v, scale):
    from xformers.ops import fmha

    # xformers takes [B, S, H, D]: pass transposed views, return to SDPA's layout the same way.
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(*_bshd(q, k, v), scale=scale)
    return out.transpose(1, 2), lse[..., : q.shape[2]].to(accum_dtype(q.dtype))


def _xformers_backward(dout, q, k, v, out, lse, scale):
    from xformers.ops import fmha

    grads = fmha.memory_efficient_attention_backward(
        *_bshd(dout, out), lse.float().contiguous(), *_bshd(q, k, v), scale=scale
    )
    return tuple(g.transpose(1, 2) for g in grads)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda(dtypes: tuple[torch.dtype, ...]) -> Callable[[torch.device, torch.dtype], bool]:
    return lambda device, dtype: device.type == "cuda" and dtype in dtypes


def _cuda_installed(module: str) -> Callable[[torch.device, torch.dtype], bool]:
    return lambda device, dtype: device.type == "cuda" and dtype in HALF and _installed(module)


def _flash_head_dims(head_dim: int, dtype: torch.dtype) -> bool:
    return head_dim % 8 == 0 and head_dim <= 256


def _efficient_head_dims(head_dim: int, dtype: torch.dtype) -> bool:
    return head_dim % (8 if dtype in HALF else 4) == 0


register_backend(AttentionBackend("math", _math_forward, math_backward, lambda device, dtype: True))
register_backend(
    AttentionBackend(
        "flash_cpu",
        _flash_cpu_forward,
        _flash_cpu_backward,
        lambda device, dtype: device.type == "cpu" and dtype in (torch.float32, torch.float64, *HALF),
    )
)
register_backend(
    AttentionBackend("cudnn", _cudnn_forward, _cudnn_backward, _cuda(HALF), "bshd", _flash_head_dims)
)
register_backend(
    AttentionBackend("flash", _flash_forward, _flash_backward, _cuda(HALF), "bshd", _flash_head_dims)
)
register_backend(
    AttentionBackend(
        "efficient_cuda",
        _efficient_forward,
        _efficient_backward,
        _cuda((torch.float32, *HALF)),
        "bshd",
        _efficient_head_dims,
    )
)
register_backend(
    AttentionBackend(
        "flash3",
        _flash3_forward,
        _flash3_backward,
        _cuda_installed("flash_attn_interface"),
        "bshd",
        _flash_head_dims,
    )
)
register_backend(
    AttentionBackend("xformers", _xformers_forward, _xformers_backward, _cuda_installed("xformers"), "bshd")
)
