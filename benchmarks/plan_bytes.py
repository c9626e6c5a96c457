"""The plan and the bytes per link ``hfpatch plan`` reports for Wan 2.1 14B and Flux.1-dev on 16 GPUs.

Analytic (:func:`hfpatch.distributed.traffic.step_traffic`, held equal to the measured bytes at world 4 by
``tests/distributed/test_nodes.py``), from the published transformer configs built on the meta device: no weight,
no process group. On 2 nodes of 8 (``hfpatch plan MODEL --nodes 2 --gpus-per-node 8``) and 4 nodes of 4: the plan
``parallel=16`` gets with the node size known (Ulysses inside a node) and without it (the planner before issue
48), and the bytes the busiest rank sends in one denoising step (bf16) inside its node and across nodes. Wan: 720 x 1280, 81 frames (75,600 tokens), guided. Flux: 1024 x 1024
(4,096 tokens) and 512 text tokens, guidance-distilled (one transformer call a step).

Run: ``python benchmarks/plan_bytes.py`` (seconds, CPU) -> ``benchmarks/results/plan_bytes.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: diffusers' configs of the published checkpoints (Wan-AI/Wan2.1-T2V-14B-Diffusers, black-forest-labs/FLUX.1-dev).
WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6,
)  # fmt: skip
FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
)  # fmt: skip
LAYOUTS = ((2, 8), (4, 4))  # (nodes, GPUs per node)
RESULTS = Path(__file__).parent / "results" / "plan_bytes.json"


def pipelines() -> dict[str, tuple[object, dict]]:
    """The two pipelines, their transformers on the meta device (the VAEs' default scale factors: 8, and 4 in time)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    with torch.device("meta"):
        wan = WanTransformer3DModel(**WAN_14B)
        flux = FluxTransformer2DModel(**FLUX_DEV)
    return {
        "Wan 2.1 14B, 720p, 81 frames": (
            WanPipeline(tokenizer=None, text_encoder=None, transformer=wan, vae=None, scheduler=UniPCMultistepScheduler()),
            dict(height=720, width=1280, frames=81),
        ),
        "Flux.1-dev, 1024 x 1024": (
            FluxPipeline(
                scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                text_encoder_2=None, tokenizer_2=None, transformer=flux,
            ),
            dict(height=1024, width=1024, text_tokens=512),
        ),
    }  # fmt: skip


def main() -> dict:
    from hfpatch.api import plan_of
    from hfpatch.cli.plan import DTYPES, plan_report, step_shape
    from hfpatch.distributed.traffic import across, inside, step_traffic

    rows = {}
    for name, (pipe, size) in pipelines().items():
        for nodes, per_node in LAYOUTS:
            world = nodes * per_node
            report = plan_report(pipe, nodes, per_node, **size)
            print(f"{name} on {nodes} x {per_node}", *report, sep="\n  ")
            row = {"report": report}
            for label, node_size in (("node_aware", per_node), ("node_unaware", None)):
                plan, facts = plan_of(pipe, world, world, node_size=node_size)
                shape, what = step_shape(pipe, **size, element_size=DTYPES["bf16"], guided=facts.guides)
                ranks = step_traffic(plan, shape, per_node)
                busiest = max(ranks, key=lambda sent: (across(sent), inside(sent)))
                row[label] = {
                    "plan": repr(plan),
                    "shape": what,
                    "inside_bytes": inside(busiest),
                    "across_bytes": across(busiest),
                }
                print(
                    f"  {label}: {plan}: inside {inside(busiest) / 2**30:.2f} GiB, "
                    f"across {across(busiest) / 2**30:.3f} GiB"
                )
            rows[f"{name} on {nodes} x {per_node}"] = row
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
