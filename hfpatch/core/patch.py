"""Reversible, per-object patches.

A :class:`Patch` is an undo log. Every mutation hfpatch makes goes through one of its primitives
(:meth:`Patch.set_attr`, :meth:`Patch.wrap_method`, :meth:`Patch.swap_processor`,
:meth:`Patch.add_forward_pre_hook`, :meth:`Patch.add_forward_hook`, :meth:`Patch.on_remove`), which record
what was there before (the old object itself, or ``ABSENT``). :meth:`Patch.remove` replays the log in
reverse, so the patched objects get back the *identical* attributes, processors and hooks they had.

>>> import torch
>>> from hfpatch.core.patch import Patch
>>> layer = torch.nn.Linear(2, 2)
>>> before = dict(vars(layer))
>>> with Patch("demo") as patch:
...     _ = patch.wrap_method(layer, "forward", lambda orig: (lambda x: 2 * orig(x)))
...     patch.set_attr(layer, "note", "patched")
>>> dict(vars(layer)) == before and all(vars(layer)[k] is v for k, v in before.items())
True
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .ranks import data_position

__all__ = ["ABSENT", "MARKER", "Patch", "PatchError", "get_patch"]

#: Instance attribute holding the live patch of an object (set by ``hfpatch.apply``, removed with the patch).
MARKER = "_hfpatch_patch"


class _Absent:
    """Marker for 'this attribute did not exist on the instance'."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()

# nn.Module keeps submodules, parameters and buffers outside ``__dict__``.
_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")


class PatchError(RuntimeError):
    """Raised when a patch cannot be applied or removed consistently."""


def _instance_value(obj: Any, name: str) -> Any:
    """The value stored on the instance itself (not inherited from the class), or ABSENT."""
    if isinstance(obj, torch.nn.Module):
        for slot in _MODULE_SLOTS:
            store = obj.__dict__.get(slot, {})
            if name in store:
                return store[name]
    return obj.__dict__.get(name, ABSENT)


def _describe(obj: Any) -> str:
    name = getattr(obj, "_hfpatch_label", None)
    return name or f"{type(obj).__name__}@{id(obj):#x}"


@dataclass
class _Entry:
    kind: str  # "attr" | "hook" | "callback" | "child"
    obj: Any
    name: str
    old: Any = ABSENT
    new: Any = ABSENT  # the value the patch set (attr entries)
    handle: Any = None
    undo: Callable[[], None] | None = None
    keep: bool = False  # bookkeeping (the patch marker, copy refusal): stays while the patch is disabled

    def __str__(self) -> str:
        if self.kind == "attr":
            return f"{_describe(self.obj)}.{self.name} (was {'ABSENT' if self.old is ABSENT else type(self.old).__name__})"
        return f"{_describe(self.obj)}: {self.kind} {self.name}"


@dataclass
class Patch:
    """An applied hfpatch patch: an undo log plus what :func:`hfpatch.apply` resolved.

    Attributes:
        name: What was patched (for ``repr``).
        plan: The resolved :class:`hfpatch.ParallelConfig` (``None`` for patches without parallelism).
        options: The options the patch was applied with.
        children: Patches of components (a pipeline patch holds its transformer/VAE patches).
        part_of: For a component's patch, the name of the pipeline patch that owns it.
        reduce_group: Process group the patched module splits its work over (``None``: not split). Gradients
            of a split module are averaged over it (DDP does; :func:`hfpatch.all_reduce_gradients` without DDP).
        families: The patch families that changed this object, name -> role (``{"dit_usp": "transformer"}``).
        requested: The options the caller passed (``options`` adds every default).
        notes: What the patch left alone and why, one line each, shown by ``repr`` and :meth:`describe` (a
            pipeline patch says whether its VAE is split and, if not, why).

    ``repr(patch)`` is a one-line summary (what was patched, by which families, the degrees that matter);
    :meth:`describe` lists every change.
    """

    name: str
    plan: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    children: list[Patch] = field(default_factory=list)
    part_of: str | None = None
    reduce_group: Any = None
    families: dict[str, str] = field(default_factory=dict)
    requested: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _log: list[_Entry] = field(default_factory=list, repr=False)
    _removed: bool = field(default=False, repr=False)
    # Depth of ``disabled()`` blocks, and what they swapped out: per patch, so patches never share a flag.
    _disabled_depth: int = field(default=0, repr=False)
    _swaps: list[tuple[Any, str, Any, Any]] = field(default_factory=list, repr=False)

    # ------------------------------------------------------------------ primitives
    def set_attr(self, obj: Any, name: str, value: Any, *, keep_when_disabled: bool = False) -> None:
        """Set ``obj.name = value`` (through the object's own ``__setattr__``) and log the old value.

        ``keep_when_disabled``: bookkeeping that stays in place inside :meth:`disabled` (the patch marker).
        """
        self._check_live()
        old = _instance_value(obj, name)
        setattr(obj, name, value)
        self._log.append(
            _Entry("attr", obj, name, old, new=_instance_value(obj, name), keep=keep_when_disabled)
        )

    def wrap_method(self, obj: Any, name: str, wrapper: Callable[[Callable], Callable]) -> Callable:
        """Replace the bound method ``obj.name`` by ``wrapper(original_bound_method)`` on this instance only.

        A ``forward`` under an accelerate hook (CPU offload, ``device_map``) is wrapped where the hook keeps it,
        ``_old_forward``: diffusers re-installs offload hooks after every pipeline call
        (``maybe_free_model_hooks``), which resets ``forward`` to ``_old_forward`` and would drop the patch.
        """
        if name == "forward" and hasattr(obj, "_hf_hook") and hasattr(obj, "_old_forward"):
            name = "_old_forward"
        original = getattr(obj, name)
        new = wrapper(original)
        if not callable(new):
            raise PatchError(f"wrapper for {type(obj).__name__}.{name} returned a non-callable {new!r}")
        self.set_attr(obj, name, new)
        return new

    def swap_processor(self, attention: Any, processor: Any) -> None:
        """Replace a diffusers attention module's ``processor`` (the identical old one comes back)."""
        if not hasattr(attention, "processor"):
            raise PatchError(f"{type(attention).__name__} has no attention processor to swap")
        self.set_attr(attention, "processor", processor)

    def add_forward_pre_hook(
        self, module: torch.nn.Module, hook: Callable, *, with_kwargs: bool = True, prepend: bool = False
    ) -> RemovableHandle:
        """``module.register_forward_pre_hook``; removed by handle (removing it earlier is fine too)."""
        self._check_live()
        handle = module.register_forward_pre_hook(self._gated(hook), with_kwargs=with_kwargs, prepend=prepend)
        self._log.append(_Entry("hook", module, getattr(hook, "__name__", "forward_pre_hook"), handle=handle))
        return handle

    def add_forward_hook(
        self, module: torch.nn.Module, hook: Callable, *, with_kwargs: bool = True, always_call: bool = False
    ) -> RemovableHandle:
        """``module.register_forward_hook``; removed by handle (removing it earlier is fine too)."""
        self._check_live()
        handle = module.register_forward_hook(
            self._gated(hook), with_kwargs=with_kwargs, always_call=always_call
        )
        self._log.append(_Entry("hook", module, getattr(hook, "__name__", "forward_hook"), handle=handle))
        return handle

    def _gated(self, hook: Callable) -> Callable:
        """``hook``, inert while this patch is :meth:`disabled` (a hook returning ``None`` changes nothing)."""

        @functools.wraps(hook)
        def gated(*args: Any, **kwargs: Any) -> Any:
            if self._disabled_depth:
                return None
            return hook(*args, **kwargs)

        return gated

    def add_child(self, child: Patch) -> Patch:
        """Make ``child`` (a component's patch) part of this one; it is undone at its place in the log."""
        self._check_live()
        self.children.append(child)
        self._log.append(_Entry("child", child, child.name))
        return child

    def on_remove(self, obj: Any, name: str, undo: Callable[[], None]) -> None:
        """Register an arbitrary undo step (for state that is not an attribute, e.g. a cache to free)."""
        self._check_live()
        self._log.append(_Entry("callback", obj, name, undo=undo))

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_active(self) -> bool:
        return not self._removed

    @property
    def is_disabled(self) -> bool:
        """Whether a :meth:`disabled` block of this patch is running (the model runs unpatched)."""
        return self._disabled_depth > 0

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel replica: ranks with the same ``data_rank`` must get the same batch.

        See :func:`hfpatch.distributed.data.data_parallel_position`.
        """
        return data_position(self.plan)[0]

    @property
    def num_data_ranks(self) -> int:
        """Number of data-parallel replicas (distinct batches per step) over the launched world."""
        return data_position(self.plan)[1]

    @contextlib.contextmanager
    def disabled(self) -> Iterator[Patch]:
        """Run the patched model or pipeline unpatched inside the block, on whichever ranks enter it.

        Every hook of the patch (and of its children: a pipeline's transformer and VAE) is inert and every
        swapped attribute (wrapped methods, attention processors, replaced ``forward``) holds its pre-patch
        value, so nothing communicates and no same-input guard runs: validation or sampling on the main
        process only. On exit (also on an exception) the patched behaviour comes back; nested blocks are
        fine. Only the patch marker and the copy refusal stay, so :func:`hfpatch.get_patch` still finds
        the patch. State is this patch's own: other patches are unaffected. Call an unwrapped model inside
        (``accelerator.unwrap_model(model)``): DDP's own forward synchronises with the other ranks.

        >>> import torch
        >>> from hfpatch.core.patch import Patch
        >>> layer = torch.nn.Linear(2, 2)
        >>> x = torch.ones(1, 2)
        >>> plain = layer(x)
        >>> patch = Patch("demo")
        >>> _ = patch.wrap_method(layer, "forward", lambda orig: (lambda x: 2 * orig(x)))
        >>> with patch.disabled():
        ...     torch.equal(layer(x), plain)
        True
        >>> torch.equal(layer(x), 2 * plain), patch.is_disabled
        (True, False)
        >>> patch.remove()
        """
        self._check_live()
        self._disabled_depth += 1
        if self._disabled_depth > 1:  # nested: already unpatched
            try:
                yield self
            finally:
                self._disabled_depth -= 1
            return
        children = contextlib.ExitStack()
        try:
            for entry in reversed(self._log):
                if entry.kind == "child":
                    children.enter_context(entry.obj.disabled())
                elif entry.kind == "attr" and not entry.keep:
                    swap = _swap_out(entry)
                    if swap is not None:
                        self._swaps.append(swap)
            yield self
        finally:
            self._disabled_depth = 0
            try:
                self._restore_swaps()
            finally:
                children.close()

    def _restore_swaps(self) -> None:
        """Put back what :meth:`disabled` swapped out (the patched values), latest swap first."""
        while self._swaps:
            obj, slot, patched, unpatched = self._swaps.pop()
            if _instance_value(obj, slot) is unpatched:
                _set_slot(obj, slot, patched)
            else:
                warnings.warn(
                    f"{_describe(obj)}.{slot} was changed inside patch.disabled(); keeping that change, so "
                    "that part of the patch stays off. Do not modify patched objects inside disabled().",
                    stacklevel=4,
                )

    def remove(self) -> None:
        """Undo every mutation (children included) in exact reverse order of application. Idempotent."""
        if self._removed:
            return
        self._restore_swaps()  # removed inside disabled(): undo from the patched state, as always
        errors: list[BaseException] = []
        for entry in reversed(self._log):
            try:
                _undo(entry)
            except BaseException as exc:
                errors.append(exc)
        self._log.clear()
        self._removed = True
        if errors:
            raise PatchError(f"{len(errors)} undo step(s) of {self.name} failed: {errors[0]!r}") from errors[
                0
            ]

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def change_count(self) -> int:
        """``len(self.entries())`` without formatting a line: the logged mutations, children included."""
        return sum(e.obj.change_count() if e.kind == "child" else 1 for e in self._log)

    def entries(self) -> list[str]:
        """Human-readable list of every logged mutation, children included."""
        lines = []
        for entry in self._log:
            if entry.kind == "child":
                lines += [f"{entry.obj.name}: {line}" for line in entry.obj.entries()]
            else:
                lines.append(str(entry))
        return lines

    def _all_families(self) -> list[tuple[str, str, str]]:
        """(object name, family, role) of this patch and its children, in the order they were applied."""
        found = [(child.name, f, r) for child in self.children for _, f, r in child._all_families()]
        return found + [(self.name, f, r) for f, r in self.families.items()]

    def _plan_text(self) -> str:
        """The degrees above 1, the VAE's only where a VAE family patched something (``cfg=2, ulysses=2``)."""
        if self.plan is None or getattr(self.plan, "world_size", 1) == 1:
            return "one rank"
        names = ["data", "cfg", "pipefusion", "ring", "ulysses"]
        if any(role == "vae" for _, _, role in self._all_families()):
            names.append("vae")
        shown = [f"{n}={getattr(self.plan, n)}" for n in names if getattr(self.plan, n, 1) > 1]
        return ", ".join(shown) or "one rank"

    def __repr__(self) -> str:
        """One line: ``<hfpatch.Patch WanPipeline (active): cfg=2, vae=2; wan_vae on AutoencoderKLWan,
        pipeline_parallel; 77 changes, see patch.describe()>`` (options only when the caller passed some)."""
        state = "active" if self.is_active else "removed"
        by = ", ".join(
            family if obj == self.name else f"{family} on {obj}" for obj, family, _ in self._all_families()
        )
        count = self.change_count()
        parts = [f"<hfpatch.Patch {self.name} ({state}): {self._plan_text()}"]
        if by:
            parts.append(by)
        if self.requested:
            parts.append("options " + ", ".join(f"{k}={v!r}" for k, v in self.requested.items()))
        parts += self.notes
        parts.append(f"{count} change{'s' if count != 1 else ''}, see patch.describe()>")
        return "; ".join(parts)

    def describe(self) -> str:
        """Every detail: the resolved plan and options, then every change, one per line (children included).

        >>> import torch
        >>> from hfpatch.core.patch import Patch
        >>> layer = torch.nn.Linear(2, 2)
        >>> with Patch("Linear") as patch:
        ...     patch.set_attr(layer, "note", 1)
        ...     print(patch.describe())
        Patch 'Linear' (active)
        plan: None
        options: {}
          Linear@0x....note (was ABSENT)
        """
        state = "active" if self.is_active else "removed"
        lines = [f"Patch {self.name!r} ({state})", f"plan: {self.plan!r}", f"options: {self.options!r}"]
        if self.part_of:
            lines.insert(1, f"part of: {self.part_of}")
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"  {line}" for line in self.entries()]
        return "\n".join(lines)

    def refuse_copies(self, obj: Any) -> None:
        """Make ``copy.deepcopy(obj)``, ``pickle``/``torch.save(obj)`` raise this patch's clear ``TypeError``.

        ``copy`` and ``pickle`` look ``__deepcopy__``/``__reduce_ex__`` up on the instance, so two instance
        attributes (removed with the patch) stop them at ``obj`` itself, before they reach hooks and wrapped
        methods that would fail with "Can't pickle local object" or "cannot pickle ProcessGroup".
        """

        def refuse_deepcopy(memo: dict) -> Any:
            raise self._copy_error("deepcopy")

        def refuse_pickle(protocol: int) -> Any:
            raise self._copy_error("pickle (torch.save)")

        self.set_attr(obj, "__deepcopy__", refuse_deepcopy, keep_when_disabled=True)
        self.set_attr(obj, "__reduce_ex__", refuse_pickle, keep_when_disabled=True)

    def __deepcopy__(self, memo: dict) -> Patch:
        raise self._copy_error("deepcopy")

    def __reduce_ex__(self, protocol: int) -> Any:
        raise self._copy_error("pickle (torch.save)")

    def _copy_error(self, how: str) -> TypeError:
        # A patched object holds its live patch (hooks, process groups, wrapped methods): a copy or a pickle
        # would carry wrappers bound to the original object and groups of this process. Refuse it clearly.
        what = self.part_of + "." + self.name if self.part_of else self.name
        return TypeError(
            f"cannot {how} {what} while it is patched by hfpatch.apply (its hooks, wrapped methods and process "
            "groups belong to the live patch). Copy it before hfpatch.apply (e.g. an EMA model) or after "
            "patch.remove(); to save it, use state_dict() or save_pretrained(), which hold no hfpatch state "
            "(with shard_weights, call save_pretrained() on every rank: rank 0 writes the full weights)."
        )

    def _check_live(self) -> None:
        if self._removed:
            raise PatchError(f"patch {self.name!r} was removed; apply a new one")


def _undo(entry: _Entry) -> None:
    if entry.kind == "child":
        entry.obj.remove()
    elif entry.kind == "hook":
        entry.handle.remove()
    elif entry.kind == "callback":
        entry.undo()
    elif not _still_ours(entry):
        return
    elif entry.old is ABSENT:
        obj = entry.obj
        if isinstance(obj, torch.nn.Module) or entry.name in obj.__dict__:
            delattr(obj, entry.name)
    else:
        # object.__setattr__ bypasses e.g. DiffusionPipeline.__setattr__ re-registering config; for modules
        # the nn.Module setattr routes submodules/parameters back to their stores.
        if isinstance(entry.obj, torch.nn.Module):
            setattr(entry.obj, entry.name, entry.old)
        else:
            object.__setattr__(entry.obj, entry.name, entry.old)


def _set_slot(obj: Any, name: str, value: Any) -> None:
    """Store ``value`` on the instance (``ABSENT``: delete the instance attribute), bypassing e.g.
    ``DiffusionPipeline.__setattr__``; modules route submodules/parameters to their stores."""
    if value is ABSENT:
        if isinstance(obj, torch.nn.Module) or name in obj.__dict__:
            delattr(obj, name)
    elif isinstance(obj, torch.nn.Module):
        setattr(obj, name, value)
    else:
        object.__setattr__(obj, name, value)


def _swap_out(entry: _Entry) -> tuple[Any, str, Any, Any] | None:
    """Put the pre-patch value of an attr entry in place: ``(obj, slot, patched, unpatched)``, or ``None``
    when the patched value is no longer there (replaced since; left alone)."""
    obj, slot, unpatched = entry.obj, entry.name, entry.old
    if _instance_value(obj, slot) is not entry.new:
        # An accelerate hook added after apply keeps the patched forward in ``_old_forward``.
        if entry.name != "forward" or _instance_value(obj, "_old_forward") is not entry.new:
            return None
        slot = "_old_forward"
        if unpatched is ABSENT:
            unpatched = type(obj).forward.__get__(obj, type(obj))
    _set_slot(obj, slot, unpatched)
    return obj, slot, entry.new, _instance_value(obj, slot)


def _still_ours(entry: _Entry) -> bool:
    """Whether ``entry.obj.name`` still holds what the patch set, so restoring the old value is safe.

    If something wrapped it since, e.g. accelerate's ``add_hook_to_module`` (CPU offload, ``device_map``),
    which keeps the wrapped callable in ``_old_forward``: the patch's value is swapped for the pre-patch one
    there and the newer wrapper stays. Otherwise the later change is dropped, with a warning.
    """
    if entry.new is ABSENT or _instance_value(entry.obj, entry.name) is entry.new:
        return True
    if entry.name == "forward" and getattr(entry.obj, "_old_forward", None) is entry.new:
        if entry.old is ABSENT:
            original = getattr(type(entry.obj), entry.name).__get__(entry.obj, type(entry.obj))
        else:
            original = entry.old
        object.__setattr__(entry.obj, "_old_forward", original)
        return False
    if entry.name == "_old_forward" and _instance_value(entry.obj, "forward") is entry.new:
        # The accelerate hook that held the wrapper was removed (it put the wrapper back as ``forward``).
        stock = getattr(type(entry.obj), "forward", None)
        if getattr(entry.old, "__func__", None) is stock:
            delattr(entry.obj, "forward")
        else:
            object.__setattr__(entry.obj, "forward", entry.old)
        return False
    warnings.warn(
        f"{_describe(entry.obj)}.{entry.name} was replaced after hfpatch.apply (now "
        f"{type(_instance_value(entry.obj, entry.name)).__name__}); removing the patch restores the pre-patch "
        "value and drops that later change. Remove hfpatch patches before changing what they patched.",
        stacklevel=4,
    )
    return True


def get_patch(obj: Any) -> Patch | None:
    """The live :class:`Patch` applied to ``obj`` (directly or as a pipeline component), else ``None``."""
    patch = getattr(obj, "__dict__", {}).get(MARKER)
    return patch if patch is not None and patch.is_active else None
