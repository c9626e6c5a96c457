"""See through the wrappers training scripts put around a model (DDP, FSDP, accelerate, ``torch.compile``).

``accelerator.prepare(model)`` returns a ``DistributedDataParallel``, ``torch.compile(model)`` an
``OptimizedModule``; both hold the patched module (``.module`` / ``._orig_mod``), which is where hfpatch keeps
its patch. :func:`unwrap_model` peels every layer, in any order (DDP around a compiled model and the reverse).

>>> import torch
>>> from hfpatch.core.wrappers import unwrap_model
>>> layer = torch.nn.Linear(2, 2)
>>> unwrap_model(torch.compile(layer, backend="eager")) is layer
True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["unwrap_model", "unwrap_once"]


def unwrap_once(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module one wrapper layer holds, or ``None`` if ``module`` is not a known wrapper."""
    compiled = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule (a submodule)
    if isinstance(compiled, torch.nn.Module):
        return compiled
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    wrappers: tuple[type, ...] = (DistributedDataParallel, DataParallel)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    except ImportError:  # torch built without distributed
        pass
    if isinstance(module, wrappers):
        return module.module
    return None


def unwrap_model(obj: Any) -> Any:
    """``obj`` without its DDP/FSDP/DataParallel/``torch.compile`` wrappers (anything else unchanged)."""
    while isinstance(obj, torch.nn.Module):
        inner = unwrap_once(obj)
        if inner is None:
            return obj
        obj = inner
    return obj
