"""``torch.compile`` for hfpatch's hot paths: one compiled graph per kind of call, never a recompilation.

Dynamo caches compiled frames per *code object* and re-checks guards (shapes, dtypes, grad mode, which
optional tensors are ``None``) on every call; a call that fails every guard of a code object compiles it
again (a recompilation, counted in ``torch._dynamo.utils.counters`` and refused under
``torch._dynamo.config.error_on_recompile``). hfpatch's compiled paths know in advance which kinds of call
they make (the streaming transformer's warm-up blocks, whose cache is not full yet, and its steady blocks;
GradCache's chunks with and without a graph): :func:`compiled_variant` gives each kind its own copy of the
function with its own code object, so each compiles exactly once and none ever recompiles.

:func:`compile_function` is ``torch.compile`` with hfpatch's defaults (``fullgraph=True``: a graph break is an
error, not a silent slow path; ``dynamic=False``: static shapes) and the CUDA-graph option
(``mode="reduce-overhead"``, CUDA only: :func:`check_cuda_graphs`).

>>> import torch
>>> from hfpatch.core.compile import compiled_variant
>>> def double(x):
...     return 2 * x
>>> a, b = compiled_variant(double, "a", backend="eager"), compiled_variant(double, "b", backend="eager")
>>> a(torch.ones(2)).tolist(), b(torch.ones(3)).tolist()   # one compilation each, no recompilation
([2.0, 2.0], [2.0, 2.0, 2.0])
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["check_compile_backend", "check_cuda_graphs", "compile_function", "compiled_variant", "fresh_copy"]


def check_compile_backend(backend: Any, cuda_graphs: bool, where: str) -> None:
    """Raise ``ValueError`` for a backend ``torch.compile`` does not know, or CUDA graphs off inductor."""
    if callable(backend):
        if cuda_graphs:
            raise ValueError(
                f"{where}: cuda_graphs=True needs compile_backend='inductor', got a callable backend"
            )
        return
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"{where}: compile_backend must be a torch.compile backend name, got {backend!r}")
    from torch._dynamo import list_backends

    known = set(list_backends(exclude_tags=())) | {"inductor", "eager", "aot_eager"}
    if backend not in known:
        raise ValueError(f"{where}: unknown compile_backend {backend!r}; torch.compile knows {sorted(known)}")
    if cuda_graphs and backend != "inductor":
        raise ValueError(
            f"{where}: cuda_graphs=True captures inductor's compiled graphs (mode='reduce-overhead'); "
            f"got compile_backend={backend!r}: use 'inductor'"
        )


def check_cuda_graphs(device: torch.device, where: str) -> None:
    """Raise ``ValueError`` unless ``device`` is a CUDA device (CUDA graphs exist only there)."""
    if device.type != "cuda":
        raise ValueError(
            f"{where}: cuda_graphs=True captures CUDA graphs, but the model runs on {device.type}; move it to a "
            "CUDA device, or set cuda_graphs=False (compile=True alone works on every device)"
        )


def fresh_copy(fn: types.FunctionType, tag: str) -> types.FunctionType:
    """``fn`` with its own code object (same code, globals, defaults and closure), named ``tag`` for logs.

    Dynamo keys its cache by code object: two copies never share compiled frames or guards.
    """
    code = fn.__code__.replace(
        co_name=f"{fn.__code__.co_name}[{tag}]", co_qualname=f"{fn.__qualname__}[{tag}]"
    )
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def compile_function(
    fn: Callable[..., Any],
    *,
    backend: Any = "inductor",
    cuda_graphs: bool = False,
    fullgraph: bool = True,
    dynamic: bool | None = False,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """``torch.compile(fn)`` with hfpatch's defaults; ``cuda_graphs`` selects ``mode="reduce-overhead"``;
    ``options`` are inductor settings (ignored by other backends)."""
    mode = "reduce-overhead" if cuda_graphs else None
    if backend != "inductor":
        options = None
    return torch.compile(
        fn, backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic, options=options
    )


def compiled_variant(fn: types.FunctionType, tag: str, **options: Any) -> Callable[..., Any]:
    """:func:`compile_function` of :func:`fresh_copy` ``(fn, tag)``: one code object, hence one compilation, per tag."""
    return compile_function(fresh_copy(fn, tag), **options)
