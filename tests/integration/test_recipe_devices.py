"""The training recipe follows the model's device: what fails on a GPU fails here too (models on ``meta``).

A CPU-only suite cannot put the model on CUDA, but it can put it on the ``meta`` device: torch refuses to
mix ``meta`` and CPU tensors (a batch left on the CPU: a loader kept out of ``accelerator.prepare``), and
:func:`hfpatch.testing.devices.generator_device_rule` adds CUDA's rule for generators (a CPU generator handed
to a draw on the model's device). The example's training step runs there with a batch straight from its CPU
loader; a step that forgot either would raise the error the issue saw on the H100.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import hfpatch
from hfpatch.testing.devices import generator_device_rule

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "integrations" / "lora_sp_accelerate.py"


def _example():
    spec = importlib.util.spec_from_file_location("lora_sp_accelerate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_step_follows_the_model_device():
    example = _example()
    args = example.parse_args(["--train-text-encoder"])
    meta = torch.device("meta")
    models = tuple(m.to(meta) for m in example.build_models(args, torch.float32))
    dataset = example.InstanceDataset(4)
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=2)))  # on the CPU, as a loader gives it
    assert batch["pixels"].device.type == "cpu"
    with generator_device_rule():
        loss = example.training_step_loss(models, batch, args, [hfpatch.StepRNG(0)], meta, torch.float32)
        loss.backward()
    assert loss.device == meta
    assert all(
        p.grad is not None and p.grad.device == meta for p in models[1].parameters() if p.requires_grad
    )


def test_the_rule_catches_the_mistakes_it_stands_for():
    """The two GPU failures of issue 21, reproduced on ``meta``: so the test above can fail."""
    generator = hfpatch.step_generator(0, 0, replay=True)  # a CPU generator, as step_generator returns it
    latents = torch.zeros(2, 4, device="meta")
    with generator_device_rule(), pytest.raises(RuntimeError, match="device type for generator"):
        torch.randn(latents.shape, generator=generator, device=latents.device)
    with pytest.raises(RuntimeError, match="device"):
        latents + torch.randn(latents.shape, generator=generator)  # noise left on the CPU
