"""Sequence-parallel (USP) ``CogVideoXTransformer3DModel`` (CogVideoX 2B/5B/1.5): video tokens sharded.

Plan (see :mod:`hfpatch.patches._sequence_parallel`): the video tokens entering ``transformer_blocks.0``
(after the stock patch embedding, which also adds CogVideoX-2B's sin-cos positions) and the rotary table
``image_rotary_emb`` ``(cos, sin)``, each ``[S, D]``, are sharded; ``proj_out``'s output is gathered before
the stock unpatchify. Text tokens stay replicated: the blocks carry them as a separate stream.

Every ``transformer_blocks[i].attn1`` gets :class:`CogVideoXUSPAttnProcessor`: the stock projections,
per-head norms and rotary (video tokens only), then :func:`~hfpatch.attention.usp.usp_attention` with the
text as the exact joint part in front (CogVideoX's ``[text, video]`` order).

Gradients: every rank holds partial gradients; all-reduce SUM over the ``sp`` group
(:func:`hfpatch.all_reduce_gradients`).

>>> import hfpatch
>>> from hfpatch.testing import tiny_cogvideox_transformer
>>> model = tiny_cogvideox_transformer()
>>> with hfpatch.apply(model) as patch:   # one process: nothing to shard
...     patch.plan.sequence_parallel
1
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ._sequence_parallel import (
    GatherOutput,
    SequenceParallelFamily,
    SequencePlan,
    SequenceShard,
    SplitInput,
    USPAttnProcessor,
    usp_attention_call,
)

__all__ = ["CogVideoXTransformerUSP", "CogVideoXUSPAttnProcessor"]


class CogVideoXUSPAttnProcessor(USPAttnProcessor):
    """CogVideoX joint text+video attention (``CogVideoXAttnProcessor2_0``) on this rank's video shard.

    Args:
        state: The model's :class:`~hfpatch.patches._sequence_parallel.SequenceShard`.
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.embeddings import apply_rotary_emb

        self.refuse_mask(attention_mask)
        batch = hidden_states.shape[0]
        head_dim = attn.to_k.out_features // attn.heads

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, -1, attn.heads, head_dim)  # [B, S, H, D]; the norms act on D only

        # The stock processor projects [text, video] in one call; per-token linears make that the same.
        query, key, value = (
            heads(attn.to_q(hidden_states)),
            heads(attn.to_k(hidden_states)),
            heads(attn.to_v(hidden_states)),
        )
        q_txt = heads(attn.to_q(encoder_hidden_states))
        k_txt = heads(attn.to_k(encoder_hidden_states))
        v_txt = heads(attn.to_v(encoder_hidden_states))
        if attn.norm_q is not None:
            query, q_txt = attn.norm_q(query), attn.norm_q(q_txt)
        if attn.norm_k is not None:
            key, k_txt = attn.norm_k(key), attn.norm_k(k_txt)
        if image_rotary_emb is not None:  # video tokens only
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            if not attn.is_cross_attention:
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        out, out_txt = usp_attention_call(
            self.state, query, key, value, joint=(q_txt, k_txt, v_txt), joint_position="front"
        )
        hidden_states = attn.to_out[1](attn.to_out[0](out.reshape(batch, -1, attn.heads * head_dim)))
        encoder_hidden_states = attn.to_out[1](
            attn.to_out[0](out_txt.reshape(batch, -1, attn.heads * head_dim))
        )
        return hidden_states, encoder_hidden_states


class CogVideoXTransformerUSP(SequenceParallelFamily):
    """USP for ``diffusers.CogVideoXTransformer3DModel``."""

    name: ClassVar[str] = "cogvideox_usp"
    plan: ClassVar[SequencePlan] = {
        "": (SplitInput("image_rotary_emb", dim=0),),  # (cos, sin), each [S, D]; passed to every block
        "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),  # [B, S, D] video tokens
        "proj_out": (GatherOutput(dim=1),),
    }

    def attention_modules(self, target: Any) -> list[tuple[str, torch.nn.Module, str]]:
        return [
            (f"transformer_blocks.{i}.attn1", block.attn1, "CogVideoXAttnProcessor2_0")
            for i, block in enumerate(target.transformer_blocks)
        ]

    def make_processor(self, state: SequenceShard, path: str, attention: torch.nn.Module) -> Any:
        return CogVideoXUSPAttnProcessor(state)
