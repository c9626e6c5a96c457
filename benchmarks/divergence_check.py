"""Cost per training step of the check that refuses ranks whose trainable weights diverged (issue 45).

The weight row of every patched call's same-input table follows the values of the parameters that require
grad (:class:`hfpatch.distributed.agreement.trainable.TrainableWeights`): after an optimizer step, the next call
digests them again; a training forward with no step since reads their version counters; a call under
``no_grad`` with no step since compares one integer. This script times :meth:`WeightWatch.row
<hfpatch.distributed.agreement.WeightWatch.row>` (the whole of the check's local work; its row rides in the
same-input table the call exchanges anyway, so it sends nothing more) in those three situations, against one
unpatched training step (forward, backward, AdamW step) of the same model, on one CPU process with one thread:

- the tests' tiny Wan transformer (``hfpatch.testing.tiny_wan_transformer``), with a peft LoRA (r=4 on
  ``to_q/to_k/to_v/to_out.0``, base frozen) and as a full fine-tune;
- the same at a larger tiny size (8 heads of 32, 4 layers), where the digest's per-tensor overhead matters less.

Medians over ``REPEATS`` samples. Writes ``benchmarks/results/divergence_check.json``; under a minute.

    python benchmarks/divergence_check.py
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hfpatch.distributed.agreement import WeightWatch
from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds

RESULTS = Path(__file__).parent / "results"
REPEATS = 30
SIZES = {
    "tests' tiny (4x8 heads, 2 layers)": {},
    "larger tiny (8x32 heads, 4 layers)": dict(num_heads=8, head_dim=32, num_layers=4),
}


def _model(mode: str, size: dict[str, Any]) -> torch.nn.Module:
    from peft import LoraConfig

    model = tiny_wan_transformer(**size)
    if mode == "lora":
        model.requires_grad_(False)
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return model


def _median(fn: Any) -> float:
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(mode: str, size: dict[str, Any]) -> dict[str, Any]:
    model = _model(mode, size)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randn(1, 4, 2, 16, 16, generator=torch.Generator().manual_seed(0))  # 128 tokens
    t, text = torch.tensor([500]), wan_prompt_embeds(1, 6)

    def step() -> None:
        model(x, t, text).sample.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up (AdamW state)
    watch = WeightWatch([("", model)], type(model).__name__)
    try:
        watch.row()
        step_s = _median(step)
        after_step = []
        for _ in range(REPEATS):
            step()
            start = time.perf_counter()
            watch.row()  # an optimizer step since the last look: the trainable values are digested again
            after_step.append(time.perf_counter() - start)
        training_forward_s = _median(watch.row)  # grad enabled, no step: version counters only
        with torch.no_grad():
            no_grad_s = _median(watch.row)  # no step, no grad: one comparison
    finally:
        watch.close()
    trainable_bytes = sum(p.numel() * p.element_size() for p in params)
    return {
        "mode": mode,
        "trainable_tensors": len(params),
        "trainable_bytes": trainable_bytes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_s": step_s,
        "check_after_a_step_s": statistics.median(after_step),
        "check_after_a_step_of_step": statistics.median(after_step) / step_s,
        "check_training_forward_no_step_s": training_forward_s,
        "check_no_grad_no_step_s": no_grad_s,
    }


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
        "repeats": REPEATS,
        "cases": {name: [measure(mode, size) for mode in ("lora", "full")] for name, size in SIZES.items()},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "divergence_check.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    for name, rows in main()["cases"].items():
        for row in rows:
            print(
                f"{name}, {row['mode']}: step {row['step_s'] * 1e3:.1f} ms, check after a step "
                f"{row['check_after_a_step_s'] * 1e3:.3f} ms ({100 * row['check_after_a_step_of_step']:.2f}%), "
                f"training forward {row['check_training_forward_no_step_s'] * 1e6:.1f} us, "
                f"no_grad {row['check_no_grad_no_step_s'] * 1e9:.0f} ns"
            )
