"""Sequence-parallel glue shared by the DiT patches: a sharding plan interpreted by hooks.

A DiT family declares *where* its token sequence is cut and gathered as a plan, a dict from submodule path
(``""`` is the model itself) to specs:

* :class:`SplitInput` shards a named argument of that submodule's ``forward`` before it runs
  (:class:`MeasureInput` only takes the sequence length from one; :class:`FullLength` turns a token count read off
  a cut tensor back into the whole sequence's),
* :class:`SplitOutput` shards what the submodule returns (one element of a tuple output with ``index``),
* :class:`GatherOutput` gathers the submodule's output back to the full, unpadded sequence.

A path may use ``*`` for one whole segment (``"transformer_blocks.*"``: every block, as in diffusers'
``_cp_plan``); :func:`expand_plan` resolves such paths against a model (a pattern matching nothing is an
error, and specs of paths that resolve to the same submodule are concatenated in plan order).

:func:`apply_sequence_plan` turns each entry into a forward (pre-)hook registered through a
:class:`~hfpatch.core.patch.Patch`, so ``patch.remove()`` drops them all. The family then swaps the
self-attention processors for USP-aware ones that read the per-call geometry from the shared
:class:`~hfpatch.patches.dit.shard.SequenceShard` (re-exported here).

Layout (:mod:`hfpatch.attention.layout`): the sequence is zero-padded at the end to a multiple of ``N``
(the ``sp`` group size, ``ring * ulysses``) and cut into ``N`` equal shards; shard ``p`` lives on the rank
whose index in the ``sp`` group is ``p``. Padded tokens are masked as keys inside the attention and trimmed
at the gather, so they never reach the output; a tuple or list (rotary ``(cos, sin)``, ControlNet
residuals) has each of its tensors sharded the same way.

Gradients (:mod:`hfpatch.distributed.gradients`): every rank computes the same loss from the full output;
the gather's backward scales the gradient by ``N`` and takes this rank's slice, so each rank's parameter
gradients are ``N`` times its shard's share and their MEAN over the ``sp`` group (what DDP and FSDP2
compute, or :func:`hfpatch.all_reduce_gradients` in a plain loop) is the unpatched gradient. Inputs of the
model that require grad have their gradient averaged over the group in backward: every rank hands the full
input gradient to whatever produced the input.

>>> from hfpatch.patches.dit.vocabulary import GatherOutput, SplitInput, SplitOutput
>>> plan = {  # Wan's plan
...     "": (SplitInput("timestep", dim=1, ndim=2),),      # per-token timesteps [B, S] only
...     "rope": (SplitOutput(dim=1),),                     # (cos, sin), each [1, S, 1, D]
...     "blocks.0": (SplitInput("hidden_states", dim=1),),
...     "proj_out": (GatherOutput(dim=1),),
... }
>>> from hfpatch.testing import tiny_wan_transformer
>>> from hfpatch.patches.dit.sequence_parallel import check_plan
>>> check_plan(tiny_wan_transformer(), plan)   # every path and argument exists
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ...core.config import ModelFacts, ParallelConfig
from ...core.dropout import refuse_dropout
from ...core.patch import Patch
from ...core.registry import PatchFamily
from ...distributed.agreement import check_same_inputs, named_arguments
from ...distributed.gradients import average_input_gradients
from .shard import SequenceShard
from .streams import install_streams
from .vocabulary import (
    FullLength,
    GatherOutput,
    MeasureInput,
    ReplicatedInput,
    ReplicatedOutput,
    SequencePlan,
    Spec,
    SplitInput,
    SplitOutput,
)

__all__ = [
    "SequenceParallelFamily",
    "SequenceShard",
    "apply_sequence_plan",
    "check_plan",
    "expand_plan",
    "usp_attention_call",
]


# ----------------------------------------------------------------------------------------------- interpreter
#: The specs that act on a submodule's arguments (a forward pre-hook).
_INPUT_SPECS = (SplitInput, MeasureInput, FullLength, ReplicatedInput)


def _map_tensors(value: Any, fn) -> Any:
    """Apply ``fn`` to a tensor, or to each tensor of a tuple/list/dict (other values pass through)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return type(value)(fn(v) for v in value)
    if type(value) is dict and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        return {k: fn(v) for k, v in value.items()}  # AnyFlow's rotary {"query": ..., "key": ...}
    return value


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a tensor or of a tuple/list/dict of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    return []


def _argument(args: Sequence[Any], kwargs: dict[str, Any], name: str, position: int) -> Any:
    """The value of forward argument ``name`` (at ``position`` when passed positionally; ``None`` when absent)."""
    return kwargs.get(name, args[position] if position < len(args) else None)


def _cut_element(value: Any, fn, index: int | None) -> Any:
    """:func:`_map_tensors` on ``value``, or only on its element ``index`` (a tuple/list; ``None`` passes)."""
    if index is None:
        return _map_tensors(value, fn)
    if value is None:
        return value
    items = list(value)
    items[index] = _map_tensors(items[index], fn)
    return type(value)(items)


def _splitter(state: SequenceShard, dim: int, ndim: int | None, where: str, joint: str | None = None):
    def split(x: torch.Tensor) -> torch.Tensor:
        if ndim is not None and x.dim() != ndim:
            return x
        if joint is not None:
            return state.split_joint(x, dim % x.dim(), joint, where)
        return state.split(x, dim % x.dim(), where)

    return split


def _resolve(root: torch.nn.Module, path: str) -> torch.nn.Module:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError as exc:
        raise ValueError(
            f"sequence-parallel plan names {path!r}, which {type(root).__name__} does not have"
        ) from exc


def _positions(
    module: torch.nn.Module, specs: list[SplitInput | MeasureInput | FullLength | ReplicatedInput], path: str
) -> dict[str, int]:
    params = list(inspect.signature(module.forward).parameters)
    for spec in specs:
        if spec.name not in params:
            raise ValueError(
                f"sequence-parallel plan splits argument {spec.name!r} of {path or 'the model'} "
                f"({type(module).__name__}), whose forward takes {params}"
            )
    return {spec.name: params.index(spec.name) for spec in specs}


def _matches(pattern: list[str], name: str) -> bool:
    parts = name.split(".")
    return len(parts) == len(pattern) and all(p in ("*", n) for p, n in zip(pattern, parts))


def _last_child(model: torch.nn.Module, path: str) -> str:
    """``path`` with each ``-1`` segment replaced by the index of the last module of that list."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part == "-1":
            parent = _resolve(model, ".".join(parts[:i]))
            if not isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)) or not len(parent):
                raise ValueError(
                    f"sequence-parallel plan names {path!r}: {'.'.join(parts[:i]) or 'the model'} is not a "
                    "non-empty list of modules"
                )
            parts[i] = str(len(parent) - 1)
    return ".".join(parts)


def expand_plan(model: torch.nn.Module, plan: SequencePlan) -> dict[str, tuple[Spec, ...]]:
    """``plan`` with every ``*`` path replaced by the submodule paths it matches (in module order), and every
    ``-1`` segment by the index of the last module of that list (``"blocks.-1"``: the last block). Pure.

    Raises:
        ValueError: A pattern that matches no submodule of ``model``.

    >>> from hfpatch.testing import tiny_wan_transformer
    >>> list(expand_plan(tiny_wan_transformer(), {"blocks.*": (SplitInput("hidden_states", dim=1),)}))
    ['blocks.0', 'blocks.1']
    """
    expanded: dict[str, tuple[Spec, ...]] = {}
    names: list[str] | None = None
    for path, specs in plan.items():
        path = _last_child(model, path)
        if "*" in path:
            if names is None:
                names = [name for name, _ in model.named_modules() if name]
            pattern = path.split(".")
            found = [name for name in names if _matches(pattern, name)]
            if not found:
                raise ValueError(
                    f"sequence-parallel plan names {path!r}, which matches no submodule of {type(model).__name__}"
                )
        else:
            found = [path]
        for name in found:
            expanded[name] = expanded.get(name, ()) + tuple(specs)
    return expanded


def check_plan(model: torch.nn.Module, plan: SequencePlan) -> None:
    """Raise ``ValueError`` if ``plan`` names a submodule or an argument ``model`` does not have. Pure."""
    for path, specs in expand_plan(model, plan).items():
        _positions(_resolve(model, path), [s for s in specs if isinstance(s, _INPUT_SPECS)], path)


def _input_hook(
    module: torch.nn.Module,
    specs: list[SplitInput | MeasureInput | FullLength | ReplicatedInput],
    state: SequenceShard,
    path: str,
):
    positions = _positions(module, specs, path)

    def split_inputs(_module, args, kwargs):
        args = list(args)
        for spec in specs:
            if isinstance(
                spec, ReplicatedInput
            ):  # averaged by the unit's own hook (.streams), which runs next
                value = _argument(args, kwargs, spec.name, positions[spec.name])
                state.streams.replicated(*_flat_tensors(value), force=True)
                continue
            if isinstance(spec, FullLength):
                position = positions[spec.name]
                value = _argument(args, kwargs, spec.name, position)
                if not isinstance(value, int) or state.local_len is None or value < state.local_len:
                    raise ValueError(
                        f"sequence-parallel plan at {path}:{spec.name} expects a token count of at least this "
                        f"call's shard ({state.local_len} tokens, set by an earlier split of the plan), got {value!r}"
                    )
                full = value - state.local_len + state.valid_len
                if spec.name in kwargs:
                    kwargs[spec.name] = full
                else:
                    args[position] = full
                continue
            if isinstance(spec, MeasureInput):
                value = _argument(args, kwargs, spec.name, positions[spec.name])
                if isinstance(value, torch.Tensor):
                    state.measure(value.shape[spec.dim], f"{path}:{spec.name}")
                continue
            split = _splitter(state, spec.dim, spec.ndim, f"{path}:{spec.name}", spec.joint)
            cut = functools.partial(_cut_element, fn=split, index=spec.index)
            if spec.name in kwargs:
                kwargs[spec.name] = cut(kwargs[spec.name])
            elif positions[spec.name] < len(args):
                args[positions[spec.name]] = cut(args[positions[spec.name]])
        return tuple(args), kwargs

    return split_inputs


def apply_sequence_plan(
    model: torch.nn.Module,
    plan: SequencePlan,
    state: SequenceShard,
    patch: Patch,
    check_inputs: bool = True,
) -> set[str]:
    """Install ``plan`` on ``model`` as hooks logged in ``patch``; returns the submodule paths it hooked.

    Checks the whole plan first (:func:`check_plan`), then registers: a pre-hook on the model that starts
    a new call (:meth:`SequenceShard.begin`) after checking that every rank of the ``sp`` group was given
    the same arguments (``check_inputs``; :func:`hfpatch.distributed.agreement.check_same_inputs`), one
    pre-hook per submodule with :class:`SplitInput` specs, one hook per :class:`SplitOutput` or
    :class:`GatherOutput`.

    A submodule replaced after ``apply`` (peft wraps ``proj_out`` in a ``lora.Linear`` when a LoRA is loaded,
    and unwraps it when unloaded) gets the hooks moved to it at the next call: left on the wrapped base
    layer, a gather would run before the LoRA term is added to the local shard.
    """
    plan = expand_plan(model, plan)
    check_plan(model, plan)
    installed: dict[str, tuple[torch.nn.Module, list[Any]]] = {}

    def install(path: str, specs: tuple[Spec, ...]) -> None:
        module = _resolve(model, path)
        handles = []
        inputs = [s for s in specs if isinstance(s, _INPUT_SPECS)]
        if inputs:
            handles.append(patch.add_forward_pre_hook(module, _input_hook(module, inputs, state, path)))
        for spec in specs:
            if isinstance(spec, SplitOutput):
                if spec.flatten_to is not None and spec.flatten_from != spec.dim:
                    raise ValueError(
                        f"sequence-parallel plan at {path!r}: flatten_to needs flatten_from = dim (the token grid "
                        f"starts where the cut is), got dim={spec.dim}, flatten_from={spec.flatten_from}"
                    )
                where = f"{path}:output" + ("" if spec.index is None else f"[{spec.index}]")
                split = _splitter(state, spec.dim, spec.ndim, where, spec.joint)
                replicated = (
                    None
                    if spec.replicated is None
                    else (
                        spec.replicated,
                        _positions(module, [MeasureInput(spec.replicated, spec.dim)], path),
                    )
                )

                def split_output(
                    _m,
                    args,
                    kwargs,
                    out,
                    split=split,
                    flatten_from=spec.flatten_from,
                    flatten_to=spec.flatten_to,
                    index=spec.index,
                    dim=spec.dim,
                    replicated=replicated,
                    where=where,
                ):
                    if replicated is not None:  # this call's sequence: what the replicated part leaves
                        name, positions = replicated
                        part = _argument(args, kwargs, name, positions[name])
                        whole = (out if index is None else out[index]).shape[dim]
                        state.measure(whole - part.shape[dim], where)

                    def cut_grid(x: torch.Tensor) -> torch.Tensor:
                        # The stock code flattens dims flatten_from..flatten_to itself: hand the cut tokens back
                        # with size-1 dims in place of the others.
                        last = flatten_to % x.dim()
                        shard = split(x.flatten(flatten_from, last))
                        kept = shard.shape
                        return shard.view(
                            *kept[: flatten_from + 1], *[1] * (last - flatten_from), *kept[flatten_from + 1 :]
                        )

                    def cut(x: torch.Tensor) -> torch.Tensor:
                        if flatten_to is not None:
                            return cut_grid(x)
                        return split(x if flatten_from is None else x.flatten(flatten_from))

                    return _cut_element(out, cut, index)

                handles.append(patch.add_forward_hook(module, split_output))
            elif isinstance(spec, GatherOutput):

                def gather_output(
                    _m,
                    _args,
                    _kwargs,
                    out,
                    dim=spec.dim,
                    joint=spec.joint,
                    index=spec.index,
                    recut=spec.recut,
                    where=path,
                ):
                    def gather(x):
                        return (
                            state.gather(x, dim, recut)
                            if joint is None
                            else state.gather_joint(x, dim, joint, where, recut)
                        )

                    if index is None:
                        return gather(out)
                    items = list(out)
                    items[index] = gather(items[index])
                    return type(out)(items)

                handles.append(patch.add_forward_hook(module, gather_output))
            elif isinstance(spec, ReplicatedOutput):

                def replicated_output(_m, _args, _kwargs, out):
                    # Every rank computes the same loss from it: its gradient is the full one on every rank, on
                    # which the replicated stream runs its backward (:mod:`.streams`); nothing to change.
                    state.streams.replicated(*(t for t in _flat_tensors(out)))

                handles.append(patch.add_forward_hook(module, replicated_output))
        installed[path] = (module, handles)

    what = f"{type(model).__name__}.forward"

    def begin_call(_module, args, kwargs):
        # Dropout that draws in this forward (a LoRA's lora_dropout, added before or after apply): refused before
        # any collective, the same on every rank (the ranks hold the same model).
        refuse_dropout(model, "sequence-parallel forward")
        # First, before any collective whose shape depends on the inputs: the ranks split ONE sample.
        named = named_arguments(type(model).forward, (model, *args), kwargs)
        named.pop("self", None)
        check_same_inputs(named, state.group, what=what, enabled=check_inputs)
        for path, specs in plan.items():
            hooked, handles = installed[path]
            if path and _resolve(model, path) is not hooked:
                for handle in handles:
                    handle.remove()
                install(path, specs)
        state.begin()
        # A trained module upstream (text encoder, adapter) then gets the full gradient on every rank.
        args, kwargs = average_input_gradients((args, kwargs), state.group)
        state.streams.begin((args, kwargs))
        return args, kwargs

    def end_call(_module, _args, _kwargs, _output):
        state.streams.end()  # the call's autograd nodes are not held past it

    patch.add_forward_pre_hook(model, begin_call)
    patch.add_forward_hook(model, end_call, always_call=True)
    for path, specs in plan.items():
        install(path, specs)
    return set(plan)


# ----------------------------------------------------------------------------------------------- family base
class SequenceParallelFamily(PatchFamily):
    """Base of the DiT USP families: a plan, the self-attention modules, and their USP processor.

    A subclass sets ``plan`` (or overrides :meth:`plan_for`) and implements :meth:`attention_modules` (with
    the class name(s) of the stock processor each one must have) and :meth:`make_processors`
    (:class:`hfpatch.patches.dit.PlannedDiTUSP`: stand-ins running the stock processor code). :meth:`apply` is a
    no-op when ``ring * ulysses == 1`` (other families may share the same ``hfpatch.apply`` call), and when
    ``pipefusion > 1``: the PipeFusion family then runs Ulysses/Ring inside its stages.

    Options: ``check_inputs`` (the same-input check, default on); ``exchange`` (how the Ulysses exchange runs:
    ``None``, exact and blocking; ``"overlap"``, ``"fp8"``, ``"fp8+overlap"`` or an
    :class:`hfpatch.attention.exchange.ExchangeConfig`; needs ``ulysses > 1``, FP8 refused under training unless
    asked for by name and with ``compile=True``); ``compile=True`` runs the model's ``forward``
    through ``torch.compile(fullgraph=True)`` (``compile_backend``, default inductor): the splits, the routed
    attention and the collectives (single custom ops, :mod:`hfpatch.distributed.collectives`) compile into one
    graph with no break, forward and backward, while the model-level hooks (the same-input check, the input
    gradient averaging, the per-call geometry reset) run eagerly around it. ``patch.remove()`` restores the
    eager ``forward``.
    """

    role: ClassVar[str] = "transformer"
    split_axis: ClassVar[str | None] = "sp"
    plan: ClassVar[SequencePlan] = {}
    options: ClassVar[dict[str, Any]] = {
        "check_inputs": True,
        "compile": False,
        "compile_backend": "inductor",
        "exchange": None,
    }

    def plan_for(self, target: Any) -> SequencePlan:
        """The sequence plan of ``target`` (default: the class attribute ``plan``)."""
        return self.plan

    def attention_modules(self, target: Any) -> list[tuple[str, torch.nn.Module, str | tuple[str, ...]]]:
        """``(path, attention module, stock processor class name(s))`` of every attention to swap."""
        raise NotImplementedError

    def make_processors(self, target: Any, state: SequenceShard) -> list[tuple[str, torch.nn.Module, Any]]:
        """``(path, attention module, USP processor)`` for every module of :meth:`attention_modules`."""
        raise NotImplementedError

    def facts(self, target: Any) -> ModelFacts:
        return ModelFacts(num_heads=target.config.num_attention_heads, name=type(target).__name__)

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        self.check_compile(target, config, options)
        self.check_exchange(target, config, options)
        if config.sequence_parallel == 1 or config.pipefusion > 1:  # PipeFusion runs sp in its stages
            return
        check_plan(target, self.plan_for(target))
        for path, attention, stock in self.attention_modules(target):
            found = type(attention.processor).__name__
            accepted = (stock,) if isinstance(stock, str) else tuple(stock)
            if found not in accepted:
                raise ValueError(
                    f"{type(target).__name__}.{path} uses attention processor {found}; sequence parallelism "
                    f"replaces only the stock {' or '.join(accepted)}. Restore it (e.g. "
                    "model.set_default_attn_processor() or unload the IP-Adapter) before hfpatch.apply, "
                    "or use ring=ulysses=1."
                )

    def check_exchange(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        """Raise ``ValueError`` for a bad ``exchange`` option, or one that configures no Ulysses exchange."""
        from ...attention.exchange import ExchangeConfig

        exchange = ExchangeConfig.parse(options["exchange"])
        if exchange is None:
            return
        if config.ulysses == 1 or config.pipefusion > 1:
            raise ValueError(
                f"exchange={options['exchange']!r} configures the Ulysses exchange of {type(target).__name__}, but the "
                f"plan {config} has none (ulysses = 1, or PipeFusion); drop exchange= or plan ulysses > 1"
            )
        if exchange.lossy and options["compile"]:
            raise ValueError(
                "exchange: the FP8 exchange runs in eager mode only (compiled code exchanges exactly); drop "
                "compile=True or the FP8 exchange"
            )

    def check_compile(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        """Raise ``ValueError`` for bad ``compile``/``compile_backend`` options, or ``compile=True`` without a split."""
        if not isinstance(options["compile"], bool):
            raise ValueError(f"compile must be a bool, got {options['compile']!r}")
        if options["compile"]:
            from ...core.compile import check_compile_backend

            check_compile_backend(
                options["compile_backend"], False, f"hfpatch.apply({type(target).__name__})"
            )
            if config.sequence_parallel == 1 or config.pipefusion > 1:
                raise ValueError(
                    f"compile=True compiles the sequence-parallel forward of {type(target).__name__}, but the plan "
                    f"{config} has none (ring * ulysses = 1, or PipeFusion); compile a one-rank model with "
                    "torch.compile(model), a streaming one with StreamingConfig(compile=True)"
                )

    def apply(self, target: Any, patch: Patch, mesh: Any, options: dict[str, Any]) -> None:
        if (
            mesh.config.sequence_parallel == 1 or mesh.config.pipefusion > 1
        ):  # PipeFusion runs sp in its stages
            return
        from ...attention.exchange import ExchangeConfig

        state = SequenceShard(
            mesh.group("sp"),
            mesh.group("ulysses"),
            mesh.group("ring"),
            ExchangeConfig.parse(options["exchange"]),
        )
        hooked = apply_sequence_plan(
            target, self.plan_for(target), state, patch, check_inputs=bool(options["check_inputs"])
        )
        swapped = self.make_processors(target, state)
        for _, attention, processor in swapped:
            patch.swap_processor(attention, processor)
        # Replicated streams entering the shard get their gradient averaged before their backward (.streams).
        routed = {path for path, _, _ in swapped}
        install_streams(target, state.streams, (hooked | routed) - {""}, routed, patch)

        def check_attention_swaps(_module, args, kwargs):
            # fuse_qkv_projections() / set_attn_processor() after apply would install stock processors that
            # attend within each rank's shard only: a wrong result of the right shape. Same check on every rank.
            for path, attention, processor in swapped:
                if attention.processor is not processor:
                    raise RuntimeError(
                        f"{type(target).__name__}.{path}.processor was replaced after hfpatch.apply (by "
                        f"{type(attention.processor).__name__}, e.g. fuse_qkv_projections() or "
                        "set_attn_processor()); it would attend within this rank's shard only. Call those before "
                        "hfpatch.apply, or patch.remove() and apply again."
                    )

        patch.add_forward_pre_hook(target, check_attention_swaps)
        if options.get("compile"):
            from ...core.compile import compile_function

            # The forward only: the hooks above run eagerly around the compiled graph. Shapes follow torch's
            # default (static, then dynamic after a new shape), so another resolution compiles at most once more.
            patch.wrap_method(
                target,
                "forward",
                lambda forward: compile_function(forward, backend=options["compile_backend"], dynamic=None),
            )


# ----------------------------------------------------------------------------------------------- attention
def usp_attention_call(
    state: SequenceShard,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    joint: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    joint_position: str = "front",
    joint_key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    dense: Any = None,
    joined: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor:
    """``hfpatch.attention.usp.usp_attention`` on this call's shards (``bshd`` layouts, joint text replicated);
    ``backend``/``dense`` as there (Ring's kernel; the ring-degree-1 attention), the exchange as ``state.exchange``.
    ``joined``: return the output joined with the joint output where ``joint_position`` puts it
    (:func:`hfpatch.attention.usp.usp_attention_joined`: no concatenation under Ulysses)."""
    from ...attention.usp import usp_attention, usp_attention_joined

    if state.local_len is None or query.shape[1] != state.local_len:
        # E.g. model.forward(...) called directly: nn.Module hooks (the split) run only through model(...).
        raise RuntimeError(
            f"sequence-parallel attention got {query.shape[1]} query tokens but this call's shard holds "
            f"{state.local_len}: the model ran without its sequence split. Call model(...), not model.forward(...)."
        )
    joint_query, joint_key, joint_value = joint if joint is not None else (None, None, None)
    if (
        joint is not None
    ):  # replicated on every rank (the plan says so): the full gradient reaches their backward
        joint_query, joint_key, joint_value = state.streams.average(*joint)
    result = (usp_attention_joined if joined else usp_attention)(
        query,
        key,
        value,
        ulysses_group=state.ulysses_group,
        ring_group=state.ring_group,
        valid_len=state.valid_len,
        joint_query=joint_query,
        joint_key=joint_key,
        joint_value=joint_value,
        joint_position=joint_position,
        joint_key_mask=joint_key_mask,
        scale=scale,
        backend=backend,
        dense=dense,
        exchange=state.exchange,
    )
    if (
        joined
    ):  # the shard's tokens with the text in one tensor: sharded (as a concatenation of the two would be)
        state.streams.sharded(result)
        return result
    out, joint_out = result
    state.streams.sharded(out)
    if joint_out is not None:
        state.streams.replicated(joint_out)
    return out, joint_out
