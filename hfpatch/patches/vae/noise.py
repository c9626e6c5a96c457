"""Noise a VAE decoder draws with ``torch.randn``, split by height: each rank keeps its rows of the full draw.

LTX-Video's decoder (0.9.1 and later) and LTX-2's add ``torch.randn(H, W)`` spatial noise inside their resnets
(``inject_noise``). On a height shard the stock call would draw an ``h_local x W`` plane: other numbers than one
device draws, and different on every rank. :func:`rows_of_full_draw` intercepts the draw (a
:class:`torch.overrides.TorchFunctionMode`, active only around the module that draws), draws the full
``H x W`` plane from the same generator and returns this rank's rows of it. Every rank then consumes the same
random numbers as one device does, in the same order, so the decoded video equals one device's for the same
generator state, and the generator states stay in step across the ranks.

The draw is the size of one frame plane (``H x W``), not of a feature map. Noise from the global RNG needs the
same RNG state on every rank; the split VAE checks it with the inputs (:func:`rng_state`).

>>> import torch
>>> from hfpatch.patches.vae.noise import full_height_randn
>>> g = torch.Generator().manual_seed(0)
>>> full = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
>>> torch.equal(full_height_randn((2, 3), [3, 2], rank=1, generator=g), full[3:])
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .halo import row_offsets
from .state import VAEShardState

__all__ = ["full_height_randn", "noise_forward", "rng_state", "rows_of_full_draw"]


def full_height_randn(shape: Sequence[int], rows: Sequence[int], rank: int, **kwargs: Any) -> torch.Tensor:
    """This rank's rows (dim -2) of ``torch.randn`` of the full height (``sum(rows)``), ``kwargs`` passed on.

    ``shape``: the local shape (``shape[-2] == rows[rank]``); ``rows``: every rank's rows.
    """
    full = list(shape)
    full[-2] = sum(rows)
    return torch.randn(full, **kwargs).narrow(-2, row_offsets(list(rows))[rank], rows[rank])


class _FullHeightRandn(TorchFunctionMode):
    """``torch.randn(size, ...)`` whose dim -2 is this rank's rows of a map -> the rows of the full draw."""

    def __init__(self, state: VAEShardState) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.randn and self.state.sharding:
            size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            size = tuple(int(s) for s in size)
            if len(size) >= 2 and size[-2] > 0:
                return full_height_randn(size, self.state.sizes(size[-2]), self.state.rank, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def rows_of_full_draw(state: VAEShardState) -> Iterator[None]:
    """Inside the block, ``torch.randn`` of a plane with this rank's rows draws the full height and keeps them."""
    with _FullHeightRandn(state):
        yield


def noise_forward(module: torch.nn.Module, state: VAEShardState) -> Callable:
    """``module.forward`` with its ``torch.randn`` noise drawn at full height (:func:`rows_of_full_draw`)."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not state.sharding:
            return original(*args, **kwargs)
        with rows_of_full_draw(state):
            return original(*args, **kwargs)

    return forward


def rng_state(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The global RNG state a ``torch.randn`` without generator reads (CPU, and the current CUDA device's)."""
    states = {"torch_rng_state": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        states["cuda_rng_state"] = torch.cuda.get_rng_state(device)
    return states
