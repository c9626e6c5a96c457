"""Tiny quantized copies of the tiny models: each kind diffusers loads that runs on a CPU.

:func:`quantized` returns a quantized copy of a model (the model itself is left as it is), by kind:

* ``"torchao-int8"``: torchao's int8 weight-only (``quantize_(model, Int8WeightOnlyConfig())``: every
  ``nn.Linear`` weight an ``Int8Tensor``, one scale per row);
* ``"gguf-q8_0"``, ``"gguf-q4_k"``: the model written to a ``.gguf`` file with the ``gguf`` package
  (:func:`write_gguf`: Q8_0 where a row is whole blocks of 32, Q4_K where it is whole super-blocks of 256, F32
  elsewhere) and loaded back with diffusers' ``from_single_file`` and ``GGUFQuantizationConfig`` (the weights
  ``GGUFParameter`` s of ``GGUFLinear`` s, dequantized at each call);
* ``"quanto-qint8"``, ``"quanto-qint4"``: optimum-quanto's ``quantize(model, weights=...)`` then ``freeze``;
* ``"bnb-nf4"``, ``"bnb-nf4-nested"``: bitsandbytes' ``Linear4bit`` (nf4, blocks of 32 so that the tiny models'
  rows are whole blocks; block statistics plain, as diffusers' ``BitsAndBytesConfig`` leaves them by default, or
  nested: double quant) for every ``nn.Linear`` of the transformer blocks, built by hand on the CPU (diffusers'
  ``BitsAndBytesConfig`` quantizes on a GPU only). Its AVX512-BF16 CPU kernel is turned off
  (``support_avx512bf16_for_cpu = False``): it repacks the weights at the first call and computes in bf16, on some
  CPUs only; the fp32 path computes the same on every CPU.

:func:`available_kinds` lists the kinds whose packages are installed (the ``[quant]`` extra installs them all).

>>> import torch
>>> from hfpatch.testing import tiny_wan_transformer
>>> from hfpatch.testing.quantized import available_kinds, quantized
>>> "quanto-qint8" in available_kinds() or not available_kinds()
True
"""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile
from typing import Any

import torch

__all__ = ["KINDS", "available_kinds", "quantize_q4_k", "quantized", "tiny_quantizable", "write_gguf"]

#: kind -> the module it needs.
KINDS: dict[str, str] = {
    "torchao-int8": "torchao",
    "gguf-q8_0": "gguf",
    "gguf-q4_k": "gguf",
    "quanto-qint8": "optimum.quanto",
    "quanto-qint4": "optimum.quanto",
    "bnb-nf4": "bitsandbytes",
    "bnb-nf4-nested": "bitsandbytes",
}


def _installed(module: str) -> bool:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return False
    # a package's leftover build folder is a namespace package: no origin, not an installed package
    return spec is not None and spec.origin is not None


def available_kinds() -> list[str]:
    """The kinds of :data:`KINDS` whose package is installed here."""
    return [kind for kind, module in KINDS.items() if _installed(module)]


# ----------------------------------------------------------------------------------------------- GGUF
def quantize_q4_k(rows: Any) -> Any:
    """GGUF Q4_K blocks of ``rows`` (a float numpy array ``[n, k]``, ``k`` a multiple of 256) as ``uint8``
    ``[n, k / 256 * 144]``: per super-block of 256 values, fp16 ``d`` and ``dmin``, 8 six-bit scales and mins (one
    per 32 values) and 4-bit values, ``x ~ d * scale * q - dmin * min`` (the ``gguf`` package reads Q4_K but
    does not write it)."""
    import numpy as np

    x = np.asarray(rows, dtype=np.float32)
    n, k = x.shape
    blocks = x.reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks of 32
    low = np.maximum(-blocks.min(axis=2), 0.0)  # each sub-block's offset (>= 0)
    scale = (blocks.max(axis=2) + low) / 15.0
    d = (scale.max(axis=1) / 63.0).astype(np.float16)
    dmin = (low.max(axis=1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    step = (d32 * sc)[:, :, None]
    shift = (dmin32 * mn)[:, :, None]
    q = np.clip(np.round(np.divide(blocks + shift, step, out=np.zeros_like(blocks), where=step > 0)), 0, 15)
    q = q.astype(np.uint8)
    packed = np.empty((blocks.shape[0], 12), dtype=np.uint8)  # the 6-bit scales and mins, as Q4_K packs them
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    # byte j of group g: sub-block 2g in the low nibble, 2g + 1 in the high one
    pairs = q.reshape(-1, 4, 2, 32)
    values = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    head = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)]
    out = np.concatenate([*head, packed, values], 1)
    return out.reshape(n, (k // 256) * 144)


def write_gguf(model: torch.nn.Module, path: str, qtype: str = "Q8_0") -> None:
    """Write ``model``'s state dict (diffusers' names, so ``from_single_file`` loads it without conversion) to the
    ``.gguf`` file ``path``: 2D weights in ``qtype`` (``"Q8_0"``, or ``"Q4_K"`` with Q8_0 where a row is not whole
    super-blocks) where a row is whole blocks, every other tensor F32."""
    import gguf
    import numpy as np

    types = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(path, "hfpatch-tiny")
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().cpu().numpy()
        wide = array.ndim == 2 and name.endswith("weight")
        if wide and qtype == "Q4_K" and array.shape[1] % 256 == 0:
            writer.add_tensor(name, quantize_q4_k(array), raw_dtype=types.Q4_K)
        elif wide and array.shape[1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, types.Q8_0), raw_dtype=types.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf(model: torch.nn.Module, qtype: str) -> torch.nn.Module:
    from diffusers import GGUFQuantizationConfig

    folder = tempfile.mkdtemp(prefix="hfpatch-gguf-")
    try:
        model.save_config(folder)
        path = os.path.join(folder, "model.gguf")
        write_gguf(model, path, qtype)
        loaded = type(model).from_single_file(
            path,
            config=folder,
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
            torch_dtype=torch.float32,
        )
        return loaded.eval()
    finally:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)


# ----------------------------------------------------------------------------------------------- the others
def _bnb_nf4(model: torch.nn.Module, nested: bool = False) -> torch.nn.Module:
    from bitsandbytes.nn import Linear4bit, Params4bit

    blocks = ("blocks", "transformer_blocks", "single_transformer_blocks")
    for name, module in list(model.named_modules()):
        if not name.startswith(blocks):
            continue
        for child_name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            layer = Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                quant_type="nf4",
                compute_dtype=torch.float32,
            )
            layer.weight = Params4bit(
                child.weight.data.clone(),
                requires_grad=False,
                quant_type="nf4",
                blocksize=32,
                compress_statistics=nested,
            )
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
            layer = layer.to("cpu")  # quantizes
            layer.support_avx512bf16_for_cpu = False
            setattr(module, child_name, layer)
    return model.eval()


def tiny_quantizable(family: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(tiny stock float model, forward kwargs)`` whose linears every kind quantizes whole, for ``family``
    ``"wan"`` (``ffn_dim=256``: the FFN's second projection is whole Q4_K super-blocks; batch 2) or ``"flux"``
    (``head_dim=16``: its FFNs' 256 too; batch 1). 25 image tokens, so that worlds 2, 3 and 4 leave padding.

    >>> from hfpatch.testing.quantized import tiny_quantizable
    >>> model, kwargs = tiny_quantizable("wan")
    >>> tuple(model(**kwargs).sample.shape)
    (2, 4, 1, 10, 10)
    """
    from .models import flux_inputs, tiny_flux_transformer, tiny_wan_transformer

    def randn(*shape: int, seed: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    if family == "wan":  # 1 x 5 x 5 tokens
        kwargs = dict(
            hidden_states=randn(2, 4, 1, 10, 10, seed=1),
            timestep=torch.tensor([500, 20]),
            encoder_hidden_states=randn(2, 6, 16, seed=3),
        )
        return tiny_wan_transformer(ffn_dim=256), kwargs
    if family != "flux":
        raise ValueError(f"unknown family {family!r}; known: wan, flux")
    return tiny_flux_transformer(head_dim=16, axes_dims_rope=(4, 4, 8)), flux_inputs()


def quantized(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """A quantized copy of ``model`` (fp32, on the CPU) of ``kind`` (a key of :data:`KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantization kind {kind!r}; known: {', '.join(KINDS)}")
    if kind.startswith("gguf-"):
        return _gguf(model, kind.removeprefix("gguf-").upper())
    copied = copy.deepcopy(model)
    if kind == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(copied, Int8WeightOnlyConfig())
        return copied.eval()
    if kind.startswith("quanto-"):
        from optimum.quanto import freeze, qint4, qint8, quantize

        quantize(copied, weights=qint8 if kind == "quanto-qint8" else qint4)
        freeze(copied)
        return copied.eval()
    return _bnb_nf4(copied, nested=kind == "bnb-nf4-nested")
