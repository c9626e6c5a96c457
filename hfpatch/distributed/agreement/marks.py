"""A context variable set for the length of every call of a module: the checks' marks (a call agreed, a weight
watch live), which nested calls and collectives read without an argument to carry them."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any


def mark_calls(
    patch: Any, module: Any, mark: contextvars.ContextVar, value: Callable[[tuple, dict], Any]
) -> None:
    """Set ``mark`` to ``value(args, kwargs)`` as the first forward pre-hook of ``module`` (through ``patch``, so
    ``remove()`` takes it away) and reset it after the call, also when the call raises. ``value`` may raise
    (a failed check): the mark is then not set and nothing is reset."""
    tokens: list[contextvars.Token] = []

    def enter(_module: Any, args: tuple, kwargs: dict) -> None:
        tokens.append(mark.set(value(args, kwargs)))

    def leave(_module: Any, _args: tuple, _kwargs: dict, _output: Any) -> None:
        if tokens:
            mark.reset(tokens.pop())

    patch.add_forward_pre_hook(module, enter, prepend=True)
    patch.add_forward_hook(module, leave, always_call=True)
