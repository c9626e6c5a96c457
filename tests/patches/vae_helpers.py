"""Helpers shared by the split-VAE tests (``test_kl_vae.py``, ``test_wan_vae.py``): run, reference, gradients.

Tolerances come from ``hfpatch.testing.tolerance``: every reference carries the unpatched fp32 VAE's own
rounding noise against an fp64 twin (same weights, same inputs), and a patched result passes when it is
within ``reassociation_tol(noise)`` of the reference.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

import hfpatch
from hfpatch import all_reduce_gradients
from hfpatch.testing.tolerance import rel_error, rounding_noise, to_fp64

_FP64_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run(vae, kind: str, x: torch.Tensor) -> torch.Tensor:
    """The decoded sample, or the encoded latent mean (``AutoencoderDC``: its deterministic latent)."""
    if kind == "decode":
        return vae.decode(x).sample
    encoded = vae.encode(x)
    return encoded.latent_dist.mean if hasattr(encoded, "latent_dist") else encoded.latent


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
        all_reduce_gradients(vae)  # the documented reduction: MEAN over the VAE ranks
        patch.remove()
    grads = (leaf.grad, param_grads(vae))
    vae.zero_grad(set_to_none=True)
    return grads


def fp64_twin(vae: torch.nn.Module) -> torch.nn.Module:
    """An fp64 copy of ``vae`` (made once per VAE object): its fp32 rounding scale."""
    if vae not in _FP64_TWINS:
        _FP64_TWINS[vae] = to_fp64(vae)
    return _FP64_TWINS[vae]


def unpatched_reference(vae, kind: str, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(unpatched fp32 output, its relative fp32 rounding noise vs fp64), computed on rank 0, sent to all."""

    def compute() -> tuple[torch.Tensor, float]:
        with torch.no_grad():
            out = run(vae, kind, x)
            return out, rounding_noise(out, run(fp64_twin(vae), kind, to_fp64(x)))

    return from_rank0(compute)


def gradient_error(vae, kind: str, x: torch.Tensor) -> tuple[float, float, int]:
    """(worst relative gradient error of the split VAE, unpatched fp32 gradient noise, parameters with grads).

    Input and parameter gradients after the documented SUM over the VAE ranks, against the unpatched ones.
    Each tensor's error is relative to its fp64 gradient's largest entry, at least 1% of the largest of all
    (a parameter whose true gradient is ~0, such as an attention key bias, holds only rounding noise).
    """
    (gx_ref, gp_ref), (gx64, gp64) = from_rank0(
        lambda: (
            backward(vae, kind, x, patched=False),
            backward(fp64_twin(vae), kind, to_fp64(x), patched=False),
        )
    )
    gx, gp = backward(vae, kind, x, patched=True)
    ref, ref64, got = {"input": gx_ref, **gp_ref}, {"input": gx64, **gp64}, {"input": gx, **gp}
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    floor = 0.01 * max(g.abs().max().item() for g in ref64.values())
    scales = {n: max(g.abs().max().item(), floor) for n, g in ref64.items()}
    error = max(rel_error(got[n], ref[n], scales[n]) for n in ref)
    noise = max(rel_error(ref[n], ref64[n], scales[n]) for n in ref)
    return error, noise, len(gp)
