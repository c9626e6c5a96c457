"""The models of :func:`hfpatch.loading.from_pretrained`, before any weight is read: the diffusers and
transformers models a pipeline folder names, each built on ``meta`` from its config as its library's own
``from_pretrained`` builds it, and the dtype that loader gives each of its floating tensors.
:mod:`hfpatch.loading` reads the checkpoint into them.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch


# ----------------------------------------------------------------------------------------------- models
@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def component_dtype(torch_dtype: Any, name: str) -> torch.dtype:
    """The dtype diffusers' pipeline loader gives component ``name`` (float32 when none is given)."""
    if isinstance(torch_dtype, dict):
        return torch_dtype.get(name, torch_dtype.get("default", torch.float32))
    return torch.float32 if torch_dtype is None else torch_dtype


def _library_of(cls: type) -> str | None:
    """``"diffusers"`` for a ``ModelMixin``, ``"transformers"`` for a ``PreTrainedModel``, else ``None``."""
    for base in cls.__mro__:
        key = f"{base.__module__.split('.')[0]}.{base.__name__}"
        if key == "diffusers.ModelMixin":
            return "diffusers"
        if key == "transformers.PreTrainedModel":
            return "transformers"
    return None


def meta_model(cls: type, library: str, folder: str, dtype: torch.dtype) -> torch.nn.Module:
    """``cls`` built from the config in ``folder`` as its library's ``from_pretrained`` builds it, on ``meta``
    (buffers real, computed at construction)."""
    import accelerate

    if library == "diffusers":
        from diffusers.models.modeling_utils import no_init_weights

        config = cls.load_config(folder)
        with _default_dtype(dtype), no_init_weights(), accelerate.init_empty_weights():
            model = cls.from_config(config)
        model.register_to_config(_name_or_path=folder)
    else:
        config = cls.config_class.from_pretrained(folder)
        with _default_dtype(dtype), accelerate.init_empty_weights():
            model = cls(config)
        model.tie_weights()
        # What transformers' loader attaches (the conversions of its key mapping that matched the checkpoint; none
        # here: hfpatch reads each tensor by the model's own name). save_pretrained reads it: set, it writes the
        # keys in its natural order, as after a stock load; absent, in module order (other shard files).
        model._weight_conversions = []
    model.eval()
    return model


def target_dtypes(
    model: torch.nn.Module, cls: type, library: str, dtype: torch.dtype
) -> Callable[[str, Any], Any]:
    """``target(name, meta_tensor)``: the dtype the library's ``from_pretrained`` gives a floating tensor of the
    checkpoint: diffusers casts to ``dtype`` except the modules of ``_keep_in_fp32_modules`` (float32);
    transformers keeps the dtype the model was built in, except its dtype plan's modules (float32 in fp16/bf16)."""
    if library == "diffusers":
        keep = cls._keep_in_fp32_modules or []
        keep = [keep] if isinstance(keep, str) else list(keep)
        return lambda name, _: torch.float32 if any(m in name.split(".") for m in keep) else dtype
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return lambda _, tensor: tensor.dtype
    patterns = list(plan)
    alternation = re.compile("|".join(f"(?P<g{i}>{p.replace('*', '.*')})" for i, p in enumerate(patterns)))

    def target(name: str, tensor: Any) -> torch.dtype:
        found = alternation.search(name)
        return plan[patterns[int(found.lastgroup[1:])]] if found else tensor.dtype

    return target


def model_components(folder: str) -> dict[str, tuple[type, str]]:
    """Component name -> (class, library) of the diffusers and transformers models in ``model_index.json``."""
    import diffusers

    index = diffusers.DiffusionPipeline.load_config(folder)
    found: dict[str, tuple[type, str]] = {}
    for name, value in index.items():
        if (
            name.startswith("_")
            or not isinstance(value, (list, tuple))
            or len(value) != 2
            or value[0] is None
        ):
            continue
        library, class_name = value
        if library not in ("diffusers", "transformers") or not os.path.isdir(os.path.join(folder, name)):
            continue
        cls = getattr(importlib.import_module(library), class_name, None)
        kind = None if cls is None else _library_of(cls)
        if kind is not None:
            found[name] = (cls, kind)
    return found
