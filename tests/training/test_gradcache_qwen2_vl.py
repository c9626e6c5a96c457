"""GradCache on stock Qwen2-VL and Qwen2.5-VL: parameter gradients vs the full-batch loss, pixel-split errors,
frozen-tower reuse.

These models differ from Qwen3-VL in what the splitter must get right: a video is one block of placeholder
tokens (no per-frame timestamps), Qwen2.5-VL's tower attends within windows and takes one
``second_per_grid_ts`` value per video (the temporal M-RoPE step), and both need ``mm_token_type_ids`` to
build M-RoPE positions (Qwen2.5-VL silently falls back to 1D positions without it). Reference = one
forward/backward of the whole batch through the stock model. Chunking only regroups matmuls and the
per-chunk gradient sums (reassociation), so losses and gradients are compared within ``reassociation_tol``
of the reference step's own fp32-vs-fp64 noise, as in ``test_gradcache.py`` (``gradcache_helpers``);
gradients relative to the largest reference gradient of all parameters.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from gradcache_helpers import fp64_loss, grad_noise

from hfpatch.testing import qwen2_vl_inputs, tiny_qwen2_5_vl, tiny_qwen2_vl
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64
from hfpatch.training import GradCache
from hfpatch.training.pooling import default_rep
from hfpatch.training.trainer import info_nce

# Batch of 6: images of different sizes, a sample with two images, one with none, a sample with a video and
# one with an image and a video (two videos, so second_per_grid_ts is cut per video, not per sample).
MEDIA = [
    [("image", (1, 4, 4))],
    [("image", (1, 2, 4)), ("image", (1, 2, 2))],
    [],
    [("video", (2, 2, 2))],
    [("image", (1, 4, 2)), ("video", (2, 2, 4))],
    [("image", (1, 2, 6))],
]
FACTORIES = {"qwen2_vl": tiny_qwen2_vl, "qwen2_5_vl": tiny_qwen2_5_vl}
# Seconds per temporal patch of each video (Qwen2.5-VL only): different values, so a video given another
# video's value moves its temporal positions and changes the gradients.
SECONDS = {"qwen2_vl": None, "qwen2_5_vl": [0.5, 2.0]}


def _inputs(kind: str) -> tuple[dict, dict]:
    queries = qwen2_vl_inputs([[]] * len(MEDIA), text_len=5, seed=2, padding="right")
    return queries, qwen2_vl_inputs(MEDIA, seed=1, second_per_grid_ts=SECONDS[kind])


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameter gradients (then cleared, so the next step starts from none)."""
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_match(model: torch.nn.Module, ref: dict[str, torch.Tensor], noise: float) -> None:
    got = _grads(model)
    assert set(got) == set(ref), f"different parameters got gradients: {set(got) ^ set(ref)}"
    diff = max((got[n] - ref[n]).abs().max().item() for n in ref)
    scale = max(g.abs().max().item() for g in ref.values())
    tol = reassociation_tol(noise)
    print(f"max |grad diff| / max |grad| = {diff / scale:.3e}, tolerance {tol:.3e}")
    assert diff <= tol * scale, f"max |grad diff| {diff:.3e} > {tol:.3e} * {scale:.3e}"


def _full_batch(
    model: torch.nn.Module, inputs: tuple[dict, ...], loss_fn=info_nce
) -> tuple[torch.Tensor, dict]:
    loss = loss_fn(*[default_rep(model(**x), x) for x in inputs])
    loss.backward()
    return loss.detach(), _grads(model)


def _noise(
    model: torch.nn.Module, inputs: tuple[dict, ...], ref_loss: torch.Tensor, ref: dict
) -> tuple[float, float]:
    """(loss noise, gradient noise) of the fp32 full-batch step: against the same step of an fp64 copy."""
    exact_loss, exact = _full_batch(to_fp64(model), to_fp64(inputs), fp64_loss(info_nce))
    return rounding_noise(ref_loss, exact_loss), grad_noise(ref, exact)


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def case(request) -> tuple[str, torch.nn.Module, torch.Tensor, dict, tuple[float, float]]:
    """(kind, model, full-batch loss, full-batch gradients, their noise), computed once per model."""
    kind = request.param
    model = FACTORIES[kind]()
    ref_loss, ref = _full_batch(model, _inputs(kind))
    return kind, model, ref_loss, ref, _noise(model, _inputs(kind), ref_loss, ref)


@pytest.fixture
def shared(case) -> tuple[str, torch.nn.Module, torch.Tensor, dict, tuple[float, float]]:
    """``case`` with the shared model's gradients cleared (a failed test may have left some)."""
    case[1].zero_grad(set_to_none=True)
    return case


# (4, 20): by patches, documents {0}, {1, 2, 3}, {4}, {5}: the two videos land in different chunks.
@pytest.mark.parametrize("chunk_size, chunk_patches", [(1, None), (2, None), (3, None), (4, 20)])
def test_gradcache_qwen2_family_chunks_match_full_batch(shared, chunk_size, chunk_patches):
    kind, model, ref_loss, ref, (loss_noise, noise) = shared
    loss = GradCache(model, info_nce, chunk_size, chunk_patches=chunk_patches).step(*_inputs(kind))
    error, tol = rel_error(loss, ref_loss), reassociation_tol(loss_noise)
    assert error <= tol, f"loss relative error {error:.3e} > {tol:.3e}"
    _assert_grads_match(model, ref, noise)


def test_gradcache_qwen2_family_naive_pixel_split_raises(shared):
    kind, model, *_ = shared

    def dim0_split(x, chunk_size):  # what a generic split does: every tensor by sample count
        return [{k: v[s : s + chunk_size] for k, v in x.items()} for s in range(0, 6, chunk_size)]

    # First document chunk: pixel rows 0..1, but image grids (1, 4, 4) and (1, 2, 4) = 24 patches.
    with pytest.raises(
        ValueError, match="'pixel_values' has 2 rows but its 'image_grid_thw' .* gives 24 patches"
    ):
        GradCache(model, info_nce, 2, split_fn=dim0_split).step(*_inputs(kind))
    assert not _grads(model), "the error is raised before any backward"


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_gradcache_qwen2_family_reuse_frozen_vision_matches_full_batch(kind):
    def frozen_tower_model():
        model = FACTORIES[kind]()
        model.visual.requires_grad_(False)
        return model

    if "mm_encoder_outputs" not in inspect.signature(type(frozen_tower_model()).forward).parameters:
        # An older transformers would silently ignore the cached tower outputs: refused instead.
        with pytest.raises(ValueError, match="forward takes mm_encoder_outputs"):
            GradCache(frozen_tower_model(), info_nce, 2, reuse_frozen_vision=True)
        return
    reference = frozen_tower_model()
    ref_loss, ref = _full_batch(reference, _inputs(kind))
    _, noise = _noise(reference, _inputs(kind), ref_loss, ref)
    model = frozen_tower_model()
    calls = []
    model.visual.register_forward_hook(lambda *_: calls.append(1))
    GradCache(model, info_nce, 2, reuse_frozen_vision=True).step(*_inputs(kind))
    # Document chunks {0, 1}: images; {2, 3}: a video; {4, 5}: images and a video -> 4 tower calls in pass 1,
    # none in pass 2.
    assert len(calls) == 4, f"the tower ran {len(calls)} times; expected once per modality per media chunk"
    _assert_grads_match(model, ref, noise)
