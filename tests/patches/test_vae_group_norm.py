"""The split VAE's GroupNorm for bf16/fp16 inputs: fp32 arithmetic, but autograd keeps only the input.

Plain autograd on ``var_mean(x.float())`` and ``x.float() * scale + shift`` would keep two fp32 copies of
every GroupNorm input (4x the bf16 input's bytes), which cancelled the split's memory saving in bf16
(patched/unpatched KL VAE training peak 1.01 before the fix). ``_UpcastVarMean``/``_UpcastScaleShift`` save
the input in its own dtype and have hand-written backwards, checked here against autograd. The world-2 test
uses large per-group means (1000 with std 8, -30 with std 1): normalising with a bf16-rounded shift
``-mean / std`` loses the result to cancellation there (about 80 spacings of bf16 or fp16 off at world 2); fp32
arithmetic keeps it to one rounding. The bf16 weight's gradient is two terms that cancel there too (33-48
spacings off when each was rounded to bf16 before summing): they are summed in fp32, then rounded once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hfpatch.patches.vae.layers import group_norm_forward
from hfpatch.patches.vae.norms import _UpcastScaleShift, _UpcastVarMean
from hfpatch.patches.vae.state import VAEShardState, gather_rows, scatter_rows
from hfpatch.testing.tolerance import eps, summation_tol


def _randn(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def test_upcast_functions_fp64_gradcheck_passes():
    # fp64 inputs stay fp64 (the compute dtype is promote(x.dtype, fp32)), so finite differences apply.
    x = _randn(2, 3, 7).requires_grad_(True)
    assert torch.autograd.gradcheck(_UpcastVarMean.apply, (x,))
    x = _randn(2, 3, 4, 5, seed=1).requires_grad_(True)
    scale = _randn(2, 3, 1, 1, seed=2).requires_grad_(True)
    shift = _randn(2, 3, 1, 1, seed=3).requires_grad_(True)
    assert torch.autograd.gradcheck(_UpcastScaleShift.apply, (x, scale, shift))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_functions_low_precision_match_autograd_and_save_only_input(dtype):
    """Same outputs and gradients as autograd on the upcast formulas; saved tensors: ``x`` (own dtype) + stats."""
    x = (_randn(2, 4, 6, 5) * 3 + 5).to(dtype)
    scale = _randn(2, 4, 1, 1, seed=1).float()
    shift = _randn(2, 4, 1, 1, seed=2).float()
    grad_out = _randn(2, 4, 6, 5, seed=3).to(dtype)
    grad_var, grad_mean = _randn(2, 4, seed=4).float(), _randn(2, 4, seed=5).float()

    def run(var_mean, scale_shift) -> tuple[list[torch.Tensor], dict[int, int], int]:
        """Outputs and gradients, the distinct storages autograd saved (pointer -> bytes), ``x``'s pointer."""
        leaves = [t.clone().requires_grad_(True) for t in (x, scale, shift)]
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            var, mean = var_mean(leaves[0].reshape(2, 4, -1))
            y = scale_shift(*leaves)
        torch.autograd.backward([y, var, mean], [grad_out, grad_var, grad_mean])
        return [y, var, mean, *(leaf.grad for leaf in leaves)], saved, leaves[0].untyped_storage().data_ptr()

    new, saved, x_ptr = run(_UpcastVarMean.apply, _UpcastScaleShift.apply)
    ref, ref_saved, _ = run(
        lambda g: torch.var_mean(g.float(), dim=-1, correction=0),
        lambda x, scale, shift: torch.addcmul(shift, x.float(), scale).to(x.dtype),
    )
    for name, a, b in zip(("y", "var", "mean", "grad_x", "grad_scale", "grad_shift"), new, ref):
        assert a.dtype == b.dtype, name
        # Forwards are the same ops. Backwards are the same fp32 products summed in another order: grad_x's
        # one rounding to ``dtype`` may land on the other side (one spacing of ``dtype`` of its largest
        # entry); grad_scale/grad_shift sum 6 x 5 per-position fp32 terms per (sample, channel), bounded
        # by the summation bound times the sum of the terms' magnitudes.
        if name in ("y", "var", "mean"):
            tol = 0.0
        elif name == "grad_x":
            tol = eps(dtype) * b.abs().max().item()
        else:
            terms = (grad_out.float() * (x.float() if name == "grad_scale" else 1.0)).abs()
            tol = summation_tol(6 * 5) * terms.sum(dim=(-2, -1)).max().item()
        assert (a.float() - b.float()).abs().max().item() <= tol, (name, a, b)
    # Saved for backward: x itself (no copy) and per-group statistics; autograd's formulas keep two fp32
    # copies of x (4x its bf16/fp16 bytes).
    x_bytes = x.numel() * x.element_size()
    assert saved[x_ptr] == x_bytes and sum(saved.values()) - x_bytes < x_bytes / 4, saved
    assert sum(ref_saved.values()) >= 4 * x_bytes, ref_saved


def _split_group_norm(dtype: torch.dtype, latent_rows: list[int]) -> dict[str, float]:
    """GroupNorm over rows split as ``latent_rows`` vs the fp32 unsplit norm of the same low-precision input."""
    world, rank = dist.get_world_size(), dist.get_rank()
    norm = torch.nn.GroupNorm(2, 4, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(_randn(4, seed=1) * 0.5 + 1)
        norm.bias.copy_(_randn(4, seed=2))
    norm.to(dtype)
    rows = sum(latent_rows)
    # Group 0: mean 1000, std 8; group 1: mean -30, std 1 (|mean| >> std in both).
    stds, means = torch.tensor([8.0, 8.0, 1.0, 1.0]), torch.tensor([1000.0, 1000.0, -30.0, -30.0])
    x = _randn(2, 4, rows, 3).float() * stds.view(1, 4, 1, 1) + means.view(1, 4, 1, 1)
    x = x.to(dtype).requires_grad_(True)
    weight = _randn(2, 4, rows, 3, seed=3).float()

    ref_norm = torch.nn.GroupNorm(2, 4, eps=1e-6)
    ref_norm.load_state_dict({k: v.float() for k, v in norm.state_dict().items()})
    ref_x = x.detach().float().requires_grad_(True)
    reference = ref_norm(ref_x)
    (reference * weight).sum().backward()

    state = VAEShardState(group=dist.group.WORLD, world=world, rank=rank, approx=False, output="full")
    state.mode, state.latent_rows = "shard", latent_rows
    out = gather_rows(group_norm_forward(norm, state)(scatter_rows(x, latent_rows, state)), state)
    (out.float() * weight).sum().backward()
    # Per-rank partial gradients (x: own rows only), N-scaled by the gather (exact: N = 2), averaged in fp32
    # (exact for x: the others are zeros).
    grads = [x.grad.float(), norm.weight.grad.float(), norm.bias.grad.float()]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= world
    references = [ref_x.grad, ref_norm.weight.grad, ref_norm.bias.grad]
    spacing = torch.finfo(dtype).eps
    result = {"dtype_kept": float(out.dtype == dtype)}
    # Output: in spacings of its own magnitude (of 1 below 1); gradients: of their largest entry.
    result["out"] = ((out.float() - reference).abs() / reference.abs().clamp_min(1)).max().item() / spacing
    for name, grad, ref in zip(("grad_x", "grad_weight", "grad_bias"), grads, references):
        result[name] = (grad - ref).abs().max().item() / ref.abs().max().item() / spacing
    return result


def _split_group_norm_cases() -> list[dict[str, float]]:
    return [_split_group_norm(dtype, [3, 2]) for dtype in (torch.bfloat16, torch.float16)]


def test_split_group_norm_low_precision_large_mean_within_one_rounding(rank_pool):
    for rank_results in rank_pool(2).run(_split_group_norm_cases):
        for res in rank_results:
            assert res["dtype_kept"] == 1.0, res
            assert res["out"] <= 1.0, res  # one rounding to bf16/fp16 of the fp32 result
            # Input grads: fp32 formulas rounded once to the input dtype, relative to the largest entry.
            assert res["grad_x"] <= 1.0, res
            # Parameter grads are fp32 sums rounded once to the parameter dtype (per-rank, then summed: 2).
            assert res["grad_weight"] <= 2.0 and res["grad_bias"] <= 2.0, res
