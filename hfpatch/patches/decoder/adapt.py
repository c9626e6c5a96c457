"""What some decoders need beyond the common split, one adaptation per need, named in
:data:`hfpatch.patches.decoder.table.DECODER_NEEDS` by the decoder's class: each is a function
``(decoder, split, patch) -> None`` that installs its hooks or wrappers on this decoder object only.

* ``"deepstack"`` (Qwen3-VL, Qwen3-VL-MoE): the visual features added to the hidden states after early layers are
  those of this rank's visual tokens, in its shard's order.
* ``"position_ids"`` (Ministral 3): the attention scales each query by a function of its token's position
  (``get_llama_4_attn_scale(position_ids)``), so every layer gets this rank's shard of ``position_ids``, in the
  hidden states' order (cut once per forward).
* ``"per_layer_inputs"`` (Gemma 4's per-layer embeddings): computed for the whole sequence before the layers and
  multiplied into each layer's output, so the decoder's ``project_per_layer_inputs`` returns this rank's shard.
* ``"kv_shared_inputs"`` (Gemma 4's KV-sharing layers): the decoder slices its hidden states, per-layer inputs,
  rotary tables and masks to the last ``logits_to_keep`` positions before those layers (a no-op slice at 0, which
  hfpatch's mask object does not take). Under the split every position stays: the shared layers are per token
  for their queries (their keys and values are the earlier layer's), so the model's head, which slices the
  gathered hidden states to ``logits_to_keep`` itself, returns the unpatched logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...core.patch import Patch
from .sharding import DecoderSplit

__all__ = ["ADAPTATIONS", "adapt"]


def _deepstack(decoder: torch.nn.Module, split: DecoderSplit, patch: Patch) -> None:
    def local_deepstack(original_process: Callable) -> Callable:
        def deepstack_process(hidden_states, visual_pos_masks, visual_embeds):
            order = visual_pos_masks.reshape(-1).cumsum(0).view_as(visual_pos_masks) - 1
            local_mask = split.shard(visual_pos_masks, -1, fill=False)
            rows = split.shard(order, -1)[local_mask].to(visual_embeds.device)
            return original_process(hidden_states, local_mask, visual_embeds.index_select(0, rows))

        return deepstack_process

    patch.wrap_method(decoder, "_deepstack_process", local_deepstack)


def _position_ids(decoder: torch.nn.Module, split: DecoderSplit, patch: Patch) -> None:
    def shard_position_ids(_layer, args, kwargs):
        positions = kwargs.get("position_ids")
        if positions is None:
            raise RuntimeError(
                f"{type(decoder).__name__}: a layer was called without position_ids, which its attention reads "
                "for every token; sequence parallelism shards them with the hidden states"
            )
        kwargs["position_ids"] = split.sequence_input(positions)
        return args, kwargs

    for layer in decoder.layers:
        patch.add_forward_pre_hook(layer, shard_position_ids)


def _per_layer_inputs(decoder: torch.nn.Module, split: DecoderSplit, patch: Patch) -> None:
    def local_per_layer_inputs(original: Callable) -> Callable:
        def project_per_layer_inputs(
            inputs_embeds: torch.Tensor, per_layer_inputs: Any = None
        ) -> torch.Tensor:
            return split.shard(
                original(inputs_embeds, per_layer_inputs), 1
            )  # [B, S, layers, D] -> this rank's

        return project_per_layer_inputs

    patch.wrap_method(decoder, "project_per_layer_inputs", local_per_layer_inputs)


def _kv_shared_inputs(decoder: torch.nn.Module, split: DecoderSplit, patch: Patch) -> None:
    def whole(_original: Callable) -> Callable:
        def keep_kv_shared_inputs(
            hidden_states, per_layer_inputs, position_embeddings, masks, *args, **kwargs
        ):
            return hidden_states, per_layer_inputs, position_embeddings, masks

        return keep_kv_shared_inputs

    patch.wrap_method(decoder, "_maybe_slice_kv_shared_inputs", whole)


#: Need (as :data:`hfpatch.patches.decoder.table.DECODER_NEEDS` names it) -> its installer.
ADAPTATIONS: dict[str, Callable[[torch.nn.Module, DecoderSplit, Patch], None]] = {
    "deepstack": _deepstack,
    "position_ids": _position_ids,
    "per_layer_inputs": _per_layer_inputs,
    "kv_shared_inputs": _kv_shared_inputs,
}


def adapt(decoder: torch.nn.Module, needs: tuple[str, ...], split: DecoderSplit, patch: Patch) -> None:
    """Install the adaptations ``needs`` names on ``decoder`` (this object only, undone by ``patch.remove()``)."""
    for need in needs:
        ADAPTATIONS[need](decoder, split, patch)
