"""PipeFusion's per-model state and attention: the streams of K/V buffers, the stage's point-to-point sends, and
the processor base that attends a patch's queries to the stage's K/V buffer (with Ulysses/Ring inside a stage).
The design notes are :mod:`hfpatch.patches.pipefusion.stages`'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...distributed import runtime
from ...distributed.collectives import record_sent, wait_works
from .layout import SequenceShardLayout, patch_ranges

__all__ = ["PipeFusionAttnProcessor", "PipeFusionState", "parameter_bytes"]

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
class PipeFusionCall:
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
        self.call: PipeFusionCall | None = None
        self.released_bytes = 0

    # ------------------------------------------------------------------ calls
    def begin(self, hidden_states: torch.Tensor, timestep: torch.Tensor, tokens: int) -> PipeFusionCall:
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
        self.call = PipeFusionCall(stream, synchronous, [(0, tokens)] if synchronous else ranges)
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
        record_sent(kind, tensor.numel() * tensor.element_size())
        return [work]

    def recv(self, into: torch.Tensor, from_stage: int) -> list[dist.Work]:
        try:
            return [dist.irecv(into, self.peers[from_stage], group=self.group)]
        except RuntimeError as exc:
            if not runtime.is_peer_failure(exc):
                raise
            raise runtime.collective_error("PipeFusion receive", self.group, exc) from exc

    def recv_rows(self, like: torch.Tensor, rows: tuple[int, int]) -> tuple[torch.Tensor, list[dist.Work]]:
        """Post the receive of rows ``start:end`` (dim 1) of the previous stage's hidden states into a new buffer
        of ``like``'s batch, channels, dtype and device; return it with the pending work."""
        start, end = rows
        buffer = like.new_empty((like.shape[0], end - start, like.shape[-1]))
        return buffer, self.recv(buffer, self.stage - 1)

    def wait(self, works: list[dist.Work], what: str) -> None:
        wait_works(works, what, self.group)

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

    def current_call(self, where: str) -> PipeFusionCall:
        """The model call this block runs in; ``where`` names the attention for the error outside one."""
        call = self.state.call
        if call is None:
            raise RuntimeError(
                f"{where} ran outside a PipeFusion call of the model (a block called on its own?): call the "
                "model, whose blocks are split over the PipeFusion ranks"
            )
        return call

    def attend(
        self, call: PipeFusionCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
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


def sequence_parallel_attention(
    state: PipeFusionState,
    call: PipeFusionCall,
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
