"""Sequence-parallel (USP) ``SD3Transformer2DModel`` (SD3 and SD3.5): image tokens sharded, text replicated.

Plan (see :mod:`hfpatch.patches._sequence_parallel`): the output of ``pos_embed`` (patchified latents plus
their learned positions, ``[B, S, D]``) and the ControlNet residuals are sharded along the image tokens;
``proj_out``'s output is gathered before the stock unpatchify.

Every ``transformer_blocks[i].attn`` gets :class:`SD3USPAttnProcessor` (joint attention, the text tokens
passed as the exact joint part after the image tokens, SD3's ``[image, text]`` order) and, in SD3.5's
dual-attention blocks, ``attn2`` gets it too (image-only self-attention).

Gradients: every rank holds partial gradients; all-reduce SUM over the ``sp`` group
(:func:`hfpatch.all_reduce_gradients`).

>>> import hfpatch
>>> from hfpatch.testing import tiny_sd3_transformer
>>> model = tiny_sd3_transformer()
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
    SplitOutput,
    USPAttnProcessor,
    usp_attention_call,
)

__all__ = ["SD3TransformerUSP", "SD3USPAttnProcessor"]


class SD3USPAttnProcessor(USPAttnProcessor):
    """SD3 joint attention (``JointAttnProcessor2_0``, also image-only without text) on this rank's image shard.

    Args:
        state: The model's :class:`~hfpatch.patches._sequence_parallel.SequenceShard`.
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self.refuse_mask(attention_mask)
        batch = hidden_states.shape[0]
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch, -1, attn.heads, head_dim)  # [B, S, H, D]; the norms act on D only
        key = key.view(batch, -1, attn.heads, head_dim)
        value = value.view(batch, -1, attn.heads, head_dim)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        joint = None
        if encoder_hidden_states is not None:
            q_txt = attn.add_q_proj(encoder_hidden_states).view(batch, -1, attn.heads, head_dim)
            k_txt = attn.add_k_proj(encoder_hidden_states).view(batch, -1, attn.heads, head_dim)
            v_txt = attn.add_v_proj(encoder_hidden_states).view(batch, -1, attn.heads, head_dim)
            if attn.norm_added_q is not None:
                q_txt = attn.norm_added_q(q_txt)
            if attn.norm_added_k is not None:
                k_txt = attn.norm_added_k(k_txt)
            joint = (q_txt, k_txt, v_txt)

        out, out_txt = usp_attention_call(self.state, query, key, value, joint=joint, joint_position="back")
        hidden_states = out.reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if encoder_hidden_states is None:  # SD3.5's attn2: image-only self-attention
            return hidden_states

        encoder_hidden_states = out_txt.reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        if not attn.context_pre_only:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


class SD3TransformerUSP(SequenceParallelFamily):
    """USP for ``diffusers.SD3Transformer2DModel``."""

    name: ClassVar[str] = "sd3_usp"
    plan: ClassVar[SequencePlan] = {
        "": (SplitInput("block_controlnet_hidden_states", dim=1),),  # list of [B, S, D]
        "pos_embed": (SplitOutput(dim=1),),  # [B, S, D] patch tokens with positions added
        "proj_out": (GatherOutput(dim=1),),
    }

    def attention_modules(self, target: Any) -> list[tuple[str, torch.nn.Module, str]]:
        found = []
        for i, block in enumerate(target.transformer_blocks):
            found.append((f"transformer_blocks.{i}.attn", block.attn, "JointAttnProcessor2_0"))
            if getattr(block, "use_dual_attention", False):  # SD3.5: image-only self-attention
                found.append((f"transformer_blocks.{i}.attn2", block.attn2, "JointAttnProcessor2_0"))
        return found

    def make_processor(self, state: SequenceShard, path: str, attention: torch.nn.Module) -> Any:
        return SD3USPAttnProcessor(state)
