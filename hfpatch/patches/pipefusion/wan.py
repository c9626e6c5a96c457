"""PipeFusion for ``WanTransformer3DModel``: its ``blocks`` split into stages, its self-attention (``attn1``) on
the stage's K/V buffer. The machinery, shared with :mod:`hfpatch.patches.pipefusion.flux`, and the design notes are
:mod:`hfpatch.patches.pipefusion.stages`.

>>> import hfpatch
>>> from hfpatch.testing import tiny_wan_transformer
>>> from hfpatch.patches.pipefusion import WanPipeFusion
>>> sorted(WanPipeFusion.options)
['check_inputs', 'pipefusion', 'pipefusion_blocks', 'pipefusion_patches', 'pipefusion_release_weights', 'pipefusion_warmup']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ...core.config import ModelFacts, ParallelConfig
from ...core.patch import Patch
from ...core.registry import PatchFamily
from ...distributed.agreement import install_call_guard
from .layout import stage_ranges
from .stages import (
    PIPEFUSION_OPTIONS,
    block_spans,
    check_pipefusion_options,
    gather_stage_output,
    install_model_hooks,
    release_other_blocks,
    stage_groups,
    stage_rows,
    wrap_stage_blocks,
)
from .state import HANDOFF, PipeFusionAttnProcessor, PipeFusionState

__all__ = ["PipeFusionWanAttnProcessor", "WanPipeFusion", "apply_pipefusion"]


class PipeFusionWanAttnProcessor(PipeFusionAttnProcessor):
    """Wan self-attention (``attn1``) of a block of this stage, attending to the stage's K/V buffer
    (:meth:`PipeFusionAttnProcessor.attend`); ``layer`` is the index of the block in ``model.blocks``."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from ..wan_attention import wan_self_attention_qkv

        call = self.current_call(f"{self.state.name}.blocks.{self.layer}.attn1")
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("PipeFusionWanAttnProcessor serves self-attention (attn1) without a mask")
        query, key, value = wan_self_attention_qkv(
            attn, hidden_states, rotary_emb
        )  # [B, s, H, D], this patch
        out = self.attend(call, query, key, value).flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


class WanPipeFusion(PatchFamily):
    """PipeFusion for ``diffusers.WanTransformer3DModel`` (registered in ``hfpatch.patches.BUILTIN_FAMILIES``).

    Options:
        pipefusion: Let the planner of ``parallel=N`` give PipeFusion a degree (default False: an int
            ``parallel`` never plans PipeFusion, which is approximate; see :func:`hfpatch.core.config.plan_parallel`).
        pipefusion_patches: ``M``, token patches per pipelined call (default ``None``: the number of stages).
        pipefusion_warmup: ``W`` >= 1, exact synchronous calls per stream before pipelining (default 1).
        pipefusion_blocks: Blocks per stage, e.g. ``(3, 2)``; default: as even as possible.
        pipefusion_release_weights: Release the other stages' block weights (default True). Released weights
            do not come back: ``patch.remove()`` then warns and leaves those blocks on the ``meta`` device
            (reload the model to run it unpatched). With False every rank keeps every weight and
            ``remove()`` restores the model exactly.
        check_inputs: Check that the ranks of a stage group get the same call arguments.
    """

    name: ClassVar[str] = "wan_pipefusion"
    role: ClassVar[str] = "transformer"
    options: ClassVar[dict[str, Any]] = PIPEFUSION_OPTIONS

    def facts(self, target: Any) -> ModelFacts:
        return ModelFacts(
            num_heads=target.config.num_attention_heads,
            name=type(target).__name__,
            num_blocks=len(target.blocks),
        )

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        name = type(target).__name__
        if not check_pipefusion_options(
            target, config, options, len(target.blocks), name, sequence_parallel=True
        ):
            return
        for index, block in enumerate(target.blocks):
            found = type(block.attn1.processor).__name__
            if found != "WanAttnProcessor":
                raise ValueError(
                    f"{name}.blocks.{index}.attn1 uses attention processor {found}; PipeFusion replaces only the "
                    "stock WanAttnProcessor. Restore it (model.set_default_attn_processor()) before hfpatch.apply"
                )

    def apply(self, target: Any, patch: Patch, mesh: Any, options: dict[str, Any]) -> None:
        if mesh.config.pipefusion == 1:
            return
        apply_pipefusion(target, patch, options=options, **stage_groups(mesh))


def _stage_runner(state: PipeFusionState, blocks: list[Callable[..., torch.Tensor]]) -> Callable[..., Any]:
    """Replacement ``forward`` of ``blocks[0]``: runs this rank's stage (``blocks``: the stock forwards of its
    blocks) for the whole call, patch by patch, and returns the final hidden states on the last stage (its
    input, a placeholder, elsewhere: the output is sent by the last stage after the model's output layers)."""

    def run_stage(
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        call = state.call
        if call is None:
            raise RuntimeError(f"{state.name}.blocks ran outside a PipeFusion call of the model")
        outputs: list[torch.Tensor] = []
        sending: list[dist.Work] = []
        per_token = temb.ndim == 4  # Wan 2.2 per-token modulation [B, S, 6, C]
        shard = call.shard
        rows, sliced = stage_rows(call)
        source, all_temb, all_rotary = hidden_states, temb, rotary_emb
        if shard is not None:  # sequence parallel in the stage: this rank's shards of every patch
            index_ = shard.local_index
            source = hidden_states.index_select(1, index_) if state.is_first else hidden_states
            all_temb = temb.index_select(1, index_) if per_token else temb
            if rotary_emb is not None:
                all_rotary = tuple(r.index_select(1, index_) for r in rotary_emb)

        pending = state.recv_rows(hidden_states, rows[0]) if not state.is_first else None
        for index, (start, end) in enumerate(rows):
            if state.is_first:
                x = source[:, start:end]
            else:
                x, works = pending
                if index + 1 < len(rows):  # the next patch arrives while this one computes
                    pending = state.recv_rows(hidden_states, rows[index + 1])
                state.wait(works, "PipeFusion receive")
            temb_patch = all_temb[:, start:end] if per_token and sliced else all_temb
            rotary = all_rotary
            if sliced and all_rotary is not None:
                rotary = tuple(r[:, start:end] for r in all_rotary)
            call.current, call.index = (start, end), index
            for block in blocks:
                x = block(x, encoder_hidden_states, temb_patch, rotary)
            if state.is_last:
                outputs.append(x)
            else:
                state.wait(sending, "PipeFusion send")  # at most one patch in flight
                sending = state.send(x, state.stage + 1, HANDOFF)
        state.wait(sending, "PipeFusion send")
        if not state.is_last:
            return hidden_states  # placeholder: the model output comes from the last stage
        return gather_stage_output(state, call, outputs)

    return run_stage


def _passthrough(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Replacement ``forward`` of every block but the first: the first one ran the whole stage."""
    return hidden_states


def apply_pipefusion(
    target: Any,
    patch: Patch,
    group: Any,
    options: dict[str, Any],
    stages: list[tuple[int, int]] | None = None,
    sp_groups: tuple[Any, Any, Any] = (None, None, None),
    guard: Any = None,
) -> PipeFusionState:
    """Install PipeFusion on a ``WanTransformer3DModel`` through ``patch`` (what :class:`WanPipeFusion` does).

    ``group=None`` runs every stage in this process (one stage of all blocks, no communication): the same
    stale-K/V arithmetic as ``P`` ranks, since which rank holds a block does not change what it computes.
    Tests and benchmarks use it as the reference of the approximate mode, and to measure its error cheaply.

    Args:
        target: The model (validated by :meth:`WanPipeFusion.validate`).
        patch: The patch that logs every change.
        group: The ``pipefusion`` process group, or ``None``.
        options: :attr:`WanPipeFusion.options`, resolved.
        stages: Block ranges per stage (default: from ``pipefusion_blocks`` and the group size).
        sp_groups: The ``sp``, ``ulysses`` and ``ring`` groups of this rank: sequence parallel inside each
            stage (:func:`sequence_parallel_attention`); ``None`` each for none.
        guard: The group whose ranks must get the same call arguments (default ``group``; with sequence
            parallel, every stage's every sp rank).

    >>> import torch
    >>> from hfpatch.core.patch import Patch
    >>> from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
    >>> model = tiny_wan_transformer()
    >>> x, t, text = torch.randn(1, 4, 2, 4, 4), torch.tensor([500.0]), wan_prompt_embeds()
    >>> with torch.no_grad():
    ...     reference = model(x, t, text).sample
    ...     with Patch("pipefusion") as patch:
    ...         options = {**WanPipeFusion.options, "pipefusion_patches": 4}
    ...         state = apply_pipefusion(model, patch, None, options)
    ...         warm = model(x, t, text).sample                 # warm-up call: exact
    ...         stale = model(x, t - 10, text).sample           # pipelined: the other patches' K/V are stale
    >>> torch.equal(warm, reference), torch.equal(stale, reference)
    (True, False)
    """
    name = type(target).__name__
    world = 1 if group is None else dist.get_world_size(group)
    if stages is None:
        stages = stage_ranges(len(target.blocks), world, options["pipefusion_blocks"] if world > 1 else None)
    state = PipeFusionState(
        group, stages, options["pipefusion_patches"] or world, options["pipefusion_warmup"], name, sp_groups
    )
    guard = group if guard is None else guard
    if options["check_inputs"] and guard is not None:
        install_call_guard(patch, target, guard, f"{name}.forward (PipeFusion stages)")
    own = range(state.first, state.end)
    stage_blocks: list[Callable[..., torch.Tensor]] = []  # the stock forwards of this stage's blocks
    wrap_stage_blocks(
        patch, list(target.blocks), own, _stage_runner(state, stage_blocks), _passthrough, stage_blocks
    )
    for index in own:
        attention = target.blocks[index].attn1
        backend = getattr(attention.processor, "_attention_backend", None)
        patch.swap_processor(attention, PipeFusionWanAttnProcessor(state, index, backend))

    patch_size = tuple(target.config.patch_size)

    def tokens_of(named: dict[str, Any]) -> int:
        tokens = 1
        for size, step in zip(named["hidden_states"].shape[2:], patch_size):
            tokens *= size // step
        return tokens

    install_model_hooks(target, patch, state, name, tokens_of)
    if options["pipefusion_release_weights"]:
        release_other_blocks(
            target,
            patch,
            state,
            list(target.blocks),
            own,
            ("blocks",),
            lambda i: f"{name}.blocks {block_spans(i)}",
        )
    return state
