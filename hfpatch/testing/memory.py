"""Deterministic memory measurement on CPU: peak bytes of tensors *created* while tracking.

Tensors that exist before tracking starts (parameters, inputs) are not counted, so the figure is the
activation (and gradient/temporary) memory of the tracked code. :func:`count_copies` counts, the same way, the
bytes that copying ops write (a layout change, a concatenation, a dtype conversion), to compare data movement
with its analytic minimum. Storages are counted once however many
views share them and leave the count when they are freed. On CUDA use ``torch.cuda.max_memory_allocated``;
this tracker gives the same kind of figure on any device, deterministically.

>>> import torch
>>> from hfpatch.testing.memory import track_memory
>>> with track_memory() as mem:
...     x = torch.ones(1024)          # 4 KiB
...     y = x * 2                      # + 4 KiB
...     del x
...     z = y + 1                      # x was freed: still 8 KiB live
>>> mem.peak_bytes
8192
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["CopyCounter", "MemoryTracker", "count_copies", "measure_peak", "resident_peak", "track_memory"]


#: Tensor types that are no wrapper subclass (the hot path skips ``is_traceable_wrapper_subclass``).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _tensors(value: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Appends the tensors in an op's arguments or results to ``out``: tensors in (nested) lists, tuples and
    dicts, what ATen schemas hold. ``tree_flatten`` finds the same leaves, at several times the cost of the
    tiny ops of a test model (the tracker runs on every op)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, (torch.Tensor, list, tuple, dict)):
                _tensors(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, out)
    return out


def _plain_tensors(values: list[Any]) -> Iterator[torch.Tensor]:
    """The dense tensors among ``values``, a wrapper subclass (DTensor) replaced by its inner tensors."""
    for value in values:
        if not isinstance(value, torch.Tensor) or value.is_sparse:
            continue
        if type(value) not in _PLAIN and is_traceable_wrapper_subclass(value):
            yield from _plain_tensors([getattr(value, n) for n in value.__tensor_flatten__()[0]])
        else:
            yield value


def _data_ptrs(tensors: list[torch.Tensor]) -> set[int]:
    """The data pointers of ``tensors``' storages (of a wrapper subclass's inner tensors)."""
    ptrs = {t.untyped_storage().data_ptr() for t in tensors if type(t) in _PLAIN and not t.is_sparse}
    wrapped = [t for t in tensors if type(t) not in _PLAIN]
    return ptrs.union(t.untyped_storage().data_ptr() for t in _plain_tensors(wrapped)) if wrapped else ptrs


@dataclass
class MemoryTracker(TorchDispatchMode):
    """A dispatch mode that tracks live bytes of storages created under it (see module docstring).

    Attributes:
        live_bytes: Bytes of tracked storages alive now.
        peak_bytes: Highest ``live_bytes`` seen.
    """

    live_bytes: int = 0
    peak_bytes: int = 0
    #: ``id(storage)`` -> (a weak reference whose callback releases its bytes, the bytes) of each tracked storage
    #: alive (storages keep their Python object while they live: the id is theirs until they are freed).
    _seen: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        super().__init__()

    def _track(
        self, tensor: torch.Tensor, inputs: list[torch.Tensor], ptrs: set[int] | None
    ) -> set[int] | None:
        """Counts ``tensor``'s storage if new; returns the inputs' data pointers ``ptrs`` (computed once per op,
        when first needed). A wrapper subclass (a DTensor: FSDP2's parameters) counts its local tensors."""
        if type(tensor) not in _PLAIN and is_traceable_wrapper_subclass(tensor):
            for inner in _plain_tensors([getattr(tensor, n) for n in tensor.__tensor_flatten__()[0]]):
                ptrs = self._track(inner, inputs, ptrs)
            return ptrs
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._seen or storage.device.type == "meta":
            return ptrs
        # A view or in-place result of an untracked (pre-existing) tensor shares its storage: no new memory.
        if ptrs is None:
            ptrs = _data_ptrs(inputs)
        if storage.data_ptr() in ptrs:
            return ptrs
        nbytes = storage.nbytes()
        self._seen[key] = (weakref.ref(storage, lambda _, key=key: self._release(key)), nbytes)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return ptrs

    def _release(self, key: int) -> None:
        self.live_bytes -= self._seen.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = _tensors(out, [])
        if results:
            inputs = _tensors(kwargs, _tensors(args, [])) if kwargs else _tensors(args, [])
            ptrs = None
            for leaf in results:
                if not leaf.is_sparse:
                    ptrs = self._track(leaf, inputs, ptrs)
        return out

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current live bytes."""
        self.peak_bytes = self.live_bytes


@contextmanager
def track_memory() -> Iterator[MemoryTracker]:
    """Context manager yielding a :class:`MemoryTracker`; read ``peak_bytes`` after the block."""
    tracker = MemoryTracker()
    with tracker:
        yield tracker


def measure_peak(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn`` under a tracker; return ``(result, peak_bytes)``."""
    with track_memory() as tracker:
        result = fn(*args, **kwargs)
    return result, tracker.peak_bytes


#: aten ops that only move or convert data (their output, or the destination of ``copy_``, is what they write).
COPY_OPS = frozenset(
    {
        "aten::copy_",
        "aten::clone",
        "aten::cat",
        "aten::stack",
        "aten::_to_copy",
        "aten::index_select",
        "aten::index.Tensor",
        "aten::narrow_copy",
        "aten::repeat",
        "aten::constant_pad_nd",
        "aten::slice_scatter",
        "aten::select_scatter",
        "aten::as_strided_scatter",
        "aten::index_put_",
        "aten::masked_scatter",
        "aten::flip",
        "aten::roll",
        "aten::gather",
        "aten::_unsafe_index.Tensor",
        "aten::expand_copy",
        "aten::permute_copy",
        "aten::transpose_copy",
        "aten::view_copy",
    }
)


@dataclass
class CopyCounter(TorchDispatchMode):
    """A dispatch mode that adds up the bytes written by copying ops (:data:`COPY_OPS`).

    Attributes:
        bytes_copied: Total bytes written by copying ops.
        by_op: The same, per op name (``"aten::copy_"``, ``"aten::cat"``, ...).
    """

    bytes_copied: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name + ("" if func._overloadname == "default" else f".{func._overloadname}")
        if name in COPY_OPS or func._schema.name in COPY_OPS:
            written = args[0] if func._schema.name.endswith("_") else out  # in place: its destination
            nbytes = sum(
                t.numel() * t.element_size() for t in tree_flatten(written)[0] if isinstance(t, torch.Tensor)
            )
            key = func._schema.name
            self.by_op[key] = self.by_op.get(key, 0) + nbytes
            self.bytes_copied += nbytes
        return out


@contextmanager
def count_copies() -> Iterator[CopyCounter]:
    """Count the bytes copying ops write inside the block (:class:`CopyCounter`).

    >>> import torch
    >>> x = torch.randn(4, 8)                      # 128 bytes
    >>> with count_copies() as copies:
    ...     y = x.t().contiguous()                 # a layout change: 128 bytes written
    ...     z = x.view(8, 4)                       # a view: nothing
    >>> copies.bytes_copied, copies.by_op
    (128, {'aten::clone': 128})
    """
    counter = CopyCounter()
    with counter:
        yield counter


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def resident_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the process's peak resident set while it ran, in bytes above the resident set it started
    from: the measure ``top`` and container limits see (mapped files and the allocator's cache included), where
    :class:`MemoryTracker` counts live tensor bytes. Freed memory is given back to the system first
    (``malloc_trim``), then the kernel's high-water mark is reset (``5`` written to ``/proc/self/clear_refs``).
    Linux only (raises ``OSError`` elsewhere).

    >>> import sys, torch
    >>> from hfpatch.testing.memory import resident_peak
    >>> if sys.platform == "linux":
    ...     _, peak = resident_peak(lambda: torch.ones(64 << 20, dtype=torch.uint8).sum())
    ...     assert peak >= 64 << 20
    """
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = fn()
    return out, _status_bytes("VmHWM") - base
