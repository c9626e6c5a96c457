"""Replicated streams of a sequence-parallel DiT: where they enter the sharded computation, their gradient is
averaged over the ``sp`` group before their backward runs.

A DiT computes some tensors whole on every rank (the text stream and its refiners, the timestep embedding, image
conditions) and hands them to the computation on this rank's shard of the tokens: joint or cross attention,
the modulation of the sharded tokens. The gradient that comes back to such a tensor is this rank's *share*
(``N`` times over, :mod:`hfpatch.distributed.gradients`); the replicated part must run its backward on the mean of
the shares, the full gradient, or a model that rounds inside it (Kandinsky 5's text rotary rounds q/k to bf16
even in fp32) rounds each share instead of their sum. So every such tensor enters the sharded computation through
:func:`~hfpatch.distributed.gradients.grads_averaged_over_group`, at two kinds of boundary:

* **The routed attention's replicated inputs**: the joint text's query/key/value (``joint="front"/"back"``, its
  keys/values for ``joint="keys"``) and the replicated queries of ``joint="queries"``, which the plan declares
  replicated (:func:`~hfpatch.patches.dit.sequence_parallel.usp_attention_call`).
* **The arguments of the model's units** (its direct children, the elements of its block lists): a unit called
  with tensors of the shard gets every argument *proven* replicated (below) through the average, one all-reduce
  per call for all of them (the text and the timestep embedding entering a block, say).

Proven replicated, per call, conservatively: a tensor is replicated when everything it was computed from is.
The model's inputs and parameters are; the output of a unit called with replicated arguments only is, unless the
unit holds hfpatch machinery (a split or gather of the plan, a routed attention); what hfpatch itself produces is
marked as it is made: a split's output is sharded, a gather's or a joint attention output's replicated. For a tensor
that requires grad, the proof walks its autograd history back to those marks; an edge it cannot see through (an
input that did not require grad, inside glue code between units) leaves it unproven. Unproven tensors are never
averaged: at worst a replicated tensor keeps the shares (the mean over the group is still the unpatched gradient,
only not the unpatched backward of the replicated part); a sharded tensor is never averaged. Each rank decides
from its own graph, which is the same on every rank (the same code on the same shapes), so the ranks reduce alike.

Not covered: compiled code, ``compile=True`` or diffusers' ``compile_repeated_blocks`` (a trace has no autograd
history to walk: the units' arguments keep the shares, the mean over the group is still the unpatched gradient;
the routed attention's replicated inputs are still averaged), reentrant checkpointing (its blocks' inputs are detached leaves) and the recomputation of
non-reentrant checkpointing (its graph is discarded; the forward's averages stand).

>>> from hfpatch.patches.dit.streams import units
>>> from hfpatch.testing import tiny_wan_transformer
>>> [path for path, _ in units(tiny_wan_transformer())][-4:]
['blocks.0', 'blocks.1', 'norm_out', 'proj_out']
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ...core.patch import Patch
from ...distributed.gradients import grads_averaged_over_group

__all__ = ["ReplicatedStreams", "install_streams", "units"]


def units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(path, module)`` of the model's units: its direct children, with ``ModuleList``/``ModuleDict`` children
    replaced by their elements (recursively: FLUX.3's ``mode_blocks.image.0``). Pure."""

    def expand(path: str, module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for name, child in module.named_children():
                yield from expand(f"{path}.{name}", child)
        else:
            yield path, module

    return [unit for name, child in model.named_children() for unit in expand(name, child)]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``value``: itself, or those of a tuple/list/mapping, recursively."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)


def _replace(value: Any, new: dict[int, torch.Tensor]) -> Any:
    """``value`` with each tensor whose ``id`` is in ``new`` replaced (same containers otherwise)."""
    if isinstance(value, torch.Tensor):
        return new.get(id(value), value)
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_replace(item, new) for item in value)
    if type(value) is dict:
        return {key: _replace(item, new) for key, item in value.items()}
    return value


def _active() -> bool:
    """Gradients are recorded by this forward (not a compiled trace, not a checkpoint's recomputation in backward)."""
    return (
        torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and torch._C._current_graph_task_id() == -1
    )


#: What a tensor of the call is known to be (a walk combines them: sharded wins, then unknown).
SHARDED, UNKNOWN, REPLICATED = -1, 0, 1


class ReplicatedStreams:
    """What the tensors of the current forward are known to be over the ``sp`` group (module docstring).

    Held by the model's :class:`~hfpatch.patches.dit.sequence_parallel.SequenceShard`; the split, gather and
    attention mark what they make, the modules' hooks (:func:`install_streams`) ask, mark and average.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.on = False
        #: autograd node -> SHARDED, UNKNOWN or REPLICATED, for this call.
        self._nodes: dict[Any, int] = {}
        #: id -> (tensor without grad, what it is); held for the call, so that its id stays its own.
        self._values: dict[int, tuple[torch.Tensor, int]] = {}
        #: The averaging nodes of this call (a tensor that went through one is not averaged again).
        self._averaged: set[Any] = set()
        #: Per module call in progress: what it is (None when it holds hfpatch machinery: nothing marked after).
        self._calls: list[int | None] = []
        #: Whether this call cut anything yet: before its first split, everything it computed is replicated.
        self._cut = False

    # ------------------------------------------------------------------------------------------- call
    def begin(self, inputs: Any) -> None:
        """A new forward whose inputs (nested args/kwargs) are replicated; off outside autograd recording."""
        self.end()
        self.on = _active()
        if self.on:
            self.replicated(*_tensors(inputs))

    def end(self) -> None:
        """Forget the call (drops the autograd nodes and tensors it held)."""
        self.on = False
        self._nodes.clear()
        self._values.clear()
        self._averaged.clear()
        self._calls.clear()
        self._cut = False

    # ------------------------------------------------------------------------------------------- marks
    def replicated(self, *tensors: torch.Tensor, force: bool = False) -> None:
        """Mark ``tensors`` as the same on every rank of the group (a gather's output, a joint attention's);
        ``force``: even over a mark of sharded (the plan says so: :class:`~.vocabulary.ReplicatedInput`)."""
        self._mark(tensors, REPLICATED, force)

    def sharded(self, *tensors: torch.Tensor) -> None:
        """Mark ``tensors`` as this rank's own (a split's output, the attention's output for the shard)."""
        self._mark(tensors, SHARDED, False)

    def _mark(self, tensors: tuple[torch.Tensor, ...], state: int, force: bool) -> None:
        if not self.on or torch.compiler.is_compiling():
            return
        self._cut = self._cut or state == SHARDED
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            if t.grad_fn is not None:
                node = t.grad_fn
                self._nodes[node] = state if force else min(state, self._nodes.get(node, state))
                continue
            # A view's storage belongs to its base: what views it is what the base is (a replicated tensor's base
            # was computed with it; a split's output is a copy, its own base).
            for value in (t, t._base):
                if value is not None:
                    old = self._values.get(id(value))
                    keep = state if force or old is None or old[0] is not value else min(state, old[1])
                    self._values[id(value)] = (value, keep)

    def state(self, t: torch.Tensor) -> int:
        """What ``t`` is known to be in this call: SHARDED, UNKNOWN or REPLICATED (module docstring)."""
        if t.grad_fn is not None:
            return self._walk(t.grad_fn)
        if t.requires_grad:  # a leaf: a parameter, or an input the caller made requiring grad
            return REPLICATED
        states = [
            found[1]
            for v in (t, t._base)
            if v is not None and (found := self._values.get(id(v))) is not None and found[0] is v
        ]
        return min(states) if states else UNKNOWN

    def proven(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is proven replicated in this call."""
        return self.state(t) == REPLICATED

    def _walk(self, root: Any) -> int:
        """Back from ``root``: SHARDED if a path reaches a sharded mark; else UNKNOWN if one goes through an input
        without grad (of unknown origin); else REPLICATED (every path ends at a replicated mark or a leaf)."""
        nodes = self._nodes
        stack = [root]
        while stack:
            node = stack[-1]
            if node in nodes:
                stack.pop()
                continue
            pending, state = [], REPLICATED
            for parent, _ in node.next_functions:
                seen = UNKNOWN if parent is None else nodes.get(parent)
                if seen is None:
                    pending.append(parent)
                elif seen == SHARDED:
                    state = SHARDED
                    break
                else:
                    state = min(state, seen)
            if state != SHARDED and pending:
                stack.extend(pending)
                continue
            nodes[node] = state
            stack.pop()
        return nodes[root]

    # ------------------------------------------------------------------------------------------- modules
    def enter(self, machinery: bool, averages: bool, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A module's call. With replicated arguments only (and no hfpatch machinery inside), a replicated
        computation; with a sharded one (or machinery), a computation on the shard, which takes its replicated
        arguments through an average (``averages``; those not averaged on their way in already)."""
        if torch.compiler.is_compiling():  # nothing to walk in a trace; no Python state touched either
            return None
        if not self.on or not _active():
            self._calls.append(None)
            return None
        if not self._cut and not machinery:  # nothing rank-dependent ran yet in this forward
            self._calls.append(REPLICATED)
            return None
        found = list(_tensors((args, kwargs)))
        states = [self.state(t) for t in found]
        call = SHARDED if machinery else min(states, default=REPLICATED)
        self._calls.append(None if machinery else call)
        if call != SHARDED or not averages:
            return None
        streams = {
            id(t): t
            for t, state in zip(found, states)
            if state == REPLICATED and t.grad_fn is not None and t.grad_fn not in self._averaged
        }
        if not streams:
            return None
        averaged = self.average(*streams.values())
        new = dict(zip(streams, averaged))
        return _replace(args, new), _replace(kwargs, new)

    def average(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``tensors`` (replicated) through one :func:`~hfpatch.distributed.gradients.grads_averaged_over_group`:
        the shares of their gradient that the shard's computation hands back are averaged before their backward."""
        averaged = grads_averaged_over_group(tensors, self.group)
        if self.on and not torch.compiler.is_compiling():
            self.replicated(*averaged)
            self._averaged.update(t.grad_fn for t in averaged if t.grad_fn is not None)
        return averaged

    def leave(self, output: Any) -> None:
        """The end of a module's call: what it computed from replicated (sharded) arguments only is replicated
        (sharded); a call with machinery inside marked its own outputs."""
        if torch.compiler.is_compiling() or not self._calls:
            return
        call = self._calls.pop()
        if self.on and call is not None and call != UNKNOWN:
            self._mark(tuple(_tensors(output)), call, False)


def install_streams(
    model: torch.nn.Module, streams: ReplicatedStreams, machinery: set[str], routed: set[str], patch: Patch
) -> None:
    """Hook every submodule of ``model`` to ``streams``, through ``patch``: a call that computes on the shard averages
    the replicated streams it takes in; a call with replicated arguments only marks its outputs replicated (which
    lets the proof see past the inputs without grad used inside it: rotary tables, masks).

    ``machinery``: submodule paths where hfpatch splits, gathers or routes attention; a module holding one of them
    is never a replicated computation, whatever its arguments. ``routed``: the routed attention modules, which
    average their replicated inputs themselves, after their projections
    (:func:`~hfpatch.patches.dit.sequence_parallel.usp_attention_call`).
    """
    for path, module in model.named_modules():
        if not path:
            continue
        holds = any(m == path or m.startswith(f"{path}.") for m in machinery)

        def enter(_module, args, kwargs, holds=holds, averages=path not in routed):
            return streams.enter(holds, averages, args, kwargs)

        def leave(_module, _args, _kwargs, output):
            streams.leave(output)

        patch.add_forward_pre_hook(module, enter)
        patch.add_forward_hook(module, leave, always_call=True)
