"""Tiny stock transformers decoders beyond Qwen and Llama (:mod:`hfpatch.testing.models`), described as data: one row
per model (:data:`TINY_DECODERS`), one builder (:func:`tiny_decoder`), and processor-style batches with two images
of different sizes where the model takes them (:func:`tiny_decoder_inputs`).

Every text model has 4 query and 2 key/value heads of 8 channels (hidden 32, vocabulary 128, pad id 0), two
layers unless a feature needs more (Gemma 4's KV-sharing layers), sliding windows of 4 tokens unless overridden,
and every parameter re-drawn from the seed (norm weights around 1, everything else ``N(0, 0.04)``). The VLMs' vision
towers are one or two layers of width 16 on 16 x 16 images in patches of 4.

>>> from hfpatch.testing.decoders import tiny_decoder, tiny_decoder_inputs
>>> model = tiny_decoder("gemma3_vlm")
>>> batch = tiny_decoder_inputs("gemma3_vlm")
>>> type(model).__name__, tuple(model(**batch).logits.shape)
('Gemma3ForConditionalGeneration', (2, 19, 128))
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .models import build, qwen3_vl_inputs

__all__ = ["TINY_DECODERS", "TinyDecoder", "tiny_decoder", "tiny_decoder_inputs"]


@dataclass(frozen=True)
class TinyDecoder:
    """A tiny random-weight transformers model, as data.

    Args:
        cls: ``"transformers.<Name>"``, the model class.
        config_cls: ``"transformers.<Name>Config"``, its config class.
        config: The config's arguments (``text``: the shared tiny text model, merged under ``text_config`` for a VLM).
        media: The batch layout :func:`tiny_decoder_inputs` builds: ``"text"``, or the VLM's image layout.
    """

    cls: str
    config_cls: str
    config: Mapping[str, Any]
    media: str = "text"


_TEXT = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=0, bos_token_id=None,
    eos_token_id=None,
)  # fmt: skip
_SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
_GEMMA3 = dict(_TEXT, query_pre_attn_scalar=8, **_SLIDING)
#: Gemma 4 with every feature the split must carry: per-layer embeddings, KV-sharing layers (the last two reuse
#: the keys and values of the first two), the MoE block beside the MLP, wider full-attention heads.
_GEMMA4 = dict(
    _TEXT, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
    vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, global_head_dim=16, num_kv_shared_layers=2,
    enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
)  # fmt: skip
#: Ministral 3's query scale ``1 + beta log(1 + floor(pos / original_max))`` changes every 4 tokens here.
_MINISTRAL3 = dict(
    _TEXT,
    max_position_embeddings=64,  # YaRN's factor x original_max_position_embeddings
    rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
    },
)  # fmt: skip
_QWEN_MROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [1, 1, 2],
    "mrope_interleaved": True,
}
_QWEN_VISION = dict(
    depth=2, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=4, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64,
)  # fmt: skip
_QWEN_IDS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
#: GLM: head_dim is hidden / heads (16), the rotary covers half of it: 4 frequencies in M-RoPE sections 2 + 1 + 1.
_GLM_TEXT = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5},
)  # fmt: skip
_GLM_MOE = dict(
    moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1,
)  # fmt: skip
_GLM_VISION = dict(
    depth=2, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=4, image_size=16,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
)  # fmt: skip
_GLM_IDS = dict(
    image_token_id=120, video_token_id=121, image_start_token_id=122, image_end_token_id=123,
    video_start_token_id=124, video_end_token_id=125,
)  # fmt: skip
_SIGLIP = dict(
    model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    image_size=16, patch_size=4, num_channels=3,
)  # fmt: skip
_PIXTRAL = dict(
    model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
    patch_size=4, image_size=16,
)  # fmt: skip
_INTERN_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=16,
    patch_size=4,
)
_GEMMA4_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
    head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=64,
)  # fmt: skip
_GEMMA4_IDS = dict(
    image_token_id=120, boi_token_id=121, eoi_token_id=122, video_token_id=123, audio_token_id=124,
    boa_token_id=125, eoa_token_index=126,
)  # fmt: skip


def _vlm(text: dict[str, Any], **rest: Any) -> dict[str, Any]:
    return dict(text_config=text, **rest)


#: name -> row. Names are what :func:`tiny_decoder` and :func:`tiny_decoder_inputs` take.
TINY_DECODERS: dict[str, TinyDecoder] = {
    "gemma3": TinyDecoder("transformers.Gemma3ForCausalLM", "transformers.Gemma3TextConfig", _GEMMA3),
    "gemma3_vlm": TinyDecoder(
        "transformers.Gemma3ForConditionalGeneration", "transformers.Gemma3Config",
        _vlm(_GEMMA3, vision_config=_SIGLIP, mm_tokens_per_image=4, image_token_index=120, boi_token_index=121,
             eoi_token_index=122),
        media="gemma3",
    ),
    "gemma4": TinyDecoder("transformers.Gemma4ForCausalLM", "transformers.Gemma4TextConfig", _GEMMA4),
    "gemma4_vlm": TinyDecoder(
        "transformers.Gemma4ForConditionalGeneration", "transformers.Gemma4Config",
        _vlm(dict(_GEMMA4, use_bidirectional_attention="vision"), vision_config=_GEMMA4_VISION, audio_config=None,
             **_GEMMA4_IDS),
        media="gemma4",
    ),
    "mistral": TinyDecoder("transformers.MistralForCausalLM", "transformers.MistralConfig", dict(_TEXT, sliding_window=4)),
    "ministral": TinyDecoder("transformers.MinistralForCausalLM", "transformers.MinistralConfig", dict(_TEXT, **_SLIDING)),
    "ministral3": TinyDecoder("transformers.Ministral3ForCausalLM", "transformers.Ministral3Config", _MINISTRAL3),
    "mistral3": TinyDecoder(
        "transformers.Mistral3ForConditionalGeneration", "transformers.Mistral3Config",
        _vlm(dict(_TEXT, model_type="mistral", sliding_window=None), vision_config=_PIXTRAL, image_token_index=120,
             spatial_merge_size=2),
        media="pixtral",
    ),
    "mistral3_ministral3": TinyDecoder(
        "transformers.Mistral3ForConditionalGeneration", "transformers.Mistral3Config",
        _vlm(dict(_MINISTRAL3, model_type="ministral3"), vision_config=_PIXTRAL, image_token_index=120,
             spatial_merge_size=2),
        media="pixtral",
    ),
    "qwen3_vl_moe": TinyDecoder(
        "transformers.Qwen3VLMoeForConditionalGeneration", "transformers.Qwen3VLMoeConfig",
        _vlm(dict(_TEXT, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, rope_parameters=_QWEN_MROPE),
             vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[1]), **_QWEN_IDS),
        media="qwen",
    ),
    "glm4v": TinyDecoder(
        "transformers.Glm4vForConditionalGeneration", "transformers.Glm4vConfig",
        _vlm(_GLM_TEXT, vision_config=_GLM_VISION, **_GLM_IDS), media="glm",
    ),
    "glm4v_moe": TinyDecoder(
        "transformers.Glm4vMoeForConditionalGeneration", "transformers.Glm4vMoeConfig",
        _vlm(dict(_GLM_TEXT, **_GLM_MOE), vision_config=_GLM_VISION, **_GLM_IDS), media="glm",
    ),
    "glm46v": TinyDecoder(
        "transformers.Glm46VForConditionalGeneration", "transformers.Glm46VConfig",
        _vlm(dict(_GLM_TEXT, model_type="glm4v_text"), vision_config=dict(_GLM_VISION, model_type="glm4v_vision"),
             **_GLM_IDS),
        media="glm",
    ),
    "internvl": TinyDecoder(
        "transformers.InternVLForConditionalGeneration", "transformers.InternVLConfig",
        _vlm(dict(_TEXT, model_type="qwen2", head_dim=None), vision_config=_INTERN_VISION, image_token_id=120,
             image_seq_length=4),
        media="internvl",
    ),
    "internvl_qwen3": TinyDecoder(
        "transformers.InternVLForConditionalGeneration", "transformers.InternVLConfig",
        _vlm(dict(_TEXT, model_type="qwen3"), vision_config=_INTERN_VISION, image_token_id=120, image_seq_length=4),
        media="internvl",
    ),
}  # fmt: skip


def tiny_decoder(name: str, seed: int = 0, **overrides: Any) -> Any:
    """The tiny model of row ``name`` of :data:`TINY_DECODERS`; ``overrides`` update its config's arguments (its
    ``text_config``'s for a VLM), e.g. ``sliding_window=12``."""
    import transformers

    row = TINY_DECODERS[name]
    config = copy.deepcopy(dict(row.config))  # configs may normalise nested dicts in place
    if "text_config" in config:
        config["text_config"] = {
            k: v for k, v in {**config["text_config"], **overrides}.items() if v is not None
        }
    else:
        config = {k: v for k, v in {**config, **overrides}.items() if v is not None}
    # Experts run as a loop over experts: the grouped-matmul kernel has no fp64 (the tests' fp64 twins).
    config_cls = getattr(transformers, row.config_cls.removeprefix("transformers."))
    return build(row.cls, seed, config_cls(**config, experts_implementation="eager"))


def _ids(length: int, gen: torch.Generator) -> list[int]:
    return torch.randint(1, 100, (length,), generator=gen).tolist()


def _rows(seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` (pad id 0)."""
    length = max(map(len, seqs))
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(seqs):
        ids[i, length - len(seq) :] = torch.tensor(seq)
        mask[i, length - len(seq) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def tiny_decoder_inputs(name: str, seed: int = 5) -> dict[str, torch.Tensor]:
    """A processor-style batch for :func:`tiny_decoder`'s ``name``, built by hand (no processor, no hub): two rows,
    left padding; for a VLM two images in the first row (of different sizes where the tower takes any: Pixtral,
    Gemma 4, Qwen-style and GLM towers; SigLIP and InternViT take fixed-size images and tiles) and none in the
    second. Text: 11 tokens, the first row padded by 3."""
    gen = torch.Generator().manual_seed(seed)
    media = TINY_DECODERS[name].media
    if media == "text":
        batch = _rows([_ids(8, gen), _ids(11, gen)])
    elif media in ("qwen", "glm"):
        batch = qwen3_vl_inputs([[("image", (1, 4, 4)), ("image", (1, 2, 4))], []], text_len=3, seed=seed)
        if media == "glm":  # GLM's M-RoPE reads image tokens as type 1, and its vision grids have t = 1
            batch["mm_token_type_ids"] = (batch["input_ids"] == 120).long()
    elif media == "gemma3":  # <boi> + 4 pooled tokens + <eoi> per 16 x 16 image
        image = [121, *[120] * 4, 122]
        batch = _rows([_ids(3, gen) + image + _ids(2, gen) + image + _ids(2, gen), _ids(11, gen)])
        batch["token_type_ids"] = (batch["input_ids"] == 120).long()
        batch["pixel_values"] = torch.randn(2, 3, 16, 16, generator=gen)
    elif media == "gemma4":  # 4 x 4 and 4 x 2 patches, pooled 2 x 2: 4 and 2 tokens; patch rows padded to 16
        sizes = [(4, 4), (4, 2)]
        images = [[121, *[120] * (h * w // 4), 122] for h, w in sizes]
        batch = _rows([_ids(3, gen) + images[0] + _ids(2, gen) + images[1] + _ids(2, gen), _ids(11, gen)])
        batch["mm_token_type_ids"] = (batch["input_ids"] == 120).long()
        pixels = torch.zeros(len(sizes), 16, 3 * 4 * 4)
        positions = torch.full((len(sizes), 16, 2), -1, dtype=torch.long)
        for i, (h, w) in enumerate(sizes):
            xy = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(h), indexing="xy"), -1).reshape(
                -1, 2
            )
            pixels[i, : h * w] = torch.rand(h * w, 3 * 4 * 4, generator=gen)
            positions[i, : h * w] = xy
        batch["pixel_values"], batch["image_position_ids"] = pixels, positions
    elif (
        media == "pixtral"
    ):  # 16 x 16 and 8 x 16 pixels: 4 x 4 and 2 x 4 patches, merged 2 x 2: 4 and 2 tokens
        batch = _rows([_ids(3, gen) + [120] * 4 + _ids(2, gen) + [120] * 2 + _ids(2, gen), _ids(11, gen)])
        pixels = torch.zeros(2, 3, 16, 16)
        pixels[0] = torch.randn(3, 16, 16, generator=gen)
        pixels[1, :, :8] = torch.randn(3, 8, 16, generator=gen)
        batch["pixel_values"], batch["image_sizes"] = pixels, torch.tensor([[16, 16], [8, 16]])
    elif media == "internvl":  # two 16 x 16 tiles, 4 tokens each after the pixel shuffle
        batch = _rows([_ids(3, gen) + [120] * 4 + _ids(2, gen) + [120] * 4 + _ids(2, gen), _ids(11, gen)])
        batch["pixel_values"] = torch.randn(2, 3, 16, 16, generator=gen)
    else:
        raise ValueError(f"unknown media layout {media!r}")
    return batch
