"""Helpers shared by the GradCache tests (``test_gradcache.py``, ``test_gradcache_qwen2_vl.py``): the rounding
noise of a full-batch reference step, measured on fp64 copies of the models and inputs.

Tolerances come from ``hfpatch.testing.tolerance``: chunking only regroups matmuls and the per-chunk
gradient sums (reassociation), so a GradCache step passes when it is within ``reassociation_tol(noise)`` of
the fp32 full-batch step, ``noise`` being that step's own relative error against the same step in fp64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


@contextlib.contextmanager
def fp64_float():
    """``Tensor.float()`` leaves fp64 tensors fp64 while active: ``info_nce`` casts its inputs with
    ``.float()``, which would round an fp64 reference's embeddings to fp32."""
    original = torch.Tensor.float

    def keep_fp64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = keep_fp64
    try:
        yield
    finally:
        torch.Tensor.float = original


def fp64_loss(loss_fn: Callable) -> Callable:
    """``loss_fn`` evaluated in fp64 on fp64 embeddings (under :func:`fp64_float`; its backward needs none)."""

    def loss64(*reps, **kwargs):
        with fp64_float():
            return loss_fn(*reps, **kwargs)

    return loss64


def grad_noise(ref: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> float:
    """The fp32 gradients' largest error against the fp64 ones, relative to the largest fp64 gradient (the
    scale GradCache's gradients are compared at)."""
    assert ref.keys() == exact.keys(), sorted(set(ref) ^ set(exact))
    diff = max((ref[n].double() - exact[n]).abs().max().item() for n in ref)
    return diff / max(g.abs().max().item() for g in exact.values())
