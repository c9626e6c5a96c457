"""The random state a GradCache chunk is embedded under, kept from its first forward and replayed for its second,
so that dropout draws the same masks in both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

__all__ = ["RngState"]


@dataclass
class RngState:
    """CPU and accelerator RNG states captured before a chunk's first forward, replayed for its second.

    Like ``RandContext`` in luyug/GradCache and the state that ``torch.utils.checkpoint`` preserves:
    replaying happens inside ``torch.random.fork_rng``, so the global RNG continues afterwards as if each
    chunk had been run once.
    """

    cpu: torch.Tensor
    device_type: str
    devices: list[int]
    device_states: list[torch.Tensor]

    @classmethod
    def capture(cls, *tensors: torch.Tensor) -> RngState:
        """Save the CPU state and the states of the accelerators that ``tensors`` live on."""
        device_type = next((t.device.type for t in tensors if t.device.type not in ("cpu", "meta")), "cuda")
        devices, states = get_device_states(*tensors)
        return cls(torch.get_rng_state(), device_type, devices, states)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block under the saved states; restore the current ones afterwards."""
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu)
            set_device_states(self.devices, self.device_states, device_type=self.device_type)
            yield
