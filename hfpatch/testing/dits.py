"""Tiny stock diffusers DiT transformers described as data: one row per class, one builder.

A row (:class:`TinyDiT`) names the diffusers class, the constructor arguments of a tiny random-weight model
(4 heads of 8 channels, one or two blocks of each kind) and example ``forward`` arguments: tensors are described by
small specs (:class:`Randn`, :class:`Grid`, :class:`Tensor`), every other value is passed as it is.
:func:`tiny_dit` builds the model (seeded construction, every parameter re-drawn by the module it belongs to:
normalisation scales around 1, everything else ``N(0, std^2)``; some inits are zeros, which would hide bugs),
:func:`tiny_dit_inputs` the arguments. The rows use 25 image/video tokens (5 x 5) where the
model allows it, so no world size of 2-4 divides them and every sequence split pads.

>>> from hfpatch.testing.dits import TINY_DITS, tiny_dit, tiny_dit_inputs
>>> model = tiny_dit("chroma")
>>> type(model).__name__, model.config.num_attention_heads
('ChromaTransformer2DModel', 4)
>>> tuple(model(**tiny_dit_inputs("chroma")).sample.shape)
(1, 25, 16)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .models import KL_VAE_8X, build, pipeline, redraw_by_module

__all__ = [
    "TINY_DITS",
    "TINY_DIT_PIPES",
    "Grid",
    "Randn",
    "Tensor",
    "TinyDiT",
    "TinyDiTPipe",
    "tiny_dit",
    "tiny_dit_inputs",
    "tiny_dit_pipe",
    "tiny_dit_pipe_inputs",
    "split_gradients",
]


# ----------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class Randn:
    """A standard-normal tensor of ``shape`` (its generator seeded from the row's seed and its position)."""

    shape: tuple[int, ...]


@dataclass(frozen=True)
class Grid:
    """Position ids ``[prod(sizes), len(lead) + len(sizes)]`` (float): constant ``lead`` columns, then the
    row-major coordinates of a grid of ``sizes`` (Flux-style ``img_ids``). ``batch`` prepends a batch dim."""

    sizes: tuple[int, ...]
    lead: tuple[float, ...] = (0.0,)
    batch: int | None = None


@dataclass(frozen=True)
class Tensor:
    """``torch.tensor(value, dtype=dtype)`` (masks, timesteps)."""

    value: Any
    dtype: str = "float32"


@dataclass(frozen=True)
class TinyDiT:
    """A tiny random-weight stock DiT and example inputs.

    Args:
        cls: The diffusers class name (``diffusers.<cls>``).
        config: Constructor arguments.
        inputs: ``forward`` keyword arguments: :class:`Randn`/:class:`Grid`/:class:`Tensor` specs, a list of
            specs (a list of tensors), or plain values passed as they are.
        tokens: Image/video tokens the sequence plan cuts (the sharded sequence's length).
        routed: Attention modules hfpatch's sequence parallelism routes in this tiny model.
        calls: Routed attention calls each of them makes per forward (Mochi's: one per sample).
        mask: An input whose value changes the output (a padded-text mask): tests check that it does.
        unmasked: That input's value with nothing masked (a spec; default: all ones).
        attributes: ``"module.path.attribute"`` -> value, set after construction (``*`` matches one path segment).
        rounds_inside: The dtype name the stock code rounds to between fp32 operations (Kandinsky 5's rotary
            rounds q/k to ``"bfloat16"``): tests add the envelope of the flips of those roundings
            (:func:`~hfpatch.testing.tolerance.stochastic_rounding_noise`) to the smooth part's tolerance (the fp64
            twin's noise :func:`~hfpatch.testing.tolerance.without_inside_rounding`), which shows them only by chance.
    """

    cls: str
    config: Mapping[str, Any]
    inputs: Mapping[str, Any]
    tokens: int = 25
    routed: int = 2
    calls: int = 1
    mask: str | None = None
    unmasked: Any = None
    attributes: Mapping[str, Any] = field(default_factory=dict)
    rounds_inside: str | None = None


def _make(spec: Any, seed: int) -> Any:
    if isinstance(spec, Randn):
        return torch.randn(*spec.shape, generator=torch.Generator().manual_seed(seed))
    if isinstance(spec, Grid):
        axes = torch.meshgrid(*(torch.arange(n) for n in spec.sizes), indexing="ij")
        coords = torch.stack(axes, -1).reshape(math.prod(spec.sizes), len(spec.sizes)).float()
        lead = torch.tensor(spec.lead, dtype=torch.float32).expand(coords.shape[0], len(spec.lead))
        ids = torch.cat([lead, coords], dim=1)
        return ids if spec.batch is None else ids.expand(spec.batch, *ids.shape).clone()
    if isinstance(spec, Tensor):
        return torch.tensor(spec.value, dtype=getattr(torch, spec.dtype))
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, (Randn, Grid, Tensor)) for s in spec):
        return type(spec)(_make(s, seed * 100 + i) for i, s in enumerate(spec))
    return spec


# ----------------------------------------------------------------------------------------------- rows
#: Flux-like image models: one dual- and one single-stream block, 4 heads of 8, 16 input channels, 2x2x4 rope.
_FLUX_LIKE = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=16,
    axes_dims_rope=(2, 2, 4),
)
#: Their inputs: 5 x 5 = 25 packed image tokens, 7 text tokens, 2D ids.
_FLUX_INPUTS = dict(
    hidden_states=Randn((1, 25, 16)),
    encoder_hidden_states=Randn((1, 7, 16)),
    timestep=Tensor([0.7]),
    img_ids=Grid((5, 5)),
    txt_ids=Tensor([[0.0, 0.0, 0.0]] * 7),
)

#: name -> row. Names are what the tests and :func:`tiny_dit` take.
TINY_DITS: dict[str, TinyDiT] = {
    "chroma": TinyDiT(
        "ChromaTransformer2DModel",
        {
            **_FLUX_LIKE,
            "approximator_num_channels": 8,
            "approximator_hidden_dim": 16,
            "approximator_layers": 1,
        },
        _FLUX_INPUTS,
    ),
    "bria": TinyDiT("BriaTransformer2DModel", _FLUX_LIKE, {**_FLUX_INPUTS, "timestep": Tensor([700.0])}),
    "bria_fibo": TinyDiT(
        "BriaFiboTransformer2DModel",
        {**_FLUX_LIKE, "text_encoder_dim": 16},
        {**_FLUX_INPUTS, "timestep": Tensor([700.0]), "text_encoder_layers": [Randn((1, 7, 16))] * 2},
    ),
    "longcat_image": TinyDiT(
        "LongCatImageTransformer2DModel", {**_FLUX_LIKE, "pooled_projection_dim": 16}, _FLUX_INPUTS
    ),
    "ovis_image": TinyDiT("OvisImageTransformer2DModel", {**_FLUX_LIKE, "out_channels": 16}, _FLUX_INPUTS),
    "chroma_mask": TinyDiT(  # a boolean key mask over [text, image], padded text (the joint split of the mask)
        "ChromaTransformer2DModel",
        {
            **_FLUX_LIKE,
            "approximator_num_channels": 8,
            "approximator_hidden_dim": 16,
            "approximator_layers": 1,
        },
        {**_FLUX_INPUTS, "attention_mask": Tensor([[True] * 5 + [False] * 2 + [True] * 25], "bool")},
        mask="attention_mask",
    ),
    "flux3": TinyDiT(
        "Flux3Transformer2DModel",
        dict(
            in_channels=16,
            cond_in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=16,
            timestep_channels=16,
            axes_dims_rope=(2, 2, 2, 2),
        ),
        {
            **_FLUX_INPUTS,
            "img_ids": Grid((5, 5), lead=(0.0, 0.0)),
            "txt_ids": Grid((7,), lead=(0.0, 0.0, 0.0)),
        },
    ),
    "skyreels_v2": TinyDiT(  # 2 x 5 x 5 = 50 video tokens, batch 2
        "SkyReelsV2Transformer3DModel",
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=4,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=64,
        ),
        dict(
            hidden_states=Randn((2, 4, 2, 10, 10)),
            timestep=Tensor([500, 20], "long"),
            encoder_hidden_states=Randn((2, 6, 16)),
        ),
        tokens=50,
    ),
    "hunyuanimage": TinyDiT(  # 5 x 5 = 25 image tokens, batch 2, padded text
        "HunyuanImageTransformer2DModel",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=8,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=(2, 2),
            text_embed_dim=16,
            rope_axes_dim=(4, 4),
        ),
        dict(
            hidden_states=Randn((2, 4, 10, 10)),
            timestep=Tensor([500.0, 20.0]),
            encoder_hidden_states=Randn((2, 6, 16)),
            encoder_attention_mask=Tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], "long"),
        ),
        mask="encoder_attention_mask",
    ),
    "cogview4": TinyDiT(  # 5 x 5 = 25 image tokens, 6 text tokens
        "CogView4Transformer2DModel",
        dict(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            text_embed_dim=16,
            time_embed_dim=16,
            condition_dim=8,
            rope_axes_dim=(16, 16),
        ),
        dict(
            hidden_states=Randn((1, 4, 10, 10)),
            encoder_hidden_states=Randn((1, 6, 16)),
            timestep=Tensor([300.0]),
            original_size=Tensor([[40.0, 40.0]]),
            target_size=Tensor([[40.0, 40.0]]),
            crop_coords=Tensor([[0.0, 0.0]]),
        ),
    ),
    "ernie_image": TinyDiT(  # 5 x 5 = 25 image tokens, batch 2, padded text (text_lens)
        "ErnieImageTransformer2DModel",
        dict(
            hidden_size=32,
            num_attention_heads=4,
            num_layers=2,
            ffn_hidden_size=32,
            in_channels=4,
            out_channels=4,
            patch_size=2,
            text_in_dim=16,
            rope_axes_dim=(2, 2, 4),
        ),
        dict(
            hidden_states=Randn((2, 4, 10, 10)),
            timestep=Tensor([500.0, 20.0]),
            text_bth=Randn((2, 6, 16)),
            text_lens=Tensor([4, 6], "long"),
        ),
        mask="text_lens",
        unmasked=Tensor([6, 6], "long"),
    ),
    "krea2": TinyDiT(  # 5 x 5 = 25 image tokens, batch 2, a stack of 2 text layers, padded text
        "Krea2Transformer2DModel",
        dict(
            in_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=32,
            timestep_embed_dim=16,
            text_hidden_dim=16,
            num_text_layers=2,
            text_num_attention_heads=2,
            text_num_key_value_heads=2,
            text_intermediate_size=16,
            num_layerwise_text_blocks=1,
            num_refiner_text_blocks=1,
            axes_dims_rope=(2, 2, 4),
        ),
        dict(
            hidden_states=Randn((2, 25, 16)),
            encoder_hidden_states=Randn((2, 6, 2, 16)),
            timestep=Tensor([0.7, 0.2]),
            position_ids=Tensor(
                [[i, 0, 0] for i in range(6)] + [[6, h, w] for h in range(5) for w in range(5)], "long"
            ),
            encoder_attention_mask=Tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], "bool"),
        ),
        mask="encoder_attention_mask",
    ),
    "glm_image": TinyDiT(  # 5 x 5 = 25 image tokens, 6 text tokens, per-token prior tokens
        "GlmImageTransformer2DModel",
        dict(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            text_embed_dim=16,
            time_embed_dim=16,
            condition_dim=8,
            prior_vq_quantizer_codebook_size=11,
        ),
        dict(
            hidden_states=Randn((1, 4, 10, 10)),
            encoder_hidden_states=Randn((1, 6, 16)),
            prior_token_id=Tensor([[(7 * i) % 11 for i in range(25)]], "long"),
            prior_token_drop=Tensor([False], "bool"),
            timestep=Tensor([300.0]),
            target_size=Tensor([[40.0, 40.0]]),
            crop_coords=Tensor([[0.0, 0.0]]),
        ),
    ),
    "zimage": TinyDiT(  # batch 2: 5 x 5 image tokens padded to 32, captions of 6 and 40 (padded to 32 and 64)
        "ZImageTransformer2DModel",
        dict(
            in_channels=4,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=4,
            n_kv_heads=4,
            cap_feat_dim=16,
            axes_dims=[2, 2, 4],
            axes_lens=[128, 16, 16],
        ),
        dict(
            x=[Randn((4, 1, 10, 10)), Randn((4, 1, 10, 10))],
            t=Tensor([0.7, 0.2]),
            cap_feats=[Randn((6, 16)), Randn((40, 16))],
        ),
        tokens=32,
        routed=3,
    ),
    "lumina2": TinyDiT(  # 5 x 5 = 25 image tokens, batch 2, prompts padded to 6 (4 valid tokens each)
        "Lumina2Transformer2DModel",
        dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            hidden_size=32,
            num_layers=2,
            num_refiner_layers=1,
            num_attention_heads=4,
            num_kv_heads=2,
            multiple_of=16,
            axes_dim_rope=(2, 2, 4),
            axes_lens=(32, 16, 16),
            cap_feat_dim=16,
        ),
        dict(
            hidden_states=Randn((2, 4, 10, 10)),
            timestep=Tensor([0.7, 0.2]),
            encoder_hidden_states=Randn((2, 6, 16)),
            encoder_attention_mask=Tensor([[1, 1, 1, 1, 0, 0]] * 2, "long"),
        ),
        routed=3,  # the noise refiner's attention and the two main layers'
        mask="encoder_attention_mask",
    ),
    "prx": TinyDiT(  # 5 x 5 = 25 image tokens, batch 2, padded text (keys only)
        "PRXTransformer2DModel",
        dict(
            in_channels=4,
            patch_size=2,
            context_in_dim=16,
            hidden_size=32,
            mlp_ratio=2.0,
            num_heads=4,
            depth=2,
            axes_dim=[4, 4],
        ),
        dict(
            hidden_states=Randn((2, 4, 10, 10)),
            timestep=Tensor([0.7, 0.2]),
            encoder_hidden_states=Randn((2, 6, 16)),
            attention_mask=Tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], "bool"),
        ),
        mask="attention_mask",
    ),
    "joyimage_edit": TinyDiT(  # 2 items of 1 x 5 x 5 = 50 tokens (an edit: target and reference), 6 text tokens
        "JoyImageEditTransformer3DModel",
        dict(
            in_channels=4,
            hidden_size=32,
            num_attention_heads=4,
            text_dim=16,
            mlp_width_ratio=2.0,
            num_layers=2,
            rope_dim_list=[2, 2, 4],
        ),
        dict(
            hidden_states=Randn((1, 2, 4, 1, 10, 10)),
            timestep=Tensor([300.0]),
            encoder_hidden_states=Randn((1, 6, 16)),
        ),
        tokens=50,
    ),
    "joyimage_edit_plus": TinyDiT(  # 25 packed 1 x 2 x 2 patches (one 5 x 5 image), padded text
        "JoyImageEditPlusTransformer3DModel",
        dict(
            in_channels=4,
            hidden_size=32,
            num_attention_heads=4,
            text_dim=16,
            mlp_width_ratio=2.0,
            num_layers=2,
            rope_dim_list=[2, 2, 4],
        ),
        dict(
            hidden_states=Randn((1, 25, 4, 1, 2, 2)),
            timestep=Tensor([300.0]),
            encoder_hidden_states=Randn((1, 6, 16)),
            encoder_hidden_states_mask=Tensor([[1, 1, 1, 1, 0, 0]], "long"),
            shape_list=[[(1, 5, 5)]],
        ),
        mask="encoder_hidden_states_mask",
    ),
    "mochi": TinyDiT(  # 2 x 5 x 5 = 50 video tokens, batch 2, text of 4 and 6 valid tokens (one call per sample)
        "MochiTransformer3DModel",
        dict(
            patch_size=2,
            num_attention_heads=4,
            attention_head_dim=8,
            num_layers=2,
            pooled_projection_dim=16,
            in_channels=4,
            text_embed_dim=16,
            time_embed_dim=16,
            max_sequence_length=8,
        ),
        dict(
            hidden_states=Randn((2, 4, 2, 10, 10)),
            encoder_hidden_states=Randn((2, 6, 16)),
            timestep=Tensor([500.0, 20.0]),
            encoder_attention_mask=Tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], "long"),
        ),
        tokens=50,
        mask="encoder_attention_mask",
        calls=2,
    ),
    "cosmos": TinyDiT(  # 2 x 5 x 5 = 50 video tokens, batch 2, per-frame timesteps (video-to-world)
        "CosmosTransformer3DModel",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=16,
            num_layers=2,
            mlp_ratio=1.0,
            text_embed_dim=16,
            adaln_lora_dim=8,
            max_size=(8, 16, 16),
            patch_size=(1, 2, 2),
            concat_padding_mask=False,  # its resize needs torchvision
            extra_pos_embed_type=None,  # the learned positions' norm refuses fp64 (the tests' rounding reference)
        ),
        dict(
            hidden_states=Randn((2, 4, 2, 10, 10)),
            timestep=Tensor([[[[[0.7]], [[0.2]]]], [[[[0.5]], [[0.1]]]]]),
            encoder_hidden_states=Randn((2, 6, 16)),
        ),
        tokens=50,
    ),
    "motif_video": TinyDiT(  # 2 x 5 x 5 = 50 video tokens, batch 2, padded text
        "MotifVideoTransformer3DModel",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=8,
            num_layers=1,
            num_single_layers=1,
            mlp_ratio=2.0,
            text_embed_dim=16,
            rope_axes_dim=(2, 2, 4),
        ),
        dict(
            hidden_states=Randn((2, 4, 2, 10, 10)),
            timestep=Tensor([500.0, 20.0]),
            encoder_hidden_states=Randn((2, 6, 16)),
            encoder_attention_mask=Tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], "long"),
        ),
        tokens=50,
        mask="encoder_attention_mask",
    ),
    "anyflow": TinyDiT(  # 3 x 5 x 5 = 75 video tokens, batch 2, per-frame timesteps (its unpack .view()s the output)
        "AnyFlowTransformer3DModel",
        dict(
            num_attention_heads=4,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=64,
        ),
        dict(
            hidden_states=Randn((2, 3, 4, 10, 10)),
            timestep=Tensor([[700.0, 300.0, 100.0], [500.0, 200.0, 50.0]]),
            r_timestep=Tensor([[500.0, 100.0, 50.0], [300.0, 100.0, 10.0]]),
            encoder_hidden_states=Randn((2, 6, 16)),
        ),
        tokens=75,
    ),
    "dit": TinyDiT(  # 5 x 5 = 25 image tokens, batch 2, class-conditional
        "DiTTransformer2DModel",
        dict(
            num_attention_heads=4,
            attention_head_dim=8,
            in_channels=4,
            out_channels=8,  # learned sigma, as DiTPipeline expects
            num_layers=2,
            norm_num_groups=4,
            sample_size=10,
            patch_size=2,
            num_embeds_ada_norm=1000,  # DiTPipeline guides with the null class 1000
        ),
        dict(
            hidden_states=Randn((2, 4, 10, 10)),
            timestep=Tensor([500, 20], "long"),
            class_labels=Tensor([3, 7], "long"),
        ),
        # no label dropout: a random draw per training forward (the fp64 twin and each run would draw apart)
        attributes={"transformer_blocks.*.norm1.emb.class_embedder.dropout_prob": 0.0},
    ),
    "cogview3plus": TinyDiT(  # 5 x 5 = 25 image tokens, 6 text tokens
        "CogView3PlusTransformer2DModel",
        dict(
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            out_channels=4,
            text_embed_dim=16,
            time_embed_dim=16,
            condition_dim=8,
            pos_embed_max_size=8,
            sample_size=10,
        ),
        dict(
            hidden_states=Randn((1, 4, 10, 10)),
            encoder_hidden_states=Randn((1, 6, 16)),
            timestep=Tensor([300.0]),
            original_size=Tensor([[40.0, 40.0]]),
            target_size=Tensor([[40.0, 40.0]]),
            crop_coords=Tensor([[0.0, 0.0]]),
        ),
    ),
    "easyanimate": TinyDiT(  # 1 x 5 x 5 = 25 video tokens, 6 text tokens
        "EasyAnimateTransformer3DModel",
        dict(
            num_attention_heads=4,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            patch_size=2,
            num_layers=2,
            mmdit_layers=2,
            time_embed_dim=16,
            text_embed_dim=16,
            sample_width=10,
            sample_height=10,
        ),
        dict(
            hidden_states=Randn((1, 4, 1, 10, 10)),
            timestep=Tensor([300.0]),
            encoder_hidden_states=Randn((1, 6, 16)),
        ),
    ),
    "auraflow": TinyDiT(  # 5 x 5 = 25 image tokens, 6 text tokens (+ register tokens)
        "AuraFlowTransformer2DModel",
        dict(
            sample_size=10,
            patch_size=2,
            in_channels=4,
            num_mmdit_layers=1,
            num_single_dit_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=16,
            caption_projection_dim=32,
            out_channels=4,
            pos_embed_max_size=64,
        ),
        dict(
            hidden_states=Randn((1, 4, 10, 10)),
            encoder_hidden_states=Randn((1, 6, 16)),
            timestep=Tensor([300.0]),
        ),
    ),
    "consisid": TinyDiT(  # 1 x 5 x 5 = 25 video tokens, 6 text tokens, a face (perceiver after every block)
        "ConsisIDTransformer3DModel",
        dict(
            num_attention_heads=4,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            time_embed_dim=16,
            text_embed_dim=16,
            num_layers=2,
            sample_width=10,
            sample_height=10,
            sample_frames=1,
            patch_size=2,
            max_text_seq_length=6,
            is_train_face=True,
            cross_attn_interval=1,
            cross_attn_dim_head=8,
            cross_attn_num_heads=2,
            LFE_id_dim=8,
            LFE_vit_dim=8,
            LFE_depth=1,
            LFE_dim_head=8,
            LFE_num_heads=2,
            LFE_num_id_token=2,
            LFE_num_querie=4,
            LFE_output_dim=32,
            LFE_ff_mult=1,
            LFE_num_scale=1,
        ),
        dict(
            hidden_states=Randn((1, 1, 4, 10, 10)),
            encoder_hidden_states=Randn((1, 6, 16)),
            timestep=Tensor([300], "long"),
            id_cond=Randn((1, 8)),
            id_vit_hidden=[Randn((1, 3, 8))],
        ),
    ),
    "ideogram4": TinyDiT(  # one packed sequence: 6 LLM tokens then 5 x 5 = 25 image tokens (31), one segment
        "Ideogram4Transformer2DModel",
        dict(
            in_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            intermediate_size=32,
            adaln_dim=16,
            llm_features_dim=16,
            mrope_section=(2, 1, 1),
        ),
        dict(
            hidden_states=Randn((1, 31, 16)),
            timestep=Tensor([0.7]),
            encoder_hidden_states=Randn((1, 31, 16)),
            position_ids=Tensor(
                [[[i, 0, 0] for i in range(6)] + [[6, h, w] for h in range(5) for w in range(5)]], "long"
            ),
            segment_ids=Tensor([[1] * 31], "long"),
            indicator=Tensor([[3] * 6 + [2] * 25], "long"),
        ),
        tokens=31,
    ),
    "hidream": TinyDiT(  # 5 x 5 = 25 image tokens; 6 T5 and 2 x 5 Llama text tokens; 2 experts, top-1
        "HiDreamImageTransformer2DModel",
        dict(
            patch_size=2,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_channels=[16, 16],
            text_emb_dim=16,
            num_routed_experts=2,
            num_activated_experts=1,
            axes_dims_rope=(2, 2, 4),
            max_resolution=(16, 16),
            llama_layers=[0, 1],
        ),
        dict(
            hidden_states=Randn((1, 4, 10, 10)),
            timesteps=Tensor([300], "long"),
            encoder_hidden_states_t5=Randn((1, 6, 16)),
            encoder_hidden_states_llama3=Randn((2, 1, 5, 16)),
            pooled_embeds=Randn((1, 16)),
        ),
    ),
    "kandinsky5": TinyDiT(  # batch 2, 2 x 5 x 5 = 50 video tokens, 6 text tokens
        "Kandinsky5Transformer3DModel",
        dict(
            in_visual_dim=4,
            in_text_dim=16,
            in_text_dim2=16,
            time_dim=16,
            out_visual_dim=4,
            patch_size=(1, 2, 2),
            model_dim=32,
            ff_dim=32,
            num_text_blocks=1,
            num_visual_blocks=2,
            axes_dims=(2, 2, 4),
        ),
        dict(
            hidden_states=Randn((2, 2, 10, 10, 4)),
            encoder_hidden_states=Randn((2, 6, 16)),
            timestep=Tensor([300.0, 700.0]),
            pooled_projections=Randn((2, 16)),
            visual_rope_pos=(
                Tensor([0, 1], "long"),
                Tensor(list(range(5)), "long"),
                Tensor(list(range(5)), "long"),
            ),
            text_rope_pos=Tensor(list(range(6)), "long"),
            scale_factor=(1.0, 1.0, 1.0),
        ),
        tokens=50,
        rounds_inside="bfloat16",  # its stock rotary rounds q/k to bf16 even in fp32
    ),
    "hunyuanvideo_framepack": TinyDiT(  # 25 current + 38 history tokens (clean, 2x, 4x) = 63, padded text
        "HunyuanVideoFramepackTransformer3DModel",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=8,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=2,
            text_embed_dim=16,
            pooled_projection_dim=16,
            rope_axes_dim=(2, 2, 4),
            has_image_proj=True,
            image_proj_dim=16,
            has_clean_x_embedder=True,
            guidance_embeds=False,
        ),
        dict(
            hidden_states=Randn((2, 4, 1, 10, 10)),
            timestep=Tensor([300.0, 20.0]),
            encoder_hidden_states=Randn((2, 6, 16)),
            encoder_attention_mask=Tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], "long"),
            pooled_projections=Randn((2, 16)),
            image_embeds=Randn((2, 3, 16)),
            indices_latents=Tensor([7], "long"),
            latents_clean=Randn((2, 4, 1, 10, 10)),
            indices_latents_clean=Tensor([0], "long"),
            latents_history_2x=Randn((2, 4, 2, 10, 10)),
            indices_latents_history_2x=Tensor([1, 2], "long"),
            latents_history_4x=Randn((2, 4, 4, 10, 10)),
            indices_latents_history_4x=Tensor([3, 4, 5, 6], "long"),
        ),
        tokens=63,
        mask="encoder_attention_mask",
    ),
    "stable_audio": TinyDiT(  # 25 audio latent frames after one global token, 6 text tokens (cross-attention)
        "StableAudioDiTModel",
        dict(
            sample_size=25,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            num_key_value_attention_heads=2,
            out_channels=4,
            cross_attention_dim=16,
            time_proj_dim=16,
            global_states_input_dim=16,
            cross_attention_input_dim=16,
        ),
        dict(
            hidden_states=Randn((1, 4, 25)),
            timestep=Tensor([300.0]),
            encoder_hidden_states=Randn((1, 6, 16)),
            global_hidden_states=Randn((1, 1, 16)),
            rotary_embedding=(
                Randn((26, 4)),
                Randn((26, 4)),
            ),  # per-position tables, as the pipeline's cos/sin
        ),
    ),
    "kandinsky6": TinyDiT(  # 1 x 5 x 5 = 25 video tokens (sharded) and 5 audio frames (replicated), 6 text tokens
        "Kandinsky6Transformer3DModel",
        dict(
            in_visual_dim=4,
            out_visual_dim=4,
            in_text_dim=16,
            in_text_dim2=16,
            time_dim=16,
            patch_size=(1, 2, 2),
            model_dim=32,
            ff_dim=32,
            num_text_blocks=1,
            num_visual_blocks=2,
            axes_dims=(2, 2, 4),
            visual_cond=False,
            in_audio_dim=4,
            out_audio_dim=4,
            model_dim_a=16,
            time_dim_a=16,
            ff_dim_a=16,
            axes_dims_a=(8,),
        ),
        dict(
            hidden_states=Randn((1, 1, 10, 10, 4)),
            encoder_hidden_states=Randn((1, 6, 16)),
            pooled_projections=Randn((1, 16)),
            timestep=Tensor([300.0]),
            audio_hidden_states=Randn((1, 5, 4)),
        ),
        routed=4,
    ),
    "stable_audio3": TinyDiT(  # 4 memory tokens, then 25 audio frames; differential attention (2 calls per module)
        "StableAudio3DiTModel",
        dict(
            io_channels=4,
            embed_dim=32,
            depth=2,
            num_heads=4,
            cond_token_dim=16,
            global_cond_dim=16,
            local_add_cond_dim=4,
            timestep_features_dim=16,
            ff_mult=1.0,
            num_memory_tokens=4,
        ),
        dict(
            hidden_states=Randn((1, 4, 25)),
            timestep=Tensor([0.7]),
            encoder_hidden_states=Randn((1, 6, 16)),
            global_hidden_states=Randn((1, 16)),
        ),
        calls=2,
    ),
    "minimax_music3": TinyDiT(  # the timestep token, then 25 frames
        "MiniMaxMusic3Transformer1DModel",
        dict(
            in_channels=4,
            condition_dim=4,
            num_layers=2,
            num_attention_heads=4,
            attention_head_dim=8,
            ff_inner_dim=32,
            rotary_dim=4,
            fourier_embedding_dim=16,
        ),
        dict(
            hidden_states=Randn((1, 4, 25)), timestep=Tensor([0.7]), encoder_hidden_states=Randn((1, 25, 4))
        ),
    ),
    "longcat_audio": TinyDiT(  # 25 latent frames, 6 text tokens (padded: masked in the text cross-attention)
        "LongCatAudioDiTTransformer",
        dict(dit_dim=32, dit_depth=2, dit_heads=4, dit_text_dim=16, latent_dim=4, ff_mult=1.0),
        dict(
            hidden_states=Randn((1, 25, 4)),
            encoder_hidden_states=Randn((1, 6, 16)),
            encoder_attention_mask=Tensor([[1, 1, 1, 1, 0, 0]], "bool"),
            timestep=Tensor([0.7]),
            latent_cond=Randn((1, 25, 4)),
        ),
        mask="encoder_attention_mask",
    ),
}


# ----------------------------------------------------------------------------------------------- builders
def tiny_dit(name: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny stock model of row ``name`` of :data:`TINY_DITS` (``overrides`` update its config)."""
    row = TINY_DITS[name]
    config = {**row.config, **overrides}
    return build(f"diffusers.{row.cls}", seed, redraw=redraw_by_module, attributes=row.attributes, **config)


def tiny_dit_inputs(name: str, seed: int = 1) -> dict[str, Any]:
    """Fresh ``forward`` keyword arguments of row ``name`` (the same values for the same ``seed``)."""
    return {key: _make(spec, seed * 1000 + i) for i, (key, spec) in enumerate(TINY_DITS[name].inputs.items())}


# ----------------------------------------------------------------------------------------------- pipelines
@dataclass(frozen=True)
class TinyDiTPipe:
    """A stock diffusers pipeline around a :data:`TINY_DITS` transformer, without text encoders (embeddings given).

    Args:
        cls: The diffusers pipeline class name.
        transformer: Its transformer's :data:`TINY_DITS` row.
        vae: ``(hfpatch.testing factory name, keyword arguments)``.
        scheduler: ``(diffusers scheduler class name, keyword arguments)``.
        call: ``__call__`` keyword arguments (specs as in :class:`TinyDiT`), ``num_inference_steps`` left out.
        output: The output field holding the result (``images``/``frames``).
        components: Other constructor arguments (``None`` for the text encoders and tokenizers by default).
    """

    cls: str
    transformer: str
    vae: tuple[str, Mapping[str, Any]]
    scheduler: tuple[str, Mapping[str, Any]]
    call: Mapping[str, Any]
    output: str = "images"
    components: Mapping[str, Any] = field(default_factory=lambda: {"text_encoder": None, "tokenizer": None})


#: An AutoencoderKL with an 8x spatial factor: 80 x 80 pixels are 10 x 10 latents, 5 x 5 tokens of 2 x 2 patches.
_KL_8X = ("tiny_autoencoder_kl", KL_VAE_8X)

#: name -> tiny pipeline row (what tests/patches/test_dit_zoo_pipelines.py runs end to end).
TINY_DIT_PIPES: dict[str, TinyDiTPipe] = {
    "cogview4": TinyDiTPipe(  # true CFG (two calls per step), 25 image tokens, prompts of 6 and 4 tokens
        "CogView4Pipeline",
        "cogview4",
        _KL_8X,
        ("FlowMatchEulerDiscreteScheduler", {}),
        dict(
            prompt_embeds=Randn((1, 6, 16)),
            negative_prompt_embeds=Randn((1, 4, 16)),
            latents=Randn((1, 4, 10, 10)),
            height=80,
            width=80,
            guidance_scale=4.0,
            output_type="latent",
        ),
    ),
    "skyreels_v2": TinyDiTPipe(  # true CFG, 1 x 5 x 5 video tokens, the tiny Wan 2.1 VAE
        "SkyReelsV2Pipeline",
        "skyreels_v2",
        ("tiny_wan_vae", dict(version="2.1")),
        (
            "UniPCMultistepScheduler",
            dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        ),
        dict(
            prompt_embeds=Randn((1, 6, 16)),
            negative_prompt_embeds=Randn((1, 6, 16)),
            latents=Randn((1, 4, 1, 10, 10)),
            height=80,
            width=80,
            num_frames=1,
            guidance_scale=4.0,
            output_type="latent",
        ),
        output="frames",
    ),
    "cogview3plus": TinyDiTPipe(  # batched CFG ([uncond, cond] in one call), 25 image tokens
        "CogView3PlusPipeline",
        "cogview3plus",
        _KL_8X,
        ("DDIMScheduler", {}),
        dict(
            prompt_embeds=Randn((1, 6, 16)),
            negative_prompt_embeds=Randn((1, 6, 16)),
            latents=Randn((1, 4, 10, 10)),
            height=80,
            width=80,
            guidance_scale=4.0,
            output_type="latent",
        ),
    ),
    "zimage": TinyDiTPipe(  # batched CFG over lists of samples (not split by CFG parallel), 5 x 5 image tokens
        "ZImagePipeline",
        "zimage",
        _KL_8X,
        ("FlowMatchEulerDiscreteScheduler", {}),
        dict(
            prompt_embeds=[Randn((6, 16))],
            negative_prompt_embeds=[Randn((4, 16))],
            latents=Randn((1, 4, 10, 10)),
            height=80,
            width=80,
            guidance_scale=4.0,
            output_type="latent",
        ),
    ),
}


def tiny_dit_pipe(name: str, seed: int = 0) -> Any:
    """The tiny stock pipeline of row ``name`` of :data:`TINY_DIT_PIPES` (progress bar off).

    >>> import torch
    >>> from hfpatch.testing.dits import tiny_dit_pipe, tiny_dit_pipe_inputs
    >>> tuple(tiny_dit_pipe("cogview4")(**tiny_dit_pipe_inputs("cogview4"), num_inference_steps=2).images.shape)
    (1, 4, 10, 10)
    """
    import diffusers

    from . import models

    row = TINY_DIT_PIPES[name]
    factory, vae_kwargs = row.vae
    scheduler_cls, scheduler_kwargs = row.scheduler
    return pipeline(
        row.cls,
        transformer=tiny_dit(row.transformer, seed=seed),
        vae=getattr(models, factory)(seed=seed, **vae_kwargs),
        scheduler=getattr(diffusers, scheduler_cls)(**scheduler_kwargs),
        **row.components,
    )


def tiny_dit_pipe_inputs(name: str, seed: int = 1) -> dict[str, Any]:
    """Fresh ``__call__`` keyword arguments of row ``name`` (the same values for the same ``seed``)."""
    return {
        key: _make(spec, seed * 1000 + i) for i, (key, spec) in enumerate(TINY_DIT_PIPES[name].call.items())
    }


def split_gradients(
    model: torch.nn.Module,
    kwargs: dict[str, Any],
    weight: torch.Tensor,
    group: Any = None,
    inputs: tuple[str, ...] = ("hidden_states", "encoder_hidden_states"),
) -> dict[str, torch.Tensor]:
    """``model(**kwargs).sample`` weighted by ``weight`` and summed, backward: the output (``"output"``), every
    parameter gradient (``"param:NAME"``, those that get one) and the gradients of the ``inputs``
    (``"input:NAME"``), after the documented convention for a sequence-split model without DDP, the SUM over the
    ``sp`` ``group`` (:func:`hfpatch.all_reduce_gradients`; ``None``: unpatched, nothing to sum).

    >>> import torch
    >>> from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
    >>> from hfpatch.testing.dits import split_gradients
    >>> kwargs = dict(hidden_states=torch.randn(1, 4, 1, 4, 4), timestep=torch.tensor([500]),
    ...               encoder_hidden_states=wan_prompt_embeds(1, 3))
    >>> grads = split_gradients(tiny_wan_transformer(), kwargs, torch.ones(1, 4, 1, 4, 4))
    >>> tuple(grads["input:hidden_states"].shape), tuple(grads["output"].shape)
    ((1, 4, 1, 4, 4), (1, 4, 1, 4, 4))
    """
    from ..distributed.gradients import all_reduce_gradients

    model.zero_grad(set_to_none=True)
    leaves = {k: kwargs[k].clone().requires_grad_(True) for k in inputs}
    out = model(**{**kwargs, **leaves}).sample
    (out * weight).sum().backward()
    all_reduce_gradients([model, *leaves.values()], group)
    grads = {f"param:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {**grads, **{f"input:{k}": v.grad for k, v in leaves.items()}, "output": out.detach()}
