"""Public testing support: tiny random-weight stock HF models, a multi-rank runner and a memory tracker.

Everything here runs on CPU without hub access; demos, examples and the test-suite use it.
"""

from .runner import RankError, RankPool, run_ranks

__all__ = ["RankError", "RankPool", "run_ranks"]


def __getattr__(name: str):
    # Model factories import diffusers/transformers: load them only when asked for.
    import importlib

    models = importlib.import_module(f"{__name__}.models")
    if name in models.__all__:
        return getattr(models, name)
    raise AttributeError(f"module 'hfpatch.testing' has no attribute {name!r}")
