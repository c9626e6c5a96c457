"""Run by ``tests/distributed/test_nodes.py`` under two torchrun agents (``--nnodes 2 --nproc-per-node 2``): what a
rank sees of the plan, its mesh and its outputs on two nodes; rank 0 writes them as JSON to ``sys.argv[1]``."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from pipe_helpers import wan_pipe_call  # tests/, on PYTHONPATH (test_nodes.py sets it for the agents)

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


def main(path: str) -> None:
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
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
