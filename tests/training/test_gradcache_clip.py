"""GradCache on CLIP's towers without ``rep_fn`` (issue 45, item 4): the embedding is the one the model documents.

``CLIPTextModelWithProjection`` / ``CLIPVisionModelWithProjection`` return ``text_embeds`` / ``image_embeds``
(the projected, pooled embedding) next to ``last_hidden_state``. Pooling ``last_hidden_state`` (the vision tower's
last patch token) trained without ``text_projection``, ``visual_projection`` and ``post_layernorm``, silently.
Tiny random-weight CLIP built from a config (nothing downloaded); the reference is ``CLIPModel``'s own loss
(``return_loss=True``) on the whole batch, with the same weights; tolerances from the fp32-vs-fp64 noise of that
reference (``hfpatch.testing.tolerance``), each tensor relative to max(its largest fp64 gradient, 1% of the
model's largest).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    CLIPConfig,
    CLIPModel,
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
)

from hfpatch.testing.tolerance import reassociation_tol, rel_error
from hfpatch.training import GradCache

BATCH, CHUNK = 6, 2


def _clip(dtype: torch.dtype = torch.float32) -> CLIPModel:
    torch.manual_seed(0)
    text = CLIPTextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=16, projection_dim=8,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16,
        patch_size=8, projection_dim=8,
    )  # fmt: skip
    config = CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=8)
    return CLIPModel(config).eval().to(dtype)


def _towers(model: CLIPModel) -> tuple[CLIPTextModelWithProjection, CLIPVisionModelWithProjection]:
    """The two ``...WithProjection`` towers holding ``model``'s weights (the same keys, one tower each)."""
    text = CLIPTextModelWithProjection(model.config.text_config).eval().to(model.dtype)
    vision = CLIPVisionModelWithProjection(model.config.vision_config).eval().to(model.dtype)
    state = model.state_dict()
    for tower in (text, vision):
        missing, _ = tower.load_state_dict(
            {k: v for k, v in state.items() if k in tower.state_dict()}, strict=False
        )
        assert not missing, missing
    return text, vision


def _inputs() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 63, (BATCH, 7), generator=g)
    ids[:, -1] = 63  # CLIP pools the text at the highest token id (eos)
    mask = torch.ones_like(ids)
    mask[1, 5:-1] = 0
    pixels = torch.randn(BATCH, 3, 16, 16, generator=g)
    return {"input_ids": ids, "attention_mask": mask}, {"pixel_values": pixels}


def _reference_grads(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = _clip(dtype)
    text, image = _inputs()
    image = {"pixel_values": image["pixel_values"].to(dtype)}
    model(**text, **image, return_loss=True).loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_gradcache_clip_towers_without_rep_fn_equal_clipmodel_loss():
    model = _clip()
    text_tower, vision_tower = _towers(model)
    scale = model.logit_scale

    def clip_loss(text_embeds: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        t, i = (torch.nn.functional.normalize(x, dim=-1) for x in (text_embeds, image_embeds))
        logits = scale.exp() * t @ i.T
        labels = torch.arange(len(t))
        ce = torch.nn.functional.cross_entropy
        return (ce(logits, labels) + ce(logits.T, labels)) / 2

    text, image = _inputs()
    GradCache([text_tower, vision_tower], clip_loss, chunk_size=CHUNK).step(text, image)
    got = {"logit_scale": scale.grad}
    for tower in (text_tower, vision_tower):
        got.update({k: p.grad for k, p in tower.named_parameters() if p.grad is not None})

    want, want64 = _reference_grads(torch.float32), _reference_grads(torch.float64)
    # The projections and the vision tower's post_layernorm are trained (pooling last_hidden_state left them out).
    assert {
        "text_projection.weight",
        "visual_projection.weight",
        "vision_model.post_layernorm.weight",
    } <= set(got)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    floor = 0.01 * max(g.abs().max().item() for g in want64.values())
    scales = {k: max(g.abs().max().item(), floor) for k, g in want64.items()}
    noise = max(rel_error(want[k], want64[k], scales[k]) for k in want)
    errors = {k: rel_error(got[k], want[k], scales[k]) for k in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= reassociation_tol(noise), (worst, errors[worst], noise)


def test_gradcache_refuses_an_output_with_both_clip_embeddings():
    """``CLIPModel``'s output holds ``text_embeds`` and ``image_embeds``: which is the input's is ambiguous."""
    model = _clip()
    text, image = _inputs()
    inputs = {**text, **image}
    with pytest.raises(TypeError, match="holds both text_embeds and image_embeds.*rep_fn"):
        GradCache(model, lambda a, b: (a * b).sum(), chunk_size=CHUNK).step(inputs, inputs)
