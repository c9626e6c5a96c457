"""Sequence-parallel (USP) ``FluxTransformer2DModel``: image tokens sharded, text tokens replicated.

Plan (see :mod:`hfpatch.patches._sequence_parallel`): the model's ``hidden_states`` ``[B, S, C]`` and
``img_ids`` ``[S, 3]`` are sharded along the image tokens (so the stock ``pos_embed`` builds the rotary
table of ``txt_ids + local img_ids``), as are ControlNet residuals; ``proj_out``'s output is gathered.

Every attention gets :class:`FluxUSPAttnProcessor`: the stock projections, RMS norms and rotary, then
:func:`~hfpatch.attention.usp.usp_attention` with the replicated text tokens passed as the exact joint
part (``joint_position="front"``, Flux's ``[text, image]`` order). Dual-stream blocks hand text and image
separately; single-stream blocks concatenate ``[text, local image]`` in one sequence, which the processor
cuts at ``len(sequence) - local image tokens``.

Gradients: every rank holds partial gradients; all-reduce SUM over the ``sp`` group
(:func:`hfpatch.all_reduce_gradients`).

>>> import hfpatch
>>> from hfpatch.testing import tiny_flux_transformer
>>> model = tiny_flux_transformer()
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

__all__ = ["FluxTransformerUSP", "FluxUSPAttnProcessor"]


class FluxUSPAttnProcessor(USPAttnProcessor):
    """Flux joint attention (dual- and single-stream blocks) on this rank's image-token shard.

    Args:
        state: The model's :class:`~hfpatch.patches._sequence_parallel.SequenceShard`.
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        self.refuse_mask(attention_mask)
        dual = encoder_hidden_states is not None
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))  # [B, S, H, D]
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if dual and attn.added_kv_proj_dim is not None:
            encoder_query = attn.norm_added_q(encoder_query.unflatten(-1, (-1, attn.head_dim)))
            encoder_key = attn.norm_added_k(encoder_key.unflatten(-1, (-1, attn.head_dim)))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        if image_rotary_emb is not None:  # covers [text, local image], as built from txt_ids + local img_ids
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        # Text tokens first: the encoder stream (dual blocks) or the head of the single-stream sequence.
        text_len = encoder_hidden_states.shape[1] if dual else query.shape[1] - self.state.local_len
        sizes = [text_len, query.shape[1] - text_len]
        (q_txt, q_img), (k_txt, k_img), (v_txt, v_img) = (t.split(sizes, dim=1) for t in (query, key, value))
        out_img, out_txt = usp_attention_call(
            self.state, q_img, k_img, v_img, joint=(q_txt, k_txt, v_txt), joint_position="front"
        )
        hidden_states = torch.cat([out_txt, out_img], dim=1).flatten(2, 3).to(query.dtype)

        if dual:
            encoder_hidden_states, hidden_states = hidden_states.split(sizes, dim=1)
            hidden_states = attn.to_out[0](hidden_states.contiguous())
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
            return hidden_states, encoder_hidden_states
        return hidden_states


class FluxTransformerUSP(SequenceParallelFamily):
    """USP for ``diffusers.FluxTransformer2DModel`` (Flux.1 dev/schnell/Kontext layouts)."""

    name: ClassVar[str] = "flux_usp"
    plan: ClassVar[SequencePlan] = {
        "": (
            SplitInput("hidden_states", dim=1),  # [B, S, C] packed latents
            SplitInput("img_ids", dim=0, ndim=2),  # [S, 3]
            SplitInput("img_ids", dim=1, ndim=3),  # deprecated [B, S, 3]
            SplitInput("controlnet_block_samples", dim=1),  # list of [B, S, D]
            SplitInput("controlnet_single_block_samples", dim=1),
        ),
        "proj_out": (GatherOutput(dim=1),),
    }

    def attention_modules(self, target: Any) -> list[tuple[str, torch.nn.Module, str]]:
        blocks = [(f"transformer_blocks.{i}", b) for i, b in enumerate(target.transformer_blocks)]
        blocks += [
            (f"single_transformer_blocks.{i}", b) for i, b in enumerate(target.single_transformer_blocks)
        ]
        return [(f"{path}.attn", block.attn, "FluxAttnProcessor") for path, block in blocks]

    def make_processor(self, state: SequenceShard, path: str, attention: torch.nn.Module) -> Any:
        return FluxUSPAttnProcessor(state)
