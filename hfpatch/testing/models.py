"""Tiny random-weight stock models for tests, demos and examples (CPU, no hub, well under a second).

Every model is described once, as data: a row of :data:`TINY_MODELS` (:class:`TinyModel`) names the stock class
and the constructor arguments of its tiny version, and :func:`tiny_model` builds it (seeded construction, every
parameter re-drawn; some HF inits are zeros, which would hide bugs). The ``tiny_*`` functions are the rows under
their public names, with the knobs tests turn (``num_heads``, ``head_dim``, ``num_layers``) as arguments and the
rest as ``**overrides`` of the config. :mod:`hfpatch.testing.dits` describes 30 more DiTs the same way.
Every factory seeds its own generator, so the same call gives the same weights on every rank
(``tests/testing/test_models.py`` pins a checksum of each one's weights).

>>> from hfpatch.testing import tiny_wan_transformer
>>> tiny_wan_transformer().config.num_attention_heads
4
>>> from hfpatch.testing.models import tiny_model
>>> tiny_model("wan_transformer", num_attention_heads=2).config.num_attention_heads
2
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "flux_inputs",
    "qwen2_vl_inputs",
    "qwen3_vl_inputs",
    "tiny_autoencoder_kl",
    "tiny_bert",
    "tiny_chronoedit_transformer",
    "tiny_clip_text_model",
    "tiny_clip_tokenizer",
    "tiny_cogvideox_transformer",
    "tiny_flux2_transformer",
    "tiny_flux_pipe",
    "tiny_flux_pipe_with_text_encoders",
    "tiny_flux_transformer",
    "tiny_hunyuandit_pipe",
    "tiny_hunyuandit_transformer",
    "tiny_hunyuanvideo15_transformer",
    "tiny_hunyuanvideo_pipe",
    "tiny_hunyuanvideo_transformer",
    "tiny_llama_causal_lm",
    "tiny_ltx2_transformer",
    "tiny_ltx_pipe",
    "tiny_ltx_transformer",
    "tiny_minimax_h3_transformer",
    "tiny_model",
    "tiny_pixart_pipe",
    "tiny_pixart_transformer",
    "tiny_qwen2_5_vl",
    "tiny_qwen2_vl",
    "tiny_qwen3_causal_lm",
    "tiny_qwen3_vl",
    "tiny_qwenimage_pipe",
    "tiny_qwenimage_transformer",
    "tiny_sd3_pipe",
    "tiny_sdxl_pipe",
    "tiny_sd3_transformer",
    "tiny_t5_encoder",
    "tiny_t5_tokenizer",
    "tiny_wan_pipe",
    "tiny_wan_transformer",
    "tiny_wan_vace_transformer",
    "tiny_wan_vae",
    "wan_prompt_embeds",
]


# ----------------------------------------------------------------------------------------------- the builder
class _Seeded:
    """Seed torch's global RNG for a block (constructors draw from it) and restore its state after."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __enter__(self) -> None:
        self.state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: Any) -> None:
        torch.random.set_rng_state(self.state)


def redraw_by_name(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter re-drawn from ``seed``: weights named ``*norm*`` around 1, everything else ``N(0, 0.04)``
    (the rows of :data:`TINY_MODELS`)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return model.eval()


def redraw_by_module(model: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """Every parameter re-drawn from ``seed``: the scale and shift of normalisation layers (modules named ``*Norm*``)
    around 1 and 0, every other parameter ``N(0, std^2)`` (the rows of :data:`hfpatch.testing.dits.TINY_DITS`,
    which catches norms whose parameters are not named ``norm``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            norm = "Norm" in type(module).__name__
            for name, param in module.named_parameters(recurse=False):
                if norm and name == "weight":
                    param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
                elif norm:
                    param.copy_(0.1 * torch.randn(param.shape, generator=gen))
                else:
                    param.copy_(std * torch.randn(param.shape, generator=gen))
    return model.eval()


def _resolve(name: str | type) -> Any:
    """``"diffusers.WanTransformer3DModel"`` -> the class (imported on first use); a class as it is."""
    if isinstance(name, str):
        module, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(module), attr)
    return name


def build(
    cls: str | type,
    seed: int,
    /,
    *args: Any,
    redraw: Callable[[torch.nn.Module, int], torch.nn.Module] = redraw_by_name,
    attributes: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``cls(*args, **kwargs)`` constructed under a seeded global RNG, ``attributes`` set, weights re-drawn.

    ``attributes`` maps ``"module.path.attribute"`` to a value set after construction (``*`` matches one path
    segment). The one builder of every tiny model here and in :mod:`hfpatch.testing.dits`.

    A process builds each model once: later calls with the same arguments (plain data, or transformers configs)
    return a deep copy of it (constructing and re-drawing a tiny DiT costs ~26 ms of CPU in a process that has
    imported its module, a copy ~5 ms, and the test-suite builds the same models thousands of times). The copy is the built model bit for bit: its own
    parameters, buffers and submodules.
    """
    key = _cache_key((cls, seed, args, redraw, attributes, kwargs))
    if key is not None and key in _BUILT:
        return copy.deepcopy(_BUILT[key])
    model = _build(cls, seed, *args, redraw=redraw, attributes=attributes, **kwargs)
    if key is not None:
        if len(_BUILT) >= _BUILT_MAX:
            _BUILT.pop(next(iter(_BUILT)))  # the oldest
        _BUILT[key] = copy.deepcopy(model)  # kept apart from the caller's, which it may change
    return model


#: Models :func:`build` made in this process, by arguments (at most :data:`_BUILT_MAX`, tiny each).
_BUILT: dict[Any, torch.nn.Module] = {}
_BUILT_MAX = 256


def _cache_key(value: Any) -> Any:
    """A hashable stand-in for plain arguments (data, classes, functions, transformers configs by content); None for
    anything else (that call is not cached)."""
    if (
        value is None
        or isinstance(value, (str, int, float, bool, type))
        or callable(value)
        and hasattr(value, "__qualname__")
    ):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        items = [_cache_key(v) for v in value]
        return None if any(i is None for i in items) else (type(value).__name__, tuple(items))
    if isinstance(value, Mapping):
        items = [(_cache_key(k), _cache_key(v)) for k, v in value.items()]
        return (
            None if any(k is None or v is None for k, v in items) else ("map", tuple(sorted(items, key=repr)))
        )
    if hasattr(value, "to_json_string"):  # a transformers config: its full content
        return (type(value), value.to_json_string())
    return None


def _build(
    cls: str | type,
    seed: int,
    /,
    *args: Any,
    redraw: Callable[[torch.nn.Module, int], torch.nn.Module],
    attributes: Mapping[str, Any] | None,
    **kwargs: Any,
) -> Any:
    with _Seeded(seed):
        model = _resolve(cls)(*args, **kwargs)
    for path, value in (attributes or {}).items():
        pattern, attribute = path.rsplit(".", 1)
        parts = pattern.split(".")
        for name, module in model.named_modules():
            names = name.split(".")
            if len(names) == len(parts) and all(p in ("*", n) for p, n in zip(parts, names)):
                setattr(module, attribute, value)
    return redraw(model, seed)


def pipeline(cls: str, **components: Any) -> Any:
    """A stock diffusers pipeline ``diffusers.<cls>(**components)`` with its progress bar off."""
    pipe = _resolve(f"diffusers.{cls}")(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@dataclass(frozen=True)
class TinyModel:
    """A tiny random-weight stock model, as data.

    Args:
        cls: The class, ``"diffusers.<Name>"`` or ``"transformers.<Name>"`` (imported when first built).
        config: Constructor arguments (diffusers), or the arguments of ``config_cls`` (transformers).
        derived: Arguments computed from the final config (``lambda c: {"hidden_size": ...}``): they follow
            the heads and widths a call sets, unless the call sets them itself.
        config_cls: For transformers models, the config class (``cls(config_cls(**config), **init)``).
        init: Further constructor arguments, not part of the config.
    """

    cls: str
    config: Mapping[str, Any]
    derived: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    config_cls: str | None = None
    init: Mapping[str, Any] = field(default_factory=dict)


def tiny_model(name: str, seed: int = 0, **config: Any) -> Any:
    """The tiny stock model of row ``name`` of :data:`TINY_MODELS` (``config`` updates its constructor arguments).

    >>> tiny_model("bert", num_hidden_layers=1).config.num_hidden_layers
    1
    """
    row = TINY_MODELS[name]
    merged = {**copy.deepcopy(dict(row.config)), **config}  # constructors may normalise lists in place
    merged = {**merged, **(row.derived(merged) if row.derived else {}), **config}
    if row.config_cls is None:
        return build(row.cls, seed, **merged, **row.init)
    return build(row.cls, seed, _resolve(row.config_cls)(**merged), **row.init)


def _inner(c: dict[str, Any]) -> int:
    return c["num_attention_heads"] * c["attention_head_dim"]


# ----------------------------------------------------------------------------------------------- rows
# The rows read as a table, one config argument after another: not reformatted.
# fmt: off
#: Wan 2.1 text-to-video layout: patch 1x2x2, 4 heads of 8, 2 blocks (ChronoEdit and VACE add to it).
_WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
    text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    rope_max_seq_len=64,
)
#: The causal 3D Wan VAE (8x spatial, 4x temporal), z_dim 4.
_WAN_VAE = dict(
    base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
    latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
)
#: A tiny decoder-only text model: 4 query / 2 key-value heads of 8 (released bos/eos ids: outside the vocabulary).
_TINY_TEXT_LM = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
    pad_token_id=0,
)
#: The in-memory tokenizers' alphabet: one token per lowercase letter.
_TOKEN_CHARS = "abcdefghijklmnopqrstuvwxyz"

#: name -> row. Names are what :func:`tiny_model` takes.
TINY_MODELS: dict[str, TinyModel] = {
    # ---- DiT transformers
    "wan_transformer": TinyModel("diffusers.WanTransformer3DModel", _WAN),
    "chronoedit_transformer": TinyModel(
        "diffusers.ChronoEditTransformer3DModel",
        {**_WAN, "image_dim": 16, "rope_temporal_skip_len": 8},
        derived=lambda c: {"added_kv_proj_dim": _inner(c)},
    ),
    "wan_vace_transformer": TinyModel(
        "diffusers.WanVACETransformer3DModel",
        {**_WAN, "vace_in_channels": 8},
        derived=lambda c: {"vace_layers": list(range(c["num_layers"]))},
    ),
    "flux_transformer": TinyModel(  # one double- and one single-stream block
        "diffusers.FluxTransformer2DModel",
        dict(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=16, pooled_projection_dim=16, guidance_embeds=False,
            axes_dims_rope=(2, 2, 4),
        ),
    ),
    "flux2_transformer": TinyModel(
        "diffusers.Flux2Transformer2DModel",
        dict(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=16, timestep_guidance_channels=16,
            axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False,
        ),
    ),
    "sd3_transformer": TinyModel(  # two joint blocks
        "diffusers.SD3Transformer2DModel",
        dict(
            sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=16, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=32,
        ),
        derived=lambda c: {"caption_projection_dim": _inner(c)},
    ),
    "cogvideox_transformer": TinyModel(
        "diffusers.CogVideoXTransformer3DModel",
        dict(
            num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
            text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
            max_text_seq_length=8, use_rotary_positional_embeddings=True,
        ),
    ),
    "qwenimage_transformer": TinyModel(
        "diffusers.QwenImageTransformer2DModel",
        dict(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
        ),
    ),
    "ltx_transformer": TinyModel(
        "diffusers.LTXVideoTransformer3DModel",
        dict(
            in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, num_layers=2,
            caption_channels=16,
        ),
        derived=lambda c: {"cross_attention_dim": _inner(c)},
    ),
    "ltx2_transformer": TinyModel(  # the audio stream has 2 heads of 8
        "diffusers.LTX2VideoTransformer3DModel",
        dict(
            in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, audio_in_channels=8,
            audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
            audio_cross_attention_dim=16, num_layers=2, caption_channels=16,
        ),
        derived=lambda c: {"cross_attention_dim": _inner(c)},
    ),
    "hunyuanvideo_transformer": TinyModel(  # one dual-, one single-stream and one refiner block
        "diffusers.HunyuanVideoTransformer3DModel",
        dict(
            in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=False,
            text_embed_dim=16, pooled_projection_dim=16, rope_axes_dim=(2, 2, 4),
        ),
    ),
    "hunyuanvideo15_transformer": TinyModel(
        "diffusers.HunyuanVideo15Transformer3DModel",
        dict(
            in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=2,
            num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=16,
            image_embed_dim=16, rope_axes_dim=(2, 2, 4),
        ),
    ),
    "minimax_h3_transformer": TinyModel(  # 4 heads of 12: 2 rotary frequencies per axis
        "diffusers.MiniMaxH3Transformer3DModel",
        dict(
            num_attention_heads=4, attention_head_dim=12, num_layers=2, num_refiner_layers=1, in_channels=2,
            audio_in_channels=8, text_dim=16, freq_dim=16, time_embed_dim=16,
        ),
        derived=lambda c: {
            "hidden_size": _inner(c),
            "ffn_dim": 2 * _inner(c),
            "time_embed_hidden_dim": _inner(c),
            "rope_freq_dim": c["attention_head_dim"] // 6,
        },
    ),
    "hunyuandit_transformer": TinyModel(  # 4 blocks: one long skip, block 0 to block 3
        "diffusers.HunyuanDiT2DModel",
        dict(
            num_attention_heads=4, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=8,
            num_layers=4, mlp_ratio=2.0, learn_sigma=True, cross_attention_dim=16, cross_attention_dim_t5=16,
            pooled_projection_dim=16, text_len=4, text_len_t5=6, use_style_cond_and_image_meta_size=False,
        ),
        derived=lambda c: {"hidden_size": _inner(c)},
    ),
    "pixart_transformer": TinyModel(
        "diffusers.PixArtTransformer2DModel",
        dict(
            num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
            sample_size=8, patch_size=2, caption_channels=16, use_additional_conditions=False,
        ),
        derived=lambda c: {"cross_attention_dim": _inner(c)},
    ),
    "sdxl_unet": TinyModel(  # text_time added conditioning: pooled text + 6 time ids of 4 channels
        "diffusers.UNet2DConditionModel",
        dict(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
            cross_attention_dim=16, norm_num_groups=8, addition_embed_type="text_time",
            addition_time_embed_dim=4, projection_class_embeddings_input_dim=16 + 6 * 4,
        ),
    ),
    # ---- VAEs
    "wan_vae_2.1": TinyModel("diffusers.AutoencoderKLWan", _WAN_VAE),
    "wan_vae_2.2": TinyModel(  # patchify, residual up/down, 16x spatial
        "diffusers.AutoencoderKLWan",
        dict(
            _WAN_VAE, decoder_base_dim=8, is_residual=True, patch_size=2, in_channels=12, out_channels=12,
            scale_factor_spatial=16,
        ),
    ),
    "autoencoder_kl": TinyModel(  # two resolutions, GroupNorm, mid-block attention: 2x spatial
        "diffusers.AutoencoderKL",
        dict(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16),
            layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=32,
        ),
    ),
    "qwenimage_vae": TinyModel(  # 2x spatial
        "diffusers.AutoencoderKLQwenImage",
        dict(
            base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
        ),
    ),
    "qwenimage21_vae": TinyModel(  # Wan 2.2's residual form on single images, patchify 2: 8x spatial
        "diffusers.AutoencoderKLQwenImage21",
        dict(
            base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
            temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
            is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=8,
        ),
    ),
    "flux2_vae": TinyModel(  # AutoencoderKL's encoder/decoder plus the latents' BatchNorm: 2x spatial
        "diffusers.AutoencoderKLFlux2",
        dict(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
            latent_channels=4, norm_num_groups=4, sample_size=32,
        ),
    ),
    "hunyuanimage_vae": TinyModel(  # GroupNorm(32 groups), pixel-shuffle resampling, mid attention: 2x spatial
        "diffusers.AutoencoderKLHunyuanImage",
        dict(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64), layers_per_block=1,
            spatial_compression_ratio=2, sample_size=32,
        ),
    ),
    "hunyuanimage_refiner_vae": TinyModel(  # causal 3D convs with replicate padding, DCAE resampling: 4x spatial
        "diffusers.AutoencoderKLHunyuanImageRefiner",
        dict(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1,
            spatial_compression_ratio=4, temporal_compression_ratio=2,
        ),
    ),
    "autoencoder_dc": TinyModel(  # Sana's layout: stride-2 conv down, nearest up, ReLU linear attention: 2x spatial
        "diffusers.AutoencoderDC",
        dict(
            in_channels=3, latent_channels=4, attention_head_dim=4,
            encoder_block_types=("ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 16),
            decoder_block_out_channels=(8, 16), encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
            encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
            downsample_block_type="Conv", upsample_block_type="interpolate",
            decoder_norm_types=("batch_norm", "rms_norm"), decoder_act_fns=("relu", "silu"),
        ),
    ),
    "ltx_vae": TinyModel(  # 32x spatial, 8x temporal, 8 latent channels
        "diffusers.AutoencoderKLLTXVideo",
        dict(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
            decoder_spatio_temporal_scaling=(True, True, True, False),
            decoder_inject_noise=(False, False, False, False, False),
            upsample_residual=(False, False, False, False), upsample_factor=(1, 1, 1, 1),
            timestep_conditioning=False, patch_size=4, patch_size_t=1, encoder_causal=True,
            decoder_causal=False,
        ),
    ),
    "hunyuanvideo_vae": TinyModel(  # 8x spatial, 4x temporal
        "diffusers.AutoencoderKLHunyuanVideo",
        dict(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
            spatial_compression_ratio=8, temporal_compression_ratio=4, mid_block_add_attention=True,
        ),
    ),
    "hunyuanvideo15_vae": TinyModel(  # 4x spatial, 4x temporal, causal attention in the mid-blocks
        "diffusers.AutoencoderKLHunyuanVideo15",
        dict(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1,
            spatial_compression_ratio=4, temporal_compression_ratio=4,
        ),
    ),
    "ltx2_vae": TinyModel(  # 16x spatial (patch 2), 8x temporal, reflect-padded causal decoder, residual upsamplers
        "diffusers.AutoencoderKLLTX2Video",
        dict(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, True),
            decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False, False, False, False),
            upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), patch_size=2,
            spatial_compression_ratio=16, temporal_compression_ratio=8,
        ),
    ),
    "cogvideox_vae": TinyModel(  # 2x spatial, 2x temporal, SpatialNorm3D decoder, frame batches with conv_cache
        "diffusers.AutoencoderKLCogVideoX",
        dict(
            in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 2,
            up_block_types=("CogVideoXUpBlock3D",) * 2, block_out_channels=(8, 8), latent_channels=4,
            layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=2, sample_height=32, sample_width=32,
        ),
    ),
    "mochi_vae": TinyModel(  # 2x spatial, 2x temporal; per-frame GroupNorm needs 32 channels (32 groups)
        "diffusers.AutoencoderKLMochi",
        dict(
            in_channels=15, out_channels=3, encoder_block_out_channels=(32, 32),
            decoder_block_out_channels=(32, 32), latent_channels=4, layers_per_block=(1, 1, 1),
            temporal_expansions=(2,), spatial_expansions=(2,), add_attention_block=(False, True, True),
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
        ),
    ),
    "allegro_vae": TinyModel(  # 2x spatial, 2x temporal; tiles of 4 frames x 10 x 10 pixels every 2 x 6 x 6
        "diffusers.AutoencoderKLAllegro",
        dict(
            in_channels=3, out_channels=3, down_block_types=("AllegroDownBlock3D",) * 2,
            up_block_types=("AllegroUpBlock3D",) * 2, block_out_channels=(8, 8),
            temporal_downsample_blocks=(True, False), temporal_upsample_blocks=(False, True), latent_channels=4,
            layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=2, sample_size=10,
        ),
        init={
            "attributes": {  # Allegro encodes and decodes through its tiles only
                ".use_tiling": True, ".kernel": (4, 10, 10), ".stride": (2, 6, 6), ".tile_overlap_t": 2,
                ".tile_overlap_h": 4, ".tile_overlap_w": 4,
            }
        },
    ),
    "cosmos_vae": TinyModel(  # 4x spatial (Haar patch 2), 4x temporal, spatial + causal temporal attention
        "diffusers.AutoencoderKLCosmos",
        dict(
            in_channels=3, out_channels=3, latent_channels=4, encoder_block_out_channels=(8, 8, 8, 8),
            decode_block_out_channels=(8, 8, 8, 8), attention_resolutions=(4, 8), resolution=16, num_layers=1,
            patch_size=2, spatial_compression_ratio=4, temporal_compression_ratio=4, latents_mean=None,
            latents_std=None,
        ),
    ),
    # ---- text models
    "qwen3_causal_lm": TinyModel(
        "transformers.Qwen3ForCausalLM", _TINY_TEXT_LM, config_cls="transformers.Qwen3Config"
    ),
    "llama_causal_lm": TinyModel(
        "transformers.LlamaForCausalLM", _TINY_TEXT_LM, config_cls="transformers.LlamaConfig"
    ),
    "bert": TinyModel(  # no pooler
        "transformers.BertModel",
        dict(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        ),
        config_cls="transformers.BertConfig",
        init={"add_pooling_layer": False},
    ),
    "clip_text_model": TinyModel(  # tiny_clip_tokenizer's vocabulary, 8 positions
        "transformers.CLIPTextModel",
        dict(
            vocab_size=2 + 2 * len(_TOKEN_CHARS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=8, projection_dim=16, bos_token_id=0,
            eos_token_id=1, pad_token_id=1,
        ),
        config_cls="transformers.CLIPTextConfig",
    ),
    "t5_encoder": TinyModel(  # tiny_t5_tokenizer's vocabulary
        "transformers.T5EncoderModel",
        dict(
            vocab_size=4 + 2 * len(_TOKEN_CHARS), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        ),
        config_cls="transformers.T5Config",
    ),
}

#: Config overrides giving the tiny image VAE rows their released models' proportions: a spatial factor of 8 and
#: channels growing 4x from the pixel level to the latent level (QwenImage 2.1's row has them already). Memory
#: measurements use them: in a factor-2 row the latent-level tensors (the mid-block attention's keys/values and
#: scores, the statistics) weigh as much as the pixel-level maps, which in no released VAE they do.
VAE_MEMORY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwenimage_vae": dict(dim_mult=[1, 2, 4, 4], temperal_downsample=[False, True, True]),
    "qwenimage21_vae": {},
    "flux2_vae": dict(
        block_out_channels=(8, 16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
    ),
    "hunyuanimage_vae": dict(block_out_channels=(32, 32, 64, 64), spatial_compression_ratio=8),
    "hunyuanimage_refiner_vae": dict(block_out_channels=(8, 16, 32, 32), spatial_compression_ratio=8),
    "autoencoder_dc": dict(
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 16, 32, 32), decoder_block_out_channels=(8, 16, 32, 32),
        encoder_layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,), (5,)), decoder_qkv_multiscales=((), (), (5,), (5,)),
        decoder_norm_types=("batch_norm", "batch_norm", "rms_norm", "rms_norm"),
        decoder_act_fns=("relu", "relu", "silu", "silu"),
    ),
}
# fmt: on


def _knobs(
    overrides: dict[str, Any], num_heads: int, head_dim: int, num_layers: int | None = None
) -> dict[str, Any]:
    """A factory's knobs as config arguments; ``overrides`` win."""
    knobs: dict[str, Any] = {"num_attention_heads": num_heads, "attention_head_dim": head_dim}
    if num_layers is not None:
        knobs["num_layers"] = num_layers
    return {**knobs, **overrides}


# ----------------------------------------------------------------------------------------------- DiT transformers


def tiny_wan_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``WanTransformer3DModel`` (Wan 2.1 layout; ``image_dim``/``added_kv_proj_dim`` via overrides)."""
    return tiny_model("wan_transformer", seed, **_knobs(overrides, num_heads, head_dim, num_layers))


def tiny_chronoedit_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``ChronoEditTransformer3DModel`` (Wan 2.1 I2V layout: cross-attention to text and image keys).

    Call it with ``hidden_states`` ``[B, 4, F, H, W]`` (patch 1x2x2; ``F = 2`` takes ChronoEdit's temporal-skip
    rotary path), ``timestep`` ``[B]``, ``encoder_hidden_states`` ``[B, T, 16]`` and
    ``encoder_hidden_states_image`` ``[B, I, 16]``.
    """
    return tiny_model("chronoedit_transformer", seed, **_knobs(overrides, num_heads, head_dim, num_layers))


def tiny_wan_vace_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``WanVACETransformer3DModel``: :func:`tiny_wan_transformer`'s layout plus a VACE block per layer.

    Call it like the Wan transformer plus ``control_hidden_states`` ``[B, 8, F, H, W]`` (the latent's frames and
    size) and optionally ``control_hidden_states_scale`` ``[num_layers]``.
    """
    return tiny_model("wan_vace_transformer", seed, **_knobs(overrides, num_heads, head_dim, num_layers))


def tiny_flux_transformer(num_heads: int = 4, head_dim: int = 8, seed: int = 0, **overrides: Any):
    """A stock ``FluxTransformer2DModel`` with one double and one single block."""
    return tiny_model("flux_transformer", seed, **_knobs(overrides, num_heads, head_dim))


def tiny_flux2_transformer(num_heads: int = 4, head_dim: int = 8, seed: int = 0, **overrides: Any):
    """A stock ``Flux2Transformer2DModel`` with one double-stream and one single-stream block.

    Call it with ``hidden_states`` ``[B, S, 16]``, ``encoder_hidden_states`` ``[B, T, 16]``, ``img_ids`` and
    ``txt_ids`` (``[B, S, 4]``/``[B, T, 4]`` or 2D) and ``timestep`` in ``[0, 1]``.
    """
    return tiny_model("flux2_transformer", seed, **_knobs(overrides, num_heads, head_dim))


def tiny_sd3_transformer(num_heads: int = 4, head_dim: int = 8, seed: int = 0, **overrides: Any):
    """A stock ``SD3Transformer2DModel`` with two joint blocks."""
    return tiny_model("sd3_transformer", seed, **_knobs(overrides, num_heads, head_dim))


def tiny_cogvideox_transformer(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``CogVideoXTransformer3DModel`` (5B layout: rotary positions, given as ``image_rotary_emb``).

    ``head_dim`` 16 leaves the 3D rotary table of ``diffusers.models.embeddings.get_3d_rotary_pos_embed``
    even sizes per axis (4 for time, 6 each for height and width).
    """
    return tiny_model("cogvideox_transformer", seed, **_knobs(overrides, num_heads, head_dim, num_layers))


def tiny_qwenimage_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``QwenImageTransformer2DModel`` (dual-stream joint attention, text mask, complex rotary).

    Call it with packed latents ``hidden_states`` ``[B, F*H*W, 16]``, ``img_shapes=[[(F, H, W)]] * B`` and text
    ``encoder_hidden_states`` ``[B, T, 16]`` (optionally ``encoder_hidden_states_mask`` ``[B, T]``).
    """
    return tiny_model("qwenimage_transformer", seed, **_knobs(overrides, num_heads, head_dim, num_layers))


def tiny_ltx_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``LTXVideoTransformer3DModel`` (video self-attention with rotary, cross-attention to text).

    Call it with ``hidden_states`` ``[B, F*H*W, 8]``, ``encoder_hidden_states`` ``[B, T, 16]``,
    ``encoder_attention_mask`` ``[B, T]``, ``timestep`` (``[B]``, or ``[B, F*H*W]`` per token) and
    ``num_frames``/``height``/``width``.
    """
    return tiny_model("ltx_transformer", seed, **_knobs(overrides, num_heads, head_dim, num_layers))


def tiny_ltx2_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``LTX2VideoTransformer3DModel`` (LTX-2: video and audio streams, audio-video cross-attention).

    Call it with ``hidden_states`` ``[B, F*H*W, 8]``, ``audio_hidden_states`` ``[B, A, 8]``,
    ``encoder_hidden_states`` and ``audio_encoder_hidden_states`` ``[B, T, 16]``, ``encoder_attention_mask``
    ``[B, T]``, ``timestep`` ``[B]`` (or ``[B, F*H*W]`` per token, with ``audio_timestep`` ``[B]``),
    ``num_frames``/``height``/``width`` and ``audio_num_frames=A``. The audio stream has 2 heads of 8.
    """
    return tiny_model("ltx2_transformer", seed, **_knobs(overrides, num_heads, head_dim, num_layers))


def tiny_hunyuanvideo_transformer(num_heads: int = 4, head_dim: int = 8, seed: int = 0, **overrides: Any):
    """A stock ``HunyuanVideoTransformer3DModel`` (text-to-video) with one dual- and one single-stream block.

    Call it with ``hidden_states`` ``[B, 4, F, H, W]`` (patch 1x2x2), ``timestep`` ``[B]``,
    ``encoder_hidden_states`` ``[B, T, 16]``, ``encoder_attention_mask`` ``[B, T]`` (a prefix of ones) and
    ``pooled_projections`` ``[B, 16]``.
    """
    return tiny_model("hunyuanvideo_transformer", seed, **_knobs(overrides, num_heads, head_dim))


def tiny_hunyuanvideo15_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``HunyuanVideo15Transformer3DModel`` (HunyuanVideo 1.5: dual-stream blocks, video and text joined).

    Call it with ``hidden_states`` ``[B, 4, F, H, W]`` (patch 1x1x1: ``F*H*W`` tokens), ``timestep`` ``[B]``,
    ``encoder_hidden_states`` ``[B, T, 16]`` with ``encoder_attention_mask`` ``[B, T]``,
    ``encoder_hidden_states_2`` ``[B, T2, 16]`` with ``encoder_attention_mask_2`` ``[B, T2]`` (the ByT5 text) and
    ``image_embeds`` ``[B, N, 16]`` (all zeros: text-to-video, the image tokens masked).
    """
    return tiny_model(
        "hunyuanvideo15_transformer", seed, **_knobs(overrides, num_heads, head_dim, num_layers)
    )


def tiny_minimax_h3_transformer(num_heads: int = 4, head_dim: int = 12, seed: int = 0, **overrides: Any):
    """A stock ``MiniMaxH3Transformer3DModel`` (one packed sequence of video, text and audio rows).

    Call it with ``hidden_states`` ``[B, V, 8]`` (patch 1x2x2 of 2 channels), ``audio_hidden_states``
    ``[B, A, 8]``, ``encoder_hidden_states`` ``[B, T, 16]``, ``timestep`` (the distinct noise levels),
    per-row ``timestep_indices``, ``token_tags`` (0 video, 1 text, 2 audio) and ``position_ids`` ``[S, 3]``,
    and the rows of each modality in the packed sequence (``video_indices``, ``audio_indices``,
    ``text_indices``; ``S = V + A + T``).
    """
    return tiny_model("minimax_h3_transformer", seed, **_knobs(overrides, num_heads, head_dim))


def tiny_hunyuandit_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 4, seed: int = 0, **overrides: Any
):
    """A stock ``HunyuanDiT2DModel`` (4 blocks: one long skip, block 0 to block 3), without style/size conditions.

    Call it with ``hidden_states`` ``[B, 4, H, W]`` (patch 2), a float ``timestep`` ``[B]``, CLIP-like
    ``encoder_hidden_states`` ``[B, 4, 16]`` with ``text_embedding_mask`` ``[B, 4]``, T5-like
    ``encoder_hidden_states_t5`` ``[B, 6, 16]`` with ``text_embedding_mask_t5`` ``[B, 6]`` (masked tokens become
    the learned padding) and ``image_rotary_emb`` (cos, sin), each ``[H/2 * W/2, head_dim]``, as the pipeline
    builds it with ``diffusers.models.embeddings.get_2d_rotary_pos_embed``.

    >>> tiny_hunyuandit_transformer().config.num_layers
    4
    """
    return tiny_model("hunyuandit_transformer", seed, **_knobs(overrides, num_heads, head_dim, num_layers))


def tiny_pixart_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``PixArtTransformer2DModel`` (PixArt-alpha/sigma layout: ``ada_norm_single``, learned-sigma output).

    Call it with ``hidden_states`` ``[B, 4, H, W]`` (patch 2; the sin-cos positions follow the input size),
    ``encoder_hidden_states`` ``[B, T, 16]``, ``encoder_attention_mask`` ``[B, T]`` and ``timestep`` ``[B]``.

    >>> tiny_pixart_transformer().config.out_channels
    8
    """
    return tiny_model("pixart_transformer", seed, **_knobs(overrides, num_heads, head_dim, num_layers))


# ----------------------------------------------------------------------------------------------- VAEs


def tiny_wan_vae(version: str = "2.1", seed: int = 0, **overrides: Any):
    """A stock ``AutoencoderKLWan``: ``"2.1"`` (causal 3D, 8x spatial) or ``"2.2"`` (patchify, residual up/down)."""
    if version not in ("2.1", "2.2"):
        raise ValueError(f"version must be '2.1' or '2.2', got {version!r}")
    return tiny_model(f"wan_vae_{version}", seed, **overrides)


def tiny_autoencoder_kl(seed: int = 0, **overrides: Any):
    """A stock 2D ``AutoencoderKL`` (two resolutions, GroupNorm, mid-block attention), 2x spatial factor."""
    return tiny_model("autoencoder_kl", seed, **overrides)


# ----------------------------------------------------------------------------------------------- text models


def tiny_qwen3_causal_lm(seed: int = 0, **overrides: Any):
    """A stock ``Qwen3ForCausalLM`` (qk-norm, grouped-query attention: 4 query / 2 key-value heads of 8) with tiny dims.

    >>> import torch
    >>> tuple(tiny_qwen3_causal_lm()(input_ids=torch.tensor([[1, 2, 3]])).logits.shape)
    (1, 3, 128)
    """
    return tiny_model("qwen3_causal_lm", seed, **overrides)


def tiny_llama_causal_lm(seed: int = 0, **overrides: Any):
    """A stock ``LlamaForCausalLM`` (grouped-query attention: 4 query / 2 key-value heads of 8) with tiny dims.

    >>> import torch
    >>> tuple(tiny_llama_causal_lm()(input_ids=torch.tensor([[1, 2, 3]])).logits.shape)
    (1, 3, 128)
    """
    return tiny_model("llama_causal_lm", seed, **overrides)


def tiny_bert(seed: int = 0, dropout: float = 0.0, **overrides: Any):
    """A stock ``BertModel`` text encoder (no pooler) with tiny dims; ``dropout`` sets hidden and attention dropout.

    >>> import torch
    >>> from hfpatch.testing import tiny_bert
    >>> tuple(tiny_bert()(input_ids=torch.tensor([[1, 2, 3]])).last_hidden_state.shape)
    (1, 3, 32)
    """
    dropouts = {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    return tiny_model("bert", seed, **{**dropouts, **overrides})


def tiny_clip_text_model(seed: int = 0, **overrides: Any):
    """A stock ``CLIPTextModel`` (hidden 16, 8 positions) matching :func:`tiny_clip_tokenizer`'s vocabulary."""
    return tiny_model("clip_text_model", seed, **overrides)


def tiny_t5_encoder(seed: int = 0, **overrides: Any):
    """A stock ``T5EncoderModel`` (d_model 16) matching :func:`tiny_t5_tokenizer`'s vocabulary."""
    return tiny_model("t5_encoder", seed, **overrides)


def tiny_clip_tokenizer(model_max_length: int = 8):
    """A ``CLIPTokenizer`` built in memory (no hub): one token per lowercase letter, with and without ``</w>``.

    >>> from hfpatch.testing.models import tiny_clip_tokenizer
    >>> tiny_clip_tokenizer()("ab", padding="max_length", max_length=8).input_ids
    [0, 2, 29, 1, 1, 1, 1, 1]
    """
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in _TOKEN_CHARS:
        vocab[char] = len(vocab)
    for char in _TOKEN_CHARS:
        vocab[f"{char}</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def tiny_t5_tokenizer(model_max_length: int = 8):
    """A ``T5TokenizerFast`` (Unigram) built in memory (no hub): one piece per lowercase letter, ``</s>`` is 1.

    >>> from hfpatch.testing.models import tiny_t5_tokenizer
    >>> tiny_t5_tokenizer()("ab").input_ids[-1]
    1
    """
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(char, -2.0) for char in _TOKEN_CHARS] + [(f"\u2581{c}", -1.5) for c in _TOKEN_CHARS]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


# ----------------------------------------------------------------------------------------------- pipelines
def _no_text_encoders(count: int) -> dict[str, None]:
    """``text_encoder``/``tokenizer`` (and ``_2``, ``_3``, ... up to ``count``) as ``None``: embeddings given."""
    suffixes = [""] + [f"_{i}" for i in range(2, count + 1)]
    return {f"{part}{s}": None for s in suffixes for part in ("text_encoder", "tokenizer")}


#: ``tiny_autoencoder_kl`` arguments for an 8x spatial factor: 80 x 80 pixels are 10 x 10 latents.
KL_VAE_8X = dict(
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 8, 8, 16),
)


def wan_prompt_embeds(batch: int = 1, length: int = 6, text_dim: int = 16, seed: int = 1) -> torch.Tensor:
    """Random text-encoder outputs shaped like UMT5's, for running a tiny Wan pipeline without a tokenizer."""
    return torch.randn(batch, length, text_dim, generator=torch.Generator().manual_seed(seed))


def flux_inputs(side: int = 5, text_tokens: int = 7, seed: int = 1) -> dict[str, torch.Tensor]:
    """Forward kwargs of :func:`tiny_flux_transformer` (16 latent channels, text and pooled width 16), batch 1: a
    ``side x side`` grid of image tokens (``img_ids`` ``[0, row, column]``) and ``text_tokens`` text tokens, drawn
    from ``seed``, ``seed + 1`` and ``seed + 2``. The default 25 image tokens leave padding at worlds 2, 3 and 4.

    >>> from hfpatch.testing.models import flux_inputs, tiny_flux_transformer
    >>> tuple(tiny_flux_transformer()(**flux_inputs()).sample.shape)
    (1, 25, 16)
    """

    def randn(*shape: int, seed: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    tokens = side * side
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(
        tokens, 2
    )
    return dict(
        hidden_states=randn(1, tokens, 16, seed=seed),
        encoder_hidden_states=randn(1, text_tokens, 16, seed=seed + 1),
        pooled_projections=randn(1, 16, seed=seed + 2),
        timestep=torch.tensor([0.7]),
        img_ids=torch.cat([torch.zeros(tokens, 1), grid.float()], dim=1),
        txt_ids=torch.zeros(text_tokens, 3),
    )


def tiny_wan_pipe(seed: int = 0, two_transformers: bool = False, text_encoder: bool = False):
    """A stock ``WanPipeline`` from tiny parts; call it with ``prompt_embeds``/``negative_prompt_embeds``, or, with
    ``text_encoder=True`` (a tiny T5 encoder and tokenizer, ``max_sequence_length=8``), with a prompt: then
    ``save_pretrained`` writes a checkpoint that ``hfpatch generate`` and ``DiffusionPipeline.from_pretrained`` load
    (the quickstart's ``./tiny-wan``: ``tiny_wan_pipe(text_encoder=True).save_pretrained("tiny-wan")``).

    >>> import torch
    >>> from hfpatch.testing import tiny_wan_pipe, wan_prompt_embeds
    >>> pipe = tiny_wan_pipe()
    >>> out = pipe(prompt_embeds=wan_prompt_embeds(), negative_prompt_embeds=wan_prompt_embeds(seed=2),
    ...            height=32, width=32, num_frames=5, num_inference_steps=2, output_type="pt",
    ...            generator=torch.Generator().manual_seed(0)).frames
    >>> tuple(out.shape)
    (1, 5, 3, 32, 32)
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    return pipeline(
        "WanPipeline",
        tokenizer=tiny_t5_tokenizer() if text_encoder else None,
        text_encoder=tiny_t5_encoder() if text_encoder else None,
        vae=tiny_wan_vae("2.1", seed=seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=tiny_wan_transformer(seed=seed),
        transformer_2=tiny_wan_transformer(seed=seed + 100) if two_transformers else None,
        boundary_ratio=0.5 if two_transformers else None,
    )


def tiny_sd3_pipe(seed: int = 0):
    """A stock ``StableDiffusion3Pipeline`` (batched CFG) from tiny parts; call it with ``prompt_embeds``
    ``[B, L, 16]``, ``pooled_prompt_embeds`` ``[B, 16]`` and their negatives (no text encoders)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return pipeline(
        "StableDiffusion3Pipeline",
        transformer=tiny_sd3_transformer(seed=seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_autoencoder_kl(seed=seed, latent_channels=4, shift_factor=0.0),
        **_no_text_encoders(3),
    )


def tiny_flux_pipe(seed: int = 0):
    """A stock ``FluxPipeline`` from tiny parts; call it with ``prompt_embeds`` and ``pooled_prompt_embeds``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return pipeline(
        "FluxPipeline",
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        # shift_factor: FluxPipeline decodes with it (output_type "pil"/"pt")
        vae=tiny_autoencoder_kl(seed=seed, latent_channels=4, shift_factor=0.0),
        transformer=tiny_flux_transformer(seed=seed),
        **_no_text_encoders(2),
    )


def tiny_flux_pipe_with_text_encoders(seed: int = 0):
    """A stock ``FluxPipeline`` with tiny CLIP and T5 text encoders and in-memory tokenizers: call it with
    ``prompt=`` (lowercase letters and spaces) and ``max_sequence_length=8``.

    >>> import torch
    >>> from hfpatch.testing.models import tiny_flux_pipe_with_text_encoders
    >>> pipe = tiny_flux_pipe_with_text_encoders()
    >>> out = pipe(prompt=["a cat", "a dog"], height=16, width=16, num_inference_steps=2, max_sequence_length=8,
    ...            output_type="latent", generator=torch.Generator().manual_seed(0)).images
    >>> tuple(out.shape)
    (2, 16, 16)
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    return pipeline(
        "FluxPipeline",
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        # shift_factor: FluxPipeline decodes with it (output_type "pil"/"pt")
        vae=tiny_autoencoder_kl(seed=seed, latent_channels=4, shift_factor=0.0),
        text_encoder=tiny_clip_text_model(seed=seed),
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=tiny_t5_encoder(seed=seed),
        tokenizer_2=tiny_t5_tokenizer(),
        transformer=tiny_flux_transformer(seed=seed),
    )


def tiny_sdxl_pipe(seed: int = 0):
    """A stock ``StableDiffusionXLPipeline`` around a tiny ``UNet2DConditionModel`` (``text_time`` added
    conditioning), no text encoders: call it with ``prompt_embeds`` ``[B, L, 16]``, ``pooled_prompt_embeds``
    ``[B, 16]`` and their negatives, and 16 x 16 pixels (8 x 8 latents).

    >>> import torch
    >>> from hfpatch.testing import tiny_sdxl_pipe
    >>> pipe = tiny_sdxl_pipe()
    >>> embeds = {"prompt_embeds": torch.zeros(1, 5, 16), "pooled_prompt_embeds": torch.zeros(1, 16)}
    >>> tuple(pipe(**embeds, height=16, width=16, num_inference_steps=1, output_type="latent").images.shape)
    (1, 4, 8, 8)
    """
    from diffusers import EulerDiscreteScheduler

    return pipeline(
        "StableDiffusionXLPipeline",
        vae=tiny_autoencoder_kl(seed=seed, latent_channels=4),
        unet=tiny_model("sdxl_unet", seed),
        scheduler=EulerDiscreteScheduler(),
        **_no_text_encoders(2),
    )


def tiny_qwenimage_pipe(seed: int = 0, **transformer_overrides: Any):
    """A stock ``QwenImagePipeline`` from tiny parts, without text encoder: call it with ``prompt_embeds``
    ``[B, T, 16]`` and ``prompt_embeds_mask`` ``[B, T]`` (and their negatives for true CFG), ``height``/``width``
    multiples of 4 (the VAE's 2x and the 2x2 patches: 20 x 20 pixels are 5 x 5 tokens); packed ``latents=``
    ``[B, H*W, 16]``. Keyword arguments go to :func:`tiny_qwenimage_transformer`.

    >>> import torch
    >>> from hfpatch.testing import tiny_qwenimage_pipe
    >>> pipe = tiny_qwenimage_pipe()
    >>> out = pipe(prompt_embeds=torch.ones(1, 5, 16), prompt_embeds_mask=torch.ones(1, 5, dtype=torch.long),
    ...            height=32, width=32, num_inference_steps=2, output_type="pt",
    ...            generator=torch.Generator().manual_seed(0)).images
    >>> tuple(out.shape)
    (1, 3, 32, 32)
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    return pipeline(
        "QwenImagePipeline",
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_model("qwenimage_vae", seed),
        transformer=tiny_qwenimage_transformer(seed=seed, **transformer_overrides),
        **_no_text_encoders(1),
    )


def tiny_ltx_pipe(seed: int = 0, **transformer_overrides: Any):
    """A stock ``LTXPipeline`` (batched CFG) from tiny parts, without text encoder: call it with ``prompt_embeds``
    ``[B, T, 16]``, ``prompt_attention_mask`` ``[B, T]`` and their negatives; ``height``/``width`` multiples of 32
    (the VAE's spatial factor: 160 x 160 gives 5 x 5 latent tokens per frame), ``num_frames`` = 1 + 8k (its
    temporal factor). Latents (``latents=``) are packed ``[B, F*H*W, 8]``. Keyword arguments go to
    :func:`tiny_ltx_transformer`.

    >>> import torch
    >>> from hfpatch.testing import tiny_ltx_pipe
    >>> pipe = tiny_ltx_pipe()
    >>> out = pipe(prompt_embeds=torch.ones(1, 4, 16), prompt_attention_mask=torch.ones(1, 4, dtype=torch.long),
    ...            negative_prompt_embeds=torch.zeros(1, 4, 16),
    ...            negative_prompt_attention_mask=torch.ones(1, 4, dtype=torch.long),
    ...            height=64, width=32, num_frames=9, num_inference_steps=2, output_type="pt",
    ...            generator=torch.Generator().manual_seed(0)).frames
    >>> tuple(out.shape)
    (1, 9, 3, 64, 32)
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    return pipeline(
        "LTXPipeline",
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_model("ltx_vae", seed),
        transformer=tiny_ltx_transformer(seed=seed, **transformer_overrides),
        **_no_text_encoders(1),
    )


def tiny_hunyuanvideo_pipe(seed: int = 0, **transformer_overrides: Any):
    """A stock ``HunyuanVideoPipeline`` (true CFG with a negative prompt) from tiny parts, without text encoders:
    call it with ``prompt_embeds`` ``[B, T, 16]``, ``prompt_attention_mask`` ``[B, T]``, ``pooled_prompt_embeds``
    ``[B, 16]`` (and their negatives with ``true_cfg_scale > 1``); ``height``/``width`` multiples of 16 (the
    VAE's 8x and the 2x2 patches: 80 x 80 pixels are 5 x 5 tokens per latent frame). Keyword arguments go to
    :func:`tiny_hunyuanvideo_transformer`.

    >>> import torch
    >>> from hfpatch.testing import tiny_hunyuanvideo_pipe
    >>> pipe = tiny_hunyuanvideo_pipe()
    >>> out = pipe(prompt_embeds=torch.ones(1, 4, 16), prompt_attention_mask=torch.ones(1, 4, dtype=torch.long),
    ...            pooled_prompt_embeds=torch.ones(1, 16), height=32, width=32, num_frames=1,
    ...            num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    >>> tuple(out.shape)
    (1, 1, 3, 32, 32)
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    return pipeline(
        "HunyuanVideoPipeline",
        transformer=tiny_hunyuanvideo_transformer(seed=seed, **transformer_overrides),
        vae=tiny_model("hunyuanvideo_vae", seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        **_no_text_encoders(2),
    )


def tiny_pixart_pipe(seed: int = 0, **transformer_overrides: Any):
    """A stock ``PixArtAlphaPipeline`` (batched CFG) from tiny parts, without text encoder: call it with
    ``prompt_embeds`` ``[B, T, 16]``, ``prompt_attention_mask`` ``[B, T]``, their negatives and
    ``negative_prompt=None``; ``height``/``width`` multiples of 8 (the VAE's spatial factor is 4: 40 x 40 gives
    5 x 5 tokens of 2 x 2 latent patches) and ``use_resolution_binning=False``.

    >>> import torch
    >>> from hfpatch.testing import tiny_pixart_pipe
    >>> out = tiny_pixart_pipe()(prompt_embeds=torch.ones(1, 4, 16), prompt_attention_mask=torch.ones(1, 4),
    ...     negative_prompt=None, negative_prompt_embeds=torch.zeros(1, 4, 16),
    ...     negative_prompt_attention_mask=torch.ones(1, 4), height=40, width=40, num_inference_steps=2,
    ...     use_resolution_binning=False, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    >>> tuple(out.shape)
    (1, 3, 40, 40)
    """
    from diffusers import DPMSolverMultistepScheduler

    vae = tiny_autoencoder_kl(
        seed=seed,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 8, 16),
    )
    return pipeline(
        "PixArtAlphaPipeline",
        vae=vae,
        transformer=tiny_pixart_transformer(seed=seed, **transformer_overrides),
        scheduler=DPMSolverMultistepScheduler(),
        **_no_text_encoders(1),
    )


def tiny_hunyuandit_pipe(seed: int = 0, **transformer_overrides: Any):
    """A stock ``HunyuanDiTPipeline`` (batched CFG) from tiny parts, without text encoders: call it with
    ``prompt_embeds`` ``[B, 4, 16]`` / ``prompt_embeds_2`` ``[B, 6, 16]``, their attention masks and negatives,
    ``use_resolution_binning=False`` and ``height``/``width`` multiples of 16 (the pipeline sizes its rotary grid
    for an 8x VAE, which this one is: 80 x 80 gives 5 x 5 tokens of 2 x 2 latent patches). Its scheduler is DDIM
    (deterministic: the pipeline's default DDPM draws noise every step, so every rank would need the same
    ``generator``).

    >>> import torch
    >>> from hfpatch.testing import tiny_hunyuandit_pipe
    >>> mask = torch.ones(1, 4, dtype=torch.long)
    >>> out = tiny_hunyuandit_pipe()(prompt_embeds=torch.ones(1, 4, 16), prompt_attention_mask=mask,
    ...     negative_prompt_embeds=torch.zeros(1, 4, 16), negative_prompt_attention_mask=mask,
    ...     prompt_embeds_2=torch.ones(1, 6, 16), prompt_attention_mask_2=torch.ones(1, 6, dtype=torch.long),
    ...     negative_prompt_embeds_2=torch.zeros(1, 6, 16),
    ...     negative_prompt_attention_mask_2=torch.ones(1, 6, dtype=torch.long), height=80, width=80,
    ...     num_inference_steps=2, use_resolution_binning=False, output_type="latent").images
    >>> tuple(out.shape)
    (1, 4, 10, 10)
    """
    from diffusers import DDIMScheduler

    return pipeline(
        "HunyuanDiTPipeline",
        vae=tiny_autoencoder_kl(seed=seed, **KL_VAE_8X),
        transformer=tiny_hunyuandit_transformer(seed=seed, **transformer_overrides),
        scheduler=DDIMScheduler(clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        **_no_text_encoders(2),
    )


# ----------------------------------------------------------------------------------------------- vision-language


def tiny_qwen3_vl(
    seed: int = 0,
    vision_overrides: dict[str, Any] | None = None,
    causal_lm: bool = False,
    **text_overrides: Any,
):
    """A stock ``Qwen3VLModel`` (vision tower + text model) with tiny dims; inputs per the Qwen3-VL processor layout.

    Keyword arguments override the text config; ``vision_overrides`` the vision config. ``causal_lm=True``
    builds ``Qwen3VLForConditionalGeneration`` (the same model plus the LM head and loss).
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLModel

    text = dict(head_dim=8, rope_parameters={**_QWEN_MROPE, "mrope_interleaved": True})
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        out_hidden_size=32,
        num_position_embeddings=64,
        deepstack_visual_indexes=[1],
    )
    model_cls = Qwen3VLForConditionalGeneration if causal_lm else Qwen3VLModel
    return _tiny_qwen_vl(Qwen3VLConfig, model_cls, text, vision, text_overrides, vision_overrides, seed)


def tiny_qwen2_vl(
    seed: int = 0,
    vision_overrides: dict[str, Any] | None = None,
    causal_lm: bool = False,
    **text_overrides: Any,
):
    """A stock ``Qwen2VLModel`` (vision tower + text model) with tiny dims; inputs from :func:`qwen2_vl_inputs`.

    Same token ids and patch layout as :func:`tiny_qwen3_vl`. Keyword arguments override the text config;
    ``vision_overrides`` the vision config; ``causal_lm=True`` builds ``Qwen2VLForConditionalGeneration``.

    >>> from hfpatch.testing import qwen2_vl_inputs
    >>> model = tiny_qwen2_vl()
    >>> tuple(model(**qwen2_vl_inputs([[("image", (1, 2, 4))], []])).last_hidden_state.shape)
    (2, 8, 32)
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLModel

    # The merger maps the tower's embed_dim to hidden_size, the language model's width.
    vision = dict(embed_dim=16, hidden_size=32, mlp_ratio=2)
    model_cls = Qwen2VLForConditionalGeneration if causal_lm else Qwen2VLModel
    return _tiny_qwen_vl(
        Qwen2VLConfig, model_cls, _QWEN2_TEXT, vision, text_overrides, vision_overrides, seed
    )


def tiny_qwen2_5_vl(
    seed: int = 0,
    vision_overrides: dict[str, Any] | None = None,
    causal_lm: bool = False,
    **text_overrides: Any,
):
    """A stock ``Qwen2_5_VLModel`` (windowed vision tower + text model) with tiny dims; inputs from
    :func:`qwen2_vl_inputs` (with ``second_per_grid_ts`` for videos). ``causal_lm=True`` builds
    ``Qwen2_5_VLForConditionalGeneration``.

    The tower's first block attends within windows of 16 pixels (2x2 merged tokens, so grids wider than 4
    patches span several windows), the second over the whole image, as in the released models' mix.

    >>> from hfpatch.testing import qwen2_vl_inputs
    >>> model = tiny_qwen2_5_vl()
    >>> batch = qwen2_vl_inputs([[("video", (2, 2, 6))], []], second_per_grid_ts=[0.5])
    >>> tuple(model(**batch).last_hidden_state.shape)
    (2, 12, 32)
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLModel

    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        out_hidden_size=32,
        window_size=16,
        fullatt_block_indexes=[1],
        tokens_per_second=4,
    )
    model_cls = Qwen2_5_VLForConditionalGeneration if causal_lm else Qwen2_5_VLModel
    return _tiny_qwen_vl(
        Qwen2_5_VLConfig, model_cls, _QWEN2_TEXT, vision, text_overrides, vision_overrides, seed
    )


_QWEN_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}


_QWEN2_TEXT = dict(bos_token_id=None, eos_token_id=None, rope_parameters=_QWEN_MROPE)


def _tiny_qwen_vl(
    config_cls: type,
    model_cls: type,
    text: dict[str, Any],
    vision: dict[str, Any],
    text_overrides: dict[str, Any],
    vision_overrides: dict[str, Any] | None,
    seed: int,
):
    """A Qwen-VL family model: the shared tiny text model, vision patch layout (patch 4, temporal 2, merge 2,
    3 channels: pixel rows of 96 values) and special token ids, plus each family's own fields."""
    text = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **copy.deepcopy(
            text
        ),  # configs may normalise rope_parameters in place: keep the shared defaults intact
    )
    text.update(text_overrides)
    vision = dict(
        depth=2,
        num_heads=2,
        in_channels=3,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        **vision,
    )
    vision.update(vision_overrides or {})
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=120,
        video_token_id=121,
        vision_start_token_id=122,
        vision_end_token_id=123,
    )
    return build(model_cls, seed, config)


def qwen3_vl_inputs(
    media: list[list[tuple[str, tuple[int, int, int]]]],
    text_len: int = 3,
    seed: int = 0,
    padding: str = "left",
) -> dict[str, torch.Tensor]:
    """A Qwen3-VL processor-style batch for :func:`tiny_qwen3_vl`, built by hand (no processor, no hub).

    ``media[i]`` lists sample ``i``'s images and videos as ``("image" | "video", (t, h, w))`` patch grids
    (``h``, ``w`` even). Each image becomes ``<vision_start> + t*h*w/4 image tokens + <vision_end>``; a video
    becomes, per frame, a timestamp token and ``<vision_start> + h*w/4 video tokens + <vision_end>`` (the
    Qwen3-VL layout). Pixel rows are random ``[sum t*h*w, 3*2*4*4]``; padding id 0 on the given side.

    >>> batch = qwen3_vl_inputs([[("image", (1, 4, 4))], [], [("video", (2, 2, 2))]])
    >>> batch["pixel_values"].shape, batch["image_grid_thw"].tolist(), batch["video_grid_thw"].tolist()
    (torch.Size([16, 96]), [[1, 4, 4]], [[2, 2, 2]])
    """
    return _qwen_vl_inputs(media, text_len, seed, padding, frame_timestamps=True)


def qwen2_vl_inputs(
    media: list[list[tuple[str, tuple[int, int, int]]]],
    text_len: int = 3,
    seed: int = 0,
    padding: str = "left",
    second_per_grid_ts: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """A Qwen2-VL / Qwen2.5-VL processor-style batch for :func:`tiny_qwen2_vl` and :func:`tiny_qwen2_5_vl`.

    Same arguments and pixel layout as :func:`qwen3_vl_inputs`, but a video is one block
    ``<vision_start> + t*h*w/4 video tokens + <vision_end>`` without per-frame timestamp tokens (the
    Qwen2-VL / Qwen2.5-VL processor layout). ``second_per_grid_ts`` (Qwen2.5-VL only) gives one value per video
    in batch order, the seconds each temporal patch spans, which scale the videos' temporal M-RoPE positions.
    ``mm_token_type_ids`` is included: both models build M-RoPE positions from it (Qwen2-VL raises without it
    when media are given; Qwen2.5-VL silently falls back to 1D positions).

    >>> batch = qwen2_vl_inputs([[("video", (2, 2, 2))], [("image", (1, 2, 2))]], second_per_grid_ts=[0.5])
    >>> (batch["input_ids"] == 121).sum().item(), batch["second_per_grid_ts"].tolist()
    (2, [0.5])
    """
    batch = _qwen_vl_inputs(media, text_len, seed, padding, frame_timestamps=False)
    if second_per_grid_ts is not None:
        videos = len(batch.get("video_grid_thw", ()))
        if len(second_per_grid_ts) != videos:
            raise ValueError(
                f"second_per_grid_ts has {len(second_per_grid_ts)} values but the batch has {videos} videos; "
                "give one value per video, in batch order."
            )
        if videos:  # like the processor: no video, no key
            batch["second_per_grid_ts"] = torch.tensor(second_per_grid_ts, dtype=torch.float32)
    return batch


def _qwen_vl_inputs(
    media: list[list[tuple[str, tuple[int, int, int]]]],
    text_len: int,
    seed: int,
    padding: str,
    frame_timestamps: bool,
) -> dict[str, torch.Tensor]:
    """The shared builder: ``frame_timestamps`` selects the Qwen3-VL video layout (one timestamp token and
    vision block per frame) over the Qwen2-VL one (one vision block per video)."""
    image_id, video_id, start_id, end_id, merge2, patch_dim = 120, 121, 122, 123, 4, 3 * 2 * 4 * 4
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(1, 100, (n,), generator=gen).tolist()

    seqs, grids = [], {"image": [], "video": []}
    for items in media:
        seq = text(text_len)
        for kind, (t, h, w) in items:
            grids[kind].append([t, h, w])
            if kind == "image":
                seq += [start_id] + [image_id] * (t * h * w // merge2) + [end_id]
            elif frame_timestamps:
                for _ in range(t):
                    seq += text(1) + [start_id] + [video_id] * (h * w // merge2) + [end_id]
            else:
                seq += [start_id] + [video_id] * (t * h * w // merge2) + [end_id]
            seq += text(1)
        seqs.append(seq)
    length = max(map(len, seqs))
    input_ids = torch.zeros(len(seqs), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, seq in enumerate(seqs):
        span = slice(length - len(seq), length) if padding == "left" else slice(0, len(seq))
        input_ids[i, span] = torch.tensor(seq)
        attention_mask[i, span] = 1
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": (input_ids == image_id).long() + 2 * (input_ids == video_id).long(),
    }
    for kind, grid_key, pixel_key in (
        ("image", "image_grid_thw", "pixel_values"),
        ("video", "video_grid_thw", "pixel_values_videos"),
    ):
        if grids[kind]:
            grid = torch.tensor(grids[kind])
            batch[grid_key] = grid
            batch[pixel_key] = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=gen)
    return batch
