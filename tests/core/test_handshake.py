"""The ``hfpatch.apply`` handshake: ranks that call ``apply`` differently raise the same ``ApplyMismatchError``
on every rank, naming what each rank passed, and nothing is patched anywhere; identical calls (valid or not)
behave as without the handshake. (``apply`` on some ranks only: see tests/distributed/test_faults.py.)

Every case here calls ``apply`` exactly once on every rank, so the shared pool's handshake counters stay in step.
"""

from __future__ import annotations

from typing import Any

import pytest

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.api import ApplyMismatchError, _config_text, _text
from hfpatch.core.registry import PatchFamily, Registry
from hfpatch.testing import tiny_autoencoder_kl, tiny_wan_transformer


class Scale(PatchFamily):
    """Toy family with an option (validated: ``factor > 0``)."""

    name = "scale"
    options = {"factor": 2.0}
    role = "vae"

    def validate(self, target, config, options):
        if options["factor"] <= 0:
            raise ValueError(f"factor must be > 0, got {options['factor']}")

    def apply(self, target, patch, mesh, options):
        patch.set_attr(target, "_toy_factor", options["factor"])


def _registry() -> Registry:
    registry = Registry()
    registry.register("diffusers.AutoencoderKL", Scale)
    return registry


def _outcome(target: Any, **kwargs: Any) -> dict[str, Any]:
    """Call ``apply`` once; what it raised (type, message, cause) and whether ``target`` was left alone."""
    before = dict(vars(target))
    try:
        patch = hfpatch.apply(target, **kwargs)
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "cause": None if exc.__cause__ is None else type(exc.__cause__).__name__,
            "untouched": hfpatch.get_patch(target) is None
            and dict(vars(target)).keys() == before.keys()
            and all(vars(target)[k] is v for k, v in before.items()),
        }
    patch.remove()
    return {"type": None, "plan": _config_text(patch.plan)}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


# ----------------------------------------------------------------------------------------------- cases
def _different_parallel() -> dict[str, Any]:
    parallel = ParallelConfig(ulysses=2) if _rank() == 0 else ParallelConfig(ring=2)
    return _outcome(tiny_wan_transformer(), parallel=parallel)


def _different_options() -> dict[str, Any]:
    return _outcome(tiny_autoencoder_kl(), parallel=2, registry=_registry(), factor=2.0 + _rank())


def _one_rank_invalid() -> dict[str, Any]:
    options = {"factor": 2.0} if _rank() == 0 else {"factr": 2.0}  # a typo on rank 1: TypeError there only
    return _outcome(tiny_autoencoder_kl(), parallel=2, registry=_registry(), **options)


def _same_invalid() -> dict[str, Any]:
    return _outcome(tiny_autoencoder_kl(), parallel=2, registry=_registry(), factor=-1.0)


def _different_models() -> dict[str, Any]:
    model = tiny_wan_transformer(num_layers=2 + _rank())
    return _outcome(model, parallel=ParallelConfig(ulysses=2))


def _same_call_twice() -> list[Any]:
    model = tiny_wan_transformer()
    first = hfpatch.apply(model, parallel=2)
    again = hfpatch.apply(model, parallel=2)  # the live identical patch, after a handshake on every rank
    same = again is first
    first.remove()
    return [same, _config_text(first.plan)]


def _handshake_cases() -> dict[str, Any]:
    return {
        "parallel": _different_parallel(),
        "options": _different_options(),
        "one_invalid": _one_rank_invalid(),
        "same_invalid": _same_invalid(),
        "models": _different_models(),
        "twice": _same_call_twice(),
    }


@pytest.fixture(scope="module")
def results(rank_pool) -> list[dict[str, Any]]:
    return rank_pool(2).run(_handshake_cases)


# ----------------------------------------------------------------------------------------------- checks
def test_different_parallel_raises_the_same_error_on_every_rank(results):
    rank0, rank1 = (r["parallel"] for r in results)
    assert rank0 == rank1, (rank0, rank1)  # word for word
    assert rank0["type"] == "ApplyMismatchError" and rank0["untouched"]
    message = rank0["message"]
    assert "rank 0: hfpatch.apply(WanTransformer3DModel, parallel=ParallelConfig(ulysses=2))" in message
    assert "rank 1: hfpatch.apply(WanTransformer3DModel, parallel=ParallelConfig(ring=2))" in message
    assert "nothing was patched on any rank" in message


def test_different_options_are_named_per_rank(results):
    rank0, rank1 = (r["options"] for r in results)
    assert rank0 == rank1 and rank0["type"] == "ApplyMismatchError" and rank0["untouched"]
    assert (
        "rank 0: hfpatch.apply(AutoencoderKL, parallel=2, factor=2.0) -> plan ParallelConfig(vae=2)"
        in (rank0["message"])
    )
    assert "rank 1: hfpatch.apply(AutoencoderKL, parallel=2, factor=3.0)" in rank0["message"]


def test_an_error_on_one_rank_only_raises_on_every_rank(results):
    rank0, rank1 = (r["one_invalid"] for r in results)
    assert rank0["message"] == rank1["message"] and rank0["type"] == rank1["type"] == "ApplyMismatchError"
    assert (
        "rank 1: hfpatch.apply(AutoencoderKL, parallel=2, factr=2.0) raised TypeError: unknown option"
        in (rank0["message"])
    )
    assert rank1["cause"] == "TypeError" and rank0["cause"] is None  # each rank's own error is chained
    assert rank0["untouched"] and rank1["untouched"]


def test_the_same_invalid_call_raises_its_own_error(results):
    for r in results:
        assert r["same_invalid"]["type"] == "ValueError" and r["same_invalid"]["untouched"]
        assert r["same_invalid"]["message"] == "factor must be > 0, got -1.0"


def test_different_models_are_refused(results):
    rank0, rank1 = (r["models"] for r in results)
    assert rank0 == rank1 and rank0["type"] == "ApplyMismatchError" and rank0["untouched"]
    assert (
        "model config digest" in rank0["message"] and "build the same model on every rank" in rank0["message"]
    )


def test_identical_calls_pass(results):
    for r in results:
        assert r["twice"] == [True, "ParallelConfig(ulysses=2, vae=1)"]  # a transformer: no VAE to split


def test_call_text_has_no_addresses():
    assert issubclass(ApplyMismatchError, ValueError)  # callers catching ValueError keep working
    assert _text(object()) == "<object object>"
    assert _config_text(ParallelConfig(ring=2, ulysses=2)) == "ParallelConfig(ring=2, ulysses=2)"
    assert _config_text(ParallelConfig(ulysses=2, vae=1)) == "ParallelConfig(ulysses=2, vae=1)"
    assert _config_text(ParallelConfig()) == "ParallelConfig()"
