"""PipeFusion for ``WanTransformer3DModel``: the blocks split over ranks, the tokens pipelined as patches.

The machinery shared with :mod:`hfpatch.patches.pipefusion.flux` (Flux's two block lists and joint text/image
sequence) lives here too: :class:`PipeFusionState`, :func:`check_pipefusion_options`,
:func:`install_model_hooks`, :func:`wrap_stage_blocks`, :func:`release_other_blocks`.

After ``hfpatch.apply(pipe, parallel=ParallelConfig(pipefusion=P), pipefusion_patches=M,
pipefusion_warmup=W)`` on every rank of a ``P``-rank group (xDiT's PipeFusion, arXiv 2405.14430):

* **Stages.** Rank ``p`` of the ``pipefusion`` group holds the blocks of stage ``p``
  (:func:`~hfpatch.patches.pipefusion.layout.stage_ranges`: contiguous, as even as possible, or
  ``pipefusion_blocks=(n0, n1, ...)``). The other blocks' parameters are released to the ``meta`` device
  (``pipefusion_release_weights=True``, the default): each rank keeps ``1/P`` of the block weights plus the
  unsplit embeddings, norms and output projection. Every rank runs the stock model around the blocks (patch
  and condition embeddings, rotary tables: every stage needs them).
* **Warm-up** (the first ``W`` calls of each stream, see below): synchronous and exact. Stage 0 runs its
  blocks on the whole sequence and sends the hidden states to stage 1, and so on; every self-attention
  stores its full K/V in the stage's per-layer buffer.
* **Pipelined calls** (after the warm-up): the tokens are cut into ``M`` contiguous patches
  (:func:`~hfpatch.patches.pipefusion.layout.patch_ranges`). Stage ``p`` runs patch ``m`` through its
  blocks as soon as stage ``p - 1`` sent it, then sends it on (point-to-point, one patch of hidden states
  per boundary). Each self-attention writes the patch's fresh K/V into its buffer and attends to the whole
  buffer: fresh K/V for the patches this call already passed through the layer, the previous call's K/V
  ("stale", the diffusion model's temporal redundancy) for the others. Cross-attention, norms, modulation
  and the MLP are per token, hence exact. This is the only approximation of PipeFusion, so its error
  grows with ``M`` and shrinks with ``W`` (README: measured PSNR).
* **Output.** The last stage sends the model output to every other rank of its group: every rank returns
  the full output.

Streams: K/V buffers and warm-up counts are kept per ``cache_context`` name (``WanPipeline`` calls the
model in ``"cond"`` then ``"uncond"``: two streams) and per input shape. A stream starts over (empty
buffers, warm-up again) when a new generation begins: the ``step_index`` of the pipeline's
``cache_context`` is not above the last one, or, without it, the timestep does not decrease. So the
first ``W`` calls of every stream are exact, a Wan 2.2 ``transformer_2`` warms up when it takes over, and
``W`` >= the number of steps gives the unpatched output.

With Ulysses/Ring (``ParallelConfig(pipefusion=P, ulysses=U, ring=R)``, xDiT's hybrid): each stage is the
``U x R`` ranks of an ``sp`` group (the mesh puts ``pipefusion`` outside ``ring`` and ``ulysses``, so the
``pipefusion`` group links the same sp rank of every stage). Each patch is padded at its end to a multiple of
``U x R`` and cut into equal shards (:class:`~hfpatch.patches.pipefusion.layout.SequenceShardLayout`); a
rank runs its shard of every patch and hands it to the same sp rank of the next stage. Self-attention
(:func:`sequence_parallel_attention`): a Ulysses all-to-all to heads, a K/V buffer holding this rank's heads of
its ring block of every patch, Ring passes of that buffer, the inverse all-to-all (xDiT: its long-context
attention with a per-patch K/V cache). Sequence parallel is exact: the output equals PipeFusion alone. The
last stage's sp ranks all-gather the sequence for the output layers. (The sequence-parallel families stand
aside when ``pipefusion > 1``: this one runs the sequence parallelism.) Flux shards its joint ``[text, image]``
patches the same way (:mod:`hfpatch.patches.pipefusion.flux`).

Unlike xDiT's engine, which rewrites the denoising loop to run the scheduler patch by patch, hfpatch keeps
the stock pipeline loop: the pipeline fills and drains at every transformer call, a bubble of ``P - 1`` of
``M + P - 1`` patch slots per call (xDiT: ``P - 1`` of ``M * steps + P - 1``). The weights split and the
point-to-point volume (one ``[B, S, C]`` tensor per boundary per call) are the same.

Inference only: a call with gradients enabled or in training mode raises before any communication.

>>> import hfpatch
>>> from hfpatch.testing import tiny_wan_transformer
>>> from hfpatch.patches.pipefusion import WanPipeFusion
>>> sorted(WanPipeFusion.options)
['check_inputs', 'pipefusion', 'pipefusion_blocks', 'pipefusion_patches', 'pipefusion_release_weights', 'pipefusion_warmup']
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ...core.config import ModelFacts, ParallelConfig
from ...core.patch import Patch
from ...core.registry import PatchFamily
from ...distributed import runtime
from ...distributed.agreement import install_call_guard, named_arguments
from ...distributed.collectives import _record, _wait, all_gather
from .layout import SequenceShardLayout, check_stage_counts, patch_ranges, stage_ranges

__all__ = [
    "PIPEFUSION_OPTIONS",
    "PipeFusionState",
    "PipeFusionAttnProcessor",
    "PipeFusionWanAttnProcessor",
    "WanPipeFusion",
    "check_pipefusion_options",
    "parameter_bytes",
]

#: ``count_comm`` kinds: hidden states handed to the next stage, and the output sent by the last stage.
HANDOFF, OUTPUT = "pipefusion", "pipefusion_output"


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers that hold memory (not on ``meta``), shared ones once.

    >>> import torch
    >>> parameter_bytes(torch.nn.Linear(4, 2))   # 8 weights + 2 biases, fp32
    40
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type == "meta":
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.device.index or 0)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total


# ----------------------------------------------------------------------------------------------- state
@dataclass
class _Stream:
    """K/V buffers and warm-up count of one stream (one ``cache_context`` name and input shape)."""

    kv: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # block index -> [key, value] (bshd)
    calls: int = 0  # calls since this generation started
    last_step: int | None = None
    last_timestep: float | None = None


@dataclass
class _Call:
    """The transformer call in progress."""

    stream: _Stream
    synchronous: bool
    patches: list[tuple[int, int]]  # token ranges (one range of every token when synchronous)
    current: tuple[int, int] = (0, 0)  # token range of the patch the blocks are running on
    shard: _ShardIndex | None = None  # with sequence parallel in the stage: where this rank's tokens are
    index: int = 0  # the patch the blocks are running on (pipelined calls)


class _ShardIndex:
    """A :class:`~hfpatch.patches.pipefusion.layout.SequenceShardLayout` with its index tensors on a device."""

    def __init__(self, layout: SequenceShardLayout, device: torch.device) -> None:
        def index(rows: list[int]) -> torch.Tensor:
            return torch.tensor(rows, dtype=torch.long, device=device)

        self.layout = layout
        self.rows = layout.rows
        self.local_rows = layout.local_rows
        self.kv_rows = layout.kv_rows
        self.kv_len = layout.kv_len
        self.local_index = index(layout.local_index)
        self.sync_order = index(layout.sync_order)
        self.global_rows = index(layout.global_rows)
        self.valid_keys = [None if keep is None else index(keep) for keep in layout.valid_keys]


class PipeFusionState:
    """This rank's stage and the state shared by a model's PipeFusion hooks and processors.

    Attributes:
        group: The ``pipefusion`` process group; the stage index is this rank's index in it.
        stages: Block range ``(first, end)`` of every stage.
        patches: ``M``, token patches per pipelined call.
        warmup: ``W``, synchronous calls per stream before pipelining.
        released_bytes: Bytes of parameters and buffers released at apply (0 when kept).
    """

    def __init__(
        self,
        group: Any,
        stages: list[tuple[int, int]],
        patches: int,
        warmup: int,
        name: str,
        sp_groups: tuple[Any, Any, Any] = (None, None, None),
    ):
        self.group = group
        self.stages = stages
        self.patches = patches
        self.warmup = warmup
        self.name = name
        # group None: one stage holding every block (the single-process simulation, see apply_pipefusion)
        self.world = 1 if group is None else dist.get_world_size(group)
        self.stage = 0 if group is None else dist.get_rank(group)
        self.first, self.end = stages[self.stage]
        self.is_first, self.is_last = self.stage == 0, self.stage == self.world - 1
        self.peers = (
            [runtime.rank()] if group is None else [dist.get_global_rank(group, r) for r in range(self.world)]
        )
        # sequence parallel inside the stage (xDiT's hybrid): the sp, ulysses and ring groups of this rank
        self.sp_group, self.ulysses_group, self.ring_group = sp_groups
        self.sp_world = 1 if self.sp_group is None else dist.get_world_size(self.sp_group)
        self.sp_index = 0 if self.sp_group is None else dist.get_rank(self.sp_group)
        self.ulysses = 1 if self.ulysses_group is None else dist.get_world_size(self.ulysses_group)
        self._shards: dict[tuple, _ShardIndex] = {}
        self.streams: dict[tuple, _Stream] = {}
        self.context: tuple[str, int | None] | None = None  # open cache_context: (name, step_index)
        self.call: _Call | None = None
        self.released_bytes = 0

    # ------------------------------------------------------------------ calls
    def begin(self, hidden_states: torch.Tensor, timestep: torch.Tensor, tokens: int) -> _Call:
        """Start a call: pick its stream, decide warm-up or pipelined, cut the patches. Pure per rank (the
        ranks decide alike from alike inputs), so a bad geometry raises on every rank before any send."""
        ranges = patch_ranges(tokens, self.patches)  # also checks that M fits the tokens
        name, step = self.context if self.context is not None else (None, None)
        key = (name, tuple(hidden_states.shape), tokens, hidden_states.dtype, hidden_states.device)
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = _Stream()
        now = float(timestep.detach().max()) if timestep.numel() else 0.0
        if step is not None:
            restart = stream.last_step is None or step <= stream.last_step
        else:
            restart = stream.last_timestep is None or now >= stream.last_timestep
        if restart:
            stream.kv.clear()
            stream.calls = 0
        stream.last_step, stream.last_timestep = step, now
        synchronous = stream.calls < self.warmup or self.patches == 1
        stream.calls += 1
        self.call = _Call(stream, synchronous, [(0, tokens)] if synchronous else ranges)
        if self.sp_world > 1:
            self.call.shard = self.shard_index(tokens, ranges, hidden_states.device)
        return self.call

    def shard_index(self, tokens: int, ranges: list[tuple[int, int]], device: torch.device) -> _ShardIndex:
        """This rank's :class:`_ShardIndex` of ``ranges`` (the call's patches, also in a synchronous call: the
        K/V buffer keeps the pipelined layout)."""
        key = (tokens, len(ranges), device)
        if key not in self._shards:
            layout = SequenceShardLayout(ranges, self.sp_world, self.sp_index, self.ulysses)
            self._shards[key] = _ShardIndex(layout, device)
        return self._shards[key]

    def abort(self) -> None:
        """A call failed midway: its stream's buffers are half-updated, so the stream starts over."""
        if self.call is not None:
            self.call.stream.kv.clear()
            self.call.stream.calls = 0
            self.call.stream.last_step = self.call.stream.last_timestep = None
        self.call = None

    def kv_bytes(self) -> int:
        """Bytes of every K/V buffer this rank holds (all streams)."""
        return sum(
            t.numel() * t.element_size() for s in self.streams.values() for kv in s.kv.values() for t in kv
        )

    def clear(self) -> None:
        """Drop every buffer (``patch.remove()``)."""
        self.streams.clear()
        self.call = None

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: torch.Tensor, to_stage: int, kind: str) -> list[dist.Work]:
        tensor = tensor.contiguous()
        try:
            work = dist.isend(tensor, self.peers[to_stage], group=self.group)
        except RuntimeError as exc:
            if not runtime.is_peer_failure(exc):
                raise
            raise runtime.collective_error("PipeFusion send", self.group, exc) from exc
        _record(kind, tensor.numel() * tensor.element_size())
        return [work]

    def recv(self, into: torch.Tensor, from_stage: int) -> list[dist.Work]:
        try:
            return [dist.irecv(into, self.peers[from_stage], group=self.group)]
        except RuntimeError as exc:
            if not runtime.is_peer_failure(exc):
                raise
            raise runtime.collective_error("PipeFusion receive", self.group, exc) from exc

    def wait(self, works: list[dist.Work], what: str) -> None:
        _wait(works, what, self.group)

    def __repr__(self) -> str:
        sp = f", sp={self.sp_index}/{self.sp_world}" if self.sp_world > 1 else ""
        return (
            f"PipeFusionState(stage={self.stage}/{self.world}, blocks={self.first}..{self.end - 1}, "
            f"patches={self.patches}, warmup={self.warmup}{sp})"
        )

    def __deepcopy__(self, memo: dict) -> PipeFusionState:
        raise TypeError(
            "cannot deepcopy a model patched for PipeFusion by hfpatch.apply (its hooks, K/V buffers and process "
            "group belong to the patch); copy it before hfpatch.apply"
        )


# ----------------------------------------------------------------------------------------------- attention
class PipeFusionAttnProcessor:
    """Base of the PipeFusion processors: the current call of the stage, and attention over its K/V buffer.

    Subclasses compute their family's projections, norms and rotary (op for op as the stock processor, so
    warm-up calls equal it bit for bit), then call :meth:`attend`.

    Args:
        state: The model's :class:`PipeFusionState`.
        layer: Index of the block among the blocks PipeFusion splits.
        backend: The replaced processor's ``_attention_backend`` (kept).
    """

    def __init__(self, state: PipeFusionState, layer: int, backend: Any = None) -> None:
        self.state = state
        self.layer = layer
        self._attention_backend = backend

    def current_call(self, where: str) -> _Call:
        """The model call this block runs in; ``where`` names the attention for the error outside one."""
        call = self.state.call
        if call is None:
            raise RuntimeError(
                f"{where} ran outside a PipeFusion call of the model (a block called on its own?): call the "
                "model, whose blocks are split over the PipeFusion ranks"
            )
        return call

    def attend(
        self, call: _Call, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """``[B, s, H, D]`` attention of this patch's queries (this rank's rows of it under sequence parallel).

        Warm-up stores the whole sequence's K/V; a pipelined call overwrites the patch's rows of the buffer
        with its fresh K/V and attends to the whole buffer (current rows of the patches seen this step, the
        previous step's for the others). Under sequence parallel: :func:`sequence_parallel_attention`.
        """
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if call.shard is not None:
            return sequence_parallel_attention(self.state, call, self.layer, query, key, value)
        if call.synchronous:
            call.stream.kv[self.layer] = [key, value]
        else:
            buffer = call.stream.kv.get(self.layer)
            start, end = call.current
            if buffer is None or buffer[0].shape[1] < end or key.shape[1] != end - start:
                raise RuntimeError(
                    f"PipeFusion: no K/V buffer for block {self.layer} of {self.state.name} (warm-up skipped?)"
                )
            buffer[0][:, start:end] = key
            buffer[1][:, start:end] = value
            key, value = buffer
        return dispatch_attention_fn(
            query, key, value, attn_mask=None, backend=self._attention_backend, parallel_config=None
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer={self.layer}, {self.state!r})"


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


def sequence_parallel_attention(
    state: PipeFusionState,
    call: _Call,
    layer: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> torch.Tensor:
    """Attention of this rank's query rows over the stage's K/V buffer, sharded over the stage's ``sp`` ranks
    (xDiT's hybrid: its long-context attention with a K/V cache per patch).

    ``query``/``key``/``value`` ``[B, rows, H, D]`` are this rank's shards (of the current patch, or of every
    patch in a synchronous call). Ulysses: an all-to-all turns them into this rank's heads of the ring block of
    each patch; the fresh K/V go into their rows of the buffer (a synchronous call writes every row), which
    holds, for this rank's heads, the ring block of every patch. Ring: the buffers travel around the ring
    group, each query block merging its attention over every rank's real (unpadded) keys. The inverse
    all-to-all returns ``[B, rows, H, D]``. The same stale/fresh K/V as PipeFusion without sequence parallel,
    so the result equals it up to float reassociation.
    """
    from ...attention.local import local_attention
    from ...attention.merge import merge_attention
    from ...attention.ulysses import heads_to_sequence, sequence_to_heads
    from ...distributed.collectives import ring_shift

    shard = call.shard
    assert shard is not None
    heads = query.shape[2]
    q, k, v = (sequence_to_heads(t, state.ulysses_group, heads) for t in (query, key, value))
    if call.synchronous:
        buffer = [k.index_select(1, shard.sync_order), v.index_select(1, shard.sync_order)]
        call.stream.kv[layer] = buffer
    else:
        buffer = call.stream.kv.get(layer)
        first, end = shard.kv_rows[call.index]
        if buffer is None or buffer[0].shape[1] != shard.kv_len:
            raise RuntimeError(f"PipeFusion: no K/V buffer for block {layer} (warm-up skipped?)")
        buffer[0][:, first:end] = k
        buffer[1][:, first:end] = v
    del k, v
    group = state.ring_group
    world = 1 if group is None else dist.get_world_size(group)
    me = 0 if group is None else dist.get_rank(group)
    q_h = q.transpose(1, 2)
    out = lse = None
    k_cur, v_cur = buffer
    for step in range(world):
        source = (me - step) % world
        if step < world - 1:  # pass the buffer on before computing with it
            (k_next, v_next), wait = ring_shift([k_cur, v_cur], group)
        keep = shard.valid_keys[source]
        k_blk, v_blk = (k_cur, v_cur) if keep is None else (k_cur[:, keep], v_cur[:, keep])
        if k_blk.shape[1] > 0:
            block = local_attention(q_h, k_blk.transpose(1, 2), v_blk.transpose(1, 2))
            out, lse = merge_attention(out, lse, *block)
        if step < world - 1:
            wait()
            k_cur, v_cur = k_next, v_next
    assert out is not None  # ring rank 0's buffer holds the first token of every patch
    out = out.transpose(1, 2).to(query.dtype)
    return heads_to_sequence(out, state.ulysses_group, heads)


# ----------------------------------------------------------------------------------------------- stage runner
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
        batch, channels = hidden_states.shape[0], hidden_states.shape[-1]
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

        def post_recv(index: int) -> tuple[torch.Tensor, list[dist.Work]]:
            start, end = rows[index]
            buffer = hidden_states.new_empty((batch, end - start, channels))
            return buffer, state.recv(buffer, state.stage - 1)

        pending = post_recv(0) if not state.is_first else None
        for index, (start, end) in enumerate(rows):
            if state.is_first:
                x = source[:, start:end]
            else:
                x, works = pending
                if index + 1 < len(rows):  # the next patch arrives while this one computes
                    pending = post_recv(index + 1)
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


def stage_rows(call: _Call) -> tuple[list[tuple[int, int]], bool]:
    """The row ranges a stage runs one after the other in ``call`` (the patches' tokens; with sequence
    parallel, this rank's local rows: its shard of every patch, all at once when synchronous), and whether
    they are slices (``False``: a synchronous call without sequence parallel runs the stock tensors)."""
    shard = call.shard
    if shard is None:
        return call.patches, not call.synchronous
    return ([(0, shard.rows)] if call.synchronous else shard.local_rows), True


def gather_stage_output(state: PipeFusionState, call: _Call, outputs: list[torch.Tensor]) -> torch.Tensor:
    """The last stage's outputs of every row range, as the whole ``[B, tokens, C]`` sequence in token order:
    concatenated, and with sequence parallel all-gathered over the stage's sp ranks (padding dropped)."""
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    if call.shard is not None:
        out = all_gather(out, 1, state.sp_group).index_select(1, call.shard.global_rows)
    return out


def _passthrough(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Replacement ``forward`` of every block but the first: the first one ran the whole stage."""
    return hidden_states


def _output_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0]
    return out.sample


def _deliver(state: PipeFusionState, out: Any) -> None:
    """The last stage sends the model output to every other stage, which receive it in place."""
    tensor = _output_tensor(out)
    if state.is_last:
        works = [w for peer in range(state.world - 1) for w in state.send(tensor, peer, OUTPUT)]
        state.wait(works, "PipeFusion output send")
        return
    target = (
        tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    )
    state.wait(state.recv(target, state.world - 1), "PipeFusion output receive")
    if target is not tensor:
        tensor.copy_(target)


def _check_inference(model: torch.nn.Module, name: str) -> None:
    if model.training:
        raise RuntimeError(
            f"PipeFusion on {name} is inference only, but the model is in training mode; call model.eval() "
            "(PipeFusion's stale K/V make it approximate, and its blocks live on other ranks)"
        )
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"PipeFusion on {name} is inference only: it does not support backward (blocks live on other ranks, "
            "stale K/V are not differentiable), but gradients are enabled. Run it under torch.no_grad() or "
            "torch.inference_mode() (diffusers pipelines do), or use ulysses/ring for training."
        )


# ----------------------------------------------------------------------------------------------- weights
def _release(modules: list[torch.nn.Module], keep: set[int]) -> int:
    """Replace the parameters and buffers of ``modules`` (those not in ``keep``, by id) by ``meta`` tensors
    of the same shape and dtype. Returns the bytes no longer held by the model."""
    released = 0
    for module in modules:
        for sub in module.modules():
            for store in (sub._parameters, sub._buffers):
                for name, tensor in list(store.items()):
                    if tensor is None or id(tensor) in keep or tensor.device.type == "meta":
                        continue
                    released += tensor.numel() * tensor.element_size()
                    empty = torch.empty_like(tensor, device="meta")
                    if isinstance(tensor, torch.nn.Parameter):
                        empty = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                    store[name] = empty
    return released


# ----------------------------------------------------------------------------------------------- family
#: Options of every PipeFusion family (see :class:`WanPipeFusion`).
PIPEFUSION_OPTIONS: dict[str, Any] = {
    "pipefusion": False,
    "pipefusion_patches": None,
    "pipefusion_warmup": 1,
    "pipefusion_blocks": None,
    "pipefusion_release_weights": True,
    "check_inputs": True,
}


def check_pipefusion_options(
    target: Any,
    config: ParallelConfig,
    options: dict[str, Any],
    num_blocks: int,
    name: str,
    sequence_parallel: bool = False,
) -> bool:
    """The checks every PipeFusion family makes at ``apply`` (pure, so they raise alike on every rank).
    ``sequence_parallel``: whether the family runs Ulysses/Ring inside its stages.

    Returns:
        Whether the plan uses PipeFusion (``config.pipefusion > 1``); the family then checks its processors.
    """
    stages = config.pipefusion
    patches, warmup = options["pipefusion_patches"], options["pipefusion_warmup"]
    blocks, release = options["pipefusion_blocks"], options["pipefusion_release_weights"]
    if stages == 1:
        if options.get("pipefusion"):
            return False  # the planner was allowed PipeFusion and gave it one rank: the options are moot
        given = [
            f"{k}={options[k]!r}"
            for k in ("pipefusion_patches", "pipefusion_blocks")
            if options[k] is not None
        ]
        given += [f"pipefusion_warmup={warmup!r}"] if warmup != 1 else []
        given += [f"pipefusion_release_weights={release!r}"] if release is not True else []
        if given:
            raise ValueError(
                f"{', '.join(given)} configure PipeFusion, but the plan has pipefusion=1; pass "
                "parallel=hfpatch.ParallelConfig(pipefusion=N, ...) (or parallel=N, pipefusion=True) or drop "
                "these options"
            )
        return False
    if patches is not None and (not isinstance(patches, int) or isinstance(patches, bool) or patches < 1):
        raise ValueError(
            f"pipefusion_patches must be a positive int (token patches) or None, got {patches!r}"
        )
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(
            f"pipefusion_warmup must be an int >= 1 (synchronous steps that fill the K/V buffers), got {warmup!r}"
        )
    if not isinstance(release, bool):
        raise ValueError(f"pipefusion_release_weights must be True or False, got {release!r}")
    check_stage_counts(num_blocks, stages, blocks, name)
    if config.sequence_parallel > 1 and not sequence_parallel:
        raise ValueError(
            f"pipefusion={stages} with ulysses={config.ulysses}, ring={config.ring} is not supported for {name} "
            "yet (it is for WanTransformer3DModel and FluxTransformer2DModel); combine PipeFusion with cfg=2 or "
            "data=N, or use "
            "ulysses/ring without PipeFusion"
        )
    if target.training:
        raise ValueError(
            f"PipeFusion is inference only, but {name} is in training mode; call .eval() before hfpatch.apply"
        )
    if any(p.device.type == "meta" for p in target.parameters()):
        raise ValueError(f"{name} has parameters on the meta device (already released?); load it fully first")
    return True


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


def stage_groups(mesh: Any) -> dict[str, Any]:
    """The process groups a PipeFusion install takes from the mesh: ``group`` (the stages), ``sp_groups``
    (sequence parallel inside each stage) and ``guard`` (every rank of the pipeline: same call arguments)."""
    return {
        "group": mesh.group("pipefusion"),
        "sp_groups": (mesh.group("sp"), mesh.group("ulysses"), mesh.group("ring")),
        "guard": mesh.group("pipefusion_sp"),
    }


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
            lambda i: f"{name}.blocks {_spans(i)}",
        )
    return state


def wrap_stage_blocks(
    patch: Patch,
    blocks: list[torch.nn.Module],
    own: range,
    runner: Callable[..., Any],
    passthrough: Callable[..., Any],
    stage_blocks: list[Callable[..., Any]] | None = None,
) -> None:
    """The stock loop calls every block in turn: the first one's ``forward`` becomes ``runner`` (this stage
    for the whole call), the others' ``passthrough``. ``stage_blocks`` (the list ``runner`` reads) gets the
    stock forwards of the blocks in ``own``."""
    originals: dict[int, Callable[..., Any]] = {}

    def wrap_block(index: int) -> Callable[[Callable], Callable]:
        def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
            originals[index] = original
            return runner if index == 0 else passthrough

        return wrapper

    for index, block in enumerate(blocks):
        patch.wrap_method(block, "forward", wrap_block(index))
    if stage_blocks is not None:
        stage_blocks.extend(originals[i] for i in own)


def install_model_hooks(
    target: Any,
    patch: Patch,
    state: PipeFusionState,
    name: str,
    tokens_of: Callable[[dict[str, Any]], int],
    precheck: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Wrap ``target.forward`` (inference check, ``precheck`` of the named arguments, the call's stream and
    patches, the output sent to every rank) and ``cache_context`` (the stream name); clear the buffers at
    ``remove()``. Everything that raises here raises before any communication of the call."""

    def wrap_forward(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            _check_inference(target, name)
            named = named_arguments(type(target).forward, (target, *args), kwargs)
            if precheck is not None:
                precheck(named)
            state.begin(named["hidden_states"], torch.as_tensor(named.get("timestep")), tokens_of(named))
            try:
                out = original(*args, **kwargs)
                _deliver(state, out)
            except BaseException:
                state.abort()
                raise
            state.call = None
            return out

        return forward

    patch.wrap_method(target, "forward", wrap_forward)
    if callable(getattr(target, "cache_context", None)):
        patch.wrap_method(target, "cache_context", _recording_context(state))
    patch.on_remove(target, "pipefusion buffers", state.clear)
    patch.set_attr(target, "_hfpatch_pipefusion", state)


def release_other_blocks(
    target: Any,
    patch: Patch,
    state: PipeFusionState,
    blocks: list[torch.nn.Module],
    own: range,
    containers: tuple[str, ...],
    describe: Callable[[list[int]], str],
) -> None:
    """Release the weights of ``blocks`` outside ``own`` to ``meta`` (keeping every tensor shared with this
    stage's blocks, with the children of ``target`` other than ``containers``, and ``target``'s own
    parameters), and warn at ``remove()`` that they do not come back. ``describe(indices)`` names them."""
    others = [b for i, b in enumerate(blocks) if i not in own]
    if not others:
        return
    keep = {id(t) for i in own for t in (*blocks[i].parameters(), *blocks[i].buffers())}
    keep |= {
        id(t)
        for n, m in target.named_children()
        if n not in containers
        for t in (*m.parameters(), *m.buffers())
    }
    keep |= {id(t) for t in target._parameters.values() if t is not None}
    state.released_bytes = _release(others, keep)
    released = describe([i for i in range(len(blocks)) if i not in own])

    def warn_released() -> None:
        warnings.warn(
            f"hfpatch: PipeFusion released the weights of {released} on this rank "
            f"({state.released_bytes} bytes; they are on the meta device now) and cannot restore them: "
            "patch.remove() restored everything else, but those blocks cannot run. Reload the model to run "
            "it unpatched, or apply with pipefusion_release_weights=False to keep every weight.",
            stacklevel=4,
        )

    patch.on_remove(target, "pipefusion released weights", warn_released)


def _spans(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[str] = []
    for i in indices:
        if spans and int(spans[-1].split("-")[-1]) == i - 1:
            spans[-1] = f"{spans[-1].split('-')[0]}-{i}"
        else:
            spans.append(str(i))
    return ", ".join(spans)


def _recording_context(state: PipeFusionState) -> Callable[[Callable], Callable]:
    """Wrap ``model.cache_context`` so the calls inside it know their stream (name) and ``step_index``."""

    def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        @contextmanager
        def cache_context(name: str, **kwargs: Any) -> Iterator[None]:
            previous, state.context = state.context, (name, kwargs.get("step_index"))
            try:
                with original(name, **kwargs):
                    yield
            finally:
                state.context = previous

        return cache_context

    return wrapper
