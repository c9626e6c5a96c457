"""Same-input guard: the ranks that share one piece of work check that they were given the same inputs.

Sequence parallelism, CFG/data parallelism and the split VAE compute ONE result together, each rank from its
own copy of the inputs. When a user's script feeds the ranks different data (a data loader sharded per rank,
an RNG state restored on rank 0 only, accelerate's ``split_between_processes``), the result is a silent
mixture, or a collective whose shapes disagree aborts in gloo/NCCL. So before the first shape-dependent
collective of a split call, the ranks exchange one fixed-size table (:data:`SLOTS` x :data:`FIELDS` int64,
3.3 KiB per rank) describing every argument of the call, and raise the same :class:`InputMismatchError` on
every rank when the rows differ.

Each argument gets a row: a hash of its name, a hash of its kind (type, dtype, device type, whether it
takes part in autograd), its shape, the exact bits of a scalar value (so the message can print it), and two
64-bit content digests. A digest is ``sum_i w_i * word_i`` in wrapping int64 arithmetic over the tensor's
raw bytes read as integer words, with odd pseudo-random weights ``w_i`` per position. Arithmetic mod 2^64 is
exact and associative, so the digest does not depend on the reduction order or the CPU kernel; an odd weight
is invertible mod 2^64, so a change of any single word (down to one bit) always changes the digest, and a
permutation or a scale of many elements changes it unless two independent 64-bit sums cancel at once. It is
not a cryptographic hash: it guards against scripts that are wrong, not against adversaries.

Weights are checked too (:class:`WeightMismatchError`): ``hfpatch.apply`` compares a fingerprint of every
parameter and buffer over the ranks before it patches anything (:func:`weight_digests`, one row per tensor
from :func:`bulk_digest`, folded into one digest that rides in ``apply``'s handshake), and a
:class:`WeightWatch` adds one row to every later same-input table, so that an adapter or LoRA added after
``apply`` on some ranks only, or initialised per rank, is refused at the next patched call.

>>> import torch
>>> from hfpatch.distributed.agreement import describe_inputs
>>> x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
>>> same = describe_inputs({"x": x, "step": 3})
>>> bool((same == describe_inputs({"x": x.clone(), "step": 3})).all())
True
>>> flipped = x.clone()
>>> flipped.view(torch.int32)[1, 2] ^= 1          # one bit of one element
>>> bool((same == describe_inputs({"x": flipped, "step": 3})).all())
False
"""

from __future__ import annotations

import contextvars
import hashlib
import inspect
import struct
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .agreement_digests import _hash, _to_int64, bulk_digest, content_digest
from .agreement_live import DIVERGENCE_CAUSES, TrainableWeights, count_optimizer_steps, divergence_note

__all__ = [
    "FIELDS",
    "SLOTS",
    "InputMismatchError",
    "WeightMismatchError",
    "WeightWatch",
    "bulk_digest",
    "bytes_per_check",
    "check_same_inputs",
    "content_digest",
    "describe_inputs",
    "install_call_guard",
    "named_arguments",
    "weight_digests",
    "weight_watch_of",
    "weights_mismatch_message",
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


class WeightMismatchError(ValueError):
    """Ranks that compute one result together hold different weights (raised on every one of them alike).

    Raised by ``hfpatch.apply`` before anything is patched, and by a patched call after the set of parameters
    changed (an adapter or LoRA added or replaced after ``apply``); the message names the first tensors that
    differ and the ranks that hold them.
    """


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
        row[_KIND - 1] = _hash(f"{type(value).__name__}/{tensor.dtype}/{tensor.device.type}/{grad}")
        row[_NDIM - 1] = tensor.dim()
        shape = [*tensor.shape[:_DIMS], *[-1] * (_DIMS - min(tensor.dim(), _DIMS))]
        row[_SHAPE.start - 1 : _SHAPE.stop - 1] = shape
        row[_NUMEL - 1] = tensor.numel()
        if tensor.numel() == 1 and not tensor.is_complex() and isinstance(value, torch.Tensor):
            row[_VALUE - 1], row[_HAS_VALUE - 1] = _scalar_bits(tensor.item()), 1
        elif isinstance(value, torch.Generator):  # its seed, for the message (the state is what is compared)
            row[_VALUE - 1], row[_HAS_VALUE - 1] = _to_int64(value.initial_seed()), _SEED_VALUE
        row[_DIGEST_A - 1], row[_DIGEST_B - 1] = content_digest(tensor)
        return row
    if isinstance(value, (bool, int, float)):
        row[_KIND - 1] = _hash(type(value).__name__)
        row[_DIGEST_A - 1] = _hash(value.hex() if isinstance(value, float) else repr(value))  # exact
        try:
            row[_VALUE - 1], row[_HAS_VALUE - 1] = _scalar_bits(value), 1
        except OverflowError:  # an int beyond float range: compared by its digest only
            pass
        return row
    if value is None or isinstance(value, (str, bytes, torch.dtype, torch.device)):
        row[_KIND - 1] = _hash(type(value).__name__)
        row[_DIGEST_A - 1] = _hash(repr(value))
        return row
    # Other objects (callbacks, schedulers, modules): only their type is compared.
    row[_KIND - 1] = _hash(f"{type(value).__module__}.{type(value).__qualname__}")
    return row


def _fold(rows: Sequence[list[int]]) -> list[int]:
    """One row standing for several leaves: shape/value of the first, kinds and digests mixed in order."""
    folded = list(rows[0])
    for i, row in enumerate(rows[1:], start=1):
        for field in (_KIND - 1, _DIGEST_A - 1, _DIGEST_B - 1, _NUMEL - 1):
            folded[field] = _to_int64(folded[field] * 0x100000001B3 + row[field] * (2 * i + 1))
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
        table[slot] = [_hash(group[0] if len(group) == 1 else "+".join(group)), *_fold(rows)]
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
    from . import runtime
    from .collectives import _record
    from .waiting import all_gather_noticed

    watch = _WATCH.get()
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
    _record("guard", local.numel() * local.element_size() * (len(gathered) - 1))
    table = torch.stack(gathered).cpu()  # (world, SLOTS, FIELDS)
    differs = (table != table[0]).any(dim=-1)  # (world, SLOTS)
    if not bool(differs.any()):
        return
    names = _slot_names(named)
    ranks = [dist.get_global_rank(group, r) for r in range(table.shape[0])]
    slots = differs.any(dim=0).nonzero().flatten().tolist()
    weights = names.index(WEIGHTS_SLOT) if WEIGHTS_SLOT in names else None
    if weights in slots and bool((table[:, weights, _NAME] == _hash(WEIGHTS_SLOT)).all()):
        # Every rank watches weights and they differ: every rank names the tensors (a second exchange).
        every: list[Any] = [None] * len(ranks)
        mine = (watch.digests(), watch.moved()) if watch is not None else ({}, set())
        try:
            dist.all_gather_object(every, mine, group=group)
        except RuntimeError as exc:
            if not runtime.is_peer_failure(exc):
                raise
            raise runtime.collective_error(f"the same-weights check of {what}", group, exc) from exc
        others = [names[s] for s in slots if s != weights and s < len(names)]
        digests = [d for d, _ in every]
        differing = [n for n in set().union(*digests) if any(d.get(n) != digests[0].get(n) for d in digests)]
        when = divergence_note(what, differing, set().union(*(m for _, m in every)), others)
        causes = DIVERGENCE_CAUSES if when is not None else None
        when = when or (
            f" (found at a call of {what}: its parameters changed since hfpatch.apply, e.g. an adapter or LoRA "
            "was added" + (f"; the inputs {', '.join(map(repr, others))} differ too" if others else "") + ")"
        )
        raise WeightMismatchError(
            weights_mismatch_message(digests, ranks, watch.what if watch is not None else what, when, causes)
        )
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
    from .runtime import CollectiveError

    tokens: list[contextvars.Token] = []

    def check_call(_module: Any, args: tuple, kwargs: dict) -> None:
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
        tokens.append(_AGREED.set(True))

    def clear_mark(_module: Any, _args: tuple, _kwargs: dict, _output: Any) -> None:
        if tokens:
            _AGREED.reset(tokens.pop())

    patch.add_forward_pre_hook(module, check_call, prepend=True)
    patch.add_forward_hook(module, clear_mark, always_call=True)


def named_arguments(function: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """``args``/``kwargs`` of a call of ``function`` by parameter name (``arg0``, ... where unbindable)."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    return dict(bound.arguments)


# ----------------------------------------------------------------------------------------------- weights
#: Columns of a weight row: a hash of the tensor's kind (dtype, shape, whether it holds data), two digests.
_WEIGHT_FIELDS = 3
#: Tensors named in a :class:`WeightMismatchError`; the rest are counted.
_NAMED_TENSORS = 5


def _weight_row(tensor: torch.Tensor) -> torch.Tensor:
    """``(3,)`` int64 row of one parameter or buffer, on its device.

    A tensor without data of its own here holds no digest, only its kind: on the meta device (offload hooks
    bring the weights in per call), or a DTensor (FSDP2: each rank holds another shard by design).
    """
    local = not tensor.is_meta and not any(c.__name__ == "DTensor" for c in type(tensor).__mro__)
    kind = _hash(f"{tensor.dtype}/{tuple(tensor.shape)}/{'data' if local else 'no data'}")
    if not local:
        return torch.tensor([kind, 0, 0], dtype=torch.int64)
    return torch.cat([torch.tensor([kind], dtype=torch.int64, device=tensor.device), bulk_digest(tensor)])


def _named_tensors(modules: Sequence[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.Tensor]]:
    """(qualified name, tensor) of every parameter and buffer of ``modules``, each tensor once (tied weights
    under their first name); ``prefix.`` names a pipeline's component."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for prefix, module in modules:
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            found.append((f"{prefix}.{name}" if prefix else name, tensor))
    return found


def _rows(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Weight rows of ``tensors``: computed on their devices, brought to the host in one copy per device."""
    rows = [_weight_row(t) for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, row in enumerate(rows):
        by_device.setdefault(row.device, []).append(i)
    out: list[list[int]] = [[]] * len(rows)
    for indices in by_device.values():
        for i, values in zip(indices, torch.stack([rows[i] for i in indices]).tolist()):
            out[i] = values
    return out


def weight_digests(modules: Sequence[tuple[str, torch.nn.Module]]) -> dict[str, list[int]]:
    """Name -> ``[kind, digest a, digest b]`` of every parameter and buffer of ``modules`` (see :func:`bulk_digest`).

    ``modules`` are ``(prefix, module)`` pairs: a model is ``[("", model)]``, a pipeline its components by name.

    >>> import torch
    >>> a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    >>> b.load_state_dict(a.state_dict())
    <All keys matched successfully>
    >>> weight_digests([("", a)]) == weight_digests([("", b)])
    True
    >>> with torch.no_grad():
    ...     b.bias[1] = torch.nextafter(b.bias[1], torch.tensor(9.0))    # one ulp
    >>> [n for n, row in weight_digests([("", b)]).items() if row != weight_digests([("", a)])[n]]
    ['bias']
    """
    named = _named_tensors(modules)
    return dict(zip([n for n, _ in named], _rows([t for _, t in named])))


def fold_digests(digests: Mapping[str, list[int]]) -> str:
    """One hex digest standing for every name and row of ``digests`` (what the ranks compare first)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + struct.pack("<3q", *digests[name]))
    return h.hexdigest()


def weights_mismatch_message(
    every: Sequence[Mapping[str, list[int]]],
    ranks: Sequence[int],
    what: str,
    when: str = "",
    causes: str | None = None,
) -> str:
    """The :class:`WeightMismatchError` text for the per-rank ``weight_digests`` ``every`` (the same on every
    rank); ``when`` follows the first sentence (where the difference was found), ``causes`` replaces the
    usual causes.

    >>> same, other = {"w": [1, 2, 3], "b": [1, 5, 6]}, {"w": [1, 2, 4], "b": [1, 5, 6], "lora_A": [1, 7, 7]}
    >>> print(weights_mismatch_message([same, other], [0, 1], "WanTransformer3DModel").splitlines()[1])
      'lora_A': only on rank 1
    """
    names = sorted(set().union(*every))
    first = every[0]
    lines = []
    differing = 0
    for name in names:
        rows = [d.get(name) for d in every]
        if all(r == rows[0] for r in rows):
            continue
        differing += 1
        if len(lines) >= _NAMED_TENSORS:
            continue
        holders = [ranks[i] for i, r in enumerate(rows) if r is not None]
        if len(holders) < len(rows):
            lines.append(
                f"  {name!r}: only on rank{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))}"
            )
            continue
        odd = [ranks[i] for i, r in enumerate(rows) if r != first.get(name)]
        kind = "another dtype or shape" if any(r[0] != rows[0][0] for r in rows) else "other values"
        lines.append(
            f"  {name!r}: {kind} on rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} than on rank {ranks[0]}"
        )
    more = f"\n  ... and {differing - len(lines)} more" if differing > len(lines) else ""
    return (
        f"hfpatch: the ranks {list(ranks)} compute one result together with {what}, so they must hold the same "
        f"weights, but {differing} of its {len(names)} parameters and buffers differ{when}:\n"
        + "\n".join(lines)
        + more
        + "\n"
        + (causes or _USUAL_CAUSES)
        + " check_inputs=False skips this check."
    )


_USUAL_CAUSES = (
    "Usual causes: a model or adapter initialised on each rank without the same seed (call "
    "torch.manual_seed(seed) before building it or before add_adapter/load_lora_weights, on every rank), "
    "another checkpoint or dtype on some ranks, or an adapter added, loaded or fused on some ranks only."
)


# Registrations of parameters, buffers and submodules in this process (torch's global registration hooks, on
# while a WeightWatch lives): a WeightWatch re-reads its modules only when this moved since its last look.
_REGISTRATIONS = [0]
_REGISTRATION_HOOKS: list[Any] = []
_LIVE_WATCHES = [0]


def _count_registration(*_: Any) -> None:
    _REGISTRATIONS[0] += 1


def _watch_registrations(on: bool) -> None:
    """Count registrations while at least one :class:`WeightWatch` is open (reference-counted)."""
    from torch.nn.modules import module as torch_module

    _LIVE_WATCHES[0] += 1 if on else -1
    if on and not _REGISTRATION_HOOKS:
        _REGISTRATION_HOOKS.extend(
            register(_count_registration)
            for register in (
                torch_module.register_module_parameter_registration_hook,
                torch_module.register_module_buffer_registration_hook,
                torch_module.register_module_module_registration_hook,
            )
        )
    elif not on and _LIVE_WATCHES[0] == 0:
        for handle in _REGISTRATION_HOOKS:
            handle.remove()
        _REGISTRATION_HOOKS.clear()


class WeightWatch:
    """Keeps the weight fingerprint of a patched object current, at almost no cost per call.

    Every same-input check made inside a call of a watched module (:meth:`enter`) gets one more row: the
    fingerprint of every parameter and buffer (:func:`fold_digests`), so the ranks compare weights at each
    patched call with no collective of their own. The fingerprint is cached: a call re-reads the tensors only
    when a parameter, buffer or submodule was registered anywhere in the process since its last look (torch's
    global registration hooks count them: one integer comparison per call otherwise), and digests only the
    tensors that are new or replaced since (an adapter's, a LoRA's). The parameters that require grad are
    also followed when changed in place: their values are digested again after an optimizer step or when their
    version counters moved (:class:`~hfpatch.distributed.agreement_live.TrainableWeights`),
    so ranks that stepped on partial gradients (no DDP, no ``all_reduce_gradients``) are refused at the next
    patched call. Frozen tensors changed in place (``load_state_dict``) are not re-digested. Deleting a submodule (``del``, peft's ``delete_adapter``) registers nothing: it is seen at the next
    registration.

    Args:
        modules: ``(prefix, module)`` pairs to watch (a pipeline's components by name).
        what: The watched object in words, for the error.
        digests: Digests already computed for these tensors (``hfpatch.apply``'s own check), reused.
    """

    def __init__(
        self,
        modules: Sequence[tuple[str, torch.nn.Module]],
        what: str,
        digests: Mapping[str, list[int]] | None = None,
    ) -> None:
        import weakref

        self._weakref = weakref.ref
        self.modules = list(modules)
        self.what = what
        self.refreshes = 0  # times the tensors were re-read (tests, benchmarks)
        self._digests: dict[str, list[int]] = {}
        self._tensors: dict[int, tuple[Any, list[int]]] = {}  # id(tensor) -> (weakref of it, its row)
        self._row: torch.Tensor | None = None
        self._static: list[int] = []  # [tensor count, folded digest] as of the last refresh
        self._live: TrainableWeights | None = None
        self._seen = -1
        self._closed = False
        _watch_registrations(True)
        count_optimizer_steps(True)
        self._refresh(dict(digests or {}))

    def close(self) -> None:
        """Stop counting registrations for this watch (``patch.remove()`` calls it). Idempotent."""
        if not self._closed:
            self._closed = True
            _watch_registrations(False)
            count_optimizer_steps(False)
            for module in [m for m, watch in _WATCHES.items() if watch is self]:
                del _WATCHES[module]

    def _refresh(self, known: Mapping[str, list[int]]) -> None:
        named = _named_tensors(self.modules)
        reuse: dict[str, list[int]] = {}  # rows of tensors digested before, under this name or another one
        stale: list[tuple[str, torch.Tensor]] = []
        for n, t in named:
            seen = self._tensors.get(id(t))
            if n in known:
                reuse[n] = known[n]
            elif seen is not None and seen[0]() is t:  # the same tensor (peft renames wrapped weights)
                reuse[n] = seen[1]
            elif t.is_meta and n in self._digests:  # offloaded for now: its data did not change
                reuse[n] = self._digests[n]
            else:
                stale.append((n, t))
        if stale or len(named) != len(self._digests) or self._row is None:
            reuse.update(zip([n for n, _ in stale], _rows([t for _, t in stale])))
            self._digests = {n: reuse[n] for n, _ in named}
            folded = int.from_bytes(bytes.fromhex(fold_digests(self._digests))[:8], "little", signed=True)
            self._static = [len(self._digests), folded]
            self.refreshes += 1
        self._tensors = {id(t): (self._weakref(t), self._digests[n]) for n, t in named}
        parameters = {id(p) for _, module in self.modules for p in module.parameters()}
        trainable = [(n, t) for n, t in named if id(t) in parameters]
        if self._live is None or not self._live.same_tensors(trainable):
            self._live = TrainableWeights(trainable)
        self._row = None
        self._seen = _REGISTRATIONS[0]

    def row(self) -> torch.Tensor:
        """``[tensor count, folded digest, trainable digests (2)]`` of the watched weights, re-read if anything
        was registered since, the trainable values digested again if one of them moved."""
        if _REGISTRATIONS[0] != self._seen:
            self._refresh({})
        assert self._live is not None
        if self._live.update() or self._row is None:
            self._row = torch.tensor([*self._static, *self._live.value], dtype=torch.int64)
        return self._row

    def digests(self) -> dict[str, list[int]]:
        """Name -> weight row of every watched tensor (as of the last :meth:`row`; the trainable tensors that
        moved since the last refresh digested again)."""
        out = dict(self._digests)
        if self._live is not None and self._live.moved:
            moved = [(n, t) for n, t in self._live.named if n in self._live.moved]
            out.update(zip([n for n, _ in moved], _rows([t for _, t in moved])))
        return out

    def moved(self) -> set[str]:
        """Names of the trainable tensors changed in place since the last refresh."""
        return set(self._live.moved) if self._live is not None else set()

    def enter(self, patch: Any, module: torch.nn.Module) -> None:
        """Make the same-input checks inside every call of ``module`` include this watch (first pre-hook)."""
        tokens: list[contextvars.Token] = []

        def watch_weights(_module: Any, _args: tuple, _kwargs: dict) -> None:
            tokens.append(_WATCH.set(self))

        def unwatch_weights(_module: Any, _args: tuple, _kwargs: dict, _output: Any) -> None:
            if tokens:
                _WATCH.reset(tokens.pop())

        patch.add_forward_pre_hook(module, watch_weights, prepend=True)
        patch.add_forward_hook(module, unwatch_weights, always_call=True)
        _WATCHES[module] = self


#: The weights of the patched call running now (set by :meth:`WeightWatch.enter`).
_WATCH: contextvars.ContextVar[WeightWatch | None] = contextvars.ContextVar("hfpatch_weights", default=None)
#: Module -> the watch its calls carry, until ``patch.remove()`` closes it (:func:`weight_watch_of`).
_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weight_watch_of(module: torch.nn.Module) -> WeightWatch | None:
    """The :class:`WeightWatch` whose fingerprint the patched calls of ``module`` carry (``None`` when none: one
    rank, ``check_inputs=False``, weights sharded by FSDP, or the patch removed). Tests and benchmarks read its
    counters (``refreshes``)."""
    return _WATCHES.get(module)


#: The slot name of the weights row in a same-input table.
WEIGHTS_SLOT = "(weights)"
