"""Helpers shared by the pipeline tests of several folders (``tests/`` is on ``sys.path`` through its
``conftest.py``; spawned ranks inherit it)."""

from __future__ import annotations

from typing import Any

import torch

from hfpatch.testing import wan_prompt_embeds


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
