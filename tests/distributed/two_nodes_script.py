"""Run by ``tests/distributed/test_nodes.py`` under two torchrun agents (``--nnodes 2 --nproc-per-node 2``): what a
rank sees of the plan, its mesh and its outputs on two nodes; rank 0 writes them as JSON to ``sys.argv[1]``.

With a saved tiny Wan folder (``sys.argv[2]``) and a work folder (``sys.argv[3]``) it also runs, on the same ranks:
``hfpatch generate`` of the folder (as ``torchrun -m hfpatch generate`` would: the CLI's ``main`` in the launched
rank), writing ``generate.pt``; ``hfpatch.from_pretrained`` of a hub id whose download is a local fake into a
cache folder per node (``GROUP_RANK``), which must run once per node, on local rank 0; and a LoRA training step."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from pipe_helpers import (  # tests/, on PYTHONPATH (test_nodes.py sets it for the agents)
    WAN_GENERATE_ARGS,
    lora_step,
    wan_pipe_call,
)

import hfpatch
from hfpatch.distributed import runtime
from hfpatch.testing import tiny_wan_pipe, tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.tolerance import rel_error, rounding_noise, to_fp64


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, 4, 2, 8, 8, generator=g), torch.tensor([500]), wan_prompt_embeds(1, 6)


def _pipe_call(pipe) -> torch.Tensor:
    return wan_pipe_call(pipe, output_type="latent")


def _groups(plan, axis: str, nodes: list[int]) -> list[list[int]]:
    """The nodes of the ranks of this rank's ``axis`` group."""
    group = runtime.get_mesh(plan).group(axis)
    ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
    return [nodes[r] for r in ranks]


REPO, COMMIT = "hfpatch/tiny-wan", "0123456789abcdef0123456789abcdef01234567"


def _from_hub(folder: str, work: Path) -> dict:
    """``hfpatch.from_pretrained(REPO, 4)`` with each node's cache; the download is the folder copied in the hub's
    layout (no hub here). Its output against loading the folder whole and applying the same plan."""
    from diffusers import DiffusionPipeline

    import hfpatch.loading.pretrained as loading

    node = int(os.environ["GROUP_RANK"])
    cache = work / f"cache-node{node}"
    real, calls = loading._snapshot, []

    def snapshot(repo_id, revision, cache_dir, local_files_only):
        calls.append("cache" if local_files_only else "download")
        if not local_files_only:
            base = Path(cache_dir, "models--" + repo_id.replace("/", "--"))
            (base / "refs").mkdir(parents=True)
            (base / "refs" / "main").write_text(COMMIT)
            shutil.copytree(folder, base / "snapshots" / COMMIT)
        return real(repo_id, revision, cache_dir, True)  # the real resolution, offline

    loading._snapshot = snapshot
    try:
        pipe, patch = hfpatch.from_pretrained(REPO, 4, cache_dir=str(cache))
    finally:
        loading._snapshot = real
    out = _pipe_call(pipe)
    patch.remove()
    whole = DiffusionPipeline.from_pretrained(folder)
    patch = hfpatch.apply(whole, parallel=4)
    expected = _pipe_call(whole)
    patch.remove()
    return {
        "calls": calls,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "equal": bool(torch.equal(out, expected)),
    }


def main(path: str, folder: str | None = None, work: str | None = None) -> None:
    dist.init_process_group("gloo")
    nodes: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ["GROUP_RANK"]))
    result: dict = {"nodes": nodes, "local_world_size": os.environ["LOCAL_WORLD_SIZE"]}

    model = tiny_wan_transformer()
    x, t, text = _inputs()
    with torch.no_grad():
        reference = model(x, t, text).sample
        noise = rounding_noise(reference, to_fp64(model)(*to_fp64((x, t, text))).sample)
        patch = hfpatch.apply(model, parallel=4)
        out = model(x, t, text).sample
    result["transformer"] = {
        "heads": model.config.num_attention_heads,
        "plan": repr(patch.plan),
        "ulysses_nodes": _groups(patch.plan, "ulysses", nodes),
        "diff": rel_error(out, reference),
        "noise": noise,
    }
    patch.remove()

    pipe = tiny_wan_pipe()
    reference = _pipe_call(pipe)
    noise = rounding_noise(reference, _pipe_call(to_fp64(pipe)))
    patch = hfpatch.apply(pipe, parallel=4)
    out = _pipe_call(pipe)
    result["pipeline"] = {
        "plan": repr(patch.plan),
        "ulysses_nodes": _groups(patch.plan, "ulysses", nodes),
        "diff": rel_error(out, reference),
        "noise": noise,
    }
    patch.remove()
    if folder is not None and work is not None:
        from hfpatch.cli import main as hfpatch_command

        out = Path(work) / "generate.pt"
        # the planner's degrees over the two nodes with the VAE on one rank: two-call CFG and Ulysses are bit-exact
        degrees = ["--cfg", "2", "--ulysses", "2", "--vae", "1"]
        result["generate"] = hfpatch_command(
            ["generate", folder, *WAN_GENERATE_ARGS, *degrees, "--out", str(out)]
        )
        result["hub"] = _from_hub(folder, Path(work))
        result["lora"] = lora_step(4)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
