"""The decoder families of issue 49 (Gemma 3/4, Mistral, Ministral, Ministral 3, Mistral 3, Qwen3-VL-MoE, GLM-4.1V/
4.5V/4.6V, InternVL) as cases for ``test_decoder_families.py``: tiny stock models of :mod:`hfpatch.testing.decoders`
and their batches.

Every builder seeds its own generators, so each rank builds the same model and batch. Text cases are two rows of 16
and 19 tokens (left padding) or three samples packed in one row; VLM cases put two images in the first row (of
different sizes where the tower takes any), or pack two such rows, drawn with two seeds, in one row (position ids
that restart, no attention mask; M-RoPE models: ``[4, 1, S]`` position ids whose text row restarts). The
sliding-window cases run Gemma 3 and 4 with a window shorter than any rank's shard (3 tokens: 19 tokens over 4
ranks are shards of 5) and one longer than two shards (``2 ceil(19 / world) + 1``), read from the pool's world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hfpatch.testing.decoders import TINY_DECODERS, tiny_decoder, tiny_decoder_inputs

#: The packed text case: samples of 7, 6 and 6 tokens in one row (position ids restart, no attention mask).
PACKED = (7, 6, 6)
#: The short sliding window: under one shard at every world size up to 4 (19 tokens).
SHORT_WINDOW = 3


def long_window() -> int:
    """A sliding window longer than two shards of the 19-token rows at this pool's world size."""
    world = dist.get_world_size() if dist.is_initialized() else 2
    return 2 * -(-19 // world) + 1


def _labels(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return ids.masked_fill(mask == 0, -100) if mask is not None else ids.clone()


def _text(layout: str, seed: int = 4) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    if layout == "packed":
        ids = torch.randint(1, 100, (1, sum(PACKED)), generator=gen)
        positions = torch.cat([torch.arange(n) for n in PACKED])[None]
        labels = ids.clone()
        labels[
            0, torch.tensor(PACKED).cumsum(0)[:-1]
        ] = -100  # a sample's first token is no target of the last
        return dict(input_ids=ids, position_ids=positions, labels=labels, use_cache=False)
    ids = torch.randint(1, 100, (2, 19), generator=gen)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    return dict(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask))


#: Per-image inputs of a VLM batch: every image of the batch is its first row's.
_MEDIA_KEYS = ("pixel_values", "image_sizes", "image_position_ids", "image_grid_thw")


def _vlm_samples(row: str) -> list[dict[str, Any]]:
    """Two multimodal samples of the VLM ``row``, each as a batch of its own: the first row (unpadded, its two
    images of different sizes where the tower takes any) of :func:`tiny_decoder_inputs` drawn with seeds 5 and 6."""
    samples = []
    for seed in (5, 6):
        batch = tiny_decoder_inputs(row, seed=seed)
        keep = batch.pop("attention_mask")[0].bool()
        samples.append({k: v if k in _MEDIA_KEYS else v[:1, keep] for k, v in batch.items()})
    return samples


def _vlm_packed(model: torch.nn.Module, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """``samples`` packed in one row: position ids that restart at each sample and no attention mask (what
    transformers detects as packing). Qwen- and GLM-style models take ``[4, 1, S]`` position ids: the text row
    that restarts, then each sample's own M-RoPE rows (its ``get_rope_index``)."""
    packed = {k: torch.cat([s[k] for s in samples], dim=0 if k in _MEDIA_KEYS else 1) for k in samples[0]}
    rows = []
    for s in samples:
        positions = torch.arange(s["input_ids"].shape[1])[None]
        if "image_grid_thw" in s:
            mrope, _ = model.model.get_rope_index(s["input_ids"], s["mm_token_type_ids"], s["image_grid_thw"])
            positions = torch.cat([positions[None], mrope])
        rows.append(positions)
    packed["position_ids"] = torch.cat(rows, dim=-1)
    labels = packed["input_ids"].clone()
    labels[0, samples[0]["input_ids"].shape[1]] = -100  # the second sample's first token is no target
    return dict(packed, labels=labels, use_cache=False)


#: Case name -> (row of TINY_DECODERS, layout, config overrides). Layouts: ``left`` (two rows, left padding),
#: ``packed`` (text: :data:`PACKED`; a VLM: two multimodal samples in one row, :func:`_vlm_packed`), ``media`` (the
#: row's VLM batch), ``aux`` and ``packed_aux`` (media or packed with ``output_router_logits=True``), ``base`` (the
#: row's headless base model on its VLM batch). Overrides with ``"long"`` take :func:`long_window`.
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3_short": ("gemma3", "left", {"sliding_window": SHORT_WINDOW}),
    "gemma3_long": ("gemma3", "left", {"sliding_window": "long"}),
    "gemma3_packed": ("gemma3", "packed", {}),
    "gemma3_vlm": ("gemma3_vlm", "media", {}),
    "gemma3_vlm_base": ("gemma3_vlm", "base", {}),
    "gemma3_vlm_packed": ("gemma3_vlm", "packed", {}),
    "gemma4_short": ("gemma4", "left", {"sliding_window": SHORT_WINDOW}),
    "gemma4_long": ("gemma4", "left", {"sliding_window": "long"}),
    "gemma4_packed": ("gemma4", "packed", {}),
    "gemma4_vlm": ("gemma4_vlm", "media", {}),
    "gemma4_vlm_packed": ("gemma4_vlm", "packed", {}),
    "mistral": ("mistral", "left", {}),
    "mistral_packed": ("mistral", "packed", {}),
    "ministral": ("ministral", "left", {}),
    "ministral_packed": ("ministral", "packed", {}),
    "ministral3": ("ministral3", "left", {}),
    "ministral3_packed": ("ministral3", "packed", {}),
    "mistral3": ("mistral3", "media", {}),
    "mistral3_packed": ("mistral3", "packed", {}),
    "mistral3_ministral3": ("mistral3_ministral3", "media", {}),
    # The load-balancing term weighs as much as the language-model loss (its default is 1e-3): its gradient counts.
    "qwen3_vl_moe": ("qwen3_vl_moe", "aux", {"router_aux_loss_coef": 1.0}),
    "qwen3_vl_moe_packed": ("qwen3_vl_moe", "packed_aux", {"router_aux_loss_coef": 1.0}),
    "glm4v": ("glm4v", "media", {}),
    "glm4v_packed": ("glm4v", "packed", {}),
    "glm4v_moe": ("glm4v_moe", "aux", {"router_aux_loss_coef": 1.0}),
    "glm4v_moe_packed": ("glm4v_moe", "packed_aux", {"router_aux_loss_coef": 1.0}),
    "glm46v_base": ("glm46v", "base", {}),
    "internvl": ("internvl", "media", {}),
    "internvl_packed": ("internvl", "packed", {}),
    "internvl_qwen3": ("internvl_qwen3", "media", {}),
}


def build(case: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(tiny stock model, forward kwargs) for ``case`` (fresh objects each call, identical on every rank)."""
    row, layout, overrides = CASES[case]
    overrides = {k: long_window() if v == "long" else v for k, v in overrides.items()}
    model = tiny_decoder(row, **overrides)
    if layout in ("packed", "packed_aux") and TINY_DECODERS[row].media != "text":
        batch = _vlm_packed(model, _vlm_samples(row))
        return model, dict(batch, output_router_logits=True) if layout == "packed_aux" else batch
    if layout in ("left", "packed"):
        return model, _text(layout)
    batch = tiny_decoder_inputs(row)
    if layout == "base":
        return model.model, batch
    batch["labels"] = _labels(batch["input_ids"], batch["attention_mask"])
    if layout == "aux":
        batch["output_router_logits"] = True
    return model, batch


def packed_samples(case: str) -> list[tuple[slice, dict[str, Any]]]:
    """The samples of a packed ``case``, each as a batch of its own (its default position ids, no labels) with
    its tokens' slice of the packed row: the stock model's packed logits equal each sample's own."""
    row, layout, _ = CASES[case]
    assert layout.startswith("packed"), case
    if TINY_DECODERS[row].media == "text":
        ids, ends = _text("packed")["input_ids"], torch.tensor(PACKED).cumsum(0).tolist()
        spans = [slice(a, b) for a, b in zip([0, *ends[:-1]], ends)]
        return [(span, dict(input_ids=ids[:, span], use_cache=False)) for span in spans]
    found, start = [], 0
    for sample in _vlm_samples(row):
        length = sample["input_ids"].shape[1]
        found.append((slice(start, start + length), dict(sample, use_cache=False)))
        start += length
    return found


def outputs(out: Any) -> dict[str, torch.Tensor]:
    """The compared outputs: logits, loss and the load-balancing loss, or a base model's last hidden state."""
    if getattr(out, "logits", None) is None:
        return {"last_hidden_state": out.last_hidden_state}
    found = {"logits": out.logits, "loss": out.loss}
    if getattr(out, "aux_loss", None) is not None:
        found["aux_loss"] = out.aux_loss
    return found


def objective(out: Any) -> torch.Tensor:
    """What backward differentiates: the model's loss (with the load-balancing term when asked), or a fixed
    linear functional of a base model's hidden states."""
    if getattr(out, "loss", None) is not None:
        return out.loss
    hidden = out.last_hidden_state
    weight = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(9))  # the same draw for fp64
    return (hidden * weight.to(hidden.dtype)).sum()


# ----------------------------------------------------------------------------------------------- refused
_BASE = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
)  # fmt: skip
_LINEAR = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention"],
)  # fmt: skip
_MOE = dict(
    moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2
)
_LLAMA4 = dict(
    _BASE, intermediate_size=16, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=2, attention_chunk_size=4, no_rope_layer_interval=2, pad_token_id=0,
)  # fmt: skip
_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
               patch_size=4)  # fmt: skip

#: Refused model -> (class, config class, config): the registry's refusals (one per family and kind) and models
#: whose decoder, inside a wrapper, is outside its allowlist.
REFUSED_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(_BASE, **_LINEAR)),
    "qwen3_5_moe_vlm": (
        "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig",
        dict(text_config=dict(_BASE, **_LINEAR, **_MOE), vision_config=dict(depth=1, hidden_size=16, num_heads=2,
             intermediate_size=32, out_hidden_size=32)),
    ),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(_BASE, **_LINEAR, **_MOE)),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", _LLAMA4),
    "llama4_vlm": (
        "Llama4ForConditionalGeneration", "Llama4Config",
        dict(text_config=_LLAMA4, vision_config=dict(_VISION, intermediate_size=64, vision_output_dim=32,
             projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5)),
    ),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(_BASE, num_local_experts=4, num_experts_per_tok=2)),
    "internvl_gpt_oss": (
        "InternVLForConditionalGeneration", "InternVLConfig",
        dict(text_config=dict(_BASE, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2),
             vision_config=_VISION, image_token_id=120, image_seq_length=4),
    ),
    "mistral3_llama": (
        "Mistral3ForConditionalGeneration", "Mistral3Config",
        dict(text_config=dict(_BASE, model_type="llama"), vision_config=dict(_VISION, model_type="pixtral", head_dim=8),
             image_token_index=120, spatial_merge_size=2),
    ),
}  # fmt: skip


def refused_model(name: str) -> torch.nn.Module:
    """The tiny model ``name`` of :data:`REFUSED_MODELS`."""
    import transformers

    from hfpatch.testing.models import build

    cls, config_cls, config = REFUSED_MODELS[name]
    return build(getattr(transformers, cls), 0, getattr(transformers, config_cls)(**config))
