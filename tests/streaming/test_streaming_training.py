"""Streaming training model (chunks with overlap, gradient mask, exit-step graph) and the checkpoint converter."""

from __future__ import annotations

import pytest
import torch

import hfpatch
from hfpatch.streaming import (
    StreamingConfig,
    StreamingTrainingModel,
    convert_diffusers_to_native,
    convert_native_to_diffusers,
)
from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.tolerance import eps

CONFIG = StreamingConfig(num_frame_per_block=2, local_attn_size=6, sink_size=2)


def _trainer(model, seed: int = 0, **kwargs) -> StreamingTrainingModel:
    kwargs = {"chunk_size": 6, "min_new_frames": 2, "denoising_step_list": (1000, 750, 500), **kwargs}
    trainer = StreamingTrainingModel(model, CONFIG, seed=seed, **kwargs)
    trainer.setup_sequence(wan_prompt_embeds(), latent_shape=(4, 4, 4), max_length=16)
    return trainer


def _count_grad_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(
        lambda m, a, k: calls.append(torch.is_grad_enabled()), with_kwargs=True
    )
    return calls, handle


def test_generate_next_chunk_fixed_size_overlap_and_mask_on_new_frames():
    model = tiny_wan_transformer()
    with hfpatch.apply(model, streaming=CONFIG):
        trainer = _trainer(model)
        gen = torch.Generator().manual_seed(0)
        first, info0 = trainer.generate_next_chunk(requires_grad=False, generator=gen)
        second, info1 = trainer.generate_next_chunk(requires_grad=False, generator=gen)
    assert first.shape == second.shape == (1, 4, 6, 4, 4)
    assert info0.new_frames == 6 and info0.gradient_mask.all() and info0.chunk_start_frame == 0
    new = info1.new_frames
    assert new % 2 == 0 and 2 <= new <= 6 and trainer.current_length == 6 + new
    assert info1.chunk_start_frame == 6 + new - 6
    assert info1.gradient_mask.tolist() == [[False] * (6 - new) + [True] * new]
    # The overlap is the tail of the previous chunk, unchanged (a copy: exact).
    assert torch.equal(second[:, :, : 6 - new], first[:, :, new:])
    assert len(info1.exit_steps) == new // 2 and all(0 <= e < 3 for e in info1.exit_steps)


def test_generator_path_gradients_reach_parameters_only_through_new_frames():
    model = tiny_wan_transformer()
    params = [p for p in model.parameters()]
    with hfpatch.apply(model, streaming=CONFIG):
        trainer = _trainer(model, seed=3, min_new_frames=2)
        gen = torch.Generator().manual_seed(0)
        trainer.generate_next_chunk(requires_grad=False, generator=gen)  # fill the overlap
        calls, handle = _count_grad_forwards(model)
        chunk, info = trainer.generate_next_chunk(requires_grad=True, generator=gen)
        handle.remove()
    mask = info.gradient_mask[0]
    assert not mask.all(), "the test needs overlap frames (seeded choice gave none)"
    # One graph-building forward per generated block: the exit step; the rest ran without a graph.
    assert sum(calls) == info.new_frames // 2 and len(calls) > sum(calls)
    for frame in range(chunk.shape[2]):
        grads = (
            torch.autograd.grad(
                chunk[:, :, frame].square().sum(), params, allow_unused=True, retain_graph=True
            )
            if chunk[:, :, frame].requires_grad
            else [None] * len(params)
        )
        reached = any(g is not None and g.abs().sum() > 0 for g in grads)
        assert reached == bool(mask[frame]), (
            f"frame {frame}: gradient reached={reached}, mask={bool(mask[frame])}"
        )


def test_critic_path_builds_no_graph():
    model = tiny_wan_transformer()
    with hfpatch.apply(model, streaming=CONFIG):
        trainer = _trainer(model)
        calls, handle = _count_grad_forwards(model)
        chunk, _ = trainer.generate_next_chunk(
            requires_grad=False, generator=torch.Generator().manual_seed(0)
        )
        handle.remove()
    assert not chunk.requires_grad and not any(calls)


def test_sequence_done_and_invalid_sizes_raise():
    model = tiny_wan_transformer()
    with hfpatch.apply(model, streaming=CONFIG):
        with pytest.raises(ValueError, match="multiples of num_frame_per_block=2"):
            StreamingTrainingModel(model, CONFIG, chunk_size=5)
        trainer = _trainer(model, min_new_frames=6)
        trainer.setup_sequence(wan_prompt_embeds(), latent_shape=(4, 4, 4), max_length=6)
        with torch.no_grad():
            trainer.generate_next_chunk(requires_grad=False, generator=torch.Generator().manual_seed(0))
        assert trainer.sequence_done
        with pytest.raises(ValueError, match="the sequence is done"):
            trainer.generate_next_chunk(requires_grad=False)


def _rank_cases() -> dict:
    """On every rank: choices drawn with a rank-dependent seed must still agree (broadcast from rank 0).

    The agreement needs torch.distributed initialised, not an hfpatch parallel axis: data-parallel training
    wraps the streaming transformer in DDP/FSDP, so each rank applies streaming alone (``parallel=1``). (Under
    sequence parallelism the ranks stream one sequence together: tests/streaming/test_streaming_parallel.py.)
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    model = tiny_wan_transformer()
    out = {}
    with hfpatch.apply(model, streaming=CONFIG, parallel=1):
        trainer = _trainer(model, seed=100 + rank)
        gen = torch.Generator().manual_seed(rank)  # per-rank noise, as in data-parallel training
        infos = [trainer.generate_next_chunk(requires_grad=False, generator=gen)[1] for _ in range(3)]
        out["choices"] = [(i.new_frames, i.exit_steps) for i in infos]
        out["draws"] = trainer.shared_randint(0, 1000, 5)
    return out


def test_random_choices_agree_across_ranks(rank_pool):
    results = rank_pool(2).run(_rank_cases)
    assert results[0]["choices"] == results[1]["choices"]
    assert results[0]["draws"] == results[1]["draws"]
    assert len({n for n, _ in results[0]["choices"][1:]} | {tuple(e) for _, e in results[0]["choices"]}) > 1


# --------------------------------------------------------------------------------------- converter
def _native_checkpoint(model, lora_modules: dict[str, int], alpha: float, seed: int = 0) -> dict:
    """A Self-Forcing/LongLive-style checkpoint of ``model``: native keys under ``generator_ema``/``model.``,
    with peft LoRA (base_layer + lora_A/B) on ``lora_modules`` whose merge gives back the model's weights."""
    gen = torch.Generator().manual_seed(seed)
    native = convert_diffusers_to_native(model.state_dict())
    out = {}
    for key, value in native.items():
        module = key.rsplit(".", 1)[0]
        if module in lora_modules:
            rank = lora_modules[module]
            a = torch.randn(rank, value.shape[1], generator=gen) if key.endswith("weight") else None
            if a is not None:
                b = torch.randn(value.shape[0], rank, generator=gen)
                out[f"model.{module}.base_layer.weight"] = value - (alpha / rank) * (b @ a)
                out[f"model.{module}.lora_A.default.weight"] = a
                out[f"model.{module}.lora_B.default.weight"] = b
            else:
                out[f"model.{module}.base_layer.bias"] = value
        else:
            out[f"model.{key}"] = value
    return {"generator_ema": out, "critic": {"ignored": torch.zeros(1)}}


def test_converter_native_to_diffusers_loads_strict_and_round_trips():
    model = tiny_wan_transformer()
    state = model.state_dict()
    native = convert_diffusers_to_native(state)
    assert "blocks.0.self_attn.q.weight" in native and "blocks.1.norm3.weight" in native
    assert "head.modulation" in native and "time_projection.1.weight" in native
    back = convert_native_to_diffusers(native)
    assert back.keys() == state.keys() and all(back[k] is v for k, v in state.items())
    assert convert_diffusers_to_native(back).keys() == native.keys()
    fresh = tiny_wan_transformer(seed=1)
    fresh.load_state_dict(
        convert_native_to_diffusers({"generator": {"model." + k: v for k, v in native.items()}}), strict=True
    )
    # Renaming only: the values are copied, exact.
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_converter_merges_peft_lora_into_base_weights():
    model = tiny_wan_transformer()
    lora_modules = {"blocks.0.self_attn.q": 2, "blocks.1.ffn.0": 3}
    checkpoint = _native_checkpoint(model, lora_modules, alpha=4.0)
    lora = {  # diffusers weight name -> the LoRA term scale * B @ A the checkpoint subtracted from it
        name: (4.0 / rank) * (checkpoint["generator_ema"][f"model.{module}.lora_B.default.weight"]
                              @ checkpoint["generator_ema"][f"model.{module}.lora_A.default.weight"])
        for module, rank in lora_modules.items()
        for name in convert_native_to_diffusers({f"{module}.weight": torch.zeros(1)})
    }  # fmt: skip
    assert len(lora) == 2
    fresh = tiny_wan_transformer(seed=1)
    fresh.load_state_dict(convert_native_to_diffusers(checkpoint, lora_alpha=4.0), strict=True)
    for (name, a), b in zip(fresh.state_dict().items(), model.state_dict().values()):
        if name not in lora:  # copied: exact
            assert torch.equal(a, b), name
            continue
        # The checkpoint holds fl(W - T) and the merge computes fl(fl(W - T) + T) with the same fp32 product
        # T = scale * B @ A (same kernel, same shapes): two roundings, each at most eps / 2 of
        # |W| + |T|, elementwise.
        tol = eps() * (b.abs() + lora[name].abs())
        assert ((a - b).abs() <= tol).all(), f"{name}: {((a - b).abs() / tol).max():.2f} x the rounding bound"
    # A wrong alpha merges half the LoRA term: off by |T| / 2, far beyond those two roundings.
    wrong = convert_native_to_diffusers(checkpoint, lora_alpha=2.0)["blocks.0.attn1.to_q.weight"]
    name, reference = "blocks.0.attn1.to_q.weight", model.blocks[0].attn1.to_q.weight
    assert ((wrong - reference).abs() > eps() * (reference.abs() + lora[name].abs())).any()


def test_converter_unknown_or_incomplete_keys_raise():
    native = convert_diffusers_to_native(tiny_wan_transformer().state_dict())
    with pytest.raises(ValueError, match="have no diffusers name .*img_emb"):
        convert_native_to_diffusers({**native, "img_emb.proj.0.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="needs lora_A, lora_B and a base weight"):
        convert_native_to_diffusers(
            {**native, "blocks.0.self_attn.q.lora_A.default.weight": torch.zeros(1, 1)}
        )
