"""Helpers shared by the pipeline and training tests of several folders (``tests/`` is on ``sys.path`` through its
``conftest.py``; spawned ranks inherit it)."""

from __future__ import annotations

from typing import Any

import torch

import hfpatch
from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, to_fp64

#: ``hfpatch generate`` of the tiny Wan folder (``tiny_wan_pipe(text_encoder=True)``): CFG, 5 frames of 32 x 32,
#: 2 steps, the tiny tokenizers' length.
WAN_GENERATE_ARGS = [
    "--prompt", "a cat", "--negative-prompt", "blurry", "--height", "32", "--width", "32", "--frames", "5",
    "--steps", "2", "--pipeline-kwargs", '{"max_sequence_length": 8}',
]  # fmt: skip


def wan_pipe_call(pipe: Any, **overrides: Any) -> torch.Tensor:
    """The tiny Wan pipeline with CFG (5 frames of 32 x 32, 2 steps, seed 0); ``overrides`` replace arguments."""
    arguments = dict(
        prompt_embeds=wan_prompt_embeds(),
        negative_prompt_embeds=wan_prompt_embeds(seed=2),
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=5.0,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    )
    return pipe(**{**arguments, **overrides}).frames


Snapshot = list[tuple[Any, dict[str, Any]]]


def snapshot(pipe: Any) -> Snapshot:
    """``vars()`` of the pipeline, its components and every submodule (attention processors included)."""
    objs: list[Any] = [pipe]
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            objs += list(component.modules())
        elif component is not None:
            objs.append(component)
    return [(obj, dict(vars(obj))) for obj in objs]


def restored(before: Snapshot, run_state: dict[str, frozenset[str]]) -> bool:
    """Same attribute names everywhere; same objects except the ``run_state[class name]`` attributes, which
    every pipeline call replaces by new objects, patched or not (compared by presence only)."""
    return all(
        vars(obj).keys() == attrs.keys()
        and all(vars(obj)[k] is v for k, v in attrs.items() if k not in run_state.get(type(obj).__name__, ()))
        for obj, attrs in before
    )


def wan_sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training sample ``i`` for the tiny Wan transformer: latents ``[1, 4, 1, 10, 10]`` and prompt embeddings."""
    latents = torch.randn(1, 4, 1, 10, 10, generator=torch.Generator().manual_seed(100 + i))
    return latents, wan_prompt_embeds(1, 6, seed=200 + i)


def wan_sample_loss(transformer: Any, text: Any, samples: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Mean over ``samples`` of a fixed linear functional of the transformer output (a per-sample loss); ``text``
    maps the prompt embeddings first (a trainable module upstream)."""
    losses = []
    for i in samples:
        latents, prompt = (t.to(dtype) for t in wan_sample(i))
        out = transformer(latents, torch.tensor([500]), text(prompt)).sample
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + i)).to(dtype)
        losses.append((out * weight).sum())
    return torch.stack(losses).mean()


def _lora_model() -> torch.nn.Module:
    from peft import LoraConfig

    model = tiny_wan_transformer()
    with torch.random.fork_rng(devices=[]):  # the same adapter on every rank and model
        torch.manual_seed(5)
        model.add_adapter(
            LoraConfig(
                r=2,
                lora_alpha=4,
                target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                init_lora_weights=False,
            )
        )
    return model.train()


def _lora_grads(model: torch.nn.Module, args: tuple, weight: torch.Tensor, reduce: bool = False) -> dict:
    model.zero_grad(set_to_none=True)
    (model(*args).sample * weight).sum().backward()
    if reduce:  # a plain loop's one line after backward(): the mean over the group that split the work
        hfpatch.all_reduce_gradients(model)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def lora_step(parallel: int) -> dict:
    """A LoRA training step of the README recipe's shape (a tiny Wan transformer with a LoRA adapter, patched with
    ``parallel``, ``backward()``, then the plain loop's ``all_reduce_gradients``) on this launch's ranks: every
    LoRA gradient against one process's, as its error over the reassociation tolerance of its fp32-vs-fp64
    noise (the worst), with the plan."""
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(1, 4, 2, 8, 8, generator=g), torch.tensor([500]), wan_prompt_embeds(1, 6))
    weight = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(7))
    reference = _lora_grads(_lora_model(), args, weight)
    reference64 = _lora_grads(to_fp64(_lora_model()), to_fp64(args), weight.double())
    model = _lora_model()
    patch = hfpatch.apply(model, parallel=parallel)
    grads = _lora_grads(model, args, weight, reduce=True)
    patch.remove()
    worst = max(
        rel_error(grads[n], reference[n]) / reassociation_tol(rounding_noise(reference[n], reference64[n]))
        for n in reference
    )
    return {"plan": repr(patch.plan), "tensors": len(reference), "worst_error_over_tolerance": worst}
