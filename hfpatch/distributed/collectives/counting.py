"""The communication counter: :func:`count_comm` opens a :class:`CommCounter` for a block, and every collective
of :mod:`hfpatch.distributed.collectives` (and any other hfpatch code that sends, e.g. PipeFusion's hand-offs and
the same-input check) adds the bytes it sends to each open counter with :func:`record_sent`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["CommCounter", "count_comm", "record_sent"]


@dataclass
class CommCounter:
    """Bytes this rank sent, total and per collective kind (``"all_to_all"``, ``"halo"``, ...)."""

    bytes_sent: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.by_op[op] = self.by_op.get(op, 0) + nbytes
        self.calls[op] = self.calls.get(op, 0) + 1


_COUNTERS: contextvars.ContextVar[tuple[CommCounter, ...]] = contextvars.ContextVar(
    "hfpatch_comm", default=()
)


@contextmanager
def count_comm() -> Iterator[CommCounter]:
    """Count bytes sent by hfpatch collectives on this rank inside the block (nestable).

    >>> from hfpatch.distributed.collectives import count_comm
    >>> with count_comm() as counter:
    ...     pass
    >>> counter.bytes_sent
    0
    """
    counter = CommCounter()
    token = _COUNTERS.set(_COUNTERS.get() + (counter,))
    try:
        yield counter
    finally:
        _COUNTERS.reset(token)


def record_sent(op: str, nbytes: int) -> None:
    """Add ``nbytes`` sent by one call of ``op`` (a collective kind) to every :func:`count_comm` counter open.

    Nothing is counted in code being compiled (Dynamo cannot trace ``ContextVar.get``; counting is a host-side
    aid): the collectives count in their custom ops, which run as in eager mode.

    >>> with count_comm() as counter:
    ...     record_sent("halo", 12)
    >>> counter.by_op, counter.calls
    ({'halo': 12}, {'halo': 1})
    """
    if torch.compiler.is_compiling():  # Dynamo cannot trace ContextVar.get; counting is a host-side aid
        return
    for counter in _COUNTERS.get():
        counter.add(op, nbytes)
