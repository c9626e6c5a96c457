"""Pool token states into one embedding per sample: last-token, mean and CLS, for left or right padding.

>>> import torch
>>> hidden = torch.arange(8.0).view(2, 4, 1)                  # two samples, four positions
>>> mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])         # right-padded, left-padded
>>> pool(hidden, mask, "last").flatten().tolist()             # last real token of each row
[2.0, 7.0]
>>> pool(hidden, mask, "cls").flatten().tolist()              # first real token of each row
[0.0, 5.0]
>>> pool(hidden, mask, "mean").flatten().tolist()
[1.0, 6.0]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

__all__ = ["Pooling", "default_rep", "pool"]

Pooling = Literal["last", "mean", "cls"]


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, mode: Pooling = "last") -> torch.Tensor:
    """Pool ``hidden`` ``[B, L, D]`` to ``[B, D]``.

    Args:
        hidden: Token states.
        attention_mask: ``[B, L]``, 1 for real tokens; ``None`` means no padding.
        mode: ``"last"``: the last real token (what decoder embedders such as Qwen3-Embedding and VLM2Vec use);
            ``"mean"``: mean over real tokens; ``"cls"``: the first real token (BERT-style encoders).
            Positions come from the mask, so left and right padding give the same result.
    """
    if hidden.ndim != 3:
        raise ValueError(f"pool expects token states [B, L, D], got shape {tuple(hidden.shape)}.")
    batch, length, _ = hidden.shape
    if attention_mask is None:
        attention_mask = torch.ones(batch, length, dtype=torch.long, device=hidden.device)
    if attention_mask.shape != (batch, length):
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match hidden {tuple(hidden.shape)}."
        )
    mask = attention_mask.to(hidden.device).bool()
    rows = torch.arange(batch, device=hidden.device)
    if mode == "last":
        # argmax returns the first maximum: on the flipped mask that is the last real token, for either padding.
        return hidden[rows, length - 1 - mask.flip(-1).int().argmax(-1)]
    if mode == "cls":
        return hidden[rows, mask.int().argmax(-1)]
    if mode == "mean":
        weights = mask.to(hidden.dtype).unsqueeze(-1)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
    raise ValueError(f"unknown pooling {mode!r}; expected 'last', 'mean' or 'cls'.")


def default_rep(output: Any, inputs: Any, mode: Pooling = "last") -> torch.Tensor:
    """Turn a model output into ``[B, D]`` embeddings.

    A ``[B, D]`` tensor, the ``"sentence_embedding"`` of a sentence-transformers output dict, or the one
    embedding a transformers output documents (``text_embeds`` of ``CLIPTextModelWithProjection``,
    ``image_embeds`` of ``CLIPVisionModelWithProjection``, SigLIP's alike) is returned as is (an output with
    both, ``CLIPModel``'s, is refused: say which with ``rep_fn``); ``[B, L, D]`` token states (a tensor, ``last_hidden_state`` of a
    ``ModelOutput``/dict, else its last ``hidden_states`` entry as in a ``*ForCausalLM`` output with
    ``output_hidden_states=True``, or the first element of a tuple) are pooled with
    ``inputs["attention_mask"]`` when the inputs are a mapping that has one. A bare tensor input means no
    padding; positional (tuple) inputs are refused for token states, since which of them is the mask is
    unknown.
    """
    if isinstance(output, Mapping) and isinstance(output.get("sentence_embedding"), torch.Tensor):
        return output["sentence_embedding"]  # a sentence-transformers model's (already pooled) output
    embeds = _documented_embeddings(output)
    if embeds is not None:
        return embeds
    if isinstance(output, Mapping) or hasattr(output, "last_hidden_state"):
        get = output.get if isinstance(output, Mapping) else lambda key: getattr(output, key, None)
        hidden = get("last_hidden_state")
        if hidden is None and get("hidden_states") is not None:
            hidden = get("hidden_states")[-1]
    elif isinstance(output, (tuple, list)):
        hidden = output[0]
    else:
        hidden = output
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(
            f"cannot find embeddings in a model output of type {type(output).__name__}; expected a tensor, a "
            "ModelOutput with last_hidden_state (or hidden_states: call the model with "
            "output_hidden_states=True), or a tuple. Pass rep_fn=... to GradCache."
        )
    if hidden.ndim == 2:
        return hidden
    if isinstance(inputs, (tuple, list)):
        raise TypeError(
            "cannot pool token states of positional (tuple) inputs: which of them is the attention mask is "
            "unknown. Pass the inputs as a dict/BatchEncoding with 'attention_mask', or rep_fn=... to GradCache."
        )
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    return pool(hidden, mask, mode)


#: The projected embeddings transformers' contrastive towers document in their outputs (CLIP, SigLIP, ...).
EMBEDDING_FIELDS = ("text_embeds", "image_embeds")


def _documented_embeddings(output: Any) -> torch.Tensor | None:
    """The one ``text_embeds``/``image_embeds`` tensor of ``output``; None without; an error with both."""
    if not (isinstance(output, Mapping) or hasattr(output, "last_hidden_state")):
        return None
    get = output.get if isinstance(output, Mapping) else lambda key: getattr(output, key, None)
    found = {k: get(k) for k in EMBEDDING_FIELDS if isinstance(get(k), torch.Tensor)}
    if len(found) > 1:
        raise TypeError(
            f"the model output ({type(output).__name__}) holds both {' and '.join(found)}: which one is this "
            "input's embedding is ambiguous. Run each tower on its own input (CLIPModel's text_model + "
            "text_projection, or CLIPTextModelWithProjection / CLIPVisionModelWithProjection) or pass "
            "rep_fn=lambda output, chunk: output.text_embeds (or image_embeds) to GradCache."
        )
    return next(iter(found.values()), None)
