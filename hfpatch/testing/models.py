"""Tiny random-weight stock models for tests, demos and examples (CPU, no hub, well under a second).

Every factory seeds its own generator, so the same call gives the same weights on every rank.

>>> from hfpatch.testing import tiny_wan_transformer
>>> tiny_wan_transformer().config.num_attention_heads
4
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = [
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


def _seeded(seed: int):
    class _Seed:
        def __enter__(self):
            self.state = torch.random.get_rng_state()
            torch.manual_seed(seed)

        def __exit__(self, *exc):
            torch.random.set_rng_state(self.state)

    return _Seed()


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw every parameter (some HF inits are zeros, which would hide bugs) deterministically."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return model.eval()


def _build(model_cls: type, config: dict[str, Any], overrides: dict[str, Any], seed: int) -> Any:
    """``model_cls(**config, **overrides)`` with seeded construction and re-drawn weights (see :func:`_randomize`)."""
    with _seeded(seed):
        return _randomize(model_cls(**{**config, **overrides}), seed)


def tiny_wan_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``WanTransformer3DModel`` (Wan 2.1 layout; ``image_dim``/``added_kv_proj_dim`` via overrides)."""
    from diffusers import WanTransformer3DModel

    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    return _build(WanTransformer3DModel, config, overrides, seed)


def tiny_wan_vae(version: str = "2.1", seed: int = 0, **overrides: Any):
    """A stock ``AutoencoderKLWan``: ``"2.1"`` (causal 3D, 8x spatial) or ``"2.2"`` (patchify, residual up/down)."""
    from diffusers import AutoencoderKLWan

    if version == "2.1":
        config = dict(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        )
    elif version == "2.2":
        config = dict(
            base_dim=8,
            decoder_base_dim=8,
            z_dim=4,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            is_residual=True,
            patch_size=2,
            in_channels=12,
            out_channels=12,
            scale_factor_spatial=16,
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        )
    else:
        raise ValueError(f"version must be '2.1' or '2.2', got {version!r}")
    return _build(AutoencoderKLWan, config, overrides, seed)


def tiny_autoencoder_kl(seed: int = 0, **overrides: Any):
    """A stock 2D ``AutoencoderKL`` (two resolutions, GroupNorm, mid-block attention), 2x spatial factor."""
    from diffusers import AutoencoderKL

    config = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
    )
    return _build(AutoencoderKL, config, overrides, seed)


def tiny_flux_transformer(num_heads: int = 4, head_dim: int = 8, seed: int = 0, **overrides: Any):
    """A stock ``FluxTransformer2DModel`` with one double and one single block."""
    from diffusers import FluxTransformer2DModel

    config = dict(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=head_dim,
        num_attention_heads=num_heads,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(2, 2, 4),
    )
    return _build(FluxTransformer2DModel, config, overrides, seed)


def tiny_sd3_transformer(num_heads: int = 4, head_dim: int = 8, seed: int = 0, **overrides: Any):
    """A stock ``SD3Transformer2DModel`` with two joint blocks."""
    from diffusers import SD3Transformer2DModel

    config = dict(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=head_dim,
        num_attention_heads=num_heads,
        joint_attention_dim=16,
        caption_projection_dim=num_heads * head_dim,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=32,
    )
    return _build(SD3Transformer2DModel, config, overrides, seed)


def wan_prompt_embeds(batch: int = 1, length: int = 6, text_dim: int = 16, seed: int = 1) -> torch.Tensor:
    """Random text-encoder outputs shaped like UMT5's, for running a tiny Wan pipeline without a tokenizer."""
    return torch.randn(batch, length, text_dim, generator=torch.Generator().manual_seed(seed))


def tiny_wan_pipe(seed: int = 0, two_transformers: bool = False):
    """A stock ``WanPipeline`` from tiny parts; call it with ``prompt_embeds``/``negative_prompt_embeds``.

    >>> import torch
    >>> from hfpatch.testing import tiny_wan_pipe, wan_prompt_embeds
    >>> pipe = tiny_wan_pipe()
    >>> out = pipe(prompt_embeds=wan_prompt_embeds(), negative_prompt_embeds=wan_prompt_embeds(seed=2),
    ...            height=32, width=32, num_frames=5, num_inference_steps=2, output_type="pt",
    ...            generator=torch.Generator().manual_seed(0)).frames
    >>> tuple(out.shape)
    (1, 5, 3, 32, 32)
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    transformer = tiny_wan_transformer(seed=seed)
    transformer_2 = tiny_wan_transformer(seed=seed + 100) if two_transformers else None
    vae = tiny_wan_vae("2.1", seed=seed)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=0.5 if two_transformers else None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sd3_pipe(seed: int = 0):
    """A stock ``StableDiffusion3Pipeline`` (batched CFG) from tiny parts; call it with ``prompt_embeds``
    ``[B, L, 16]``, ``pooled_prompt_embeds`` ``[B, 16]`` and their negatives (no text encoders)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(
        transformer=tiny_sd3_transformer(seed=seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_autoencoder_kl(seed=seed, latent_channels=4, shift_factor=0.0),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_flux_pipe(seed: int = 0):
    """A stock ``FluxPipeline`` from tiny parts; call it with ``prompt_embeds`` and ``pooled_prompt_embeds``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        # shift_factor: FluxPipeline decodes with it (output_type "pil"/"pt")
        vae=tiny_autoencoder_kl(seed=seed, latent_channels=4, shift_factor=0.0),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=tiny_flux_transformer(seed=seed),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


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


# head_dim 8 has 4 rotary frequencies, split over the (t, h, w) M-RoPE axes.
_QWEN_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
# Qwen2-VL / Qwen2.5-VL: head_dim = hidden / heads = 8; the released bos/eos ids lie outside the tiny vocabulary.
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
    with _seeded(seed):
        return _randomize(model_cls(config), seed)


_TINY_TEXT_LM = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def tiny_qwen3_causal_lm(seed: int = 0, **overrides: Any):
    """A stock ``Qwen3ForCausalLM`` (qk-norm, grouped-query attention: 4 query / 2 key-value heads of 8) with tiny dims.

    >>> import torch
    >>> tuple(tiny_qwen3_causal_lm()(input_ids=torch.tensor([[1, 2, 3]])).logits.shape)
    (1, 3, 128)
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with _seeded(seed):
        return _randomize(Qwen3ForCausalLM(Qwen3Config(**{**_TINY_TEXT_LM, **overrides})), seed)


def tiny_llama_causal_lm(seed: int = 0, **overrides: Any):
    """A stock ``LlamaForCausalLM`` (grouped-query attention: 4 query / 2 key-value heads of 8) with tiny dims.

    >>> import torch
    >>> tuple(tiny_llama_causal_lm()(input_ids=torch.tensor([[1, 2, 3]])).logits.shape)
    (1, 3, 128)
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    with _seeded(seed):
        return _randomize(LlamaForCausalLM(LlamaConfig(**{**_TINY_TEXT_LM, **overrides})), seed)


def tiny_bert(seed: int = 0, dropout: float = 0.0, **overrides: Any):
    """A stock ``BertModel`` text encoder (no pooler) with tiny dims; ``dropout`` sets hidden and attention dropout.

    >>> import torch
    >>> from hfpatch.testing import tiny_bert
    >>> tuple(tiny_bert()(input_ids=torch.tensor([[1, 2, 3]])).last_hidden_state.shape)
    (1, 3, 32)
    """
    from transformers import BertConfig, BertModel

    config = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    config.update(overrides)
    with _seeded(seed):
        return _randomize(BertModel(BertConfig(**config), add_pooling_layer=False), seed)


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


def tiny_cogvideox_transformer(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``CogVideoXTransformer3DModel`` (5B layout: rotary positions, given as ``image_rotary_emb``).

    ``head_dim`` 16 leaves the 3D rotary table of ``diffusers.models.embeddings.get_3d_rotary_pos_embed``
    even sizes per axis (4 for time, 6 each for height and width).
    """
    from diffusers import CogVideoXTransformer3DModel

    config = dict(
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        in_channels=4,
        out_channels=4,
        time_embed_dim=16,
        text_embed_dim=16,
        num_layers=num_layers,
        sample_width=8,
        sample_height=8,
        sample_frames=9,
        patch_size=2,
        max_text_seq_length=8,
        use_rotary_positional_embeddings=True,
    )
    return _build(CogVideoXTransformer3DModel, config, overrides, seed)


_TOKEN_CHARS = "abcdefghijklmnopqrstuvwxyz"


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


def tiny_clip_text_model(seed: int = 0, **overrides: Any):
    """A stock ``CLIPTextModel`` (hidden 16, 8 positions) matching :func:`tiny_clip_tokenizer`'s vocabulary."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = dict(
        vocab_size=2 + 2 * len(_TOKEN_CHARS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=8,
        projection_dim=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    config.update(overrides)
    with _seeded(seed):
        return _randomize(CLIPTextModel(CLIPTextConfig(**config)), seed)


def tiny_t5_encoder(seed: int = 0, **overrides: Any):
    """A stock ``T5EncoderModel`` (d_model 16) matching :func:`tiny_t5_tokenizer`'s vocabulary."""
    from transformers import T5Config, T5EncoderModel

    config = dict(
        vocab_size=4 + 2 * len(_TOKEN_CHARS),
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
    )
    config.update(overrides)
    with _seeded(seed):
        return _randomize(T5EncoderModel(T5Config(**config)), seed)


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
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        # shift_factor: FluxPipeline decodes with it (output_type "pil"/"pt")
        vae=tiny_autoencoder_kl(seed=seed, latent_channels=4, shift_factor=0.0),
        text_encoder=tiny_clip_text_model(seed=seed),
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=tiny_t5_encoder(seed=seed),
        tokenizer_2=tiny_t5_tokenizer(),
        transformer=tiny_flux_transformer(seed=seed),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_qwenimage_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``QwenImageTransformer2DModel`` (dual-stream joint attention, text mask, complex rotary).

    Call it with packed latents ``hidden_states`` ``[B, F*H*W, 16]``, ``img_shapes=[[(F, H, W)]] * B`` and text
    ``encoder_hidden_states`` ``[B, T, 16]`` (optionally ``encoder_hidden_states_mask`` ``[B, T]``).
    """
    from diffusers import QwenImageTransformer2DModel

    config = dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=num_layers,
        attention_head_dim=head_dim,
        num_attention_heads=num_heads,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
    )
    return _build(QwenImageTransformer2DModel, config, overrides, seed)


def tiny_flux2_transformer(num_heads: int = 4, head_dim: int = 8, seed: int = 0, **overrides: Any):
    """A stock ``Flux2Transformer2DModel`` with one double-stream and one single-stream block.

    Call it with ``hidden_states`` ``[B, S, 16]``, ``encoder_hidden_states`` ``[B, T, 16]``, ``img_ids`` and
    ``txt_ids`` (``[B, S, 4]``/``[B, T, 4]`` or 2D) and ``timestep`` in ``[0, 1]``.
    """
    from diffusers import Flux2Transformer2DModel

    config = dict(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=head_dim,
        num_attention_heads=num_heads,
        joint_attention_dim=16,
        timestep_guidance_channels=16,
        axes_dims_rope=(2, 2, 2, 2),
        guidance_embeds=False,
    )
    return _build(Flux2Transformer2DModel, config, overrides, seed)


def tiny_ltx_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``LTXVideoTransformer3DModel`` (video self-attention with rotary, cross-attention to text).

    Call it with ``hidden_states`` ``[B, F*H*W, 8]``, ``encoder_hidden_states`` ``[B, T, 16]``,
    ``encoder_attention_mask`` ``[B, T]``, ``timestep`` (``[B]``, or ``[B, F*H*W]`` per token) and
    ``num_frames``/``height``/``width``.
    """
    from diffusers import LTXVideoTransformer3DModel

    config = dict(
        in_channels=8,
        out_channels=8,
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        cross_attention_dim=num_heads * head_dim,
        num_layers=num_layers,
        caption_channels=16,
    )
    return _build(LTXVideoTransformer3DModel, config, overrides, seed)


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
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    vae = _build(
        AutoencoderKLQwenImage,
        dict(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 2],
            num_res_blocks=1,
            temperal_downsample=[False],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        ),
        {},
        seed,
    )
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=tiny_qwenimage_transformer(seed=seed, **transformer_overrides),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline

    vae = _build(
        AutoencoderKLLTXVideo,
        dict(
            in_channels=3,
            out_channels=3,
            latent_channels=8,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, True, False),
            decoder_spatio_temporal_scaling=(True, True, True, False),
            decoder_inject_noise=(False, False, False, False, False),
            upsample_residual=(False, False, False, False),
            upsample_factor=(1, 1, 1, 1),
            timestep_conditioning=False,
            patch_size=4,
            patch_size_t=1,
            encoder_causal=True,
            decoder_causal=False,
        ),
        {},
        seed,
    )
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=tiny_ltx_transformer(seed=seed, **transformer_overrides),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline

    vae = tiny_autoencoder_kl(
        seed=seed,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 8, 16),
    )
    pipe = PixArtAlphaPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        transformer=tiny_pixart_transformer(seed=seed, **transformer_overrides),
        scheduler=DPMSolverMultistepScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
    from diffusers import DDIMScheduler, HunyuanDiTPipeline

    vae = tiny_autoencoder_kl(
        seed=seed,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 16),
    )
    pipe = HunyuanDiTPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=tiny_hunyuandit_transformer(seed=seed, **transformer_overrides),
        scheduler=DDIMScheduler(clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        text_encoder_2=None,
        tokenizer_2=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_chronoedit_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``ChronoEditTransformer3DModel`` (Wan 2.1 I2V layout: cross-attention to text and image keys).

    Call it with ``hidden_states`` ``[B, 4, F, H, W]`` (patch 1x2x2; ``F = 2`` takes ChronoEdit's temporal-skip
    rotary path), ``timestep`` ``[B]``, ``encoder_hidden_states`` ``[B, T, 16]`` and
    ``encoder_hidden_states_image`` ``[B, I, 16]``.
    """
    from diffusers import ChronoEditTransformer3DModel

    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        image_dim=16,
        added_kv_proj_dim=num_heads * head_dim,
        rope_max_seq_len=64,
        rope_temporal_skip_len=8,
    )
    return _build(ChronoEditTransformer3DModel, config, overrides, seed)


def tiny_wan_vace_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``WanVACETransformer3DModel``: :func:`tiny_wan_transformer`'s layout plus a VACE block per layer.

    Call it like the Wan transformer plus ``control_hidden_states`` ``[B, 8, F, H, W]`` (the latent's frames and
    size) and optionally ``control_hidden_states_scale`` ``[num_layers]``.
    """
    from diffusers import WanVACETransformer3DModel

    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
        vace_layers=list(range(num_layers)),
        vace_in_channels=8,
    )
    return _build(WanVACETransformer3DModel, config, overrides, seed)


def tiny_hunyuanvideo_transformer(num_heads: int = 4, head_dim: int = 8, seed: int = 0, **overrides: Any):
    """A stock ``HunyuanVideoTransformer3DModel`` (text-to-video) with one dual- and one single-stream block.

    Call it with ``hidden_states`` ``[B, 4, F, H, W]`` (patch 1x2x2), ``timestep`` ``[B]``,
    ``encoder_hidden_states`` ``[B, T, 16]``, ``encoder_attention_mask`` ``[B, T]`` (a prefix of ones) and
    ``pooled_projections`` ``[B, 16]``.
    """
    from diffusers import HunyuanVideoTransformer3DModel

    config = dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        guidance_embeds=False,
        text_embed_dim=16,
        pooled_projection_dim=16,
        rope_axes_dim=(2, 2, 4),
    )
    return _build(HunyuanVideoTransformer3DModel, config, overrides, seed)


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
    from diffusers import HunyuanDiT2DModel

    config = dict(
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        in_channels=4,
        patch_size=2,
        sample_size=8,
        hidden_size=num_heads * head_dim,
        num_layers=num_layers,
        mlp_ratio=2.0,
        learn_sigma=True,
        cross_attention_dim=16,
        cross_attention_dim_t5=16,
        pooled_projection_dim=16,
        text_len=4,
        text_len_t5=6,
        use_style_cond_and_image_meta_size=False,
    )
    return _build(HunyuanDiT2DModel, config, overrides, seed)


def tiny_pixart_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``PixArtTransformer2DModel`` (PixArt-alpha/sigma layout: ``ada_norm_single``, learned-sigma output).

    Call it with ``hidden_states`` ``[B, 4, H, W]`` (patch 2; the sin-cos positions follow the input size),
    ``encoder_hidden_states`` ``[B, T, 16]``, ``encoder_attention_mask`` ``[B, T]`` and ``timestep`` ``[B]``.

    >>> tiny_pixart_transformer().config.out_channels
    8
    """
    from diffusers import PixArtTransformer2DModel

    config = dict(
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        in_channels=4,
        out_channels=8,
        num_layers=num_layers,
        cross_attention_dim=num_heads * head_dim,
        sample_size=8,
        patch_size=2,
        caption_channels=16,
        use_additional_conditions=False,
    )
    return _build(PixArtTransformer2DModel, config, overrides, seed)


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
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

    vae = _build(
        AutoencoderKLHunyuanVideo,
        dict(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
            mid_block_add_attention=True,
        ),
        {},
        seed,
    )
    pipe = HunyuanVideoPipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=tiny_hunyuanvideo_transformer(seed=seed, **transformer_overrides),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    config = dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        cross_attention_dim=16,
        norm_num_groups=8,
        addition_embed_type="text_time",
        addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=16 + 6 * 4,  # pooled text + 6 time ids of 4 channels
    )
    pipe = StableDiffusionXLPipeline(
        vae=tiny_autoencoder_kl(seed=seed, latent_channels=4),
        text_encoder=None,
        text_encoder_2=None,
        tokenizer=None,
        tokenizer_2=None,
        unet=_build(UNet2DConditionModel, config, {}, seed),
        scheduler=EulerDiscreteScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_hunyuanvideo15_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``HunyuanVideo15Transformer3DModel`` (HunyuanVideo 1.5: dual-stream blocks, video and text joined).

    Call it with ``hidden_states`` ``[B, 4, F, H, W]`` (patch 1x1x1: ``F*H*W`` tokens), ``timestep`` ``[B]``,
    ``encoder_hidden_states`` ``[B, T, 16]`` with ``encoder_attention_mask`` ``[B, T]``,
    ``encoder_hidden_states_2`` ``[B, T2, 16]`` with ``encoder_attention_mask_2`` ``[B, T2]`` (the ByT5 text) and
    ``image_embeds`` ``[B, N, 16]`` (all zeros: text-to-video, the image tokens masked).
    """
    from diffusers import HunyuanVideo15Transformer3DModel

    config = dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        num_layers=num_layers,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,
        text_embed_2_dim=16,
        image_embed_dim=16,
        rope_axes_dim=(2, 2, 4),
    )
    return _build(HunyuanVideo15Transformer3DModel, config, overrides, seed)


def tiny_ltx2_transformer(
    num_heads: int = 4, head_dim: int = 8, num_layers: int = 2, seed: int = 0, **overrides: Any
):
    """A stock ``LTX2VideoTransformer3DModel`` (LTX-2: video and audio streams, audio-video cross-attention).

    Call it with ``hidden_states`` ``[B, F*H*W, 8]``, ``audio_hidden_states`` ``[B, A, 8]``,
    ``encoder_hidden_states`` and ``audio_encoder_hidden_states`` ``[B, T, 16]``, ``encoder_attention_mask``
    ``[B, T]``, ``timestep`` ``[B]`` (or ``[B, F*H*W]`` per token, with ``audio_timestep`` ``[B]``),
    ``num_frames``/``height``/``width`` and ``audio_num_frames=A``. The audio stream has 2 heads of 8.
    """
    from diffusers import LTX2VideoTransformer3DModel

    config = dict(
        in_channels=8,
        out_channels=8,
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        cross_attention_dim=num_heads * head_dim,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=num_layers,
        caption_channels=16,
    )
    return _build(LTX2VideoTransformer3DModel, config, overrides, seed)


def tiny_minimax_h3_transformer(num_heads: int = 4, head_dim: int = 12, seed: int = 0, **overrides: Any):
    """A stock ``MiniMaxH3Transformer3DModel`` (one packed sequence of video, text and audio rows).

    Call it with ``hidden_states`` ``[B, V, 8]`` (patch 1x2x2 of 2 channels), ``audio_hidden_states``
    ``[B, A, 8]``, ``encoder_hidden_states`` ``[B, T, 16]``, ``timestep`` (the distinct noise levels),
    per-row ``timestep_indices``, ``token_tags`` (0 video, 1 text, 2 audio) and ``position_ids`` ``[S, 3]``,
    and the rows of each modality in the packed sequence (``video_indices``, ``audio_indices``,
    ``text_indices``; ``S = V + A + T``).
    """
    from diffusers import MiniMaxH3Transformer3DModel

    hidden = num_heads * head_dim
    config = dict(
        num_attention_heads=num_heads,
        attention_head_dim=head_dim,
        hidden_size=hidden,
        num_layers=2,
        num_refiner_layers=1,
        ffn_dim=2 * hidden,
        in_channels=2,
        audio_in_channels=8,
        text_dim=16,
        freq_dim=16,
        time_embed_hidden_dim=hidden,
        time_embed_dim=16,
        rope_freq_dim=head_dim // 6,
    )
    return _build(MiniMaxH3Transformer3DModel, config, overrides, seed)
