"""The words the DiT plan table is written in: the sequence-plan specs, the row types, and what several rows share.

A row of :data:`~hfpatch.patches.dit.plans.PLANS` is a :class:`DiTPlan`: the attention modules to route through
USP (:class:`AttentionRoute`), where the token sequence is cut (a :data:`SequencePlan`: :class:`SplitInput`,
:class:`SplitOutput`, :class:`GatherOutput`, ... specs by submodule path, which
:mod:`hfpatch.patches.dit.sequence_parallel` turns into hooks; or diffusers' ``_cp_plan`` translated), and what is
refused. What several rows repeat lives here: the Flux-like row
(:func:`flux_like`), shared sequence plans, per-call input checks, head counts. Adding a DiT class adds a row to the
table and, at most, one function here.

>>> from hfpatch.patches.dit.vocabulary import flux_like
>>> [route.path for route in flux_like("FluxAttnProcessor").attention]
['transformer_blocks.*.attn', 'single_transformer_blocks.*.attn']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "AttentionRoute",
    "DiTPlan",
    "FullLength",
    "GatherOutput",
    "MeasureInput",
    "ReplicatedInput",
    "ReplicatedOutput",
    "SequencePlan",
    "SplitInput",
    "SplitOutput",
    "flux_like",
    "refused_unless",
]


# ----------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class SplitInput:
    """Shard the argument ``name`` of a submodule's ``forward`` along ``dim``.

    Args:
        name: Parameter name in the submodule's ``forward`` signature (found positionally or by keyword).
        dim: Sequence dim of the tensor (of each tensor, for a tuple or list).
        ndim: Only shard tensors with this many dims; others pass through replicated (e.g. Wan's
            ``timestep`` is sharded when it is per-token ``[B, S]`` and left alone when it is ``[B]``).
        joint: ``"front"``/``"back"``: the tensor holds replicated tokens (the text) before/after the sharded
            ones, whose count is this call's sequence length (set by an earlier split of the plan): only those are
            cut, the replicated ones stay in place (a packed ``[text, image]`` sequence or its mask).
        index: Only cut element ``index`` of a tuple/list argument (JoyImage's ``((cos, sin), text_freqs)``).
    """

    name: str
    dim: int
    ndim: int | None = None
    joint: str | None = None
    index: int | None = None


@dataclass(frozen=True)
class MeasureInput:
    """Take this call's sequence length from the argument ``name`` (its size along ``dim``) without cutting it.

    For a model that packs its image tokens with the text before cutting them (a joint split, which needs the
    sharded length, comes first in the plan): the length is measured where the image tokens are still alone.
    """

    name: str
    dim: int


@dataclass(frozen=True)
class FullLength:
    """The integer argument ``name`` of a submodule's ``forward`` counts the tokens of a tensor the plan already cut:
    this rank's shard length in it is replaced by the whole sequence's (the replicated tokens it also counts stay).

    For stock code that sizes a table from a sharded tensor's shape (MiniMax-Music 3 builds its rotary table for
    ``hidden_states.shape[1]``, the timestep token and the frames, after the frames were cut): the submodule builds
    the table of the whole sequence, as unpatched, which a split of its output then cuts.
    """

    name: str


@dataclass(frozen=True)
class SplitOutput:
    """Shard a submodule's output (each tensor of a tuple/list output) along ``dim``.

    ``flatten_from`` flattens the output from that dim first, so a patch embedding's ``[B, C, F, H, W]``
    output can be cut as the ``[B, C, S]`` token sequence the model builds from it: the full output is freed
    right after the patch embedding instead of living until the first block returns. ``flatten_to``: only dims
    ``flatten_from`` to ``flatten_to`` are the token grid, which the stock code flattens itself after this
    submodule (Cosmos' patch embedding returns ``[B, T, H, W, C]`` and the model flattens dims 1-3): the grid is
    cut as one sequence and handed back with size-1 dims in place of the others (``[B, S/N, 1, 1, C]``), so the
    stock flatten gives this rank's tokens. ``index`` shards only
    that element of a tuple/list output (QwenImage's rotary ``(image, text)`` tables: the image one).
    ``joint="front"``/``"back"``: the output holds replicated tokens before/after the sharded ones (see
    :class:`SplitInput`); ``replicated`` names the submodule's argument whose size along ``dim`` is that
    replicated part, so the rest is this call's sequence, measured here when no earlier split did (CogVideoX's
    patch embedding returns ``[text, video]`` and takes the text as ``text_embeds``: cut there, the full
    embedding is freed at once instead of living, through the stock code's views of it, until block 0 returns).
    """

    dim: int
    ndim: int | None = None
    flatten_from: int | None = None
    flatten_to: int | None = None
    index: int | None = None
    joint: str | None = None
    replicated: str | None = None


@dataclass(frozen=True)
class GatherOutput:
    """Gather a submodule's (tensor) output along ``dim`` over the ``sp`` group and trim the padding.

    ``joint="front"``/``"back"``: the output holds replicated tokens before/after this rank's shard (a packed
    ``[text, image]`` sequence); only the shards are gathered, the replicated tokens are kept in place.
    ``index``: gather only that element of a tuple/list output (a block returning ``(image, text)``).
    ``recut``: the gathered sequence is cut again later in the forward (Lumina 2's noise refiner output, which the
    stock code packs with the text before the main blocks cut it again): the gradient reaching it is already this
    rank's scaled share (:mod:`hfpatch.distributed.gradients`), so it is not scaled again as at the model's output.
    """

    dim: int
    joint: str | None = None
    index: int | None = None
    recut: bool = False


@dataclass(frozen=True)
class ReplicatedOutput:
    """A submodule output every rank computes in full (a replicated stream's output: LTX-2's audio).

    Every rank returns the same tensor and computes the same loss from it, so its gradient is the full one on
    every rank, which the replicated stream runs its backward on; where the stream meets the sharded one, the
    shares coming back are averaged first (:mod:`hfpatch.patches.dit.streams`). Forward and backward: identity;
    the output is marked replicated for the per-call proof of :mod:`~hfpatch.patches.dit.streams`.
    """


@dataclass(frozen=True)
class ReplicatedInput:
    """The argument ``name`` of a submodule's ``forward`` is a replicated stream: the same on every rank (LTX-2's
    audio entering each block, with its rotary table).

    hfpatch proves most streams replicated by itself (:mod:`hfpatch.patches.dit.streams`); this says it for one
    whose proof the model's code hides (a stream interleaved with the sharded one, whose positions the stock code
    builds outside any module). A tensor that requires grad is averaged (its gradient, once per call) on its way
    into the submodule, with the others it takes; one that does not is marked replicated for the proof.
    """

    name: str


Spec = (
    SplitInput | MeasureInput | FullLength | SplitOutput | GatherOutput | ReplicatedOutput | ReplicatedInput
)
#: Submodule path (``""`` = the model) -> the specs applied there.
SequencePlan = Mapping[str, tuple[Spec, ...]]


# ----------------------------------------------------------------------------------------------- rows
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
    """A predicate for :class:`DiTPlan`'s ``refuse_config``: refuse every value but ``allowed``."""

    def refused(value: Any) -> bool:
        return value not in allowed

    refused.__qualname__ = f"refused_unless{allowed!r}"
    return refused


_TEXT = "the text tokens stay replicated (joint part of the attention)"

#: Wan 2.1/2.2 (T2V, I2V) and ChronoEdit: hfpatch's own plan, though diffusers has one. It cuts the patch
#: embedding's output instead of block 0's input (the full embedding is freed at once:
#: tests/patches/test_usp_memory.py) and per-token timesteps [B, S] (Wan 2.2 expand_timesteps). attn2 attends to
#: the replicated text/image.
WAN_PLAN: SequencePlan = {
    "": (SplitInput("timestep", dim=1, ndim=2),),
    "rope": (SplitOutput(dim=1),),  # (cos, sin), each [1, S, 1, D]
    "patch_embedding": (SplitOutput(dim=2, flatten_from=2),),  # [B, C, F, H, W] -> tokens [B, C, S]
    "proj_out": (GatherOutput(dim=1),),
}

#: SimpleTuner's timestep and flow-map timesteps (``timestep_sign``, ``r_timestep``), cut where they are per token
#: ``[B, S]``.
SIMPLETUNER_TIMESTEPS = tuple(
    SplitInput(name, dim=1, ndim=2) for name in ("timestep", "timestep_sign", "r_timestep")
)

#: SimpleTuner's copy of Wan (``simpletuner.helpers.models.wan.transformer``): Wan's plan for a rope that returns
#: one complex table ``[1, 1, S, D]``, and its flow-map timesteps (``timestep_sign``, ``r_timestep``) cut like the
#: timestep when they are per token.
SIMPLETUNER_WAN_PLAN: SequencePlan = {
    **WAN_PLAN,
    "": SIMPLETUNER_TIMESTEPS,
    "rope": (SplitOutput(dim=2),),
}

#: The packed image tokens [B, S, C] and their ids ([S, n], or deprecated [B, S, n]) cut at the model's input, the
#: output gathered at ``proj_out``: the plan of every Flux-like model (and of Flux.1's _cp_plan minus the text).
IMAGE_TOKENS_PLAN: SequencePlan = {
    "": (SplitInput("hidden_states", dim=1), SplitInput("img_ids", dim=-2)),
    "proj_out": (GatherOutput(dim=1),),
}


#: Flux-style ControlNet residuals: lists of [B, S, D] added per image token (to the image part of the joint
#: sequence in the single-stream blocks), cut like the tokens.
CONTROLNET = (
    SplitInput("controlnet_block_samples", dim=1),
    SplitInput("controlnet_single_block_samples", dim=1),
)


def flux_like(processor: str, single: str | None = None, **row: Any) -> DiTPlan:
    """The row of a Flux-like model: dual-stream ``transformer_blocks.*.attn`` (``processor``) and single-stream
    ``single_transformer_blocks.*.attn`` (``single``, default ``processor``) both attend over ``[text, image]``
    (text replicated, in front); the packed image tokens and their ids are cut at the model's input
    (:data:`IMAGE_TOKENS_PLAN`). ``row`` adds or overrides :class:`DiTPlan` fields.
    """
    return DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", (processor,), joint="front"),
            AttentionRoute("single_transformer_blocks.*.attn", (single or processor,), joint="front"),
        ),
        **{"plan": IMAGE_TOKENS_PLAN, **row},
    )


#: HunyuanVideo's layout (and its relatives'): the video tokens cut at the patch embedding's output, the rotary
#: tables at the rope's, the output gathered at ``proj_out``.
HUNYUAN_PLAN: SequencePlan = {
    "rope": (SplitOutput(dim=0),),  # (cos, sin), each [S, D]
    "x_embedder": (SplitOutput(dim=1),),  # tokens [B, S, C]
    "proj_out": (GatherOutput(dim=1),),
}


def same_size_images(model: Any, named: dict[str, Any]) -> None:
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


def same_caption_lengths(model: Any, named: dict[str, Any]) -> None:
    """Lumina 2: every sample's image tokens must start at the same place of the packed [text, image] sequence."""
    mask = named.get("encoder_attention_mask")
    if mask is not None and len(set(mask.sum(dim=1).tolist())) > 1:
        raise ValueError(
            f"{type(model).__name__}: captions of different lengths in one batch put the image tokens at different "
            "offsets of the packed sequence, which a sequence split cannot cut exactly; pad the prompts of one call "
            "to the same number of valid tokens, or use CFG parallel (one prompt per rank)"
        )


def one_segment(model: Any, named: dict[str, Any]) -> None:
    """Ideogram 4: one attention segment per sample (several make a block-diagonal mask over the sharded tokens)."""
    segments = named.get("segment_ids")
    if segments is not None and bool((segments != segments[:, :1]).any()):
        raise ValueError(
            f"{type(model).__name__}: segment_ids with several segments per sample (packed samples attending "
            "within their segment) make a block-diagonal mask over the sharded tokens; call with one segment per "
            "sample"
        )


def no_padded_patches(model: Any, named: dict[str, Any]) -> None:
    """JoyImage-Edit-Plus: no padded (masked) patch among the sharded tokens."""
    shapes, hidden_states = named.get("shape_list"), named.get("hidden_states")
    if shapes is None or hidden_states is None or named.get("encoder_hidden_states_mask") is None:
        return
    if any(sum(t * h * w for t, h, w in sample) != hidden_states.shape[1] for sample in shapes):
        raise ValueError(
            f"{type(model).__name__}: samples with fewer patches than the batch's longest are padded with masked "
            "patches, which are sharded over the ranks; call with samples of one patch count"
        )


def no_token_routing(model: Any, named: dict[str, Any]) -> None:
    """SimpleTuner's TREAD: a training forward with routes drops a random subset of the video tokens between two
    blocks, chosen over the whole sequence on each rank (its ``force_keep_mask`` keeps some)."""
    if model.training and torch.is_grad_enabled() and getattr(model, "_tread_routes", None):
        raise ValueError(
            f"{type(model).__name__}: TREAD token routing (SimpleTuner's tread_config) drops a random subset of "
            "the whole token sequence between blocks, which the ranks' shards cannot draw alike; train without "
            "tread_config under sequence parallelism"
        )


def simpletuner_flux_checks(model: Any, named: dict[str, Any]) -> None:
    """SimpleTuner's Flux: no TREAD routing, and no per-token timesteps (its text tokens are conditioned on their mean
    over the image tokens, which a rank holds a shard of)."""
    no_token_routing(model, named)
    timestep = named.get("timestep")
    if isinstance(timestep, torch.Tensor) and timestep.dim() == 2:
        raise ValueError(
            f"{type(model).__name__}: per-token timesteps [B, S] condition the text tokens on their mean over the "
            "image tokens, which are sharded over the ranks; call with one timestep per sample"
        )


#: The forward arguments of SimpleTuner's model copies that need the whole token grid: the hidden-state captures
#: (CREPA and the layer regularisers reshape the blocks' states per frame, which a shard of the tokens is not),
#: GLIGEN grounding and TREAD's keep mask.
SIMPLETUNER_REFUSED_ARGUMENTS = {
    "output_hidden_states": "the captured hidden states are reshaped per frame, and a rank holds a shard of tokens",
    "hidden_states_buffer": "the buffered hidden states are reshaped per frame, and a rank holds a shard of tokens",
    "grounding_kwargs": "GLIGEN grounding fuses boxes into the token grid per frame",
    "force_keep_mask": "TREAD's routing picks tokens over the whole sequence",
}


def kandinsky_heads(config: Any) -> int:
    """Kandinsky 5's head count: its head size is the sum of the rotary axes."""
    return config.model_dim // sum(config.axes_dims)


#: HunyuanVideo's and Framepack's token-replace I2V: its blocks treat the first frame's tokens apart by position.
TOKEN_REPLACE_REFUSED = {
    "image_condition_type": (
        "token_replace",
        "the token-replace I2V blocks treat the first frame's tokens apart by position in the sequence",
    )
}

#: CogVideoX's plan, which ConsisID shares (see their rows in :data:`PLANS`).
COGVIDEOX_LAYOUT = DiTPlan(
    attention=(AttentionRoute("transformer_blocks.*.attn1", ("CogVideoXAttnProcessor2_0",), joint="front"),),
    plan={
        "": (SplitInput("image_rotary_emb", dim=0),),
        # [text, video]: the text (its ``text_embeds`` argument) stays whole; cutting here frees the full
        # embedding at once (the stock forward's text and video views of it kept it alive through block 0).
        "patch_embed": (SplitOutput(dim=1, joint="front", replicated="text_embeds"),),
        "proj_out": (GatherOutput(dim=1),),
    },
)
