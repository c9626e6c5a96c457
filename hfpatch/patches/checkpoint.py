"""Weights read from safetensors files straight into the part of a model this rank keeps.

``hfpatch.from_pretrained`` (:mod:`hfpatch.loading`) builds the models it shards on the ``meta`` device and
attaches to each a :class:`CheckpointSource`: for every parameter and persistent buffer, the safetensors file and
key that hold it, its shape, and the dtype the model holds it in. The families that keep only part of a model then
read only that part, while they split it:

* ``shard_weights`` (:mod:`hfpatch.patches.fsdp`) shards the meta model with FSDP2, allocates the local shards
  and fills each from the rows of dim 0 that FSDP2 gives this rank (:func:`shard_rows`: torch's chunking,
  ``ceil(rows / N)`` per rank, the last ranks fewer or none; :meth:`CheckpointSource.read_rows`);
* PipeFusion (:mod:`hfpatch.patches.pipefusion`) reads the tensors of its own stage and of the unsplit rest
  whole (:func:`load_tensors`, still through safetensors' mapping of the file:
  :meth:`CheckpointSource.read_mapped`); the other stages' blocks stay on ``meta``.

A read is one plain read (``readinto`` at the byte range of the rows, from the offsets in the file's
safetensors header) into a new tensor: dim 0 is the outermost, so a row range is one contiguous range of bytes.
The slice is then cast to the model's dtype and copied into place. The rest of the file is never read, and no
file is mapped: a mapping of the whole file (``safe_open(...).get_slice``) would keep every page read (and the
kernel's read-ahead around it) in the process's resident set until it is closed, so a rank's resident memory
would be far more than its shard. The bytes are the ones ``safe_open`` would return (safetensors stores
little-endian; a big-endian host is refused). This module is shared (no family imports another); it knows no HF
class.

>>> shard_rows(10, 4, 0), shard_rows(10, 4, 3), shard_rows(5, 4, 3)   # 3 rows a rank; 5 rows over 4: 2, 2, 1, 0
((0, 3), (9, 10), (5, 5))
"""

from __future__ import annotations

import ctypes
import json
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CheckpointSource",
    "TensorEntry",
    "attach_source",
    "detach_source",
    "load_tensors",
    "shard_rows",
    "source_of",
]


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of the rows of dim 0 that FSDP2's ``Shard(0)`` gives ``rank`` of ``world``: torch's
    chunking (``torch.chunk``: ``ceil(rows / world)`` rows per chunk, fewer chunks than ranks when the rows run
    out), so the last ranks may get fewer rows, or none (``start == stop``). Pure.

    >>> [shard_rows(7, 3, r) for r in range(3)]
    [(0, 3), (3, 6), (6, 7)]
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not a rank of a world of {world}")
    size = -(-rows // world)
    return min(rank * size, rows), min((rank + 1) * size, rows)


@dataclass(frozen=True)
class TensorEntry:
    """Where one parameter or buffer of a model is stored, and as what the model holds it.

    Attributes:
        file: Path of the safetensors file.
        key: The tensor's name in that file.
        shape: Its shape (the model's and the file's: checked when the source is built).
        dtype: Its dtype in the file.
        target: The dtype the model holds it in (what the library's own ``from_pretrained`` would give).
    """

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    target: torch.dtype

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of dim 0 in the model's dtype (of the whole tensor for a 0-dim one)."""
        per_row = 1
        for size in self.shape[1:]:
            per_row *= size
        return per_row * torch.empty((), dtype=self.target).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor in the model's dtype."""
        return self.row_bytes * (self.shape[0] if self.shape else 1)


class CheckpointSource:
    """The safetensors entries of one model (parameter or buffer name -> :class:`TensorEntry`) and the reads.

    Names are the model's ``state_dict`` keys, tied aliases included (each pointing to the one key the file
    holds). Reads are counted: ``bytes_read`` (every slice read) and ``largest_read`` (the largest single
    slice, the transient a read adds above what the model keeps). A file stays open (a descriptor, no mapping)
    until :meth:`close`.

    Args:
        name: The model's name in messages (``"transformer"``).
        entries: Name -> entry.
        device: Where whole tensors (:func:`load_tensors`) are put.

    >>> import os, tempfile, torch
    >>> from safetensors.torch import save_file
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> save_file({"w": torch.arange(12.0).view(6, 2)}, path)
    >>> source = CheckpointSource("demo", {"w": TensorEntry(path, "w", (6, 2), torch.float32, torch.bfloat16)})
    >>> source.read_rows("w", *shard_rows(6, 4, 1))                  # rank 1 of 4: rows 2 and 3, cast
    tensor([[4., 5.],
            [6., 7.]], dtype=torch.bfloat16)
    >>> source.bytes_read                                             # as stored: 4 float32 values
    16
    """

    def __init__(self, name: str, entries: dict[str, TensorEntry], device: Any = "cpu") -> None:
        self.name = name
        self.entries = dict(entries)
        self.device = torch.device(device)
        self.bytes_read = 0
        self.largest_read = 0
        self._files: dict[str, Any] = {}
        self._mapped: dict[str, Any] = {}

    def __repr__(self) -> str:
        files = len({e.file for e in self.entries.values()})
        return f"CheckpointSource({self.name!r}, {len(self.entries)} tensors in {files} file(s))"

    def _open(self, file: str) -> tuple[Any, dict[str, Any], int]:
        """``(unbuffered file, header, offset of the data)`` of ``file``, opened once."""
        if file not in self._files:
            handle = open(file, "rb", buffering=0)  # noqa: SIM115 (kept open until close())
            try:
                length = int.from_bytes(_read_exactly(handle, 0, 8, file), "little")
                header = json.loads(bytes(_read_exactly(handle, 8, length, file)))
            except BaseException:
                handle.close()
                raise
            self._files[file] = (handle, header, 8 + length)
        return self._files[file]

    def read_rows(
        self, name: str, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``[start, stop)`` of dim 0 of ``name`` (all of them by default; a 0-dim tensor whole), read from
        its file alone (one plain read of their bytes) and returned contiguous, on the CPU, in the model's dtype.

        ``out``: a tensor of the rows' shape and the model's dtype to fill instead (and return). When it is a
        contiguous CPU tensor and the file holds the model's dtype, the bytes are read straight into it: no
        temporary, so nothing freed is left for the allocator to keep resident.

        Raises:
            KeyError: ``name`` is not an entry of this source.
            ValueError: ``out`` has another shape or dtype.
            OSError: The file is shorter than its header says (truncated since it was checked).
        """
        if sys.byteorder != "little":
            raise RuntimeError("hfpatch reads safetensors files (little-endian) on little-endian hosts only")
        entry = self.entries[name]
        handle, header, data = self._open(entry.file)
        begin, end = header[entry.key]["data_offsets"]
        if not entry.shape:
            rows, offset, nbytes = (), data + begin, end - begin
        else:
            stop = entry.shape[0] if stop is None else stop
            row = (end - begin) // entry.shape[0] if entry.shape[0] else 0
            rows = (stop - start, *entry.shape[1:])
            offset, nbytes = data + begin + start * row, (stop - start) * row
        if out is not None and (tuple(out.shape) != rows or out.dtype != entry.target):
            raise ValueError(
                f"{self.name}.{name}: out is {out.dtype} {tuple(out.shape)}, the rows are {entry.target} {rows}"
            )
        direct = (
            out is not None
            and out.device.type == "cpu"
            and out.is_contiguous()
            and entry.dtype == entry.target
        )
        tensor = out if direct else torch.empty(rows, dtype=entry.dtype)
        if nbytes:
            buffer = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
            _read_exactly(handle, offset, nbytes, entry.file, buffer)
        self.bytes_read += nbytes
        self.largest_read = max(self.largest_read, nbytes)
        if direct:
            return out
        if tensor.dtype != entry.target:
            tensor = tensor.to(entry.target)
        if out is not None:
            return out.copy_(tensor)
        return tensor.contiguous()

    def read_mapped(self, name: str) -> torch.Tensor:
        """``name`` whole, as :meth:`read_rows` gives it but through safetensors' mapping of its file
        (``safe_open(...).get_slice``, the file mapped until :meth:`close`): PipeFusion's reads
        (:func:`load_tensors`). Its output differs when its stage's weights are the tensors :meth:`read_rows`
        returns (the same bits, verified; fresh tensors rather than safetensors' views), so it keeps this path
        until that is understood (issue 46)."""
        from safetensors import safe_open

        entry = self.entries[name]
        if entry.file not in self._mapped:
            self._mapped[entry.file] = safe_open(entry.file, framework="pt", device="cpu")
        handle = self._mapped[entry.file].get_slice(entry.key)
        tensor = handle[...] if not entry.shape else handle[0 : entry.shape[0]]
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_read += nbytes
        self.largest_read = max(self.largest_read, nbytes)
        if tensor.dtype != entry.target:
            tensor = tensor.to(entry.target)
        return tensor.contiguous()

    def close(self) -> None:
        """Close the open files (they are reopened on the next read)."""
        for handle, _, _ in self._files.values():
            handle.close()
        self._files.clear()
        self._mapped.clear()


def _read_exactly(handle: Any, offset: int, nbytes: int, file: str, into: Any = None) -> memoryview:
    """``nbytes`` of ``handle`` from ``offset``, read into ``into`` (a writable buffer of that size) or a new one."""
    view = memoryview(bytearray(nbytes) if into is None else into).cast("B")
    handle.seek(offset)
    done = 0
    while done < nbytes:
        got = handle.readinto(view[done:])
        if not got:
            raise OSError(f"{file}: {nbytes} bytes expected at offset {offset}, the file ends after {done}")
        done += got
    return view


_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> CheckpointSource


def attach_source(model: torch.nn.Module, source: CheckpointSource) -> None:
    """Mark ``model`` (built on ``meta``) as one whose weights the families read from ``source`` while they split it."""
    _SOURCES[model] = source


def detach_source(model: torch.nn.Module) -> None:
    """Forget ``model``'s source (its open files are closed)."""
    source = _SOURCES.pop(model, None)
    if source is not None:
        source.close()


def source_of(model: torch.nn.Module) -> CheckpointSource | None:
    """The :class:`CheckpointSource` attached to ``model``, or ``None`` (a model loaded the usual way)."""
    return _SOURCES.get(model)


def load_tensors(
    model: torch.nn.Module, source: CheckpointSource, skip: set[int] | frozenset[int] = frozenset()
) -> int:
    """Read whole, from ``source``, every parameter and buffer of ``model`` that is on ``meta``, except those
    whose id is in ``skip`` (they stay on ``meta``); a tensor registered under several names (tied) is read once
    and registered as one object again. Returns the bytes left on ``meta`` (of the skipped tensors).

    Raises:
        ValueError: A tensor on ``meta`` that is not skipped has no entry in ``source`` (nothing to read it from).
    """
    loaded: dict[
        int, tuple[torch.Tensor, torch.Tensor]
    ] = {}  # id -> (the meta tensor, kept alive; its value)
    left = 0
    left_seen: set[int] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for name, tensor in list(store.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) in skip:
                    if id(tensor) not in left_seen:
                        left_seen.add(id(tensor))
                        left += tensor.numel() * tensor.element_size()
                    continue
                if id(tensor) not in loaded:
                    full = f"{module_name}.{name}" if module_name else name
                    if full not in source.entries:
                        raise ValueError(
                            f"hfpatch: {source.name}.{full} is on the meta device and the checkpoint has no tensor "
                            "for it; it cannot be loaded"
                        )
                    value = source.read_mapped(full).to(source.device)
                    if isinstance(tensor, torch.nn.Parameter):
                        value = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
                    loaded[id(tensor)] = (tensor, value)
                store[name] = loaded[id(tensor)][1]
    return left
