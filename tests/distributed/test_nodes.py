"""Several nodes (issue 48): the planner keeps Ulysses inside a node, and a launch of two torchrun agents on one host
(``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on the loopback, distinct ``GROUP_RANK``) runs exact.

* The planner, over a table of (nodes, ranks per node, heads, guidance, PipeFusion): each Ulysses group of the plan,
  read from the mesh's rank grid (Ulysses innermost, torchrun numbering each node's ranks consecutively), lies in
  one node, and its degree is the largest such (a brute force over every divisor).
* An explicit ``ParallelConfig`` whose Ulysses groups span nodes runs, with one warning naming the degrees that
  would not.
* Two agents of two ranks: a bare Wan transformer at ``parallel=4`` (4 heads: ``ulysses=4`` on one node) plans
  ``ring=2 x ulysses=2`` with each Ulysses group inside a node, read from the process groups of the live mesh
  and every rank's ``GROUP_RANK``; a Wan pipeline at ``parallel=4`` plans ``cfg=2 x ulysses=2``. Both equal the
  unpatched outputs within fp32 reassociation (the fp64 twin's noise).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from hfpatch import ParallelConfig
from hfpatch.core.config import ModelFacts, crosses_nodes, plan_parallel, resolve_parallel
from hfpatch.distributed.runtime import AXES
from hfpatch.testing.tolerance import reassociation_tol

SCRIPT = Path(__file__).with_name("two_nodes_script.py")


def _ulysses_groups(plan: ParallelConfig) -> list[list[int]]:
    """The global ranks of every Ulysses group, from the mesh's rank grid (the layout hfpatch's DeviceMesh uses)."""
    shape = [getattr(plan, axis) for axis in AXES]
    world = 1
    for size in shape:
        world *= size
    return torch.arange(world).view(shape).reshape(-1, plan.ulysses).tolist()


TABLE = [
    (nodes, per_node, heads, guides, pipefusion)
    for nodes in (1, 2, 3, 4)
    for per_node in (1, 2, 4, 8)
    for heads in (1, 2, 3, 4, 6, 8, 12, 24, 40)
    for guides in (False, True)
    for pipefusion in (False, True)
]


def test_the_planner_keeps_every_ulysses_group_inside_a_node():
    checked = 0
    for nodes, per_node, heads, guides, pipefusion in TABLE:
        world = nodes * per_node
        facts = ModelFacts(
            num_heads=heads, guides=guides, pipeline=True, num_blocks=4 if pipefusion else None
        )
        plan = plan_parallel(world, facts, pipefusion=pipefusion, node_size=per_node)
        case = (nodes, per_node, heads, guides, pipefusion, plan)
        groups = _ulysses_groups(plan)
        assert all(len({rank // per_node for rank in group}) == 1 for group in groups), case
        assert not crosses_nodes(plan.ulysses, world, per_node), case
        # The largest degree that divides the ranks left to sequence parallelism and the heads, inside a node.
        sp = plan.ring * plan.ulysses
        inside = [
            d
            for d in range(1, sp + 1)
            if sp % d == 0 and heads % d == 0 and (world <= per_node or per_node % d == 0)
        ]
        assert plan.ulysses == max(inside), case
        unaware = plan_parallel(world, facts, pipefusion=pipefusion)
        assert (plan.cfg, plan.pipefusion, plan.sequence_parallel) == (
            unaware.cfg,
            unaware.pipefusion,
            unaware.sequence_parallel,
        ), case  # the node size moves ranks from Ulysses to Ring only
        checked += 1
    assert checked == len(TABLE) == 576
    # The case: 24 heads, no guidance, two nodes of 4: Ring across, Ulysses 4 inside each node.
    plan = plan_parallel(8, ModelFacts(num_heads=24), node_size=4)
    assert (plan.ring, plan.ulysses) == (2, 4)
    assert plan_parallel(8, ModelFacts(num_heads=24)).ulysses == 8  # without the node size: across nodes


def test_an_explicit_plan_across_nodes_runs_and_warns_once_with_the_plan_that_would_not():
    facts = ModelFacts(num_heads=24, name="WanTransformer3DModel")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            plan = resolve_parallel(ParallelConfig(ulysses=8), 8, facts, node_size=4)
    assert plan.ulysses == 8  # runs as asked
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "Ulysses groups of 8 ranks across nodes of 4 ranks" in messages[0], messages[0]
    assert (
        "ParallelConfig(data=1, cfg=1, ring=2, ulysses=4, vae=8) keeps each Ulysses group inside"
        in messages[0]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inside a node, or the node size unknown: nothing said
        resolve_parallel(ParallelConfig(ring=2, ulysses=4), 8, facts, node_size=4)
        resolve_parallel(ParallelConfig(ulysses=8), 8, facts, node_size=8)
        resolve_parallel(ParallelConfig(ulysses=8), 8, facts, node_size=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> list[dict]:
    """Two torchrun agents of two ranks on this host, one c10d rendezvous."""
    out = tmp_path_factory.mktemp("nodes") / "result.json"
    port = _free_port()
    tests = str(SCRIPT.parents[1])  # the script imports the suite's shared helpers (tests/pipe_helpers.py)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HFPATCH_TIMEOUT_S": "120", "PYTHONPATH": path}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hfpatch-two-nodes",
        "--max-restarts", "0", str(SCRIPT), str(out),
    ]  # fmt: skip
    agents = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=400)[0])
    finally:
        for agent in agents:
            agent.kill()
    assert all(agent.returncode == 0 for agent in agents), "\n".join(logs)[-6000:]
    return json.loads(out.read_text())


def test_two_agents_plan_ulysses_inside_each_node_and_equal_unpatched(two_nodes):
    assert all(r["nodes"] == [0, 0, 1, 1] for r in two_nodes), two_nodes  # GROUP_RANK of each global rank
    for rank, result in enumerate(two_nodes):
        assert result["local_world_size"] == "2", result
        transformer, pipeline = result["transformer"], result["pipeline"]
        assert transformer["heads"] == 4  # one node of 4 would plan ulysses=4
        assert transformer["plan"] == "ParallelConfig(data=1, cfg=1, ring=2, ulysses=2, vae=1)", transformer
        assert pipeline["plan"] == "ParallelConfig(data=1, cfg=2, ring=1, ulysses=2, vae=4)", pipeline
        for case in (transformer, pipeline):
            assert len(case["ulysses_nodes"]) == 2 and len(set(case["ulysses_nodes"])) == 1, (rank, case)
            assert case["diff"] <= reassociation_tol(case["noise"]), (rank, case)


def test_the_node_size_is_torchruns_and_only_when_consistent(monkeypatch):
    """torchrun sets ``LOCAL_WORLD_SIZE`` and ``GROUP_WORLD_SIZE``; accelerate on CPU writes ``LOCAL_WORLD_SIZE=1``
    by itself when no launcher set it (the suite's rank pools): that alone must not shrink the Ulysses degree."""
    from hfpatch.core.ranks import node_size

    cases = [
        ({"LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, 2),
        ({"LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "1", "WORLD_SIZE": "8"}, 8),
        ({"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "4"}, None),  # accelerate's guess, no torchrun
        ({"LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, None),  # inconsistent
        ({}, None),
    ]
    for env, expected in cases:
        for name in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert node_size() == expected, env
