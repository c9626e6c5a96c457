"""Same weights on the ranks that compute one result together: a fingerprint of every parameter and buffer
(:func:`weight_digests`, :func:`fold_digests`) that ``hfpatch.apply`` compares before it patches, the
:class:`WeightMismatchError` naming the tensors that differ, and the :class:`WeightWatch` that keeps the
fingerprint current in every later same-input check of a patched call (the trainable values followed by
:mod:`hfpatch.distributed.agreement.trainable`). The design notes are :mod:`hfpatch.distributed.agreement`'s,
which re-exports the public names.
"""

from __future__ import annotations

import contextvars
import hashlib
import struct
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ..stored import stored_tensors
from .digests import bulk_digest, hash_text, to_int64
from .marks import mark_calls
from .trainable import DIVERGENCE_CAUSES, TrainableWeights, count_optimizer_steps, divergence_note

__all__ = [
    "WEIGHTS_SLOT",
    "WeightMismatchError",
    "WeightWatch",
    "compared_as_files",
    "current_watch",
    "fold_digests",
    "weight_digests",
    "weight_watch_of",
    "weights_mismatch",
    "weights_mismatch_message",
]


class WeightMismatchError(ValueError):
    """Ranks that compute one result together hold different weights (raised on every one of them alike).

    Raised by ``hfpatch.apply`` before anything is patched, and by a patched call after the set of parameters
    changed (an adapter or LoRA added or replaced after ``apply``); the message names the first tensors that
    differ and the ranks that hold them.
    """


#: Columns of a weight row: a hash of the tensor's kind (dtype, shape, whether it holds data), two digests.
_WEIGHT_FIELDS = 3
#: Tensors named in a :class:`WeightMismatchError`; the rest are counted.
_NAMED_TENSORS = 5
#: Odd multiplier combining the digests of a quantized weight's stored tensors, in order.
_MIX = to_int64(0x9E3779B97F4A7C15)


#: Address ranges ``(start, stop)`` of file mappings whose bytes the caller compared over the ranks itself
#: (:func:`compared_as_files`); set only inside that block.
_COMPARED_FILES: contextvars.ContextVar[tuple[tuple[int, int], ...]] = contextvars.ContextVar(
    "hfpatch_compared_files", default=()
)


@contextmanager
def compared_as_files(regions: Sequence[tuple[int, int]]) -> Iterator[None]:
    """Inside the block, tensors whose storages all lie in one of ``regions`` (``(start, stop)`` addresses of
    file mappings) are compared by their kind only, not digested: the caller compared those files' bytes over the
    ranks (``hfpatch.from_pretrained``: the sha256 of every byte of a GGUF file, computed once per node), and a
    digest would read every byte of the mapping on every rank, where each rank keeps only its rows.

    >>> import numpy as np, torch
    >>> array = np.arange(8, dtype=np.float32)
    >>> mapped = torch.from_numpy(array)                       # stands for a view of a mapped file
    >>> start = mapped.data_ptr()
    >>> with compared_as_files([(start, start + array.nbytes)]):
    ...     weight_digests([("", torch.nn.ParameterList([mapped]))])["0"][1:]
    [0, 0]
    """
    token = _COMPARED_FILES.set(tuple(regions))
    try:
        yield
    finally:
        _COMPARED_FILES.reset(token)


def _in_compared_files(parts: Sequence[torch.Tensor]) -> bool:
    regions = _COMPARED_FILES.get()
    if not regions or not parts or any(p.device.type != "cpu" for p in parts):
        return False
    storages = [part.untyped_storage() for part in parts]  # a view's whole storage: inside the file, or not
    return all(
        any(lo <= s.data_ptr() and s.data_ptr() + s.nbytes() <= hi for lo, hi in regions) for s in storages
    )


def _weight_row(tensor: torch.Tensor) -> torch.Tensor:
    """``(3,)`` int64 row of one parameter or buffer, on its device.

    A tensor without data of its own here holds no digest, only its kind: on the meta device (offload hooks
    bring the weights in per call), or a DTensor (FSDP2: each rank holds another shard by design); so does a
    view of a file whose bytes the ranks compared (:func:`compared_as_files`). A quantized
    weight (a tensor subclass: torchao, optimum-quanto, GGUF, bitsandbytes) is digested over what it stores
    (:func:`~hfpatch.distributed.stored.stored_tensors`: its quantized data and scales, in order), its kind and
    layout in the kind hash; an unknown subclass raises
    :class:`~hfpatch.distributed.stored.UnsupportedTensorError`.
    """
    local = not tensor.is_meta and not any(c.__name__ == "DTensor" for c in type(tensor).__mro__)
    text, parts = stored_tensors(tensor) if local else ("", [])
    if local and _in_compared_files(parts):
        local, text = False, f"{text}/file compared"
    kind = hash_text(
        f"{tensor.dtype}/{tuple(tensor.shape)}/{'data' if local else 'no data'}"
        + (f"/{text}" if text else "")
    )
    if not local:
        return torch.tensor([kind, 0, 0], dtype=torch.int64)
    digest = bulk_digest(parts[0])
    for part in parts[1:]:  # in order: a part moved to another place changes the digest
        digest = digest * _MIX + bulk_digest(part).to(digest.device)
    return torch.cat([torch.tensor([kind], dtype=torch.int64, device=digest.device), digest])


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


#: The open watches (their tensor caches forget a parameter or buffer as it is replaced).
_OPEN: list[WeightWatch] = []


def _count_registration(*_: Any) -> None:
    _REGISTRATIONS[0] += 1


def _count_tensor(slot: str) -> Any:
    """A registration hook that counts, and makes every open watch forget the tensor the new one replaces (the
    hook runs before the module's slot is assigned), so a watch never keeps a replaced weight alive."""

    def hook(module: torch.nn.Module, name: str, *_: Any) -> None:
        _REGISTRATIONS[0] += 1
        old = getattr(module, slot, {}).get(name)
        if old is not None:
            for watch in _OPEN:
                watch.forget(old)

    return hook


def _watch_registrations(on: bool) -> None:
    """Count registrations while at least one :class:`WeightWatch` is open (reference-counted)."""
    from torch.nn.modules import module as torch_module

    _LIVE_WATCHES[0] += 1 if on else -1
    if on and not _REGISTRATION_HOOKS:
        _REGISTRATION_HOOKS.extend(
            [
                torch_module.register_module_parameter_registration_hook(_count_tensor("_parameters")),
                torch_module.register_module_buffer_registration_hook(_count_tensor("_buffers")),
                torch_module.register_module_module_registration_hook(_count_registration),
            ]
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
    version counters moved (:class:`~hfpatch.distributed.agreement.trainable.TrainableWeights`),
    so ranks that stepped on partial gradients (no DDP, no ``all_reduce_gradients``) are refused at the next
    patched call. Frozen tensors changed in place (``load_state_dict``) are not re-digested. Deleting a submodule (``del``, peft's ``delete_adapter``) registers nothing: it is seen at the next
    registration.

    The watch keeps the tensors it digested (strong references, so that an ``id`` is never taken for another
    tensor's), never weak references: ``model.to()`` swaps a tensor subclass's parameters in place
    (``torch.utils.swap_tensors``: optimum-quanto's, torchao's), which a weak reference forbids. A parameter or
    buffer replaced by a registration is forgotten at once; one deleted without a registration (``del``) is
    released at the next refresh or at ``patch.remove()``.

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
        self.modules = list(modules)
        self.what = what
        self.refreshes = 0  # times the tensors were re-read (tests, benchmarks)
        self._digests: dict[str, list[int]] = {}
        self._tensors: dict[int, tuple[torch.Tensor, list[int]]] = {}  # id(tensor) -> (the tensor, its row)
        self._row: torch.Tensor | None = None
        self._static: list[int] = []  # [tensor count, folded digest] as of the last refresh
        self._live: TrainableWeights | None = None
        self._seen = -1
        self._closed = False
        _watch_registrations(True)
        count_optimizer_steps(True)
        _OPEN.append(self)
        try:
            self._refresh(dict(digests or {}))
        except BaseException:
            self.close()
            raise

    def forget(self, tensor: torch.Tensor) -> None:
        """Drop ``tensor`` from the cache (it is being replaced): its row is digested again if it comes back."""
        self._tensors.pop(id(tensor), None)

    def close(self) -> None:
        """Stop counting registrations for this watch (``patch.remove()`` calls it). Idempotent."""
        if not self._closed:
            self._closed = True
            self._tensors = {}
            if self in _OPEN:
                _OPEN.remove(self)
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
            elif seen is not None and seen[0] is t:  # the same tensor (peft renames wrapped weights)
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
        self._tensors = {id(t): (t, self._digests[n]) for n, t in named}
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
        mark_calls(patch, module, _WATCH, lambda _args, _kwargs: self)
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


def current_watch() -> WeightWatch | None:
    """The :class:`WeightWatch` of the patched call running now (``None`` outside a watched module's call): its
    row joins the same-input table of every check made inside the call."""
    return _WATCH.get()


def weights_mismatch(
    watch: WeightWatch | None, group: Any, what: str, ranks: Sequence[int], others: Sequence[str]
) -> WeightMismatchError:
    """The error of a same-input check of ``what`` whose weights row differs over ``group`` while every rank
    watches weights: a second exchange (every rank's digests and moved tensors) lets every rank name the tensors.
    ``ranks`` are the group's global ranks, ``others`` the inputs that differ too."""
    from .. import runtime

    every: list[Any] = [None] * len(ranks)
    mine = (watch.digests(), watch.moved()) if watch is not None else ({}, set())
    try:
        dist.all_gather_object(every, mine, group=group)
    except RuntimeError as exc:
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error(f"the same-weights check of {what}", group, exc) from exc
    digests = [d for d, _ in every]
    differing = [n for n in set().union(*digests) if any(d.get(n) != digests[0].get(n) for d in digests)]
    when = divergence_note(what, differing, set().union(*(m for _, m in every)), others)
    causes = DIVERGENCE_CAUSES if when is not None else None
    when = when or (
        f" (found at a call of {what}: its parameters changed since hfpatch.apply, e.g. an adapter or LoRA "
        "was added" + (f"; the inputs {', '.join(map(repr, others))} differ too" if others else "") + ")"
    )
    return WeightMismatchError(
        weights_mismatch_message(digests, ranks, watch.what if watch is not None else what, when, causes)
    )
