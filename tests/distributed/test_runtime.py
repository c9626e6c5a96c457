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


def _sharing_case():
    from hfpatch.distributed.runtime import describe_group

    shapes = {
        "r2u2": dict(ring=2, ulysses=2),
        "c2u2": dict(cfg=2, ulysses=2),
        "d2r2": dict(data=2, ring=2),
        "c2r2": dict(cfg=2, ring=2),
        "u4": dict(ulysses=4),
        "r4": dict(ring=4),
    }
    meshes = {name: get_mesh(ParallelConfig(**kwargs)) for name, kwargs in shapes.items()}
    names = {
        name: {axis: getattr(g, "group_name", None) for axis, g in mesh.groups.items()}
        for name, mesh in meshes.items()
    }
    device_mesh = meshes["r2u2"].device_mesh
    return {
        "names": names,
        "described": {
            axis: describe_group(meshes[m].group(axis)) for m, axis in (("u4", "ulysses"), ("r4", "ring"))
        },
        "dims": device_mesh.mesh_dim_names,
        "dim_groups": [device_mesh.get_group(a) is meshes["r2u2"].group(a) for a in ("ring", "ulysses")],
        "u4_dims": meshes["u4"].device_mesh.mesh_dim_names,
    }


def test_plans_of_other_shapes_share_the_groups_of_an_axis_that_splits_the_ranks_alike(rank_pool):
    """A group per axis and rank set, not per plan (each gloo group polls its sockets from a thread of its own;
    each NCCL communicator holds GPU buffers)."""
    for rank, result in enumerate(rank_pool(4).run(_sharing_case)):
        names = result["names"]
        assert names["c2u2"]["ulysses"] == names["r2u2"]["ulysses"], rank  # [0, 1], [2, 3] in both
        assert names["c2r2"]["ring"] == names["d2r2"]["ring"], rank  # [0, 1], [2, 3] in both
        assert names["c2r2"]["cfg"] == names["c2u2"]["cfg"], rank  # [0, 2], [1, 3] in both
        assert names["r2u2"]["ring"] != names["d2r2"]["ring"], rank  # [0, 2], [1, 3] there
        # the same ranks on other axes: groups of their own, named for their axis in error messages
        assert names["c2u2"]["cfg"] not in (names["r2u2"]["ring"], names["d2r2"]["data"]), rank
        assert names["u4"]["ulysses"] != names["r4"]["ring"], rank
        assert result["described"] == {
            "ulysses": "ulysses group of global ranks [0, 1, 2, 3]",
            "ring": "ring group of global ranks [0, 1, 2, 3]",
        }, rank
        assert (
            len({n["world"] for n in names.values()}) == 1 and names["u4"]["vae"] == names["u4"]["world"]
        ), rank
        # the DeviceMesh spans the split axes, on the same groups
        assert result["dims"] == ("ring", "ulysses") and result["dim_groups"] == [True, True], rank
        assert result["u4_dims"] == ("ulysses",), rank
