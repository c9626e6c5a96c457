"""This rank's place in a DiT's sequence split and the geometry of the current call (:class:`SequenceShard`): the
split, joint split and gather that every hook of a sequence plan (:mod:`hfpatch.patches.dit.sequence_parallel`,
which re-exports it) and every routed attention of the model go through. Layout: :mod:`hfpatch.attention.layout`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...attention.layout import shard_len, shard_sequence
from ...distributed.collectives import all_gather
from ...distributed.gradients import grad_scaled_by_group
from .streams import ReplicatedStreams

__all__ = ["SequenceShard"]


class SequenceShard:
    """This rank's place in the sequence split, plus the geometry of the current forward call.

    One instance per patched model, shared by its hooks and attention processors. ``valid_len`` (real
    tokens in the full sequence) and ``local_len`` (tokens per shard, padding included) are set by the
    first split of each forward and checked by every later one, so a plan that cuts two tensors of
    different lengths fails loudly instead of mis-aligning them. Gradient checkpointing is fine (a
    recomputed block re-cuts the same shard), as long as no forward of another length runs between a
    forward and its backward.

    Attributes:
        group: The ``sp`` process group (ring x ulysses).
        ulysses_group, ring_group: Groups passed to ``usp_attention`` (``None`` for degree 1).
        rank, world: Index in ``group`` (= shard index) and its size.
        exchange: How the Ulysses exchange runs (:class:`hfpatch.attention.exchange.ExchangeConfig`; ``None``:
            exact and blocking), the ``exchange=`` option of ``hfpatch.apply``.
    """

    def __init__(self, group: Any, ulysses_group: Any, ring_group: Any, exchange: Any = None) -> None:
        self.group = group
        self.ulysses_group = ulysses_group
        self.ring_group = ring_group
        self.exchange = exchange
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.valid_len: int | None = None
        self.local_len: int | None = None
        #: (attention path, call index) -> replicated text tokens its joint attention took in this call (a
        #: stand-in that splits its query by ``local_len`` checks a recompute, or a stale-geometry call, against it).
        self.text_len: dict[Any, int] = {}
        #: What this call computes whole on every rank, and where it enters the shard (:mod:`.streams`).
        self.streams = ReplicatedStreams(group)

    def begin(self) -> None:
        """Forget the previous call's geometry (a new forward may have another sequence length)."""
        self.valid_len = None
        self.local_len = None
        self.text_len.clear()

    def measure(self, length: int, where: str) -> None:
        """Record (or check) this call's sequence length without cutting anything."""
        if self.valid_len is None:
            self.valid_len = length
            self.local_len = shard_len(length, self.world)
        elif length != self.valid_len:
            raise ValueError(
                f"sequence-parallel plan at {where!r} got a sequence of {length} tokens but this forward "
                f"already split {self.valid_len}; the tensors cut by the plan must share one sequence"
            )

    def split(self, x: torch.Tensor, dim: int, where: str) -> torch.Tensor:
        """This rank's shard of ``x`` along ``dim``, recording (or checking) the sequence length."""
        self.measure(x.shape[dim], where)
        # A copy, not a view: the full tensor (patch embedding output, rotary tables) must be freeable.
        shard = shard_sequence(x, dim, self.world, self.rank).clone()
        self.streams.sharded(shard)
        return shard

    def gather(self, x: torch.Tensor, dim: int, recut: bool = False) -> torch.Tensor:
        """The full, unpadded sequence from every rank's shard (identical on every rank). ``recut``: the plan cuts
        it again later in the forward, so its gradient is not scaled by the group size (see :class:`GatherOutput`)."""
        if self.valid_len is None:
            raise RuntimeError(
                "sequence-parallel gather before any split: the plan has no split on this path"
            )
        # Contiguous and unpadded, as the stock code expects its output (AnyFlow .view()s it): the padding at the end
        # of the last shards is left out as the shards are assembled, never copied in and then cut off.
        full = all_gather(x, dim, self.group, backward="slice", valid=self.valid_len)
        if not recut:
            full = grad_scaled_by_group(full, self.group)
        self.streams.replicated(full)
        return full

    def _joint_parts(self, length: int, sharded: int, joint: str, where: str) -> list[int]:
        if joint not in ("front", "back"):
            raise ValueError(
                f"sequence-parallel plan at {where!r}: joint must be 'front' or 'back', not {joint!r}"
            )
        if self.valid_len is None:
            raise ValueError(
                f"sequence-parallel plan at {where!r}: a joint split/gather needs this call's sequence length, "
                "set by an earlier split of the plan; none ran before it"
            )
        if length < sharded:
            raise ValueError(
                f"sequence-parallel plan at {where!r}: {length} tokens cannot hold the {sharded} sharded ones "
                "of this call"
            )
        return [length - sharded, sharded] if joint == "front" else [sharded, length - sharded]

    def split_joint(self, x: torch.Tensor, dim: int, joint: str, where: str) -> torch.Tensor:
        """Cut the ``valid_len`` sharded tokens of a ``[replicated, sharded]`` (``front``) or ``[sharded,
        replicated]`` (``back``) sequence along ``dim``; the replicated ones stay whole, in place."""
        sizes = self._joint_parts(x.shape[dim], self.valid_len or 0, joint, where)
        first, second = x.split(sizes, dim)
        if joint == "front":
            shard = torch.cat([first, shard_sequence(second, dim, self.world, self.rank)], dim)
        else:
            shard = torch.cat([shard_sequence(first, dim, self.world, self.rank), second], dim)
        self.streams.sharded(shard)
        return shard

    def gather_joint(
        self, x: torch.Tensor, dim: int, joint: str, where: str, recut: bool = False
    ) -> torch.Tensor:
        """Gather the shards of a ``[replicated, shard]`` / ``[shard, replicated]`` sequence (the inverse of
        :meth:`split_joint`; ``recut`` as in :meth:`gather`)."""
        sizes = self._joint_parts(x.shape[dim], self.local_len or 0, joint, where)
        first, second = x.split(sizes, dim)
        if joint == "front":
            full = torch.cat([first, self.gather(second, dim, recut)], dim)
        else:
            full = torch.cat([self.gather(first, dim, recut), second], dim)
        self.streams.replicated(full)
        return full

    def __repr__(self) -> str:
        return f"SequenceShard(rank={self.rank}, world={self.world}, valid_len={self.valid_len})"

    def __deepcopy__(self, memo: dict) -> SequenceShard:
        # A copy's hooks would still close over this shard and its patch: refuse rather than half-work.
        raise TypeError(
            "cannot deepcopy a model patched for sequence parallelism by hfpatch.apply (its hooks and process "
            "groups belong to the patch): copy it (e.g. an EMA model) before hfpatch.apply, or patch.remove() "
            "first and apply to each copy."
        )

    def __reduce__(self):
        self.__deepcopy__({})  # pickling (torch.save(model)) would lose the groups the same way
