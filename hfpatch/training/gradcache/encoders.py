"""How GradCache calls an encoder: the model under one wrapper layer, a sentence-transformers model told from a
plain module, the Qwen-VL spec of its config, its frozen vision tower run once and its features fed into each
chunk (``reuse_frozen_vision=True``), and the call of a chunk. :mod:`hfpatch.training.gradcache` re-exports
:func:`is_sentence_transformer`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..vlm_split import VisionTokenSpec

__all__ = [
    "call_encoder",
    "config_vision_spec",
    "frozen_vision_encoder",
    "inner_module",
    "is_sentence_transformer",
    "with_vision_features",
]


def inner_module(model: nn.Module) -> nn.Module:
    """The module a DDP-style wrapper holds (its ``.module``, one layer), else ``model`` itself.

    >>> import torch
    >>> layer = torch.nn.Linear(2, 2)
    >>> inner_module(layer) is layer
    True
    """
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def config_vision_spec(model: nn.Module) -> VisionTokenSpec | None:
    """The Qwen-VL token spec read from ``model``'s config (one wrapper layer unwrapped); ``None`` for a model
    that is no vision-language model (its media keys then raise when split).

    >>> import torch
    >>> config_vision_spec(torch.nn.Linear(2, 2)) is None
    True
    """
    config = getattr(inner_module(model), "config", None)
    try:
        return VisionTokenSpec.from_config(config) if config is not None else None
    except ValueError:
        return None  # not a vision-language model: media keys will raise in split_inputs


def frozen_vision_encoder(model: nn.Module) -> nn.Module:
    """The Qwen-VL base model (the module with ``get_image_features`` and a ``visual`` tower) inside ``model``
    (peft/DDP wrappers included), checked to have a frozen tower."""
    for module in model.modules():
        visual = module._modules.get("visual")  # its own child (a peft wrapper forwards attribute lookups)
        if isinstance(visual, nn.Module) and callable(getattr(module, "get_image_features", None)):
            trainable = [n for n, p in visual.named_parameters() if p.requires_grad]
            if trainable:
                raise ValueError(
                    f"reuse_frozen_vision=True but the vision tower of {type(module).__name__} has trainable "
                    f"parameters ({trainable[:3]}...); their gradients would be lost. Freeze the tower "
                    "(requires_grad_(False)) or leave reuse_frozen_vision off."
                )
            if "mm_encoder_outputs" not in inspect.signature(module.forward).parameters:
                # An older transformers takes it into **kwargs and ignores it: text-only embeddings, wrong grads.
                import transformers

                raise ValueError(
                    f"reuse_frozen_vision=True needs a transformers release whose {type(module).__name__}.forward "
                    f"takes mm_encoder_outputs (5.24 does; the installed {transformers.__version__} does not, and "
                    "would ignore the cached tower outputs); upgrade transformers or leave reuse_frozen_vision off."
                )
            return module
    raise ValueError(
        f"reuse_frozen_vision=True needs a Qwen2-VL/Qwen2.5-VL/Qwen3-VL model (a module with get_image_features "
        f"and a visual tower); {type(model).__name__} has none."
    )


def with_vision_features(encoder: nn.Module, chunk: Mapping[str, Any]) -> dict[str, Any]:
    """``chunk`` with pixels replaced by the vision tower's outputs, as the model's ``mm_encoder_outputs``."""
    features = {}
    if chunk.get("pixel_values") is not None:
        features["image"] = encoder.get_image_features(
            chunk["pixel_values"], chunk["image_grid_thw"], return_dict=True
        )
    if chunk.get("pixel_values_videos") is not None:
        features["video"] = encoder.get_video_features(
            chunk["pixel_values_videos"], chunk["video_grid_thw"], return_dict=True
        )
    out = {k: v for k, v in chunk.items() if k not in ("pixel_values", "pixel_values_videos")}
    out["mm_encoder_outputs"] = features  # every present modality: the model computes (and stores) nothing
    return out


def is_sentence_transformer(model: Any) -> bool:
    """Whether ``model`` (DDP/``torch.compile`` wrappers unwrapped) is a sentence-transformers model
    (``SentenceTransformer`` and its siblings: ``model(features_dict)`` returning a dict). Never imports
    sentence_transformers: a model of it can only exist once it is imported.

    >>> import torch
    >>> is_sentence_transformer(torch.nn.Linear(2, 2))
    False
    """
    if sys.modules.get("sentence_transformers") is None or not isinstance(model, nn.Module):
        return False
    try:
        from sentence_transformers.base.model import BaseModel  # sentence-transformers >= 6
    except ImportError:  # pragma: no cover - older layout
        try:
            from sentence_transformers import SentenceTransformer as BaseModel
        except ImportError:
            return False
    model = inner_module(model)
    return isinstance(getattr(model, "_orig_mod", model), BaseModel)


def call_encoder(model: nn.Module, chunk: Any, features_dict: bool = False) -> Any:
    """``model`` on ``chunk``: ``model(dict(chunk))`` with ``features_dict`` (sentence-transformers), else
    ``model(**chunk)`` for a mapping, ``model(*chunk)`` for a tuple or list, ``model(chunk)`` otherwise.

    >>> import torch
    >>> call_encoder(torch.nn.Linear(2, 3), torch.ones(4, 2)).shape
    torch.Size([4, 3])
    """
    if features_dict:
        # sentence-transformers modules write their outputs (token_embeddings, ...) into the dict they get:
        # a shallow copy keeps them out of the chunk, which pass 2 reuses.
        return model(dict(chunk))
    if isinstance(chunk, Mapping):
        return model(**chunk)
    if isinstance(chunk, (tuple, list)):
        return model(*chunk)
    return model(chunk)
