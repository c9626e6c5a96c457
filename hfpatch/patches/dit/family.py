"""Sequence parallelism (USP) for any diffusers DiT, driven by a plan instead of a hand-written family.

Two pieces of data describe a model; one family (:class:`PlannedDiTUSP`) interprets them.

**Where the sequence is cut and gathered.** diffusers declares it on many transformers as ``_cp_plan``
(``ContextParallelInput``/``ContextParallelOutput`` keyed by submodule path, ``*`` for every block);
:func:`plan_from_cp` translates it into hfpatch's :mod:`~hfpatch.patches.dit.sequence_parallel` specs, so the
split gets hfpatch's guarantees: end padding for token counts that do not divide the degree (masked keys,
trimmed gather), uneven heads, Ring with P2P overlap, Ulysses x Ring, exact backward, CPU/gloo. Models
without ``_cp_plan`` get their plan from :data:`PLANS` instead: a table entry, not a module.

hfpatch shards only the image/video tokens. The text is short and the text stream is cheap, so it stays
replicated on every rank and takes part in joint attention as the exact *joint* part of
:func:`~hfpatch.attention.usp.usp_attention`. Where diffusers' plan also cuts the
text (``encoder_hidden_states``, its mask, its ids, its rotary table), the table entry lists those entries as
``replicate``: they are dropped from the translated plan (and a stale entry that no longer names a plan entry
is an error). A text key mask (QwenImage's ``encoder_hidden_states_mask``, padded prompts) is honoured exactly
as ``joint_key_mask``; a cross-attention to the text (LTX's ``attn2``) needs no communication at all.

Which attention runs through USP, and how the stock processors are routed without modifying them, is
:mod:`hfpatch.patches.dit.processors`.

>>> from hfpatch.patches.dit import PLANS, plan_source
>>> from hfpatch.testing import tiny_qwenimage_transformer
>>> plan_source(tiny_qwenimage_transformer())
'_cp_plan'
>>> from hfpatch.patches.dit import PlannedDiTUSP
>>> sorted(PlannedDiTUSP().plan_for(tiny_qwenimage_transformer()))
['img_in', 'pos_embed', 'proj_out', 'transformer_blocks.*']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ...core.config import ModelFacts, ParallelConfig
from ...core.patch import Patch
from ...core.registry import class_key
from .plans import PLANS, UNSUPPORTED
from .processors import DISPATCH, SDPA, USPDispatchProcessor, route_kind, usp_dispatch_processor
from .sequence_parallel import SequenceParallelFamily, SequenceShard
from .vocabulary import AttentionRoute, DiTPlan, GatherOutput, SequencePlan, Spec, SplitInput, SplitOutput

__all__ = ["PlannedDiTUSP", "plan_from_cp", "plan_source"]


def _entry(target: Any) -> tuple[str, DiTPlan] | None:
    for cls in type(target).__mro__:
        key = class_key(cls)
        if key in PLANS:
            return key, PLANS[key]
    return None


def plan_source(target: Any) -> str | None:
    """``"_cp_plan"`` (diffusers' plan, translated), ``"hfpatch"`` (the table's own plan) or ``None``."""
    found = _entry(target)
    if found is None:
        return None
    return "hfpatch" if found[1].plan is not None else "_cp_plan"


# ----------------------------------------------------------------------------------------------- _cp_plan
def plan_from_cp(
    cp_plan: Mapping[str, Any], replicate: tuple[tuple[str, str | int], ...] = (), where: str = "_cp_plan"
) -> dict[str, tuple[Spec, ...]]:
    """hfpatch specs for a diffusers ``_cp_plan``, without the ``replicate`` entries. Pure.

    ``ContextParallelInput`` on an argument name is :class:`SplitInput` (``expected_dims`` is ``ndim``:
    tensors of other ranks pass replicated, as in diffusers), on an output index (``split_output=True``)
    :class:`SplitOutput` with that ``index``; ``ContextParallelOutput`` is :class:`GatherOutput`.

    Raises:
        ValueError: A construct hfpatch does not translate, or a ``replicate`` entry naming nothing.

    >>> from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
    >>> plan_from_cp({"": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
    ...                    "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
    ...               "proj_out": ContextParallelOutput(gather_dim=1)}, replicate=(("", "encoder_hidden_states"),))
    {'': (SplitInput(name='hidden_states', dim=1, ndim=3, joint=None, index=None),),
     'proj_out': (GatherOutput(dim=1, joint=None, index=None, recut=False),)}
    """
    unused = set(replicate)
    plan: dict[str, tuple[Spec, ...]] = {}
    for path, entry in cp_plan.items():
        specs: list[Spec] = []
        if isinstance(entry, Mapping):
            for key, inputs in entry.items():
                if (path, key) in unused or (path, key) in replicate:
                    unused.discard((path, key))
                    continue
                for cp in inputs if isinstance(inputs, (list, tuple)) else (inputs,):
                    dim, ndim = cp.split_dim, cp.expected_dims
                    if isinstance(key, int) and cp.split_output:
                        specs.append(SplitOutput(dim=dim, ndim=ndim, index=key))
                    elif isinstance(key, str) and not cp.split_output:
                        specs.append(SplitInput(key, dim=dim, ndim=ndim))
                    else:
                        raise ValueError(
                            f"{where}[{path!r}][{key!r}]: {cp!r} is not a form hfpatch translates"
                        )
        elif hasattr(entry, "gather_dim"):
            specs.append(GatherOutput(dim=entry.gather_dim))
        else:
            raise ValueError(
                f"{where}[{path!r}]: {entry!r} is not a form hfpatch translates (one gather per path)"
            )
        if specs:
            plan[path] = tuple(specs)
    if unused:
        raise ValueError(
            f"{where}: hfpatch's table keeps {sorted(map(str, unused))} replicated, but the plan has no such entry"
        )
    return plan


# ----------------------------------------------------------------------------------------------- family
class PlannedDiTUSP(SequenceParallelFamily):
    """USP for every class of :data:`PLANS`: the plan from ``_cp_plan`` or the table, the stock attention routed."""

    name: ClassVar[str] = "dit_usp"

    def _entry(self, target: Any) -> DiTPlan:
        found = _entry(target)
        if found is None:
            raise TypeError(f"hfpatch has no sequence-parallel plan for {type(target).__name__}")
        return found[1]

    def facts(self, target: Any) -> ModelFacts:
        heads = self._entry(target).heads
        count = heads(target.config) if callable(heads) else getattr(target.config, heads)
        return ModelFacts(num_heads=count, name=type(target).__name__)

    def plan_for(self, target: Any) -> SequencePlan:
        entry = self._entry(target)
        if entry.plan is not None:
            plan = dict(entry.plan)
        else:
            cp_plan = getattr(type(target), "_cp_plan", None)
            if not cp_plan:
                raise TypeError(
                    f"{type(target).__name__} declares no _cp_plan in this diffusers version and hfpatch's table has "
                    "no plan of its own for it"
                )
            plan = plan_from_cp(
                cp_plan, entry.replicate + entry.earlier, where=f"{type(target).__name__}._cp_plan"
            )
        for path, specs in entry.extra.items():
            plan[path] = plan.get(path, ()) + tuple(specs)
        return plan

    def _routes(self, target: Any) -> list[tuple[str, torch.nn.Module, AttentionRoute]]:
        from .sequence_parallel import expand_plan

        found = []
        for route in self._entry(target).attention:
            try:
                paths = expand_plan(target, {route.path: ()})
            except ValueError:
                if route.optional:
                    continue
                raise
            for path in paths:
                found.append((path, target.get_submodule(path), route))
        return found

    def attention_modules(self, target: Any) -> list[tuple[str, torch.nn.Module, tuple[str, ...]]]:
        return [(path, module, route.processors) for path, module, route in self._routes(target)]

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        self.check_compile(target, config, options)
        self.check_exchange(target, config, options)
        from ..caches import cache_names, check_caches

        if config.pipefusion > 1 and cache_names(target):
            raise ValueError(
                f"{type(target).__name__} has diffusers step caches enabled ({', '.join(cache_names(target))}); "
                "PipeFusion reuses stale activations of its own and does not compose with them: disable the cache"
            )
        if config.sequence_parallel == 1 or config.pipefusion > 1:  # PipeFusion runs sp in its stages
            return

        check_caches(target, sequence=config.sequence_parallel, cfg=1, data=1, two_call_cfg=False)
        if getattr(target, "_parallel_config", None) is not None:
            raise ValueError(
                f"{type(target).__name__} has diffusers' own context parallelism enabled (enable_parallelism); "
                "hfpatch replaces it: load the model without it before hfpatch.apply"
            )
        for attr, (value, reason) in self._entry(target).refuse_config.items():
            got = getattr(target.config, attr, None)
            if value(got) if callable(value) else got == value:
                raise ValueError(
                    f"{type(target).__name__} with {attr}={got!r} is not supported under sequence parallelism "
                    f"({reason})"
                )
        super().validate(target, config, options)
        for path, module, _ in self._routes(target):
            if route_kind(type(module.processor)) is None:
                raise ValueError(
                    f"{type(target).__name__}.{path}: {type(module.processor).__name__} calls neither {DISPATCH} "
                    f"nor F.{SDPA} from its __call__, so hfpatch cannot route its attention"
                )

    def make_processors(self, target: Any, state: SequenceShard) -> list[tuple[str, torch.nn.Module, Any]]:
        name = type(target).__name__
        return [
            (path, module, usp_dispatch_processor(module.processor, state, route.joint, f"{name}.{path}"))
            for path, module, route in self._routes(target)
        ]

    def apply(self, target: Any, patch: Patch, mesh: Any, options: dict[str, Any]) -> None:
        if (
            mesh.config.sequence_parallel == 1 or mesh.config.pipefusion > 1
        ):  # PipeFusion runs sp in its stages
            return
        entry = self._entry(target)
        refuse, check = dict(entry.refuse), entry.check
        if refuse or check is not None:
            from ...distributed.agreement import named_arguments

            def refuse_arguments(_module, args, kwargs):
                named = named_arguments(type(target).forward, (target, *args), kwargs)
                for name, reason in refuse.items():
                    if named.get(name) is not None and named.get(name) is not False:
                        raise ValueError(
                            f"{type(target).__name__}: {name}= is not supported under sequence parallelism ({reason}); "
                            "call without it, or patch.remove() first"
                        )
                if check is not None:
                    check(target, named)

            patch.add_forward_pre_hook(target, refuse_arguments)  # before the plan's first collective
        from ..caches import agree_caches, cache_hooks

        enabled = [hook for _, hook in cache_hooks(target)]

        def check_caches_unchanged(_module, args, kwargs):
            # A step cache enabled (or replaced) after apply would decide from this rank's shard alone.
            if [hook for _, hook in cache_hooks(target)] != enabled:
                raise RuntimeError(
                    f"{type(target).__name__}: a diffusers step cache was enabled or changed after hfpatch.apply; "
                    "its skip decisions would follow this rank's shard only. Enable the cache before "
                    "hfpatch.apply, or patch.remove() and apply again."
                )

        patch.add_forward_pre_hook(target, check_caches_unchanged)
        super().apply(target, patch, mesh, options)
        state = next(  # the stand-ins hold the model's SequenceShard
            module.processor.state
            for module in target.modules()
            if isinstance(getattr(module, "processor", None), USPDispatchProcessor)
        )
        agree_caches(target, state, patch)


# ----------------------------------------------------------------------------------------------- info
def support_table() -> list[tuple[str, str]]:
    """``(class name, how hfpatch shards it)`` for every transformer class the installed diffusers exports.

    What ``hfpatch info`` prints: the family and where its plan comes from (diffusers' ``_cp_plan``,
    translated; hfpatch's table; a family module of its own), or why not.
    """
    import diffusers.models.transformers as transformers

    from .. import default_registry

    supported = default_registry().supported()
    rows = []
    for name in sorted(dir(transformers)):
        cls = getattr(transformers, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            continue
        keys = [class_key(c) for c in cls.__mro__]
        usp = next((f for k in keys for f in supported.get(k, []) if f.endswith("usp")), None)
        entry = next((PLANS[k] for k in keys if k in PLANS), None)
        if entry is not None:
            rows.append((name, f"{usp} (plan: {'hfpatch table' if entry.plan is not None else '_cp_plan'})"))
        elif usp is not None:
            rows.append((name, f"{usp} (plan: hfpatch family module)"))
        else:
            why = UNSUPPORTED.get(name) or (
                "declares _cp_plan, no hfpatch table entry yet"
                if getattr(cls, "_cp_plan", None)
                else "no plan"
            )
            rows.append((name, f"not supported ({why})"))
    return rows
