"""The decoder family's tables, as data: which transformers classes it patches, where each one's decoder and vision
tower are and what each needs beyond the common split (:data:`TARGETS`), what some decoder classes need wherever
they sit (:data:`DECODER_NEEDS`), and the classes refused, with the reason and what to do (:data:`REFUSED`).

Nothing here imports transformers: classes are named by registry key (``"transformers.Gemma3ForCausalLM"``), so the
registry reads the refusals and the docs' table is generated (:func:`support_table`, :func:`support_markdown`)
without building a model.

>>> TARGETS["transformers.Gemma3ForConditionalGeneration"].masks
'model'
>>> sorted(DECODER_NEEDS["transformers.Gemma4TextModel"])
['kv_shared_inputs', 'per_layer_inputs']
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DECODERS",
    "DECODER_NEEDS",
    "FRAME_TOWERS",
    "REFUSED",
    "TARGETS",
    "VISION",
    "Target",
    "support_markdown",
    "support_table",
]


@dataclass(frozen=True)
class Target:
    """One supported class: where its decoder is and what it needs.

    Attributes:
        family: The model family, as the docs' table names it.
        decoder: Path of the decoder (the module with ``layers``, ``norm`` and ``rotary_emb``), ``""`` for itself.
        vision: Path of a Qwen-style vision tower that attends within each frame (split by frames,
            ``sp_vision="split"``); ``None``: no tower, or one that runs whole on every rank.
        masks: Path of the module that builds the decoder's masks from its own config's ``get_text_config()``
            (Gemma 3/4 VLMs build them outside the decoder), ``""`` for itself; that module gets a config copy whose
            text config is the decoder's routed copy. ``None``: the decoder builds its masks.
        text_models: For a wrapper whose decoder is ``AutoModel(text_config)``: the decoder classes supported inside
            it (registry keys); any other is refused. Empty: the decoder's class is fixed by the model class.
        aux_loss: The class adds transformers' load-balancing loss (``load_balancing_loss_func`` of its modeling
            module) with ``output_router_logits=True``: computed from every rank's partial sums instead.
    """

    family: str
    decoder: str
    vision: str | None = None
    masks: str | None = None
    text_models: tuple[str, ...] = ()
    aux_loss: bool = False


def _pair(
    family: str,
    head: str,
    base: str,
    decoder: str,
    vision: str | None = None,
    masks: bool = False,
    text_models: tuple[str, ...] = (),
    aux_loss: bool = False,
) -> dict[str, Target]:
    """The rows of a model class with a head (``head``: its base model is its ``model``) and of that base model
    (``base``); paths are the base model's, the loss (``aux_loss``) is the head's."""
    return {
        f"transformers.{head}": Target(
            family, f"model.{decoder}" if decoder else "model", None if vision is None else f"model.{vision}",
            "model" if masks else None, text_models, aux_loss,
        ),
        f"transformers.{base}": Target(family, decoder, vision, "" if masks else None, text_models),
    }  # fmt: skip


#: The text decoders a wrapper may hold that the split supports as they are (plus the needs of
#: :data:`DECODER_NEEDS`).
_QWEN_LLAMA = ("transformers.Qwen2Model", "transformers.Qwen3Model", "transformers.LlamaModel")

#: Class key -> :class:`Target`. Read along the MRO (a subclass of a supported class is supported).
TARGETS: dict[str, Target] = {
    **_pair("Qwen3", "Qwen3ForCausalLM", "Qwen3Model", ""),
    **_pair("Llama", "LlamaForCausalLM", "LlamaModel", ""),
    **_pair("Qwen3-VL", "Qwen3VLForConditionalGeneration", "Qwen3VLModel", "language_model", "visual"),
    **_pair("Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel", "language_model", "visual"),
    **_pair("Qwen2-VL", "Qwen2VLForConditionalGeneration", "Qwen2VLModel", "language_model", "visual"),
    **_pair(
        "Qwen3-VL-MoE", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeModel", "language_model", "visual",
        aux_loss=True,
    ),
    **_pair("Gemma 3", "Gemma3ForCausalLM", "Gemma3TextModel", ""),
    **_pair("Gemma 3", "Gemma3ForConditionalGeneration", "Gemma3Model", "language_model", masks=True),
    **_pair("Gemma 4", "Gemma4ForCausalLM", "Gemma4TextModel", ""),
    **_pair("Gemma 4", "Gemma4ForConditionalGeneration", "Gemma4Model", "language_model", masks=True),
    **_pair("Mistral", "MistralForCausalLM", "MistralModel", ""),
    **_pair("Ministral", "MinistralForCausalLM", "MinistralModel", ""),
    **_pair("Ministral 3", "Ministral3ForCausalLM", "Ministral3Model", ""),
    **_pair(
        "Mistral 3", "Mistral3ForConditionalGeneration", "Mistral3Model", "language_model",
        text_models=("transformers.MistralModel", "transformers.Ministral3Model", "transformers.MinistralModel"),
    ),
    **_pair("GLM-4.1V", "Glm4vForConditionalGeneration", "Glm4vModel", "language_model", "visual"),
    **_pair("GLM-4.5V", "Glm4vMoeForConditionalGeneration", "Glm4vMoeModel", "language_model", "visual", aux_loss=True),
    **_pair(
        "GLM-4.6V", "Glm46VForConditionalGeneration", "Glm46VModel", "language_model", "visual",
        text_models=("transformers.Glm4vTextModel", "transformers.Glm4vMoeTextModel"),
    ),
    **_pair("InternVL", "InternVLForConditionalGeneration", "InternVLModel", "language_model", text_models=_QWEN_LLAMA),
}  # fmt: skip

#: Class key -> path of its decoder, ``""`` for itself (:data:`TARGETS`' paths).
DECODERS: dict[str, str] = {key: row.decoder for key, row in TARGETS.items()}
#: Class key -> path of its Qwen-style vision tower, split by frames (:data:`TARGETS`' paths).
VISION: dict[str, str] = {key: row.vision for key, row in TARGETS.items() if row.vision is not None}
#: The vision tower classes that attend within each frame (what ``sp_vision="split"`` cuts between frames); a
#: wrapper whose tower is another class runs it whole on every rank.
FRAME_TOWERS: frozenset[str] = frozenset(
    f"transformers.{name}"
    for name in (
        "Qwen3VLVisionModel", "Qwen2_5_VisionTransformerPretrainedModel", "Qwen2VisionTransformerPretrainedModel",
        "Qwen3VLMoeVisionModel", "Glm4vVisionModel", "Glm4vMoeVisionModel",
    )
)  # fmt: skip

#: Decoder class key -> what its layers need beyond the hidden states and the rotary tables, by name of an
#: adaptation (:mod:`hfpatch.patches.decoder.adapt`): ``"deepstack"`` (Qwen3-VL adds visual features after early
#: layers: each rank its own tokens'), ``"position_ids"`` (Ministral 3 scales the query by a function of each
#: token's position: the layers' ``position_ids`` are sharded like the hidden states), ``"per_layer_inputs"``
#: (Gemma 4's per-layer embeddings, computed for the whole sequence: sharded once), ``"kv_shared_inputs"`` (Gemma 4
#: slices the masks before its KV-sharing layers for ``logits_to_keep``: left whole, the gathered logits are cut
#: by the model's head as unpatched).
DECODER_NEEDS: dict[str, tuple[str, ...]] = {
    "transformers.Qwen3VLTextModel": ("deepstack",),
    "transformers.Qwen3VLMoeTextModel": ("deepstack",),
    "transformers.Ministral3Model": ("position_ids",),
    "transformers.Gemma4TextModel": ("per_layer_inputs", "kv_shared_inputs"),
}

_LINEAR = (
    "its linear_attention layers (Gated DeltaNet) run a causal depthwise convolution and a recurrent state "
    "across the whole sequence: a rank's shard would need the state of every earlier shard, which the split "
    "does not pass yet. What to do: run the model whole on each rank (data parallel, no sequence split)"
)
_LLAMA4 = (
    "its chunked-attention layers, the query temperature of its NoPE layers (computed from the local length, "
    "not the tokens' positions) and its complex rotary table are not carried by the split yet. What to do: run "
    "the model whole on each rank (data parallel, no sequence split)"
)
_SINKS = (
    "its attention has learned sinks (a per-head logit that joins every softmax row), which the "
    "sequence-parallel attention does not merge. What to do: run the model whole on each rank (data parallel, "
    "no sequence split)"
)

#: Class key -> why the decoder family does not split it, and what to do (``hfpatch.apply``'s error, the docs'
#: table); :data:`_REFUSED_FAMILY` names each one's family.
REFUSED: dict[str, str] = {}
_REFUSED_FAMILY: dict[str, str] = {}


def _refuse(family: str, classes: tuple[str, ...], reason: str) -> None:
    for name in classes:
        REFUSED[f"transformers.{name}"] = reason
        _REFUSED_FAMILY[f"transformers.{name}"] = family


_refuse(
    "Qwen3.5",
    ("Qwen3_5ForCausalLM", "Qwen3_5TextModel", "Qwen3_5ForConditionalGeneration", "Qwen3_5Model"),
    _LINEAR,
)
_refuse(
    "Qwen3.5-MoE",
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeModel"),
    _LINEAR,
)
_refuse("Qwen3-Next", ("Qwen3NextForCausalLM", "Qwen3NextModel"), _LINEAR)
_refuse("Llama 4", ("Llama4ForCausalLM", "Llama4TextModel"), _LLAMA4)
_refuse(
    "Llama 4",
    ("Llama4ForConditionalGeneration",),
    _LLAMA4.replace(
        ". What to do",
        "; its forward also fails upstream in transformers 5.24 (it reads outputs.image_outputs from the "
        "language model's output, which has none). What to do",
    ),
)
_refuse("GPT-OSS", ("GptOssForCausalLM", "GptOssModel"), _SINKS)


def support_table() -> list[tuple[str, str, str]]:
    """``(family, class name, how)`` for every class the decoder family splits or refuses, in table order: the
    decoder's path and the class's needs, or ``"refused: <reason>"``.

    >>> dict((name, how) for _, name, how in support_table())["InternVLModel"]
    'decoder language_model (Qwen2Model, Qwen3Model or LlamaModel); vision tower whole on every rank'
    """
    rows = []
    for key, row in TARGETS.items():
        how = [f"decoder {row.decoder or 'itself'}"]
        if row.text_models:
            names = [k.split(".", 1)[1] for k in row.text_models]
            how[0] += f" ({', '.join(names[:-1])} or {names[-1]})"
        if row.vision is not None:
            how.append(f"vision tower {row.vision} split by frames")
        elif row.decoder.endswith("language_model"):  # a VLM whose tower runs whole
            how.append("vision tower whole on every rank")
        if row.masks is not None:
            how.append(f"masks built by {row.masks or 'itself'}, routed")
        if row.aux_loss:
            how.append("load-balancing loss from every rank's sums")
        rows.append((row.family, key.split(".", 1)[1], "; ".join(how)))
    for key, reason in REFUSED.items():
        rows.append((_REFUSED_FAMILY[key], key.split(".", 1)[1], f"refused: {reason}"))
    return rows


def support_markdown() -> str:
    """The docs' table of decoder classes (``docs/capabilities/decoder-sequence-parallel.md``), from
    :func:`support_table`: one line per family and treatment, its classes together."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for family, name, how in support_table():
        grouped.setdefault((family, how), []).append(f"`{name}`")
    lines = ["| family | classes | how |", "|---|---|---|"]
    lines += [f"| {family} | {', '.join(names)} | {how} |" for (family, how), names in grouped.items()]
    return "\n".join(lines)
