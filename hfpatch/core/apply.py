"""``hfpatch.apply``: validate everything on every rank, then mutate through one :class:`Patch`."""

from __future__ import annotations

from typing import Any

import torch

from ..distributed import runtime
from .config import ModelFacts, ParallelConfig, resolve_parallel
from .patch import Patch
from .registry import PatchFamily, Registry, class_key, default_registry

__all__ = ["apply", "get_patch"]

#: Instance attribute holding the live patch of an object (removed with the patch).
MARKER = "_hfpatch_patch"


def get_patch(obj: Any) -> Patch | None:
    """The live :class:`Patch` applied to ``obj`` (directly or as a pipeline component), else ``None``."""
    patch = getattr(obj, "__dict__", {}).get(MARKER)
    return patch if patch is not None and patch.is_active else None


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


def _merge_facts(units: list[tuple[Any, list[PatchFamily]]], target: Any) -> ModelFacts:
    heads: list[int] = []
    guides = False
    for obj, families in units:
        for family in families:
            facts = family.facts(obj)
            if facts.num_heads is not None:
                heads.append(facts.num_heads)
            guides = guides or facts.guides
    return ModelFacts(
        num_heads=min(heads) if heads else None,
        guides=guides,
        name=type(target).__name__,
        pipeline=_is_pipeline(target),
    )


def _requested_world(parallel: int | ParallelConfig | None) -> int | None:
    if isinstance(parallel, ParallelConfig):
        return parallel.world_size
    if isinstance(parallel, int) and not isinstance(parallel, bool):
        return parallel
    return None


def apply(
    target: Any,
    parallel: int | ParallelConfig | None = None,
    *,
    registry: Registry | None = None,
    **options: Any,
) -> Patch:
    """Patch ``target`` in place and return the :class:`Patch` that undoes it.

    Every rank must call this with the same arguments. All checks run before any collective or mutation,
    so invalid input raises the same error on every rank and leaves ``target`` untouched.

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
        TypeError: Unsupported target (the supported classes are listed) or an unknown option.
        ValueError: Degrees that do not fit the world or the model, or a conflicting second apply.
        RuntimeError: More than one rank requested without torch.distributed or a launcher environment.

    >>> import hfpatch, torch
    >>> from hfpatch.testing import tiny_autoencoder_kl
    >>> vae = tiny_autoencoder_kl()
    >>> with hfpatch.apply(vae) as patch:
    ...     patch.plan.world_size
    1
    """
    registry = registry or default_registry()
    units = _units(target, registry)
    if not any(families for _, families in units):
        supported = ", ".join(k.split(".", 1)[1] for k in registry.supported()) or "none registered"
        raise TypeError(f"hfpatch has no patch for {type(target).__name__}; supported classes: {supported}")

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
    resolved_options = {**known, **options}

    facts = _merge_facts(units, target)
    requested = _requested_world(parallel)
    runtime.check_launchable(requested or 1)  # no process group and no launcher: say how to launch
    world = runtime.launched_world_size()  # reads the launcher's environment; initialises nothing
    config = resolve_parallel(parallel, world, facts)

    existing = get_patch(target)
    if existing is not None:
        if existing.plan == config and existing.options == resolved_options:
            return existing
        owner = f" as part of {existing.part_of}" if existing.part_of else ""
        raise ValueError(
            f"{type(target).__name__} is already patched{owner} with plan={existing.plan}, "
            f"options={existing.options}; call patch.remove() before applying plan={config}, "
            f"options={resolved_options}"
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

    mesh = runtime.get_mesh(config)  # the first collective: every check above passed on every rank

    top = Patch(name=type(target).__name__, plan=config, options=resolved_options)
    try:
        for obj, families in units:
            child = top
            if obj is not target:
                child = Patch(type(obj).__name__, plan=config, options=resolved_options, part_of=top.name)
                top.add_child(child)
            for family in families:
                family.apply(obj, child, mesh, {k: resolved_options[k] for k in family.options})
                if family.split_axis is not None and mesh.size(family.split_axis) > 1:
                    child.reduce_group = mesh.group(family.split_axis)
            child.set_attr(obj, MARKER, child)
            child.refuse_copies(obj)
    except BaseException as exc:
        try:
            top.remove()
        except BaseException as rollback_error:  # keep the original error; say the rollback failed too
            exc.add_note(f"hfpatch: rolling back the partial patch also failed: {rollback_error!r}")
        raise
    return top
