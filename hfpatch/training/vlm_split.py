"""Split Qwen2-VL / Qwen2.5-VL / Qwen3-VL model inputs into chunks of whole samples (pure tensor code).

A Qwen-VL processor batch is not "batch first" everywhere. ``input_ids``, ``attention_mask`` and
``mm_token_type_ids`` are ``[B, L]``, but ``pixel_values`` holds the patches of *all* images of the batch
one after another (``[sum_i t_i*h_i*w_i, C*tp*p*p]``), ``image_grid_thw`` has one ``(t, h, w)`` row per image
(not per sample), and the same holds for videos (``pixel_values_videos``, ``video_grid_thw``,
``second_per_grid_ts``). Slicing ``pixel_values[:n]`` for the first ``n`` samples runs without error and
feeds the wrong patches to the vision tower, so this module never slices media by sample count: it derives
how many images and videos each sample owns and cuts the media by those counts.

How images are assigned to samples. Sample ``i`` holds ``n_i`` image placeholder tokens
(``input_ids == image_token_id``; ``mm_token_type_ids == 1`` when ``input_ids`` is absent). Image ``j``
fills ``k_j = t_j*h_j*w_j / merge**2`` placeholders (``merge`` = ``spatial_merge_size``), and the processor
lists the images in sample order. The images of sample ``i`` are therefore the next rows of
``image_grid_thw`` whose ``k_j`` add up to exactly ``n_i``; since every ``k_j > 0`` this assignment is
unique, and any mismatch is an error. This is more robust than counting ``<vision_start>`` tokens, whose
number per video differs between Qwen2-VL (one per video) and Qwen3-VL (one per frame). Videos work the same
with ``video_token_id`` (``mm_token_type_ids == 2``).

>>> import torch
>>> spec = VisionTokenSpec(image_token_id=9, video_token_id=8, spatial_merge_size=2)
>>> batch = {
...     "input_ids": torch.tensor([[1, 9, 9, 0], [1, 2, 3, 0], [9, 9, 9, 9]]),   # 2, 0 and 4 image tokens
...     "image_grid_thw": torch.tensor([[1, 2, 4], [1, 4, 4]]),                  # 8 and 16 patches
...     "pixel_values": torch.randn(24, 12),
... }
>>> chunks = split_vlm_inputs(batch, spec, chunk_size=2)
>>> [sorted(c) for c in chunks]
[['image_grid_thw', 'input_ids', 'pixel_values'], ['image_grid_thw', 'input_ids', 'pixel_values']]
>>> [tuple(c["pixel_values"].shape) for c in chunks]
[(8, 12), (16, 12)]
>>> [len(c) for c in split_vlm_inputs(batch, spec, chunk_size=1)]   # the text-only sample has no media keys
[3, 1, 3]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MEDIA_KEYS",
    "VisionTokenSpec",
    "has_grids",
    "has_media",
    "media_per_sample",
    "plan_chunks",
    "split_vlm_inputs",
    "validate_vlm_chunk",
]


@dataclass(frozen=True)
class _Modality:
    grid: str  # (t, h, w) rows, one per image/video
    pixels: str  # patch rows, sum of t*h*w
    per_item: tuple[str, ...]  # further keys with one entry per image/video
    token_type: int  # value in mm_token_type_ids


_IMAGE = _Modality("image_grid_thw", "pixel_values", (), 1)
_VIDEO = _Modality("video_grid_thw", "pixel_values_videos", ("second_per_grid_ts",), 2)

#: Keys cut per image/video rather than per sample.
MEDIA_KEYS = frozenset(
    {_IMAGE.grid, _IMAGE.pixels, *_IMAGE.per_item, _VIDEO.grid, _VIDEO.pixels, *_VIDEO.per_item}
)


@dataclass(frozen=True)
class VisionTokenSpec:
    """Placeholder token ids and the merge factor that relate vision patches to LLM tokens.

    Args:
        image_token_id: Id of the image placeholder token in ``input_ids``.
        video_token_id: Id of the video placeholder token (``None`` if the model has no video input).
        spatial_merge_size: Patches merged per side into one LLM token (2 for all Qwen-VL releases).
    """

    image_token_id: int
    video_token_id: int | None
    spatial_merge_size: int

    @classmethod
    def from_config(cls, config: Any) -> VisionTokenSpec:
        """Read the spec from a Qwen2-VL/Qwen2.5-VL/Qwen3-VL config (duck-typed, no transformers import).

        Raises:
            ValueError: The config lacks ``image_token_id`` or ``vision_config.spatial_merge_size``.
        """
        image = getattr(config, "image_token_id", None)
        vision = getattr(config, "vision_config", None)
        merge = getattr(vision, "spatial_merge_size", None)
        if image is None or merge is None:
            raise ValueError(
                f"{type(config).__name__} has no image_token_id / vision_config.spatial_merge_size; expected a "
                "Qwen2-VL, Qwen2.5-VL or Qwen3-VL config. Pass VisionTokenSpec(...) explicitly for other models."
            )
        return cls(int(image), getattr(config, "video_token_id", None), int(merge))

    def _token_id(self, modality: _Modality) -> int | None:
        return self.image_token_id if modality is _IMAGE else self.video_token_id


def has_media(inputs: Mapping[str, Any]) -> bool:
    """Whether a model-input mapping carries Qwen-VL media keys (so that it must be split with this module)."""
    return any(inputs.get(key) is not None for key in MEDIA_KEYS)


def has_grids(inputs: Mapping[str, Any]) -> bool:
    """Whether a model-input mapping carries Qwen-VL grids (``image_grid_thw``/``video_grid_thw``): what sets
    Qwen-VL pixels (rows of patches) apart from ``[B, C, H, W]`` ``pixel_values`` of CLIP-style towers."""
    return any(inputs.get(modality.grid) is not None for modality in (_IMAGE, _VIDEO))


def _batch_size(inputs: Mapping[str, Any]) -> int:
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "inputs_embeds"):
        value = inputs.get(key)
        if isinstance(value, torch.Tensor):
            return value.shape[0]
    raise ValueError(
        f"cannot tell the batch size of a Qwen-VL input with keys {sorted(inputs)}: expected input_ids, "
        "attention_mask, mm_token_type_ids or inputs_embeds ([B, L] tensors)."
    )


def _placeholders_per_sample(
    inputs: Mapping[str, Any], spec: VisionTokenSpec, modality: _Modality
) -> torch.Tensor:
    ids = inputs.get("input_ids")
    token_id = spec._token_id(modality)
    if isinstance(ids, torch.Tensor) and token_id is not None:
        return (ids == token_id).sum(-1).cpu()
    types = inputs.get("mm_token_type_ids")
    if isinstance(types, torch.Tensor):
        return (types == modality.token_type).sum(-1).cpu()
    raise ValueError(
        f"'{modality.grid}' is given but neither input_ids (with a {modality.grid.split('_')[0]} token id in the "
        "VisionTokenSpec) nor mm_token_type_ids is, so the media cannot be assigned to samples."
    )


def _grid(inputs: Mapping[str, Any], modality: _Modality) -> torch.Tensor | None:
    grid = inputs.get(modality.grid)
    if grid is None:
        if inputs.get(modality.pixels) is not None:
            raise ValueError(
                f"'{modality.pixels}' is given without '{modality.grid}'; pass both (processor output)."
            )
        return None
    grid = torch.as_tensor(grid)
    if grid.ndim != 2 or grid.shape[-1] != 3:
        raise ValueError(
            f"'{modality.grid}' must have shape [num_items, 3] (t, h, w), got {tuple(grid.shape)}."
        )
    return grid


def _tokens_per_item(grid: torch.Tensor, spec: VisionTokenSpec, modality: _Modality) -> list[int]:
    patches = grid.prod(-1).tolist()
    merge2 = spec.spatial_merge_size**2
    bad = [p for p in patches if p <= 0 or p % merge2]
    if bad:
        raise ValueError(
            f"'{modality.grid}' rows give {bad} patches, which is not a positive multiple of "
            f"spatial_merge_size**2 = {merge2}; the grid does not come from a Qwen-VL processor with this spec."
        )
    return [p // merge2 for p in patches]


def media_per_sample(inputs: Mapping[str, Any], spec: VisionTokenSpec) -> dict[str, list[int]]:
    """Number of images and videos each sample owns, derived from its placeholder tokens and the grids.

    Returns:
        ``{"image_grid_thw": [...], "video_grid_thw": [...]}`` with one count per sample (only the
        modalities present in ``inputs``).

    Raises:
        ValueError: A sample's placeholder count is not the sum of the token counts of the next grid rows,
            or grid rows are left over.
    """
    batch = _batch_size(inputs)
    counts: dict[str, list[int]] = {}
    for modality in (_IMAGE, _VIDEO):
        grid = _grid(inputs, modality)
        if grid is None:
            continue
        tokens = _tokens_per_item(grid, spec, modality)
        placeholders = _placeholders_per_sample(inputs, spec, modality).tolist()
        item, per_sample = 0, []
        for sample, need in enumerate(placeholders):
            start, have = item, 0
            while have < need and item < len(tokens):
                have += tokens[item]
                item += 1
            if have != need:
                raise ValueError(
                    f"sample {sample} has {need} {modality.grid.split('_')[0]} placeholder tokens but the "
                    f"'{modality.grid}' rows {start}..{item - 1} from there give {have} tokens "
                    f"(t*h*w / {spec.spatial_merge_size}**2 per row, in order): input_ids and '{modality.grid}' "
                    "do not belong together (were the media split separately from the text?)."
                )
            per_sample.append(item - start)
        if item != len(tokens):
            raise ValueError(
                f"'{modality.grid}' has {len(tokens)} rows but the {batch} samples' placeholder tokens use only "
                f"{item}; input_ids and '{modality.grid}' do not belong together."
            )
        counts[modality.grid] = per_sample
    return counts


def plan_chunks(
    patches_per_sample: Sequence[int], chunk_size: int | None = None, chunk_patches: int | None = None
) -> list[tuple[int, int]]:
    """Group consecutive samples into chunks ``[(start, end), ...]`` of at most ``chunk_size`` samples and,
    if given, at most ``chunk_patches`` vision patches (a sample larger than ``chunk_patches`` alone is one
    chunk: samples are never cut).

    >>> plan_chunks([16, 12, 0, 8], chunk_patches=16)
    [(0, 1), (1, 3), (3, 4)]
    """
    if chunk_size is None and chunk_patches is None:
        raise ValueError(
            "give chunk_size (samples per chunk) and/or chunk_patches (vision patches per chunk)."
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of samples, got {chunk_size}.")
    if chunk_patches is not None and chunk_patches < 1:
        raise ValueError(f"chunk_patches must be a positive number of patches, got {chunk_patches}.")
    chunks, start, patches = [], 0, 0
    for i, p in enumerate(patches_per_sample):
        full = chunk_size is not None and i - start >= chunk_size
        over = chunk_patches is not None and i > start and patches + p > chunk_patches
        if full or over:
            chunks.append((start, i))
            start, patches = i, 0
        patches += p
    if len(patches_per_sample) > start:
        chunks.append((start, len(patches_per_sample)))
    return chunks


def _slice_sample_value(key: str, value: Any, start: int, end: int, batch: int) -> Any:
    if isinstance(value, torch.Tensor):
        if key == "position_ids" and value.ndim == 3:  # M-RoPE ids are [3 (or 4), B, L]
            return value[:, start:end]
        if value.ndim == 0 or value.shape[0] != batch:
            raise ValueError(
                f"cannot split '{key}' of shape {tuple(value.shape)} by sample: its first dimension is not the "
                f"batch size {batch}. Pass a split_fn that knows this key, or drop it from the inputs."
            )
        return value[start:end]
    if isinstance(value, list) and len(value) == batch:
        return value[start:end]
    return value  # flags and other per-batch settings are shared by every chunk


def split_vlm_inputs(
    inputs: Mapping[str, Any],
    spec: VisionTokenSpec,
    chunk_size: int | None = None,
    chunk_patches: int | None = None,
) -> list[dict[str, Any]]:
    """Split a Qwen-VL model-input mapping into chunks of whole samples, each a valid model input.

    ``[B, ...]`` tensors (and ``[3, B, L]`` ``position_ids``) are cut by sample; ``*_grid_thw``,
    ``second_per_grid_ts`` and pixel rows are cut by each sample's media (see module docstring). A chunk
    without images (videos) has no image (video) keys at all, which is how the model expects text-only input.
    Every chunk is checked with :func:`validate_vlm_chunk`.

    Args:
        inputs: Processor output (``dict`` or ``BatchEncoding``).
        spec: Token ids and merge size, e.g. ``VisionTokenSpec.from_config(model.config)``.
        chunk_size: Most samples per chunk.
        chunk_patches: Most vision patches (rows of ``pixel_values`` + ``pixel_values_videos``) per chunk.

    Raises:
        ValueError: Media do not match the placeholder tokens, or a tensor cannot be split by sample.
    """
    batch = _batch_size(inputs)
    counts = media_per_sample(inputs, spec)
    patches_per_sample = [0] * batch
    cuts: dict[
        str, tuple[list[int], list[int]]
    ] = {}  # grid key -> (item offsets, pixel-row offsets) per sample
    for modality in (_IMAGE, _VIDEO):
        if modality.grid not in counts:
            continue
        grid = _grid(inputs, modality)
        item_rows = [0]
        for n in counts[modality.grid]:
            item_rows.append(item_rows[-1] + n)
        patch_rows = [0] + torch.as_tensor(grid).prod(-1).cumsum(0).tolist()
        pixel_rows = [patch_rows[i] for i in item_rows]
        for s in range(batch):
            patches_per_sample[s] += pixel_rows[s + 1] - pixel_rows[s]
        cuts[modality.grid] = (item_rows, pixel_rows)

    chunks = []
    for start, end in plan_chunks(patches_per_sample, chunk_size, chunk_patches):
        chunk = {
            key: _slice_sample_value(key, value, start, end, batch)
            for key, value in inputs.items()
            if key not in MEDIA_KEYS
        }
        for modality in (_IMAGE, _VIDEO):
            if modality.grid not in cuts:
                continue
            item_rows, pixel_rows = cuts[modality.grid]
            i0, i1 = item_rows[start], item_rows[end]
            if i0 == i1:
                continue  # no media of this kind in the chunk: omit its keys
            chunk[modality.grid] = inputs[modality.grid][i0:i1]
            if inputs.get(modality.pixels) is not None:
                chunk[modality.pixels] = inputs[modality.pixels][pixel_rows[start] : pixel_rows[end]]
            for key in modality.per_item:
                if inputs.get(key) is not None:
                    chunk[key] = inputs[key][i0:i1]
        validate_vlm_chunk(chunk, spec, source=inputs)
        chunks.append(chunk)
    return chunks


def validate_vlm_chunk(
    chunk: Mapping[str, Any], spec: VisionTokenSpec, source: Mapping[str, Any] | None = None
) -> None:
    """Check that a chunk's pixel rows match its grids and its placeholder tokens match its grids.

    This is what makes a naive ``pixel_values[:n]`` split impossible to use by accident: the stock model
    would run on misaligned patches without complaint whenever the totals happen to agree.

    Args:
        chunk: One chunk of model inputs.
        spec: Placeholder ids and merge size.
        source: The batch the chunk was cut from. Every key it has must also be in the chunk, except the keys
            of a modality the chunk holds none of: a dropped ``mm_token_type_ids`` or ``second_per_grid_ts``
            makes the stock models fall back to other positions without an error.

    Raises:
        ValueError: Pixel rows, per-item values, grids and placeholder tokens disagree, or keys were lost.
    """
    if source is not None:
        omitted = {
            key
            for modality in (_IMAGE, _VIDEO)
            if _grid(chunk, modality) is None
            for key in (modality.grid, modality.pixels, *modality.per_item)
        }
        lost = [k for k, v in source.items() if v is not None and chunk.get(k) is None and k not in omitted]
        if lost:
            raise ValueError(
                f"chunk lacks {lost}, which the batch it was cut from has: a split must keep every model input "
                "(cut per sample or per image/video); use hfpatch.training.vlm_split.split_vlm_inputs."
            )
    for modality in (_IMAGE, _VIDEO):
        grid = _grid(chunk, modality)
        name = modality.grid.split("_")[0]
        if grid is None:
            try:
                placeholders = int(_placeholders_per_sample(chunk, spec, modality).sum())
            except ValueError:
                placeholders = 0  # no input_ids / mm_token_type_ids to count with
            if placeholders:
                raise ValueError(
                    f"chunk has {placeholders} {name} placeholder tokens but no '{modality.grid}': its media were "
                    "lost in splitting; split Qwen-VL inputs with hfpatch.training.vlm_split.split_vlm_inputs."
                )
            continue
        patches = int(grid.prod(-1).sum())
        pixels = chunk.get(modality.pixels)
        if pixels is not None and pixels.shape[0] != patches:
            raise ValueError(
                f"chunk '{modality.pixels}' has {pixels.shape[0]} rows but its '{modality.grid}' {grid.tolist()} "
                f"gives {patches} patches (sum of t*h*w): pixel rows were not cut by the grids (a dim-0 split by "
                "sample count is wrong for Qwen-VL); use hfpatch.training.vlm_split.split_vlm_inputs."
            )
        for key in modality.per_item:
            value = chunk.get(key)
            if value is not None and len(value) != grid.shape[0]:
                raise ValueError(
                    f"chunk '{key}' has {len(value)} entries but '{modality.grid}' has {grid.shape[0]} rows."
                )
        tokens = sum(_tokens_per_item(grid, spec, modality))
        placeholders = int(_placeholders_per_sample(chunk, spec, modality).sum())
        if placeholders != tokens:
            raise ValueError(
                f"chunk has {placeholders} {name} placeholder tokens but its '{modality.grid}' {grid.tolist()} "
                f"needs {tokens} (t*h*w / {spec.spatial_merge_size}**2 per row): grids were not cut with the "
                "samples that own them; use hfpatch.training.vlm_split.split_vlm_inputs."
            )
