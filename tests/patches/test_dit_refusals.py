"""``hfpatch.apply`` on a DiT class hfpatch does not split (``hfpatch.patches.dit.UNSUPPORTED``): a short error that
names the class, gives the table's reason and says what to do, raised alike on every rank before anything is patched.

The refusal is decided by the class alone (the registry's lookup along the MRO), so the test over every class of the
table applies hfpatch to an instance of each class that carries ``nn.Module``'s state only (its own ``__init__``, which
needs a config of that class, is not run): what runs is ``apply``'s whole path (lookup, refusal, the ranks' handshake
over the target's type) on the real class. A real tiny ``LatteTransformer3DModel`` and its pipeline show that a built
model takes the same path, and that a pipeline asked to split its refused transformer gets the same reason.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.core.registry import Registry
from hfpatch.patches.dit import UNSUPPORTED

#: An error that reads in one glance (the old one listed 1,700 characters of class names).
MAX_LENGTH = 700


def _class(name: str) -> type:
    import diffusers.models.transformers as transformers

    return getattr(transformers, name)


def _stand_in(cls: type) -> torch.nn.Module:
    """An instance of ``cls`` with ``nn.Module``'s state only (no config needed: the refusal reads the type)."""
    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    return obj


def _tiny_latte() -> torch.nn.Module:
    from diffusers import LatteTransformer3DModel

    torch.manual_seed(0)  # the same weights on every rank (apply checks that they agree)
    return LatteTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=1,
        sample_size=8,
        patch_size=2,
        cross_attention_dim=16,
        caption_channels=16,
        video_length=2,
    )


def refusal_cases() -> dict[str, Any]:
    """Per case: (error type, message), or what ``apply`` did instead."""
    from diffusers import DDIMScheduler, LattePipeline

    from hfpatch.testing import tiny_autoencoder_kl

    world = dist.get_world_size()
    results: dict[str, Any] = {}

    def attempt(case: str, target: Any, parallel: Any) -> None:
        try:
            patch = hfpatch.apply(target, parallel=parallel)
        except (TypeError, ValueError) as exc:
            results[case] = (type(exc).__name__, str(exc))
        else:
            results[case] = ("patched", str(patch.plan))
            patch.remove()

    for name in UNSUPPORTED:
        attempt(name, _stand_in(_class(name)), ParallelConfig(ulysses=world))
        attempt(f"{name} (parallel=None)", _stand_in(_class(name)), None)
    latte = _tiny_latte()
    attempt("latte", latte, ParallelConfig(ring=world))
    pipe = LattePipeline(
        tokenizer=None,
        text_encoder=None,
        vae=tiny_autoencoder_kl(),
        transformer=latte,
        scheduler=DDIMScheduler(),
    )
    attempt("latte pipeline ulysses", pipe, ParallelConfig(ulysses=world))
    attempt("latte pipeline cfg", pipe, ParallelConfig(cfg=2, data=world // 2))
    return results


def test_refusals_every_unsupported_class_says_why_on_every_rank(rank_pool):
    results = rank_pool(2).run(refusal_cases)
    assert results[0] == results[1]  # the same error on every rank
    got = results[0]
    for name, reason in UNSUPPORTED.items():
        for case in (name, f"{name} (parallel=None)"):
            kind, message = got[case]
            assert kind == "TypeError", (case, kind, message)
            assert message.startswith(f"hfpatch does not split {name} over ranks: {reason}."), (case, message)
            assert "ParallelConfig(cfg=2)" in message and "hfpatch info" in message, message
            assert len(message) <= MAX_LENGTH, (case, len(message))
    kind, message = got["latte"]
    assert kind == "TypeError" and message.startswith(
        f"hfpatch does not split LatteTransformer3DModel over ranks: {UNSUPPORTED['LatteTransformer3DModel']}."
    ), message
    kind, message = got["latte pipeline ulysses"]
    assert kind == "ValueError", message
    assert message.startswith(
        "ulysses=2, ring=1 split LattePipeline's transformer, but hfpatch does not split "
    ), message
    assert UNSUPPORTED["LatteTransformer3DModel"] in message and len(message) <= MAX_LENGTH, message
    assert got["latte pipeline cfg"][0] == "patched"  # the advice works: CFG parallel runs it whole per rank


def test_registry_refusal_follows_the_mro_and_yields_to_families():
    class Refused(torch.nn.Module):
        pass

    class SubOfRefused(Refused):
        pass

    class Supported(torch.nn.Module):
        pass

    class RefusedSubOfSupported(Supported):
        pass

    for cls in (Refused, SubOfRefused, Supported, RefusedSubOfSupported):
        cls.__module__ = "fakelib.models"
    registry = Registry()
    registry.register("fakelib.Supported", "builtins:object")
    registry.register_refusals(
        {"Refused": "why not", "RefusedSubOfSupported": "no", "Supported": "x"}, library="fakelib"
    )
    assert registry.refusal_for(Refused()) == ("Refused", "why not")
    assert registry.refusal_for(SubOfRefused()) == ("Refused", "why not")  # inherits its parent's reason
    assert registry.refusal_for(Supported()) is None  # a class with families is never refused
    assert registry.refusal_for(RefusedSubOfSupported()) == ("RefusedSubOfSupported", "no")
    assert registry.refusal_for(torch.nn.Linear(1, 1)) is None
    lazy = Registry()
    lazy.register_refusals("hfpatch.patches.dit.plans:UNSUPPORTED", library="diffusers")
    assert lazy.refusal_for(_stand_in(_class("SanaVideoTransformer3DModel"))) == (
        "SanaVideoTransformer3DModel",
        UNSUPPORTED["SanaVideoTransformer3DModel"],
    )
