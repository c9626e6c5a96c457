"""Height-split video VAEs (HunyuanVideo 1 and 1.5, LTX-Video, LTX-2, CogVideoX, Mochi, Allegro, Cosmos) vs the
unpatched stock VAEs, on gloo ranks. Cases and references: ``video_vae_cases.py``.

One ``pool.run`` per world size runs every class: decode and encode outputs, input and parameter gradients
(latent height 5: no world of 2, 3 or 4 divides it), and at worlds 2 and 4 the memory and bytes case.

Tolerances (``hfpatch.testing.tolerance``): the split changes only the order of floating-point sums (GroupNorm
statistics merged over the ranks, attention merged block by block with the log-sum-exp, gradients summed over
ranks; conv windows are assembled from the same values), so each result must be within ``reassociation_tol`` of
the unpatched fp32 VAE's own rounding noise against an fp64 twin.

Memory: the acceptance bound on the per-rank peak of live tensors of a decode (``vae_output="shard"``, local rows
kept), 0.6 of unpatched at N = 2 and 0.35 at N = 4, at latent 16 rows (Allegro: one tile of 16 x 16 latent
rows and columns; its output is gathered per tile). Bytes sent: every kind equals the analytic count from the
unsplit shapes (:func:`hfpatch.patches.vae.family.analytic_split_bytes`): halo rows, GroupNorm statistics (and
Allegro's per-tile output gather), ring attention blocks; the same-input guard aside.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import video_vae_cases as cases

from hfpatch.testing.tolerance import reassociation_tol

#: Acceptance bound on the per-rank decode peak, relative to the unsplit decode.
PEAK_BOUND = {2: 0.6, 4: 0.35}


def _world_cases(refs: dict[str, Any], memory: bool, modes: dict[str, Any] | None) -> dict[str, Any]:
    """On every rank: every class's split results, its memory/bytes case at worlds 2 and 4, and (world 2) the
    tiled/framewise/approx modes and the refusals."""
    out: dict[str, Any] = {}
    for name in cases.SPECS:
        out[name] = cases.split_case(name, refs[name])
        if memory:
            out[f"{name}/memory"] = cases.memory_case(name)
    if modes is not None:
        out["contract"] = cases.contract_case(modes)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_video_vaes_split_equals_unpatched_memory_and_bytes(rank_pool, world):
    torch.set_num_threads(1)
    refs = {name: cases.references(name) for name in cases.SPECS}  # once per session, in this process
    memory = world in PEAK_BOUND
    peaks = {name: cases.unpatched_peak(name) for name in cases.SPECS} if memory else {}
    modes = cases.mode_references() if world == 2 else None
    results = rank_pool(world).run(_world_cases, refs, memory, modes)
    if modes is not None:
        _check_contract([result["contract"] for result in results])
    for rank, result in enumerate(results):
        for name in cases.SPECS:
            for key, (error, noise) in result[name].items():
                if key.endswith("_params"):
                    assert error >= 10, (world, name, key, error)  # the decoder's or encoder's weights
                else:
                    assert error <= reassociation_tol(noise), (world, rank, name, key, error, noise)
            if not memory:
                continue
            mem = result[f"{name}/memory"]
            ratio = mem["peak"] / peaks[name]
            assert ratio <= PEAK_BOUND[world], (world, rank, name, ratio)
            sent = {k: v for k, v in mem["sent"].items() if k != "guard"}
            expected = {k: v for k, v in mem["analytic"].items() if v}
            assert sent == expected, (world, rank, name, sent, expected)
            assert expected.get("halo", 0) > 0, (name, expected)


def _check_contract(results: list[dict[str, Any]]) -> None:
    """World 2: the modes compose with the split, and misuse is refused with the same error on every rank."""
    assert (
        results[0]["rng"] == results[1]["rng"]
        and results[0]["mochi_framewise"] == results[1]["mochi_framewise"]
    )
    for res in results:
        # Bit-identical needs the same kernels summing in the same order: the ranks and this process (the
        # references) at one thread each. At 2 threads a rank's Mochi tiles differ by one ulp (9.5e-7 of 12.7):
        # the ranks once inherited 2 from accelerate's PartialState in an earlier test (RankPool resets it).
        assert res["threads"] == torch.get_num_threads() == 1, res["threads"]
        for name in cases.TILED:
            # The stock tile code on the same tiles, some on each rank, exchanged exactly: bit-identical.
            assert res[f"{name}/tiled"] == 0.0, (name, res)
        error, noise = res["framewise"]
        assert error <= reassociation_tol(noise), res  # every frame tile is a split call of its own
        assert res["identity"] is True, res
        assert res["approx"] > 1e-3, res  # approx skips the conv halos: it must differ from precise
        assert res["mochi_framewise"].startswith("TypeError") and "framewise" in res["mochi_framewise"], res
        assert (
            res["allegro_shard"].startswith("ValueError") and "vae_output='full'" in res["allegro_shard"]
        ), res
        assert "gradient checkpointing" in res["checkpointing"], res
        assert "torch_rng_state" in res["rng"] and "differs from rank 0" in res["rng"], res
