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

__all__ = ["GeneratorDeviceRule", "generator_device_rule"]


class GeneratorDeviceRule(TorchFunctionMode):
    """CUDA's check, on any device: a random op's generator must live on the device type it draws on.

    ``draws`` records ``(output device type, generator device type)`` of every seeded draw, so a test can
    also check WHERE the draws happened (diffusers' convention draws on the generator's device, then moves).
    """

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[tuple[str, str]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator):
            if kwargs.get("device") is not None:
                out = torch.device(kwargs["device"])
            else:  # an in-place draw (normal_, uniform_) or a *_like: the tensor's device
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                out = tensors[0].device if tensors else torch.get_default_device()
            self.draws.append((out.type, generator.device.type))
            if out.type != generator.device.type:
                raise RuntimeError(
                    f"Expected a '{out.type}' device type for generator but found "
                    f"'{generator.device.type}' (hfpatch.testing.devices: CUDA's rule)"
                )
        return func(*args, **kwargs)


def generator_device_rule() -> GeneratorDeviceRule:
    """A ``with`` block (``as rule``: its ``draws``) in which a random op whose generator sits on another
    device type than its output raises, as CUDA does (on CPU and ``meta`` torch itself does not check)."""
    return GeneratorDeviceRule()
