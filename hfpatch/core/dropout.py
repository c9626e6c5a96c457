"""Dropout that draws inside a split forward: found and refused by name.

Where a patch splits a forward over ranks (a DiT's token sequence, a VAE's rows), each rank's dropout draws a mask
of its shard's shape from the same RNG state (``hfpatch.StepRNG`` keeps the ranks of a group in step): not the
slice of the mask the unpatched module draws over the whole tensor, and the same pattern on every shard. Such a
forward is refused (:func:`refuse_dropout`), not run inexactly; eval mode (``p`` unused) and ``p = 0`` run.
"""

from __future__ import annotations

import torch

__all__ = ["active_dropouts", "refuse_dropout"]

#: torch's dropout modules (every one takes ``p``; their common base is private).
DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def active_dropouts(module: torch.nn.Module) -> list[str]:
    """The dropout modules of ``module`` that draw in this forward (training mode, ``p > 0``), named.

    >>> import torch
    >>> from hfpatch.core.dropout import active_dropouts
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1), torch.nn.Dropout(0.0))
    >>> active_dropouts(net), active_dropouts(net.eval())
    (['1 (Dropout, p=0.1)'], [])
    """

    def draws(m: torch.nn.Module) -> bool:
        return isinstance(m, DROPOUTS) and m.training and m.p > 0

    if not any(draws(m) for m in module.modules()):  # every call: no name strings built unless one draws
        return []
    return [f"{name} ({type(m).__name__}, p={m.p})" for name, m in module.named_modules() if draws(m)]


def refuse_dropout(module: torch.nn.Module, where: str) -> None:
    """Raise ``ValueError`` naming the dropout modules that would draw inside ``module``'s split ``where`` (e.g.
    ``"sequence-parallel forward"``); nothing when none does. The same on every rank (the ranks hold the same
    module), so no rank is left waiting."""
    drawing = active_dropouts(module)
    if not drawing:
        return
    lora = any(".lora_dropout." in path for path in drawing)
    raise ValueError(
        f"{type(module).__name__} is in training mode with dropout inside its {where}: "
        f"{', '.join(drawing[:4])}{' ...' if len(drawing) > 4 else ''} ({len(drawing)} modules). Each rank would "
        "draw a mask for its own shard, not its slice of the unpatched model's mask, so the result would differ "
        "from the unpatched model. Set "
        + ("LoraConfig(lora_dropout=0.0)" if lora else "these dropout probabilities to 0")
        + " for split training, or call .eval() where no dropout is wanted."
    )
