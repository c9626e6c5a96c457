"""GradCache's ``compile=True``: the encoders' forwards through ``torch.compile``, one compiled copy per kind of
chunk call (:class:`CompiledForwards`), installed for one chunk call at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .chunks import chunk_tensors

__all__ = ["CompiledForwards"]


class CompiledForwards:
    """The encoders' ``forward`` through ``torch.compile``, one compiled copy per kind of chunk call.

    A kind is (the module, its forward, autograd on or off, autocast state, the chunk's tensor shapes and
    dtypes): pass 1 runs without a graph, pass 2 (and the kept chunk) with one, and a smaller last chunk has
    shapes of its own. Each kind gets its own code object (:func:`~hfpatch.core.compile.compiled_variant`), so
    each compiles once, with static shapes, and no graph is ever recompiled: a batch of equal chunks costs
    two compilations (with and without a graph), a smaller last chunk two more. Nothing is padded, so every
    chunk computes what the eager forward computes. The compiled forward is installed on the innermost module
    (inside DDP/FSDP/accelerate wrappers, whose own forward runs as usual) for the duration of each chunk call
    only. Random ops keep torch's generator (inductor's ``fallback_random``), so dropout masks replay exactly
    in pass 2 and equal the eager ones.
    """

    #: Kinds kept compiled at once; beyond that the least recently used is dropped (recompiled if it returns).
    MAX_KINDS = 8

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.variants: dict[tuple, Callable[..., Any]] = {}
        self.warned = False

    def _kind(self, inner: nn.Module, forward: Any, chunk: Any) -> tuple:
        device_type = next((t.device.type for t in chunk_tensors(chunk)), "cpu")
        autocast = torch.is_autocast_enabled(device_type)
        return (
            id(inner),
            getattr(forward, "__func__", forward),
            torch.is_grad_enabled(),
            autocast,
            torch.get_autocast_dtype(device_type) if autocast else None,
            tuple((tuple(t.shape), t.dtype, t.device) for t in chunk_tensors(chunk)),
        )

    def _variant(self, kind: tuple, forward: Callable[..., Any]) -> Callable[..., Any]:
        from ...core.compile import compiled_variant

        variant = self.variants.pop(kind, None)
        if variant is None:
            if len(self.variants) >= self.MAX_KINDS:
                self.variants.pop(next(iter(self.variants)))
                if not self.warned:
                    self.warned = True
                    import warnings

                    warnings.warn(
                        f"GradCache(compile=True) met more than {self.MAX_KINDS} kinds of chunk (shapes, grad mode, "
                        "autocast); every new kind compiles again. Pad the inputs to a fixed length (e.g. a "
                        "tokenizer's padding='max_length') so chunks share their shapes.",
                        stacklevel=4,
                    )

            def chunk_forward(*args: Any, **kwargs: Any) -> Any:
                return forward(*args, **kwargs)

            tag = f"GradCache chunk {'with' if kind[2] else 'without'} graph #{len(self.variants)}"
            variant = compiled_variant(
                chunk_forward, tag, backend=self.backend, fullgraph=False, options={"fallback_random": True}
            )
        self.variants[kind] = variant  # most recently used last
        return variant

    @contextlib.contextmanager
    def installed(self, model: nn.Module, chunk: Any) -> Iterator[None]:
        """The innermost module's ``forward`` is the compiled one of this chunk's kind inside the block."""
        from ...core.wrappers import unwrap_model

        inner = unwrap_model(model)
        previous = inner.__dict__.get("forward")  # an instance-level forward (accelerate's wrappers) or None
        forward = inner.forward
        inner.forward = self._variant(self._kind(inner, forward, chunk), forward)
        try:
            yield
        finally:
            if previous is None:
                del inner.forward
            else:
                inner.forward = previous
