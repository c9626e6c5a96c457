"""The GPU lane, issue 50's GPU criterion: transformers quantized by diffusers' own configs on CUDA (torchao fp8
weight-only through ``TorchAoConfig``, bitsandbytes nf4 through ``BitsAndBytesConfig``), patched with Ulysses 2 and
Ring 2 on two gloo ranks sharing the one GPU, against the same quantized model unpatched in the same process.
Skipped without a CUDA device (both configs quantize on a GPU only; the CPU suite covers the kinds a CPU runs,
``tests/patches/test_quantized.py``).

The parent writes the tiny stock Wan and Flux (fp32, random weights) with
``save_pretrained`` once, and each rank loads them with ``from_pretrained(..., quantization_config=...,
device_map={"": "cuda:0"})``, as a user's script does. Compute stays fp32 (TF32 off; torchao's fp8 weight-only
dequantizes to the activations' dtype, nf4 computes in ``bnb_4bit_compute_dtype=float32``), so the model is smooth in
its inputs and the tolerance is ``reassociation_tol`` of its measured response to one-ulp input changes
(``perturbation_noise``), as in the CPU test. The test first asserts that the weights ARE quantized (a config
that silently left them float would make the comparison vacuous).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.testing.quantized import tiny_quantizable
from hfpatch.testing.tolerance import perturbation_noise, reassociation_tol, rel_error

DEVICE = os.environ.get("HFPATCH_GPU_LANE_DEVICE", "cuda:0")
pytestmark = pytest.mark.skipif(
    torch.device(DEVICE).type != "cuda" or not torch.cuda.is_available(),
    reason="diffusers' TorchAoConfig fp8 and BitsAndBytesConfig nf4 quantize on a CUDA device only",
)
KINDS = [
    k
    for k, module in (("torchao-fp8", "torchao"), ("bnb-nf4", "bitsandbytes"))
    if importlib.util.find_spec(module)
]


def _config(kind: str) -> Any:
    from diffusers import BitsAndBytesConfig, TorchAoConfig

    if kind == "torchao-fp8":
        from torchao.quantization import Float8WeightOnlyConfig

        return TorchAoConfig(Float8WeightOnlyConfig())
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )


def _quantized_linears(model: torch.nn.Module) -> int:
    """How many ``nn.Linear`` weights are held quantized (a tensor subclass, or bitsandbytes' ``Params4bit``)."""
    return sum(
        type(m.weight) is not torch.nn.Parameter or m.weight.dtype not in (torch.float32, torch.bfloat16)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )


def _cases(device_name: str, folders: dict[str, str], kinds: list[str]) -> dict[tuple, Any]:
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    classes = {"wan": WanTransformer3DModel, "flux": FluxTransformer2DModel}
    results: dict[tuple, Any] = {}
    for family, folder in folders.items():
        kwargs = {k: v.to(device) for k, v in tiny_quantizable(family)[1].items()}
        for kind in kinds:
            model = classes[family].from_pretrained(
                folder,
                quantization_config=_config(kind),
                torch_dtype=torch.float32,
                device_map={"": device_name},
            )
            results[(family, kind, "quantized linears")] = _quantized_linears(model)
            with torch.no_grad():
                ref = model(**kwargs).sample
                noise = perturbation_noise(lambda inputs, m=model: m(**inputs).sample, kwargs, trials=2)
                for ulysses, ring in ((2, 1), (1, 2)):
                    with hfpatch.apply(model, parallel=ParallelConfig(ulysses=ulysses, ring=ring)):
                        out = model(**kwargs).sample
                    results[(family, kind, ulysses, ring)] = (rel_error(out, ref), reassociation_tol(noise))
    return results


@pytest.mark.skipif(not KINDS, reason="neither torchao nor bitsandbytes is installed")
def test_diffusers_quantized_fp8_and_nf4_at_two_ranks(rank_pool, tmp_path):
    folders = {}
    for family in ("wan", "flux"):
        folders[family] = str(tmp_path / family)
        tiny_quantizable(family)[0].save_pretrained(folders[family])
    per_rank = rank_pool(2).run(_cases, DEVICE, folders, KINDS)
    print({k: v for k, v in per_rank[0].items()})
    for family in folders:
        for kind in KINDS:
            assert all(r[(family, kind, "quantized linears")] > 0 for r in per_rank), (family, kind)
            for ulysses, ring in ((2, 1), (1, 2)):
                errors = [r[(family, kind, ulysses, ring)] for r in per_rank]
                assert all(err <= tol for err, tol in errors), (family, kind, ulysses, ring, errors)
