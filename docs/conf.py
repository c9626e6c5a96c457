"""Sphinx configuration of hfpatch's documentation (``python -m sphinx -W --keep-going -n docs docs/_build``).

Pages are Markdown (MyST), the API reference is autodoc over the docstrings of the public modules (each
module's ``__all__``), Google-style sections through napoleon. Nitpicky mode is on: every reference to an
hfpatch object must resolve. References to other libraries (torch, diffusers, transformers, ...) have no
inventory to resolve against (no network at build time), so they are ignored by pattern, not one by one.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # document this checkout's hfpatch, not an installed one

import hfpatch  # noqa: E402

project = "hfpatch"
author = "hfpatch contributors"
release = version = hfpatch.__version__
copyright = "hfpatch contributors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "README.md"]
root_doc = "index"

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4  # "page.md#a-heading" links, checked like any reference

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_default_options: dict[str, object] = {}
autoclass_content = "both"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_custom_sections = [("Class attributes", "params_style"), ("Options", "params_style")]

nitpicky = True
# Other libraries' objects: no intersphinx inventory can be fetched at build time.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|diffusers|transformers|accelerate|peft|sentence_transformers|numpy|datasets)(\..*)?"),
    (r"py:.*", r"(typing|collections|contextlib|types|dataclasses|enum|pathlib|os|logging)(\..*)?"),
    (r"py:.*", r"(Tensor|Module|Any|Callable|Iterator|Iterable|Sequence|Mapping|Generator|Path|nn\..*)"),
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|type|object|None|NoneType)"),
    (r"py:.*", r"c10d::.*"),  # torch.distributed's C++ classes as their annotations read (dist.Work)
]

html_theme = "furo"
html_title = f"hfpatch {release}"
html_static_path: list[str] = []


# ----------------------------------------------------------------------------------------------- generated pages
# Modules documented in full on the curated API pages, and (module, members) documented in part there.
CURATED = {
    "hfpatch": None,
    "hfpatch.training": None,
    "hfpatch.training.causal_checkpoint": None,
    "hfpatch.streaming": None,
    "hfpatch.testing": None,
    "hfpatch.testing.tolerance": None,
    "hfpatch.testing.devices": None,
    "hfpatch.distributed.collectives": None,
    "hfpatch.attention": None,
    "hfpatch.core.compile": None,
    "hfpatch.distributed.gradients": None,
    "hfpatch.distributed.data": None,
    "hfpatch.patches.decoder": ["sequence_sum"],
}


def _write_module_index(app) -> None:
    """docs/api/modules.rst: every other module of the package (its docstring and the names of its ``__all__``
    not documented on a curated page), generated at each build so that a new module is documented, and its
    references checked, without an edit here."""
    import importlib
    import pkgutil

    documented: set[int] = set()
    for name, members in CURATED.items():
        module = importlib.import_module(name)
        for member in members if members is not None else getattr(module, "__all__", []):
            obj = getattr(module, member)
            if callable(obj):
                documented.add(id(obj))
    names = sorted(m.name for m in pkgutil.walk_packages(hfpatch.__path__, "hfpatch."))
    out = [
        "All modules",
        "===========",
        "",
        "Every other module of the package, generated at build time: its docstring (most hold the design notes of",
        "what they implement) and the names of its ``__all__`` not documented on the pages before this one.",
        "",
    ]
    for name in names:
        if CURATED.get(name, ()) is None:
            continue
        module = importlib.import_module(name)
        members = [
            m for m in getattr(module, "__all__", []) if not (callable(getattr(module, m)) and id(getattr(module, m)) in documented)
        ]
        # A package re-exports the names of its modules (hfpatch.patches.dit.PlannedDiTUSP): each object is
        # documented once, at the first path in sorted order, which is the package's.
        documented.update(id(getattr(module, m)) for m in members if callable(getattr(module, m)))
        out += [name, "-" * len(name), "", f".. automodule:: {name}"]
        out += [f"   :members: {', '.join(members)}"] if members else []
        out.append("")
    path = os.path.join(app.srcdir, "api", "modules.rst")
    text = "\n".join(out)
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def _napoleon_except_inline_attributes(app, what, name, obj, options, lines) -> None:
    """napoleon, except on property/attribute docstrings: it reads their first ``x: y`` as ``type: text``, and
    hfpatch writes them as sentences ("Ranks used: ...")."""
    from sphinx.ext.napoleon import _process_docstring

    if what not in ("property", "attribute", "data"):
        _process_docstring(app, what, name, obj, options, lines)


# ----------------------------------------------------------------------------------------------- references
def _lookup(path: str):
    """The object a dotted path names (a module, then attributes), or ``None``."""
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _documented(env) -> dict[int, str]:
    """id(object) -> the name it is documented under (the first, in sorted order), built once per build."""
    cache = getattr(env, "_hfpatch_documented", None)
    if cache is None:
        cache = {}
        for name in sorted(env.get_domain("py").objects):
            obj = _lookup(name)
            if obj is not None and not isinstance(obj, (int, float, str, bool, tuple)):
                cache.setdefault(id(obj), name)
        env._hfpatch_documented = cache
    return cache


def _resolve_by_object(app, env, node, contnode):
    """Resolve a Python reference that Sphinx's name lookup missed by finding the object it names.

    Docstrings refer to objects as their own module sees them (``:func:`step_seed``` in
    ``hfpatch.distributed.data``), while the API pages document many of them under a re-exported name
    (``hfpatch.step_rng``). A reference is looked up in the context it was written in (its module and class,
    then every hfpatch module's globals for a bare name); if it names a real object, it links to where that object
    is documented, or, for an object with no entry (a private helper), renders as code without a link. A name
    that exists nowhere still fails the build: references cannot go stale.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = []
    if module and cls:
        candidates.append(f"{module}.{cls}.{target}")
    if module:
        candidates.append(f"{module}.{target}")
    candidates.append(target)
    obj = next((o for o in map(_lookup, candidates) if o is not None), None)
    if obj is None and "." not in target or obj is None and target.split(".")[0] in ("dist", "nn", "F"):
        import pkgutil
        import sys as _sys

        head, _, rest = target.partition(".")
        found = {}
        for info in pkgutil.walk_packages(hfpatch.__path__, "hfpatch."):
            mod = _sys.modules.get(info.name)
            if mod is not None and head in vars(mod):
                value = vars(mod)[head]
                for part in rest.split(".") if rest else []:
                    value = getattr(value, part, None)
                if value is not None:
                    found[id(value)] = value
        if len(found) == 1:
            obj = next(iter(found.values()))
    if obj is None:
        return None
    name = _documented(env).get(id(obj))
    if name is None:
        return contnode
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], name, node, contnode) or contnode


def _check_public_names_documented(app, env) -> None:
    """Every name of a curated module's ``__all__`` has an entry (autodoc skips a lazily exported name that is
    not in the module's ``dir()``): a warning, so the strict build fails on a public name without docs."""
    import importlib

    from sphinx.util import logging

    objects = env.get_domain("py").objects
    for name, members in CURATED.items():
        module = importlib.import_module(name)
        for member in members if members is not None else getattr(module, "__all__", []):
            if member != "__version__" and f"{name}.{member}" not in objects:
                logging.getLogger(__name__).warning(f"{name}.{member} is public (__all__) but not documented")


def setup(app):
    app.connect("builder-inited", _write_module_index)
    app.connect("missing-reference", _resolve_by_object)
    app.connect("env-check-consistency", _check_public_names_documented)
    from sphinx.ext.napoleon import _process_docstring

    for listener in list(app.events.listeners.get("autodoc-process-docstring", [])):
        if listener.handler is _process_docstring:
            app.disconnect(listener.id)
    app.connect("autodoc-process-docstring", _napoleon_except_inline_attributes)
