"""``hfpatch plan MODEL --nodes N --gpus-per-node G``: the plan ``parallel=N*G`` gets, and the bytes per link.

The pipeline is built from its configs on the meta device (no weight is read, no process group starts), planned
as :func:`hfpatch.apply` would plan it on ``N`` nodes of ``G`` ranks (:func:`hfpatch.api.plan_of`), and each
rank's traffic in one denoising step is counted inside its node and across nodes
(:func:`hfpatch.distributed.traffic.step_traffic`, the formulas the suite holds equal to the measured bytes).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
from typing import Any

__all__ = ["add_arguments", "main", "plan_report", "step_shape"]

#: Bytes per element of ``--dtype``.
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .arguments import _positive_int

    parser.add_argument(
        "model", help="a diffusers pipeline folder, or a hub id (only its configs are fetched)"
    )
    parser.add_argument("--nodes", type=_positive_int, default=1, help="nodes (default: 1)")
    parser.add_argument("--gpus-per-node", type=_positive_int, default=8, help="ranks per node (default: 8)")
    parser.add_argument("--height", type=_positive_int, help="pixels (default: the pipeline's)")
    parser.add_argument("--width", type=_positive_int, help="pixels (default: the pipeline's)")
    parser.add_argument("--frames", type=_positive_int, help="video frames (default: the pipeline's)")
    parser.add_argument(
        "--text-tokens", type=_positive_int, default=512, help="text tokens of a joint-attention model (Flux)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weights and activations")
    parser.add_argument("--pipefusion", action="store_true", help="let the planner use PipeFusion")
    parser.add_argument(
        "--no-peer-access",
        action="store_true",
        help="the node's GPUs cannot reach each other directly (PCIe without P2P): Ulysses stays at 1",
    )


def _folder(model: str) -> str:
    if os.path.isdir(model):
        return model
    if (
        os.sep in model.rstrip(os.sep).split("/", 1)[-1]
        or model.startswith((".", os.sep))
        or os.path.exists(model)
    ):
        raise ValueError(f"{model} is not a pipeline folder (a local path that is not a directory)")
    from huggingface_hub import snapshot_download

    # Configs, scheduler and tokenizer files only: no weights.
    return snapshot_download(model, allow_patterns=["*.json", "*.txt", "*.model", "*.tiktoken"])


def _defaults(pipe: Any) -> dict[str, Any]:
    """The ``height``, ``width`` and ``num_frames`` the pipeline's ``__call__`` uses when not given."""
    found = {
        name: p.default
        for name, p in inspect.signature(type(pipe).__call__).parameters.items()
        if name in ("height", "width", "num_frames") and isinstance(p.default, int)
    }
    size = getattr(pipe, "default_sample_size", None)
    if size is not None and hasattr(pipe, "vae_scale_factor"):
        found.setdefault("height", size * pipe.vae_scale_factor)
        found.setdefault("width", size * pipe.vae_scale_factor)
    return found


def step_shape(
    pipe: Any,
    height: int | None = None,
    width: int | None = None,
    frames: int | None = None,
    *,
    text_tokens: int = 512,
    element_size: int = 2,
    guided: bool = False,
    batch: int = 1,
) -> tuple[Any, str]:
    """The :class:`~hfpatch.distributed.traffic.StepShape` of one step of ``pipe`` and a line describing it.

    Knows how Wan (video patches, cross-attention to the text) and Flux (2 x 2 packed latents, text joined to
    every attention) turn pixels into tokens.

    Raises:
        ValueError: Another transformer class (its token layout is not known here).
    """
    from ..distributed.traffic import StepShape

    defaults = _defaults(pipe)
    height, width = height or defaults.get("height"), width or defaults.get("width")
    transformer = pipe.transformer
    config = transformer.config
    kind = type(transformer).__name__
    if kind == "WanTransformer3DModel":
        frames = frames or defaults.get("num_frames", 81)
        spatial, temporal = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        latent = ((frames - 1) // temporal + 1, height // spatial, width // spatial)
        pt, ph, pw = config.patch_size
        tokens = (latent[0] // pt) * (latent[1] // ph) * (latent[2] // pw)
        shape = StepShape(
            tokens=tokens,
            heads=config.num_attention_heads,
            head_dim=config.attention_head_dim,
            layers=config.num_layers,
            out_features=config.out_channels * pt * ph * pw,
            batch=batch,
            guided=guided,
            latent_numel=config.out_channels * math.prod(latent),
            element_size=element_size,
        )
        what = f"{height}x{width}, {frames} frames: {tokens:,} tokens"
    elif kind == "FluxTransformer2DModel":
        packed = pipe.vae_scale_factor * 2  # latents packed 2 x 2 into one token
        tokens = (height // packed) * (width // packed)
        out = config.out_channels or config.in_channels
        shape = StepShape(
            tokens=tokens,
            heads=config.num_attention_heads,
            head_dim=config.attention_head_dim,
            layers=config.num_layers + config.num_single_layers,
            out_features=out,
            joint_text=text_tokens,
            batch=batch,
            guided=guided,
            latent_numel=tokens * out,
            element_size=element_size,
        )
        what = f"{height}x{width}: {tokens:,} tokens + {text_tokens} text tokens"
    else:
        raise ValueError(
            f"hfpatch plan counts bytes for Wan and Flux token layouts; {kind} is not one of them"
        )
    return shape, what


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def plan_report(
    pipe: Any,
    nodes: int,
    gpus_per_node: int,
    *,
    height: int | None = None,
    width: int | None = None,
    frames: int | None = None,
    text_tokens: int = 512,
    dtype: str = "bf16",
    pipefusion: bool = False,
    peer_access: bool | None = None,
) -> list[str]:
    """The lines ``hfpatch plan`` prints for ``pipe`` (built on meta or not) on ``nodes`` x ``gpus_per_node``.

    >>> from hfpatch.testing import tiny_wan_pipe
    >>> print("\\n".join(plan_report(tiny_wan_pipe(), 2, 2, height=32, width=32, frames=5)[:2]))
    WanPipeline: 4 heads, guided (CFG parallel when it fills ranks)
    parallel=4 on 2 nodes x 2 ranks: ParallelConfig(data=1, cfg=2, ring=1, ulysses=2, vae=4)
    """
    from ..api import plan_of
    from ..distributed.traffic import KINDS, across, inside, step_traffic

    world = nodes * gpus_per_node
    node_size = gpus_per_node if nodes > 1 else None
    plan, facts = plan_of(
        pipe, world, world, node_size=node_size, peer_access=peer_access, pipefusion=pipefusion
    )
    heads = f"{facts.num_heads} heads" if facts.num_heads else "no sequence-parallel transformer"
    guidance = "guided (CFG parallel when it fills ranks)" if facts.guides else "unguided"
    lines = [
        f"{type(pipe).__name__}: {heads}, {guidance}",
        f"parallel={world} on {nodes} node{'s' if nodes > 1 else ''} x {gpus_per_node} ranks: {plan}",
    ]
    if plan.pipefusion > 1 or facts.num_heads is None:
        return [
            *lines,
            "bytes per step: not counted for this plan (PipeFusion's patch pipeline, or no transformer)",
        ]
    try:
        shape, what = step_shape(
            pipe,
            height,
            width,
            frames,
            text_tokens=text_tokens,
            element_size=DTYPES[dtype],
            guided=facts.guides,
        )
    except ValueError as exc:
        return [*lines, f"bytes per step: {exc}"]
    ranks = step_traffic(plan, shape, node_size)
    busiest = max(range(world), key=lambda r: (across(ranks[r]), inside(ranks[r])))
    sent = ranks[busiest]
    lines += [
        f"bytes rank {busiest} sends per denoising step ({dtype}, {what}; the rank sending most across nodes):",
        f"  {'collective':<12} {'inside its node':>16} {'across nodes':>14}",
    ]
    for kind in KINDS:
        if kind in sent:
            lines.append(f"  {kind:<12} {_bytes(sent[kind][0]):>16} {_bytes(sent[kind][1]):>14}")
    lines.append(f"  {'total':<12} {_bytes(inside(sent)):>16} {_bytes(across(sent)):>14}")
    return lines


def main(args: argparse.Namespace) -> int:
    """``hfpatch plan``: print :func:`plan_report` for ``args.model``; 2 when its configs cannot be read."""
    import sys

    from ..loading.pretrained import meta_pipeline

    # A missing folder, a hub id that cannot be fetched, a folder without model_index.json: one line, status 2.
    try:
        pipe = meta_pipeline(_folder(args.model))[0]
    except Exception as exc:
        print(
            f"hfpatch plan: cannot read the configs of {args.model}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 2
    lines = plan_report(
        pipe,
        args.nodes,
        args.gpus_per_node,
        height=args.height,
        width=args.width,
        frames=args.frames,
        text_tokens=args.text_tokens,
        dtype=args.dtype,
        pipefusion=args.pipefusion,
        peer_access=False if args.no_peer_access else None,
    )
    print("\n".join(lines))
    return 0
