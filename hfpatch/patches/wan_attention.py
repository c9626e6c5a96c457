"""Helpers of the Wan streaming patch (the stock Wan self-attention arithmetic).

>>> import torch
>>> from hfpatch.patches.wan_attention import apply_wan_rotary
>>> x = torch.randn(1, 3, 2, 4)  # [B, S, H, D]
>>> cos, sin = torch.ones(1, 3, 1, 4), torch.zeros(1, 3, 1, 4)  # angle 0: the identity rotation
>>> torch.equal(apply_wan_rotary(x, cos, sin), x)
True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["apply_wan_rotary", "wan_self_attention_qkv"]


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


def wan_self_attention_qkv(
    attn: Any, hidden_states: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key, value ``[B, S, H, D]`` of a Wan self-attention (``attn1``), as the stock processor builds them.

    Projections through diffusers' own helper (so fused QKV works), RMS norms across heads per token, then the
    rotary embedding on query and key.
    """
    from diffusers.models.transformers.transformer_wan import _get_qkv_projections

    query, key, value = _get_qkv_projections(attn, hidden_states, None)
    query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
    key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
    if rotary_emb is not None:
        query = apply_wan_rotary(query, *rotary_emb)
        key = apply_wan_rotary(key, *rotary_emb)
    return query, key, value
