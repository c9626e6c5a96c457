"""The denoisers of a diffusers pipeline, shared by the families that act on them (CFG/data parallel, FSDP2).

A pipeline's denoisers are its components whose class is in :data:`PER_SAMPLE_ARGS` (found by type, with the
forward arguments that carry a batch dim) and the diffusers models named in :data:`DENOISER_NAMES`:
:mod:`hfpatch.patches.pipeline` splits their calls, :mod:`hfpatch.patches.fsdp` shards their weights.
:func:`pipeline_denoisers` finds them; :func:`known_class` names the most specific class of an object that a
table (such as :data:`PER_SAMPLE_ARGS`) lists.

>>> from hfpatch.patches.denoisers import pipeline_denoisers
>>> from hfpatch.testing import tiny_wan_pipe
>>> [type(model).__name__ for model in pipeline_denoisers(tiny_wan_pipe())]
['WanTransformer3DModel']
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DENOISER_NAMES", "PER_SAMPLE_ARGS"]

#: Transformer class -> (forward arguments with a batch dim (split), arguments that carry no batch dim
#: (passed unchanged)). Any other argument given a non-``None`` value is refused: hfpatch cannot tell how
#: to split it, and guessing could give a wrong result.
PER_SAMPLE_ARGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "WanTransformer3DModel": (
        ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
        ("return_dict", "attention_kwargs"),
    ),
    "SD3Transformer2DModel": (
        ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
        ("return_dict", "joint_attention_kwargs", "skip_layers"),
    ),
    # txt_ids/img_ids are [seq, 3] positions shared by the batch (a 3-D batched form is deprecated in
    # diffusers, which reads its first row); guidance is expanded to the batch by FluxPipeline.
    "FluxTransformer2DModel": (
        ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"),
        ("return_dict", "joint_attention_kwargs", "txt_ids", "img_ids", "controlnet_blocks_repeat"),
    ),
    # image_rotary_emb is the (cos, sin) table of the image tokens, shared by the batch.
    "HunyuanDiT2DModel": (
        (
            "hidden_states",
            "timestep",
            "encoder_hidden_states",
            "text_embedding_mask",
            "encoder_hidden_states_t5",
            "text_embedding_mask_t5",
            "image_meta_size",
            "style",
        ),
        ("return_dict", "image_rotary_emb"),
    ),
}

#: Pipeline component names of denoisers whose class is not in :data:`PER_SAMPLE_ARGS` (split by
#: :func:`generic_split`). Only diffusers models (``ModelMixin``) under these names are wrapped.
DENOISER_NAMES: tuple[str, ...] = ("transformer", "transformer_2", "unet")


def _class_names(obj: Any) -> list[str]:
    return [cls.__name__ for cls in type(obj).__mro__]


def known_class(obj: Any, table: Any) -> str | None:
    """The most specific class name of ``obj`` that is a key of (or listed in) ``table``."""
    return next((name for name in _class_names(obj) if name in table), None)


def _is_diffusers_model(obj: Any) -> bool:
    return any(
        f"{c.__module__.split('.')[0]}.{c.__name__}" == "diffusers.ModelMixin" for c in type(obj).__mro__
    )


def pipeline_denoisers(pipe: Any) -> list[torch.nn.Module]:
    """The pipeline's denoisers, in component order: components whose class is in :data:`PER_SAMPLE_ARGS`
    (found by type), and diffusers models named in :data:`DENOISER_NAMES`."""
    found: list[torch.nn.Module] = []
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        known = known_class(component, PER_SAMPLE_ARGS) is not None
        if known or (name in DENOISER_NAMES and _is_diffusers_model(component)):
            if all(component is not f for f in found):
                found.append(component)
    return found
