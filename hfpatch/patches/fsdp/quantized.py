"""Quantized weights under ``shard_weights``: each rank keeps 1/N of the QUANTIZED rows, gathered per unit.

FSDP2 shards floating-point parameters (a quantized tensor subclass it cannot chunk is dequantized, and GGUF's or
bitsandbytes' uint8 blocks are refused), so the quantized weights whose storage splits by output row
(:func:`hfpatch.distributed.stored.row_split`: GGUF blocks, torchao's per-row ``Int8Tensor``, optimum-quanto's per-row
``WeightQBytesTensor``, bitsandbytes' 4-bit blocks and their scales when a row is whole blocks and the scales are not
quantized again) are left out of FSDP2 (``ignored_params``) and sharded here:

* **At rest** each such parameter object stays the module's, its inner tensors (int8 data and scales, GGUF's
  blocks) replaced by this rank's rows of them, copied (:func:`~hfpatch.patches.checkpoint.shard_rows`: FSDP2's
  ``ceil(rows / N)`` split), so each rank holds about 1/N of the quantized bytes.
* **Around a unit's forward** (the units FSDP2 gathers: each block, the root for the rest) one all-gather of every
  row shard of the unit, packed as bytes (:func:`torch.distributed.all_gather_into_tensor`, each rank's part padded
  to the largest), rebuilds a new full tensor of each kind (:func:`~hfpatch.distributed.stored.rebuilt`) that the
  module holds for the call; after it the sharded object is put back and the full one is freed (unless autograd
  kept it for a backward).
* **remove()** gathers every row back into the original objects (a collective of the shard group).

What is not row-splittable (optimum-quanto's packed qint4, bitsandbytes with double quant, an unknown tensor subclass)
is refused by name before anything changes (:func:`refusal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...distributed import runtime
from ...distributed.stored import (
    RowSplit,
    UnsupportedTensorError,
    get_part,
    quantized_kind,
    rebuilt,
    row_split,
    set_part,
    stored_tensors,
)
from ..checkpoint import shard_rows

__all__ = ["QuantizedRows", "refusal", "row_sharded"]

#: Byte alignment of each part inside the packed all-gather buffer (any element size views it in place).
_ALIGN = 16


def row_sharded(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor, RowSplit]]:
    """``(module, name, parameter, split)`` of every quantized parameter of ``model`` that splits by row, each
    once (a tied one under its first module)."""
    found = []
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            split, _ = row_split(param)
            if split is not None:
                found.append((module, name, param, split))
    return found


def refusal(model: torch.nn.Module, label: str) -> str | None:
    """Why ``shard_weights`` cannot shard ``model``'s quantized weights (the first kind it cannot split, named with
    a parameter and what to do), or ``None``."""
    for name, param in model.named_parameters():
        try:
            stored_tensors(param)
        except UnsupportedTensorError as exc:
            return f"shard_weights cannot shard {label}: its parameter {name!r}: {exc}"
        kind = quantized_kind(param)
        if kind is None:
            continue
        split, why = row_split(param)
        if split is None:
            return (
                f"shard_weights cannot shard {label}'s {kind} weights ({name!r}): {why}, so its quantized storage "
                "does not split by rows, and hfpatch never dequantizes silently. Run without shard_weights (each rank "
                "holds the whole quantized model; sequence, CFG and Ring parallelism work on it), or use a kind that "
                "shard_weights splits by rows: a GGUF file (from_single_file + GGUFQuantizationConfig), torchao int8 "
                "weight-only (Int8WeightOnlyConfig), optimum-quanto qint8, bitsandbytes 4-bit without double quant"
            )
    return None


@dataclass
class _Entry:
    module: torch.nn.Module
    name: str
    param: torch.Tensor  # the module's own object: holds this rank's rows at rest
    split: RowSplit
    shapes: dict[str, tuple[int, ...]]  # part -> its full shape
    dtypes: dict[str, torch.dtype]
    device: torch.device  # where the full rows were (remove() puts them back there)
    code_group: int | None = None  # bitsandbytes, while sharded: which weights shared its code book before


@dataclass
class _Unit:
    module: torch.nn.Module
    entries: list[_Entry]
    handles: list[Any] = field(default_factory=list)
    held: list[tuple[_Entry, torch.Tensor]] = field(default_factory=list)  # gathered for the running call


def _equal_tensors(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and torch.equal(a, b)


def _row_bytes(entry: _Entry, part: str) -> int:
    shape = entry.shapes[part]
    inner = 1
    for size in shape[1:]:
        inner *= size
    return inner * torch.empty((), dtype=entry.dtypes[part]).element_size()


class QuantizedRows:
    """The row shards of ``model``'s row-splittable quantized weights over ``group`` (one of its FSDP2 units per
    entry of ``units``, the root last), gathered around each unit's forward.

    Args:
        model: The model being sharded.
        units: Its FSDP2 units, the root (``model``) last: a parameter belongs to the innermost unit holding it.
        group: The shard group's process group.
        device: Where this rank keeps its rows (FSDP2's shard device).
    """

    def __init__(
        self, model: torch.nn.Module, units: Sequence[torch.nn.Module], group: Any, device: torch.device
    ) -> None:
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = device
        self.gathers = 0  # all-gathers made (tests)
        self._code_books: dict[int, torch.Tensor] = {}  # bitsandbytes, while sharded: group -> its kept table
        owner: dict[int, int] = {}
        for index, unit in enumerate(units):  # inner units first: the root claims what is left
            for module in unit.modules():
                owner.setdefault(id(module), index)
        self.units = [_Unit(unit, []) for unit in units]
        for module, name, param, split in row_sharded(model):
            parts = {p: get_part(param, p, split.rows) for p in split.parts}
            entry = _Entry(
                module,
                name,
                param,
                split,
                {p: tuple(t.shape) for p, t in parts.items()},
                {p: t.dtype for p, t in parts.items()},
                next(iter(parts.values())).device,
            )
            self.units[owner[id(module)]].entries.append(entry)
        self.units = [u for u in self.units if u.entries]

    @property
    def params(self) -> set[torch.Tensor]:
        """The parameters sharded here (FSDP2's ``ignored_params``)."""
        return {e.param for u in self.units for e in u.entries}

    # ------------------------------------------------------------------------------------------- shard / gather
    def shard(self) -> None:
        """Keep this rank's rows of every entry (copies: the full storage is freed) and hook every unit."""
        for unit in self.units:
            for entry in unit.entries:
                start, stop = shard_rows(entry.split.rows, self.world, self.rank)
                for part in entry.split.parts:
                    full = get_part(entry.param, part, entry.split.rows)
                    set_part(entry.param, part, full[start:stop].to(self.device, copy=True).contiguous())
            unit.handles = [
                unit.module.register_forward_pre_hook(lambda *_, u=unit: self._gather(u)),
                unit.module.register_forward_hook(lambda *_, u=unit: self._release(u), always_call=True),
            ]
        self._share_code_books()

    def _share_code_books(self) -> None:
        """bitsandbytes gives every 4-bit weight its own copy of the same 16-value code book (the NF4 or FP4 table):
        while sharded, equal code books are one tensor, so a rank holds one per table instead of one per weight
        (4% of the quantized bytes of the tiny Wan; remove() gives back one copy per original tensor)."""
        groups: dict[int, int] = {}  # id of an original code book -> its group (the weights that shared it)
        for entry in self._entries():
            state = getattr(entry.param, "quant_state", None)
            code = getattr(state, "code", None)
            if code is None:
                continue
            entry.code_group = groups.setdefault(id(code), len(groups))
            kept = next((t for t in self._code_books.values() if _equal_tensors(t, code)), None)
            if kept is None:  # the first of its table: kept, and given back to its own group at remove()
                kept = self._code_books[entry.code_group] = code
            state.code = kept

    def _own_code_books(self) -> None:
        for entry in self._entries():
            if entry.code_group is not None:
                state = entry.param.quant_state
                if entry.code_group not in self._code_books:
                    self._code_books[entry.code_group] = state.code.clone()
                state.code = self._code_books[entry.code_group]
                entry.code_group = None
        self._code_books = {}

    def _entries(self) -> list[_Entry]:
        return [entry for unit in self.units for entry in unit.entries]

    def _all_rows(self, entries: Sequence[_Entry], device: torch.device) -> list[dict[str, torch.Tensor]]:
        """Every rank's rows of ``entries``, gathered in one all-gather: per entry, part -> full tensor."""
        layout: list[tuple[int, str, int]] = []  # (entry index, part, offset in a rank's chunk) per rank 0
        sizes = [0] * self.world
        offsets: list[list[int]] = [[] for _ in range(self.world)]
        for i, entry in enumerate(entries):
            for part in entry.split.parts:
                for r in range(self.world):
                    start, stop = shard_rows(entry.split.rows, self.world, r)
                    offsets[r].append(sizes[r])
                    sizes[r] += -(-(stop - start) * _row_bytes(entry, part) // _ALIGN) * _ALIGN
                layout.append((i, part, len(layout)))
        chunk = max(sizes)
        local = torch.zeros(chunk, dtype=torch.uint8, device=device)
        for i, part, k in layout:
            rows = get_part(
                entries[i].param, part
            )  # this rank's rows (flat for bitsandbytes: no shape needed)
            if rows.numel():
                flat = rows.detach().reshape(-1).view(torch.uint8)
                local[offsets[self.rank][k] : offsets[self.rank][k] + flat.numel()].copy_(flat)
        gathered = torch.empty(chunk * self.world, dtype=torch.uint8, device=device)
        try:
            dist.all_gather_into_tensor(gathered, local, group=self.group)
        except RuntimeError as exc:
            if runtime.is_peer_failure(exc):
                raise runtime.collective_error(
                    "the shard_weights gather of quantized rows", self.group, exc
                ) from exc
            raise
        self.gathers += 1
        out: list[dict[str, torch.Tensor]] = [{} for _ in entries]
        for i, part, k in layout:
            entry = entries[i]
            full = torch.empty(entry.shapes[part], dtype=entry.dtypes[part], device=device)
            width = _row_bytes(entry, part)
            for r in range(self.world):
                start, stop = shard_rows(entry.split.rows, self.world, r)
                if stop > start:
                    at = r * chunk + offsets[r][k]
                    raw = gathered[at : at + (stop - start) * width]
                    full[start:stop].view(-1).view(torch.uint8).copy_(raw)
            out[i][part] = full
        return out

    def _device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gather(self, unit: _Unit) -> None:
        if unit.held:  # a forward that raised left it gathered: put the shards back first
            self._release(unit)
        full = self._all_rows(unit.entries, self._device())
        for entry, parts in zip(unit.entries, full):
            whole = rebuilt(entry.param, parts)
            entry.module._parameters[entry.name] = whole
            unit.held.append((entry, whole))

    def _release(self, unit: _Unit) -> None:
        for entry, _ in unit.held:
            entry.module._parameters[entry.name] = entry.param
        unit.held = []

    # ------------------------------------------------------------------------------------------- restore
    def restore(self) -> None:
        """Gather every row back into the original parameter objects and remove the hooks (a collective)."""
        for unit in self.units:
            for handle in unit.handles:
                handle.remove()
            unit.handles = []
            self._release(unit)
            full = self._all_rows(unit.entries, self._device())
            for entry, parts in zip(unit.entries, full):
                for part, value in parts.items():
                    set_part(entry.param, part, value.to(entry.device))
        self._own_code_books()
