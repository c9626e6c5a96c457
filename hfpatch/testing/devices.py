"""Catch, on a CPU-only machine, the device mistakes that only a GPU run would show.

On CUDA two things fail that pass on CPU: a tensor left on the CPU meeting one on the GPU ("Expected all
tensors to be on the same device"), and a random op given a generator on another device type than the one
it draws on ("Expected a 'cuda' device type for generator but found 'cpu'"). Run the code with its models
and tensors on the ``meta`` device (shapes only, no memory): torch already refuses to mix ``meta`` and CPU
tensors, and :func:`generator_device_rule` adds CUDA's generator rule, so a path that forgets a ``.to(device)``
or hands a CPU generator to a draw on the model's device fails here as it would on a GPU.

>>> import torch
>>> from hfpatch.testing.devices import generator_device_rule
>>> cpu_generator = torch.Generator().manual_seed(0)
>>> with generator_device_rule():
...     torch.randn(2, generator=cpu_generator, device="meta")
Traceback (most recent call last):
...
RuntimeError: Expected a 'meta' device type for generator but found 'cpu' (hfpatch.testing.devices: CUDA's rule)
>>> from diffusers.utils.torch_utils import randn_tensor
>>> with generator_device_rule():  # diffusers' convention: draw on the generator's device, then move
...     randn_tensor((2,), generator=cpu_generator, device=torch.device("meta")).device
device(type='meta')
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["generator_device_rule"]


class _GeneratorDeviceRule(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        out = func(*args, **kwargs)
        if isinstance(generator, torch.Generator) and isinstance(out, torch.Tensor):
            if out.device.type != generator.device.type:
                raise RuntimeError(
                    f"Expected a '{out.device.type}' device type for generator but found "
                    f"'{generator.device.type}' (hfpatch.testing.devices: CUDA's rule)"
                )
        return out


def generator_device_rule() -> TorchFunctionMode:
    """A ``with`` block in which a random op whose generator sits on another device type than its output
    raises, as CUDA does (on CPU and ``meta`` torch itself does not check)."""
    return _GeneratorDeviceRule()
