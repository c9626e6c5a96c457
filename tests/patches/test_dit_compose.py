"""diffusers' model hooks composed with hfpatch's sequence parallelism: group offloading, layerwise casting, LoRA
hot-swap and torch.compile on a patched transformer, gloo, fp32.

Each case builds the tiny QwenImage transformer (joint attention, padded-prompt mask, 25 image tokens) with the
feature, runs it unpatched (the reference: the feature on one rank), applies ``hfpatch.apply`` (Ulysses 2 and
Ring 2) and runs again: the output must equal the reference within ``reassociation_tol`` of the plain model's
fp32-vs-fp64 noise, and ``patch.remove()`` must give the reference back bit for bit.

* group offloading (``enable_group_offload``, block level, CPU to CPU here: the hooks that move each block's
  weights run as on a GPU) applied before ``hfpatch.apply``;
* layerwise casting (``enable_layerwise_casting``: bf16 storage, fp32 compute) before ``apply``;
* LoRA hot-swap: an adapter added before ``apply``, its weights swapped in place after ``apply``
  (``load_lora_adapter(..., hotswap=True)``): the output is the other adapter's;
* ``torch.compile`` of the patched model (eager backend).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from test_dit_usp import build

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64


def _lora(seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    from peft import LoraConfig

    model, kwargs, _ = build("qwenimage_mask")
    torch.manual_seed(seed)
    config = LoraConfig(
        r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
    )
    model.add_adapter(config, adapter_name="default")
    return model, kwargs


def compose_cases() -> dict[str, dict[str, Any]]:
    from peft.utils import get_peft_model_state_dict

    world = dist.get_world_size()
    plain, kwargs, _ = build("qwenimage_mask")
    with torch.no_grad():
        noise = rel_error(plain(**kwargs).sample, to_fp64(plain)(**to_fp64(kwargs)).sample)
    results = {}
    for parallel in (ParallelConfig(ulysses=world), ParallelConfig(ring=world)):
        tag = f"ulysses={parallel.ulysses} ring={parallel.ring}"
        cases: dict[str, tuple[torch.nn.Module, Any]] = {}
        offloaded, _, _ = build("qwenimage_mask")
        offloaded.enable_group_offload(
            onload_device=torch.device("cpu"), offload_device=torch.device("cpu"), offload_type="block_level",
            num_blocks_per_group=1,
        )  # fmt: skip
        cases["group_offload"] = (offloaded, None)
        cast, _, _ = build("qwenimage_mask")
        cast.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
        cases["layerwise_casting"] = (cast, None)
        swapped, _ = _lora(1)
        other, _ = _lora(2)
        cases["lora_hotswap"] = (swapped, get_peft_model_state_dict(other))
        compiled, _, _ = build("qwenimage_mask")
        cases["compile"] = (compiled, "compile")
        for name, (model, extra) in cases.items():
            with torch.no_grad():
                reference = (other if name == "lora_hotswap" else model)(**kwargs).sample
                patch = hfpatch.apply(model, parallel=parallel)
                if name == "lora_hotswap":
                    model.load_lora_adapter(extra, adapter_name="default", hotswap=True, prefix=None)
                run = torch.compile(model, backend="eager") if name == "compile" else model
                out = run(**kwargs).sample
                patch.remove()
                after = model(**kwargs).sample
            results[f"{name} {tag}"] = {
                "error": rel_error(out, reference),
                "noise": noise,
                "removed_bitwise": torch.equal(after, reference),
                "out": out,
            }
    return results


def test_model_hooks_compose_with_sequence_parallelism(rank_pool):
    results = rank_pool(2).run(compose_cases)  # 25 tokens: 13 + 12, the second shard padded
    for case in results[0]:
        for rank, result in enumerate(r[case] for r in results):
            assert result["error"] <= reassociation_tol(result["noise"]), (rank, case, result["error"])
            assert result["removed_bitwise"], (rank, case)
        outputs = [r[case]["out"] for r in results]
        assert all(torch.equal(outputs[0], o) for o in outputs[1:]), case
    assert len(results[0]) == 8
