"""How :class:`hfpatch.training.gradcache.GradCache` calls an encoder: the model under its wrappers (DDP, FSDP,
accelerate, ``torch.compile``), a sentence-transformers model told from a plain module, the vision tower of a
VLM frozen and its features fed into each chunk, the batch length of a chunk, and the compiled forwards, one
per kind of chunk. :mod:`hfpatch.training.gradcache` re-exports the public name here.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .vlm_split import VisionTokenSpec


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, Mapping):
        return [v for v in x.values() if isinstance(v, torch.Tensor)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def _vision_spec(model: nn.Module) -> VisionTokenSpec | None:
    config = getattr(_unwrap(model), "config", None)
    try:
        return VisionTokenSpec.from_config(config) if config is not None else None
    except ValueError:
        return None  # not a vision-language model: media keys will raise in split_inputs


def _frozen_vision_encoder(model: nn.Module) -> nn.Module:
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


def _with_vision_features(encoder: nn.Module, chunk: Mapping[str, Any]) -> dict[str, Any]:
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
    model = _unwrap(model)
    return isinstance(getattr(model, "_orig_mod", model), BaseModel)


def _call(model: nn.Module, chunk: Any, features_dict: bool = False) -> Any:
    if features_dict:
        # sentence-transformers modules write their outputs (token_embeddings, ...) into the dict they get:
        # a shallow copy keeps them out of the chunk, which pass 2 reuses.
        return model(dict(chunk))
    if isinstance(chunk, Mapping):
        return model(**chunk)
    if isinstance(chunk, (tuple, list)):
        return model(*chunk)
    return model(chunk)


def _batch_len(chunk: Any) -> int | None:
    if isinstance(chunk, Mapping):
        for key in ("input_ids", "attention_mask", "inputs_embeds"):
            if isinstance(chunk.get(key), torch.Tensor):
                return chunk[key].shape[0]
        return None
    tensors = _tensors(chunk)
    return tensors[0].shape[0] if tensors else None


class _CompiledForwards:
    """The encoders' ``forward`` through ``torch.compile``, one compiled copy per kind of chunk call.

    A kind is (the module, its forward, autograd on or off, autocast state, the chunk's tensor shapes and
    dtypes): pass 1 runs without a graph, pass 2 (and the kept chunk) with one, and a smaller last chunk has
    shapes of its own. Each kind gets its own code object (:func:`~hfpatch.core.compile.compiled_variant`), so
    each compiles once, with static shapes, and no graph is ever recompiled: a batch of equal chunks costs
    two compilations (with and without a graph), a smaller last chunk two more. Nothing is padded, so every
    chunk computes what the eager forward computes. The compiled forward is installed on the innermost module
    (inside DDP/FSDP/accelerate wrappers, whose own forward runs as usual) for the duration of each chunk call
    only. Random ops keep torch's generator (inductor's ``fallback_random``), so dropout masks replay exactly
    in pass 2 and equal the eager ones.
    """

    #: Kinds kept compiled at once; beyond that the least recently used is dropped (recompiled if it returns).
    MAX_KINDS = 8

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.variants: dict[tuple, Callable[..., Any]] = {}
        self.warned = False

    def _kind(self, inner: nn.Module, forward: Any, chunk: Any) -> tuple:
        device_type = next((t.device.type for t in _tensors(chunk)), "cpu")
        autocast = torch.is_autocast_enabled(device_type)
        return (
            id(inner),
            getattr(forward, "__func__", forward),
            torch.is_grad_enabled(),
            autocast,
            torch.get_autocast_dtype(device_type) if autocast else None,
            tuple((tuple(t.shape), t.dtype, t.device) for t in _tensors(chunk)),
        )

    def _variant(self, kind: tuple, forward: Callable[..., Any]) -> Callable[..., Any]:
        from ..core.compile import compiled_variant

        variant = self.variants.pop(kind, None)
        if variant is None:
            if len(self.variants) >= self.MAX_KINDS:
                self.variants.pop(next(iter(self.variants)))
                if not self.warned:
                    self.warned = True
                    import warnings

                    warnings.warn(
                        f"GradCache(compile=True) met more than {self.MAX_KINDS} kinds of chunk (shapes, grad mode, "
                        "autocast); every new kind compiles again. Pad the inputs to a fixed length (e.g. a "
                        "tokenizer's padding='max_length') so chunks share their shapes.",
                        stacklevel=4,
                    )

            def chunk_forward(*args: Any, **kwargs: Any) -> Any:
                return forward(*args, **kwargs)

            tag = f"GradCache chunk {'with' if kind[2] else 'without'} graph #{len(self.variants)}"
            variant = compiled_variant(
                chunk_forward, tag, backend=self.backend, fullgraph=False, options={"fallback_random": True}
            )
        self.variants[kind] = variant  # most recently used last
        return variant

    @contextlib.contextmanager
    def installed(self, model: nn.Module, chunk: Any) -> Iterator[None]:
        """The innermost module's ``forward`` is the compiled one of this chunk's kind inside the block."""
        from ..core.wrappers import unwrap_model

        inner = unwrap_model(model)
        previous = inner.__dict__.get("forward")  # an instance-level forward (accelerate's wrappers) or None
        forward = inner.forward
        inner.forward = self._variant(self._kind(inner, forward, chunk), forward)
        try:
            yield
        finally:
            if previous is None:
                del inner.forward
            else:
                inner.forward = previous
