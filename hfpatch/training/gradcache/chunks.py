"""The chunks GradCache runs an encoder on: the default split of one encoder input into chunks of whole samples
(:func:`split_inputs`; Qwen-VL media by :mod:`hfpatch.training.vlm_split`), the tensors of a chunk and its
number of samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..vlm_split import VisionTokenSpec, has_grids, has_media, split_vlm_inputs

__all__ = ["batch_len", "chunk_tensors", "split_inputs"]


def split_inputs(
    inputs: Any,
    chunk_size: int | None,
    *,
    chunk_patches: int | None = None,
    vision_spec: VisionTokenSpec | None = None,
) -> list[Any]:
    """Default split of one encoder input into chunks of whole samples.

    - tensor: along dim 0;
    - tuple/list of tensors (positional model arguments): each along dim 0, chunks are tuples;
    - mapping (``dict``, ``BatchEncoding``): Qwen-VL media (grids present, or media keys with a
      ``vision_spec``) -> :func:`split_vlm_inputs`; otherwise every ``[B, ...]`` tensor by sample (CLIP-style
      ``pixel_values`` ``[B, C, H, W]`` too), other values shared.

    Raises:
        ValueError: A mapping tensor whose first dimension is not the batch size (e.g. Qwen-VL
            ``pixel_values`` without ``image_grid_thw``), or grids without a ``vision_spec``.
    """
    if isinstance(inputs, torch.Tensor):
        if chunk_size is None:
            raise ValueError(
                "chunk_patches applies to inputs with Qwen-VL media only; give chunk_size for tensors."
            )
        return list(inputs.split(chunk_size))
    if isinstance(inputs, (tuple, list)):
        parts = [split_inputs(x, chunk_size) for x in inputs]
        if len({len(p) for p in parts}) != 1:
            raise ValueError(f"positional inputs have different batch sizes: {[len(x) for x in inputs]}.")
        return [type(inputs)(chunk) for chunk in zip(*parts)]
    if isinstance(inputs, Mapping):
        if has_grids(inputs) or (vision_spec is not None and has_media(inputs)):
            if vision_spec is None:
                raise ValueError(
                    "inputs carry Qwen-VL grids (image_grid_thw/video_grid_thw) but the encoder config has no "
                    "image_token_id/vision_config.spatial_merge_size; pass vision_spec=VisionTokenSpec(...)."
                )
            return split_vlm_inputs(inputs, vision_spec, chunk_size, chunk_patches)
        sizes = {k: v.shape[0] for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.ndim > 0}
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"cannot split a model input by sample: tensors have different first dimensions {sizes}. "
                "Pass split_fn=... for this layout."
            )
        if chunk_size is None:
            raise ValueError(
                "chunk_patches applies to inputs with Qwen-VL media only; this input has none, so "
                "also give chunk_size (samples per chunk)."
            )
        batch = next(iter(sizes.values()))
        return [
            {
                k: v[s : s + chunk_size] if isinstance(v, torch.Tensor) and v.ndim > 0 else v
                for k, v in inputs.items()
            }
            for s in range(0, batch, chunk_size)
        ]
    raise TypeError(
        f"cannot split an input of type {type(inputs).__name__}; expected a tensor, a tuple of tensors, a dict "
        "or a BatchEncoding. Pass split_fn=... to GradCache."
    )


def chunk_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors of an encoder input or chunk: a tensor, a mapping's tensor values, a tuple's or list's
    (nested), in order; nothing else.

    >>> import torch
    >>> [t.shape for t in chunk_tensors({"input_ids": torch.ones(2, 3), "mode": "last"})]
    [torch.Size([2, 3])]
    """
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, Mapping):
        return [v for v in x.values() if isinstance(v, torch.Tensor)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in chunk_tensors(v)]
    return []


def batch_len(chunk: Any) -> int | None:
    """The samples of an encoder input or chunk: the first dimension of a mapping's ``input_ids``,
    ``attention_mask`` or ``inputs_embeds`` (``None`` without them), else of its first tensor (``None``: none).

    >>> import torch
    >>> batch_len({"input_ids": torch.ones(4, 7)}), batch_len((torch.ones(3, 2),)), batch_len("text")
    (4, 3, None)
    """
    if isinstance(chunk, Mapping):
        for key in ("input_ids", "attention_mask", "inputs_embeds"):
            if isinstance(chunk.get(key), torch.Tensor):
                return chunk[key].shape[0]
        return None
    tensors = chunk_tensors(chunk)
    return tensors[0].shape[0] if tensors else None
