"""Changes to a sequence-parallel model after ``hfpatch.apply`` that would give wrong results raise instead.

Each case runs on 2 gloo ranks (ulysses=2); every rank must raise the same error before any collective of
the failing call (the attention processors are checked in the model's first pre-hook).
"""

from __future__ import annotations

import copy

import torch
from test_dit_usp import build

import hfpatch
from hfpatch import ParallelConfig


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except (RuntimeError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def misuse_cases() -> dict[str, str]:
    results = {}
    with torch.no_grad():
        for family in ("sd3", "cogvideox"):  # stock fused processors attend within the local shard only
            model, kwargs, _ = build(family)
            with hfpatch.apply(model, parallel=ParallelConfig(ulysses=2)):
                model.fuse_qkv_projections()
                results[f"{family} fuse_qkv"] = _error(model, **kwargs)
        model, kwargs, _ = build("wan21")
        with hfpatch.apply(model, parallel=ParallelConfig(ulysses=2)):
            model.set_attn_processor(type(model.blocks[0].attn2.processor)())  # the stock Wan processor
            results["wan set_attn_processor"] = _error(model, **kwargs)
        model, kwargs, _ = build("flux")
        with hfpatch.apply(model, parallel=ParallelConfig(ulysses=2)):
            model(**kwargs)  # a normal call first: the shard geometry of a previous call must not be reused
            results["flux forward()"] = _error(model.forward, **kwargs)
            results["flux deepcopy"] = _error(copy.deepcopy, model)
    return results


def test_usp_changes_after_apply_raise_on_every_rank(rank_pool):
    expected = {
        "sd3 fuse_qkv": "RuntimeError: SD3Transformer2DModel.transformer_blocks.0.attn.processor was replaced",
        "cogvideox fuse_qkv": "RuntimeError: CogVideoXTransformer3DModel.transformer_blocks.0.attn1.processor was",
        "wan set_attn_processor": "RuntimeError: WanTransformer3DModel.blocks.0.attn1.processor was",
        "flux forward()": "RuntimeError: sequence-parallel attention got 25 query tokens but this call's shard",
        "flux deepcopy": "TypeError: cannot deepcopy a model patched for sequence parallelism",
    }
    for rank, results in enumerate(rank_pool(2).run(misuse_cases)):
        for case, start in expected.items():
            assert results[case].startswith(start), (rank, case, results[case])
