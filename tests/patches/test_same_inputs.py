"""Ranks that share one split call but were given different inputs raise the same error on every rank.

For each split kind -- a sequence-parallel transformer call, a CFG/data-parallel pipeline call (and its
transformer calls), a split VAE decode -- the last rank of the group receives an input that differs from the
others by one bit of one element, by a scale of ``1 + 1e-6``, by a permutation, by shape, by dtype, or by a
scalar argument (timestep, step count, guidance, height, generator seed). Every rank must raise the same
``InputMismatchError`` naming the argument, before any shape-dependent collective (so no rank hangs or
aborts), and the patch must stay usable: identical inputs afterwards give exactly what the same patched
call gave before the errors (same kernels on the same values). The comparison of inputs is exact (a digest
of the bits), so there is no tolerance to state; patched-vs-unpatched fidelity is tested elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pipe_helpers import wan_pipe_call

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.distributed.agreement import InputMismatchError
from hfpatch.testing import tiny_autoencoder_kl, tiny_wan_pipe, tiny_wan_transformer, wan_prompt_embeds


def _flip_bit(x: torch.Tensor, index: int) -> torch.Tensor:
    """``x`` with the lowest bit of element ``index`` (of the flattened tensor) flipped."""
    out = x.clone()
    out.view(-1).view(torch.int32)[index] ^= 1
    return out


def _swap(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its first and last elements exchanged (a permutation: same values, same sums)."""
    out = x.clone().view(-1)
    out[0], out[-1] = x.view(-1)[-1], x.view(-1)[0]
    return out.view(x.shape)


def _perturbations(
    x: torch.Tensor, grow: Callable[[torch.Tensor], torch.Tensor], dtype: bool = True
) -> dict[str, torch.Tensor]:
    """Every way the odd rank's copy of ``x`` differs; ``grow`` makes a tensor of another shape."""
    cases = {
        "bit_first": _flip_bit(x, 0),
        "bit_middle": _flip_bit(x, x.numel() // 2 + 1),
        "bit_last": _flip_bit(x, x.numel() - 1),
        "scale": x * (1 + 1e-6),
        "permutation": _swap(x),
        "shape": grow(x),
    }
    if dtype:
        cases["dtype"] = x.double()
    return cases


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except InputMismatchError as exc:
        return f"InputMismatchError: {exc}"
    except Exception as exc:  # anything else is a failure of the guard (reported by the test)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _odd(value: Any, reference: Any) -> Any:
    """``value`` on the last rank, ``reference`` on the others."""
    return value if dist.get_rank() == dist.get_world_size() - 1 else reference


# ----------------------------------------------------------------------------------------------- rank fns
def _transformer_cases(config: ParallelConfig) -> dict[str, Any]:
    model = tiny_wan_transformer()
    x = torch.randn(1, 4, 1, 10, 10, generator=torch.Generator().manual_seed(1))
    text = wan_prompt_embeds(1, 6)
    timestep = torch.tensor([500])
    results: dict[str, Any] = {}
    with torch.no_grad(), hfpatch.apply(model, parallel=config):
        before = model(x, timestep, text).sample
        for case, bad in _perturbations(x, lambda t: torch.cat([t, t[:, :, :1]], 2)).items():
            results[f"hidden_states {case}"] = _outcome(lambda bad=bad: model(_odd(bad, x), timestep, text))
        results["encoder_hidden_states bit"] = _outcome(
            lambda: model(x, timestep, _odd(_flip_bit(text, 7), text))
        )
        results["timestep"] = _outcome(lambda: model(x, _odd(torch.tensor([501]), timestep), text))
        results["return_dict"] = _outcome(lambda: model(x, timestep, text, return_dict=_odd(False, True)))
        results["after"] = torch.equal(model(x, timestep, text).sample, before)
    return results


def _pipeline_cases(config: ParallelConfig) -> dict[str, Any]:
    pipe = tiny_wan_pipe()
    embeds = wan_prompt_embeds()
    results: dict[str, Any] = {}
    with hfpatch.apply(pipe, parallel=config):
        before = wan_pipe_call(pipe)
        # No dtype case: the pipeline casts prompt_embeds to the transformer's dtype (fp64 copies of the same
        # fp32 values come back identical, and the call is right to run).
        for case, bad in _perturbations(embeds, lambda t: torch.cat([t, t[:, :1]], 1), dtype=False).items():
            results[f"prompt_embeds {case}"] = _outcome(
                lambda bad=bad: wan_pipe_call(pipe, prompt_embeds=_odd(bad, embeds))
            )
        scalars = {
            "num_inference_steps": dict(num_inference_steps=_odd(3, 2)),
            "guidance_scale": dict(guidance_scale=_odd(4.0, 5.0)),
            "no_guidance": dict(guidance_scale=_odd(1.0, 5.0)),
            "height": dict(height=_odd(48, 32)),
            "generator": dict(generator=torch.Generator().manual_seed(_odd(1, 0))),
        }
        for case, overrides in scalars.items():
            results[case] = _outcome(lambda overrides=overrides: wan_pipe_call(pipe, **overrides))
        results["after"] = torch.equal(wan_pipe_call(pipe), before)
    return results


def _vae_cases() -> dict[str, Any]:
    vae = tiny_autoencoder_kl()
    z = torch.randn(1, 4, 5, 3, generator=torch.Generator().manual_seed(1))
    empty = torch.zeros(0, 4, 5, 3)
    results: dict[str, Any] = {"empty batch unpatched": _outcome(lambda: vae.decode(empty))}
    with torch.no_grad(), hfpatch.apply(vae):
        before = vae.decode(z).sample
        for case, bad in _perturbations(z, lambda t: torch.cat([t, t[:, :, :1]], 2)).items():
            results[f"z {case}"] = _outcome(lambda bad=bad: vae.decode(_odd(bad, z)))
        results["generator"] = _outcome(
            lambda: vae.decode(z, generator=torch.Generator())
        )  # not a split input
        results["empty batch"] = _outcome(lambda: vae.decode(empty))  # what the unpatched VAE does, at once
        results["after"] = torch.equal(vae.decode(z).sample, before)
    return results


# ----------------------------------------------------------------------------------------------- checks
def _check(results: list[dict[str, Any]], expected: dict[str, str]) -> None:
    """Every case raised the same InputMismatchError on every rank, naming ``expected[case]`` and the odd
    rank; afterwards the patch still works (the same call gives bit for bit what it gave before)."""
    odd = len(results) - 1
    for case, argument in expected.items():
        messages = [r[case] for r in results]
        assert all(m == messages[0] for m in messages), (case, messages)  # the same error on every rank
        assert messages[0].startswith("InputMismatchError: hfpatch: the ranks"), (case, messages[0])
        label = argument if argument.startswith("'") else repr(argument)  # a pipeline argument: its label
        assert f"{label}: differs from rank 0" in messages[0], (case, argument, messages[0])
        assert f"on rank {odd}:" in messages[0] and "check_inputs=False" in messages[0], messages[0]
    assert all(r["after"] is True for r in results), [r["after"] for r in results]


TENSOR_CASES = ("bit_first", "bit_middle", "bit_last", "scale", "permutation", "shape", "dtype")


@pytest.mark.parametrize(
    "world, config",
    [(2, ParallelConfig(ulysses=2)), (3, ParallelConfig(ring=3)), (4, ParallelConfig(ulysses=2, ring=2))],
)
def test_sequence_parallel_transformer_refuses_per_rank_inputs(rank_pool, world, config):
    results = rank_pool(world).run(_transformer_cases, config)
    expected = {f"hidden_states {c}": "hidden_states" for c in TENSOR_CASES}
    expected.update(
        {
            "encoder_hidden_states bit": "encoder_hidden_states",
            "timestep": "timestep",
            "return_dict": "return_dict",
        }
    )
    _check(results, expected)
    assert "value 500.0" in results[0]["timestep"] and "value 501.0" in results[0]["timestep"]


@pytest.mark.parametrize(
    "world, config",
    [(2, ParallelConfig(cfg=2)), (3, ParallelConfig(ring=3)), (4, ParallelConfig(cfg=2, ulysses=2))],
)
def test_parallel_pipeline_refuses_per_rank_inputs(rank_pool, world, config):
    results = rank_pool(world).run(_pipeline_cases, config)
    # The arguments the user passed the pipeline come first, not the transformer's computed from them.
    embeds = "'prompt_embeds' (WanPipeline argument)"
    expected = {f"prompt_embeds {c}": embeds for c in TENSOR_CASES if c != "dtype"}
    expected.update(
        {
            "num_inference_steps": "pipeline scheduler timesteps",
            "guidance_scale": "pipeline guidance_scale",
            "no_guidance": "pipeline guidance_scale",
            "height": "'height' (WanPipeline argument)",
            "generator": "'generator' (WanPipeline argument)",
        }
    )
    _check(results, expected)
    for case, argument in expected.items():
        if argument.startswith("'"):  # a pipeline argument is named first
            first = results[0][case].splitlines()[1]
            assert argument in first, (case, first)
    generator = results[0]["generator"]
    assert "(seed 0) on rank" in generator and "(seed 1)" in generator, generator
    assert "(the arguments below are computed from those above)" in results[0]["prompt_embeds bit_first"]


@pytest.mark.parametrize("world", [2, 3])
def test_split_vae_refuses_per_rank_inputs_and_treats_empty_batches_as_unpatched(rank_pool, world):
    results = rank_pool(world).run(_vae_cases)
    _check(results, {f"z {c}": "x" for c in TENSOR_CASES})
    assert all(r["empty batch"] == r["empty batch unpatched"] for r in results), results[0]["empty batch"]
    assert all(r["generator"] == "no error" for r in results), [r["generator"] for r in results]
