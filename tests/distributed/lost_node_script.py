"""Run by ``tests/distributed/test_nodes.py`` under two torchrun agents (``--nnodes 2 --nproc-per-node 2``): a Wan
transformer at ``parallel=4`` (``ring=2 x ulysses=2``, Ring across the nodes) called in a loop until a collective
fails. Each rank writes ``ready.RANK`` (its pid, its agent's pid and its node) after its first call; the test then
kills one node (its agent and both its workers). A survivor writes ``report.RANK.json``: when it caught hfpatch's
``CollectiveError`` and its message, then waits for its node's other survivor to report before it exits."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import hfpatch
from hfpatch.distributed.runtime import CollectiveError
from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds


def main(folder: Path) -> None:
    rank = int(os.environ["RANK"])
    model = tiny_wan_transformer()
    g = torch.Generator().manual_seed(3)
    x, t, text = torch.randn(1, 4, 2, 8, 8, generator=g), torch.tensor([500]), wan_prompt_embeds(1, 6)
    patch = hfpatch.apply(model, parallel=4)
    with torch.no_grad():
        model(x, t, text)
        ready = {
            "pid": os.getpid(),
            "agent": os.getppid(),
            "node": int(os.environ["GROUP_RANK"]),
            "plan": repr(patch.plan),
        }
        (folder / f"ready.{rank}").write_text(json.dumps(ready))
        try:
            while True:
                model(x, t, text)
        except CollectiveError as exc:
            report = {"caught": time.time(), "message": str(exc), "node": ready["node"]}
            (folder / f"report.{rank}.tmp").write_text(json.dumps(report))
            (folder / f"report.{rank}.tmp").rename(folder / f"report.{rank}.json")  # whole when it appears
    # The first survivor to exit makes its agent terminate the other: wait (bounded) until every rank of this node
    # has reported, so that a survivor still inside its timeout is not killed before it raises.
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    node_ranks = [ready["node"] * local + i for i in range(local)]
    deadline = time.monotonic() + 2 * float(os.environ.get("HFPATCH_TIMEOUT_S", "30")) + 10
    while time.monotonic() < deadline and not all((folder / f"report.{r}.json").exists() for r in node_ranks):
        time.sleep(0.1)
    # A failed rank: its agent stops at once (a successful one would wait for the lost node at torchrun's exit
    # barrier); no teardown either, which would wait for the peers that are gone.
    os._exit(3)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
