"""Deterministic memory measurement on CPU: peak bytes of tensors *created* while tracking.

Tensors that exist before tracking starts (parameters, inputs) are not counted, so the figure is the
activation (and gradient/temporary) memory of the tracked code. Storages are counted once however many
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

__all__ = ["MemoryTracker", "measure_peak", "track_memory"]


def _plain_tensors(values: list[Any]) -> Iterator[torch.Tensor]:
    """The dense tensors among ``values``, a wrapper subclass (DTensor) replaced by its inner tensors."""
    for value in values:
        if not isinstance(value, torch.Tensor) or value.is_sparse:
            continue
        if is_traceable_wrapper_subclass(value):
            yield from _plain_tensors([getattr(value, n) for n in value.__tensor_flatten__()[0]])
        else:
            yield value


@dataclass
class MemoryTracker(TorchDispatchMode):
    """A dispatch mode that tracks live bytes of storages created under it (see module docstring).

    Attributes:
        live_bytes: Bytes of tracked storages alive now.
        peak_bytes: Highest ``live_bytes`` seen.
    """

    live_bytes: int = 0
    peak_bytes: int = 0
    _seen: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False)

    def __post_init__(self) -> None:
        super().__init__()

    def _track(self, tensor: torch.Tensor, input_ptrs: set[int]) -> None:
        if is_traceable_wrapper_subclass(tensor):  # a DTensor (FSDP2's parameters): its local tensors
            for inner in _plain_tensors([getattr(tensor, n) for n in tensor.__tensor_flatten__()[0]]):
                self._track(inner, input_ptrs)
            return
        storage = tensor.untyped_storage()
        # A view or in-place result of an untracked (pre-existing) tensor shares its storage: no new memory.
        if storage in self._seen or storage.device.type == "meta" or storage.data_ptr() in input_ptrs:
            return
        nbytes = storage.nbytes()
        self._seen[storage] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        input_ptrs = {t.untyped_storage().data_ptr() for t in _plain_tensors(tree_flatten((args, kwargs))[0])}
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and not leaf.is_sparse:
                self._track(leaf, input_ptrs)
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
