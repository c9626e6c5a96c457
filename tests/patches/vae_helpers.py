"""Helpers shared by the split-VAE tests (``test_kl_vae.py``, ``test_wan_vae.py``): run, reference, gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist

import hfpatch
from hfpatch import all_reduce_gradients


def run(vae, kind: str, x: torch.Tensor) -> torch.Tensor:
    return vae.decode(x).sample if kind == "decode" else vae.encode(x).latent_dist.mean


def from_rank0(fn, *args, **kwargs):
    """``fn()`` computed on rank 0 only (unpatched references need no collective) and sent to every rank."""
    box = [fn(*args, **kwargs) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def param_grads(vae) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in vae.named_parameters() if p.grad is not None}


def backward(vae, kind: str, x: torch.Tensor, patched: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Input and parameter gradients of a fixed random projection of the output (same loss on every rank)."""
    vae.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_(True)
    patch = hfpatch.apply(vae) if patched else None
    out = run(vae, kind, leaf)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
    if patch is not None:
        all_reduce_gradients(vae)  # the documented reduction: SUM over the VAE ranks
        patch.remove()
    grads = (leaf.grad, param_grads(vae))
    vae.zero_grad(set_to_none=True)
    return grads
