"""``hfpatch.apply``: validate everything on every rank, agree, then mutate through one :class:`Patch`.

This is the top of the package: it joins the core (:class:`Patch`, plans, the registry), the process groups
(:mod:`hfpatch.distributed.runtime`) and the built-in families (:mod:`hfpatch.patches`); nothing in those
imports it (``tests/test_imports.py`` checks the layers).

When the plan spans several ranks, the ranks first run a short handshake (:func:`_handshake`, over the
default group's store, bounded by ``HFPATCH_TIMEOUT_S``): each posts what it was asked to do (target class
and config, resolved plan and options, or the error its own checks raised). Ranks that were given different
arguments, or where only some ranks' checks failed, raise the same :class:`ApplyMismatchError` listing every
rank's call; ranks whose peers never call ``apply`` raise
:class:`hfpatch.distributed.runtime.CollectiveError` within the timeout. Nothing is patched on any rank then.

The handshake also carries a fingerprint of every parameter and buffer of the target
(:func:`hfpatch.distributed.agreement.weight_digests`, folded into one digest): ranks that hold different
weights (a model or adapter initialised without a common seed, another checkpoint) raise the same
:class:`~hfpatch.distributed.agreement.WeightMismatchError`, naming the tensors. After patching, a
:class:`~hfpatch.distributed.agreement.WeightWatch` keeps that fingerprint in every same-input check of the
patched calls, so an adapter added later on some ranks only, or initialised per rank, is refused at the next
call.
"""

from __future__ import annotations

import hashlib
import re
import types
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch

from .core.config import ModelFacts, ParallelConfig, resolve_parallel
from .core.patch import MARKER, Patch, get_patch
from .core.ranks import topology
from .core.registry import PatchFamily, Registry, class_key
from .distributed import runtime
from .distributed.agreement import (
    WeightMismatchError,
    WeightWatch,
    fold_digests,
    weight_digests,
    weights_mismatch_message,
)
from .distributed.stored import UnsupportedTensorError
from .patches import default_registry

__all__ = ["ApplyMismatchError", "WeightMismatchError", "apply", "get_patch", "plan_of"]


class ApplyMismatchError(ValueError):
    """The ranks called ``hfpatch.apply`` with different arguments (raised alike on every rank; nothing patched)."""


def _is_pipeline(obj: Any) -> bool:
    return any(class_key(c) == "diffusers.DiffusionPipeline" for c in type(obj).__mro__)


def _units(target: Any, registry: Registry) -> list[tuple[Any, list[PatchFamily]]]:
    """(object, families) to patch: a pipeline's components found by type, then the pipeline itself."""
    if not _is_pipeline(target):
        return [(target, registry.families_for(target))]
    units = []
    seen: set[int] = set()
    for component in target.components.values():
        if isinstance(component, torch.nn.Module) and id(component) not in seen:
            seen.add(id(component))
            families = registry.families_for(component)
            if families:
                units.append((component, families))
    units.append((target, registry.families_for(target)))
    return units


def _vae_notes(target: Any, registry: Registry, config: ParallelConfig) -> list[str]:
    """For a pipeline: one line per VAE component (a component named ``*vae*``, or one whose class is refused)
    saying whether it is split over the ranks and, if not, why."""
    if not _is_pipeline(target):
        return []
    notes = []
    for name, component in target.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        what = f"{name}: {type(component).__name__}"
        family = next((f for f in registry.families_for(component) if f.role == "vae"), None)
        refusal = registry.refusal(component)
        if family is not None and config.vae > 1:
            notes.append(f"{what} split by height over {config.vae} ranks ({family.name})")
        elif family is not None:
            notes.append(f"{what} not split: one VAE rank (ParallelConfig(vae=1) or a world of one)")
        elif refusal is not None:
            notes.append(f"{what} not split: {refusal}")
        elif "vae" in name.lower():
            notes.append(f"{what} not split: hfpatch has no split for this class yet")
    return notes


#: What to do with a class hfpatch cannot split (``apply``'s refusals).
_RUN_WHOLE = (
    "run it whole on every rank instead: apply hfpatch to its pipeline with a CFG/data-only plan, e.g. "
    "parallel=ParallelConfig(cfg=2) or ParallelConfig(data=N); `hfpatch info` lists the classes it splits"
)


def _refusal_text(obj: Any, refused: tuple[str, str], module: bool = False) -> str:
    name, reason = refused
    shown = type(obj).__name__ if name == type(obj).__name__ else f"{type(obj).__name__} (a {name})"
    if module:
        shown += f" ({type(obj).__module__})"
    return f"hfpatch does not split {shown} over ranks: {reason}"


def _unsupported(target: Any, registry: Registry) -> TypeError:
    """The error for a target no family patches: the reason when its class is refused, else the supported ones."""
    refused = registry.refusal_for(target)
    if refused is not None and type(target).__module__.split(".")[0] == "transformers":
        # A transformers model has no pipeline to run whole: its reason says what to do; its module is named.
        return TypeError(f"{_refusal_text(target, refused, module=True)}.")
    if refused is not None:
        return TypeError(f"{_refusal_text(target, refused)}. To use several ranks, {_RUN_WHOLE}.")
    cls = type(target)
    names = {key: key.split(".", 1)[1] for key in registry.supported()}  # "diffusers.X" -> "X"
    supported = sorted(names.values())
    listed = ", ".join(supported) or "none registered"
    # The built-in registry has dozens of classes: `hfpatch info` prints them with their families.
    if len(listed) > 240:
        listed = f"{len(supported)} classes, listed by `hfpatch info`"
    # A trainer's own copy of a diffusers class (SimpleTuner's WanTransformer3DModel) has the supported one's name.
    namesakes = sorted(key for key, name in names.items() if name == cls.__name__)
    same_name = (
        f"; hfpatch supports {', '.join(namesakes)}, another class of the same name: this one is not a subclass of "
        f"it (a copy of its code in another package?). If it computes what that class does, "
        f"`hfpatch.register_like({cls.__name__}, {namesakes[0]})` patches it as that class"
        if namesakes
        else ""
    )
    return TypeError(
        f"hfpatch has no patch for {cls.__name__} ({cls.__module__}){same_name}; supported classes: {listed}"
    )


def _refuse_split_components(target: Any, parallel: ParallelConfig, registry: Registry) -> None:
    """Sequence parallelism asked of a pipeline whose transformers are all refused: say why (``ValueError``)."""
    if not _is_pipeline(target):
        return
    for name, component in target.components.items():
        # The denoisers only: a refused VAE or vocoder is run whole and named in the patch's notes instead.
        if "transformer" not in name or not isinstance(component, torch.nn.Module):
            continue
        refused = registry.refusal_for(component)
        if refused is not None:
            raise ValueError(
                f"ulysses={parallel.ulysses}, ring={parallel.ring} split {type(target).__name__}'s transformer, but "
                f"{_refusal_text(component, refused)}; {_RUN_WHOLE}"
            )


def _drop_superseded(
    units: list[tuple[Any, list[PatchFamily]]], options: dict[str, Any]
) -> tuple[list[tuple[Any, list[PatchFamily]]], dict[str, str]]:
    """``units`` without the families that another family of the same object replaces given its options
    (:meth:`~hfpatch.core.registry.PatchFamily.supersedes`), and ``{dropped family: the family replacing it}``."""
    kept, dropped = [], {}
    for obj, families in units:
        replaced: dict[str, str] = {}
        for family in families:
            for name in family.supersedes({k: options[k] for k in family.options}):
                replaced[name] = family.name
        kept.append((obj, [f for f in families if f.name not in replaced]))
        dropped.update(
            {f"{f.name} ({type(obj).__name__})": replaced[f.name] for f in families if f.name in replaced}
        )
    return kept, dropped


def _merge_facts(units: list[tuple[Any, list[PatchFamily]]], target: Any) -> ModelFacts:
    heads: list[int] = []
    blocks: list[int] = []
    guides = False
    for obj, families in units:
        for family in families:
            facts = family.facts(obj)
            if facts.num_heads is not None:
                heads.append(facts.num_heads)
            if facts.num_blocks is not None:
                blocks.append(facts.num_blocks)
            guides = guides or facts.guides
    return ModelFacts(
        num_heads=min(heads) if heads else None,
        guides=guides,
        name=type(target).__name__,
        pipeline=_is_pipeline(target),
        num_blocks=min(blocks) if blocks else None,
        splits_vae=any(family.role == "vae" for _, families in units for family in families),
    )


def _requested_world(parallel: int | ParallelConfig | None) -> int | None:
    if isinstance(parallel, ParallelConfig):
        return parallel.world_size
    if isinstance(parallel, int) and not isinstance(parallel, bool):
        return parallel
    return None


def _text(value: Any) -> str:
    """``repr`` without memory addresses (the same object on every rank prints alike)."""
    if isinstance(value, ParallelConfig):
        return _config_text(value)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def _config_text(config: ParallelConfig) -> str:
    """``ParallelConfig(ring=2, ulysses=2)``: the degrees that are not their default."""
    defaults = ParallelConfig()
    product = config.data * config.cfg * config.pipefusion * config.ring * config.ulysses
    shown = [
        f"{f.name}={getattr(config, f.name)}"
        for f in fields(config)
        if getattr(config, f.name) != (product if f.name == "vae" else getattr(defaults, f.name))
    ]
    return f"ParallelConfig({', '.join(shown)})"


def _portable(value: Any) -> Any:
    """A config value without the entries that may differ between machines (paths, versions, private keys)."""
    if isinstance(value, Mapping):
        return {
            str(k): _portable(v)
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
            if not str(k).startswith("_") and not str(k).endswith(("_version", "name_or_path"))
        }
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    return value


def _model_digest(target: Any) -> str:
    """Short digest of the model configs of ``target`` (and of a pipeline's components)."""
    objects = list(target.components.values()) if _is_pipeline(target) else [target]
    parts = []
    for obj in objects:
        config = getattr(obj, "config", None)
        try:
            if isinstance(config, Mapping):  # diffusers: a FrozenDict of the constructor's arguments
                items = dict(config)
            elif hasattr(config, "to_dict"):  # transformers
                items = config.to_dict()
            else:
                continue
        except Exception:  # an unusual config object: compared by type only
            items = {}
        parts.append(f"{type(obj).__name__}:{_text(_portable(items))}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=6).hexdigest()


def plan_of(
    target: Any,
    parallel: int | ParallelConfig | None,
    world_size: int,
    *,
    node_size: int | None = None,
    peer_access: bool | None = None,
    pipefusion: bool = False,
) -> tuple[ParallelConfig, ModelFacts]:
    """The plan ``hfpatch.apply(target, parallel)`` resolves on ``world_size`` ranks of ``node_size`` per node, and
    the facts it planned from; patches nothing, runs no family check and starts no group (``hfpatch plan`` calls
    it on a pipeline built on the meta device).

    >>> from hfpatch.testing import tiny_wan_transformer
    >>> plan_of(tiny_wan_transformer(), 8, 8, node_size=4)[0]  # 4 heads, two nodes of 4
    ParallelConfig(data=1, cfg=1, ring=2, ulysses=4, vae=1)
    """
    facts = _merge_facts(_units(target, default_registry()), target)
    config = resolve_parallel(
        parallel, world_size, facts, pipefusion=pipefusion, node_size=node_size, peer_access=peer_access
    )
    return config, facts


def _plan(target: Any, parallel: Any, options: dict[str, Any]) -> ParallelConfig:
    """The plan ``apply(target, parallel, **options)`` resolves in this launch, without the families' checks and
    without patching anything (``hfpatch.from_pretrained`` reads it to know which weights each rank keeps)."""
    world = runtime.launched_world_size()
    return plan_of(target, parallel, world, pipefusion=options.get("pipefusion", False), **topology())[0]


def _differences(existing: Patch, config: ParallelConfig, options: dict[str, Any]) -> list[str]:
    """``"key: live -> asked"`` for the plan and each option that differ between a live patch and a new call."""
    missing = object()
    out = []
    if existing.plan != config:
        out.append(f"plan: {_text(existing.plan)} now, {_text(config)} asked")
    for key in sorted(set(existing.options) | set(options)):
        old, new = existing.options.get(key, missing), options.get(key, missing)
        if old != new:
            shown = ("not an option" if v is missing else _text(v) for v in (old, new))
            out.append("{}: {} now, {} asked".format(key, *shown))
    return out


def _check(
    target: Any, parallel: Any, registry: Registry, options: dict[str, Any]
) -> tuple[list[tuple[Any, list[PatchFamily]]], ParallelConfig, dict[str, Any], Patch | None]:
    """Every local check of ``apply``: (units, plan, resolved options, the live identical patch or None)."""
    units = _units(target, registry)
    if not any(families for _, families in units):
        raise _unsupported(target, registry)

    known: dict[str, Any] = {}
    for _, families in units:
        for family in families:
            known.update(family.options)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
            f"{type(target).__name__}; known: {', '.join(sorted(known)) or 'none'}"
        )
    units, dropped = _drop_superseded(units, {**known, **options})
    live: dict[str, Any] = {}
    for _, families in units:
        for family in families:
            live.update(family.options)
    stray = sorted(set(options) - set(live))
    if stray:
        replaced = "; ".join(f"{by} replaces {name}" for name, by in sorted(dropped.items()))
        raise TypeError(
            f"option{'s' if len(stray) > 1 else ''} {', '.join(map(repr, stray))} of {type(target).__name__} "
            f"belong{'' if len(stray) > 1 else 's'} to a patch that the other options replace ({replaced}), so "
            f"{'they' if len(stray) > 1 else 'it'} would do nothing; options that apply: {', '.join(sorted(live))}"
        )
    resolved_options = {**live, **options}

    facts = _merge_facts(units, target)
    if isinstance(parallel, ParallelConfig) and parallel.sequence_parallel > 1 and facts.num_heads is None:
        _refuse_split_components(target, parallel, registry)
    requested = _requested_world(parallel)
    runtime.check_launchable(requested or 1)  # no process group and no launcher: say how to launch
    world = runtime.launched_world_size()  # reads the launcher's environment; initialises nothing
    config = resolve_parallel(
        parallel, world, facts, pipefusion=resolved_options.get("pipefusion", False), **topology()
    )

    existing = get_patch(target)
    if existing is not None:
        if existing.plan == config and existing.options == resolved_options:
            return units, config, resolved_options, existing
        owner = f" as part of {existing.part_of}" if existing.part_of else ""
        raise ValueError(
            f"{type(target).__name__} is already patched{owner} with other settings "
            f"({'; '.join(_differences(existing, config, resolved_options))}); call patch.remove() before "
            "applying it again with these, or pass the same arguments to get the live patch back"
        )
    for obj, _ in units:
        if get_patch(obj) is not None:
            raise ValueError(
                f"{type(obj).__name__} inside {type(target).__name__} is already patched by another hfpatch.apply; "
                "remove that patch first"
            )

    for obj, families in units:
        for family in families:
            family.validate(obj, config, {k: resolved_options[k] for k in family.options})
    return units, config, resolved_options, None


def _handshake(
    target: Any,
    parallel: Any,
    options: dict[str, Any],
    config: ParallelConfig | None,
    resolved_options: dict[str, Any] | None,
    error: Exception | None,
    digests: dict[str, list[int]] | None = None,
) -> None:
    """Check that every rank made the same ``apply`` call; raise :class:`ApplyMismatchError` alike on all if not.

    ``digests`` (:func:`~hfpatch.distributed.agreement.weight_digests` of the target) travel folded into one
    digest; when only they differ, a second exchange of every tensor's digest names the tensors that differ.

    Raises:
        WeightMismatchError: The same call, but the ranks hold different weights.
        CollectiveError: A rank did not call ``apply`` within ``HFPATCH_TIMEOUT_S``.
    """
    call = ", ".join(
        [type(target).__name__, f"parallel={_text(parallel)}"]
        + [f"{k}={_text(v)}" for k, v in sorted(options.items())]
    )
    mine = {
        "call": f"hfpatch.apply({call})",
        "parallel": _text(parallel),
        "target": type(target).__name__,
        "model": _model_digest(target),
        "plan": None if config is None else _text(config),
        "options": None
        if resolved_options is None
        else [[k, _text(v)] for k, v in sorted(resolved_options.items())],
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "weights": None if digests is None else fold_digests(digests),
    }
    every = runtime.exchange(
        "apply",
        mine,
        what="hfpatch.apply",
        hint="; a rank that passes parallel=1 runs alone and takes no part",
    )
    compared = ("target", "model", "plan", "options", "error")
    if all(all(p[k] == every[0][k] for k in compared) for p in every):
        if all(p["weights"] == every[0]["weights"] for p in every):
            return
        # The same call on different weights: every rank sends every tensor's digest to name them.
        tables = runtime.exchange("apply weights", {"digests": digests or {}}, what="hfpatch.apply")
        raise WeightMismatchError(
            weights_mismatch_message(
                [t["digests"] for t in tables], list(range(len(tables))), type(target).__name__
            )
            + " Nothing was patched on any rank."
        )
    lines: dict[str, list[int]] = {}
    models = {p["model"] for p in every}
    for rank, p in enumerate(every):
        line = p["call"]
        if p["error"] is not None:
            line += f" raised {p['error']}"
        elif p["plan"] is not None and p["plan"] != p["parallel"]:
            line += f" -> plan {p['plan']}"
        if len(models) > 1:
            line += f" (model config digest {p['model']})"
        lines.setdefault(line, []).append(rank)
    listing = "\n".join(
        f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {line}"
        for line, ranks in lines.items()
    )
    hint = (
        " The models differ too (their config digests are shown): build the same model on every rank."
        if len(models) > 1
        else ""
    )
    mismatch = ApplyMismatchError(
        "hfpatch.apply: every rank must call hfpatch.apply with the same target and arguments (the ranks compute "
        f"one result together), but they did not; nothing was patched on any rank:\n{listing}\n"
        f"Pass the same parallel= and options on every rank (do not derive them from the rank).{hint}"
    )
    raise mismatch from error


def apply(
    target: Any,
    parallel: int | ParallelConfig | None = None,
    *,
    registry: Registry | None = None,
    **options: Any,
) -> Patch:
    """Patch ``target`` in place and return the :class:`Patch` that undoes it.

    Every rank must call this with the same arguments. All checks run before any collective or mutation,
    so invalid input raises the same error on every rank and leaves ``target`` untouched. When the plan spans
    several ranks, a short handshake (bounded by ``HFPATCH_TIMEOUT_S``) then checks that every rank made the
    same call; every process group the patch communicates over is hfpatch's own, with that timeout.

    Args:
        target: A diffusers ``DiffusionPipeline``, a diffusers model (DiT transformer or VAE) or a
            transformers ``PreTrainedModel``. A pipeline's components are found by type.
        parallel: ``None`` (the current world size), an int number of ranks (planned automatically; read
            ``patch.plan``) or an explicit :class:`hfpatch.ParallelConfig`.
        registry: Registry to look families up in (default: the built-in one).
        **options: Feature options of the target's families (``hfpatch info`` lists them).

    Returns:
        The live :class:`Patch`; ``patch.remove()`` (or leaving a ``with`` block) restores the originals.

    Raises:
        TypeError: Unsupported target (the reason when hfpatch refuses its class, else the supported classes) or
            an unknown option.
        ValueError: Degrees that do not fit the world or the model, or a conflicting second apply.
        ApplyMismatchError: (a ``ValueError``) The ranks called ``apply`` with different targets, arguments
            or model configs, or its checks failed on some ranks only: raised alike on every rank, listing
            each rank's call.
        RuntimeError: More than one rank requested without torch.distributed or a launcher environment.
        CollectiveError: (a ``RuntimeError``, :mod:`hfpatch.distributed.runtime`) Not every rank called
            ``apply`` (or joined the process group) within ``HFPATCH_TIMEOUT_S``.

    >>> import hfpatch, torch
    >>> from hfpatch.testing import tiny_autoencoder_kl
    >>> vae = tiny_autoencoder_kl()
    >>> with hfpatch.apply(vae) as patch:
    ...     patch.plan.world_size
    1
    """
    registry = registry or default_registry()
    runtime.check_launch_agrees()  # the launcher started N processes that torch.distributed/accelerate must see
    error: Exception | None = None
    config = resolved_options = existing = None
    units: list[tuple[Any, list[PatchFamily]]] = []
    try:
        units, config, resolved_options, existing = _check(target, parallel, registry, options)
    except Exception as exc:  # raised below, after the other ranks heard of it
        error = exc
    # Several ranks compute together: agree on the call before any group is created (bounded wait).
    world = runtime.launched_world_size()
    digests = None
    if world > 1 and _requested_world(parallel) != 1 and (config is None or config.world_size > 1):
        if error is None and existing is None and _checks_weights(resolved_options):
            try:
                digests = weight_digests(_weight_modules(target))
            except UnsupportedTensorError as exc:  # every rank holds the same classes: raised alike, below
                error = UnsupportedTensorError(
                    f"hfpatch.apply cannot compare the ranks' weights of {type(target).__name__}: {exc}. Pass "
                    "check_inputs=False to skip the same-weights check (then nothing checks that every rank holds "
                    "the same weights)"
                )
        try:
            runtime.ensure_process_group(world)
            _handshake(target, parallel, options, config, resolved_options, error, digests)
        except runtime.CollectiveError as exc:
            if error is None:
                raise
            if hasattr(error, "add_note"):  # this rank's own error stays the one to fix first
                error.add_note(str(exc))
    if error is not None:
        raise _short(error)
    assert config is not None and resolved_options is not None
    if existing is not None:
        return existing

    mesh = runtime.get_mesh(config)  # the first collective: every check above passed on every rank

    top = Patch(name=type(target).__name__, plan=config, options=resolved_options, requested=dict(options))
    top.notes.extend(_vae_notes(target, registry, config))
    try:
        patches: list[tuple[Any, Patch]] = []
        for obj, families in units:
            child = top
            if obj is not target:
                child = Patch(type(obj).__name__, plan=config, options=resolved_options, part_of=top.name)
                top.add_child(child)
            for family in families:
                changes = child.change_count()
                family.apply(obj, child, mesh, {k: resolved_options[k] for k in family.options})
                if child.change_count() > changes:  # the families that changed something (repr)
                    child.families[family.name] = family.role
                if family.split_axis is not None and mesh.size(family.split_axis) > 1:
                    child.reduce_group = mesh.group(family.split_axis)
            patches.append((obj, child))
        if digests is not None:
            _watch_weights(target, top, patches, digests)
        for obj, child in patches:
            child.set_attr(obj, MARKER, child, keep_when_disabled=True)  # get_patch works inside disabled()
            child.refuse_copies(obj)
    except BaseException as exc:
        try:
            top.remove()
        except BaseException as rollback_error:  # keep the original error; say the rollback failed too
            exc.add_note(f"hfpatch: rolling back the partial patch also failed: {rollback_error!r}")
        raise
    return top


def _checks_weights(options: dict[str, Any] | None) -> bool:
    """Whether ``apply`` compares the ranks' weights (``check_inputs=False`` turns every agreement check off)."""
    return options is None or options.get("check_inputs", True) is not False


def _weight_modules(target: Any) -> list[tuple[str, torch.nn.Module]]:
    """``(prefix, module)`` whose parameters and buffers the ranks compare: a model, or a pipeline's
    ``torch.nn.Module`` components by name (text encoders and VAEs included)."""
    if not _is_pipeline(target):
        return [("", target)] if isinstance(target, torch.nn.Module) else []
    found: list[tuple[str, torch.nn.Module]] = []
    for name, component in target.components.items():
        if isinstance(component, torch.nn.Module) and all(component is not m for _, m in found):
            found.append((name, component))
    return found


def _watch_weights(
    target: Any, top: Patch, patches: list[tuple[Any, Patch]], digests: dict[str, list[int]]
) -> None:
    """Keep the weights' fingerprint in the same-input checks of every patched module's calls.

    Modules whose weights FSDP shards (``shard_weights``, or the user's ``fully_shard``) are left out: each
    rank holds another shard of them by design (their full weights were compared above, before sharding).
    """
    modules = [
        (name, module)
        for name, module in _weight_modules(target)
        if not any(cls.__name__ == "FSDPModule" for m in module.modules() for cls in type(m).__mro__)
    ]
    if not modules:
        return
    watch = WeightWatch(modules, type(target).__name__, digests)
    top.on_remove(target, "weight watch", watch.close)
    for obj, child in patches:
        if isinstance(obj, torch.nn.Module):
            watch.enter(child, obj)


def _short(error: Exception) -> Exception:
    """``error`` with a traceback of one frame, where it was raised (the frames of hfpatch's checks between
    ``apply`` and that line say nothing to the caller, and every rank prints them)."""
    tb = error.__traceback__
    if tb is None or not isinstance(error, (ValueError, TypeError, RuntimeError)):
        return error
    while tb.tb_next is not None:
        tb = tb.tb_next
    return error.with_traceback(types.TracebackType(None, tb.tb_frame, tb.tb_lasti, tb.tb_lineno))
