"""Convert Self-Forcing / CausVid / LongLive generator checkpoints (native Wan keys) to diffusers keys.

Those projects train the original Wan code (``wan/modules/model.py``, wrapped as ``CausalWanModel``), so
their checkpoints use the native Wan layout, usually under a wrapper prefix. The mapping assumed here
(the same as diffusers' ``convert_wan_transformer_to_diffusers`` for the text-to-video model):

=====================================  ===========================================================
native                                 diffusers ``WanTransformer3DModel``
=====================================  ===========================================================
``patch_embedding.*``                  ``patch_embedding.*``
``text_embedding.{0,2}.*``             ``condition_embedder.text_embedder.linear_{1,2}.*``
``time_embedding.{0,2}.*``             ``condition_embedder.time_embedder.linear_{1,2}.*``
``time_projection.1.*``                ``condition_embedder.time_proj.*``
``blocks.N.self_attn.{q,k,v,o}.*``     ``blocks.N.attn1.{to_q,to_k,to_v,to_out.0}.*``
``blocks.N.self_attn.norm_{q,k}.*``    ``blocks.N.attn1.norm_{q,k}.*``
``blocks.N.cross_attn.*``              ``blocks.N.attn2.*`` (same sub-names as ``self_attn``)
``blocks.N.norm3.*``                   ``blocks.N.norm2.*`` (native norm3 is the cross-attention norm)
``blocks.N.ffn.{0,2}.*``               ``blocks.N.ffn.net.0.proj.*``, ``blocks.N.ffn.net.2.*``
``blocks.N.modulation``                ``blocks.N.scale_shift_table``
``head.head.*``                        ``proj_out.*``
``head.modulation``                    ``scale_shift_table``
=====================================  ===========================================================

Wrappers removed first: a top-level ``{"generator_ema": ...}`` / ``{"generator": ...}`` dict (Self-Forcing
saves both; EMA is preferred), key prefixes ``model.``, ``module.``, ``diffusion_model.``,
``base_model.model.`` (peft), and ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``, ``_orig_mod.``
anywhere in a key. A LongLive LoRA saved in peft layout (``X.base_layer.weight``, ``X.lora_A[.name].weight``,
``X.lora_B[.name].weight``) is merged: ``W = W_base + (lora_alpha / rank) * B @ A``.

>>> from hfpatch.streaming.convert import convert_diffusers_to_native, convert_native_to_diffusers
>>> from hfpatch.testing import tiny_wan_transformer
>>> model = tiny_wan_transformer()
>>> native = {"model." + k: v for k, v in convert_diffusers_to_native(model.state_dict()).items()}
>>> sorted(native)[:2]
['model.blocks.0.cross_attn.k.bias', 'model.blocks.0.cross_attn.k.weight']
>>> model.load_state_dict(convert_native_to_diffusers({"generator": native}), strict=True)
<All keys matched successfully>
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = ["convert_diffusers_to_native", "convert_native_to_diffusers"]

_TOP_MODULES = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
}
_TOP_PARAMS = {"head.modulation": "scale_shift_table"}
_ATTN = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "norm_q": "norm_q", "norm_k": "norm_k"}
_BLOCK_MODULES = {
    **{f"self_attn.{a}": f"attn1.{b}" for a, b in _ATTN.items()},
    **{f"cross_attn.{a}": f"attn2.{b}" for a, b in _ATTN.items()},
    "norm3": "norm2",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_BLOCK_PARAMS = {"modulation": "scale_shift_table"}

_INFIX = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_PREFIXES = ("base_model.model.", "model.", "module.", "diffusion_model.")
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


def _rename(
    key: str,
    modules: dict[str, str],
    params: dict[str, str],
    block_modules: dict[str, str],
    block_params: dict[str, str],
) -> str | None:
    """Rename one key with the given tables, or ``None`` if no rule matches."""
    prefix, rest = "", key
    match = re.match(r"^(blocks\.\d+\.)(.+)$", key)
    if match:
        prefix, rest = match.groups()
        modules, params = block_modules, block_params
    if rest in params:
        return prefix + params[rest]
    module, _, leaf = rest.rpartition(".")
    if leaf in ("weight", "bias") and module in modules:
        return f"{prefix}{modules[module]}.{leaf}"
    return None


def _unwrap(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name in ("generator_ema", "generator"):
        if isinstance(checkpoint.get(name), Mapping):
            checkpoint = checkpoint[name]
            break
    out = {}
    for key, value in checkpoint.items():
        for infix in _INFIX:
            key = key.replace(infix, "")
        stripped = True
        while stripped:
            stripped = False
            for prefix in _PREFIXES:
                if key.startswith(prefix):
                    key, stripped = key[len(prefix) :], True
        out[key] = value
    return out


def _merge_lora(state: dict[str, torch.Tensor], lora_alpha: float | None) -> dict[str, torch.Tensor]:
    """Fold peft LoRA pairs into their base weights; drop the ``base_layer`` level."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _LORA.match(key)
        if match:
            pairs.setdefault(match["module"], {})[match["which"]] = value
        elif ".lora_" in key:
            raise ValueError(f"unsupported LoRA tensor {key!r} (only lora_A/lora_B weights, no DoRA/biases)")
        else:
            out[key.replace(".base_layer.", ".")] = value
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"} or f"{module}.weight" not in out:
            raise ValueError(
                f"LoRA of {module!r} needs lora_A, lora_B and a base weight; found {sorted(pair)}"
            )
        a, b = pair["A"], pair["B"]
        scale = 1.0 if lora_alpha is None else lora_alpha / a.shape[0]
        base = out[f"{module}.weight"]
        out[f"{module}.weight"] = (base.float() + scale * (b.float() @ a.float())).to(base.dtype)
    return out


def convert_native_to_diffusers(
    checkpoint: Mapping[str, torch.Tensor], lora_alpha: float | None = None
) -> dict[str, torch.Tensor]:
    """Native (Self-Forcing / LongLive) Wan generator state dict -> ``WanTransformer3DModel`` state dict.

    Args:
        checkpoint: A state dict, or a Self-Forcing checkpoint dict with ``generator_ema``/``generator``.
        lora_alpha: LoRA alpha of a peft LoRA in the checkpoint (scale ``alpha / rank``); ``None`` means
            scale 1 (alpha equal to the rank, as LongLive's released config).

    Returns:
        A state dict for ``transformer.load_state_dict(..., strict=True)``.

    Raises:
        ValueError: For keys no rule maps (listed), or incomplete LoRA pairs.
    """
    state = _merge_lora(_unwrap(checkpoint), lora_alpha)
    out, unknown = {}, []
    for key, value in state.items():
        new = _rename(key, _TOP_MODULES, _TOP_PARAMS, _BLOCK_MODULES, _BLOCK_PARAMS)
        if new is None:
            unknown.append(key)
        else:
            out[new] = value
    if unknown:
        raise ValueError(
            f"{len(unknown)} native keys have no diffusers name (first: {unknown[:5]}); this converter covers the "
            "text-to-video Wan layout documented in hfpatch.streaming.convert"
        )
    return out


def convert_diffusers_to_native(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``WanTransformer3DModel`` state dict -> native Wan keys (the inverse of :func:`convert_native_to_diffusers`)."""

    def invert(table: dict[str, str]) -> dict[str, str]:
        return {v: k for k, v in table.items()}

    out, unknown = {}, []
    for key, value in state_dict.items():
        new = _rename(
            key, invert(_TOP_MODULES), invert(_TOP_PARAMS), invert(_BLOCK_MODULES), invert(_BLOCK_PARAMS)
        )
        if new is None:
            unknown.append(key)
        else:
            out[new] = value
    if unknown:
        raise ValueError(f"{len(unknown)} diffusers keys have no native name (first: {unknown[:5]})")
    return out
