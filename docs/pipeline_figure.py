"""Draw ``docs/_static/pipeline-over-ranks.png``: what ``hfpatch.apply(pipe, parallel=4)`` does to a WanPipeline.

Which component is split over which ranks along which axis: the text encoder whole on every rank, the
transformer split by CFG branch and by sequence (Ulysses), the VAE decode by latent rows, the video whole on every
rank. Run from the repository root after changing it: ``python docs/pipeline_figure.py``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

OUT = Path(__file__).parent / "_static" / "pipeline-over-ranks.png"
RANKS = ["#4c72b0", "#55a868", "#dd8452", "#c44e52"]
WHOLE = "#bbbbbb"
SIZE = 12


def _box(ax, x, y, w, h, color, lines=(), text_color="white", size=SIZE - 1):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="#333333", linewidth=1))
    for i, line in enumerate(lines):
        offset = (len(lines) - 1) / 2 - i
        ax.text(x + w / 2, y + h / 2 + offset * 0.48, line, ha="center", va="center", color=text_color, fontsize=size)


def _arrow(ax, x0, y0, x1, y1, both=False):
    style = "<|-|>" if both else "-|>"
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=14, color="#333333", lw=1.4))


def _note(ax, x, y, lines, size=SIZE - 1):
    for i, line in enumerate(lines):
        ax.text(x, y - i * 0.46, line, ha="center", va="top", fontsize=size, color="#222222")


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 6.0))
    ax.set_xlim(0, 24)
    ax.set_ylim(0, 11.2)
    ax.axis("off")
    ax.text(12, 10.8, "hfpatch.apply(pipe, parallel=4) on a WanPipeline: plan cfg=2, ulysses=2, vae=4",
            ha="center", va="center", fontsize=SIZE + 3, weight="bold")
    ax.text(12, 10.25, "every rank calls pipe(...) with the same arguments and gets the whole video; colours are ranks",
            ha="center", va="center", fontsize=SIZE, color="#444444")
    for i, (label, color) in enumerate([*[(f"rank {r}", c) for r, c in enumerate(RANKS)], ("every rank, whole", WHOLE)]):
        x = 5.6 + i * 2.5
        ax.add_patch(Rectangle((x, 9.45), 0.35, 0.35, facecolor=color, edgecolor="#333333"))
        ax.text(x + 0.5, 9.62, label, va="center", fontsize=SIZE)

    # text encoder
    ax.text(2.1, 8.9, "text encoder", ha="center", fontsize=SIZE + 1, weight="bold")
    _box(ax, 0.4, 4.4, 3.4, 4.1, WHOLE, ["prompt", "embeddings"], text_color="#222222", size=SIZE)
    _note(ax, 2.1, 3.8, ["not split: the same", "on every rank"])
    _arrow(ax, 3.9, 6.45, 5.0, 6.45)

    # transformer: CFG rows x sequence columns
    ax.text(9.4, 8.9, "transformer, at every denoising step", ha="center", fontsize=SIZE + 1, weight="bold")
    ax.text(5.9, 7.45, "cond", ha="right", va="center", fontsize=SIZE)
    ax.text(5.9, 5.45, "uncond", ha="right", va="center", fontsize=SIZE)
    _box(ax, 6.0, 6.5, 3.4, 1.95, RANKS[0], ["tokens 1 .. S/2"])
    _box(ax, 9.4, 6.5, 3.4, 1.95, RANKS[1], ["tokens S/2 .. S"])
    _box(ax, 6.0, 4.45, 3.4, 1.95, RANKS[2], ["tokens 1 .. S/2"])
    _box(ax, 9.4, 4.45, 3.4, 1.95, RANKS[3], ["tokens S/2 .. S"])
    _arrow(ax, 6.0, 4.15, 12.8, 4.15, both=True)
    _note(ax, 9.4, 3.75, [
        "sequence axis: tokens split over 2 ranks",
        "(Ulysses: in attention, an all-to-all",
        "gives each rank half the heads)",
        "CFG axis: cond and uncond on other",
        "ranks, 1 all-gather per step",
    ])
    _arrow(ax, 13.0, 6.45, 14.3, 6.45)

    # VAE decode by latent rows
    ax.text(16.4, 8.9, "VAE decode", ha="center", fontsize=SIZE + 1, weight="bold")
    for r, color in enumerate(RANKS):
        label = f"latent rows {r + 1}/4"
        _box(ax, 14.5, 7.45 - r * 1.0, 3.8, 1.0, color, [label])
    _arrow(ax, 18.6, 4.45, 18.6, 8.45, both=True)
    _note(ax, 16.4, 3.8, ["height axis: split over", "all 4 ranks, halo rows", "exchanged at each conv"])
    _arrow(ax, 18.9, 6.45, 20.0, 6.45)

    # output
    ax.text(21.9, 8.9, "video", ha="center", fontsize=SIZE + 1, weight="bold")
    _box(ax, 20.2, 4.4, 3.4, 4.1, WHOLE, ["whole, on", "every rank"], text_color="#222222", size=SIZE)
    _note(ax, 21.9, 3.8, ["= the unpatched", "pipeline's, up to", "fp32 reordering"])
    ax.text(12, 0.9, "The scheduler, the noise and the latents are whole on every rank: only the transformer calls "
            "and the decode are divided.", ha="center", fontsize=SIZE - 1, color="#444444")
    OUT.parent.mkdir(exist_ok=True)
    fig.savefig(OUT, dpi=110, bbox_inches="tight", facecolor="white")
    plt.close(fig)


if __name__ == "__main__":
    main()
