"""How the Ulysses exchange runs: exact and blocking (the default), overlapped with the attention, or in FP8.

The options are read by :func:`hfpatch.attention.usp.usp_attention` (``exchange=``), by the exchange's plans
(:mod:`hfpatch.attention.exchange.plans`: chunks of heads, wire dtype per tensor, scales) and by
:func:`hfpatch.attention.exchange.overlap.start_sequence_to_heads`; the FP8 wire is
:mod:`hfpatch.attention.exchange.wire`.

>>> import torch
>>> ExchangeConfig.parse("fp8")
ExchangeConfig(overlap=False, chunks=2, dtype=torch.float8_e4m3fn, scale='head', exact_keys=False, training=False)
>>> ExchangeConfig.parse("overlap").lossy
False
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .wire import FP8

Tensor = torch.Tensor
_SCALES = ("head", "tensor")


@dataclass(frozen=True)
class ExchangeConfig:
    """How the Ulysses exchange runs. The default (``ExchangeConfig()`` or ``None``) is exact and blocking.

    Args:
        overlap: Pipeline the exchange with the attention: the heads in ``chunks`` parts, each part's exchange
            running while the previous part attends (same results, bit for bit on the kernels tested).
        chunks: Head chunks when overlapping (at least 2).
        dtype: Wire dtype of q, k, v and the output: ``None`` (their own, exact) or ``torch.float8_e4m3fn``.
        scale: FP8 scales per sample and head of each message (``"head"``) or per sample (``"tensor"``).
        exact_keys: With FP8, send the keys in their own dtype (the scores are most sensitive to them).
        training: Allow the FP8 exchange while autograd records with inputs that require grad (asked for by
            name: the forward is perturbed, the backward exchanges exact gradients).

    >>> ExchangeConfig(overlap=True, chunks=4).lossy
    False
    """

    overlap: bool = False
    chunks: int = 2
    dtype: torch.dtype | None = None
    scale: str = "head"
    exact_keys: bool = False
    training: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.overlap, bool) or not isinstance(self.training, bool):
            raise ValueError(
                f"ExchangeConfig: overlap and training must be bools, got {self.overlap!r}, {self.training!r}"
            )
        if not isinstance(self.exact_keys, bool):
            raise ValueError(f"ExchangeConfig: exact_keys must be a bool, got {self.exact_keys!r}")
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 2:
            raise ValueError(f"ExchangeConfig: chunks must be an int >= 2, got {self.chunks!r}")
        if self.dtype not in (None, FP8):
            raise ValueError(
                f"ExchangeConfig: dtype must be None (exact) or torch.float8_e4m3fn, got {self.dtype!r}"
            )
        if self.scale not in _SCALES:
            raise ValueError(f"ExchangeConfig: scale must be one of {_SCALES}, got {self.scale!r}")

    @property
    def lossy(self) -> bool:
        """Whether values are rounded on the wire (FP8)."""
        return self.dtype is not None

    @classmethod
    def parse(cls, value: ExchangeConfig | str | None) -> ExchangeConfig | None:
        """``None``, an :class:`ExchangeConfig`, or a name: ``"exact"``, ``"overlap"``, ``"fp8"``, ``"fp8+overlap"``.

        Raises:
            ValueError: Anything else.
        """
        if value is None or isinstance(value, cls):
            return value
        names = {
            "exact": None,
            "overlap": cls(overlap=True),
            "fp8": cls(dtype=FP8),
            "fp8+overlap": cls(overlap=True, dtype=FP8),
        }
        if isinstance(value, str) and value in names:
            return names[value]
        raise ValueError(
            f"exchange must be None, an hfpatch.attention.exchange.ExchangeConfig or one of {sorted(names)}, "
            f"got {value!r}"
        )

    def check(self, tensors: Sequence[Tensor | None], where: str) -> None:
        """Refuse the FP8 exchange under training unless ``training=True``.

        Depends only on this rank's inputs, which every rank has alike: all ranks raise before any collective.
        """
        if not self.lossy:
            return
        present = [t for t in tensors if t is not None]
        if not self.training and torch.is_grad_enabled() and any(t.requires_grad for t in present):
            raise ValueError(
                f"{where}: the FP8 exchange rounds q, k, v and the output (about 2^-4 relative per element); it is "
                "refused while autograd records inputs that require grad. Run inference under torch.no_grad(), or "
                "ask for it by name: ExchangeConfig(dtype=torch.float8_e4m3fn, training=True)"
            )
