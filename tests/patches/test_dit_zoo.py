"""The contract battery over every data-described tiny DiT (``hfpatch.testing.dits.TINY_DITS``), gloo, fp32.

Each row of ``TINY_DITS`` is a stock diffusers transformer class with a row in ``hfpatch.patches.dit.PLANS``. The
same rank functions and checks as ``test_dit_usp.py``/``test_dit_plans.py`` (forward within ``reassociation_tol``
of the unpatched model's own fp32-vs-fp64 noise, gradients after the sp reduction, ``remove()`` restores identity,
each rank attends from its own shard), run for all rows in one ``pool.run`` per world size: at world 2, 3 and 4
with Ulysses, Ring and 2x2, on 25 tokens (no world divides them: every layout pads) and 4 heads (Ulysses 3 splits
them unevenly). On top: every transformer class of the installed diffusers is either supported or has an
architectural reason in ``UNSUPPORTED``, and every row's mask input really changes the stock output.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_dit_usp import (
    _configs,
    backward_cases,
    build,
    check_backward,
    check_forward,
    forward_cases,
    lifecycle_cases,
)

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.attention.layout import shard_len
from hfpatch.testing.dits import TINY_DITS, _make, tiny_dit, tiny_dit_inputs
from hfpatch.testing.tolerance import rel_error

ZOO = tuple(TINY_DITS)


def zoo_shard_cases(names: list[str]) -> dict[str, dict[str, Any]]:
    """What the stand-in processors saw in one patched forward (ring over the whole world)."""
    from hfpatch.patches.dit import USPDispatchProcessor

    world = dist.get_world_size()
    results = {}
    for name in names:
        model, kwargs, _ = build(name)
        with torch.no_grad(), hfpatch.apply(model, parallel=ParallelConfig(ring=world)):
            model(**kwargs)
            stand_ins = [
                m.processor
                for m in model.modules()
                if isinstance(getattr(m, "processor", None), USPDispatchProcessor)
            ]
            results[name] = {
                "valid_len": stand_ins[0].state.valid_len,
                "local_len": stand_ins[0].state.local_len,
                "calls": [p.calls for p in stand_ins],
            }
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zoo_forward_every_row_and_layout_matches_unpatched(rank_pool, world):
    cases = [(name, u, r) for name in ZOO for u, r in _configs(world)]
    check_forward(rank_pool(world).run(forward_cases, cases), cases)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zoo_backward_param_and_input_grads_match_unpatched(rank_pool, world):
    layouts = {2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2)]}[world]
    cases = [(name, u, r) for name in ZOO for u, r in layouts]
    check_backward(rank_pool(world).run(backward_cases, cases), cases)


def test_zoo_lifecycle_remove_restores_identity_double_apply_conflict(rank_pool):
    results = rank_pool(2).run(lifecycle_cases, list(ZOO))
    for rank_result in results:
        for name, result in rank_result.items():
            assert result["identity"], name
            assert result["again_is_patch"], name
            assert result["conflict"] is not None and "already patched" in result["conflict"], name
            assert result["swapped"] == TINY_DITS[name].routed, (name, result["repr"])


def test_zoo_attends_from_each_rank_shard(rank_pool):
    for rank_result in rank_pool(3).run(zoo_shard_cases, list(ZOO)):
        for name, seen in rank_result.items():
            tokens = TINY_DITS[name].tokens
            assert seen["valid_len"] == tokens, (name, seen)
            assert seen["local_len"] == shard_len(tokens, 3) < tokens, (name, seen)
            assert all(calls == TINY_DITS[name].calls for calls in seen["calls"]), (name, seen)
            assert len(seen["calls"]) == TINY_DITS[name].routed, (name, seen)


def zoo_error_cases() -> dict[str, str]:
    """Refusals of the new rows, raised before any collective (the same message on every rank)."""
    world = dist.get_world_size()
    messages: dict[str, str] = {}

    def expect(case: str, name: str, fn, **overrides: Any) -> None:
        model, kwargs = tiny_dit(name, **overrides), tiny_dit_inputs(name)
        try:
            with torch.no_grad():
                fn(model, kwargs)
        except ValueError as exc:
            messages[case] = str(exc)
        else:
            messages[case] = "no error"

    def call(changes: dict[str, Any]):
        def run(model, kwargs):
            with hfpatch.apply(model, parallel=ParallelConfig(ulysses=world)):
                model(**{**kwargs, **changes})

        return run

    expect("block_causal", "skyreels_v2", call({}), num_frame_per_block=2)
    expect(
        "diffusion_forcing",
        "skyreels_v2",
        call({"enable_diffusion_forcing": True, "timestep": torch.ones(2, 1)}),
    )
    expect(
        "reference_images",
        "flux3",
        call({"image_cond_hidden_states": torch.ones(1, 4, 16), "image_cond_ids": torch.zeros(4, 4)}),
    )
    two_sizes = [torch.ones(4, 1, 10, 10), torch.ones(4, 1, 10, 12)]
    expect("image_sizes", "zimage", call({"x": two_sizes}))
    expect(
        "caption_lengths",
        "lumina2",
        call({"encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])}),
    )
    expect("segments", "ideogram4", call({"segment_ids": torch.tensor([[1] * 16 + [2] * 15])}))
    expect("kv_caches", "glm_image", call({"kv_caches": object()}))
    return messages


def test_zoo_refusals_raise_before_collectives_on_every_rank(rank_pool):
    results = rank_pool(2).run(zoo_error_cases)
    assert results[0] == results[1]
    messages = results[0]
    assert (
        "num_frame_per_block=2 is not supported under sequence parallelism (the block-causal"
        in messages["block_causal"]
    )
    assert "enable_diffusion_forcing= is not supported" in messages["diffusion_forcing"]
    assert "image_cond_hidden_states= is not supported" in messages["reference_images"]
    assert "images of different sizes in one batch" in messages["image_sizes"]
    assert "captions of different lengths in one batch" in messages["caption_lengths"]
    assert "several segments per sample" in messages["segments"]
    assert "kv_caches= is not supported" in messages["kv_caches"]


@pytest.mark.parametrize("name", [name for name, row in TINY_DITS.items() if row.mask])
def test_zoo_mask_changes_the_stock_output(name):
    """The masked rows can fail: their mask moves the unpatched output by far more than any tolerance."""
    model, masked = tiny_dit(name), tiny_dit_inputs(name)
    row = TINY_DITS[name]
    plain = torch.ones_like(masked[row.mask]) if row.unmasked is None else _make(row.unmasked, 0)
    unmasked = {**masked, row.mask: plain}
    with torch.no_grad():
        assert rel_error(model(**masked).sample, model(**unmasked).sample) > 1e-3


def test_zoo_every_diffusers_transformer_is_supported_or_has_a_reason():
    """``hfpatch info --classes``' table: no class is left at "no plan"; the rows, PLANS and the registry agree."""
    from hfpatch.cli import info_lines
    from hfpatch.patches import DIT_USP_CLASSES, TRAINER_DIT_CLASSES
    from hfpatch.patches.dit import PLANS, UNSUPPORTED
    from hfpatch.patches.dit.family import support_table

    assert {f"diffusers.{name}" for name in DIT_USP_CLASSES} | set(TRAINER_DIT_CLASSES) == set(PLANS)
    assert {f"diffusers.{row.cls}" for row in TINY_DITS.values()} <= set(PLANS)
    rows = dict(support_table())
    supported = {name for name, how in rows.items() if how.startswith("dit_usp")}
    assert supported == {key.removeprefix("diffusers.") for key in PLANS if key.startswith("diffusers.")}
    for name, how in rows.items():
        if name not in supported:
            assert how == f"not supported ({UNSUPPORTED[name]})", (name, how)
    assert not set(UNSUPPORTED) & supported
    lines = info_lines(classes=True)  # `hfpatch info --classes`: every class
    assert all(f"  {name}: {how}" in lines for name, how in rows.items())
