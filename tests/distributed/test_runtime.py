"""The parallel mesh: axis groups have the documented membership (ulysses innermost)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hfpatch.core.config import ParallelConfig
from hfpatch.distributed.runtime import ensure_process_group, get_mesh


def _members(group):
    return None if group is None else sorted(dist.get_process_group_ranks(group))


def _mesh_case(configs):
    out = []
    for kwargs in configs:
        mesh = get_mesh(ParallelConfig(**kwargs))
        out.append(
            {axis: _members(mesh.group(axis)) for axis in ("data", "cfg", "ring", "ulysses", "sp", "vae")}
            | {"sp_rank": mesh.local_rank("sp"), "same_object": get_mesh(ParallelConfig(**kwargs)) is mesh}
        )
    return out


def test_mesh_axes_membership_world_4(rank_pool):
    configs = [dict(ring=2, ulysses=2), dict(cfg=2, ulysses=2), dict(ulysses=4), dict(data=2, ring=2)]
    per_rank = rank_pool(4).run(_mesh_case, configs)
    for rank, results in enumerate(per_rank):
        ring_ulysses, cfg_ulysses, ulysses_only, data_ring = results
        assert ring_ulysses["ulysses"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert ring_ulysses["ring"] == [rank % 2, rank % 2 + 2]
        assert (
            ring_ulysses["sp"] == [0, 1, 2, 3] and ring_ulysses["sp_rank"] == rank
        )  # ring*u + ulysses index
        assert ring_ulysses["cfg"] is None and ring_ulysses["vae"] == [0, 1, 2, 3]
        assert cfg_ulysses["cfg"] == [rank % 2, rank % 2 + 2] and cfg_ulysses["sp"] == cfg_ulysses["ulysses"]
        assert ulysses_only["sp"] == [0, 1, 2, 3] and ulysses_only["ring"] is None
        assert data_ring["data"] == [rank % 2, rank % 2 + 2] and data_ring["sp"] == data_ring["ring"]
        assert all(r["same_object"] for r in results)  # groups are built once per shape


def _wrong_world_case():
    try:
        ensure_process_group(3)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ensure_process_group_rejects_other_world_size(rank_pool):
    assert (
        rank_pool(2).run(_wrong_world_case)
        == [
            "hfpatch was asked for 3 ranks but the world size is 2; pass parallel=2 or a ParallelConfig whose "
            "degrees multiply to it"
        ]
        * 2
    )


def test_single_rank_mesh_has_no_groups():
    mesh = get_mesh(ParallelConfig())
    assert all(mesh.group(axis) is None for axis in ("data", "cfg", "ring", "ulysses", "sp", "vae"))
    assert mesh.size("sp") == 1 and mesh.local_rank("ulysses") == 0
    with pytest.raises(KeyError, match="unknown mesh axis 'tensor'"):
        mesh.group("tensor")
