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
        # 7 text + 25 image tokens, not 7 + this rank's 13: the stand-in's inferred text length gives it away.
        "flux forward()": "RuntimeError: sequence-parallel attention got 32 query tokens at FluxTransformer2DModel",
        "flux deepcopy": "TypeError: cannot deepcopy FluxTransformer2DModel while it is patched by hfpatch.apply",
    }
    for rank, results in enumerate(rank_pool(2).run(misuse_cases)):
        for case, start in expected.items():
            assert results[case].startswith(start), (rank, case, results[case])


def _copy_refusals() -> dict[str, list[str] | bool]:
    """deepcopy / pickle / torch.save of a patched transformer, pipeline and VAE; state_dict/save_pretrained."""
    import io
    import pickle
    import tempfile

    from hfpatch.testing import tiny_autoencoder_kl, tiny_wan_pipe, tiny_wan_transformer

    results: dict[str, list[str] | bool] = {}
    targets = {
        "transformer": (tiny_wan_transformer(), ParallelConfig(ulysses=2)),
        "pipeline": (tiny_wan_pipe(), ParallelConfig(cfg=2)),
        "vae": (tiny_autoencoder_kl(), ParallelConfig(vae=2)),
    }
    for name, (target, config) in targets.items():
        module = target.transformer if name == "pipeline" else target
        before = {k: v.clone() for k, v in module.state_dict().items()}
        with hfpatch.apply(target, parallel=config):
            results[name] = [
                _error(copy.deepcopy, target),
                _error(pickle.dumps, target),
                _error(torch.save, target, io.BytesIO()),
            ]
            state = module.state_dict()
            results[f"{name} state_dict"] = state.keys() == before.keys() and all(
                torch.equal(state[k], before[k]) for k in before
            )
            if name != "pipeline":  # the tiny pipe's tokenizer-free components do not all save
                with tempfile.TemporaryDirectory() as directory:
                    module.save_pretrained(directory)
                    loaded = type(module).from_pretrained(directory)
                results[f"{name} save_pretrained"] = all(
                    torch.equal(loaded.state_dict()[k], before[k]) for k in before
                )
    return results


def test_copying_a_patched_object_raises_and_state_dict_saving_works(rank_pool):
    for results in rank_pool(2).run(_copy_refusals):
        for name in ("transformer", "pipeline", "vae"):
            deepcopy, pickled, saved = results[name]
            assert deepcopy.startswith("TypeError: cannot deepcopy"), (name, deepcopy)
            for message in (pickled, saved):
                assert message.startswith("TypeError: cannot pickle (torch.save)"), (name, message)
                assert "state_dict() or save_pretrained()" in message, message
            assert results[f"{name} state_dict"] is True, name
        assert results["transformer save_pretrained"] is True and results["vae save_pretrained"] is True
