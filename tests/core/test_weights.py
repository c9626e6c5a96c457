"""Ranks that hold different weights are refused, on every rank alike, before anything is patched, and at the
first patched call after an adapter is added (issue 33: a pipeline built per rank without a common seed ran
patched and returned an output 0.58 off the unpatched one, silently).

Cases, on 2 gloo ranks in one ``pool.run``: one ulp of one element of one transformer weight on rank 1; one
ulp in a pipeline's VAE; a LoRA initialised per rank before ``apply``; the same LoRA added after ``apply``
(refused at the next call, the patch stays usable once the adapters agree); a LoRA added alike after ``apply``
(accepted: the weights are re-read once, the call equals the unpatched model with the same adapter); and
``check_inputs=False``, which skips the check. The comparison is exact (digests of the bits), so there is no
tolerance to state; the outputs compared here run the same kernels on the same values (bit for bit).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig

import hfpatch
from hfpatch import ParallelConfig, WeightMismatchError
from hfpatch.distributed.agreement import (
    bulk_digest,
    weight_digests,
    weight_watch_of,
    weights_mismatch_message,
)
from hfpatch.testing import tiny_wan_pipe, tiny_wan_transformer, wan_prompt_embeds

WEIGHT = "blocks.1.attn1.to_q.weight"


def _ulp(model: torch.nn.Module, name: str) -> None:
    """Move one element of ``name`` up by one ulp."""
    tensor = dict(model.named_parameters())[name]
    with torch.no_grad():
        flat = tensor.view(-1)
        flat[7] = torch.nextafter(flat[7], torch.tensor(float("inf")))


def _lora(model: torch.nn.Module, seed: int) -> None:
    """A LoRA on the attention projections, drawn from the global RNG seeded with ``seed`` (B non-zero)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(
            LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights=False)
        )


def _inputs() -> tuple[torch.Tensor, ...]:
    x = torch.randn(1, 4, 2, 8, 8, generator=torch.Generator().manual_seed(3))
    return x, torch.tensor([500]), wan_prompt_embeds(1, 6)


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _weight_cases() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    config = ParallelConfig(ulysses=2)

    model = tiny_wan_transformer()
    if rank == 1:
        _ulp(model, WEIGHT)
    before = dict(vars(model))
    out["ulp"] = _outcome(lambda: hfpatch.apply(model, parallel=config))
    out["ulp untouched"] = hfpatch.get_patch(model) is None and dict(vars(model)) == before

    pipe = tiny_wan_pipe()
    if rank == 1:
        _ulp(pipe.vae, next(n for n, _ in pipe.vae.named_parameters()))
    out["pipeline vae ulp"] = _outcome(lambda: hfpatch.apply(pipe, parallel=ParallelConfig(cfg=2)))

    model = tiny_wan_transformer()
    _lora(model, seed=rank)
    out["lora before apply"] = _outcome(lambda: hfpatch.apply(model, parallel=config))

    model = tiny_wan_transformer()
    x, t, text = _inputs()
    with torch.no_grad(), hfpatch.apply(model, parallel=config):
        first = model(x, t, text).sample
        _lora(model, seed=rank)
        out["lora after apply"] = _outcome(lambda: model(x, t, text))
        out["lora after apply again"] = _outcome(lambda: model(x, t, text))  # still refused: not a one-off
        model.delete_adapters("default")
        _lora(model, seed=0)  # the same adapter on every rank now
        out["usable once the adapters agree"] = _outcome(lambda: model(x, t, text))
        model.delete_adapters("default")
        out["first call again without the adapter"] = torch.equal(model(x, t, text).sample, first)

    model = tiny_wan_transformer()
    reference = tiny_wan_transformer()
    _lora(reference, seed=5)
    with torch.no_grad():
        expected = reference(x, t, text).sample
        patch = hfpatch.apply(model, parallel=config)
        model(x, t, text)
        watch_refreshes = _watch(model).refreshes
        _lora(model, seed=5)
        got = model(x, t, text).sample
        out["same lora after apply re-read once"] = _watch(model).refreshes - watch_refreshes
        model(x, t, text)
        out["no re-read without a registration"] = _watch(model).refreshes - watch_refreshes
        patch.remove()
    out["same lora after apply: max abs diff"] = (got - expected).abs().max().item()

    model = tiny_wan_transformer(seed=rank)
    out["check_inputs=False"] = _outcome(
        lambda: hfpatch.apply(model, parallel=config, check_inputs=False).remove()
    )
    return out


def _watch(model: torch.nn.Module) -> Any:
    watch = weight_watch_of(model)
    assert watch is not None, "no weight watch on the model"
    return watch


@pytest.fixture(scope="module")
def results(rank_pool) -> list[dict[str, Any]]:
    return rank_pool(2).run(_weight_cases)


def _same_on_every_rank(results: list[dict[str, Any]], case: str) -> str:
    messages = [r[case] for r in results]
    assert all(m == messages[0] for m in messages), (case, messages)
    return messages[0]


def test_one_ulp_in_one_weight_is_refused_at_apply_on_every_rank(results):
    message = _same_on_every_rank(results, "ulp")
    assert message.startswith("WeightMismatchError: hfpatch: the ranks [0, 1]"), message
    assert "1 of its " in message and f"'{WEIGHT}': other values on rank 1 than on rank 0" in message, message
    assert "Nothing was patched on any rank" in message and "torch.manual_seed" in message, message
    assert all(r["ulp untouched"] for r in results)


def test_a_pipeline_component_is_named_by_its_component(results):
    message = _same_on_every_rank(results, "pipeline vae ulp")
    assert message.startswith("WeightMismatchError") and "'vae." in message, message


def test_a_lora_initialised_per_rank_is_refused_at_apply(results):
    message = _same_on_every_rank(results, "lora before apply")
    assert message.startswith("WeightMismatchError") and "lora_A.default.weight" in message, message


def test_a_lora_added_per_rank_after_apply_is_refused_at_the_next_call(results):
    for case in ("lora after apply", "lora after apply again"):
        message = _same_on_every_rank(results, case)
        assert message.startswith("WeightMismatchError") and "lora_" in message, message
        assert "found at a call of WanTransformer3DModel.forward" in message, message
    for r in results:
        assert r["usable once the adapters agree"] == "no error", r
        assert r["first call again without the adapter"], r


def test_a_lora_added_alike_after_apply_is_read_once_and_exact(results):
    for r in results:
        assert r["same lora after apply re-read once"] == 1, r
        assert r["no re-read without a registration"] == 1, r
        # 2 ranks of Ulysses against one process: attention on head shards, projections on token shards
        assert r["same lora after apply: max abs diff"] < 1e-5, r


def test_check_inputs_false_skips_the_check(results):
    assert [r["check_inputs=False"] for r in results] == ["no error", "no error"]


# ----------------------------------------------------------------------------------------------- one process
def test_bulk_digest_sees_one_ulp_anywhere_and_a_transpose():
    w = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0))  # rows of 4096 words and a tail
    base = bulk_digest(w)
    for index in (0, 4095, 4096, 7499):  # first word, end of the first row, start of the second, the tail
        moved = w.clone()
        flat = moved.view(-1)
        flat[2 * index] = torch.nextafter(flat[2 * index], torch.tensor(9.0))
        assert not torch.equal(bulk_digest(moved), base), index
    assert not torch.equal(bulk_digest(w.t().contiguous()), base)
    assert torch.equal(bulk_digest(w.bfloat16()[:, :4999]), bulk_digest(w.bfloat16()[:, :4999].clone()))
    assert not torch.equal(
        bulk_digest(torch.arange(7, dtype=torch.uint8)),
        bulk_digest(torch.arange(7, dtype=torch.uint8).flip(0)),
    )


def test_mismatch_message_names_missing_and_differing_tensors():
    assert issubclass(WeightMismatchError, ValueError)  # callers catching ValueError keep working
    a = {"w": [1, 2, 3], "b": [1, 4, 5]}
    b = {"w": [1, 2, 9], "b": [1, 4, 5], "lora_B": [1, 1, 1]}
    message = weights_mismatch_message([a, b, a], [0, 1, 2], "M")
    assert "2 of its 3 parameters and buffers differ" in message
    assert "'lora_B': only on rank 1" in message and "'w': other values on rank 1 than on rank 0" in message


def test_weight_digests_hold_no_data_for_meta_tensors():
    model = torch.nn.Linear(2, 2, device="meta")
    digests = weight_digests([("", model)])
    assert digests["weight"][1:] == [0, 0] and digests["weight"][0] != 0
