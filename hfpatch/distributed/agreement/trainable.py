"""Trainable weights changed in place after ``hfpatch.apply``: the part of the weight row of
:class:`~hfpatch.distributed.agreement.WeightWatch` that follows an optimizer step.

Under sequence parallelism each rank's ``backward()`` gives only its share of a weight's gradient (each rank
holds a part of the tokens). A training loop that steps the optimizer without DDP (or accelerate, which wraps
in DDP) and without ``hfpatch.all_reduce_gradients`` steps every rank on its own partial gradient: the replicas
of the trainable weights drift apart, and the next patched calls compute with different weights on the ranks
of one group, silently. :class:`TrainableWeights` keeps a digest of the VALUES of every parameter that requires
grad in the row the ranks already compare at each patched call, so the next patched call after the step that
diverged them raises :class:`~hfpatch.distributed.agreement.WeightMismatchError` on every rank alike.

When the values are digested again: when a trainable parameter's version counter or data pointer moved (an
optimizer step, a hand-written update, ``load_state_dict``, ``.to()``), looked at in a call with grad enabled (a
training forward) and at the first patched call after any ``torch.optim.Optimizer`` stepped (torch's global
optimizer step hook counts the steps). Only the parameters that moved are digested, so ranks holding different
blocks by design (PipeFusion) agree until a weight moves; the parameters an optimizer stepped count as moved
even when it did not bump their version counters (fused AdamW, 8-bit optimizers writing through raw pointers). A call under
``torch.no_grad()`` with no step since costs one integer comparison, as before; a training forward reads the
version counters (tens of nanoseconds per parameter). The trainable parameters are digested by
:func:`values_digest`: small ones concatenated into chunks of :data:`CHUNK_BYTES`, each chunk and each tensor of
:data:`DIRECT_BYTES` or more by :func:`~hfpatch.distributed.agreement.digests.bulk_digest` on its device (a read of the trainable
weights once per optimizer step: a LoRA's adapters, or a full fine-tune's weights). The digest is of the values,
so ranks that changed their weights alike (an optimizer step on an all-reduced gradient, a ``load_state_dict``
of the same file on some ranks only) still agree. Not seen: parameters that do not require grad (in-place
changes of those are not re-read, as before), and a hand-written update followed only by ``no_grad`` calls
until the next training forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..stored import storage_stamp, stored_tensors
from .digests import bulk_digest, hash_text, to_int64

__all__ = [
    "CHUNK_BYTES",
    "DIVERGENCE_CAUSES",
    "TrainableWeights",
    "count_optimizer_steps",
    "divergence_note",
    "values_digest",
]

#: Trainable tensors smaller than :data:`DIRECT_BYTES` are concatenated (as bytes) into chunks of about this
#: size (one digest per chunk instead of a few kernels per tiny tensor); larger ones are digested in place.
CHUNK_BYTES = 1 << 25
DIRECT_BYTES = 1 << 20
_MIX = to_int64(0x9E3779B97F4A7C15)  # odd: combining chunk digests in order


# Optimizer steps in this process (torch's global step post-hook, on while a WeightWatch lives), and the step
# that last stepped each parameter (by id): fused and 8-bit optimizers write without bumping version counters.
_STEPS = [0]
_STEPPED_AT: dict[int, int] = {}
_STEP_HOOK: list[Any] = []
_USERS = [0]


def _count_step(optimizer: Any, *_: Any) -> None:
    _STEPS[0] += 1
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            _STEPPED_AT[id(parameter)] = _STEPS[0]


def count_optimizer_steps(on: bool) -> None:
    """Count the steps of every ``torch.optim.Optimizer`` while at least one watch is open (reference-counted)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _USERS[0] += 1 if on else -1
    if on and not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(_count_step))
    elif not on and _USERS[0] == 0 and _STEP_HOOK:
        _STEP_HOOK.pop().remove()
        _STEPPED_AT.clear()


def _has_data(tensor: torch.Tensor) -> bool:
    """A tensor whose values are here: not meta (offloaded), not a DTensor shard (FSDP2), not an inference
    tensor (no version counter)."""
    return (
        not tensor.is_meta
        and not any(c.__name__ == "DTensor" for c in type(tensor).__mro__)
        and not tensor.is_inference()
    )


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def _plain(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The plain tensors that hold the data of ``tensors``, in order (a quantized weight's inner data and scales:
    :func:`~hfpatch.distributed.stored.stored_tensors`)."""
    return [part for tensor in tensors for part in stored_tensors(tensor)[1]]


def values_digest(tensors: Sequence[torch.Tensor]) -> tuple[int, int]:
    """Two 64-bit digests of the values of ``tensors`` in order (their bytes, end to end).

    >>> import torch
    >>> a, b = torch.arange(5.0), torch.ones(3, dtype=torch.bfloat16)
    >>> values_digest([a, b]) == values_digest([a.clone(), b.clone()]), values_digest([a, b]) == values_digest([b, a])
    (True, False)
    """
    acc: torch.Tensor | None = None
    pending: list[torch.Tensor] = []

    def add(digest: torch.Tensor) -> None:
        nonlocal acc
        acc = digest if acc is None else acc.to(digest.device) * _MIX + digest

    def flush() -> None:
        if pending:
            size = sum(p.numel() for p in pending)
            pad = pending[0].new_zeros((-size) % 8)
            add(bulk_digest(torch.cat([*pending, pad]).view(torch.int64)))
            pending.clear()

    for tensor in _plain(tensors):
        raw = _bytes(tensor)
        if pending and (raw.device != pending[0].device or sum(p.numel() for p in pending) >= CHUNK_BYTES):
            flush()
        if raw.numel() >= DIRECT_BYTES:
            flush()
            add(bulk_digest(tensor))
        else:
            pending.append(raw)
    flush()
    if acc is None:
        return 0, 0
    a, b = acc.tolist()
    return a, b


class TrainableWeights:
    """The values of the parameters among ``named`` that require grad, digested again only when one moved.

    Args:
        named: ``(name, parameter)`` pairs in a fixed order (the same on every rank).
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.named = [(n, t) for n, t in named if _has_data(t)]
        self._ids = [(n, id(t)) for n, t in self.named]
        self.digests = 0  # times the trainable values were digested (tests, benchmarks)
        self.moved: set[str] = set()  # names changed in place since this object was made
        self._stamps: list[tuple[int, ...]] | None = None
        self._steps = -1
        self.value = (0, 0)
        self.update()

    def same_tensors(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether ``named`` holds the same tensor objects under the same names as this one follows."""
        return self._ids == [(n, id(t)) for n, t in named if _has_data(t)]

    def _current(self) -> tuple[list[int], list[tuple[int, ...]]]:
        live = [i for i, (_, t) in enumerate(self.named) if t.requires_grad and not t.is_meta]
        return live, [(i, *storage_stamp(self.named[i][1])) for i in live]

    def update(self) -> bool:
        """Digest the trainable values that moved again if an optimizer stepped since the last look, or (in a
        call with grad enabled) a trainable parameter's version counter or data pointer moved; True if it did.

        Only the parameters that moved here since this object was made are digested (with their names): the
        ranks compare what training changed, so ranks that hold different blocks by design (PipeFusion's stages
        release the others to ``meta``) agree until a weight moves, and a weight that moved on some ranks only
        (a step on a partial gradient moves the values everywhere, but differently) is named.
        """
        stepped = _STEPS[0] != self._steps
        if not stepped and not torch.is_grad_enabled() and self._stamps is not None:
            return False
        live, stamps = self._current()
        if stamps == self._stamps and not stepped:
            return False
        if self._stamps is not None:
            before = set(self._stamps)
            self.moved.update(self.named[s[0]][0] for s in stamps if s not in before)
            # stepped by an optimizer since the last look, whether or not it bumped the version counter
            self.moved.update(n for n, t in self.named if _STEPPED_AT.get(id(t), -1) > self._steps)
        self._stamps, self._steps = stamps, _STEPS[0]
        moved = [i for i in live if self.named[i][0] in self.moved]
        if not moved:
            return False
        a, b = values_digest([self.named[i][1] for i in moved])
        which = hash_text(",".join(self.named[i][0] for i in moved))  # which parameters moved, too
        self.value = (to_int64(a * 0x100000001B3 + which), b)
        self.digests += 1
        return True


def divergence_note(
    what: str, differing: Sequence[str], moved: set[str], others: Sequence[str]
) -> str | None:
    """The sentence of a :class:`~hfpatch.distributed.agreement.WeightMismatchError` whose ``differing``
    tensors were all changed in place (``moved`` on some rank) since the last look: training made the ranks
    diverge. None when some differing tensor was not (an adapter added per rank: the general message)."""
    if not differing or not set(differing) <= moved:
        return None
    inputs = f"; the inputs {', '.join(map(repr, others))} differ too" if others else ""
    return (
        f" (found at a call of {what}: they were changed in place since the last patched call, e.g. by an "
        f"optimizer step, and now differ across the ranks{inputs})"
    )


#: The causes that follow a :func:`divergence_note`.
DIVERGENCE_CAUSES = (
    "Usual cause: a training loop that steps the optimizer on each rank's own gradient. With sequence "
    "parallelism each rank's backward() gives only its share of the weight gradients: wrap the model in "
    "torch.nn.parallel.DistributedDataParallel (accelerate's prepare() does), or call "
    "hfpatch.all_reduce_gradients(model) after backward() and before optimizer.step(), on every rank. Otherwise: "
    "a load_state_dict or an in-place edit of the weights on some ranks only."
)
