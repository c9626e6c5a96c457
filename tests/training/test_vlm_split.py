"""Qwen-VL input splitting: media follow their samples, chunks are valid model inputs, bad splits raise.

Splitting only slices tensors, so chunk contents are compared exactly; the model-level check (each chunk's
embeddings equal the full batch's rows) runs other batch shapes (other GEMM blockings, attention over other
padded lengths), so it allows reassociation_tol of the full batch's own fp32-vs-fp64 noise.
"""

from __future__ import annotations

import pytest
import torch

from hfpatch.testing import qwen3_vl_inputs, tiny_qwen3_vl
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64
from hfpatch.training.pooling import default_rep
from hfpatch.training.vlm_split import (
    VisionTokenSpec,
    media_per_sample,
    plan_chunks,
    split_vlm_inputs,
    validate_vlm_chunk,
)

SPEC = VisionTokenSpec(image_token_id=120, video_token_id=121, spatial_merge_size=2)  # tiny_qwen3_vl's ids
MEDIA = [
    [("image", (1, 4, 4))],
    [("image", (1, 2, 4)), ("image", (1, 2, 2))],
    [],
    [("video", (2, 2, 2))],
    [("image", (1, 4, 2)), ("video", (1, 2, 4))],
    [("image", (1, 2, 6))],
]


def _batch() -> dict:
    batch = qwen3_vl_inputs(MEDIA, seed=1)
    batch["second_per_grid_ts"] = torch.tensor([0.5, 1.0])  # Qwen2.5-VL: one entry per video
    return batch


def test_media_per_sample_counts_images_and_videos():
    counts = media_per_sample(_batch(), SPEC)
    assert counts == {"image_grid_thw": [1, 2, 0, 0, 1, 1], "video_grid_thw": [0, 0, 0, 1, 1, 0]}


def test_media_per_sample_uses_mm_token_type_ids_without_input_ids():
    batch = _batch()
    del batch["input_ids"]
    assert media_per_sample(batch, SPEC)["image_grid_thw"] == [1, 2, 0, 0, 1, 1]


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4, 6])
def test_split_vlm_inputs_chunks_concatenate_to_the_batch(chunk_size):
    batch = _batch()
    chunks = split_vlm_inputs(batch, SPEC, chunk_size=chunk_size)
    assert [len(c["input_ids"]) for c in chunks] == [len(r) for r in torch.arange(6).split(chunk_size)]
    for key, value in batch.items():
        parts = [c[key] for c in chunks if key in c]
        assert torch.equal(torch.cat(parts), value), key


def test_split_vlm_inputs_chunk_without_media_omits_media_keys():
    chunks = split_vlm_inputs(_batch(), SPEC, chunk_size=1)
    assert set(chunks[2]) == {"input_ids", "attention_mask", "mm_token_type_ids"}  # text-only sample
    assert "pixel_values" not in chunks[3] and chunks[3]["video_grid_thw"].tolist() == [[2, 2, 2]]
    assert chunks[3]["second_per_grid_ts"].tolist() == [0.5]
    assert chunks[4]["pixel_values"].shape[0] == 8 and chunks[4]["pixel_values_videos"].shape[0] == 8


def test_split_vlm_inputs_chunk_patches_bounds_vision_patches():
    # Patches per sample: 16, 12, 0, 8, 16, 12.
    chunks = split_vlm_inputs(_batch(), SPEC, chunk_patches=20)
    sizes = [len(c["input_ids"]) for c in chunks]
    patches = [sum(c[k].shape[0] for k in ("pixel_values", "pixel_values_videos") if k in c) for c in chunks]
    assert sizes == [1, 3, 1, 1] and patches == [16, 20, 16, 12]


def test_split_vlm_inputs_position_ids_split_on_batch_dim():
    batch = qwen3_vl_inputs([[("image", (1, 2, 2))], [], [], [], [("image", (1, 2, 2))], []], seed=1)
    batch["position_ids"] = torch.arange(3 * 6 * batch["input_ids"].shape[1]).view(
        3, 6, -1
    )  # M-RoPE [3, B, L]
    chunks = split_vlm_inputs(batch, SPEC, chunk_size=4)
    assert torch.equal(chunks[1]["position_ids"], batch["position_ids"][:, 4:])


def test_split_vlm_inputs_chunks_embed_like_the_full_batch():
    model = tiny_qwen3_vl()
    batch = qwen3_vl_inputs(MEDIA, seed=1)
    with torch.no_grad():
        full = default_rep(model(**batch), batch)
        parts = [default_rep(model(**c), c) for c in split_vlm_inputs(batch, SPEC, chunk_size=2)]
        exact = default_rep(to_fp64(model)(**to_fp64(batch)), batch)
    error, tol = rel_error(torch.cat(parts), full), reassociation_tol(rounding_noise(full, exact))
    print(f"chunk embeddings: {error:.2e} / {tol:.2e}")
    assert error <= tol


def test_vision_token_spec_from_config_reads_qwen3_vl():
    assert VisionTokenSpec.from_config(tiny_qwen3_vl().config) == SPEC


def test_vision_token_spec_from_config_rejects_text_config():
    with pytest.raises(ValueError, match="no image_token_id"):
        VisionTokenSpec.from_config(object())


def test_validate_vlm_chunk_pixel_rows_not_matching_grids_raises():
    batch = _batch()
    naive = {k: batch[k][:2] for k in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values")}
    naive["image_grid_thw"] = batch["image_grid_thw"][:3]  # right grids, pixels cut by sample count
    with pytest.raises(
        ValueError, match="'pixel_values' has 2 rows but its 'image_grid_thw' .* gives 28 patches"
    ):
        validate_vlm_chunk(naive, SPEC)


def test_validate_vlm_chunk_tokens_not_matching_grids_raises():
    batch = _batch()
    wrong = {k: batch[k][:1] for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    wrong["image_grid_thw"], wrong["pixel_values"] = (
        batch["image_grid_thw"][1:2],
        batch["pixel_values"][16:24],
    )
    with pytest.raises(ValueError, match="chunk has 4 image placeholder tokens but .* needs 2"):
        validate_vlm_chunk(wrong, SPEC)


def test_validate_vlm_chunk_tokens_without_grid_raises():
    batch = _batch()
    lost = {k: batch[k][:1] for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    with pytest.raises(ValueError, match="4 image placeholder tokens but no 'image_grid_thw'"):
        validate_vlm_chunk(lost, SPEC)


@pytest.mark.parametrize("dropped", ["mm_token_type_ids", "second_per_grid_ts", "attention_mask"])
def test_validate_vlm_chunk_with_source_lost_key_raises(dropped):
    batch = _batch()
    good = split_vlm_inputs(batch, SPEC, chunk_size=4)
    for chunk in good:
        validate_vlm_chunk(chunk, SPEC, source=batch)  # media keys omitted from a media-less chunk are fine
    lossy = {k: v for k, v in good[0].items() if k != dropped}  # chunk 0 holds images and a video
    with pytest.raises(ValueError, match=f"chunk lacks \\['{dropped}'\\]"):
        validate_vlm_chunk(lossy, SPEC, source=batch)


def test_media_per_sample_grid_rows_left_over_raises():
    batch = _batch()
    batch["image_grid_thw"] = torch.cat([batch["image_grid_thw"], torch.tensor([[1, 2, 2]])])
    with pytest.raises(ValueError, match="has 6 rows but the 6 samples' placeholder tokens use only 5"):
        media_per_sample(batch, SPEC)


def test_media_per_sample_tokens_not_a_sum_of_grids_raises():
    batch = _batch()
    batch["image_grid_thw"] = batch["image_grid_thw"].flip(0)
    with pytest.raises(ValueError, match="sample 0 has 4 image placeholder tokens"):
        media_per_sample(batch, SPEC)


def test_split_vlm_inputs_unknown_unbatched_tensor_raises():
    batch = _batch()
    batch["extra"] = torch.zeros(7)
    with pytest.raises(ValueError, match="cannot split 'extra' of shape \\(7,\\) by sample"):
        split_vlm_inputs(batch, SPEC, chunk_size=2)


def test_plan_chunks_bad_sizes_raise():
    with pytest.raises(ValueError, match="give chunk_size"):
        plan_chunks([1, 2])
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        plan_chunks([1, 2], chunk_size=0)
    assert plan_chunks([5, 5, 5], chunk_size=2, chunk_patches=100) == [(0, 2), (2, 3)]
