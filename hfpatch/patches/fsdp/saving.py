"""``save_pretrained`` of a model or pipeline whose weights are sharded (``shard_weights=True``).

Each rank holds ``1/N`` of every sharded parameter (FSDP2 DTensors), so the stock ``save_pretrained`` cannot
write them: safetensors fails on a DTensor half-way through the folder. With ``shard_weights``, the pipeline's
and each sharded model's ``save_pretrained`` become a collective that writes the folder the unsharded model
writes, byte for byte:

1. Every rank checks that all ranks called it with the same arguments (the same-input table of a patched call,
   over every rank of the plan), before any weight moves: a call on some ranks only (``if
   accelerator.is_main_process:`` around it) waits there with a notice every ``HFPATCH_WAIT_NOTICE_S`` naming the
   missing ranks, and raises at ``HFPATCH_TIMEOUT_S`` with nothing written; different folders on different
   ranks raise on every rank at once.
2. Each sharded model's full state dict is gathered to global rank 0's CPU memory, one tensor at a time
   (torch's :func:`~torch.distributed.checkpoint.state_dict.get_model_state_dict` with ``full_state_dict`` and
   ``cpu_offload``: the other ranks keep nothing), tied weights aliased again as in the unsharded model.
3. Rank 0 runs the stock ``save_pretrained`` with each model's ``state_dict()`` answering the gathered one; the
   other ranks write nothing and wait for it (``HFPATCH_TIMEOUT_S``), so a folder read right after the call is
   complete on every rank, and an error of the write is raised on every rank.

Rank 0 holds each sharded model whole in CPU memory while writing, as an unsharded save does.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...core.patch import Patch
from ...distributed import runtime
from ...distributed.agreement import check_same_inputs, named_arguments

__all__ = ["compact", "full_state_dict", "install_sharded_save"]

# True while rank 0 writes a sharded save: a model's own save_pretrained, called by the pipeline's, runs stock.
_WRITING: contextvars.ContextVar[bool] = contextvars.ContextVar("hfpatch_sharded_save", default=False)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of an FSDP2-sharded ``model`` on global rank 0 (plain CPU tensors, in the order and
    with the tied entries of ``model.state_dict()``), ``{}`` on the other ranks. A collective over the ranks
    that share the model's shards: call it on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return {}
    first: dict[int, str] = {}  # id(parameter) -> its first key: tied weights share one tensor, as unsharded
    full: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in first:
            full[key] = full[first[id(value)]]
            continue
        first[id(value)] = key
        # An unevenly sharded tensor comes back as a view of its padded gather: the hub's shard split sizes a
        # tensor by its storage, so such a view would move the file boundaries of a max_shard_size save.
        full[key] = compact(gathered.pop(key))
    return full


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy of it when it is a view into a larger storage (a gathered shard's padding)."""
    return tensor.contiguous().clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor


def _unsharded_class(model: torch.nn.Module) -> type:
    """The model's class before ``fully_shard`` (which swaps it for an ``FSDP<Class>`` subclass)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


@contextlib.contextmanager
def _as_unsharded(states: Sequence[tuple[torch.nn.Module, dict[str, torch.Tensor]]]) -> Iterator[None]:
    """Each model looks unsharded to the stock save: ``state_dict()`` returns its gathered full state dict (an
    instance attribute) and its class is the original one (diffusers writes ``_class_name``, transformers
    ``architectures``, from it); both put back after."""
    classes = [type(model) for model, _ in states]
    try:
        for model, state in states:
            model.__dict__["state_dict"] = lambda *args, _state=state, **kwargs: dict(_state)
            model.__class__ = _unsharded_class(model)
        yield
    finally:
        for (model, _), cls in zip(states, classes):
            model.__dict__.pop("state_dict", None)
            model.__class__ = cls


def _save_collectively(
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    models: Sequence[torch.nn.Module],
    group: Any,
    label: str,
) -> Any:
    """Steps 1-3 of the module docstring for ``original`` (a bound stock ``save_pretrained``)."""
    named = named_arguments(original, args, kwargs)
    named.pop("is_main_process", None)  # every rank calls it; rank 0 writes whatever each rank says
    if isinstance(named.get("kwargs"), dict):
        named["kwargs"] = {k: v for k, v in named["kwargs"].items() if k != "is_main_process"}
    for key, value in list(named.items()):
        if isinstance(value, os.PathLike):
            named[key] = os.fspath(value)
    what = f"{label}.save_pretrained (its weights are sharded: every rank must call it, rank 0 writes)"
    hint = "For save_pretrained: call it on every rank with the same folder and arguments (rank 0 writes)."
    check_same_inputs(named, group, what=what, hint=hint)
    states = [(model, full_state_dict(model)) for model in models]
    error: BaseException | None = None
    result = None
    if dist.get_rank() == 0:
        kwargs = {k: v for k, v in kwargs.items() if k != "is_main_process"}
        token = _WRITING.set(True)
        try:
            with _as_unsharded(states):
                result = original(*args, **kwargs)
        except Exception as exc:  # every rank raises it, below
            error = exc
        finally:
            _WRITING.reset(token)
    del states
    said = runtime.exchange(
        "save_pretrained", {"error": None if error is None else repr(error)}, what=f"{label}.save_pretrained"
    )
    if error is not None:
        raise error
    if said[0]["error"] is not None:
        raise RuntimeError(f"hfpatch: rank 0 failed writing {label}.save_pretrained: {said[0]['error']}")
    return result


def install_sharded_save(
    patch: Patch, target: Any, models: Sequence[torch.nn.Module], group: Any, label: str
) -> None:
    """Make ``target.save_pretrained`` (a pipeline's or a sharded model's) the collective save above for the
    sharded ``models`` it writes; undone by ``patch.remove()``, kept inside ``patch.disabled()`` (the weights stay
    sharded there too)."""
    if not callable(getattr(target, "save_pretrained", None)):
        return

    def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)  # the pipeline reads a component's signature to pick the kwargs it passes
        def save_pretrained(*args: Any, **kwargs: Any) -> Any:
            if _WRITING.get():  # rank 0, inside the pipeline's save: the state dicts answer already
                return original(*args, **kwargs)
            return _save_collectively(original, args, kwargs, models, group, label)

        return save_pretrained

    patch.set_attr(target, "save_pretrained", wrapper(target.save_pretrained), keep_when_disabled=True)
