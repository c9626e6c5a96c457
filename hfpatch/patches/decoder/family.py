"""Sequence parallelism for transformers decoders: the text LLMs and VLMs of :data:`.table.TARGETS` (Qwen3, Llama,
Qwen2/2.5/3-VL, Qwen3-VL-MoE, Gemma 3/4, Mistral, Ministral, Ministral 3, Mistral 3, GLM-4.xV, InternVL).

``hfpatch.apply(model, parallel=N)`` cuts the decoder's token sequence (after the vision merge, for a VLM)
into ``N = ring x ulysses`` shards, one per rank, from the first decoder layer to the final norm; every rank
returns the unpatched model's output (``sp_output="full"``, the default) or its own shard of the logits and
the exact loss over real tokens (``sp_output="shard"``). Per object and reversible:

* **Attention** goes through transformers' attention interface. The decoder's modules get a shallow copy
  of their config whose ``_attn_implementation`` is a name unique to this patch, registered in
  ``ALL_ATTENTION_FUNCTIONS`` (and ``ALL_MASK_ATTENTION_FUNCTIONS``) for the life of the patch: another
  model of the same class, even one built from the same config object, keeps its own attention; the
  names are deleted and the original config objects put back by ``patch.remove()``.
* **The mask** is transformers' own. The decoder still sees the whole sequence when it builds its mask
  (``create_causal_mask``: causal, padded keys from the 2D ``attention_mask``, packed samples detected
  from position ids that restart, as the unpatched model decides), so hfpatch's mask function receives
  transformers' composed ``mask_function`` and returns a :class:`ModelMask` that evaluates it on tiles of
  GLOBAL positions (:func:`transformers.masking_utils.sdpa_mask` with offsets): each rank reads exactly
  the entries of its own (query block, key block) pairs, and never the ``S x S`` mask. Sliding-window layers
  read their window from the mask of their layer type (checked: ``sharding.window_kept``). A VLM that
  builds the masks outside its decoder (Gemma 3/4) gets a config copy whose text config is the routed one.
* **The split** is four hooks: layer 0 takes this rank's shard of ``hidden_states`` (after the
  embedding and the vision merge), every layer takes its shard of the rotary ``position_embeddings``
  (M-RoPE's ``[3, B, S, D]`` too; each table cut once per forward), and the decoder's output is gathered (or
  left sharded). What a decoder class needs beyond that (Qwen3-VL's DeepStack, Ministral 3's position ids,
  Gemma 4's per-layer inputs and KV-sharing layers) is named in :data:`DECODER_NEEDS` and installed by
  :mod:`.adapt`; a wrapper's text model outside its row's allowlist, or attention sinks, are refused.
* **MoE**: routing stays per token; transformers' load-balancing loss is computed from every rank's partial
  sums (:mod:`.moe`), exact.
* **A Qwen-style vision tower** attends within each frame, so each rank encodes a contiguous run of about ``1/N``
  of a call's frames (:func:`frame_split`) and the merged features are all-gathered (``sp_vision="split"``,
  the default), or every rank encodes everything (``"replicate"``); both measured in
  ``benchmarks/decoder_sp.py``. Other towers run whole on every rank.

Gradients follow :mod:`hfpatch.distributed.gradients`: the gather (or the sharded loss's sum) scales the
gradient by ``N``, so each rank's parameter gradients are ``N`` times its shard's share and their mean over
the ``sp`` group, DDP's or FSDP2's or :func:`hfpatch.all_reduce_gradients`', is the unpatched gradient.

>>> from hfpatch.patches.decoder import decoder_of
>>> from hfpatch.testing import tiny_qwen3_vl
>>> path, decoder = decoder_of(tiny_qwen3_vl())
>>> path, type(decoder).__name__
('language_model', 'Qwen3VLTextModel')
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import Any, ClassVar

import torch

from ...attention.masked import DEFAULT_TILE
from ...core.config import ModelFacts, ParallelConfig
from ...core.dropout import refuse_dropout
from ...core.patch import Patch
from ...core.registry import PatchFamily, class_key
from ...distributed.agreement import check_same_inputs, named_arguments
from ...distributed.gradients import average_input_gradients
from .adapt import adapt
from .moe import RouterLogits, install_exact_aux_loss
from .sharding import (
    ORDERS,
    DecoderSplit,
    attention_function,
    decoder_of,
    mask_interface,
    sharded_loss,
    split_vision,
    target_of,
    vision_of,
)
from .table import DECODER_NEEDS, FRAME_TOWERS, REFUSED

__all__ = ["DecoderUSP"]

#: Attention implementations whose semantics (softmax attention under ``create_causal_mask``'s mask) the
#: patched model reproduces; rows with no key (left padding) are zeros as with SDPA.
_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
_OUTPUTS = ("full", "shard")
#: Decoder layer types whose attention runs under the model's mask, read tile by tile (a sliding window's tiles
#: that the window rules out entirely are skipped like a causal mask's).
LAYER_TYPES = ("full_attention", "sliding_attention")
_VISION_MODES = ("split", "replicate")


# ----------------------------------------------------------------------------------------------- family
def _named(cls: type) -> str:
    """``Name (module)``: a class as errors name it."""
    return f"{cls.__name__} ({cls.__module__})"


def _check_decoder_class(target: Any, where: str, decoder: Any) -> None:
    """Refuse a decoder the split does not carry: a class outside a wrapper's allowlist (``text_models``: InternVL,
    Mistral 3, GLM-4.6V hold ``AutoModel(text_config)``), and attention sinks anywhere."""
    _, row = target_of(target)
    mro = [class_key(c) for c in type(decoder).__mro__]
    if row.text_models and not set(mro) & set(row.text_models):
        refused = next((REFUSED[key] for key in mro if key in REFUSED), None)
        allowed = ", ".join(k.split(".", 1)[1] for k in row.text_models)
        reason = refused or "not one of the decoders sequence parallelism supports inside it"
        raise TypeError(
            f"hfpatch does not split {type(target).__name__} over ranks with its decoder {where}, a "
            f"{_named(type(decoder))}: {reason}. Supported text models inside {type(target).__name__}: {allowed}"
            + (
                "."
                if refused
                else "; or run the model whole on each rank (data parallel, no sequence split)."
            )
        )
    sinks = [
        n for n, m in decoder.named_modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)
    ]
    if sinks:
        raise TypeError(
            f"hfpatch does not split {type(target).__name__} over ranks: {where}.{sinks[0]} "
            f"({_named(type(decoder))}) has attention sinks, which the sequence-parallel attention does not merge. "
            "Run the model whole on each rank (data parallel, no sequence split)."
        )


def _needs(decoder: Any) -> tuple[str, ...]:
    """The adaptations :data:`DECODER_NEEDS` lists for ``decoder``'s class (the first along its MRO)."""
    return next(
        (DECODER_NEEDS[class_key(c)] for c in type(decoder).__mro__ if class_key(c) in DECODER_NEEDS), ()
    )


def _cache_length(value: Any) -> int:
    get = getattr(value, "get_seq_length", None)
    return int(get()) if callable(get) else 0


def _mark_router_logits(output: Any, split: DecoderSplit, batch: int, length: int) -> None:
    """MoE decoders: the recorded router logits (this rank's rows) as :class:`RouterLogits`, for the exact
    load-balancing loss."""
    logits = getattr(output, "router_logits", None)
    if isinstance(logits, tuple) and logits and not isinstance(logits, RouterLogits):
        valid = split.shard(
            torch.ones(batch, length, dtype=torch.bool, device=logits[0].device), 1, fill=False
        )
        output.router_logits = RouterLogits(logits, split, valid)


class DecoderUSP(PatchFamily):
    """Sequence parallelism (Ulysses x Ring under the model's mask) for the decoders of :data:`DECODERS`.

    Options:
        sp_output: ``"full"`` (every rank gets the unpatched outputs: hidden states, logits, loss) or
            ``"shard"`` (hidden states and logits stay this rank's shard of the sequence, in the order of
            ``sp_order``; :func:`output_shard` cuts a whole-sequence tensor alike; with ``labels`` the loss is the exact mean over every real
            token of every rank, identical on all ranks, without ever holding ``[B, S, vocab]`` logits).
        sp_vision: Qwen-VL or GLM-4.xV vision tower (the others always run whole on every rank): ``"split"`` (each rank encodes a contiguous run of about ``1/N`` of
            the frames, :func:`frame_split`, and the merged and DeepStack features are all-gathered; the
            tower's ``last_hidden_state`` and ``hidden_states`` in ``image_outputs``/``video_outputs`` are then
            ``None``, as they stay per rank) or ``"replicate"`` (every rank encodes everything, the stock
            outputs). A call with fewer frames than ranks runs replicated.
        sp_tile: Tile edge of the attention (tokens), see :func:`hfpatch.attention.masked.masked_usp_attention`.
        sp_order: How tokens are dealt to ranks (:data:`ORDERS`): ``"auto"`` (the default) deals the zigzag
            order when the plan has a Ring degree (rank ``p`` holds chunks ``p`` and ``2N - 1 - p`` of ``2N``:
            every rank gets the same causal work, :mod:`hfpatch.attention.zigzag`) and contiguous runs
            otherwise. Invisible in ``sp_output="full"``; with ``"shard"`` the outputs follow it
            (:func:`output_shard` cuts labels alike).
        check_inputs: Same-input guard over the ``sp`` group on every call.
    """

    name: ClassVar[str] = "decoder_usp"
    role: ClassVar[str] = "model"
    split_axis: ClassVar[str | None] = "sp"
    options: ClassVar[dict[str, Any]] = {
        "sp_output": "full",
        "sp_vision": "split",
        "sp_tile": DEFAULT_TILE,
        "sp_order": "auto",
        "check_inputs": True,
    }

    def facts(self, target: Any) -> ModelFacts:
        _, decoder = decoder_of(target)
        return ModelFacts(num_heads=decoder.config.num_attention_heads, name=type(target).__name__)

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        name = type(target).__name__
        if options["sp_output"] not in _OUTPUTS:
            raise ValueError(f"sp_output must be one of {_OUTPUTS} for {name}, got {options['sp_output']!r}")
        if options["sp_vision"] not in _VISION_MODES:
            raise ValueError(
                f"sp_vision must be one of {_VISION_MODES} for {name}, got {options['sp_vision']!r}"
            )
        if options["sp_order"] not in ORDERS:
            raise ValueError(f"sp_order must be one of {ORDERS} for {name}, got {options['sp_order']!r}")
        tile = options["sp_tile"]
        if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
            raise ValueError(f"sp_tile must be a positive int (tokens) for {name}, got {tile!r}")
        if config.pipefusion > 1:
            raise ValueError(
                f"pipefusion={config.pipefusion}: {name} has no PipeFusion support; use ulysses/ring"
            )
        if config.sequence_parallel == 1:
            return
        path, decoder = decoder_of(target)
        where = f"{name}.{path}" if path else name
        _check_decoder_class(target, where, decoder)
        vision = vision_of(target)
        if (
            vision is not None
            and options["sp_vision"] == "split"
            and class_key(type(vision)) not in FRAME_TOWERS
        ):
            raise ValueError(
                f"{name}'s vision tower is {_named(type(vision))}, not one that attends within each frame; "
                "sp_vision='split' cuts a tower between frames. Apply with sp_vision='replicate'."
            )
        implementation = decoder.config._attn_implementation
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(
                f"{where} uses attn_implementation={implementation!r}; sequence parallelism replaces one of "
                f"{', '.join(_IMPLEMENTATIONS)}. Load the model with attn_implementation='sdpa'."
            )
        layer_types = getattr(decoder.config, "layer_types", None) or ()
        unsupported = sorted(set(layer_types) - set(LAYER_TYPES))
        if unsupported:
            raise ValueError(
                f"{where} has {unsupported} layers; sequence parallelism supports softmax attention layers "
                f"({', '.join(LAYER_TYPES)}) only"
            )
        for i, layer in enumerate(decoder.layers):
            attention = getattr(layer, "self_attn", None)
            if getattr(attention, "config", None) is not decoder.config:
                raise ValueError(
                    f"{where}.layers.{i}.self_attn does not dispatch through the decoder's config "
                    "(a replaced attention module?); sequence parallelism cannot route it"
                )
        if options["sp_output"] == "shard" and hasattr(target, "lm_head"):
            from transformers.loss.loss_utils import ForCausalLMLoss

            if target.loss_function is not ForCausalLMLoss:
                raise ValueError(
                    f"sp_output='shard' shards transformers' causal-LM loss (ForCausalLMLoss); {name}.loss_function "
                    f"is {getattr(target.loss_function, '__name__', target.loss_function)!r}"
                )

    def apply(self, target: Any, patch: Patch, mesh: Any, options: dict[str, Any]) -> None:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        if mesh.config.sequence_parallel == 1:
            return
        cls, row = target_of(target)
        _, decoder = decoder_of(target)
        split = DecoderSplit(mesh, options["sp_tile"], options["sp_output"], options["sp_order"])

        # 1. A name of its own in transformers' interfaces, and a config copy that selects it.
        implementation = f"hfpatch_sp_{id(split):x}"
        AttentionInterface.register(implementation, attention_function(split))
        AttentionMaskInterface.register(implementation, mask_interface)

        def unregister() -> None:
            AttentionInterface._global_mapping.pop(implementation, None)
            AttentionMaskInterface._global_mapping.pop(implementation, None)

        patch.on_remove(split, f"attention implementation {implementation}", unregister)
        original = decoder.config
        config = copy.copy(original)
        config._attn_implementation_internal = implementation
        routed = [m for m in decoder.modules() if m.__dict__.get("config") is original]
        for module in routed:
            patch.set_attr(module, "config", config)
        # Gemma VLMs build the decoder's masks outside it, from their config's get_text_config(): that module
        # gets a config copy whose text config is the routed one.
        outer = None
        if row.masks is not None:
            outer = target.get_submodule(row.masks) if row.masks else target
            composite = copy.copy(outer.config)
            composite.text_config = config
            patch.set_attr(outer, "config", composite)

        # 2. The split: layer 0 cuts the hidden states, every layer its rotary tables.
        layers = list(decoder.layers)
        position = (
            list(inspect.signature(type(layers[0]).forward).parameters).index("position_embeddings") - 1
        )

        def split_layer_input(layer, args, kwargs):
            args = list(args)
            if layer is layers[0]:
                if args:
                    args[0] = split.shard(args[0], 1)
                else:
                    kwargs["hidden_states"] = split.shard(kwargs["hidden_states"], 1)
            if kwargs.get("position_embeddings") is not None:
                kwargs["position_embeddings"] = split.rotary(kwargs["position_embeddings"])
            elif len(args) > position and args[position] is not None:
                args[position] = split.rotary(args[position])
            return tuple(args), kwargs

        for layer in layers:
            patch.add_forward_pre_hook(layer, split_layer_input)

        # What this decoder class needs beyond that (DeepStack, position ids, Gemma 4's per-layer inputs...).
        adapt(decoder, _needs(decoder), split, patch)

        # 3. The decoder's outputs: gathered, or this rank's shard.
        def decoder_output(_module, args, kwargs, output):
            split.end_call()
            if not hasattr(output, "last_hidden_state"):
                raise TypeError(
                    f"{type(decoder).__name__} returned {type(output).__name__}; sequence parallelism needs its "
                    "ModelOutput (do not pass return_dict=False to the decoder)"
                )
            embeds = kwargs.get("inputs_embeds")
            length = (embeds if embeds is not None else kwargs.get("input_ids")).shape[1]
            local = output.last_hidden_state
            _mark_router_logits(output, split, local.shape[0], length)
            if split.output == "shard":
                return output
            output.last_hidden_state = split.gather(local, length)
            states = getattr(output, "hidden_states", None)
            if states:
                output.hidden_states = tuple(
                    output.last_hidden_state if s is local else split.gather(s, length) for s in states
                )
            return output

        patch.add_forward_hook(decoder, decoder_output)

        vision = vision_of(target)
        if vision is not None and options["sp_vision"] == "split":
            patch.wrap_method(vision, "forward", split_vision(split, vision.spatial_merge_size))

        if row.aux_loss:  # the load-balancing loss from every rank's partial sums (output_router_logits=True)
            install_exact_aux_loss(sys.modules[cls.__module__], patch)

        # 4. sp_output="shard" with labels: the loss over every real token, from sharded logits.
        if split.output == "shard" and hasattr(target, "lm_head"):
            patch.set_attr(target, "_loss_function", sharded_loss(target.loss_function, split))

        # 5. Every call: checks (the same on every rank, before any collective), same inputs, input grads.
        forward = type(target).forward
        what = f"{type(target).__name__}.forward"

        def begin_call(_module, args, kwargs):
            # A training-mode dropout module (peft's lora_dropout) would draw per-shard masks: refused by name.
            refuse_dropout(target, "sequence-parallel forward")
            named = named_arguments(forward, (target, *args), kwargs)
            named.pop("self", None)
            extra = named.pop("kwargs", None)
            if isinstance(extra, dict):
                named.update(extra)
            if (
                any(m.__dict__.get("config") is not config for m in routed)
                or config._attn_implementation != implementation
                or (outer is not None and outer.config.get_text_config() is not config)
            ):
                raise RuntimeError(
                    f"{what}: the attention implementation of the sequence-parallel decoder was changed after "
                    "hfpatch.apply (set_attn_implementation?); its layers would attend within this rank's shard "
                    "only. Change it before hfpatch.apply, or patch.remove() and apply again."
                )
            if named.get("output_attentions"):
                raise ValueError(
                    f"{what}: output_attentions=True is not available under sequence parallelism"
                )
            for key in ("cache", "past_key_values"):
                if _cache_length(named.get(key)) > 0:
                    raise ValueError(
                        f"{what}: a KV cache holding {_cache_length(named[key])} tokens was passed; sequence "
                        "parallelism runs whole sequences (training, scoring, prefill). Generate under "
                        "`with patch.disabled():` or after patch.remove()."
                    )
            if split.output == "shard" and named.get("logits_to_keep", 0) not in (0, None):
                raise ValueError(f"{what}: logits_to_keep must be 0 with sp_output='shard'")
            check_same_inputs(named, split.group, what=what, enabled=bool(options["check_inputs"]))
            return average_input_gradients((args, kwargs), split.group)

        patch.add_forward_pre_hook(target, begin_call)
