"""End to end: tiny stock pipelines of the plan-driven DiT classes under ``hfpatch.apply(pipe, parallel=...)``.

Every rank builds the same tiny pipeline (``hfpatch.testing``: random weights, no text encoder, prompt
embeddings given), runs it unpatched in fp32 (the reference) and in fp64 (its rounding scale), applies with the
default registry (USP in the transformer, CFG/data parallel in the pipeline) and runs it again. Every rank's
output must equal the reference within ``reassociation_tol`` of that fp32-vs-fp64 noise (the sequence split
reorders sums: Ring's merge, shorter GEMMs), and the ranks must return bit-identical outputs (they gather the
same shards and run the same scheduler steps).

* ``QwenImagePipeline`` (true CFG, two calls per step; text joins the attention replicated, a padded prompt is
  masked): ``parallel=N`` plans Ulysses N (the planner does not plan CFG for true CFG); ``ParallelConfig(cfg=2)``
  at world 2 and ``ParallelConfig(cfg=2, ulysses=2)`` at world 4 put cond and uncond on different ranks after
  the observed first step (``cfg=2`` alone is bit-exact: every transformer call runs as in the unpatched
  pipeline); decoded images compared (``output_type="pt"``).
* ``LTXPipeline`` (batched CFG, masked text for the cross-attention): ``parallel=N`` plans CFG 2 x Ulysses N/2
  (each cfg rank computes one half of the ``[uncond, cond]`` batch); ``ParallelConfig(cfg=2, ring=2)`` at world
  4 for Ring inside CFG. Latents compared (the tiny random VAE saturates most pixels, which would hide
  differences).
* ``PixArtAlphaPipeline`` (batched CFG found from its ``__call__`` source, no table entry; SDPA-routed
  self-attention, cross-attention to a key-masked text): ``parallel=N`` plans CFG 2 x Ulysses N/2,
  ``ParallelConfig(cfg=2, ring=2)`` at world 4. Latents compared.
* ``HunyuanDiTPipeline`` (batched CFG from its source; SDPA-routed self-attention with 2D rotary, CLIP and T5
  cross-attention to padded text, a long skip): ``parallel=N`` plans CFG 2 x Ulysses N/2. Latents compared.
* ``HunyuanVideoPipeline`` (true CFG with a negative prompt, two calls per step; text joined behind the video
  tokens, padded prompts masked): as QwenImage, ``parallel=N`` (Ulysses N) and ``cfg=2`` x Ulysses N/2. Latents
  compared.

25 image/video tokens (5 x 5): no world size of 2-4 divides them, so every split pads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.attention.layout import shard_len
from hfpatch.testing import (
    tiny_hunyuandit_pipe,
    tiny_hunyuanvideo_pipe,
    tiny_ltx_pipe,
    tiny_pixart_pipe,
    tiny_qwenimage_pipe,
)
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64


def _qwen_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "prompt_embeds": torch.randn(1, 6, 16, generator=gen),
        "prompt_embeds_mask": torch.tensor([[1, 1, 1, 1, 0, 0]]),  # padded prompt: masked text keys
        "negative_prompt_embeds": torch.randn(1, 4, 16, generator=gen),
        "negative_prompt_embeds_mask": torch.ones(1, 4, dtype=torch.long),
        "latents": torch.randn(1, 25, 16, generator=gen),  # 20 x 20 pixels: 5 x 5 packed tokens
    }
    return inputs


def _qwen(pipe: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if pipe.transformer.dtype == torch.float64:
        inputs = to_fp64(inputs)
    return pipe(
        **inputs, true_cfg_scale=4.0, height=20, width=20, num_inference_steps=3, output_type="pt"
    ).images


def _ltx_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return {
        "prompt_embeds": torch.randn(1, 6, 16, generator=gen),
        "prompt_attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]]),
        "negative_prompt_embeds": torch.randn(1, 6, 16, generator=gen),
        "negative_prompt_attention_mask": torch.tensor([[1, 1, 0, 0, 0, 0]]),
        "latents": torch.randn(1, 25, 8, generator=gen),  # 1 frame of 160 x 160: 5 x 5 latent tokens
    }


def _ltx(pipe: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if pipe.transformer.dtype == torch.float64:
        inputs = to_fp64(inputs)
    return pipe(
        **inputs, guidance_scale=3.0, height=160, width=160, num_frames=1, num_inference_steps=3,
        output_type="latent",
    ).frames  # fmt: skip


def _hunyuan_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "prompt_embeds": torch.randn(1, 6, 16, generator=gen),
        "prompt_attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]]),  # padded prompt: masked text keys
        "pooled_prompt_embeds": torch.randn(1, 16, generator=gen),
        "negative_prompt_embeds": torch.randn(1, 6, 16, generator=gen),
        "negative_prompt_attention_mask": torch.tensor([[1, 1, 1, 0, 0, 0]]),
        "negative_pooled_prompt_embeds": torch.randn(1, 16, generator=gen),
        "latents": torch.randn(1, 4, 1, 10, 10, generator=gen),  # 1 frame of 80 x 80: 5 x 5 tokens
    }


def _hunyuan(pipe: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if pipe.transformer.dtype == torch.float64:
        inputs = to_fp64(inputs)
    return pipe(
        **inputs, true_cfg_scale=4.0, height=80, width=80, num_frames=1, num_inference_steps=3,
        output_type="latent",
    ).frames  # fmt: skip


def _pixart_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return {
        "prompt_embeds": torch.randn(1, 6, 16, generator=gen),
        "prompt_attention_mask": torch.tensor(
            [[1, 1, 1, 1, 0, 0]]
        ),  # padded prompt: cross-attention key mask
        "negative_prompt_embeds": torch.randn(1, 6, 16, generator=gen),
        "negative_prompt_attention_mask": torch.tensor([[1, 1, 0, 0, 0, 0]]),
        "latents": torch.randn(1, 4, 10, 10, generator=gen),  # 40 x 40 pixels: 5 x 5 tokens of 2 x 2 patches
    }


def _pixart(pipe: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if pipe.transformer.dtype == torch.float64:
        inputs = to_fp64(inputs)
    return pipe(
        **inputs, negative_prompt=None, guidance_scale=4.5, height=40, width=40, num_inference_steps=3,
        use_resolution_binning=False, output_type="latent",
    ).images  # fmt: skip


def _hunyuandit_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "prompt_embeds": torch.randn(1, 4, 16, generator=gen),  # CLIP-like, padded
        "prompt_attention_mask": torch.tensor([[1, 1, 1, 0]]),
        "negative_prompt_embeds": torch.randn(1, 4, 16, generator=gen),
        "negative_prompt_attention_mask": torch.tensor([[1, 1, 0, 0]]),
        "prompt_embeds_2": torch.randn(1, 6, 16, generator=gen),  # T5-like, padded
        "prompt_attention_mask_2": torch.tensor([[1, 1, 1, 1, 0, 0]]),
        "negative_prompt_embeds_2": torch.randn(1, 6, 16, generator=gen),
        "negative_prompt_attention_mask_2": torch.tensor([[1, 1, 1, 0, 0, 0]]),
        "latents": torch.randn(1, 4, 10, 10, generator=gen),  # 80 x 80 pixels: 5 x 5 tokens of 2 x 2 patches
    }


def _hunyuandit(pipe: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if pipe.transformer.dtype == torch.float64:
        inputs = to_fp64(inputs)
    return pipe(
        **inputs, guidance_scale=5.0, height=80, width=80, num_inference_steps=3, use_resolution_binning=False,
        output_type="latent",
    ).images  # fmt: skip


#: name -> (pipeline builder, inputs, run)
PIPES = {
    "qwenimage": (tiny_qwenimage_pipe, _qwen_inputs, _qwen),
    "ltx": (tiny_ltx_pipe, _ltx_inputs, _ltx),
    "hunyuanvideo": (tiny_hunyuanvideo_pipe, _hunyuan_inputs, _hunyuan),
    "pixart": (tiny_pixart_pipe, _pixart_inputs, _pixart),
    "hunyuandit": (tiny_hunyuandit_pipe, _hunyuandit_inputs, _hunyuandit),
}
#: Pipelines with two transformer calls per step (true CFG): cfg=2 puts them on different ranks, bit-exact.
TWO_CALL = ("qwenimage", "hunyuanvideo")
#: Pipelines that batch [uncond, cond] in one call: cfg=2 splits the batch (PixArt: no table entry, its source).
BATCHED = ("ltx", "pixart", "hunyuandit")
#: Routed attention modules per tiny transformer (HunyuanDiT: 4 blocks, for its long skip).
ROUTED = {"hunyuandit": 4}


def _configs(world: int) -> dict[str, tuple[str, Any, ParallelConfig]]:
    """case -> (pipeline, ``parallel=``, the plan expected) at ``world``."""
    half = world // 2
    cases = {
        f"qwenimage parallel={world}": ("qwenimage", world, ParallelConfig(ulysses=world, vae=world)),
        f"qwenimage cfg=2 ulysses={half}": (
            "qwenimage",
            ParallelConfig(cfg=2, ulysses=half),
            ParallelConfig(cfg=2, ulysses=half, vae=world),
        ),
        f"ltx parallel={world}": ("ltx", world, ParallelConfig(cfg=2, ulysses=half, vae=world)),
        f"pixart parallel={world}": ("pixart", world, ParallelConfig(cfg=2, ulysses=half, vae=world)),
        f"hunyuandit parallel={world}": ("hunyuandit", world, ParallelConfig(cfg=2, ulysses=half, vae=world)),
        f"hunyuanvideo parallel={world}": ("hunyuanvideo", world, ParallelConfig(ulysses=world, vae=world)),
        f"hunyuanvideo cfg=2 ulysses={half}": (
            "hunyuanvideo",
            ParallelConfig(cfg=2, ulysses=half),
            ParallelConfig(cfg=2, ulysses=half, vae=world),
        ),
    }
    if world == 4:
        cases["ltx cfg=2 ring=2"] = (
            "ltx",
            ParallelConfig(cfg=2, ring=2),
            ParallelConfig(cfg=2, ring=2, vae=4),
        )
        cases["pixart cfg=2 ring=2"] = (
            "pixart",
            ParallelConfig(cfg=2, ring=2),
            ParallelConfig(cfg=2, ring=2, vae=4),
        )
    return cases


# ----------------------------------------------------------------------------------------------- rank fn
def pipeline_cases() -> dict[str, dict[str, Any]]:
    """Per case: the plan, error vs the unpatched pipeline, its fp32 noise, the output, CFG phase, USP calls."""
    from hfpatch.patches.dit import USPDispatchProcessor

    world = dist.get_world_size()
    built: dict[str, tuple[Any, dict[str, torch.Tensor], torch.Tensor, float]] = {}
    results = {}
    for case, (name, parallel, _) in _configs(world).items():
        make, make_inputs, run = PIPES[name]
        if name not in built:
            pipe, inputs = make(), make_inputs()
            reference = run(pipe, inputs)
            built[name] = (pipe, inputs, reference, rounding_noise(reference, run(to_fp64(pipe), inputs)))
        pipe, inputs, reference, noise = built[name]
        seen: set[tuple[int, int]] = set()  # (batch, tokens) into proj_out: what this rank computed per call
        handle = pipe.transformer.proj_out.register_forward_pre_hook(
            lambda _module, args, seen=seen: seen.add(tuple(args[0].shape[:2]))
        )
        with hfpatch.apply(pipe, parallel=parallel) as patch:
            stand_ins = [
                m.processor
                for m in pipe.transformer.modules()
                if isinstance(getattr(m, "processor", None), USPDispatchProcessor)
            ]
            out = run(pipe, inputs)
            state = getattr(pipe.transformer.forward, "state", None)
        handle.remove()
        results[case] = {
            "plan": patch.plan,
            "error": rel_error(out, reference),
            "noise": noise,
            "out": out,
            "same_shape": out.shape == reference.shape and out.dtype == reference.dtype,
            "phase": getattr(state, "phase", None),
            "usp_swapped": len(stand_ins),
            "seen": seen,
        }
    return results


# ----------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 4])
def test_dit_pipelines_every_rank_equals_unpatched(rank_pool, world):
    results = rank_pool(world).run(pipeline_cases)
    cases = _configs(world)
    assert set(results[0]) == set(cases), sorted(results[0])
    for case, (name, _, plan) in cases.items():
        for rank, result in enumerate(r[case] for r in results):
            assert result["plan"] == plan, (rank, case, result["plan"])
            assert result["same_shape"], (rank, case)
            assert result["error"] <= reassociation_tol(result["noise"]), (
                rank,
                case,
                result["error"],
                result["noise"],
            )
            # Two-call CFG alone: every transformer call runs as in the unpatched pipeline.
            if name in TWO_CALL and plan.ulysses * plan.ring == 1:
                assert result["error"] == 0.0, (rank, case, result["error"])
            # USP really ran where the plan has a sequence degree (every routed attention module swapped).
            routed = ROUTED.get(name, 2)
            assert result["usp_swapped"] == (routed if plan.ulysses * plan.ring > 1 else 0), (rank, case)
            # Each rank computed its shard of the tokens, and LTX's batched [uncond, cond] was split by cfg.
            batch = 2 // plan.cfg if name in BATCHED else 1
            assert result["seen"] == {(batch, shard_len(25, plan.ulysses * plan.ring))}, (rank, case, result)
            if name in TWO_CALL and plan.cfg == 2:
                assert result["phase"] == "parallel", (rank, case)  # cond/uncond on different cfg ranks
        outputs = [r[case]["out"] for r in results]
        assert all(torch.equal(outputs[0], o) for o in outputs[1:]), (
            f"{case}: ranks returned different outputs"
        )
