"""Helpers shared by the Wan transformer patches (sequence parallel and streaming).

>>> import torch
>>> from hfpatch.patches._wan_common import apply_wan_rotary
>>> x = torch.randn(1, 3, 2, 4)  # [B, S, H, D]
>>> cos, sin = torch.ones(1, 3, 1, 4), torch.zeros(1, 3, 1, 4)  # angle 0: the identity rotation
>>> torch.equal(apply_wan_rotary(x, cos, sin), x)
True
"""

from __future__ import annotations

import torch

__all__ = ["apply_wan_rotary"]


def apply_wan_rotary(x_bshd: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding on ``[B, S, H, D]``, the arithmetic of the stock ``WanAttnProcessor``.

    The stock one is a closure inside ``WanAttnProcessor.__call__``, hence not importable; the processors that
    replace it must reproduce it bit for bit so the patched models match the stock ones.
    """
    x1, x2 = x_bshd.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x_bshd)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x_bshd)
