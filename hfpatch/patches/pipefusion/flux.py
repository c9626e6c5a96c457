"""PipeFusion for ``FluxTransformer2DModel``: the dual- and single-stream blocks split over ranks, the joint
``[text, image]`` sequence pipelined as patches.

``hfpatch.apply(pipe, parallel=ParallelConfig(pipefusion=P), pipefusion_patches=M, pipefusion_warmup=W)``
works as for Wan (:mod:`hfpatch.patches.pipefusion`: stages, exact warm-up, stale K/V after it, streams per
``cache_context`` name, output sent to every rank, weights of the other stages released); this module holds
what Flux adds.

**Stages over two block lists.** Flux runs ``transformer_blocks`` (dual-stream: text and image have their own
weights and meet in a joint attention) then ``single_transformer_blocks`` (one stream over the concatenated
``[text, image]`` sequence). The stages cut the concatenated list ``transformer_blocks + single_transformer_blocks``
(global block index), so a stage may end inside either list or span the switch; at every stage boundary the
state is a (text, image) pair of hidden states of the same width, whatever the block type. A dual-stream block
holds about 2.4 times the parameters of a single-stream one (two streams of projections and MLPs), so equal
block counts would leave the first stages heavy: the default stages balance the parameter bytes instead
(:func:`~hfpatch.patches.pipefusion.layout.balanced_stage_counts`, which also balances the linear layers'
compute; ``pipefusion_blocks=(n0, n1, ...)`` overrides it).

**Text tokens: a prefix of the joint sequence, in the K/V buffer like the image tokens.** Every block is per
token except its attention, which is one softmax over the joint sequence ``[text (T), image (S)]`` in both
block types (Flux's dual-stream attention concatenates ``[text, image]`` queries, keys and values exactly as
the single-stream blocks do, rotary table included). So PipeFusion treats the joint sequence of ``T + S``
tokens as *the* token sequence: its ``M`` patches are contiguous runs of it
(:func:`~hfpatch.patches.pipefusion.layout.patch_ranges` over ``T + S``), so the text tokens fall into the
first patch(es) and, when ``T`` is large, a patch holds the last text tokens and the first image tokens; a
patch carries its text part and image part together (one point-to-point message of ``[B, tokens, C]``), and
every attention keeps one K/V buffer of the ``T + S`` rows. The alternatives were weighed:

* *Text with every patch* (each patch recomputes all ``T`` text tokens beside its ``S / M`` image tokens):
  ``M`` times the text compute and hand-off bytes per call (for Flux.1 at 1024^2, ``T = 512`` and
  ``S = 4096``: at ``M = 8`` the text would be as much work as the image), and ``M`` divergent copies of the
  text stream of which one would have to be chosen.
* *Text with the first patch* (text prefix, image cut into ``M`` equal parts): the same arithmetic as the
  design taken when ``T`` is below one patch, but the first patch then carries ``T + S / M`` tokens, a
  pipeline stall of ``T`` tokens per stage per call. Cutting the joint sequence balances the patches.

With the text first, every image patch of a pipelined call attends to *fresh* text K/V (computed in this call,
by the first patch), and the text queries see fresh K/V of their own patch and stale K/V of the later
patches: the only approximation is, as for Wan, stale K/V of patches not yet passed through a layer. Compute
and hand-off bytes per call equal the synchronous ones (``[B, T + S, C]`` per stage boundary). (xDiT's own Flux
pipeline refuses its asynchronous PipeFusion loop, "Async pipeline not supported in flux", and runs Flux with
the stages synchronous only.)

**With Ulysses/Ring** (``ParallelConfig(pipefusion=P, ulysses=U, ring=R)``, as for Wan: each stage is the ``U x R``
ranks of an sp group, each rank runs its shard of every patch and hands it to the same sp rank of the next
stage). Each patch of the joint sequence is padded at its end to a multiple of ``U x R`` and cut into equal
shards (:class:`~hfpatch.patches.pipefusion.layout.SequenceShardLayout` over the ``T + S`` tokens). A shard is
a contiguous run of the joint sequence (padding repeats the patch's last token), so it is its text rows then
its image rows: the stage runner splits it at its text count into the dual-stream blocks' two inputs (either
part may be empty), the rotary table is cut by the same rows, and the joint attention goes through the shared
:func:`~hfpatch.patches.pipefusion.state.sequence_parallel_attention` (the K/V buffer sharded by ring block and
head, padding keys masked out). Sequence parallel is exact: the output equals Flux PipeFusion alone up to
reassociation. The last stage's sp ranks all-gather the joint sequence and return its text and image parts.
(Alternatives weighed: sharding a patch's text and image parts separately, each padded, gives the same
exactness with more padding; replicating the text over the sp ranks costs the text compute ``U x R`` times.)

Refused before any communication: ControlNet residuals (added between blocks, possibly on another stage), an
``attention_mask`` in ``joint_attention_kwargs``, and non-stock attention processors (IP-Adapter) at apply.

>>> from hfpatch.patches.pipefusion.flux import FluxPipeFusion
>>> from hfpatch.testing import tiny_flux_transformer
>>> FluxPipeFusion().facts(tiny_flux_transformer(num_layers=2, num_single_layers=3)).num_blocks
5
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
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

__all__ = [
    "FluxPipeFusion",
    "PipeFusionFluxAttnProcessor",
    "apply_flux_pipefusion",
    "block_bytes",
    "flux_blocks",
]


def flux_blocks(model: Any) -> list[torch.nn.Module]:
    """``transformer_blocks + single_transformer_blocks``: the blocks in the order the stages cut them."""
    return [*model.transformer_blocks, *model.single_transformer_blocks]


def block_bytes(block: torch.nn.Module) -> int:
    """Parameter bytes of a block (from shapes and dtypes: the same on every rank, before any release)."""
    return sum(p.numel() * p.element_size() for p in block.parameters())


def _describe(model: Any, indices: list[int]) -> str:
    """Global block indices -> ``"FluxTransformer2DModel.transformer_blocks 0-1, .single_transformer_blocks 0"``."""
    dual = len(model.transformer_blocks)
    parts = []
    if first := [i for i in indices if i < dual]:
        parts.append(f"transformer_blocks {block_spans(first)}")
    if second := [i - dual for i in indices if i >= dual]:
        parts.append(f"single_transformer_blocks {block_spans(second)}")
    return f"{type(model).__name__}." + ", ".join(parts)


# ----------------------------------------------------------------------------------------------- attention
class PipeFusionFluxAttnProcessor(PipeFusionAttnProcessor):
    """Flux joint attention of a block of this stage (dual- or single-stream), over the stage's K/V buffer.

    The patch's queries are the joint-sequence tokens ``call.current`` (its text part then its image part,
    as the stock processor concatenates them); its fresh keys and values (after the norms and rotary)
    overwrite those rows of the buffer of ``T + S`` rows, and the queries attend to the whole buffer
    (:meth:`~hfpatch.patches.pipefusion.PipeFusionAttnProcessor.attend`; under sequence parallel this rank's
    joint rows, text first). Warm-up: the stock computation on the whole sequence, op for op, storing K/V.
    ``layer`` is the global index of the block (``transformer_blocks`` then ``single_transformer_blocks``).
    """

    _parallel_config = None

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

        call = self.current_call(f"{self.state.name} block {self.layer} attention")
        if attention_mask is not None:
            raise ValueError("PipeFusion on Flux does not support an attention_mask (joint_attention_kwargs)")
        # The stock FluxAttnProcessor, op for op (warm-up calls must equal it bit for bit).
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query = query.unflatten(-1, (-1, attn.head_dim))
        key = key.unflatten(-1, (-1, attn.head_dim))
        value = value.unflatten(-1, (-1, attn.head_dim))
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        if attn.added_kv_proj_dim is not None:
            encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
            encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            encoder_query = attn.norm_added_q(encoder_query)
            encoder_key = attn.norm_added_k(encoder_key)
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        if image_rotary_emb is not None:  # the rows of this patch (sliced by the stage runner)
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        hidden = self.attend(call, query, key, value)
        hidden = hidden.flatten(2, 3)
        hidden = hidden.to(query.dtype)
        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            encoder_out, hidden = hidden.split_with_sizes([text, hidden.shape[1] - text], dim=1)
            hidden = attn.to_out[0](hidden.contiguous())
            hidden = attn.to_out[1](hidden)
            encoder_out = attn.to_add_out(encoder_out.contiguous())
            return hidden, encoder_out
        return hidden


# ----------------------------------------------------------------------------------------------- stage runner
def _slice_rotary(rotary: Any, start: int, end: int) -> Any:
    if rotary is None:
        return None
    if isinstance(rotary, (tuple, list)):
        return type(rotary)(r[start:end] for r in rotary)
    return rotary[start:end]


def _select_rotary(rotary: Any, index: torch.Tensor) -> Any:
    """The rotary table's rows of the joint tokens ``index`` (this rank's local rows)."""
    if rotary is None:
        return None
    if isinstance(rotary, (tuple, list)):
        return type(rotary)(r.index_select(0, index) for r in rotary)
    return rotary.index_select(0, index)


def _flux_stage_runner(state: PipeFusionState, blocks: list[Callable[..., Any]]) -> Callable[..., Any]:
    """Replacement ``forward`` of the first block (``transformer_blocks[0]``): runs this rank's stage
    (``blocks``: the stock forwards of its blocks, of either type) for the whole call, patch by patch over the
    joint ``[text, image]`` sequence, and returns ``(text, image)`` hidden states on the last stage (its inputs,
    placeholders, elsewhere)."""

    def run_stage(
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: Any = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        call = state.call
        if call is None:
            raise RuntimeError(f"{state.name} blocks ran outside a PipeFusion call of the model")
        text = encoder_hidden_states.shape[1]
        rows, sliced = stage_rows(call)
        shard = call.shard
        # the joint token of every row (sorted: a run of rows is its text rows, then its image rows)
        joint: Sequence[int] = range(text + hidden_states.shape[1])
        all_rotary, source = image_rotary_emb, None
        if shard is not None:  # sequence parallel in the stage: this rank's shards of every patch
            joint = shard.layout.local_index
            all_rotary = _select_rotary(image_rotary_emb, shard.local_index)
            if state.is_first:
                source = torch.cat([encoder_hidden_states, hidden_states], dim=1).index_select(
                    1, shard.local_index
                )
        texts: list[torch.Tensor] = []
        images: list[torch.Tensor] = []
        sending: list[dist.Work] = []

        pending = state.recv_rows(hidden_states, rows[0]) if not state.is_first else None
        for index, (start, end) in enumerate(rows):
            own_text = bisect_left(joint, text, start, end) - start  # text rows of this run: its head
            if source is not None:
                txt, img = source[:, start : start + own_text], source[:, start + own_text : end]
            elif state.is_first:
                txt = encoder_hidden_states[:, start : start + own_text]
                img = hidden_states[:, max(start, text) - text : max(end, text) - text]
            else:
                received, works = pending
                if index + 1 < len(rows):  # the next patch arrives while this one computes
                    pending = state.recv_rows(hidden_states, rows[index + 1])
                state.wait(works, "PipeFusion receive")
                txt, img = received[:, :own_text], received[:, own_text:]
            rotary = _slice_rotary(all_rotary, start, end) if sliced else all_rotary
            call.current, call.index = (start, end), index
            for block in blocks:
                txt, img = block(
                    hidden_states=img,
                    encoder_hidden_states=txt,
                    temb=temb,
                    image_rotary_emb=rotary,
                    joint_attention_kwargs=joint_attention_kwargs,
                )
            if state.is_last:
                texts.append(txt)
                images.append(img)
            else:
                state.wait(sending, "PipeFusion send")  # at most one patch in flight
                sending = state.send(torch.cat([txt, img], dim=1), state.stage + 1, HANDOFF)
        state.wait(sending, "PipeFusion send")
        if not state.is_last:
            return encoder_hidden_states, hidden_states  # placeholders: the output comes from the last stage
        if shard is not None:  # the last stage's sp ranks gather the joint sequence for the output layers
            out = gather_stage_output(state, call, [torch.cat(pair, dim=1) for pair in zip(texts, images)])
            return out[:, :text], out[:, text:]
        if len(images) == 1:
            return texts[0], images[0]
        return torch.cat(texts, dim=1), torch.cat(images, dim=1)

    return run_stage


def _passthrough(
    hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replacement ``forward`` of every block but the first: the first one ran the whole stage."""
    return encoder_hidden_states, hidden_states


def _precheck(name: str) -> Callable[[dict[str, Any]], None]:
    def check(named: dict[str, Any]) -> None:
        for key in ("controlnet_block_samples", "controlnet_single_block_samples"):
            if named.get(key) is not None:
                raise ValueError(
                    f"PipeFusion on {name} does not support ControlNet residuals ({key}): they are added between "
                    "blocks that live on different ranks; apply without PipeFusion (ulysses/ring, cfg, data)"
                )
        extra = named.get("joint_attention_kwargs") or {}
        if extra.get("attention_mask") is not None:
            raise ValueError(
                f"PipeFusion on {name} does not support an attention_mask in joint_attention_kwargs"
            )

    return check


# ----------------------------------------------------------------------------------------------- family
class FluxPipeFusion(PatchFamily):
    """PipeFusion for ``diffusers.FluxTransformer2DModel`` (options as
    :class:`~hfpatch.patches.pipefusion.WanPipeFusion`; ``pipefusion_blocks`` counts ``transformer_blocks`` then
    ``single_transformer_blocks``)."""

    name: ClassVar[str] = "flux_pipefusion"
    role: ClassVar[str] = "transformer"
    options: ClassVar[dict[str, Any]] = PIPEFUSION_OPTIONS

    def facts(self, target: Any) -> ModelFacts:
        return ModelFacts(
            num_heads=target.config.num_attention_heads,
            name=type(target).__name__,
            num_blocks=len(flux_blocks(target)),
        )

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        name = type(target).__name__
        if not check_pipefusion_options(
            target, config, options, len(flux_blocks(target)), name, sequence_parallel=True
        ):
            return
        dual = len(target.transformer_blocks)
        for index, block in enumerate(flux_blocks(target)):
            found = type(block.attn.processor).__name__
            if found != "FluxAttnProcessor":
                where = (
                    f"transformer_blocks.{index}"
                    if index < dual
                    else f"single_transformer_blocks.{index - dual}"
                )
                raise ValueError(
                    f"{name}.{where}.attn uses attention processor {found}; PipeFusion replaces only the stock "
                    "FluxAttnProcessor (no IP-Adapter). Restore it (model.set_default_attn_processor() or unload "
                    "the IP-Adapter) before hfpatch.apply"
                )

    def apply(self, target: Any, patch: Patch, mesh: Any, options: dict[str, Any]) -> None:
        if mesh.config.pipefusion == 1:
            return
        apply_flux_pipefusion(target, patch, options=options, **stage_groups(mesh))


def apply_flux_pipefusion(
    target: Any,
    patch: Patch,
    group: Any,
    options: dict[str, Any],
    stages: list[tuple[int, int]] | None = None,
    sp_groups: tuple[Any, Any, Any] = (None, None, None),
    guard: Any = None,
) -> PipeFusionState:
    """Install PipeFusion on a ``FluxTransformer2DModel`` through ``patch`` (what :class:`FluxPipeFusion` does);
    ``group=None`` is the one-process simulation; ``sp_groups`` and ``guard`` as in
    :func:`hfpatch.patches.pipefusion.wan.apply_pipefusion`.

    >>> import torch
    >>> from hfpatch.core.patch import Patch
    >>> from hfpatch.testing import tiny_flux_transformer
    >>> model = tiny_flux_transformer()
    >>> g = torch.Generator().manual_seed(0)
    >>> x, text, pooled = torch.randn(1, 16, 16, generator=g), torch.randn(1, 8, 16, generator=g), torch.randn(1, 16)
    >>> ids = {"img_ids": torch.randn(16, 3, generator=g), "txt_ids": torch.zeros(8, 3)}
    >>> with torch.no_grad():
    ...     reference = model(x, text, pooled, torch.tensor([0.9]), **ids).sample
    ...     with Patch("pipefusion") as patch:
    ...         state = apply_flux_pipefusion(model, patch, None, {**FluxPipeFusion.options, "pipefusion_patches": 3})
    ...         warm = model(x, text, pooled, torch.tensor([0.9]), **ids).sample     # warm-up call: exact
    ...         stale = model(x, text, pooled, torch.tensor([0.8]), **ids).sample    # pipelined: stale K/V
    >>> torch.equal(warm, reference), torch.equal(stale, model(x, text, pooled, torch.tensor([0.8]), **ids).sample)
    (True, False)
    """
    name = type(target).__name__
    blocks = flux_blocks(target)
    world = 1 if group is None else dist.get_world_size(group)
    if stages is None:
        counts = options["pipefusion_blocks"] if world > 1 else None
        stages = stage_ranges(len(blocks), world, counts, weights=[block_bytes(b) for b in blocks])
    state = PipeFusionState(
        group, stages, options["pipefusion_patches"] or world, options["pipefusion_warmup"], name, sp_groups
    )
    guard = group if guard is None else guard
    if options["check_inputs"] and guard is not None:
        install_call_guard(patch, target, guard, f"{name}.forward (PipeFusion stages)")
    own = range(state.first, state.end)
    stage_blocks: list[Callable[..., Any]] = []  # the stock forwards of this stage's blocks
    wrap_stage_blocks(patch, blocks, own, _flux_stage_runner(state, stage_blocks), _passthrough, stage_blocks)
    for index in own:
        attention = blocks[index].attn
        backend = getattr(attention.processor, "_attention_backend", None)
        patch.swap_processor(attention, PipeFusionFluxAttnProcessor(state, index, backend))

    def tokens_of(named: dict[str, Any]) -> int:  # the joint sequence: text tokens, then image tokens
        return named["encoder_hidden_states"].shape[1] + named["hidden_states"].shape[1]

    install_model_hooks(target, patch, state, name, tokens_of, _precheck(name))
    if options["pipefusion_release_weights"]:
        release_other_blocks(
            target,
            patch,
            state,
            blocks,
            own,
            ("transformer_blocks", "single_transformer_blocks"),
            lambda indices: _describe(target, indices),
        )
    return state
