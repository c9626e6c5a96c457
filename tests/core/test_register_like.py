"""``hfpatch.register_like`` (issue 51): a copy of a supported class's code in another package, patched as that class.

The copy is made the way trainers make theirs (SimpleTuner ships ``simpletuner.helpers.models.wan.transformer``): the
source of diffusers' ``transformer_wan.py`` executed as a module of another package (``trainer_copy``; its relative
imports still resolve to diffusers'), so its ``WanTransformer3DModel``, attention class and processor are classes of
their own, not subclasses of diffusers'. Checked, on 2, 3 and 4 gloo ranks (Ulysses 2, Ring 2, Ulysses 3, Ulysses 2
x Ring 2; 25 tokens, so every world pads): refused before registration with an error that names ``register_like``; once registered, the
patched copy's output and every parameter and input gradient (after the documented SUM over the ``sp`` group) equal
the unpatched copy's within ``reassociation_tol`` of its fp32-vs-fp64 noise, and equal diffusers' own model with the
same weights (unpatched: bit for bit, the same code); ``remove()`` restores the refusal. A class whose ``forward``
or ``__init__`` differs is refused by ``register_like`` naming the difference, as are an unsupported ``like`` and a
subclass.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

import pytest
import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.distributed.runtime import get_mesh
from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.dits import split_gradients
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64

COPY = "trainer_copy.transformer_wan"


def copied_wan() -> ModuleType:
    """diffusers' ``transformer_wan`` source run as the module ``trainer_copy.transformer_wan`` (once per process)."""
    if COPY not in sys.modules:
        import diffusers.models.transformers.transformer_wan as original

        spec = importlib.util.spec_from_file_location(COPY, original.__file__)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = original.__package__  # its relative imports: diffusers' modules
        sys.modules[COPY] = module
        spec.loader.exec_module(module)
    return sys.modules[COPY]


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(diffusers' tiny Wan, the copy's class with the same config and weights)."""
    stock = tiny_wan_transformer()
    copy = copied_wan().WanTransformer3DModel.from_config(stock.config)
    copy.load_state_dict(stock.state_dict())
    return stock, copy


def _inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return dict(
        hidden_states=torch.randn(1, 4, 1, 10, 10, generator=g),  # 25 tokens
        timestep=torch.tensor([500]),
        encoder_hidden_states=wan_prompt_embeds(1, 6),
    )


def like_cases(configs: list[tuple[int, int]]) -> dict[str, Any]:
    """On each rank: the refusal before registration, then per ``(ulysses, ring)`` the patched copy against the
    unpatched copy (output and every gradient), and the unpatched copy against diffusers' model."""
    from diffusers import WanTransformer3DModel

    stock, copy = _models()
    cls = type(copy)
    assert not issubclass(cls, WanTransformer3DModel)
    kwargs = _inputs()
    report: dict[str, Any] = {}
    try:
        hfpatch.apply(copy, parallel=ParallelConfig(ulysses=configs[0][0], ring=configs[0][1]))
    except TypeError as error:
        report["refused"] = str(error)
    weight = torch.randn(1, 4, 1, 10, 10, generator=torch.Generator().manual_seed(7))
    with hfpatch.register_like(cls, WanTransformer3DModel):
        ref = split_gradients(copy, kwargs, weight)
        ref64 = split_gradients(to_fp64(copy), to_fp64(kwargs), weight.double())
        report["copy_vs_stock"] = max(
            rel_error(ref[k], v) for k, v in split_gradients(stock, kwargs, weight).items()
        )  # the same code: bit for bit
        floor = 0.01 * max(g.abs().max().item() for g in ref64.values())
        scales = {k: max(g.abs().max().item(), floor) for k, g in ref64.items()}
        noise = max(rel_error(ref[k], ref64[k], scales[k]) for k in ref)
        copy = copied_wan().WanTransformer3DModel.from_config(stock.config)
        copy.load_state_dict(stock.state_dict())
        for ulysses, ring in configs:
            config = ParallelConfig(ulysses=ulysses, ring=ring)
            seen: list[int] = []  # the tokens each transformer block gets: this rank's shard once patched
            hook = copy.blocks[0].register_forward_pre_hook(
                lambda _, args, s=seen: s.append(args[0].shape[1])
            )
            stock_processors = [type(m.processor) for m in copy.modules() if hasattr(m, "processor")]
            with hfpatch.apply(copy, parallel=config) as patch:
                got = split_gradients(copy, kwargs, weight, get_mesh(config).group("sp"))
                report[f"plan {ulysses}x{ring}"] = repr(patch.plan)
                processors = [type(m.processor) for m in copy.modules() if hasattr(m, "processor")]
            hook.remove()
            report[f"tokens {ulysses}x{ring}"] = seen
            report[f"swapped {ulysses}x{ring}"] = sum(
                a is not b for a, b in zip(stock_processors, processors)
            )
            diffusers_before = [type(m.processor) for m in stock.modules() if hasattr(m, "processor")]
            with hfpatch.apply(stock, parallel=config):  # as many as diffusers' own class gets
                diffusers_after = [type(m.processor) for m in stock.modules() if hasattr(m, "processor")]
            report[f"swapped by diffusers' class {ulysses}x{ring}"] = sum(
                a is not b for a, b in zip(diffusers_before, diffusers_after)
            )
            report[(ulysses, ring)] = (
                max(rel_error(got[k], ref[k], scales[k]) for k in ref),
                reassociation_tol(noise),
            )
    try:
        hfpatch.apply(copy, parallel=ParallelConfig(ulysses=configs[0][0], ring=configs[0][1]))
        report["refused_after_remove"] = None
    except TypeError as error:
        report["refused_after_remove"] = str(error)
    return report


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_registered_copy_is_patched_exactly_and_unregistered_refused(rank_pool, world):
    configs = {2: [(2, 1), (1, 2)], 3: [(3, 1)], 4: [(2, 2)]}[world]
    for rank, report in enumerate(rank_pool(world).run(like_cases, configs)):
        refused = report["refused"]
        assert (
            "trainer_copy.transformer_wan" in refused
            and "register_like(WanTransformer3DModel, diffusers.WanTransformer3DModel)" in refused
        ), refused
        assert report["refused_after_remove"] == refused
        assert report["copy_vs_stock"] == 0.0
        for ulysses, ring in configs:
            error, tol = report[(ulysses, ring)]
            assert error <= tol, (world, rank, ulysses, ring, error, tol)
            assert f"ring={ring}, ulysses={ulysses}" in report[f"plan {ulysses}x{ring}"]
            # The copy's own attention modules went through hfpatch (as many as in diffusers' class), and each
            # block saw this rank's shard of the 25 tokens, not all of them.
            swapped = report[f"swapped {ulysses}x{ring}"]
            assert swapped == report[f"swapped by diffusers' class {ulysses}x{ring}"] > 0, swapped
            assert set(report[f"tokens {ulysses}x{ring}"]) == {-(-25 // world)}, report[
                f"tokens {ulysses}x{ring}"
            ]


def test_register_like_refuses_what_does_not_fit():
    from diffusers import WanTransformer3DModel

    class OtherForward(torch.nn.Module):
        def __init__(self, *args, **kwargs): ...

        def forward(self, hidden_states, timestep): ...

    with pytest.raises(ValueError, match=r"forward takes \(self, hidden_states, timestep\)"):
        hfpatch.register_like(OtherForward, WanTransformer3DModel)

    class OtherDefault(torch.nn.Module):
        __init__ = WanTransformer3DModel.__init__

        def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                    return_dict=False, attention_kwargs=None):  # fmt: skip
            ...

    with pytest.raises(ValueError, match="return_dict: positional or keyword = False here"):
        hfpatch.register_like(OtherDefault, WanTransformer3DModel)
    with pytest.raises(ValueError, match="Linear is not a class hfpatch patches"):
        hfpatch.register_like(OtherDefault, torch.nn.Linear)
    with pytest.raises(ValueError, match="is a subclass of WanTransformer3DModel"):
        hfpatch.register_like(type("Sub", (WanTransformer3DModel,), {}), WanTransformer3DModel)
    with pytest.raises(TypeError, match="takes two classes"):
        hfpatch.register_like("WanTransformer3DModel", WanTransformer3DModel)
