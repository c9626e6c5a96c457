"""The wire format of the Ulysses exchange: how a message is packed, exact or in FP8.

A message carries one sample's rows of one piece (``[rows, h, D]``: ``h`` heads of one chunk of this rank's or
the peer's), contiguous: a batch of ``B`` samples is ``B`` messages to each peer, because a sample's rows are
contiguous in the buffers the kernel reads and writes while several samples' rows are not. This rank's own
heads never travel.

* **Exact** (:class:`~hfpatch.attention.exchange.config.ExchangeConfig` ``dtype=None``, the default): the rows
  in their own dtype. A strided piece is packed by one copy (q, k, v: the heads of one peer out of every
  token's row); a contiguous one is sent as it is (the kernel's output rows). The receiver gets them straight
  in the kernel's buffer (q, k, v) or in a buffer it unpacks by one copy among the heads (the output).
* **FP8** (``dtype=torch.float8_e4m3fn``, opt-in): a piece ``[B, S, h, D]`` to one peer travels as ``B``
  messages of e4m3 bytes (``uint8`` on the wire: :data:`FP8` values of ``piece / scale``), then one message
  of float32 scales ``[B, h]``: ``amax / 448`` (:data:`FP8_MAX`, the largest finite e4m3) per sample and head
  of the piece (``scale="head"``), or per sample (``scale="tensor"``: the largest over the heads, repeated),
  1 where the piece is all zeros. The receiver multiplies in float32 and writes its own dtype. Half the bytes
  of bf16, plus ``4 B h`` bytes of scales per message. The error is an input perturbation of about ``2^-4``
  relative per element (3 mantissa bits); measured figures in ``docs/capabilities/dit-sequence-parallel.md``.
  Keys may stay exact (``exact_keys``). The text output heads, all-gathered, travel in FP8 too, and their
  owner writes the dequantised values as well, so the replicated text stream stays identical on every rank.
  The backward exchanges the gradients exactly (straight-through: the rounding's derivative taken as 1).

>>> import torch
>>> piece = torch.tensor([[[[1.0, -2.0]], [[0.5, 4.0]]]])  # [B=1, S=2, h=1, D=2]
>>> wire, scales = quantize(piece, "head")
>>> wire.dtype, wire.shape, scales.tolist()  # amax 4 / 448
(torch.uint8, torch.Size([1, 2, 1, 2]), [[0.008928571827709675]])
>>> out = torch.empty_like(piece)
>>> dequantize_into(out, wire, scales)
>>> torch.equal(out, piece)  # powers of two times the scale round exactly
True
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
#: The wire dtype of the low-precision exchange and its largest finite value.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _scales(piece: Tensor, scale: str) -> Tensor:
    """float32 ``[B, H]`` scales ``amax / 448`` of a ``[B, S, H, D]`` piece (1 where it is all zeros)."""
    amax = piece.detach().abs().amax(dim=(1, 3)).float()  # [B, H]
    if scale == "tensor":
        amax = amax.amax(dim=1, keepdim=True).expand_as(amax)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).contiguous()


def quantize(piece: Tensor, scale: str) -> tuple[Tensor, Tensor]:
    """``(wire, scales)`` of a ``[B, S, H, D]`` piece: its e4m3 bytes (``uint8``, shaped like ``piece``) and
    its float32 ``[B, H]`` scales (``scale``: ``"head"`` or ``"tensor"``)."""
    scales = _scales(piece, scale)
    wire = torch.empty(piece.shape, dtype=torch.uint8, device=piece.device)
    wire.view(FP8).copy_(piece.float().div(scales[:, None, :, None]))
    return wire, scales


def dequantize_into(dest: Tensor, wire: Tensor, scales: Tensor) -> None:
    """``dest`` <- ``e4m3(wire) * scales`` (``scales``: ``[B, H]``), computed in float32."""
    dest.copy_(wire.view(FP8).float().mul_(scales[:, None, :, None]))
