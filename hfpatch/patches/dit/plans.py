"""Sequence parallelism (USP) for any diffusers DiT, driven by a plan instead of a hand-written family.

Two pieces of data describe a model; one family (:class:`PlannedDiTUSP`) interprets them.

**Where the sequence is cut and gathered.** diffusers declares it on many transformers as ``_cp_plan``
(``ContextParallelInput``/``ContextParallelOutput`` keyed by submodule path, ``*`` for every block);
:func:`plan_from_cp` translates it into hfpatch's :mod:`~hfpatch.patches.dit.sequence_parallel` specs, so the
split gets hfpatch's guarantees: end padding for token counts that do not divide the degree (masked keys,
trimmed gather), uneven heads, Ring with P2P overlap, Ulysses x Ring, exact backward, CPU/gloo. Models
without ``_cp_plan`` get their plan from :data:`PLANS` instead: a table entry, not a module.

hfpatch shards only the image/video tokens. The text is short and the text stream is cheap, so it stays
replicated on every rank and takes part in joint attention as the exact *joint* part of
:func:`~hfpatch.attention.usp.usp_attention`. Where diffusers' plan also cuts the
text (``encoder_hidden_states``, its mask, its ids, its rotary table), the table entry lists those entries as
``replicate``: they are dropped from the translated plan (and a stale entry that no longer names a plan entry
is an error). A text key mask (QwenImage's ``encoder_hidden_states_mask``, padded prompts) is honoured exactly
as ``joint_key_mask``; a cross-attention to the text (LTX's ``attn2``) needs no communication at all.

**Which attention to route through USP.** The stock processors of these models compute their projections,
norms and rotary, then call ``dispatch_attention_fn`` (a global of their module) with
``parallel_config=self._parallel_config``. For every attention module the entry names,
:class:`USPDispatchProcessor` replaces ``module.processor`` (per object, logged in the
:class:`~hfpatch.core.patch.Patch`) by a stand-in that keeps the stock processor and runs the stock
``__call__`` *code* from a copy of that function (one per stock class: own globals dict, own code object)
whose ``dispatch_attention_fn`` is hfpatch's router; the stand-in calls it with ``self`` = a shallow copy
of the stock processor whose ``_parallel_config`` is the stand-in, so the router knows which model's
groups and shard geometry to use. So:

* per object: no module global, class, function or processor of diffusers is modified; an unpatched model
  in the same process runs the untouched stock function, and two patched models route to their own groups;
* reversible by identity: ``patch.remove()`` puts the very stock processor object back;
* compile-safe: plain Python objects and functions, no context variable or global flag a compiled graph
  could bake in; the copy has its own code object, so ``torch.compile``'s per-code-object cache never
  serves a frame compiled under the router's globals to the stock function (or the reverse);
* exact: the stand-in counts its USP calls; a stock code path that attended without ``dispatch_attention_fn``
  (so within the local shard only) raises instead of returning a wrong result of the right shape.

Older stock processors (SD3's ``JointAttnProcessor2_0``, CogVideoX's, HunyuanDiT's, PixArt's
``AttnProcessor2_0``) call ``F.scaled_dot_product_attention`` (``[B, H, S, D]``) instead, which carries no
``parallel_config``: :class:`USPSDPAProcessor` binds the router in the copy itself, one copy per stand-in whose
``F`` is a module object with ``torch.nn.functional``'s attributes and the stand-in's ``sdpa``, with the same
guarantees (:func:`_sdpa_call`). Which route a processor takes is read from its ``__call__`` code. Only the
modules a table entry names are routed: a cross-attention with the same stock class (PixArt's ``attn2``) runs
the untouched stock code.

The USP attention reads the layout from the call: a self-attention's queries are this rank's shard
(``local_len`` tokens); a joint attention's are ``local_len`` image tokens plus ``T`` replicated text
tokens at the ``front`` or ``back`` (``T = len - local_len``), as the entry declares. Key-only masks
(``[B|1, 1, 1, S]``, bool or 0/-inf float) become the joint key mask; the image keys must be unmasked.

>>> from hfpatch.patches.dit import PLANS, plan_source
>>> from hfpatch.testing import tiny_qwenimage_transformer
>>> plan_source(tiny_qwenimage_transformer())
'_cp_plan'
>>> from hfpatch.patches.dit import PlannedDiTUSP
>>> sorted(PlannedDiTUSP().plan_for(tiny_qwenimage_transformer()))
['img_in', 'pos_embed', 'proj_out', 'transformer_blocks.*']
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ...core.config import ModelFacts, ParallelConfig
from ...core.patch import Patch
from ...core.registry import class_key
from .sequence_parallel import (
    GatherOutput,
    MeasureInput,
    ReplicatedOutput,
    SequenceParallelFamily,
    SequencePlan,
    SequenceShard,
    Spec,
    SplitInput,
    SplitOutput,
    usp_attention_call,
)

__all__ = [
    "PLANS",
    "UNSUPPORTED",
    "AttentionRoute",
    "DiTPlan",
    "PlannedDiTUSP",
    "USPDispatchProcessor",
    "USPSDPAProcessor",
    "plan_from_cp",
    "plan_source",
]

#: The global name through which the stock processors attend (``diffusers.models.attention_dispatch``).
DISPATCH = "dispatch_attention_fn"


# ----------------------------------------------------------------------------------------------- table
@dataclass(frozen=True)
class AttentionRoute:
    """Attention modules whose attention runs through USP.

    Args:
        path: Submodule path, ``*`` for one whole segment (``"transformer_blocks.*.attn"``).
        processors: Class names of the stock processors the modules may have (anything else is refused).
        joint: ``None`` for self-attention over the sharded tokens only; ``"front"``/``"back"`` where the
            processor concatenates the replicated text tokens before/after the image tokens; ``"queries"``
            for a cross-attention whose queries are a replicated stream and whose keys/values are the sharded
            tokens (LTX-2's video-to-audio attention: :mod:`hfpatch.attention.sharded_keys`); ``"keys"`` where
            only the image tokens query and the replicated text joins as keys/values in front (PRX).
        optional: The path may match no module (SD3.5's ``attn2`` exists only in its dual-attention blocks).
    """

    path: str
    processors: tuple[str, ...]
    joint: str | None = None
    optional: bool = False


@dataclass(frozen=True)
class DiTPlan:
    """How hfpatch parallelises one DiT class (a row of :data:`PLANS`).

    Args:
        attention: The attention modules to route through USP (cross-attention to the text is left alone).
        plan: hfpatch's own sequence plan, for a class without ``_cp_plan``; ``None``: translate ``_cp_plan``.
        replicate: ``(path, key)`` entries of ``_cp_plan`` that hfpatch keeps replicated (the text); ``key``
            is an argument name or an output index, as in ``_cp_plan``.
        earlier: ``(path, key)`` entries of ``_cp_plan`` whose tensor hfpatch cuts *earlier* instead, by a spec
            of ``extra`` (QwenImage: the image tokens at ``img_in``'s output rather than block 0's input, so the
            full embedding is freed at once instead of living until block 0 returns).
        extra: Specs added to the translated plan (e.g. 2D ``img_ids``, per-token timesteps).
        refuse: ``forward`` arguments that must be ``None`` (or ``False``) under sequence parallelism (checked
            per call, before any collective), with the reason.
        refuse_config: ``config`` attribute -> (value, reason): a model configured so is refused at ``apply``
            (a variant whose stock code indexes the token sequence by position, say). ``value`` may be a
            predicate of the attribute's value instead (``refused_unless(1)``).
        check: ``(model, named forward arguments) -> None`` run per call before any collective: raises a
            ``ValueError`` for inputs the plan cannot cut exactly (a batch whose samples pack text and image at
            different offsets, say).
        heads: The ``config`` attribute holding the attention head count (Ulysses splits heads), or a function of
            the config that returns it.
    """

    attention: tuple[AttentionRoute, ...]
    plan: SequencePlan | None = None
    replicate: tuple[tuple[str, str | int], ...] = ()
    earlier: tuple[tuple[str, str | int], ...] = ()
    extra: SequencePlan = field(default_factory=dict)
    refuse: Mapping[str, str] = field(default_factory=dict)
    refuse_config: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    check: Callable[[Any, dict[str, Any]], None] | None = None
    heads: str | Callable[[Any], int] = "num_attention_heads"


def refused_unless(*allowed: Any) -> Callable[[Any], bool]:
    """A :attr:`DiTPlan.refuse_config` predicate: refuse every value but ``allowed``."""

    def refused(value: Any) -> bool:
        return value not in allowed

    refused.__qualname__ = f"refused_unless{allowed!r}"
    return refused


_TEXT = "the text tokens stay replicated (joint part of the attention)"

#: Wan 2.1/2.2 (T2V, I2V) and ChronoEdit: hfpatch's own plan, though diffusers has one. It cuts the patch
#: embedding's output instead of block 0's input (the full embedding is freed at once:
#: tests/patches/test_usp_memory.py) and per-token timesteps [B, S] (Wan 2.2 expand_timesteps). attn2 attends to
#: the replicated text/image.
_WAN_PLAN: SequencePlan = {
    "": (SplitInput("timestep", dim=1, ndim=2),),
    "rope": (SplitOutput(dim=1),),  # (cos, sin), each [1, S, 1, D]
    "patch_embedding": (SplitOutput(dim=2, flatten_from=2),),  # [B, C, F, H, W] -> tokens [B, C, S]
    "proj_out": (GatherOutput(dim=1),),
}

#: The packed image tokens [B, S, C] and their ids ([S, n], or deprecated [B, S, n]) cut at the model's input, the
#: output gathered at ``proj_out``: the plan of every Flux-like model (and of Flux.1's _cp_plan minus the text).
_IMAGE_TOKENS_PLAN: SequencePlan = {
    "": (SplitInput("hidden_states", dim=1), SplitInput("img_ids", dim=-2)),
    "proj_out": (GatherOutput(dim=1),),
}


#: Flux-style ControlNet residuals: lists of [B, S, D] added per image token (to the image part of the joint
#: sequence in the single-stream blocks), cut like the tokens.
_CONTROLNET = (
    SplitInput("controlnet_block_samples", dim=1),
    SplitInput("controlnet_single_block_samples", dim=1),
)


def flux_like(processor: str, single: str | None = None, **row: Any) -> DiTPlan:
    """The row of a Flux-like model: dual-stream ``transformer_blocks.*.attn`` (``processor``) and single-stream
    ``single_transformer_blocks.*.attn`` (``single``, default ``processor``) both attend over ``[text, image]``
    (text replicated, in front); the packed image tokens and their ids are cut at the model's input
    (:data:`_IMAGE_TOKENS_PLAN`). ``row`` adds or overrides :class:`DiTPlan` fields.
    """
    return DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", (processor,), joint="front"),
            AttentionRoute("single_transformer_blocks.*.attn", (single or processor,), joint="front"),
        ),
        **{"plan": _IMAGE_TOKENS_PLAN, **row},
    )


#: HunyuanVideo's layout (and its relatives'): the video tokens cut at the patch embedding's output, the rotary
#: tables at the rope's, the output gathered at ``proj_out``.
_HUNYUAN_PLAN: SequencePlan = {
    "rope": (SplitOutput(dim=0),),  # (cos, sin), each [S, D]
    "x_embedder": (SplitOutput(dim=1),),  # tokens [B, S, C]
    "proj_out": (GatherOutput(dim=1),),
}


def _same_size_images(model: Any, named: dict[str, Any]) -> None:
    """Z-Image: every sample's image tokens must start at the same place of the packed sequence."""
    images = named.get("x") or []
    if images and isinstance(images[0], list):
        raise ValueError(
            f"{type(model).__name__}: the omni mode (lists of images per sample, [text, images, SigLIP] packed per "
            "sample) is not supported under sequence parallelism; call with one image per sample"
        )
    if len({tuple(x.shape) for x in images}) > 1:
        raise ValueError(
            f"{type(model).__name__}: images of different sizes in one batch are packed at different offsets "
            "(masked per sample), which a sequence split cannot cut exactly; call with images of one size"
        )


def _same_caption_lengths(model: Any, named: dict[str, Any]) -> None:
    """Lumina 2: every sample's image tokens must start at the same place of the packed [text, image] sequence."""
    mask = named.get("encoder_attention_mask")
    if mask is not None and len(set(mask.sum(dim=1).tolist())) > 1:
        raise ValueError(
            f"{type(model).__name__}: captions of different lengths in one batch put the image tokens at different "
            "offsets of the packed sequence, which a sequence split cannot cut exactly; pad the prompts of one call "
            "to the same number of valid tokens, or use CFG parallel (one prompt per rank)"
        )


def _one_segment(model: Any, named: dict[str, Any]) -> None:
    """Ideogram 4: one attention segment per sample (several make a block-diagonal mask over the sharded tokens)."""
    segments = named.get("segment_ids")
    if segments is not None and bool((segments != segments[:, :1]).any()):
        raise ValueError(
            f"{type(model).__name__}: segment_ids with several segments per sample (packed samples attending "
            "within their segment) make a block-diagonal mask over the sharded tokens; call with one segment per "
            "sample"
        )


def _no_padded_patches(model: Any, named: dict[str, Any]) -> None:
    """JoyImage-Edit-Plus: no padded (masked) patch among the sharded tokens."""
    shapes, hidden_states = named.get("shape_list"), named.get("hidden_states")
    if shapes is None or hidden_states is None or named.get("encoder_hidden_states_mask") is None:
        return
    if any(sum(t * h * w for t, h, w in sample) != hidden_states.shape[1] for sample in shapes):
        raise ValueError(
            f"{type(model).__name__}: samples with fewer patches than the batch's longest are padded with masked "
            "patches, which are sharded over the ranks; call with samples of one patch count"
        )


def _kandinsky_heads(config: Any) -> int:
    """Kandinsky 5's head count: its head size is the sum of the rotary axes."""
    return config.model_dim // sum(config.axes_dims)


#: HunyuanVideo's and Framepack's token-replace I2V: its blocks treat the first frame's tokens apart by position.
_TOKEN_REPLACE_REFUSED = {
    "image_condition_type": (
        "token_replace",
        "the token-replace I2V blocks treat the first frame's tokens apart by position in the sequence",
    )
}

#: CogVideoX's plan, which ConsisID shares (see their rows in :data:`PLANS`).
_COGVIDEOX_LAYOUT = DiTPlan(
    attention=(AttentionRoute("transformer_blocks.*.attn1", ("CogVideoXAttnProcessor2_0",), joint="front"),),
    plan={
        "": (SplitInput("image_rotary_emb", dim=0),),
        "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),
        "proj_out": (GatherOutput(dim=1),),
    },
)

#: Class key -> how hfpatch parallelises it. Classes whose ``_cp_plan`` is used say so by ``plan=None``.
PLANS: dict[str, DiTPlan] = {
    "diffusers.WanTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("WanAttnProcessor",)),), plan=_WAN_PLAN
    ),
    # ChronoEdit: Wan 2.1 I2V's forward with a temporal-skip rotary table (its own WanAttnProcessor class, the
    # same code). Wan's plan rather than its _cp_plan: the same memory argument. attn2's image keys are
    # attended with parallel_config=None by the stock code: local, exact (replicated keys, local queries).
    "diffusers.ChronoEditTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("WanAttnProcessor",)),), plan=_WAN_PLAN
    ),
    # Wan VACE: Wan's plan, plus the control video's patch embedding cut the same way (the hints the VACE
    # blocks add to the main blocks are per token); the VACE blocks' self-attention is routed too. A control
    # video with fewer tokens than the latent (zero-padded by the stock code after the embedding) gets a
    # sequence-length error from the split on every rank, before any collective.
    "diffusers.WanVACETransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("blocks.*.attn1", ("WanAttnProcessor",)),
            AttentionRoute("vace_blocks.*.attn1", ("WanAttnProcessor",)),
        ),
        plan={
            **{k: v for k, v in _WAN_PLAN.items() if k != ""},  # VACE takes timesteps [B] only
            "vace_patch_embedding": (SplitOutput(dim=2, flatten_from=2),),
        },
    ),
    # Flux.1 (dev, schnell, Kontext): diffusers' plan, text replicated. Single-stream blocks attend over
    # [text, local image] in one sequence (text = len - local_len, in front).
    "diffusers.FluxTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("FluxAttnProcessor",), joint="front"),
            AttentionRoute("single_transformer_blocks.*.attn", ("FluxAttnProcessor",), joint="front"),
        ),
        replicate=(("", "encoder_hidden_states"), ("", "txt_ids")),
        extra={
            "": (
                SplitInput("img_ids", dim=1, ndim=3),  # deprecated [B, S, 3] (the plan cuts [S, 3])
                SplitInput("controlnet_block_samples", dim=1),  # lists of [B, S, D], added per token
                SplitInput("controlnet_single_block_samples", dim=1),
            )
        },
    ),
    # SD3 / SD3.5: no _cp_plan. The patch embedding's output (learned positions added) and the ControlNet
    # residuals are cut; the stock JointAttnProcessor2_0 (F.scaled_dot_product_attention) joins the text
    # *behind* the image tokens; SD3.5's dual-attention attn2 is image-only self-attention.
    "diffusers.SD3Transformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("JointAttnProcessor2_0",), joint="back"),
            AttentionRoute("transformer_blocks.*.attn2", ("JointAttnProcessor2_0",), optional=True),
        ),
        plan={
            "": (SplitInput("block_controlnet_hidden_states", dim=1),),  # list of [B, S, D]
            "pos_embed": (SplitOutput(dim=1),),  # [B, S, D] patch tokens with positions added
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # CogVideoX (2B/5B/1.5): no _cp_plan. The video tokens entering block 0 (after the stock embedding, which
    # splits them from the text) and the rotary table (cos, sin), each [S, D], are cut. The stock processor
    # concatenates [text, local video] before projecting and rotates [text_len:]: with the local rotary shard,
    # exactly this rank's video tokens (text = len - local_len, in front).
    "diffusers.CogVideoXTransformer3DModel": _COGVIDEOX_LAYOUT,
    # HunyuanDiT: no _cp_plan. The patch embedding's output (no positions: rotary), the rotary table (cos, sin),
    # each [S, D], and ControlNet residuals are cut; the long skips between blocks are per token. attn2 is the
    # cross-attention to the replicated text (rotary on the local queries only): left alone, exact.
    "diffusers.HunyuanDiT2DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("HunyuanAttnProcessor2_0",)),),
        plan={
            "": (SplitInput("image_rotary_emb", dim=0), SplitInput("controlnet_block_samples", dim=1)),
            "pos_embed": (SplitOutput(dim=1),),  # [B, S, D]
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # PixArt-alpha/sigma: no _cp_plan. The patch embedding's output (sin-cos positions added) is cut; attn1
    # (AttnProcessor2_0, shared with many models: only these modules are routed) is the self-attention, attn2
    # the cross-attention to the replicated, key-masked text, left alone.
    "diffusers.PixArtTransformer2DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("AttnProcessor2_0",)),),
        plan={"pos_embed": (SplitOutput(dim=1),), "proj_out": (GatherOutput(dim=1),)},
        refuse={"attention_mask": "a mask over the image tokens, which are sharded over the ranks"},
    ),
    "diffusers.QwenImageTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("QwenDoubleStreamAttnProcessor2_0",), joint="front"),
        ),
        replicate=(
            ("transformer_blocks.0", "encoder_hidden_states"),
            ("transformer_blocks.*", "encoder_hidden_states_mask"),
            ("pos_embed", 1),  # the text rotary table
        ),
        earlier=(("transformer_blocks.0", "hidden_states"),),
        extra={"img_in": (SplitOutput(dim=1),)},  # image tokens [B, S, C], cut as they are embedded
        refuse={"controlnet_block_samples": "ControlNet residuals are not sharded by the QwenImage plan"},
    ),
    "diffusers.Flux2Transformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("Flux2AttnProcessor",), joint="front"),
            AttentionRoute(
                "single_transformer_blocks.*.attn", ("Flux2ParallelSelfAttnProcessor",), joint="front"
            ),
        ),
        replicate=(("", "encoder_hidden_states"), ("", "txt_ids")),
        extra={"": (SplitInput("img_ids", dim=0, ndim=2),)},  # 2D ids [S, 4] as well as [B, S, 4]
        refuse={
            "kv_cache": "the reference-token KV cache attends per block outside dispatch_attention_fn",
            "kv_cache_mode": "the reference-token KV cache attends per block outside dispatch_attention_fn",
        },
    ),
    "diffusers.LTXVideoTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("LTXVideoAttnProcessor",)),),
        replicate=(("", "encoder_hidden_states"), ("", "encoder_attention_mask")),
        extra={"": (SplitInput("timestep", dim=1, ndim=2),)},  # per-token timesteps [B, S] (LTX 0.9.5+)
    ),
    # HunyuanVideo (T2V): no _cp_plan. The video tokens are cut at the patch embedding's output and the rotary
    # tables ([S, D] each) at the rope's; the text (after its token refiner, which attends within the text)
    # stays replicated and joins every attention *behind* the video tokens; the stock key mask over
    # [video, text] masks only the padded text.
    "diffusers.HunyuanVideoTransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("HunyuanVideoAttnProcessor2_0",), joint="back"),
            AttentionRoute(
                "single_transformer_blocks.*.attn", ("HunyuanVideoAttnProcessor2_0",), joint="back"
            ),
        ),
        plan=_HUNYUAN_PLAN,
        refuse_config=_TOKEN_REPLACE_REFUSED,
    ),
    # HunyuanVideo 1.5: no _cp_plan. HunyuanVideo's layout (video tokens cut at the patch embedding, rotary
    # tables [S, D] at the rope, text replicated and joined *behind* the video). The text (refined MLLM text,
    # ByT5 glyph text and the image tokens, valid ones first) comes with a query x key mask m[i] & m[j] over
    # [video, text] (video unmasked): a key mask plus fully masked padded-text query rows, honoured exactly
    # (_token_masks). The token refiner attends within the replicated text only (not routed).
    "diffusers.HunyuanVideo15Transformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("HunyuanVideo15AttnProcessor2_0",), joint="back"),
        ),
        plan=_HUNYUAN_PLAN,
    ),
    # LTX-2 (audio + video): _cp_plan minus the text. Only the video tokens are cut (hidden_states, the
    # self-attention and a2v/v2a rotary tables: [B, S, D] for interleaved rope, [B, H, S, D/2] for split rope,
    # per-token timesteps and keyframe markers); the audio stream stays replicated on every rank, with its
    # self-attention and text cross-attention local. Video self-attention (attn1) is routed; the audio-to-video
    # attention (video queries, audio keys) is local and exact; the video-to-audio attention (audio queries,
    # video keys) is routed as joint="queries" (exact merge over the video shards). The audio output is
    # replicated: rank 0 takes its (N-scaled) gradient (ReplicatedOutput), so the group's mean counts it once.
    "diffusers.LTX2VideoTransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn1", ("LTX2AudioVideoAttnProcessor",)),
            AttentionRoute(
                "transformer_blocks.*.video_to_audio_attn", ("LTX2AudioVideoAttnProcessor",), joint="queries"
            ),
        ),
        replicate=(("", "encoder_hidden_states"), ("", "encoder_attention_mask")),
        extra={
            "": (
                SplitInput("timestep", dim=1, ndim=2),  # per-token timesteps [B, S] (conditioning pipelines)
                SplitInput("video_keyframes_mask", dim=1, ndim=3),  # [B, S, 1]
            ),
            "rope": (SplitOutput(dim=2, ndim=4),),  # split rope: (cos, sin), each [B, H, S, D/2]
            "cross_attn_rope": (SplitOutput(dim=1, ndim=3), SplitOutput(dim=2, ndim=4)),
            "audio_proj_out": (ReplicatedOutput(),),
        },
        refuse={
            "video_self_attention_mask": "a query x key mask over the video tokens, which are sharded both ways",
        },
    ),
    # MiniMax-H3: its _cp_plan as it is. One packed sequence of video, text and audio rows (the text refined
    # before packing) attends to itself without a mask; the packed rows are cut at block 0 with their rotary
    # tables and per-row AdaLN indices, and both heads gather the full sequence before selecting their rows.
    "diffusers.MiniMaxH3Transformer3DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn", ("MiniMaxH3AttnProcessor",)),),
    ),
    # Chroma (Flux.1-schnell derived): Flux's layout; the key mask over [text, image] ([B, T + S]) is cut like
    # the tokens (its text part replicated). The blocks make it a token mask m[i] * m[j]: exact when boolean;
    # the 0/1 float mask ChromaPipeline passes is an additive bias (+1 on unmasked pairs), refused by the
    # attention with a clear error.
    "diffusers.ChromaTransformer2DModel": flux_like(
        "FluxAttnProcessor",
        plan={
            "": (*_IMAGE_TOKENS_PLAN[""], SplitInput("attention_mask", dim=1, joint="front"), *_CONTROLNET),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # Bria 3.x, LongCat-Image, Ovis-Image: Flux.1's layout with processors of their own (same code shape).
    "diffusers.BriaTransformer2DModel": flux_like(
        "BriaAttnProcessor",
        plan={
            "": (*_IMAGE_TOKENS_PLAN[""], *_CONTROLNET),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    "diffusers.LongCatImageTransformer2DModel": flux_like("LongCatImageAttnProcessor"),
    "diffusers.OvisImageTransformer2DModel": flux_like("OvisImageAttnProcessor"),
    # Bria FIBO: dual-stream blocks with its own processor, single-stream blocks with Bria's; per-block text
    # encoder layers (replicated) are mixed into the text stream.
    "diffusers.BriaFiboTransformer2DModel": flux_like("BriaFiboAttnProcessor", "BriaAttnProcessor"),
    # FLUX.3: per-mode blocks (image, reference image, text: each self-attends within its mode), then single
    # blocks over [text, image, reference]. The image tokens and their ids are cut at the input (the stock code
    # takes the image length from the shard), the text stays replicated; only the image mode's blocks and the
    # joint blocks are routed (the text mode's, same processor class, run the stock code).
    "diffusers.Flux3Transformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("mode_blocks.image.*.attn", ("Flux3AttnProcessor",)),
            AttentionRoute("single_transformer_blocks.*.attn", ("Flux3AttnProcessor",), joint="front"),
        ),
        plan=_IMAGE_TOKENS_PLAN,
        refuse={
            "image_cond_hidden_states": (
                "the reference image tokens are a second sequence of their own length, joined behind the image "
                "tokens: the replicated tokens would sit on both sides of the shard"
            )
        },
    ),
    # SkyReels-V2 (T2V, I2V): Wan's layout (rope output and patch embedding cut, attn1 routed, cross-attention
    # local). Diffusion forcing expands per-frame timesteps to per-token modulation inside forward, and the
    # block-causal variant builds a token x token mask: both refused.
    "diffusers.SkyReelsV2Transformer3DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("SkyReelsV2AttnProcessor",)),),
        plan={k: v for k, v in _WAN_PLAN.items() if k != ""},
        refuse={
            "enable_diffusion_forcing": (
                "the per-frame timesteps become a per-token modulation inside forward, which no plan entry reaches"
            )
        },
        refuse_config={
            "num_frame_per_block": (
                refused_unless(1),
                "the block-causal variant attends through a token x token mask over the sharded video",
            )
        },
    ),
    # HunyuanImage 2.1: HunyuanVideo's layout (video tokens behind which the refined, replicated text joins;
    # a key mask over [image, text] with the image part all True).
    "diffusers.HunyuanImageTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("HunyuanImageAttnProcessor",), joint="back"),
            AttentionRoute("single_transformer_blocks.*.attn", ("HunyuanImageAttnProcessor",), joint="back"),
        ),
        plan=_HUNYUAN_PLAN,
    ),
    # CogView4: the patch embedding returns (image, text): the image tokens are cut, with the rotary table
    # ([S, D] each); the stock processor (SDPA) attends over [text, image].
    "diffusers.CogView4Transformer2DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("CogView4AttnProcessor",), joint="front"),),
        plan={
            "rope": (SplitOutput(dim=0),),
            "patch_embed": (SplitOutput(dim=1, index=0),),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # ERNIE-Image: one packed, sequence-first [image, text] stream ([S, B, H]). The image tokens are cut at the
    # patch embedding's output; the rotary table over [image, text] and the key mask (the text padded) are cut
    # at their image part; the packed output of the last layer is gathered (the stock code slices the image off).
    "diffusers.ErnieImageTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("layers.*.self_attention", ("ErnieImageSingleStreamAttnProcessor",), joint="back"),
        ),
        plan={
            "x_embedder": (SplitOutput(dim=1),),  # [B, S, H]
            "pos_embed": (SplitOutput(dim=1, joint="back"),),  # [B, S + T, 1, D]
            "layers.*": (SplitInput("attention_mask", dim=-1, joint="back"),),  # [B, 1, 1, S + T]
            "final_linear": (GatherOutput(dim=0, joint="back"),),  # [S + T, B, C]
        },
    ),
    # Krea 2: a single stream over [text, image] (the text fused from the encoder's layers first, replicated).
    # The image tokens are cut at their embedding, the rotary table over [text, image] (from position_ids) and
    # the key mask at their image part; the output layer gathers the image tokens.
    "diffusers.Krea2Transformer2DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn", ("Krea2AttnProcessor",), joint="front"),),
        plan={
            "img_in": (SplitOutput(dim=1),),
            "rotary_emb": (SplitOutput(dim=0, joint="front"),),  # (cos, sin), each [T + S, D]
            "transformer_blocks.*": (
                SplitInput("attention_mask", dim=-1, joint="front"),
            ),  # [B, 1, 1, T + S]
            "final_layer": (GatherOutput(dim=1),),
        },
    ),
    # GLM-Image: CogView4's layout (rotary table and image tokens cut, text replicated in front), plus the
    # per-token prior (AR) tokens, cut after their projection. The KV cache of the reference images (kv_caches)
    # holds keys of another pass: refused.
    "diffusers.GlmImageTransformer2DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("GlmImageAttnProcessor",), joint="front"),),
        plan={
            "rope": (SplitOutput(dim=0),),
            "image_projector": (SplitOutput(dim=1),),
            "prior_projector": (SplitOutput(dim=1),),
            "proj_out": (GatherOutput(dim=1),),
        },
        refuse={"kv_caches": "the cached reference keys come from another forward, not cut by this plan"},
    ),
    # Z-Image (Turbo, base): the image tokens (padded to a multiple of 32 with a learned pad token, which takes part
    # in attention) are cut entering the noise refiner, whose blocks attend within the image; the unified
    # sequence [image, text] then holds this rank's shard and the whole (replicated) text: its rotary table and
    # key mask (captions of different padded lengths) are cut at their image part, and the final layer's output
    # is gathered the same way. The caption refiner attends within the text (not routed).
    "diffusers.ZImageTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("noise_refiner.*.attention", ("ZSingleStreamAttnProcessor",)),
            AttentionRoute("layers.*.attention", ("ZSingleStreamAttnProcessor",), joint="back"),
        ),
        plan={
            "noise_refiner.0": (SplitInput("x", dim=1),),  # [B, S, D], S padded to a multiple of 32
            "noise_refiner.*": (SplitInput("freqs_cis", dim=1),),  # complex [B, S, D/2]
            "layers.*": (
                SplitInput("freqs_cis", dim=1, joint="back"),  # [B, S + T, D/2]
                SplitInput("attn_mask", dim=1, joint="back"),  # [B, S + T] when the captions differ in length
            ),
            "all_final_layer.*": (GatherOutput(dim=1, joint="back"),),
        },
        refuse={"controlnet_block_samples": "the residuals span the packed [image, text] sequence"},
        check=_same_size_images,
        heads="n_heads",
    ),
    # Lumina-Image 2.0: the refiners run on the text and on the image apart; then one packed [text, image] sequence
    # (the valid caption tokens, then the image). Its length is taken from the noise refiner's input and the
    # packed sequence is cut at its image part entering the first main block (with its rotary table per block);
    # the output norm's projection is gathered the same way. The noise refiner attends within the whole image on
    # every rank (not routed).
    "diffusers.Lumina2Transformer2DModel": DiTPlan(
        attention=(AttentionRoute("layers.*.attn", ("Lumina2AttnProcessor2_0",), joint="front"),),
        plan={
            "noise_refiner.0": (MeasureInput("hidden_states", dim=1),),
            "layers.0": (SplitInput("hidden_states", dim=1, joint="front"),),
            "layers.*": (SplitInput("image_rotary_emb", dim=1, joint="front"),),  # complex [B, T + S, D/2]
            "norm_out": (GatherOutput(dim=1, joint="front"),),
        },
        check=_same_caption_lengths,
    ),
    # PRX: the image tokens query [text, image] keys (no text queries; the text is projected to keys/values
    # only, replicated). The image tokens are cut at their embedding, the rotary table ([B, 1, S, ...]) at the
    # rope's output; the final layer's output is gathered.
    "diffusers.PRXTransformer2DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attention", ("PRXAttnProcessor2_0",), joint="keys"),),
        plan={
            "img_in": (SplitOutput(dim=1),),
            "pe_embedder": (SplitOutput(dim=2),),
            "final_layer": (GatherOutput(dim=1),),
        },
        heads="num_heads",
    ),
    # JoyImage-Edit: Wan-like patch embedding (cut as tokens), double-stream blocks attending over [image, text]
    # (text replicated, behind); the image rotary table ((cos, sin), each [S, D]) is the first element of the
    # blocks' rotary argument. Several images (edit inputs) form one longer token sequence.
    "diffusers.JoyImageEditTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("double_blocks.*.attn", ("JoyImageAttnProcessor",), joint="back"),),
        plan={
            "img_in": (SplitOutput(dim=2, flatten_from=2),),
            "double_blocks.*": (SplitInput("image_rotary_emb", dim=0, index=0),),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # JoyImage-Edit-Plus: per-sample packed patches (padded to the batch's longest, padding masked); the patch
    # tokens are cut entering the first block, with their rotary table ([B, N, D]) and the [image, text] key mask.
    # A padded patch (a sample shorter than the batch's longest) would be a masked image token: refused per call.
    "diffusers.JoyImageEditPlusTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("double_blocks.*.attn", ("JoyImageEditPlusAttnProcessor",), joint="back"),),
        plan={
            "double_blocks.0": (SplitInput("hidden_states", dim=1),),
            "double_blocks.*": (
                SplitInput("image_rotary_emb", dim=1),
                SplitInput("attention_mask", dim=-1, joint="back"),
            ),
            "proj_out": (GatherOutput(dim=1),),
        },
        check=_no_padded_patches,
    ),
    # Mochi 1: the video tokens cut entering the first block (the patch embedding runs per frame), with the rotary
    # table ((cos, sin), each [S, H, D/2]); the stock processor (SDPA) attends once per sample over [video, that
    # sample's valid text tokens] (text replicated, behind).
    "diffusers.MochiTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("MochiAttnProcessor2_0",), joint="back"),),
        plan={
            "rope": (SplitOutput(dim=0),),
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # Cosmos Predict 2 / 2.5: the video tokens cut entering the first block, with the rotary table ([S, D] each),
    # the learned positions ([B, S, D]), ControlNet residuals and, for per-frame timesteps (video-to-world), the
    # per-token modulation ([B, S, D]) the blocks and the output norm take. The self-attention (whose stock
    # processor calls dispatch_attention_fn without parallel_config) is routed per stand-in; the
    # cross-attention to the text (and image context) is local.
    "diffusers.CosmosTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("CosmosAttnProcessor2_0",)),),
        plan={
            "rope": (SplitOutput(dim=0),),
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),
            "transformer_blocks.*": (
                SplitInput("extra_pos_emb", dim=1),  # learned positions [B, S, D] (None without them)
                SplitInput("embedded_timestep", dim=1, ndim=3),
                SplitInput("temb", dim=1, ndim=3),
                SplitInput("controlnet_residual", dim=1),
            ),
            "norm_out": (SplitInput("embedded_timestep", dim=1, ndim=3), SplitInput("temb", dim=1, ndim=3)),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # Motif-Video: HunyuanVideo's layout (video tokens cut at the patch embedding, rotary tables at the rope, the
    # text and image-prompt tokens replicated and joined behind). Its decoder layers attend from a second copy of
    # the embedded video to the main stream's output as their context: refused.
    "diffusers.MotifVideoTransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("MotifVideoAttnProcessor2_0",), joint="back"),
            AttentionRoute("single_transformer_blocks.*.attn", ("MotifVideoAttnProcessor2_0",), joint="back"),
        ),
        plan=_HUNYUAN_PLAN,
        refuse_config={
            "num_decoder_layers": (
                refused_unless(0),
                "the decoder layers take the main stream's whole output as their context, which the split leaves "
                "on its rank's shard",
            )
        },
    ),
    # AnyFlow (bidirectional): Wan's layout; its per-frame timesteps reach the blocks and the output norm as
    # per-token embeddings returned by the condition embedder ([B, S, D] and [B, S, 6D]), cut there; the rotary
    # table is a dict {query, key} of [1, 1, S, D].
    "diffusers.AnyFlowTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("AnyFlowAttnProcessor",)),),
        plan={
            "rope": (SplitOutput(dim=2),),
            "patch_embedding": (SplitOutput(dim=2, flatten_from=2),),
            "condition_embedder": (SplitOutput(dim=1, index=0), SplitOutput(dim=1, index=1)),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # DiT (class-conditional): PixArt's layout (the patch embedding's output, sin-cos positions added, cut; attn1
    # routed, SDPA); the output projection's result is gathered before the unpatchify.
    "diffusers.DiTTransformer2DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("AttnProcessor2_0",)),),
        plan={"pos_embed": (SplitOutput(dim=1),), "proj_out_2": (GatherOutput(dim=1),)},
    ),
    # CogView3-Plus: the patch embedding returns [text, image] (positions added); the image tokens are cut entering
    # the first block; CogVideoX's processor (SDPA) attends over [text, image].
    "diffusers.CogView3PlusTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn1", ("CogVideoXAttnProcessor2_0",), joint="front"),
        ),
        plan={
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # EasyAnimate: the video tokens (embedded per frame) cut entering the first block, with the rotary table;
    # its processor (SDPA) attends over [text, video].
    "diffusers.EasyAnimateTransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn1", ("EasyAnimateAttnProcessor2_0",), joint="front"),
        ),
        plan={
            "rope_embedding": (SplitOutput(dim=0),),
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # AuraFlow: the patch embedding's output (positions added) cut; register tokens and text replicated in front,
    # in the joint blocks and in the single blocks' packed [text, image] sequence (AuraFlow's processor, SDPA).
    "diffusers.AuraFlowTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("joint_transformer_blocks.*.attn", ("AuraFlowAttnProcessor2_0",), joint="front"),
            AttentionRoute("single_transformer_blocks.*.attn", ("AuraFlowAttnProcessor2_0",), joint="front"),
        ),
        plan={"pos_embed": (SplitOutput(dim=1),), "proj_out": (GatherOutput(dim=1),)},
    ),
    # ConsisID: CogVideoX's layout (the video tokens cut entering the first block, after the stock code separates
    # them from the text; rotary table [S, D] each); the face perceiver's queries are the video tokens and its
    # keys the replicated face embedding: local, exact.
    "diffusers.ConsisIDTransformer3DModel": _COGVIDEOX_LAYOUT,
    # Ideogram 4: one packed sequence per sample (LLM tokens and output-image tokens, told apart by `indicator`) with
    # one row of position ids per token: every per-token input is cut at the model's input. Tokens attend within
    # their segment (segment_ids): one segment is a full (all True) token mask per shard, exact; several segments
    # (packed samples) make a block-diagonal mask over the shards: refused per call.
    "diffusers.Ideogram4Transformer2DModel": DiTPlan(
        attention=(AttentionRoute("layers.*.attention", ("Ideogram4AttnProcessor",)),),
        plan={
            "": (
                SplitInput("hidden_states", dim=1),
                SplitInput("encoder_hidden_states", dim=1),
                SplitInput("position_ids", dim=1),
                SplitInput("segment_ids", dim=1),
                SplitInput("indicator", dim=1),
                SplitInput("timestep", dim=1, ndim=2),  # per-token timesteps [B, L]
            ),
            "final_layer": (GatherOutput(dim=1),),
        },
        check=_one_segment,
    ),
    # HiDream-I1: image tokens cut at the patch embedding, text (T5 and Llama layers) replicated and joined behind
    # the image tokens in dual- and single-stream blocks (HiDream's processor, SDPA); the rotary table over
    # [image, text] and the key multipliers (hidden_states_masks: [image] in the dual, [image, text] in the single
    # blocks) cut at their image part. The MoE routes each token on its own (top-k, no capacity): exact per shard.
    "diffusers.HiDreamImageTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("double_stream_blocks.*.block.attn1", ("HiDreamAttnProcessor",), joint="back"),
            AttentionRoute("single_stream_blocks.*.block.attn1", ("HiDreamAttnProcessor",), joint="back"),
        ),
        plan={
            "x_embedder": (SplitOutput(dim=1),),
            "pe_embedder": (SplitOutput(dim=1, joint="back"),),  # [B, S + T, 1, D/4, 2, 2]
            "double_stream_blocks.*": (SplitInput("hidden_states_masks", dim=1),),
            "single_stream_blocks.*": (SplitInput("hidden_states_masks", dim=1, joint="back"),),
            "final_layer": (GatherOutput(dim=1),),
        },
    ),
    # Kandinsky 5 (regular attention): the video tokens cut entering the first visual block (their rotary table at
    # every block) and gathered at the last block's output, before the stock code reshapes them to the [B, F, H, W]
    # grid for the output layer. The text blocks attend within the text (not routed), the visual blocks' cross-
    # attention to the text is local. NABLA sparse attention (sparse_params) selects key blocks over the whole grid:
    # refused.
    "diffusers.Kandinsky5Transformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("visual_transformer_blocks.*.self_attention", ("Kandinsky5AttnProcessor",)),
        ),
        plan={
            "visual_transformer_blocks.0": (SplitInput("visual_embed", dim=1),),
            "visual_transformer_blocks.*": (SplitInput("rope", dim=1),),  # [B, S, 1, D/2, 2, 2]
            "visual_transformer_blocks.-1": (GatherOutput(dim=1),),
        },
        refuse={"sparse_params": "NABLA sparse attention picks key blocks from scores over the whole grid"},
        heads=_kandinsky_heads,
    ),
    # HunyuanVideo FramePack: HunyuanVideo's blocks over one packed sequence (the history latents, each patchified
    # at its own scale, then the current latents), cut entering the first block with its rotary table ([S, D]
    # each; `freqs_cis` in the dual blocks) and the [video, text] key mask at every block; the last single block's
    # video output is gathered
    # before the stock code slices the current latents off by position.
    "diffusers.HunyuanVideoFramepackTransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("HunyuanVideoAttnProcessor2_0",), joint="back"),
            AttentionRoute(
                "single_transformer_blocks.*.attn", ("HunyuanVideoAttnProcessor2_0",), joint="back"
            ),
        ),
        plan={
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),
            "transformer_blocks.*": (
                SplitInput("freqs_cis", dim=0),
                SplitInput("attention_mask", dim=-1, joint="back"),
            ),
            "single_transformer_blocks.*": (
                SplitInput("image_rotary_emb", dim=0),
                SplitInput("attention_mask", dim=-1, joint="back"),
            ),
            "single_transformer_blocks.-1": (GatherOutput(dim=1, index=0),),
        },
        refuse_config=_TOKEN_REPLACE_REFUSED,
    ),
    # Stable Audio Open: the audio latent frames cut at the input projection (the pre-convolution runs on the
    # whole clip first); the global (duration + time) token joins in front, replicated; the caller's rotary table
    # over [global, audio] and the key mask are cut at their audio part per block; the projected output is
    # gathered before the stock code drops the global token and runs its post-convolution over the whole clip.
    "diffusers.StableAudioDiTModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn1", ("StableAudioAttnProcessor2_0",), joint="front"),
        ),
        plan={
            "proj_in": (SplitOutput(dim=1),),
            "transformer_blocks.*": (
                SplitInput("rotary_embedding", dim=0, joint="front"),  # (cos, sin), each [1 + S, D']
                SplitInput("attention_mask", dim=-1, joint="front"),
            ),
            "proj_out": (GatherOutput(dim=1, joint="front"),),
        },
    ),
    # Kandinsky 6 (video + audio): LTX-2's layout. The video tokens are cut entering the first fused block (their
    # rotary table at every block) and gathered from the last block's (video, audio) output before the stock code
    # reshapes them to the grid; the audio stream stays replicated (its output's gradient taken by sp rank 0). The
    # video self-attention is routed, and so is the audio-to-video cross-attention (audio queries over the sharded
    # video keys: exact merge over the shards); the video-to-audio and text cross-attentions are local.
    "diffusers.Kandinsky6Transformer3DModel": DiTPlan(
        attention=(
            AttentionRoute(
                "visual_transformer_blocks.*.video_dec_block.self_attention", ("Kandinsky6AttnProcessor",)
            ),
            AttentionRoute(
                "visual_transformer_blocks.*.av_cross_attention",
                ("Kandinsky6AttnProcessor",),
                joint="queries",
            ),
        ),
        plan={
            "visual_transformer_blocks.0": (SplitInput("vis", dim=1),),
            "visual_transformer_blocks.*": (SplitInput("vis_rope", dim=0),),
            "visual_transformer_blocks.-1": (GatherOutput(dim=1, index=0),),
            "audio_out_layer": (ReplicatedOutput(),),
        },
        heads=_kandinsky_heads,
    ),
    # Stable Audio 3: the memory tokens join in front of the audio frames (replicated); the rotary table is built
    # from the whole packed length before the first block, so the frames are cut entering it (their count taken at
    # the input projection) with the table and the inpainting frames per block; the projected frames are gathered
    # before the stock code's post-convolution over the whole clip. Its differential attention attends twice per
    # module.
    "diffusers.StableAudio3DiTModel": DiTPlan(
        attention=(
            AttentionRoute(
                "transformer_blocks.*.self_attn", ("StableAudio3SelfAttnProcessor",), joint="front"
            ),
        ),
        plan={
            "proj_in": (MeasureInput("input", dim=1),),
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1, joint="front"),),
            "transformer_blocks.*": (
                SplitInput("rope", dim=0, joint="front"),  # [M + S, D']
                SplitInput("local_seq", dim=1),  # inpainting frames [B, S, C]
            ),
            "proj_out": (GatherOutput(dim=1),),
        },
        heads="num_heads",
    ),
    # MiniMax-Music 3: the timestep token joins in front of the frames (replicated); as Stable Audio 3, the rotary
    # table covers the whole packed length, so the frames are cut entering the first block and the table per block;
    # the projection's output is gathered before the post-convolution.
    "diffusers.MiniMaxMusic3Transformer1DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("MiniMaxMusic3AttnProcessor",), joint="front"),
        ),
        plan={
            "proj_in": (MeasureInput("input", dim=1),),
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1, joint="front"),),
            "transformer_blocks.*": (
                SplitInput("rotary_emb", dim=0, joint="front"),
            ),  # (cos, sin), [1 + S, D']
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # LongCat-AudioDiT: the rotary table (built from the whole clip's length by a module the text shares) and the
    # frame mask are cut at every block, the frames entering the first; the last block's output is gathered, so the
    # long skip (the embedded clip, held in forward) adds to the whole sequence. Padded frames would be masked keys
    # of the sharded sequence: refused by the attention with a clear error.
    "diffusers.LongCatAudioDiTTransformer": DiTPlan(
        attention=(AttentionRoute("blocks.*.self_attn", ("AudioDiTSelfAttnProcessor",)),),
        plan={
            "blocks.0": (SplitInput("hidden_states", dim=1),),
            "blocks.*": (SplitInput("mask", dim=1), SplitInput("rope", dim=0)),
            "blocks.-1": (GatherOutput(dim=1),),
        },
        heads="dit_heads",
    ),
}


#: Classes hfpatch looked at and does not shard, with the reason ``hfpatch info`` prints (README: "Not supported").
UNSUPPORTED: dict[str, str] = {
    "HeliosTransformer3DModel": (
        "one forward attends over sequences of different lengths (history + current chunk, current chunk only) "
        "split at a positional boundary; an exact plan needs several sharded sequences per forward"
    ),
    # Attention that is not full softmax attention over the sequence (a key mask at most).
    "AceStepTransformer1DModel": (
        "its sliding-window layers let each token attend only to keys within a window of its own position (a banded "
        "token x token mask); sequence-parallel attention is full attention with a key mask"
    ),
    "AnyFlowFARTransformer3DModel": (
        "frame-autoregressive: its self-attention is block-causal over frame chunks (a block mask and a KV cache of "
        "earlier chunks), not full attention"
    ),
    "Cosmos3OmniTransformer": (
        "its understanding tokens attend causally (is_causal) while generation tokens attend fully over one packed "
        "multimodal sequence addressed by per-modality index tensors: a causal token x token mask"
    ),
    "Kandinsky6SRTransformer3DModel": (
        "NABLA sparse attention: each query block attends to the key blocks whose pooled scores over the whole grid "
        "pass a threshold, plus a sliding-tile mask: a data-dependent block pattern over the full sequence"
    ),
    "MiniMaxMusic3RVQDepthDecoder": (
        "a causal (is_causal) decoder over the few RVQ levels of one frame: no long token sequence, and causal"
    ),
    "OmniGenTransformer2DModel": (
        "the caller's 3D attention mask over the packed [text, images] sequence is causal for the text and "
        "bidirectional within each image: a token x token mask"
    ),
    "PriorTransformer": "a causal mask over a short token sequence (the CLIP prior's 77 + 4 tokens)",
    "QwenImage21Transformer2DModel": (
        "text and image tokens are interleaved in one sequence and attend block-causally by segment (a flex block "
        "mask or per-segment boundaries), with a reference KV cache: not full attention"
    ),
    "RFD4ProteinaTransformer": (
        "pair-biased attention: every head adds a bias from an [N, N] pair representation (updated per layer), a "
        "token x token term"
    ),
    "SanaTransformer2DModel": (
        "linear (ReLU-kernel) attention sums over all keys without softmax (no log-sum-exp merge), and its Mix-FFN "
        "runs a 3x3 depthwise convolution over the 2D token grid, mixing tokens across any cut"
    ),
    "SanaVideoTransformer3DModel": (
        "linear (ReLU-kernel) attention without softmax, and its Mix-FFN runs depthwise convolutions over the "
        "video's token grid, mixing tokens across any cut"
    ),
    "SanaWMTransformer3DModel": (
        "gated delta-rule (linear recurrent) attention and short convolutions along time: a recurrence over the "
        "sequence, not softmax attention"
    ),
    "SanaWMLTX2RefinerTransformer3DModel": (
        "a chunk-causal autoregressive refiner: each chunk attends to a KV cache of earlier chunks"
    ),
    "T5FilmDecoder": "a causal decoder over note tokens (spectrogram diffusion), not a DiT over a token grid",
    "WanAnimate2Transformer3DModel": (
        "runs in two passes sharing a reference KV cache (kv_cache_mode 'extract' then 'cached'), with block masks "
        "built from the packed grid"
    ),
    "NucleusMoEImageTransformer2DModel": (
        "expert-choice MoE routing: each expert takes its top-C tokens over the whole image sequence, so a shard's "
        "routing depends on the other shards' tokens"
    ),
    # The tokens are regrouped by position.
    "WanAnimateTransformer3DModel": (
        "the face adapter regroups the video tokens per frame by position (query.unflatten(1, (T, -1))) to attend "
        "each frame to its own face-motion tokens, and the pose latents are added per frame to the patch grid: a "
        "shard is not a whole number of frames"
    ),
    # The sequence is gathered before layers with parameters.
    "LatteTransformer3DModel": (
        "its temporal blocks fold the spatial tokens into the batch ([B * S, F, D]) with a timestep repeated per "
        "spatial token, a batch-flattened tensor a sequence cut cannot reach"
    ),
    "AllegroTransformer3DModel": (
        "its rotary embedding is a pair (per-axis frequency tables, per-token position grids) the processor indexes "
        "per token, and its video mask is an additive -10000 bias over the video tokens"
    ),
    "LuminaNextDiT2DModel": (
        "its proportional attention scales the softmax by log(sequence length) of the tokens the processor sees "
        "(the pipeline passes base_sequence_length by default), which a cut changes"
    ),
    # Not a DiT over a token sequence of its own.
    "DualTransformer2DModel": (
        "a UNet component (two Transformer2DModel over one feature map, mixed by a ratio) inside UNet blocks whose "
        "convolutions mix neighbouring positions"
    ),
    "Transformer2DModel": (
        "the UNet block transformer: its continuous-input form normalises (GroupNorm) and projects a 2D feature "
        "map inside UNet blocks whose convolutions mix neighbouring positions (the patched form is "
        "PixArtTransformer2DModel's)"
    ),
    "TransformerTemporalModel": (
        "a UNet motion module: it attends over the frames of each pixel inside UNet blocks, whose convolutions mix "
        "neighbouring positions"
    ),
    "DreamLiteTransformer2DModel": (
        "a component of the DreamLite U-Net (continuous input: GroupNorm over a 2D feature map inside U-Net blocks "
        "whose convolutions mix neighbouring positions); hfpatch does not sequence-split U-Nets"
    ),
    "BriaFibo2Transformer2DModel": (
        "the per-token noise mask and the output's image tokens are taken by position from counts of the whole "
        "sequence (hidden_states[:, image_start : image_start + num_image_tokens]), and the gist tokens join in "
        "front or behind depending on the batch's text lengths"
    ),
}


def _entry(target: Any) -> tuple[str, DiTPlan] | None:
    for cls in type(target).__mro__:
        key = class_key(cls)
        if key in PLANS:
            return key, PLANS[key]
    return None


def plan_source(target: Any) -> str | None:
    """``"_cp_plan"`` (diffusers' plan, translated), ``"hfpatch"`` (the table's own plan) or ``None``."""
    found = _entry(target)
    if found is None:
        return None
    return "hfpatch" if found[1].plan is not None else "_cp_plan"


# ----------------------------------------------------------------------------------------------- _cp_plan
def plan_from_cp(
    cp_plan: Mapping[str, Any], replicate: tuple[tuple[str, str | int], ...] = (), where: str = "_cp_plan"
) -> dict[str, tuple[Spec, ...]]:
    """hfpatch specs for a diffusers ``_cp_plan``, without the ``replicate`` entries. Pure.

    ``ContextParallelInput`` on an argument name is :class:`SplitInput` (``expected_dims`` is ``ndim``:
    tensors of other ranks pass replicated, as in diffusers), on an output index (``split_output=True``)
    :class:`SplitOutput` with that ``index``; ``ContextParallelOutput`` is :class:`GatherOutput`.

    Raises:
        ValueError: A construct hfpatch does not translate, or a ``replicate`` entry naming nothing.

    >>> from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
    >>> plan_from_cp({"": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
    ...                    "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
    ...               "proj_out": ContextParallelOutput(gather_dim=1)}, replicate=(("", "encoder_hidden_states"),))
    {'': (SplitInput(name='hidden_states', dim=1, ndim=3, joint=None, index=None),),
     'proj_out': (GatherOutput(dim=1, joint=None, index=None),)}
    """
    unused = set(replicate)
    plan: dict[str, tuple[Spec, ...]] = {}
    for path, entry in cp_plan.items():
        specs: list[Spec] = []
        if isinstance(entry, Mapping):
            for key, inputs in entry.items():
                if (path, key) in unused or (path, key) in replicate:
                    unused.discard((path, key))
                    continue
                for cp in inputs if isinstance(inputs, (list, tuple)) else (inputs,):
                    dim, ndim = cp.split_dim, cp.expected_dims
                    if isinstance(key, int) and cp.split_output:
                        specs.append(SplitOutput(dim=dim, ndim=ndim, index=key))
                    elif isinstance(key, str) and not cp.split_output:
                        specs.append(SplitInput(key, dim=dim, ndim=ndim))
                    else:
                        raise ValueError(
                            f"{where}[{path!r}][{key!r}]: {cp!r} is not a form hfpatch translates"
                        )
        elif hasattr(entry, "gather_dim"):
            specs.append(GatherOutput(dim=entry.gather_dim))
        else:
            raise ValueError(
                f"{where}[{path!r}]: {entry!r} is not a form hfpatch translates (one gather per path)"
            )
        if specs:
            plan[path] = tuple(specs)
    if unused:
        raise ValueError(
            f"{where}: hfpatch's table keeps {sorted(map(str, unused))} replicated, but the plan has no such entry"
        )
    return plan


# ----------------------------------------------------------------------------------------------- attention
def _key_mask(attn_mask: torch.Tensor | None, batch: int, keys: int, where: str) -> torch.Tensor | None:
    """``[B|1, S_k]`` bool (True: attend) from a key-only SDPA mask, or ``None`` when nothing is masked."""
    if attn_mask is None:
        return None
    shape = tuple(attn_mask.shape)
    key_only = (
        1 <= attn_mask.dim() <= 4
        and shape[-1] == keys
        and all(n == 1 for n in shape[-3:-1])
        and (attn_mask.dim() < 4 or shape[0] in (1, batch))
    )
    if not key_only:
        raise ValueError(
            f"{where}: sequence-parallel attention takes key-only masks [B or 1, 1, 1, {keys}] (padded text); "
            f"got an attention mask of shape {shape}"
        )
    mask = attn_mask.reshape(-1, keys)
    if mask.dtype == torch.bool:
        return mask
    keep = mask == 0
    if not bool((keep | torch.isneginf(mask)).all()):
        raise ValueError(
            f"{where}: sequence-parallel attention takes boolean or 0/-inf additive masks; this one has other "
            "values (a bias is not a mask of keys)"
        )
    return keep


def _token_masks(
    attn_mask: torch.Tensor | None, batch: int, queries: int, keys: int, where: str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(key mask, query mask)``, each ``[B|1, S]`` bool or ``None``, from a key-only or a *token* mask.

    A token mask is a self-attention's query x key mask ``[B|1, 1, S, S]`` that is the outer AND of one token
    mask ``m`` with itself (HunyuanVideo 1.5: ``m[i] & m[j]``, padded text masked as keys *and* as queries).
    That is exactly a key mask ``m`` plus fully masked query rows where ``m`` is False, whose output SDPA gives
    as zeros (torch's safe softmax): the caller zeroes those rows (no gradient flows through them either).
    Anything else is a key-only mask (:func:`_key_mask`) or refused.
    """
    if attn_mask is None or attn_mask.dim() != 4 or attn_mask.shape[-2] == 1:
        return _key_mask(attn_mask, batch, keys, where), None
    shape = tuple(attn_mask.shape)
    if not (queries == keys and shape[-2:] == (queries, keys) and shape[1] == 1 and shape[0] in (1, batch)):
        raise ValueError(
            f"{where}: sequence-parallel attention takes key-only masks [B or 1, 1, 1, {keys}] or a token mask "
            f"[B or 1, 1, {queries}, {keys}] (outer AND of one mask of tokens); got an attention mask of shape {shape}"
        )
    keep = _key_mask(attn_mask.reshape(-1, 1, 1, keys), shape[0] * queries, keys, where)
    keep = keep.reshape(shape[0], queries, keys)
    tokens = keep.diagonal(dim1=-2, dim2=-1)
    if not torch.equal(keep, tokens[:, :, None] & tokens[:, None, :]):
        raise ValueError(
            f"{where}: sequence-parallel attention takes a query x key mask only when it is the outer AND of one "
            "mask of tokens (masked tokens neither attend nor are attended to); this one is not"
        )
    return tokens, None if bool(tokens.all()) else tokens


#: diffusers' own ``dispatch_attention_fn`` (the one every stock module imports), set by :func:`_routed_call`.
_stock_dispatch: Any = None


def _routed_dispatch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None,
    *,
    backend: Any = None,
    parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn`` as the routed copies of the stock ``__call__`` see it.

    The stock code passes ``parallel_config=self._parallel_config``, which the stand-in's view sets to the
    stand-in: the call goes to its :meth:`USPDispatchProcessor.attend`. A call with ``parallel_config=None``
    is one the stock code itself keeps local (Wan's image keys in I2V: replicated keys, local queries), so it
    goes to diffusers' own function, exact on the shard; any other value is refused. (A plain module-level
    function, not a closure: ``torch.compile`` must be able to guard on it from the routed copy.)
    """
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs)
    if parallel_config is None:
        return _stock_dispatch(*args, backend=backend)
    if not isinstance(parallel_config, USPDispatchProcessor):
        raise RuntimeError(
            f"hfpatch's routed {DISPATCH} got parallel_config={parallel_config!r}, not its stand-in processor"
        )
    return parallel_config.attend(*args, backend=backend)


@functools.cache
def _routed_call(stock_call: types.FunctionType) -> types.FunctionType:
    """A copy of a stock ``__call__`` whose ``dispatch_attention_fn`` is :func:`_routed_dispatch`.

    One copy per stock class, shared by every stand-in (routing is per object, through the ``self`` the copy
    is given). The copy has its own globals dict (the diffusers module is left as it is) and its own code
    object: ``torch.compile`` caches compiled frames per code object and installs the compiled functions in
    the globals of the frame, so a copy sharing the stock code object would share cache entries with frames
    that run under other globals (the stock function of an unpatched model).
    """
    global _stock_dispatch
    _stock_dispatch = stock_call.__globals__[DISPATCH]
    return _function_copy(stock_call, {DISPATCH: _routed_dispatch}, "hfpatch USP")


def _function_copy(
    stock_call: types.FunctionType, overrides: dict[str, Any], label: str
) -> types.FunctionType:
    """A copy of ``stock_call`` with its own code object (``label`` in its qualified name) and its own globals:
    the stock module's, with ``overrides``.

    The copied globals have no ``__name__``: ``torch.compile`` names the globals of an inlined function by
    their module (``sys.modules[__name__]``) when they have one, so with the stock module's name its guards
    would read the stock module's ``F``/``dispatch_attention_fn`` instead of the overrides (a guard that fails
    to build, or recompiles every call). Without a name it guards on this dict itself. (Relative imports
    inside the function still resolve through ``__package__``/``__spec__``.)
    """
    scope = {**stock_call.__globals__, **overrides}
    scope.pop("__name__", None)
    code = stock_call.__code__.replace(co_qualname=f"{stock_call.__code__.co_qualname} ({label})")
    routed = types.FunctionType(
        code, scope, stock_call.__name__, stock_call.__defaults__, stock_call.__closure__
    )
    routed.__kwdefaults__ = stock_call.__kwdefaults__
    return routed


#: The module global through which the SDPA-route stock processors attend (``F.scaled_dot_product_attention``).
SDPA = "scaled_dot_product_attention"


def _functional_names(call: types.FunctionType) -> list[str]:
    """Global names of ``call`` bound to ``torch.nn.functional`` that it reads ``scaled_dot_product_attention`` from."""
    if SDPA not in call.__code__.co_names:
        return []
    return [name for name in call.__code__.co_names if call.__globals__.get(name) is torch.nn.functional]


def _sdpa_call(stock_call: types.FunctionType, stand_in: USPSDPAProcessor) -> types.FunctionType:
    """A copy of a stock ``__call__`` whose ``F.scaled_dot_product_attention`` is ``stand_in.sdpa``.

    SDPA has no argument to carry the stand-in (unlike ``parallel_config``), so the binding is in the copy
    itself: one copy *per stand-in*, with its own globals dict, in which ``F`` is a module object with the
    attributes of ``torch.nn.functional`` and ``scaled_dot_product_attention`` = the bound ``stand_in.sdpa``,
    and its own code object. Compile-safety: ``torch.compile`` keys compiled frames by code object and runs
    them with the globals they were compiled under (the compiled functions are installed there); a code
    object per stand-in means no compiled frame is ever served to another stand-in, another model or the
    stock function, and a traced call resolves ``F.scaled_dot_product_attention`` to this stand-in's bound
    method (a plain Python attribute, no global flag or context variable a graph could bake in).
    """
    functional = types.ModuleType(f"{torch.nn.functional.__name__} (hfpatch USP)")
    functional.__dict__.update({k: v for k, v in vars(torch.nn.functional).items() if not k.startswith("__")})
    setattr(functional, SDPA, stand_in.sdpa)
    overrides = dict.fromkeys(_functional_names(stock_call), functional)
    return _function_copy(stock_call, overrides, f"hfpatch USP {stand_in.where}")


class USPDispatchProcessor:
    """Per-object stand-in for a stock processor: the stock ``__call__`` code, attending through USP.

    The stand-in runs :func:`_routed_call` of the stock class's ``__call__`` with ``self`` = a shallow copy of
    the stock processor (the *view*) whose ``_parallel_config`` is this stand-in: the stock code hands it to
    ``dispatch_attention_fn`` (:func:`_routed_dispatch` in the copy), which calls :meth:`attend`. The stock
    processor itself is not modified.

    Args:
        stock: The stock processor (kept, put back by ``patch.remove()``).
        state: The model's :class:`~hfpatch.patches.dit.sequence_parallel.SequenceShard`.
        joint: ``None``, ``"front"`` or ``"back"``: where the processor puts the replicated text tokens.
        where: Module path, for messages.

    Instances are made by :func:`usp_dispatch_processor`, which gives them the stock ``__call__`` signature
    (diffusers' ``Attention`` filters keyword arguments by it).
    """

    #: The function the routed stock code attends through (for messages).
    routed: ClassVar[str] = DISPATCH
    #: Whether the stock code picks its kernel through diffusers' attention backends (honoured here).
    uses_dispatch: ClassVar[bool] = True

    def __init__(self, stock: Any, state: SequenceShard, joint: str | None, where: str) -> None:
        self.stock = stock
        self.state = state
        self.joint = joint
        self.where = where
        self.calls = 0
        self._bind()

    def _bind(self) -> None:
        """Set ``_view`` (the ``self`` of the routed call) and ``_call`` (the routed copy)."""
        self._view = copy.copy(self.stock)
        self._view._parallel_config = self
        self._call = _routed_call(type(self.stock).__call__)

    def _run(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls = 0
        out = self._call(self._view, attn, *args, **kwargs)
        if self.calls == 0:
            raise RuntimeError(
                f"{self.where}: the stock {type(self.stock).__name__} attended without {self.routed} on this "
                "call (within this rank's shard only); hfpatch cannot parallelise that path"
            )
        return out

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        attention_kwargs: dict[str, Any] | None = None,
        *,
        backend: Any = None,
    ) -> torch.Tensor:
        """``dispatch_attention_fn`` over the whole sequence: ``[B, S, H, D]`` in and out, as the stock call.

        ``backend`` (the processor's diffusers attention backend; ``None``: diffusers' active one) is honoured:
        at a ring degree of 1 the call is diffusers' own ``dispatch_attention_fn`` with it, under Ring its
        log-sum-exp form (:mod:`hfpatch.patches.dit.attention_backends`; refused by name where there is none).
        """
        self.calls += 1
        if dropout_p or is_causal or enable_gqa or attention_kwargs:
            raise ValueError(
                f"{self.where}: sequence-parallel attention computes plain softmax attention; got dropout_p="
                f"{dropout_p}, is_causal={is_causal}, enable_gqa={enable_gqa}, attention_kwargs={attention_kwargs}"
            )
        if self.joint == "queries":
            return self._attend_sharded_keys(query, key, value, attn_mask, scale)
        if self.joint == "keys":
            return self._attend_text_keys(query, key, value, attn_mask, scale, backend)
        local = self.state.local_len if self.state.local_len is not None else query.shape[1]
        text = query.shape[1] - local
        if text < 0 or (text and self.joint is None):
            text = 0  # usp_attention_call says what is wrong with the length
        elif self.joint is not None:
            # The text length is inferred from this call's shard; model.forward(...) (no split hooks) after a
            # call would mistake image tokens for text and return a wrong result of the right shape.
            # Keyed by the call's index within the module (Mochi attends once per sample, each with its own text).
            seen = self.state.text_len.setdefault((self.where, self.calls), text)
            if seen != text:
                raise RuntimeError(
                    f"sequence-parallel attention got {query.shape[1]} query tokens at {self.where}: with this "
                    f"call's shard of {local} tokens that leaves {text} text tokens, where this forward had {seen}; "
                    "the model ran without its sequence split. Call model(...), not model.forward(...)."
                )
        attn_mask = self._unmask_padding(attn_mask, local, text)
        mask, query_mask = _token_masks(attn_mask, query.shape[0], query.shape[1], key.shape[1], self.where)
        sizes = [text, local] if self.joint != "back" else [local, text]
        (q0, q1), (k0, k1), (v0, v1) = (t.split(sizes, dim=1) for t in (query, key, value))
        if self.joint == "back":
            (q_img, k_img, v_img), (q_txt, k_txt, v_txt) = (q0, k0, v0), (q1, k1, v1)
            mask_img, mask_txt = (None, None) if mask is None else mask.split(sizes, dim=1)
        else:
            (q_txt, k_txt, v_txt), (q_img, k_img, v_img) = (q0, k0, v0), (q1, k1, v1)
            mask_txt, mask_img = (None, None) if mask is None else mask.split(sizes, dim=1)
        if mask_img is not None:  # the shard's padding keys (end of the last shards) are masked by USP itself
            real = max(0, min(local, (self.state.valid_len or 0) - self.state.rank * local))
            mask_img = mask_img[:, :real]
        if mask_img is not None and not bool(mask_img.all()):
            raise ValueError(
                f"{self.where}: the attention mask masks image/video tokens, which are sharded over the ranks; "
                "sequence-parallel attention masks only the replicated text tokens"
            )
        joint = (q_txt, k_txt, v_txt) if text else None
        kernel, dense = self._kernels(backend)
        out, joint_out = usp_attention_call(
            self.state, q_img, k_img, v_img, joint=joint, joint_position=self.joint or "front",
            joint_key_mask=mask_txt if text else None, scale=scale, backend=kernel, dense=dense,
        )  # fmt: skip
        if joint_out is None:
            return out
        if query_mask is not None:  # a token mask: its masked (text) queries attend to nothing, output zeros
            joint_out = joint_out.masked_fill(~mask_txt[:, :, None, None], 0.0)
        return torch.cat([joint_out, out] if self.joint != "back" else [out, joint_out], dim=1)

    def _kernels(self, backend: Any) -> tuple[str, Any]:
        """``(Ring's local kernel, the ring-degree-1 attention)`` for the processor's diffusers ``backend``."""
        if not self.uses_dispatch:
            return "auto", None
        from .attention_backends import attention_kernels

        ring = 1 if self.state.ring_group is None else torch.distributed.get_world_size(self.state.ring_group)
        return attention_kernels(backend, _stock_dispatch, ring, self.where)

    def _unmask_padding(self, attn_mask: torch.Tensor | None, local: int, text: int) -> torch.Tensor | None:
        """A query x key token mask whose entries for this shard's padding tokens are those of a valid token.

        The padding at the end of the last shards (:mod:`hfpatch.attention.layout`) is masked as keys by USP itself
        and its query rows are dropped at the gather; a mask the stock code built from a cut per-token input
        (Ideogram 4's segment ids, padded with zeros) may disagree there, which must not make it unreadable: the
        padding tokens' rows and columns become those of a token every other token attends to.
        """
        real = max(0, min(local, (self.state.valid_len or 0) - self.state.rank * local))
        if (
            attn_mask is None
            or attn_mask.dim() != 4
            or real == local
            or attn_mask.shape[-1] != attn_mask.shape[-2]
        ):
            return attn_mask
        start = text if self.joint != "back" else 0
        pad = slice(start + real, start + local)
        keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
        keep = keep.expand(*keep.shape[:2], *keep.shape[-2:]).clone()
        keep[..., pad, pad] = True
        tokens = keep.diagonal(dim1=-2, dim2=-1).clone()  # [B, 1|H, S]: each token's own entry
        tokens[..., pad] = True
        keep[..., pad, :] = tokens[..., None, :]
        keep[..., :, pad] = tokens[..., :, None]
        if attn_mask.dtype == torch.bool:
            return keep
        return torch.zeros_like(keep, dtype=attn_mask.dtype).masked_fill(~keep, float("-inf"))

    def _attend_text_keys(self, query, key, value, attn_mask, scale, backend) -> torch.Tensor:
        """The shard's queries over ``[replicated text, sharded image]`` keys/values (``joint="keys"``)."""
        local = self.state.local_len
        text = key.shape[1] - (local or 0)
        if local is None or query.shape[1] != local or text < 0:
            raise RuntimeError(
                f"sequence-parallel attention got {query.shape[1]} queries and {key.shape[1]} keys at {self.where} "
                f"but this call's shard holds {local}: the model ran without its sequence split. Call model(...), "
                "not model.forward(...)."
            )
        mask, _ = _token_masks(attn_mask, query.shape[0], query.shape[1], key.shape[1], self.where)
        mask_txt, mask_img = (None, None) if mask is None else mask.split([text, local], dim=1)
        if mask_img is not None:
            real = max(0, min(local, (self.state.valid_len or 0) - self.state.rank * local))
            if not bool(mask_img[:, :real].all()):
                raise ValueError(
                    f"{self.where}: the attention mask masks image/video tokens, which are sharded over the ranks; "
                    "sequence-parallel attention masks only the replicated text tokens"
                )
        (k_txt, k_img), (v_txt, v_img) = key.split([text, local], dim=1), value.split([text, local], dim=1)
        # usp_attention's joint part comes with queries: zero rows, whose output is dropped (exact for the shard's
        # queries, which attend over [text, image] keys as in the stock call; no gradient flows through them).
        joint = (torch.zeros_like(k_txt), k_txt, v_txt) if text else None
        kernel, dense = self._kernels(backend)
        out, _ = usp_attention_call(
            self.state, query, k_img, v_img, joint=joint, joint_position="front",
            joint_key_mask=mask_txt if text else None, scale=scale, backend=kernel, dense=dense,
        )  # fmt: skip
        return out

    def _attend_sharded_keys(self, query, key, value, attn_mask, scale) -> torch.Tensor:
        """Replicated queries over the sharded tokens' keys/values (``joint="queries"``)."""
        from ...attention.sharded_keys import sharded_keys_attention

        if attn_mask is not None:
            raise ValueError(
                f"{self.where}: an attention mask over the sharded keys of a replicated-query attention is not "
                "supported under sequence parallelism"
            )
        if self.state.local_len is None or key.shape[1] != self.state.local_len:
            raise RuntimeError(
                f"{self.where}: sequence-parallel attention got {key.shape[1]} keys but this call's shard holds "
                f"{self.state.local_len}: the model ran without its sequence split. Call model(...), not "
                "model.forward(...)."
            )
        return sharded_keys_attention(
            query, key, value, group=self.state.group, valid_len=self.state.valid_len, scale=scale
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where}, joint={self.joint}, {self.state!r})"


class USPSDPAProcessor(USPDispatchProcessor):
    """Stand-in for a stock processor that attends by ``F.scaled_dot_product_attention`` (``[B, H, S, D]``).

    The same guarantees as :class:`USPDispatchProcessor` (per object, reversible by identity, counted calls),
    routed by a per-stand-in copy of the stock ``__call__`` (:func:`_sdpa_call`). The stock code runs with
    ``self`` = the stock processor itself: it has no ``_parallel_config`` to redirect. SD3's
    ``JointAttnProcessor2_0`` (``[image, text]``: ``joint="back"``), CogVideoX's (``[text, video]``, projected
    together, rotary on the video part: ``joint="front"``), HunyuanDiT's and PixArt's self-attention.
    """

    routed: ClassVar[str] = f"F.{SDPA}"
    uses_dispatch: ClassVar[bool] = False

    def _bind(self) -> None:
        self._view = self.stock
        self._call = _sdpa_call(type(self.stock).__call__, self)

    def sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` over the whole sequence: ``[B, H, S, D]`` in and out."""
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = self.attend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return out.transpose(1, 2)


class USPBoundDispatchProcessor(USPDispatchProcessor):
    """Stand-in for a stock processor that calls ``dispatch_attention_fn`` without ``parallel_config`` (Cosmos').

    Routed like :class:`USPSDPAProcessor`: a copy of the stock ``__call__`` per stand-in whose
    ``dispatch_attention_fn`` is this stand-in's :meth:`dispatch` (own globals, own code object), run with
    ``self`` = the stock processor.
    """

    def _bind(self) -> None:
        self._view = self.stock
        self._call = _bound_call(type(self.stock).__call__, self)

    def dispatch(self, *args: Any, parallel_config: Any = None, **kwargs: Any) -> torch.Tensor:
        """``dispatch_attention_fn`` as the stock code calls it: :meth:`attend` (``parallel_config`` ignored)."""
        return self.attend(*args, **kwargs)


def _bound_call(stock_call: types.FunctionType, stand_in: USPBoundDispatchProcessor) -> types.FunctionType:
    """A copy of a stock ``__call__`` whose ``dispatch_attention_fn`` is ``stand_in.dispatch`` (see :func:`_sdpa_call`)."""
    global _stock_dispatch
    _stock_dispatch = stock_call.__globals__[DISPATCH]  # diffusers' own, for the ring-degree-1 attention
    return _function_copy(stock_call, {DISPATCH: stand_in.dispatch}, f"hfpatch USP {stand_in.where}")


@functools.cache
def _processor_class(stock_cls: type, base: type[USPDispatchProcessor]) -> type[USPDispatchProcessor]:
    """A ``base`` subclass whose ``__call__`` has ``stock_cls.__call__``'s signature."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)

    __call__.__signature__ = inspect.signature(stock_cls.__call__)  # type: ignore[attr-defined]
    name = f"USP{stock_cls.__name__}"
    return type(name, (base,), {"__call__": __call__, "__module__": __name__, "__qualname__": name})


def _route_kind(processor_cls: type) -> type[USPDispatchProcessor] | None:
    """The stand-in class that can route ``processor_cls``'s attention, or ``None``.

    ``dispatch_attention_fn`` (with ``parallel_config``) where the ``__call__`` reads it, bound per stand-in where it
    calls ``dispatch_attention_fn`` without ``parallel_config``; otherwise ``F.scaled_dot_product_attention`` read
    from ``torch.nn.functional`` as a module global.
    """
    call = processor_cls.__call__
    if not isinstance(call, types.FunctionType):
        return None
    if DISPATCH in call.__code__.co_names and DISPATCH in call.__globals__:
        # A processor that never reads self._parallel_config (Cosmos') cannot carry the stand-in to the router.
        return (
            USPDispatchProcessor
            if "_parallel_config" in call.__code__.co_names
            else USPBoundDispatchProcessor
        )
    if _functional_names(call):
        return USPSDPAProcessor
    return None


def usp_dispatch_processor(
    stock: Any, state: SequenceShard, joint: str | None, where: str
) -> USPDispatchProcessor:
    """The stand-in of ``stock`` (:class:`USPDispatchProcessor` or :class:`USPSDPAProcessor`, by its code).

    >>> from diffusers.models.attention_processor import AttnProcessor2_0
    >>> _route_kind(AttnProcessor2_0).__name__
    'USPSDPAProcessor'
    """
    base = _route_kind(type(stock))
    if base is None:
        raise ValueError(f"{where}: {type(stock).__name__} attends through neither {DISPATCH} nor F.{SDPA}")
    return _processor_class(type(stock), base)(stock, state, joint, where)


# ----------------------------------------------------------------------------------------------- family
class PlannedDiTUSP(SequenceParallelFamily):
    """USP for every class of :data:`PLANS`: the plan from ``_cp_plan`` or the table, the stock attention routed."""

    name: ClassVar[str] = "dit_usp"

    def _entry(self, target: Any) -> DiTPlan:
        found = _entry(target)
        if found is None:
            raise TypeError(f"hfpatch has no sequence-parallel plan for {type(target).__name__}")
        return found[1]

    def facts(self, target: Any) -> ModelFacts:
        heads = self._entry(target).heads
        count = heads(target.config) if callable(heads) else getattr(target.config, heads)
        return ModelFacts(num_heads=count, name=type(target).__name__)

    def plan_for(self, target: Any) -> SequencePlan:
        entry = self._entry(target)
        if entry.plan is not None:
            plan = dict(entry.plan)
        else:
            cp_plan = getattr(type(target), "_cp_plan", None)
            if not cp_plan:
                raise TypeError(
                    f"{type(target).__name__} declares no _cp_plan in this diffusers version and hfpatch's table has "
                    "no plan of its own for it"
                )
            plan = plan_from_cp(
                cp_plan, entry.replicate + entry.earlier, where=f"{type(target).__name__}._cp_plan"
            )
        for path, specs in entry.extra.items():
            plan[path] = plan.get(path, ()) + tuple(specs)
        return plan

    def _routes(self, target: Any) -> list[tuple[str, torch.nn.Module, AttentionRoute]]:
        from .sequence_parallel import expand_plan

        found = []
        for route in self._entry(target).attention:
            try:
                paths = expand_plan(target, {route.path: ()})
            except ValueError:
                if route.optional:
                    continue
                raise
            for path in paths:
                found.append((path, target.get_submodule(path), route))
        return found

    def attention_modules(self, target: Any) -> list[tuple[str, torch.nn.Module, tuple[str, ...]]]:
        return [(path, module, route.processors) for path, module, route in self._routes(target)]

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        self.check_compile(target, config, options)
        from ..caches import cache_names, check_caches

        if config.pipefusion > 1 and cache_names(target):
            raise ValueError(
                f"{type(target).__name__} has diffusers step caches enabled ({', '.join(cache_names(target))}); "
                "PipeFusion reuses stale activations of its own and does not compose with them: disable the cache"
            )
        if config.sequence_parallel == 1 or config.pipefusion > 1:  # PipeFusion runs sp in its stages
            return

        check_caches(target, sequence=config.sequence_parallel, cfg=1, data=1, two_call_cfg=False)
        if getattr(target, "_parallel_config", None) is not None:
            raise ValueError(
                f"{type(target).__name__} has diffusers' own context parallelism enabled (enable_parallelism); "
                "hfpatch replaces it: load the model without it before hfpatch.apply"
            )
        for attr, (value, reason) in self._entry(target).refuse_config.items():
            got = getattr(target.config, attr, None)
            if value(got) if callable(value) else got == value:
                raise ValueError(
                    f"{type(target).__name__} with {attr}={got!r} is not supported under sequence parallelism "
                    f"({reason})"
                )
        super().validate(target, config, options)
        for path, module, _ in self._routes(target):
            if _route_kind(type(module.processor)) is None:
                raise ValueError(
                    f"{type(target).__name__}.{path}: {type(module.processor).__name__} calls neither {DISPATCH} "
                    f"nor F.{SDPA} from its __call__, so hfpatch cannot route its attention"
                )

    def make_processors(self, target: Any, state: SequenceShard) -> list[tuple[str, torch.nn.Module, Any]]:
        name = type(target).__name__
        return [
            (path, module, usp_dispatch_processor(module.processor, state, route.joint, f"{name}.{path}"))
            for path, module, route in self._routes(target)
        ]

    def apply(self, target: Any, patch: Patch, mesh: Any, options: dict[str, Any]) -> None:
        if (
            mesh.config.sequence_parallel == 1 or mesh.config.pipefusion > 1
        ):  # PipeFusion runs sp in its stages
            return
        entry = self._entry(target)
        refuse, check = dict(entry.refuse), entry.check
        if refuse or check is not None:
            from ...distributed.agreement import named_arguments

            def refuse_arguments(_module, args, kwargs):
                named = named_arguments(type(target).forward, (target, *args), kwargs)
                for name, reason in refuse.items():
                    if named.get(name) is not None and named.get(name) is not False:
                        raise ValueError(
                            f"{type(target).__name__}: {name}= is not supported under sequence parallelism ({reason}); "
                            "call without it, or patch.remove() first"
                        )
                if check is not None:
                    check(target, named)

            patch.add_forward_pre_hook(target, refuse_arguments)  # before the plan's first collective
        from ..caches import _hooks, agree_caches

        enabled = [hook for _, hook in _hooks(target)]

        def check_caches_unchanged(_module, args, kwargs):
            # A step cache enabled (or replaced) after apply would decide from this rank's shard alone.
            if [hook for _, hook in _hooks(target)] != enabled:
                raise RuntimeError(
                    f"{type(target).__name__}: a diffusers step cache was enabled or changed after hfpatch.apply; "
                    "its skip decisions would follow this rank's shard only. Enable the cache before "
                    "hfpatch.apply, or patch.remove() and apply again."
                )

        patch.add_forward_pre_hook(target, check_caches_unchanged)
        super().apply(target, patch, mesh, options)
        state = next(  # the stand-ins hold the model's SequenceShard
            module.processor.state
            for module in target.modules()
            if isinstance(getattr(module, "processor", None), USPDispatchProcessor)
        )
        agree_caches(target, state, patch)


# ----------------------------------------------------------------------------------------------- info
def support_table() -> list[tuple[str, str]]:
    """``(class name, how hfpatch shards it)`` for every transformer class the installed diffusers exports.

    What ``hfpatch info`` prints: the family and where its plan comes from (diffusers' ``_cp_plan``,
    translated; hfpatch's table; a family module of its own), or why not.
    """
    import diffusers.models.transformers as transformers

    from .. import default_registry

    supported = default_registry().supported()
    rows = []
    for name in sorted(dir(transformers)):
        cls = getattr(transformers, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            continue
        keys = [class_key(c) for c in cls.__mro__]
        usp = next((f for k in keys for f in supported.get(k, []) if f.endswith("usp")), None)
        entry = next((PLANS[k] for k in keys if k in PLANS), None)
        if entry is not None:
            rows.append((name, f"{usp} (plan: {'hfpatch table' if entry.plan is not None else '_cp_plan'})"))
        elif usp is not None:
            rows.append((name, f"{usp} (plan: hfpatch family module)"))
        else:
            why = UNSUPPORTED.get(name) or (
                "declares _cp_plan, no hfpatch table entry yet"
                if getattr(cls, "_cp_plan", None)
                else "no plan"
            )
            rows.append((name, f"not supported ({why})"))
    return rows
