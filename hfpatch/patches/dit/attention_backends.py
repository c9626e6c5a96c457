"""Which kernels the sequence-parallel attention runs for a diffusers attention backend the user chose.

diffusers picks a model's attention kernel per processor (``model.set_attention_backend("_native_cudnn")``)
or for a block of code (``with attention_backend("_native_flash"): ...``). hfpatch honours that choice:

- With a ring degree of 1 (Ulysses alone, or one rank) each rank holds the whole sequence of its heads, no
  log-sum-exp is needed, and the attention is diffusers' own ``dispatch_attention_fn`` with the same
  ``backend`` argument the stock processor passes: any backend runs exactly as in the unpatched model.
- Ring needs a kernel that returns the log-sum-exp: the backends that have such a form map to hfpatch's
  local kernels (:data:`LSE_KERNELS`); any other is refused by name at the call, the same on every rank,
  before any collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LSE_KERNELS", "attention_kernels"]

#: diffusers ``AttentionBackendName`` value -> the hfpatch local kernel computing it with the lse.
LSE_KERNELS = {
    "native": "auto",  # F.scaled_dot_product_attention: "auto" follows SDPA's own choice
    "_native_cudnn": "cudnn",
    "_native_flash": "flash",
    "_native_efficient": "efficient_cuda",
    "_native_math": "math",
    "_flash_3": "flash3",
    "_flash_3_hub": "flash3",
    "xformers": "xformers",
}


def _name(backend: Any) -> str:
    """The value of a diffusers backend (an ``AttentionBackendName`` or its string); ``None``: the active one."""
    if backend is None:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        backend = _AttentionBackendRegistry.get_active_backend()[0]
    return str(getattr(backend, "value", backend))


def attention_kernels(
    backend: Any, stock_dispatch: Callable[..., Any], ring_degree: int, where: str
) -> tuple[str, Callable[..., Any]]:
    """``(Ring's local kernel, the ring-degree-1 attention)`` for a processor's diffusers ``backend``.

    Args:
        backend: What the stock processor passes to ``dispatch_attention_fn`` (its ``_attention_backend``;
            ``None``: diffusers' active backend, e.g. set by ``attention_backend(...)``).
        stock_dispatch: diffusers' own ``dispatch_attention_fn``.
        ring_degree: The ring degree of this model's sequence split.
        where: Module path, for messages.

    Raises:
        ValueError: A ring degree above 1 with a backend that has no log-sum-exp form here.

    >>> import torch
    >>> from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn
    >>> with attention_backend("_native_math"):
    ...     kernel, dense = attention_kernels(None, dispatch_attention_fn, 2, "blocks.0.attn1")
    >>> kernel
    'math'
    >>> attention_kernels("sage", dispatch_attention_fn, 2, "blocks.0.attn1")
    Traceback (most recent call last):
    ...
    ValueError: blocks.0.attn1: diffusers attention backend 'sage' has no form that returns the log-sum-exp, ...
    """
    name = _name(backend)

    def dense(q, k, v, key_mask, scale):
        return stock_dispatch(q, k, v, attn_mask=key_mask, scale=scale, backend=backend)

    kernel = LSE_KERNELS.get(name)
    if kernel is None and ring_degree > 1:
        raise ValueError(
            f"{where}: diffusers attention backend {name!r} has no form that returns the log-sum-exp, which Ring "
            f"attention (ring degree {ring_degree}) needs to merge its blocks; use one of "
            f"{', '.join(sorted(LSE_KERNELS))} (model.set_attention_backend(...) or attention_backend(...)), or "
            "ParallelConfig(ulysses=N, ring=1), where any backend runs as in the unpatched model"
        )
    return kernel or "auto", dense
