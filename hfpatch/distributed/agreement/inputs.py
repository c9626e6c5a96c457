"""The same-input check: the table that describes a call's arguments (:func:`describe_inputs`), its exchange over
the ranks that share one piece of work with the :class:`InputMismatchError` naming what differs
(:func:`check_same_inputs`), and the guard that runs it first in every call of a patched module
(:func:`install_call_guard`). The design notes are :mod:`hfpatch.distributed.agreement`'s, which re-exports the
public names.
"""

from __future__ import annotations

import contextvars
import inspect
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .digests import content_digest, hash_text, to_int64
from .marks import mark_calls
from .weights import WEIGHTS_SLOT, current_watch, weights_mismatch

__all__ = [
    "FIELDS",
    "SLOTS",
    "InputMismatchError",
    "bytes_per_check",
    "check_same_inputs",
    "describe_inputs",
    "install_call_guard",
    "named_arguments",
]

#: Arguments compared one by one (sorted by name); further ones are folded into the last row.
SLOTS = 24
#: Dims of a tensor's shape kept in its row (for the message); the element count covers any further dims.
_DIMS = 6
#: Row layout.
_NAME, _KIND, _NDIM = 0, 1, 2
_SHAPE = slice(3, 3 + _DIMS)
_NUMEL, _VALUE, _HAS_VALUE, _DIGEST_A, _DIGEST_B = range(3 + _DIMS, 8 + _DIMS)
#: ``_HAS_VALUE`` of a generator's row: ``_VALUE`` holds its seed (an int), not a float's bits.
_SEED_VALUE = 2
FIELDS = 8 + _DIMS


class InputMismatchError(ValueError):
    """Ranks that share one computation were given different inputs (raised on every one of them alike)."""


# ----------------------------------------------------------------------------------------------- rows
def _leaves(value: Any, path: str) -> list[tuple[str, Any]]:
    """(path, leaf) pairs of nested tuples, lists and dicts (dict keys sorted)."""
    if isinstance(value, Mapping):
        return [leaf for k in sorted(value, key=str) for leaf in _leaves(value[k], f"{path}[{k!r}]")]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{path}[{i}]")]
    return [(path, value)]


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, torch.Generator):  # per-rank seeds show in the generator state
        return value.get_state()
    if hasattr(value, "__array_interface__") or hasattr(value, "__array__"):  # numpy arrays, PIL images
        try:
            import numpy as np

            return torch.from_numpy(np.ascontiguousarray(np.asarray(value)))
        except Exception:  # not convertible: compared by type only
            return None
    return None


def _scalar_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _leaf_row(value: Any) -> list[int]:
    """Row fields (after the name) of one leaf: kind, ndim, shape, numel, value, has-value, digests."""
    row = [0] * (FIELDS - 1)
    tensor = _as_tensor(value)
    if tensor is not None:
        grad = tensor.requires_grad and torch.is_grad_enabled()
        row[_KIND - 1] = hash_text(f"{type(value).__name__}/{tensor.dtype}/{tensor.device.type}/{grad}")
        row[_NDIM - 1] = tensor.dim()
        shape = [*tensor.shape[:_DIMS], *[-1] * (_DIMS - min(tensor.dim(), _DIMS))]
        row[_SHAPE.start - 1 : _SHAPE.stop - 1] = shape
        row[_NUMEL - 1] = tensor.numel()
        if tensor.numel() == 1 and not tensor.is_complex() and isinstance(value, torch.Tensor):
            row[_VALUE - 1], row[_HAS_VALUE - 1] = _scalar_bits(tensor.item()), 1
        elif isinstance(value, torch.Generator):  # its seed, for the message (the state is what is compared)
            row[_VALUE - 1], row[_HAS_VALUE - 1] = to_int64(value.initial_seed()), _SEED_VALUE
        row[_DIGEST_A - 1], row[_DIGEST_B - 1] = content_digest(tensor)
        return row
    if isinstance(value, (bool, int, float)):
        row[_KIND - 1] = hash_text(type(value).__name__)
        row[_DIGEST_A - 1] = hash_text(value.hex() if isinstance(value, float) else repr(value))  # exact
        try:
            row[_VALUE - 1], row[_HAS_VALUE - 1] = _scalar_bits(value), 1
        except OverflowError:  # an int beyond float range: compared by its digest only
            pass
        return row
    if value is None or isinstance(value, (str, bytes, torch.dtype, torch.device)):
        row[_KIND - 1] = hash_text(type(value).__name__)
        row[_DIGEST_A - 1] = hash_text(repr(value))
        return row
    # Other objects (callbacks, schedulers, modules): only their type is compared.
    row[_KIND - 1] = hash_text(f"{type(value).__module__}.{type(value).__qualname__}")
    return row


def _fold(rows: Sequence[list[int]]) -> list[int]:
    """One row standing for several leaves: shape/value of the first, kinds and digests mixed in order."""
    folded = list(rows[0])
    for i, row in enumerate(rows[1:], start=1):
        for field in (_KIND - 1, _DIGEST_A - 1, _DIGEST_B - 1, _NUMEL - 1):
            folded[field] = to_int64(folded[field] * 0x100000001B3 + row[field] * (2 * i + 1))
    return folded


def describe_inputs(named: Mapping[str, Any]) -> torch.Tensor:
    """The ``(SLOTS, FIELDS)`` int64 table of a call's arguments (CPU); see the module docstring."""
    names = sorted(named)
    table = [[0] * FIELDS for _ in range(SLOTS)]
    groups = [[n] for n in names[: SLOTS - 1]] + ([names[SLOTS - 1 :]] if len(names) >= SLOTS else [])
    for slot, group in enumerate(groups):
        rows = [_leaf_row(leaf) for name in group for _, leaf in _leaves(named[name], name)] or [
            _leaf_row(())
        ]
        table[slot] = [hash_text(group[0] if len(group) == 1 else "+".join(group)), *_fold(rows)]
    return torch.tensor(table, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------- check
def _table_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slot_names(named: Mapping[str, Any]) -> list[str]:
    names = sorted(named)
    return names[: SLOTS - 1] + (["+".join(names[SLOTS - 1 :])] if len(names) >= SLOTS else [])


def _value_text(row: list[int]) -> str:
    if row[_HAS_VALUE] == _SEED_VALUE:  # a generator: its seed says more than its state's shape
        return f"seed {row[_VALUE] & ((1 << 64) - 1)}"
    shape = row[_SHAPE][: min(row[_NDIM], _DIMS)]
    parts = []
    if row[_NDIM] or row[_NUMEL]:
        parts.append(f"shape {tuple(shape)}")
    if row[_HAS_VALUE]:
        parts.append(f"value {struct.unpack('<d', struct.pack('<q', row[_VALUE]))[0]!r}")
    return ", ".join(parts)


def _difference(rows: list[list[int]], rank: int) -> str:
    """What differs between ``rows[rank]`` and ``rows[0]``, in words."""
    first, other = rows[0], rows[rank]
    if first[_NAME] != other[_NAME]:
        return "a different set of arguments"
    if first[_KIND] != other[_KIND]:
        return "another type, dtype, device or requires_grad"
    if first[_NDIM] != other[_NDIM] or first[_SHAPE] != other[_SHAPE] or first[_NUMEL] != other[_NUMEL]:
        return "another shape"
    return "other contents"


def bytes_per_check(world: int) -> int:
    """Bytes one rank sends for one check in a group of ``world`` ranks (all-gather of its table)."""
    return SLOTS * FIELDS * 8 * (world - 1)


def check_same_inputs(
    named: Mapping[str, Any],
    group: Any,
    *,
    what: str,
    enabled: bool = True,
    hint: str = "",
    sources: Collection[str] = (),
) -> None:
    """Raise :class:`InputMismatchError` on every rank of ``group`` unless all passed the same ``named``.

    One ``all_gather`` of :func:`describe_inputs` over ``group`` (fixed size, counted as ``"guard"`` by
    :func:`hfpatch.distributed.collectives.count_comm`); call it before any collective whose shapes depend on
    the inputs. ``what`` names the call in the message (``"WanTransformer3DModel.forward"``), ``hint`` adds
    advice for this kind of call, ``sources`` are the names among ``named`` that the user passed (a pipeline's
    arguments, when ``named`` also holds the transformer arguments computed from them): the message lists them
    first. Inside a call of a module a :class:`WeightWatch` watches, the table has one more row, the weights'
    fingerprint; when it differs, :class:`WeightMismatchError` (naming the tensors) is raised instead. With
    ``enabled=False`` (``hfpatch.apply(..., check_inputs=False)``) nothing is checked or sent.
    """
    if not enabled or group is None or _AGREED.get() or dist.get_world_size(group) == 1:
        return
    from .. import runtime
    from ..collectives.counting import record_sent
    from ..waiting import all_gather_noticed

    watch = current_watch()
    if watch is not None:
        named = {**named, WEIGHTS_SLOT: watch.row()}
    local = describe_inputs(named).to(_table_device(group))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    try:  # logs a notice every HFPATCH_WAIT_NOTICE_S while some ranks have not reached this call
        all_gather_noticed(gathered, local, group, f"the same-input check of {what}")
    except RuntimeError as exc:  # a rank failed, exited or is late: name the check and the group
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error(f"the same-input check of {what}", group, exc) from exc
    record_sent("guard", local.numel() * local.element_size() * (len(gathered) - 1))
    table = torch.stack(gathered).cpu()  # (world, SLOTS, FIELDS)
    differs = (table != table[0]).any(dim=-1)  # (world, SLOTS)
    if not bool(differs.any()):
        return
    names = _slot_names(named)
    ranks = [dist.get_global_rank(group, r) for r in range(table.shape[0])]
    slots = differs.any(dim=0).nonzero().flatten().tolist()
    weights = names.index(WEIGHTS_SLOT) if WEIGHTS_SLOT in names else None
    if weights in slots and bool((table[:, weights, _NAME] == hash_text(WEIGHTS_SLOT)).all()):
        # Every rank watches weights and they differ: every rank names the tensors (a second exchange).
        others = [names[s] for s in slots if s != weights and s < len(names)]
        raise weights_mismatch(watch, group, what, ranks, others)
    order = sorted(slots, key=lambda slot: slot < len(names) and names[slot] not in sources)
    lines = []
    for slot in order:
        name = names[slot] if slot < len(names) else f"argument #{slot}"
        rows = table[:, slot].tolist()
        odd = [r for r in range(len(rows)) if bool(differs[r, slot])]
        detail = "; ".join(
            f"rank {ranks[r]}: {_difference(rows, r)}"
            + (f" ({_value_text(rows[r])})" if _value_text(rows[r]) else "")
            for r in odd
        )
        base = _value_text(rows[0])
        shown = name if name in sources else repr(name)  # a source's name is its label already
        lines.append(f"  {shown}: differs from rank {ranks[0]}{f' ({base})' if base else ''} on {detail}")
    given = [names[s] for s in order if s < len(names) and names[s] in sources]
    if given and len(given) < len(order):
        lines.insert(len(given), "  (the arguments below are computed from those above)")
    raise InputMismatchError(
        f"hfpatch: the ranks {ranks} compute one {what} together, so they must be given identical inputs, "
        "but they were not:\n"
        + "\n".join(lines)
        + "\nUsual causes: a DataLoader or sampler that gives every rank its own batch (shard over the data "
        "axis only: the ranks of one sequence/CFG group need the same samples), random noise or timesteps drawn "
        "from a per-rank RNG state (seed every rank alike, also after resuming from a checkpoint whose RNG state "
        "was saved by rank 0 only), or accelerate's split_between_processes around a patched call. Pass "
        "check_inputs=False to hfpatch.apply only if you have made sure the inputs agree."
        + (f" {hint}" if hint else "")
    )


# ----------------------------------------------------------------------------------------------- helpers
#: True inside a call whose inputs were already checked over a group that contains every group a nested
#: patched call would check (a CFG/data-parallel pipeline's transformer call around its sequence-parallel
#: forward): the nested check is skipped, its ranks slice the same agreed inputs the same way. Checking the
#: widest group first also matters when inputs differ: every rank raises at the same check, instead of one
#: subgroup raising while the others wait for it in a wider one.
_AGREED: contextvars.ContextVar[bool] = contextvars.ContextVar("hfpatch_inputs_agreed", default=False)


def install_call_guard(
    patch: Any,
    module: Any,
    group: Any,
    what: str,
    extra: Callable[[], dict[str, Any]] | None = None,
    deferred_error: Callable[[], BaseException | None] | None = None,
    sources: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Check every call of ``module`` over ``group`` before anything else runs, and mark it agreed.

    A forward pre-hook placed first (before the split hooks of any family) runs :func:`check_same_inputs`
    on the call's arguments plus ``extra()`` (settings read at call time) and ``sources()`` (the arguments the
    user gave the caller, listed first in the message), then sets the agreed mark for the
    rest of the call (nested checks over subgroups are skipped); an always-called forward hook clears it,
    also when the call raises. When the check fails because a peer did not get there
    (:class:`~hfpatch.distributed.runtime.CollectiveError`) and ``deferred_error()`` returns an error this
    rank raised earlier and has not reported yet, that error is raised instead: it is why the peer is late.
    """
    from ..runtime import CollectiveError

    def check_call(args: tuple, kwargs: dict) -> bool:
        named = named_arguments(type(module).forward, (module, *args), kwargs)
        named.pop("self", None)
        if extra is not None:
            named.update(extra())
        given = sources() if sources is not None else {}
        named.update(given)
        try:
            check_same_inputs(named, group, what=what, sources=given.keys())
        except CollectiveError:
            earlier = deferred_error() if deferred_error is not None else None
            if earlier is None:
                raise
            raise earlier  # noqa: B904 - the CollectiveError stays attached as __context__
        return True

    mark_calls(patch, module, _AGREED, check_call)


def named_arguments(function: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """``args``/``kwargs`` of a call of ``function`` by parameter name (``arg0``, ... where unbindable)."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    return dict(bound.arguments)
