"""Registry of patch families, keyed by qualified class-name strings and matched along the MRO.

Keys look like ``"diffusers.WanTransformer3DModel"``: the top-level package plus the class name, so a
subclass of a supported class matches and no HF module is imported to build the registry. Families are
given as ``"module:Class"`` strings and imported on first lookup.

A class that copies a supported class's code in another package (SimpleTuner ships its own
``WanTransformer3DModel``, not a subclass of diffusers') is patched as that class once registered with
:func:`register_like`, which checks that the two take the same arguments.

Classes no family patches can be *refused* with a reason (:meth:`Registry.register_refusals`): a table of class
key -> reason, or of class name -> reason for one library (``"module:NAME"``, imported on the first lookup), so
that :func:`hfpatch.apply` says why instead of only that nothing matched.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

from .config import ModelFacts, ParallelConfig

__all__ = ["LikeRegistration", "PatchFamily", "Registry", "class_key", "register_like"]

#: Classes patched as another class (:func:`register_like`) -> that class's key. Weak: a class that goes away
#: (a test's copy) leaves no entry.
_LIKE: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()


def class_key(cls: type) -> str:
    """``"<top-level package>.<ClassName>"``, e.g. ``"diffusers.AutoencoderKL"``; for a class registered with
    :func:`register_like`, the key of the class it copies."""
    like = _LIKE.get(cls)
    return like if like is not None else f"{cls.__module__.split('.')[0]}.{cls.__name__}"


class PatchFamily:
    """One HF target family. Subclass it once per family (see ``hfpatch/patches/``).

    Class attributes:
        name: Short name used in ``repr`` and errors (``"wan_transformer"``).
        options: Option name -> default. Options not listed here are rejected with ``TypeError``.
        role: ``"transformer"``, ``"vae"``, ``"pipeline"`` or ``"model"`` (shown by ``hfpatch info``). A
            pipeline's components are patched before the pipeline itself (see :func:`hfpatch.apply`).
        split_axis: Mesh axis over which the family splits the module's work (``"sp"``, ``"vae"``) or
            ``None``. Gradients of a split module are averaged over this axis (DDP/FSDP2 do;
            :func:`hfpatch.all_reduce_gradients` in a plain loop); see :mod:`hfpatch.distributed.gradients`.

    A family is stateless: :func:`hfpatch.apply` calls :meth:`facts` and :meth:`validate` on every rank
    before any collective or mutation, then :meth:`apply`, which must mutate only through the given
    :class:`~hfpatch.core.patch.Patch`.
    """

    name: ClassVar[str] = "family"
    options: ClassVar[dict[str, Any]] = {}
    role: ClassVar[str] = "model"
    split_axis: ClassVar[str | None] = None

    def facts(self, target: Any) -> ModelFacts:
        """Facts for the planner (head count, whether it guides)."""
        return ModelFacts(name=type(target).__name__)

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        """Raise ``ValueError``/``TypeError`` if ``target`` cannot run ``config`` with ``options``. Must be pure."""

    def supersedes(self, options: dict[str, Any]) -> frozenset[str]:
        """Names of the other families of the same target that this one replaces with these ``options``.

        :func:`hfpatch.apply` drops them before any check: they neither validate nor apply, and an option only
        they take is refused. The streaming patch of a Wan transformer, say, runs the sequence split itself, so
        with ``streaming=`` set it replaces the DiT family (``"dit_usp"``). Default: none. Must be pure.
        """
        return frozenset()

    def apply(self, target: Any, patch: Any, mesh: Any, options: dict[str, Any]) -> None:
        """Mutate ``target`` through ``patch`` (a :class:`~hfpatch.core.patch.Patch`)."""
        raise NotImplementedError


class Registry:
    """Maps class keys to patch families (several families may serve one class)."""

    def __init__(self) -> None:
        self._entries: dict[str, list[type[PatchFamily] | str]] = {}
        #: (library or None, table or "module:NAME"), loaded into ``_refusals`` (class key -> reason) on first use.
        self._refusal_sources: list[tuple[str | None, Mapping[str, str] | str]] = []
        self._refusals: dict[str, str] = {}

    def register(self, key: str, family: type[PatchFamily] | str) -> None:
        """Register ``family`` (a class or ``"module:Class"``) for the class named ``key``."""
        if not isinstance(key, str) or "." not in key:
            raise ValueError(f"registry keys look like 'diffusers.WanTransformer3DModel', got {key!r}")
        families = self._entries.setdefault(key, [])
        if family in families:
            raise ValueError(f"{family!r} is already registered for {key}")
        families.append(family)

    def unregister(self, key: str, family: type[PatchFamily] | str) -> None:
        self._entries[key].remove(family)
        if not self._entries[key]:
            del self._entries[key]

    @contextmanager
    def registered(self, key: str, family: type[PatchFamily] | str) -> Iterator[None]:
        """Register for the duration of a ``with`` block (tests, scripts)."""
        self.register(key, family)
        try:
            yield
        finally:
            self.unregister(key, family)

    def families_for(self, obj: Any) -> list[PatchFamily]:
        """Instantiated families for ``obj``, most specific class first; empty when unsupported."""
        return self.families_for_class(type(obj))

    def families_for_class(self, klass: type) -> list[PatchFamily]:
        """:meth:`families_for` for a class."""
        found: list[PatchFamily] = []
        seen: set[type] = set()
        for cls in klass.__mro__:
            for entry in self._entries.get(class_key(cls), []):
                family_cls = _load(entry)
                if family_cls not in seen:
                    seen.add(family_cls)
                    found.append(family_cls())
        return found

    def register_refusals(self, reasons: Mapping[str, str] | str, library: str | None = None) -> None:
        """Refuse classes with a reason: ``reasons`` maps a class key (``"diffusers.AutoencoderOobleck"``) to why
        hfpatch does not patch it, or, with ``library`` (``"diffusers"``), a bare class name of that top-level
        package; or it is ``"module:NAME"`` of such a mapping, imported on the first lookup."""
        if library is not None and (not isinstance(library, str) or not library or "." in library):
            raise ValueError(f"refusals are registered per top-level package ('diffusers'), got {library!r}")
        self._refusal_sources.append((library, reasons))

    def refusal_for(self, obj: Any) -> tuple[str, str] | None:
        """``(class name, reason)`` when ``obj``'s class is refused, ``None`` otherwise.

        Along the MRO, the first class that has families or a refusal decides: a subclass of a supported class is
        not refused by its parent's neighbours, and a class with families is never refused.

        >>> registry = Registry()
        >>> registry.register_refusals({"dict": "a mapping, not a model"}, library="builtins")
        >>> registry.refusal_for({})
        ('dict', 'a mapping, not a model')
        >>> registry.refusal_for([]) is None
        True
        """
        return self._refused_class(type(obj))

    def refusal(self, obj: Any) -> str | None:
        """Why no family patches ``obj`` (:meth:`refusal_for`'s reason), else ``None``."""
        return self.refusal_for_class(type(obj))

    def refusal_for_class(self, cls: type) -> str | None:
        """:meth:`refusal` for a class."""
        refused = self._refused_class(cls)
        return None if refused is None else refused[1]

    def _refused_class(self, klass: type) -> tuple[str, str] | None:
        while self._refusal_sources:
            library, source = self._refusal_sources.pop(0)
            table = _load(source) if isinstance(source, str) else source
            self._refusals.update({f"{library}.{k}" if library else k: v for k, v in table.items()})
        for cls in klass.__mro__:
            key = class_key(cls)
            if key in self._entries:
                return None
            if key in self._refusals:
                return key.split(".", 1)[1], self._refusals[key]
        return None

    def supported(self) -> dict[str, list[str]]:
        """Class key -> family names (imports the families)."""
        return {key: [_load(e).name for e in entries] for key, entries in sorted(self._entries.items())}


def _load(entry: Any) -> Any:
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        return getattr(importlib.import_module(module), attr)
    return entry


# ----------------------------------------------------------------------------------------------- register_like
class LikeRegistration:
    """What :func:`register_like` returns: :meth:`remove` (or leaving its ``with`` block) undoes it."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def remove(self) -> None:
        _LIKE.pop(self.cls, None)

    def __enter__(self) -> LikeRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _signature_differences(cls: type, like: type) -> list[str]:
    """How ``cls``'s ``forward`` and ``__init__`` differ from ``like``'s: parameter names, order, kinds and
    defaults (what a plan's inputs and the config are named by)."""
    differences = []
    for method in ("forward", "__init__"):
        mine, theirs = (getattr(c, method, None) for c in (cls, like))
        if mine is None or theirs is None:
            differences.append(f"{method}: {cls.__name__} has {'one' if mine else 'none'}, {like.__name__} "
                               f"{'has one' if theirs else 'none'}")  # fmt: skip
            continue
        a, b = inspect.signature(mine).parameters, inspect.signature(theirs).parameters
        if list(a) != list(b):
            differences.append(f"{method} takes ({', '.join(a)}), {like.__name__}.{method} ({', '.join(b)})")
            continue
        for name in a:
            if (a[name].kind, a[name].default) != (b[name].kind, b[name].default):
                differences.append(
                    f"{method}'s {name}: {a[name].kind.description} = {a[name].default!r} here, "
                    f"{b[name].kind.description} = {b[name].default!r} in {like.__name__}"
                )
    return differences


def register_like(cls: type, like: type, registry: Registry) -> LikeRegistration:
    """Patch ``cls`` as the supported class ``like`` of ``registry``, whose code it copies from another package
    (:func:`hfpatch.register_like`: the default registry).

    For a trainer's own copy of a diffusers model (SimpleTuner's ``WanTransformer3DModel``): not a subclass of
    diffusers' class, so nothing matches it along its MRO. From this call on, ``cls`` is patched with
    ``like``'s families and plan (:func:`class_key` answers ``like``'s key for it). Checked here: ``like`` is a
    class hfpatch patches, ``cls`` is not already one of its subclasses, and their ``forward`` and ``__init__``
    take the same parameters (names, order, kinds, defaults); a difference raises ``ValueError`` naming it.
    Not checkable here: that the copy COMPUTES what ``like`` does (a rope that returns another layout, a
    processor of its own). Verify that as hfpatch's tests do, patched against unpatched on 2 and 3 ranks
    (``tests/core/test_register_like.py`` is the recipe).

    Returns a :class:`LikeRegistration`: ``remove()`` undoes it; usable as a context manager.

    >>> import torch
    >>> from hfpatch.core.registry import Registry, register_like
    >>> class Copy(torch.nn.Module): ...
    >>> try:
    ...     register_like(Copy, torch.nn.Linear, Registry())
    ... except ValueError as error:
    ...     print(str(error).split(":")[0])
    Linear is not a class hfpatch patches
    """
    if not isinstance(cls, type) or not isinstance(like, type):
        raise TypeError(f"register_like takes two classes, got {cls!r} and {like!r}")
    if not registry.families_for_class(like):
        raise ValueError(
            f"{like.__name__} is not a class hfpatch patches: register a copy of one of the supported classes "
            "(`hfpatch info` lists them)"
        )
    if issubclass(cls, like):
        raise ValueError(f"{cls.__name__} is a subclass of {like.__name__}: hfpatch patches it already")
    differences = _signature_differences(cls, like)
    if differences:
        raise ValueError(
            f"{cls.__module__}.{cls.__name__} does not take the arguments {like.__module__}.{like.__name__} takes, "
            f"so {like.__name__}'s plan does not fit it: " + "; ".join(differences)
        )
    _LIKE[cls] = class_key(like)
    return LikeRegistration(cls)
