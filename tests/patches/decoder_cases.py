"""Tiny stock transformers decoders and batches for the sequence-parallel decoder tests (``test_decoder_usp.py``).

Every builder seeds its own generators, so each rank builds the same model and batch. Token counts are odd
(11, 13, 19, ...), so every world size of 2, 3 and 4 leaves end padding in the last shard.
"""

from __future__ import annotations

from typing import Any

import torch

from hfpatch import testing

#: The packed text case: three samples of 5, 4 and 4 tokens in one row (position ids restart).
PACKED = (5, 4, 4)
#: Qwen-VL batch: two images of different sizes in one sample, a video, a text-only row.
VL_MEDIA = [[("image", (1, 4, 4)), ("image", (1, 2, 4))], [("video", (2, 2, 2))], []]
#: More frames than ranks in both vision calls, so ``sp_vision="split"`` cuts them at every world size: a
#: 6-frame video (cut between frames) and four images of different sizes.
VL_FRAMES = [
    [("video", (6, 2, 2)), ("image", (1, 2, 2))],
    [("image", (1, 4, 4)), ("image", (1, 2, 2)), ("image", (1, 2, 4))],
]


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def _padded(ids: torch.Tensor, pads: list[int], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` with ``pads[i]`` padding tokens (id 0) on ``side`` of row ``i``, and the attention mask."""
    ids, mask = ids.clone(), torch.ones_like(ids)
    for row, n in enumerate(pads):
        if n:
            span = slice(0, n) if side == "left" else slice(ids.shape[1] - n, None)
            ids[row, span] = 0
            mask[row, span] = 0
    return ids, mask


def _labels(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return ids.masked_fill(mask == 0, -100) if mask is not None else ids.clone()


def _text(kind: str, layout: str) -> dict[str, Any]:
    if layout == "packed":  # one row of three samples; no attention mask, so transformers detects the packing
        ids = _ids(1, sum(PACKED), seed=3)
        positions = torch.cat([torch.arange(n) for n in PACKED])[None]
        labels = ids.clone()
        starts = torch.tensor(PACKED).cumsum(0)[:-1]
        labels[0, starts] = -100  # a sample's first token is no target of the previous one
        return dict(input_ids=ids, position_ids=positions, labels=labels, use_cache=False)
    ids, mask = _padded(_ids(2, 11, seed=4), [3, 0], "left" if layout == "extras" else layout)
    batch = dict(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask))
    if layout == "extras":  # every hidden state, and the Trainer's token count for the loss
        batch.update(output_hidden_states=True, num_items_in_batch=torch.tensor(29))
    return batch


def _vl_batch(kind: str, layout: str) -> dict[str, Any]:
    media, padding = (VL_FRAMES, "left") if layout == "frames" else (VL_MEDIA, layout)
    if kind == "qwen3_vl":
        batch = testing.qwen3_vl_inputs(media, padding=padding, seed=5)
    else:
        seconds = [0.5] if kind == "qwen2_5_vl" else None
        batch = testing.qwen2_vl_inputs(media, padding=padding, seed=5, second_per_grid_ts=seconds)
    batch["labels"] = _labels(batch["input_ids"], batch["attention_mask"])
    return batch


def _vl_packed(model: torch.nn.Module) -> dict[str, Any]:
    """Two Qwen3-VL samples (two images; a video and text) packed in one row: ``[4, 1, S]`` position ids whose
    text row restarts (the packing transformers detects) and whose M-RoPE rows are each sample's own."""
    samples = [testing.qwen3_vl_inputs([media], seed=6 + i) for i, media in enumerate(VL_MEDIA[:2])]
    base = model.model if hasattr(model, "model") else model
    rows = []
    for s in samples:
        mrope, _ = base.get_rope_index(
            s["input_ids"], s["mm_token_type_ids"], s.get("image_grid_thw"), s.get("video_grid_thw")
        )
        text = torch.arange(s["input_ids"].shape[1])[None, None]
        rows.append(torch.cat([text, mrope], dim=0))
    batch = {
        "input_ids": torch.cat([s["input_ids"] for s in samples], 1),
        "mm_token_type_ids": torch.cat([s["mm_token_type_ids"] for s in samples], 1),
        "position_ids": torch.cat(rows, dim=2),
        "use_cache": False,
    }
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [s[key] for s in samples if key in s]
        if parts:
            batch[key] = torch.cat(parts)
    labels = batch["input_ids"].clone()
    labels[0, samples[0]["input_ids"].shape[1]] = -100
    batch["labels"] = labels
    return batch


#: Case name -> (model kind, input layout). ``_base`` cases are the headless ``...Model`` classes.
CASES: dict[str, tuple[str, str]] = {
    "qwen3_left": ("qwen3", "left"),
    "qwen3_right": ("qwen3", "right"),
    "qwen3_packed": ("qwen3", "packed"),
    "qwen3_extras": ("qwen3", "extras"),  # output_hidden_states=True, num_items_in_batch
    "llama_left": ("llama", "left"),
    "llama_packed": ("llama", "packed"),
    "qwen3_vl_left": ("qwen3_vl", "left"),
    "qwen3_vl_right": ("qwen3_vl", "right"),
    "qwen3_vl_packed": ("qwen3_vl", "packed"),
    "qwen3_vl_base": ("qwen3_vl_base", "left"),
    "qwen2_5_vl_left": ("qwen2_5_vl", "left"),
    "qwen2_vl_right": ("qwen2_vl", "right"),
    "qwen3_vl_frames": ("qwen3_vl", "frames"),
    "qwen2_5_vl_frames": ("qwen2_5_vl", "frames"),  # windowed tower, video cut between frames
    "qwen3_vl_checkpointing": ("qwen3_vl", "left"),  # gradient checkpointing: layers recomputed in backward
    "qwen3_checkpointing": ("qwen3", "packed"),
}


def build(case: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(tiny stock model, forward kwargs) for ``case`` (fresh objects each call, identical on every rank)."""
    kind, layout = CASES[case]
    if case.endswith("_checkpointing"):
        model, kwargs = build(f"{kind}_{layout}")
        model.gradient_checkpointing_enable()
        return model, kwargs
    if kind in ("qwen3", "llama"):
        factory = testing.tiny_qwen3_causal_lm if kind == "qwen3" else testing.tiny_llama_causal_lm
        return factory(), _text(kind, layout)
    if kind == "qwen3_vl_base":
        model = testing.tiny_qwen3_vl()
        batch = _vl_batch("qwen3_vl", layout)
        batch.pop("labels")
        return model, batch
    factory = {
        "qwen3_vl": testing.tiny_qwen3_vl,
        "qwen2_5_vl": testing.tiny_qwen2_5_vl,
        "qwen2_vl": testing.tiny_qwen2_vl,
    }
    model = factory[kind](causal_lm=True)
    if layout == "packed":
        return model, _vl_packed(model)
    return model, _vl_batch(kind, layout)


def outputs(out: Any) -> dict[str, torch.Tensor]:
    """The compared outputs: ``logits`` and ``loss`` of a causal LM, ``last_hidden_state`` of a headless model."""
    if getattr(out, "logits", None) is not None:
        found = {"logits": out.logits}
        if out.loss is not None:
            found["loss"] = out.loss
    else:
        found = {"last_hidden_state": out.last_hidden_state}
    for i, state in enumerate(getattr(out, "hidden_states", None) or ()):
        found[f"hidden_states.{i}"] = state
    return found


def objective(out: Any) -> torch.Tensor:
    """What backward differentiates: the model's own loss (labels), or a fixed linear functional of the hidden states."""
    if getattr(out, "loss", None) is not None:
        return out.loss
    hidden = out.last_hidden_state
    weight = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(9))  # the same draw for fp64
    return (hidden * weight.to(hidden.dtype)).sum()
