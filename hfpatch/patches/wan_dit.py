"""Sequence-parallel (USP) ``WanTransformer3DModel``: Wan 2.1 and 2.2, text-to-video and image-to-video.

After ``hfpatch.apply(transformer, parallel=ParallelConfig(ulysses=u, ring=r))`` on every rank of an
``r * u`` group, each rank holds one shard of the video tokens from the first block to the output
projection; every rank still returns the full output of the unpatched model.

Plan (see :mod:`hfpatch.patches._sequence_parallel`):

* ``blocks.0`` input ``hidden_states`` and the ``rope`` output ``(cos, sin)`` are sharded along the tokens,
  and so is a per-token ``timestep`` ``[B, S]`` (Wan 2.2 ``expand_timesteps``), which makes the per-token
  modulation of every block and of the output norm local too;
* ``proj_out`` output is gathered (and trimmed of padding) before the stock unpatchify.

Every ``blocks[i].attn1`` gets :class:`WanUSPAttnProcessor` (the stock projections, RMS norms and rotary
on the shard, then :func:`~hfpatch.attention.usp.usp_attention`). ``attn2`` keeps its stock processor:
its queries are the local tokens and its keys/values the replicated text (and image) embeddings, so
cross-attention needs no communication.

Gradients: every rank holds partial gradients; all-reduce SUM over the ``sp`` group
(:func:`hfpatch.all_reduce_gradients`).

>>> import torch, hfpatch
>>> from hfpatch.testing import tiny_wan_transformer
>>> model = tiny_wan_transformer()
>>> with hfpatch.apply(model) as patch:   # one process: sequence parallel degree 1, nothing to patch
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
from ._wan_common import wan_self_attention_qkv

__all__ = ["WanTransformerUSP", "WanUSPAttnProcessor"]


class WanUSPAttnProcessor(USPAttnProcessor):
    """Wan self-attention (``attn1``) on this rank's token shard, exact over the whole sequence.

    Args:
        state: The model's :class:`~hfpatch.patches._sequence_parallel.SequenceShard`.
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError(
                "WanUSPAttnProcessor serves self-attention (attn1) without a mask; got "
                f"encoder_hidden_states={encoder_hidden_states is not None}, attention_mask={attention_mask is not None}"
            )
        query, key, value = wan_self_attention_qkv(attn, hidden_states, rotary_emb)  # local tokens, all heads

        out, _ = usp_attention_call(self.state, query, key, value)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


class WanTransformerUSP(SequenceParallelFamily):
    """USP for ``diffusers.WanTransformer3DModel`` (registered in ``hfpatch.patches.BUILTIN_FAMILIES``)."""

    name: ClassVar[str] = "wan_usp"
    plan: ClassVar[SequencePlan] = {
        "": (SplitInput("timestep", dim=1, ndim=2),),  # Wan 2.2 per-token timesteps [B, S]
        "rope": (SplitOutput(dim=1),),  # (cos, sin), each [1, S, 1, D]
        # [B, C, F, H, W] -> tokens [B, C, S]: cut here so the full embedding is freed at once
        "patch_embedding": (SplitOutput(dim=2, flatten_from=2),),
        "proj_out": (GatherOutput(dim=1),),
    }

    def attention_modules(self, target: Any) -> list[tuple[str, torch.nn.Module, str]]:
        return [
            (f"blocks.{i}.attn1", block.attn1, "WanAttnProcessor") for i, block in enumerate(target.blocks)
        ]

    def make_processor(self, state: SequenceShard, path: str, attention: torch.nn.Module) -> Any:
        return WanUSPAttnProcessor(state)
