"""What a weight stores: the plain tensors behind a quantized (or other subclassed) parameter, by kind.

Quantized checkpoints reach hfpatch as tensor subclasses whose values are not their bytes: torchao's
(``Int8Tensor``, ``Float8Tensor``, ...) and optimum-quanto's (``WeightQBytesTensor``, ``WeightQBitsTensor``) wrap
inner tensors (int8 data, scales) behind ``__torch_dispatch__`` and describe them with ``__tensor_flatten__``;
diffusers' ``GGUFParameter`` and bitsandbytes' ``Params4bit``/``Int8Params`` are parameters whose own storage holds
the packed blocks, with the quantization type or state beside it. An aten op the subclass lacks (``view``) raises,
and a torch function of ``GGUFParameter`` wraps its result again as a ``GGUFParameter``, so code that reads weights
(the same-weights check, byte counters, sharding) reads them here:

* :func:`stored_tensors` -- a text that describes the kind (class, quantization type, layout metadata) and the
  plain tensors that hold the data, in a fixed order: the inner tensors of ``__tensor_flatten__`` (recursively),
  or the parameter's own storage plus its known side state (GGUF's ``quant_type``, bitsandbytes' ``quant_state``
  and ``SCB``). A subclass that is neither raises :class:`UnsupportedTensorError` naming its class.
* :func:`stored_bytes`, :func:`storage_stamp` -- its bytes, and what moves when it is changed in place.
* :func:`row_split` -- for the kinds whose storage splits by output row (GGUF blocks, torchao's per-row int8,
  optimum-quanto's per-row qint8, bitsandbytes 4-bit without double quant): the inner tensors whose rows are the
  weight's rows, so ``shard_weights`` can keep
  1/N of the QUANTIZED bytes on each rank; ``None`` with the reason for the others.

Classes are known by name (module and class name), so nothing here imports torchao, optimum-quanto, diffusers or
bitsandbytes.

>>> import torch
>>> from hfpatch.distributed.stored import stored_tensors, quantized_kind
>>> text, parts = stored_tensors(torch.nn.Parameter(torch.ones(2, 3)))
>>> text, [tuple(p.shape) for p in parts], quantized_kind(torch.ones(1))
('', [(2, 3)], None)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "RowSplit",
    "UnsupportedTensorError",
    "class_path",
    "get_part",
    "is_plain",
    "quantized_kind",
    "rebuilt",
    "row_split",
    "set_part",
    "storage_stamp",
    "stored_bytes",
    "stored_tensors",
]


class UnsupportedTensorError(TypeError):
    """A parameter or buffer is a tensor subclass hfpatch cannot read the stored data of (raised alike on every
    rank, before any collective: every rank holds the same classes)."""


def class_path(tensor: Any) -> str:
    """``module.ClassName`` of ``tensor``'s class (the public module where the library sets one)."""
    cls = type(tensor)
    return f"{cls.__module__}.{cls.__qualname__}"


_PLAIN_FUNCTION = {torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl}


def _overrides_function(cls: type) -> bool:
    function = cls.__torch_function__
    return getattr(function, "__func__", function) not in _PLAIN_FUNCTION


def _overrides_dispatch(cls: type) -> bool:
    return cls.__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl


def is_plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain tensor or parameter (or a subclass that changes no torch behaviour): its
    values are its bytes."""
    cls = type(tensor)
    return cls in (torch.Tensor, torch.nn.Parameter) or not (
        _overrides_function(cls) or _overrides_dispatch(cls)
    )


def _names(tensor: Any) -> set[str]:
    """The class names of ``tensor``'s MRO, as ``top-level-module:ClassName``."""
    return {f"{c.__module__.split('.')[0]}:{c.__name__}" for c in type(tensor).__mro__}


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor on ``tensor``'s own storage (its subclass's ``__torch_function__`` not called: GGUF's
    wraps every result again)."""
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.detach()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _text(value: Any) -> str:
    """``repr(value)`` without object addresses (the same on every rank)."""
    return _ADDRESS.sub("", repr(value))


def _bnb_state(state: Any) -> tuple[str, list[torch.Tensor]]:
    """bitsandbytes' ``QuantState`` of a 4-bit weight: its tensors (block scales, code books, nested ones) and the
    rest as text."""
    items = state.as_dict(packed=False)
    tensors = [(k, v) for k, v in sorted(items.items()) if isinstance(v, torch.Tensor)]
    text = ",".join(f"{k}={_text(v)}" for k, v in sorted(items.items()) if not isinstance(v, torch.Tensor))
    cpu = getattr(state, "packing_format_for_cpu", False)
    return f"{text},keys={[k for k, _ in tensors]},cpu_packed={cpu}", [v for _, v in tensors]


def stored_tensors(tensor: torch.Tensor) -> tuple[str, list[torch.Tensor]]:
    """``(description, plain tensors)`` of what ``tensor`` stores: ``("", [tensor])`` for a plain tensor; for a
    quantized one its kind and layout as text (the same on every rank for the same weights) and the plain tensors
    that hold its data.

    Raises:
        UnsupportedTensorError: A tensor subclass that neither describes its inner tensors
            (``__tensor_flatten__``) nor is a known parameter kind.
    """
    if is_plain(tensor):
        return "", [tensor]
    cls = type(tensor)
    names = _names(tensor)
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None and _overrides_dispatch(cls):  # torchao, optimum-quanto: the inner tensors
        inner, context = flatten()
        texts, parts = [], []
        for name in inner:
            value = getattr(tensor, name)
            if value is None:
                continue
            text, stored = stored_tensors(value)
            texts.append(f"{name}:{text}" if text else name)
            parts += stored
        return f"{class_path(tensor)}({';'.join(texts)}){_text(context)}", parts
    if "diffusers:GGUFParameter" in names:
        return f"GGUF type {int(tensor.quant_type)}", [_own_storage(tensor)]
    if "bitsandbytes:Params4bit" in names:
        state = getattr(tensor, "quant_state", None)
        if state is None:  # not quantized yet (moved to the device it quantizes on)
            return f"{class_path(tensor)}(unquantized)", [_own_storage(tensor)]
        text, parts = _bnb_state(state)
        return f"{class_path(tensor)}({text})", [_own_storage(tensor), *parts]
    if "bitsandbytes:Int8Params" in names:
        extra = [t for t in (getattr(tensor, "SCB", None), getattr(tensor, "CB", None)) if t is not None]
        return f"{class_path(tensor)}(SCB,CB={len(extra)})", [_own_storage(tensor), *extra]
    raise UnsupportedTensorError(
        f"hfpatch cannot read the stored data of a {class_path(tensor)} (a tensor subclass it does not know: "
        "no __tensor_flatten__ of its inner tensors, and not one of the known quantized parameters: torchao, "
        "optimum-quanto, GGUF, bitsandbytes)"
    )


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the data ``tensor`` stores (its quantized data and scales for a quantized weight)."""
    return sum(t.numel() * t.element_size() for t in stored_tensors(tensor)[1])


def storage_stamp(tensor: torch.Tensor) -> tuple[int, ...]:
    """Version counters and data pointers of what ``tensor`` stores: moves when it is changed in place or
    replaced (a wrapper subclass has no data pointer of its own)."""
    if is_plain(tensor):
        return (tensor._version, tensor.data_ptr())
    return tuple(x for t in stored_tensors(tensor)[1] for x in (t._version, t.data_ptr()))


def quantized_kind(tensor: torch.Tensor) -> str | None:
    """The kind of a quantized weight in words (``"GGUF Q8_0"``, ``"torchao Int8Tensor"``, ``"optimum-quanto
    WeightQBytesTensor (qint8)"``, ``"bitsandbytes Params4bit (nf4)"``), or ``None`` for a plain tensor."""
    if is_plain(tensor):
        return None
    names = _names(tensor)
    if "diffusers:GGUFParameter" in names:
        quant = tensor.quant_type
        return f"GGUF {getattr(quant, 'name', quant)}"
    if "bitsandbytes:Params4bit" in names:
        return f"bitsandbytes Params4bit ({getattr(tensor, 'quant_type', '?')})"
    top = type(tensor).__module__.split(".")[0]
    library = {"optimum": "optimum-quanto"}.get(top, top)
    qtype = getattr(tensor, "qtype", None)
    detail = f" ({getattr(qtype, 'name', qtype)})" if qtype is not None else ""
    return f"{library} {type(tensor).__name__}{detail}"


@dataclass(frozen=True)
class RowSplit:
    """How a quantized weight of ``rows`` output rows splits by row: each inner tensor named in ``parts`` (an
    attribute of the weight, or ``"data"``: the parameter's own storage) has the weight's rows as its first
    dimension, whole blocks per row."""

    rows: int
    parts: tuple[str, ...]


def _bnb_rows(tensor: torch.Tensor) -> tuple[tuple[str, ...] | None, str, int]:
    """bitsandbytes 4-bit: rows of whole blocks when its statistics are not nested (diffusers'
    ``BitsAndBytesConfig`` default, ``bnb_4bit_use_double_quant=False``) and a row is whole blocks."""
    state = getattr(tensor, "quant_state", None)
    if state is None:
        return None, "it is not quantized yet", 0
    if getattr(state, "nested", False):
        return (
            None,
            "its block statistics are quantized again (nested, double quant) in blocks across rows",
            0,
        )
    if getattr(state, "packing_format_for_cpu", False):
        return None, "its 4-bit data was repacked for bitsandbytes' AVX512-BF16 CPU kernel", 0
    shape = tuple(state.shape or ())
    if len(shape) != 2 or shape[1] % state.blocksize or tensor.dtype != torch.uint8:
        return None, f"a row of its {shape} weight is not whole blocks of {state.blocksize}", 0
    return ("data", "quant_state.absmax"), "", shape[0]


def _row_parts(tensor: torch.Tensor) -> tuple[tuple[str, ...] | None, str, int]:
    names = _names(tensor)
    rows = tensor.shape[0] if tensor.dim() else 0
    if "diffusers:GGUFParameter" in names:
        return ("data",), "", rows
    path = class_path(tensor)
    if type(tensor).__name__ == "Int8Tensor" and path.startswith("torchao."):
        block = list(getattr(tensor, "block_size", []))
        if block[:1] != [1] or len(block) != tensor.dim():
            return None, f"its int8 blocks {block} span several rows", rows
        return tuple(n for n in tensor.__tensor_flatten__()[0] if getattr(tensor, n) is not None), "", rows
    if type(tensor).__name__ == "WeightQBytesTensor" and path.startswith("optimum."):
        if getattr(tensor, "axis", None) != 0:
            return (
                None,
                f"its scales run along axis {getattr(tensor, 'axis', None)}, not per output row",
                rows,
            )
        return ("_data", "_scale"), "", rows
    if type(tensor).__name__ == "WeightQBitsTensor" and path.startswith("optimum."):
        return None, "its 4-bit values are packed two rows per byte (row i with row i + rows/2)", rows
    if "bitsandbytes:Params4bit" in names:
        return _bnb_rows(tensor)
    return None, "hfpatch does not know its storage layout", rows


def row_split(tensor: torch.Tensor) -> tuple[RowSplit | None, str]:
    """``(RowSplit, "")`` when ``tensor`` is a quantized weight whose stored tensors split by output row (GGUF,
    torchao ``Int8Tensor`` with per-row blocks, optimum-quanto ``WeightQBytesTensor`` with per-row scales,
    bitsandbytes ``Params4bit`` whose rows are whole blocks and whose block scales are plain), else
    ``(None, why not)``. A plain tensor gives ``(None, "")``."""
    if is_plain(tensor):
        return None, ""
    parts, why, rows = _row_parts(tensor)
    if parts is None:
        return None, why
    for name in parts:
        inner = get_part(tensor, name, rows)
        if not is_plain(inner) or inner.dim() == 0 or inner.shape[0] != rows:
            return None, f"its {name} is not laid out by output row"
    return RowSplit(rows, parts), ""


def get_part(tensor: torch.Tensor, name: str, rows: int | None = None) -> torch.Tensor:
    """The inner tensor ``name`` of a :class:`RowSplit` (``"data"``: the parameter's own storage, as a plain
    tensor; ``"quant_state.absmax"``: bitsandbytes' block scales), with ``rows`` rows first when given (a flat
    4-bit weight and its scales as ``[rows, -1]``)."""
    if name == "data":
        value = _own_storage(tensor)
    elif name == "quant_state.absmax":
        value = tensor.quant_state.absmax
    else:
        return getattr(tensor, name)
    if rows is not None and "bitsandbytes:Params4bit" in _names(tensor):
        return value.reshape(rows, -1)
    return value


def set_part(tensor: torch.Tensor, name: str, value: torch.Tensor) -> None:
    """Make ``value`` the inner tensor ``name`` of ``tensor``, in place (the same object: a parameter stays the
    module's). ``"data"`` replaces the parameter's own storage (its torch function not called); a bitsandbytes
    weight keeps its flat layout (``[-1, 1]`` data, flat scales)."""
    flat = "bitsandbytes:Params4bit" in _names(tensor)
    if name == "data":
        with torch._C.DisableTorchFunctionSubclass():
            tensor.data = value.reshape(-1, 1) if flat else value
    elif name == "quant_state.absmax":
        tensor.quant_state.absmax = value.reshape(-1)
    else:
        setattr(tensor, name, value)


def rebuilt(tensor: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """A new tensor of ``tensor``'s kind, class and metadata whose inner tensors are ``parts`` (the full rows of a
    :class:`RowSplit`, gathered), leaving ``tensor`` as it is: ``__tensor_unflatten__`` for a torchao or
    optimum-quanto tensor, a new ``GGUFParameter`` of the same quantization type for GGUF."""
    if "diffusers:GGUFParameter" in _names(tensor):
        return type(tensor)(parts["data"], quant_type=tensor.quant_type)
    if "bitsandbytes:Params4bit" in _names(tensor):
        state = tensor.quant_state
        full = type(state)(
            absmax=parts["quant_state.absmax"].reshape(-1),
            shape=state.shape,
            code=state.code,
            blocksize=state.blocksize,
            quant_type=state.quant_type,
            dtype=state.dtype,
        )
        return type(tensor)(
            parts["data"].reshape(-1, 1),
            requires_grad=False,
            quant_state=full,
            blocksize=tensor.blocksize,
            compress_statistics=False,
            quant_type=tensor.quant_type,
            quant_storage=tensor.quant_storage,
            module=tensor.module,
            bnb_quantized=True,
        )
    names, context = tensor.__tensor_flatten__()
    inner = {n: parts.get(n, getattr(tensor, n)) for n in names if getattr(tensor, n) is not None}
    out = type(tensor).__tensor_unflatten__(inner, context, tensor.shape, tensor.stride())
    if tensor.requires_grad and out.is_floating_point():
        out.requires_grad_(True)
    return out
