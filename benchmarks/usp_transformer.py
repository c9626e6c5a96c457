"""Per-rank activation memory and bytes sent of the stock ``WanTransformer3DModel`` under USP, vs N.

A tiny but long-sequence stock Wan 2.1 transformer (``hfpatch.testing.tiny_wan_transformer`` with 8 heads of
16 channels, hidden ``C = 128``, ``ffn_dim = 4 C``, 2 layers) denoises a latent video ``[1, 4, 16, 32, 32]``
(patch 1x2x2: ``S = 16 * 16 * 16 = 4096`` tokens) in fp32 under ``torch.no_grad()`` (inference). It runs
unpatched on one process, then patched with ``hfpatch.apply(model, parallel=ParallelConfig(...))`` on
N = 2 and 4 gloo ranks: Ulysses N, Ring N and USP 2x2. Every rank reports:

- its peak live activation bytes during the transformer call (``hfpatch.testing.memory.track_memory``;
  weights and inputs are not counted) over the unpatched peak, against the target 1.2/N, with a per-module
  breakdown (live bytes on entry and peak inside ``rope``, ``patch_embedding``, each block, ...);
- the max abs difference of its output from the unpatched output;
- bytes sent (``count_comm``, split by collective) against the analytic minimum: per self-attention call
  Ulysses sends ``4 (u-1)/u`` of the local ``[B, S/N, H, D]`` tensor (q, k, v in, out back) and Ring
  ``2 (r-1)`` such tensors (K and V passed ``r-1`` times), times ``num_layers``; the output gather sends
  ``(N-1)`` local output shards. Cross-attention to the replicated text sends nothing.

Three plan-driven families (``hfpatch.patches.dit``; diffusers' ``_cp_plan`` translated where it has one) run the same configs
at the same size (8 heads of 16, ``C = 128``, MLP ``4 C``, 2 layers, 4096 image/video tokens, 16 text tokens):

- ``QwenImageTransformer2DModel``: joint attention with the 16 text tokens replicated. Analytic bytes add,
  per layer under Ulysses, the all-gather of the joint (text) output heads, ``(u-1)`` times the local
  ``[B, T, H/u, D]`` slice; the text keys/values are never sent (every rank has them). hfpatch cuts the
  image tokens at ``img_in``'s output (diffusers' plan cuts them at block 0's input, which keeps the full
  embedding alive until block 0 returns).
- ``LTXVideoTransformer3DModel``: self-attention over the video tokens, cross-attention to the replicated text
  (no communication); the rotary output is cut, the tokens enter block 0 cut.
- ``CogVideoXTransformer3DModel`` (5B layout): joint attention over ``[text, video]`` with the 16 text tokens
  replicated (the joint output heads all-gathered under Ulysses, as QwenImage's); the video tokens are cut at the
  patch embedding's ``[text, video]`` output, so the full embedding is freed there.

Writes ``benchmarks/results/usp_transformer.json`` (Wan at the top level, the others under ``families``) and
``.png``; about two minutes on two CPU cores.

    python benchmarks/usp_transformer.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.attention.layout import shard_len
from hfpatch.distributed.collectives import count_comm
from hfpatch.testing import RankPool, tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.memory import MemoryTracker, track_memory

RESULTS = Path(__file__).parent / "results"
HEADS, HEAD_DIM, LAYERS = 8, 16, 2
HIDDEN = HEADS * HEAD_DIM
LATENT = (1, 4, 16, 32, 32)  # [B, C, F, H, W]; patch (1, 2, 2) -> 16 * 16 * 16 = 4096 tokens
TEXT_LEN = 16
PATCH = (1, 2, 2)
OUT_CHANNELS = 4
MB = 2**20
# (name, ring, ulysses) per world size.
CONFIGS = {
    2: [("ulysses", 1, 2), ("ring", 2, 1)],
    4: [("ulysses", 1, 4), ("ring", 4, 1), ("usp 2x2", 2, 2)],
}
MARKERS = {"ulysses": "o-", "ring": "s-", "usp 2x2": "^"}
#: Plan-driven families benchmarked next to Wan (same heads, width, layers and token count).
FAMILIES = ("qwenimage", "ltx", "cogvideox")
#: (frames, height, width) in tokens
FAMILY_GRID = {"qwenimage": (1, 64, 64), "ltx": (16, 16, 16), "cogvideox": (16, 16, 16)}
#: proj_out channels (QwenImage and CogVideoX: 2x2 patch x 4 latent channels)
FAMILY_OUT = {"qwenimage": 16, "ltx": 8, "cogvideox": 16}


def seq_len(latent: tuple[int, ...] = LATENT) -> int:
    """Tokens after patch embedding."""
    _, _, f, h, w = latent
    return (f // PATCH[0]) * (h // PATCH[1]) * (w // PATCH[2])


def build(latent: tuple[int, ...] = LATENT) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The benchmark's stock Wan transformer (same weights on every rank) and its forward kwargs."""
    model = tiny_wan_transformer(
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        num_layers=LAYERS,
        ffn_dim=4 * HIDDEN,
        out_channels=OUT_CHANNELS,
        patch_size=PATCH,
    )
    kwargs = dict(
        hidden_states=torch.randn(*latent, generator=torch.Generator().manual_seed(1)),
        timestep=torch.tensor([500]),
        encoder_hidden_states=wan_prompt_embeds(latent[0], TEXT_LEN),
    )
    return model, kwargs


def analytic_bytes(ring: int, ulysses: int, latent: tuple[int, ...] = LATENT) -> dict[str, int]:
    """Minimum bytes one rank sends in a forward, per collective kind (fp32, equal shards)."""
    world = ring * ulysses
    local = shard_len(seq_len(latent), world)  # tokens per rank
    batch = latent[0]
    qkv = batch * local * HIDDEN * 4  # one local [B, S/N, H, D] fp32 tensor
    out_shard = batch * local * OUT_CHANNELS * PATCH[0] * PATCH[1] * PATCH[2] * 4  # proj_out output shard
    return {
        "all_to_all": LAYERS * 4 * (ulysses - 1) * qkv // ulysses,
        "ring": LAYERS * 2 * (ring - 1) * qkv,
        "all_gather": (world - 1) * out_shard,
    }


def build_family(name: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A plan-driven family's benchmark model (stock class, same weights on every rank) and forward kwargs."""
    from hfpatch.testing import tiny_cogvideox_transformer, tiny_ltx_transformer, tiny_qwenimage_transformer

    frames, height, width = FAMILY_GRID[name]
    tokens = frames * height * width
    gen = torch.Generator().manual_seed(1)
    text = torch.randn(1, TEXT_LEN, 16, generator=gen)
    if name == "qwenimage":
        model = tiny_qwenimage_transformer(
            num_heads=HEADS, head_dim=HEAD_DIM, num_layers=LAYERS, axes_dims_rope=(4, 6, 6)
        )
        kwargs = dict(
            hidden_states=torch.randn(1, tokens, 16, generator=gen),
            encoder_hidden_states=text,
            timestep=torch.tensor([0.5]),
            img_shapes=[[(frames, height, width)]],
        )
    elif name == "ltx":
        model = tiny_ltx_transformer(num_heads=HEADS, head_dim=HEAD_DIM, num_layers=LAYERS)
        kwargs = dict(
            hidden_states=torch.randn(1, tokens, 8, generator=gen),
            encoder_hidden_states=text,
            encoder_attention_mask=torch.ones(1, TEXT_LEN, dtype=torch.long),
            timestep=torch.tensor([500]),
            num_frames=frames,
            height=height,
            width=width,
        )
    elif name == "cogvideox":
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        model = tiny_cogvideox_transformer(num_heads=HEADS, head_dim=HEAD_DIM, num_layers=LAYERS)
        rotary = get_3d_rotary_pos_embed(
            HEAD_DIM, ((0, 0), (height, width)), (height, width), frames, use_real=True
        )
        kwargs = dict(
            hidden_states=torch.randn(1, frames, 4, 2 * height, 2 * width, generator=gen),  # [B, F, C, H, W]
            encoder_hidden_states=text,
            timestep=torch.tensor([500]),
            image_rotary_emb=tuple(t.float() for t in rotary),
        )
    else:
        raise ValueError(name)
    return model, kwargs


def analytic_family_bytes(name: str, ring: int, ulysses: int) -> dict[str, int]:
    """Minimum bytes one rank sends in a forward of a plan-driven family (fp32, per collective kind)."""
    world = ring * ulysses
    local = shard_len(math.prod(FAMILY_GRID[name]), world)
    qkv = local * HIDDEN * 4  # one local [1, S/N, H, D] fp32 tensor
    bytes_ = {
        "all_to_all": LAYERS * 4 * (ulysses - 1) * qkv // ulysses,
        "ring": LAYERS * 2 * (ring - 1) * qkv,
        "all_gather": (world - 1) * local * FAMILY_OUT[name] * 4,
    }
    if name in (
        "qwenimage",
        "cogvideox",
    ):  # the joint (text) output heads, all-gathered over the Ulysses group
        heads = -(-HEADS // ulysses)  # the largest head slice (heads split as evenly as possible)
        bytes_["all_gather"] += LAYERS * (ulysses - 1) * TEXT_LEN * heads * HEAD_DIM * 4
    return bytes_


def measure_family(name: str, ring: int, ulysses: int, reference: torch.Tensor) -> dict[str, Any]:
    """On every rank: a plan-driven family's peak, bytes sent and error vs ``reference``."""
    model, kwargs = build_family(name)
    with hfpatch.apply(model, parallel=ParallelConfig(ring=ring, ulysses=ulysses)):
        with torch.no_grad(), count_comm() as comm, track_memory() as mem:
            out = model(**kwargs).sample
    return {
        "peak": mem.peak_bytes,
        "sent": dict(comm.by_op),
        "max_abs_diff": (out - reference).abs().max().item(),
    }


def _summary(name: str, world: int, ring: int, ulysses: int, per_rank: list, unpatched_peak: int, analytic):
    """One run's row: the worst rank's peak and bytes against the unpatched peak and the analytic minimum."""
    ops = sorted({op for r in per_rank for op in r["sent"]} | set(analytic))
    sent = max(sum(r["sent"].values()) for r in per_rank)
    peak = max(r["peak"] for r in per_rank)
    return {
        "name": name,
        "N": world,
        "ring": ring,
        "ulysses": ulysses,
        "peak_per_rank": [r["peak"] for r in per_rank],
        "peak_max": peak,
        "peak_over_unpatched": peak / unpatched_peak,
        "target": 1.2 / world,
        "meets_target": peak / unpatched_peak <= 1.2 / world,
        "max_abs_diff": max(r["max_abs_diff"] for r in per_rank),
        "sent_by_op_max": {op: max(r["sent"].get(op, 0) for r in per_rank) for op in ops},
        "sent_max": sent,
        "analytic_by_op": analytic,
        "analytic": sum(analytic.values()),
        "sent_over_analytic": sent / sum(analytic.values()),
    }


class Breakdown:
    """Forward hooks on the model's top-level stages recording live bytes on entry and the peak inside.

    Registered after ``hfpatch.apply``, so a stage's entry is measured after the patch's split hooks ran and
    its exit after the patch's gather hook.
    """

    def __init__(self, model: torch.nn.Module, tracker: MemoryTracker) -> None:
        self.tracker = tracker
        self.rows: list[dict[str, Any]] = []
        self._saved: list[int] = []
        stages = [("rope", model.rope), ("patch_embedding", model.patch_embedding)]
        stages += [("condition_embedder", model.condition_embedder)]
        stages += [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
        stages += [("norm_out", model.norm_out), ("proj_out", model.proj_out)]
        self.handles = []
        for name, module in stages:
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(lambda m, a, o, name=name: self._exit(name)))

    def _enter(self, _module, _args) -> None:
        self._saved.append(self.tracker.peak_bytes)
        self.tracker.reset_peak()
        self._entry = self.tracker.live_bytes

    def _exit(self, name: str) -> None:
        inside = self.tracker.peak_bytes
        self.rows.append({"stage": name, "live_on_entry": self._entry, "peak_inside": inside})
        self.tracker.peak_bytes = max(self._saved.pop(), inside)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def profile(model: torch.nn.Module, kwargs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Output, peak bytes, stage breakdown and bytes sent of one inference forward."""
    with torch.no_grad(), count_comm() as comm, track_memory() as mem:
        probe = Breakdown(model, mem)
        out = model(**kwargs).sample
        probe.remove()
    return {"out": out, "peak": mem.peak_bytes, "stages": probe.rows, "sent": dict(comm.by_op)}


def measure(ring: int, ulysses: int, reference: torch.Tensor) -> dict[str, Any]:
    """On every rank: the patched model's peak, stage breakdown, bytes sent and error vs ``reference``."""
    model, kwargs = build()
    with hfpatch.apply(model, parallel=ParallelConfig(ring=ring, ulysses=ulysses)):
        result = profile(model, kwargs)
    out = result.pop("out")
    result["max_abs_diff"] = (out - reference).abs().max().item()
    return result


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(str(Path(__file__).with_name("figures.mplstyle")))  # readable at page width

    base = results["unpatched"]["peak"] / MB
    ns = [1, 2, 4]
    fig, (ax_mem, ax_comm, ax_fam) = plt.subplots(3, 1, figsize=(9, 12.9))
    ax_mem.plot(ns, [base / n for n in ns], "k:", label="ideal 1/N")
    ax_mem.plot(ns, [1.2 * base / n for n in ns], "k--", alpha=0.5, label="target 1.2/N")
    for name, marker in MARKERS.items():
        rows = [r for r in results["runs"] if r["name"] == name]
        ax_mem.plot(
            [1] + [r["N"] for r in rows], [base] + [r["peak_max"] / MB for r in rows], marker, label=name
        )
    ax_mem.set(xlabel="ranks N", ylabel="per-rank peak activation (MiB)", xticks=ns, yscale="log")
    ax_mem.set_title(
        f"stock WanTransformer3DModel, S={results['seq']}, C={HIDDEN}, ffn=4C, {LAYERS} layers, fp32",
    )
    ax_mem.legend()
    runs = results["runs"]
    x = list(range(len(runs)))
    bottom = [0.0] * len(runs)
    for op, color in (("all_to_all", "C0"), ("ring", "C1"), ("all_gather", "C2")):
        heights = [r["sent_by_op_max"].get(op, 0) / MB for r in runs]
        ax_comm.bar([i - 0.2 for i in x], heights, 0.4, bottom=bottom, color=color, label=f"measured {op}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax_comm.bar(
        [i + 0.2 for i in x], [r["analytic"] / MB for r in runs], 0.4, color="0.6", label="analytic min"
    )
    ax_comm.set_xticks(x, [f"{r['name']}\nN={r['N']}" for r in runs])
    ax_comm.set(ylabel="bytes sent per rank, one forward (MiB)")
    ax_comm.legend()
    ax_fam.plot(ns, [1 / n for n in ns], "k:", label="ideal 1/N")
    ax_fam.plot(ns, [1.2 / n for n in ns], "k--", alpha=0.5, label="target 1.2/N")
    families = {"wan": {"runs": results["runs"], "unpatched_peak": results["unpatched"]["peak"]}}
    families.update(results["families"])
    for (family_name, family), color in zip(families.items(), ("C0", "C1", "C2", "C3")):
        for name, marker in MARKERS.items():
            rows = [r for r in family["runs"] if r["name"] == name]
            ax_fam.plot(
                [1] + [r["N"] for r in rows],
                [1.0] + [r["peak_max"] / family["unpatched_peak"] for r in rows],
                marker,
                color=color,
                alpha=0.8,
                label=f"{family_name} {name}",
            )
    ax_fam.set(xlabel="ranks N", ylabel="per-rank peak / unpatched", xticks=ns, yscale="log")
    ax_fam.set_title(f"Wan, QwenImage, LTX-Video: S=4096, C={HIDDEN}, {LAYERS} layers, fp32")
    ax_fam.legend(ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _stage(stages: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(s for s in stages if s["stage"] == name)


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    model, kwargs = build()
    unpatched = profile(model, kwargs)
    reference = unpatched.pop("out")
    seq = seq_len()
    runs = []
    families: dict[str, dict[str, Any]] = {}
    for name in FAMILIES:
        family_model, family_kwargs = build_family(name)
        with torch.no_grad(), track_memory() as mem:
            family_out = family_model(**family_kwargs).sample
        tokens = math.prod(FAMILY_GRID[name])
        families[name] = {
            "model": f"diffusers {type(family_model).__name__} (hfpatch.testing, plan: _cp_plan)",
            "seq": tokens,
            "text_len": TEXT_LEN,
            "unpatched_peak": mem.peak_bytes,
            "output_max_abs": family_out.abs().max().item(),
            "full_hidden_bytes": tokens * HIDDEN * 4,
            "reference": family_out,
            "runs": [],
        }
    for world, configs in CONFIGS.items():
        with RankPool(world, timeout_s=600) as pool:
            for name, family in families.items():
                for config, ring, ulysses in configs:
                    per_rank = pool.run(measure_family, name, ring, ulysses, family["reference"])
                    analytic = analytic_family_bytes(name, ring, ulysses)
                    row = _summary(config, world, ring, ulysses, per_rank, family["unpatched_peak"], analytic)
                    row["max_rel_diff"] = row["max_abs_diff"] / family["output_max_abs"]
                    family["runs"].append(row)
            for name, ring, ulysses in configs:
                per_rank = pool.run(measure, ring, ulysses, reference)
                analytic = analytic_bytes(ring, ulysses)
                ops = sorted({op for r in per_rank for op in r["sent"]} | set(analytic))
                sent_by_op = {op: max(r["sent"].get(op, 0) for r in per_rank) for op in ops}
                sent = max(sum(r["sent"].values()) for r in per_rank)
                peak = max(r["peak"] for r in per_rank)
                runs.append(
                    {
                        "name": name,
                        "N": world,
                        "ring": ring,
                        "ulysses": ulysses,
                        "peak_per_rank": [r["peak"] for r in per_rank],
                        "peak_max": peak,
                        "peak_over_unpatched": peak / unpatched["peak"],
                        "target": 1.2 / world,
                        "meets_target": peak / unpatched["peak"] <= 1.2 / world,
                        # Live on entry to block 0 (after the split): what sharding has not divided yet.
                        "live_on_block0_entry": _stage(per_rank[0]["stages"], "blocks.0")["live_on_entry"],
                        "live_on_block1_entry": _stage(per_rank[0]["stages"], "blocks.1")["live_on_entry"],
                        "max_abs_diff": max(r["max_abs_diff"] for r in per_rank),
                        "sent_by_op_max": sent_by_op,
                        "sent_max": sent,
                        "analytic_by_op": analytic,
                        "analytic": sum(analytic.values()),
                        "sent_over_analytic": sent / sum(analytic.values()),
                        "stages_rank0": per_rank[0]["stages"],
                    }
                )
    full_hidden = LATENT[0] * seq * HIDDEN * 4
    results = {
        "model": "diffusers WanTransformer3DModel (tiny_wan_transformer)",
        "config": {
            "num_heads": HEADS,
            "head_dim": HEAD_DIM,
            "hidden": HIDDEN,
            "ffn_dim": 4 * HIDDEN,
            "num_layers": LAYERS,
            "latent": list(LATENT),
            "patch_size": list(PATCH),
            "text_len": TEXT_LEN,
            "dtype": "float32",
            "mode": "inference, torch.no_grad()",
        },
        "seq": seq,
        "units": {
            "full_hidden_bytes": full_hidden,  # one [B, S, C] fp32 tensor
            "full_rope_bytes": 2 * seq * HEAD_DIM * 4,  # (cos, sin), each [1, S, 1, D]
            "full_output_bytes": reference.numel() * reference.element_size(),
        },
        "unpatched": unpatched,
        # One block's working set on top of what is live when it starts (norms, q/k/v, attention out, MLP).
        "block_working_set_unpatched": _stage(unpatched["stages"], "blocks.0")["peak_inside"]
        - _stage(unpatched["stages"], "blocks.0")["live_on_entry"],
        "note": (
            "stages_rank0 lists, per top-level stage, live bytes on entry and the peak inside. The patched "
            "peak is inside block 0: on its entry the full [B, S, C] patch-embedding output (the stock forward "
            "still references it until block 0 returns, and the shard is a view of it) and the full rotary "
            "tables (the rope shards are views) are alive next to 1/N of the block working set."
        ),
        "runs": runs,
        "families": {
            name: {k: v for k, v in family.items() if k != "reference"} for name, family in families.items()
        },
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "usp_transformer.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "usp_transformer.png")
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import measure from this file
    from usp_transformer import main as _main  # noqa: E402  (the importable copy of this module)

    res = _main()
    unit = res["units"]["full_hidden_bytes"]
    print(f"S={res['seq']}: unpatched peak {res['unpatched']['peak'] / MB:.2f} MiB "
          f"= {res['unpatched']['peak'] / unit:.2f} x one [B, S, C] tensor")  # fmt: skip
    for run in res["runs"]:
        print(
            f"{run['name']:8s} N={run['N']}: peak {run['peak_max'] / MB:6.2f} MiB = "
            f"{run['peak_over_unpatched']:.3f} x unpatched (target <= {run['target']:.2f}); "
            f"max|diff| {run['max_abs_diff']:.1e}; sent {run['sent_max'] / MB:5.2f} MiB = "
            f"{run['sent_over_analytic']:.3f} x analytic {run['sent_by_op_max']}"
        )
    for family_name, family in res["families"].items():
        print(
            f"{family_name}: S={family['seq']}, unpatched peak {family['unpatched_peak'] / MB:.2f} MiB, "
            f"output max |x| {family['output_max_abs']:.3g}"
        )
        for run in family["runs"]:
            print(
                f"  {run['name']:8s} N={run['N']}: peak {run['peak_over_unpatched']:.3f} x unpatched; "
                f"max|diff| {run['max_abs_diff']:.1e}; sent {run['sent_max'] / MB:5.2f} MiB = "
                f"{run['sent_over_analytic']:.3f} x analytic {run['sent_by_op_max']} vs {run['analytic_by_op']}"
            )
