"""Forward peak per rank of the DiT classes under sequence parallelism at world 2, at a long sequence.

``benchmarks/dit_peaks.py`` measures every class on its tests' configs (25-75 image/video tokens), where the
replicated text, timestep and modulation tensors weigh as much as the image tokens, so the 1/N of sharding
cannot show. Here the same tiny stock models (the tests' widths: 4 heads of 8, one or two blocks of each kind;
``tests/patches/test_dit_usp.py``'s ``build``, with its inputs' structure) run on at least 1024 image/video tokens
and 16 text tokens (where the class takes text), unpatched and then with Ulysses 2 and Ring 2 on two gloo ranks,
in fp32 under ``torch.no_grad()``. Every rank measures its peak live tensor bytes
(:func:`hfpatch.testing.memory.track_memory`'s tracker: tensors created during the call, weights and inputs
excluded; Python's collector run first) over its unpatched peak, the module running at each peak (``peak_at``,
rank 0) and, as a sanity check, the max abs difference of the patched output from the unpatched one.

Writes ``benchmarks/results/dit_peaks_long.json`` and ``.png``; about two and a half minutes on two CPU cores.

    python benchmarks/dit_peaks_long.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
#: The forward peak per rank at world 2 every supported class should stay under (patched / unpatched).
TARGET = 0.6
#: (name, ring, ulysses) at world 2.
CONFIGS = [("ulysses", 1, 2), ("ring", 2, 1)]
#: Text tokens, where the class takes text.
TEXT = 16


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _text(seed: int = 2, length: int = TEXT) -> torch.Tensor:
    return _randn(1, length, 16, seed=seed)


def _mask(length: int = TEXT, padded: int = 4) -> torch.Tensor:
    """A ``[1, length]`` key mask with ``padded`` trailing pads (as the tests' padded prompts)."""
    return torch.cat([torch.ones(1, length - padded), torch.zeros(1, padded)], dim=1).long()


def _grid(*sizes: int) -> torch.Tensor:
    """Row-major coordinates of a grid of ``sizes``, ``[prod(sizes), len(sizes)]`` (float)."""
    axes = torch.meshgrid(*(torch.arange(n) for n in sizes), indexing="ij")
    return torch.stack(axes, -1).reshape(-1, len(sizes)).float()


def _wan(factory: str, frames: int, height: int, width: int, **extra: Any):
    """A Wan-layout model (patch 1x2x2) on a ``[1, 4, frames, 2 height, 2 width]`` latent."""
    from hfpatch import testing

    model = getattr(testing, factory)()
    kwargs = dict(
        hidden_states=_randn(1, 4, frames, 2 * height, 2 * width, seed=1),
        timestep=torch.tensor([500]),
        encoder_hidden_states=_text(3),
        **extra,
    )
    return model, kwargs


def build(name: str) -> tuple[torch.nn.Module, dict[str, Any], int]:
    """(the tests' tiny stock model of ``name``, long forward kwargs, image/video tokens the plan cuts)."""
    from hfpatch import testing

    if name == "wan21":  # 4 x 16 x 16 video tokens
        return (*_wan("tiny_wan_transformer", 4, 16, 16), 1024)
    if name == "chronoedit":  # 2 frames (the temporal-skip rotary) x 16 x 32, image keys
        model, kwargs = _wan(
            "tiny_chronoedit_transformer", 2, 16, 32, encoder_hidden_states_image=_randn(1, 3, 16, seed=4)
        )
        return model, kwargs, 1024
    if name == "wan_vace":  # 4 x 16 x 16, a control video of the latent's size
        model, kwargs = _wan(
            "tiny_wan_vace_transformer",
            4,
            16,
            16,
            control_hidden_states=_randn(1, 8, 4, 32, 32, seed=4),
            control_hidden_states_scale=torch.tensor([1.0, 0.5]),
        )
        return model, kwargs, 1024
    if name == "flux":  # 32 x 32 image tokens
        kwargs = dict(
            hidden_states=_randn(1, 1024, 16, seed=1),
            encoder_hidden_states=_text(),
            pooled_projections=_randn(1, 16, seed=3),
            timestep=torch.tensor([0.7]),
            img_ids=torch.cat([torch.zeros(1024, 1), _grid(32, 32)], dim=1),
            txt_ids=torch.zeros(TEXT, 3),
        )
        return testing.tiny_flux_transformer(), kwargs, 1024
    if name == "flux2":  # 32 x 32 image tokens, 4-axis ids
        kwargs = dict(
            hidden_states=_randn(1, 1024, 16, seed=1),
            encoder_hidden_states=_text(),
            timestep=torch.tensor([0.7]),
            img_ids=_grid(1, 32, 32, 1)[None],
            txt_ids=torch.cat([torch.zeros(TEXT, 3), torch.arange(float(TEXT))[:, None]], 1)[None],
        )
        return testing.tiny_flux2_transformer(), kwargs, 1024
    if name == "sd3":  # 64 x 64 latent, patch 2: 32 x 32 tokens (the tiny config's pos_embed_max_size)
        kwargs = dict(
            hidden_states=_randn(1, 4, 64, 64, seed=1),
            encoder_hidden_states=_text(),
            pooled_projections=_randn(1, 16, seed=3),
            timestep=torch.tensor([700]),
        )
        return testing.tiny_sd3_transformer(), kwargs, 1024
    if name == "cogvideox":  # 4 x 16 x 16 video tokens, rotary positions (5B layout)
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        rotary = get_3d_rotary_pos_embed(16, ((0, 0), (16, 16)), (16, 16), 4, use_real=True)
        kwargs = dict(
            hidden_states=_randn(1, 4, 4, 32, 32, seed=1),  # [B, F, C, H, W]
            encoder_hidden_states=_text(),
            timestep=torch.tensor([300]),
            image_rotary_emb=tuple(t.float() for t in rotary),
        )
        return testing.tiny_cogvideox_transformer(), kwargs, 1024
    if name == "qwenimage":  # 32 x 32 packed image tokens, joint attention
        kwargs = dict(
            hidden_states=_randn(1, 1024, 16, seed=1),
            encoder_hidden_states=_text(),
            timestep=torch.tensor([0.7]),
            img_shapes=[[(1, 32, 32)]],
        )
        return testing.tiny_qwenimage_transformer(), kwargs, 1024
    if name == "ltx":  # 4 x 16 x 16 video tokens, cross-attention to masked text
        kwargs = dict(
            hidden_states=_randn(1, 1024, 8, seed=1),
            encoder_hidden_states=_text(),
            encoder_attention_mask=_mask(),
            timestep=torch.tensor([500]),
            num_frames=4,
            height=16,
            width=16,
        )
        return testing.tiny_ltx_transformer(), kwargs, 1024
    if name == "ltx2":  # 4 x 16 x 16 video tokens sharded, 16 audio frames replicated, masked text
        kwargs = dict(
            hidden_states=_randn(1, 1024, 8, seed=1),
            audio_hidden_states=_randn(1, 16, 8, seed=4),
            encoder_hidden_states=_text(),
            audio_encoder_hidden_states=_text(3),
            encoder_attention_mask=_mask(),
            num_frames=4,
            height=16,
            width=16,
            audio_num_frames=16,
            timestep=torch.tensor([500.0]),
        )
        return testing.tiny_ltx2_transformer(), kwargs, 1024
    if name == "hunyuanvideo":  # 4 x 16 x 16 video tokens (patch 1x2x2), padded text
        kwargs = dict(
            hidden_states=_randn(1, 4, 4, 32, 32, seed=1),
            timestep=torch.tensor([500]),
            encoder_hidden_states=_text(),
            encoder_attention_mask=_mask(),
            pooled_projections=_randn(1, 16, seed=3),
        )
        return testing.tiny_hunyuanvideo_transformer(), kwargs, 1024
    if name == "hunyuanvideo15":  # 4 x 16 x 16 video tokens (patch 1), two padded texts (16 + 8 ByT5)
        kwargs = dict(
            hidden_states=_randn(1, 4, 4, 16, 16, seed=1),
            timestep=torch.tensor([500.0]),
            encoder_hidden_states=_text(),
            encoder_attention_mask=_mask(),
            encoder_hidden_states_2=_randn(1, 8, 16, seed=3),
            encoder_attention_mask_2=_mask(8, 2),
            image_embeds=torch.zeros(1, 3, 16),  # text-to-video: the image tokens are masked
        )
        return testing.tiny_hunyuanvideo15_transformer(), kwargs, 1024
    if name == "minimax_h3":  # one packed sequence: 16 text, 1024 video, 16 audio rows, interleaved
        video, audio = 1024, 16
        rows = TEXT + video + audio
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(5))
        text_indices, video_indices, audio_indices = (
            order[:TEXT],
            order[TEXT : TEXT + video],
            order[TEXT + video :],
        )
        tags = (
            torch.zeros(rows, dtype=torch.long).index_fill(0, text_indices, 1).index_fill(0, audio_indices, 2)
        )
        kwargs = dict(
            hidden_states=_randn(1, video, 8, seed=1),
            audio_hidden_states=_randn(1, audio, 8, seed=4),
            encoder_hidden_states=_text(),
            timestep=torch.tensor([0.7, 0.0]),  # noisy targets, clean text
            timestep_indices=(tags == 1).long(),
            token_tags=tags,
            position_ids=torch.randint(0, 32, (rows, 3), generator=torch.Generator().manual_seed(6)),
            video_indices=video_indices,
            audio_indices=audio_indices,
            text_indices=text_indices,
        )
        return testing.tiny_minimax_h3_transformer(), kwargs, video
    if name == "hunyuandit":  # 64 x 64 latent, patch 2: 32 x 32 tokens, 2D rotary, 8 CLIP + 8 T5 text tokens
        from diffusers.models.embeddings import get_2d_rotary_pos_embed

        rotary = get_2d_rotary_pos_embed(8, ((0, 0), (32, 32)), (32, 32), output_type="pt")
        kwargs = dict(
            hidden_states=_randn(1, 4, 64, 64, seed=1),
            timestep=torch.tensor([500.0]),
            encoder_hidden_states=_randn(1, 8, 16, seed=2),
            text_embedding_mask=_mask(8, 2),
            encoder_hidden_states_t5=_randn(1, 8, 16, seed=3),
            text_embedding_mask_t5=_mask(8, 2),
            image_rotary_emb=tuple(t.float() for t in rotary),
        )
        return testing.tiny_hunyuandit_transformer(text_len=8, text_len_t5=8), kwargs, 1024
    if name == "pixart":  # 64 x 64 latent, patch 2: 32 x 32 tokens, cross-attention to masked text
        kwargs = dict(
            hidden_states=_randn(1, 4, 64, 64, seed=1),
            encoder_hidden_states=_text(),
            encoder_attention_mask=_mask(),
            timestep=torch.tensor([500]),
        )
        return testing.tiny_pixart_transformer(), kwargs, 1024
    raise ValueError(name)


#: Class name -> the builder above (the families of test_dit_usp.py's ``build`` that dit_peaks.py measures).
CLASSES = {
    "WanTransformer3DModel": "wan21",
    "FluxTransformer2DModel": "flux",
    "SD3Transformer2DModel": "sd3",
    "CogVideoXTransformer3DModel": "cogvideox",
    "QwenImageTransformer2DModel": "qwenimage",
    "Flux2Transformer2DModel": "flux2",
    "LTXVideoTransformer3DModel": "ltx",
    "ChronoEditTransformer3DModel": "chronoedit",
    "WanVACETransformer3DModel": "wan_vace",
    "HunyuanVideoTransformer3DModel": "hunyuanvideo",
    "HunyuanVideo15Transformer3DModel": "hunyuanvideo15",
    "LTX2VideoTransformer3DModel": "ltx2",
    "MiniMaxH3Transformer3DModel": "minimax_h3",
    "HunyuanDiT2DModel": "hunyuandit",
    "PixArtTransformer2DModel": "pixart",
}


def _sample(out: Any) -> torch.Tensor:
    """The model's output: ``sample``, with LTX-2's replicated ``audio_sample`` flattened after it."""
    audio = getattr(out, "audio_sample", None)
    if audio is None:
        return out.sample
    return torch.cat([out.sample.flatten(1), audio.flatten(1)], dim=1)


def measure(names: list[str]) -> dict[str, dict[str, Any]]:
    """On every rank: per builder, ``{plan: patched peak / unpatched peak}`` (forward, no grad), where (the
    innermost module running) each peak sits, and each plan's max abs difference from the unpatched output."""
    from dit_peaks import _measured

    import hfpatch
    from hfpatch import ParallelConfig

    torch.set_num_threads(1)
    results = {}
    for name in names:
        model, _, tokens = build(name)
        inputs = lambda name=name: build(name)[1]  # noqa: E731  (fresh tensors: the inputs are not counted)
        unpatched, where, reference = _measured(model, inputs)
        reference = _sample(reference)
        row: dict[str, Any] = {
            "tokens": tokens,
            "unpatched_bytes": unpatched,
            "peak_at": {"unpatched": where},
            "max_abs_diff": {},
            "output_max_abs": reference.abs().max().item(),
        }
        for plan, ring, ulysses in CONFIGS:
            with hfpatch.apply(model, parallel=ParallelConfig(ring=ring, ulysses=ulysses)):
                peak, where, out = _measured(model, inputs)
                out = _sample(out)
            row[plan] = peak / unpatched
            row["peak_at"][plan] = where
            row["max_abs_diff"][plan] = (out - reference).abs().max().item()
        results[name] = row
    return results


def _plot(results: dict[str, Any], path: Path) -> None:
    """Draw the table of ``results`` (this script's JSON) to ``path`` (``dit_peaks.py``'s figure, rows with tokens)."""
    from dit_peaks import _plot as plot_peaks

    table = results["classes"]
    plot_peaks(
        results,
        path,
        label=lambda c: f"{c} ({table[c]['tokens']})",
        xlabel=f"forward peak per rank / unpatched (world 2, >= 1024 tokens, {results['text_tokens']} text)",
        height=(0.28, 1.4),
        legend={"fontsize": 7, "loc": "upper center", "bbox_to_anchor": (0.5, -0.1), "ncol": 4},
    )


def main() -> dict[str, Any]:
    from hfpatch.testing import RankPool

    pool = RankPool(2, timeout_s=1800)
    try:
        per_rank = pool.run(measure, list(CLASSES.values()))
    finally:
        pool.close()
    table = {}
    for cls, name in CLASSES.items():
        rows = [rank[name] for rank in per_rank]
        table[cls] = {
            "build": name,
            "tokens": rows[0]["tokens"],
            "unpatched_bytes": rows[0]["unpatched_bytes"],
            **{plan: max(r[plan] for r in rows) for plan, _, _ in CONFIGS},
            "max_abs_diff": {plan: max(r["max_abs_diff"][plan] for r in rows) for plan, _, _ in CONFIGS},
            "output_max_abs": rows[0]["output_max_abs"],
            "peak_at": rows[0]["peak_at"],  # rank 0's
        }
    over = {c: round(max(row[p] for p, _, _ in CONFIGS), 3) for c, row in table.items()}
    results = {
        "target": TARGET,
        "text_tokens": TEXT,
        "configs": {plan: {"ring": ring, "ulysses": ulysses} for plan, ring, ulysses in CONFIGS},
        "classes": table,
        "above_target": {c: v for c, v in over.items() if v > TARGET},
        "torch": torch.__version__,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dit_peaks_long.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "dit_peaks_long.png")
    for cls, row in table.items():
        flag = f"  > target (peak in {row['peak_at']})" if over[cls] > TARGET else ""
        diff = ", ".join(f"{v:.1e}" for v in row["max_abs_diff"].values())
        print(
            f"{cls:36s} {row['tokens']:5d} tokens  ulysses {row['ulysses']:.3f}  ring {row['ring']:.3f}"
            f"  max|diff| {diff}{flag}"
        )
    return results


if __name__ == "__main__":
    import os

    here = str(Path(__file__).parent)
    sys.path.insert(0, here)  # spawned ranks import measure (and dit_peaks' tracker) from here
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    from dit_peaks_long import main as _main  # noqa: E402  (the importable copy of this module)

    _main()
