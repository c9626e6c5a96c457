"""Built-in patch families: one module per HF target family, imported lazily on first lookup.

Each entry is ``(class key, "module:Family")``; :func:`hfpatch.core.registry.default_registry` reads this
table, so ``import hfpatch`` imports no diffusers or transformers module.
"""

BUILTIN_FAMILIES: list[tuple[str, str]] = []
