"""Autograd-aware collectives with explicit (possibly uneven) split sizes, and a communication counter.

Every collective here has its dual as backward (all-to-all <-> all-to-all with the split sizes swapped,
all-gather <-> reduce-scatter or slice, halo send <-> halo-gradient return), takes ``group=None`` for the
default group, and reports the bytes it sends to every :func:`count_comm` counter that is open, so tests
and benchmarks can compare communication with the analytic minimum.

Shape comments use ``W`` for the group size and ``r`` for this rank's index in the group. As in
torch.distributed, ``group=None`` means the default (world) group; a degree-1 mesh axis (``None`` from
:meth:`hfpatch.distributed.runtime.ParallelMesh.group`) must not be passed here: callers skip the collective.

A collective that fails because another rank failed, exited or timed out (gloo/NCCL timeouts, closed
connections) raises :class:`hfpatch.distributed.runtime.CollectiveError` naming the op and the group, with
the backend's error as its cause. Point-to-point waits on gloo are bounded by the group's timeout
(:func:`hfpatch.distributed.runtime.wait_timeout`).

``torch.compile``: each differentiable collective is one ``torch.library`` custom op (``hfpatch::all_to_all``,
``hfpatch::all_gather``, ``hfpatch::reduce_scatter``, ``hfpatch::all_reduce_mean``) with a fake (shape) function
and its dual registered as its autograd formula, the group passed by name. A compiled graph calls each one as a
single node, with no graph break; it runs the same Python as in eager mode, so the peer-failure errors, the
bounded waits and the byte counts of :func:`count_comm` hold in compiled code too.

The modules, one concept each: :mod:`~hfpatch.distributed.collectives.resharding` (all-to-all),
:mod:`~hfpatch.distributed.collectives.gathering` (all-gather, reduce-scatter),
:mod:`~hfpatch.distributed.collectives.reduction` (all-reduce), :mod:`~hfpatch.distributed.collectives.p2p`
(point-to-point, ring shift), :mod:`~hfpatch.distributed.collectives.halo` (halo exchange), and what they share:
:mod:`~hfpatch.distributed.collectives.counting` (:func:`count_comm`),
:mod:`~hfpatch.distributed.collectives.groups` (group sizes, ranks and names, split sizes) and
:mod:`~hfpatch.distributed.collectives.waits` (peer failures, bounded waits, buffer release). This package
re-exports their public names.
"""

from __future__ import annotations

# Public names outside ``__all__`` (as before the split), imported by name elsewhere in hfpatch: ``as`` marks them
# re-exported.
from .counting import CommCounter, count_comm
from .counting import record_sent as record_sent
from .gathering import all_gather, reduce_scatter
from .groups import ProcessGroup as ProcessGroup
from .groups import even_sizes
from .groups import group_name as group_name
from .groups import resolve_group as resolve_group
from .halo import halo_exchange
from .p2p import PendingP2P, ring_shift, start_p2p
from .reduction import all_reduce_mean as all_reduce_mean
from .reduction import all_reduce_sum
from .resharding import all_to_all
from .waits import wait_works as wait_works

__all__ = [
    "CommCounter",
    "PendingP2P",
    "all_gather",
    "all_reduce_sum",
    "all_to_all",
    "count_comm",
    "even_sizes",
    "halo_exchange",
    "reduce_scatter",
    "ring_shift",
    "start_p2p",
]
