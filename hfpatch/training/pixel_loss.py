"""Bounded-memory pixel-space loss: decode predicted latents chunk by chunk inside a training step.

Recipes that add a pixel loss (decode the predicted latents with a VAE, compare with the ground-truth images)
run out of memory on batches of large images: the decoder's activations for the whole batch are held until
``backward()``. :func:`chunked_pixel_loss` decodes ``chunk_size`` items at a time and keeps the peak memory
of the whole step (forward *and* backward) at about one chunk, with the loss and gradients of the one-shot
version.

Why not the plain chunked loop: accumulating ``loss += chunk_loss`` over chunks (the design this module
replaces) lowers the forward's transient peak only; every chunk's autograd graph, with all its decoder
activations, stays alive until ``backward()``, so the step's peak barely moves (see
``benchmarks/pixel_loss_memory.py``). Here each chunk's decode + error sum runs under non-reentrant
activation checkpointing, so a chunk's activations are freed as soon as its partial sum is computed and
rebuilt, one chunk at a time, during ``backward()``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["REFERENCE_ENV", "chunked_pixel_loss"]

logger = logging.getLogger(__name__)

REFERENCE_ENV = "HFPATCH_PIXEL_LOSS_V0"
"""Environment variable: ``1`` makes every :func:`chunked_pixel_loss` call use the one-shot reference."""

_LOSSES = {"l2": "l2", "mse": "l2", "l1": "l1", "mae": "l1"}
# The seed's adaptive thresholds: (megapixels per item at least, chunk size); smaller items get 4.
_AUTO_THRESHOLDS = ((1.0, 1), (0.25, 2))
_AUTO_SMALL_ITEMS = 4

Decode = Callable[[torch.Tensor], Any]
# A chunk's inputs: one batched tensor (a slice of a padded batch) or a tuple of same-shaped items.
_Items = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class _Chunk:
    latents: _Items
    targets: _Items
    masks: _Items | None


@dataclass(frozen=True)
class _Group:
    """Same-shaped items decoded together: a whole padded batch, or the items of a list sharing shapes."""

    latents: _Items
    targets: _Items
    masks: _Items | None

    def __len__(self) -> int:
        return len(self.latents)

    def item_shape(self) -> tuple[int, ...]:
        return tuple(self.targets[0].shape)

    def chunks(self, size: int) -> list[_Chunk]:
        def take(items: _Items | None, start: int) -> _Items | None:
            return None if items is None else items[start : start + size]

        return [
            _Chunk(take(self.latents, i), take(self.targets, i), take(self.masks, i))
            for i in range(0, len(self), size)
        ]


def chunked_pixel_loss(
    decode: Decode,
    latents: torch.Tensor | Sequence[torch.Tensor],
    targets: torch.Tensor | Sequence[torch.Tensor],
    masks: torch.Tensor | Sequence[torch.Tensor] | None = None,
    chunk_size: int | Literal["auto"] = "auto",
    loss: str = "l2",
    *,
    memory_budget_bytes: int | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """Pixel-space loss of decoded latents against target images, with the memory of one chunk.

    The loss is the seed's: images in ``[-1, 1]`` are mapped to ``[0, 1]`` and clamped there (predictions
    outside ``[-1, 1]`` get no gradient, as in the seed), the pointwise error is ``(pred - target) ** 2``
    (``"l2"``, alias ``"mse"``) or ``|pred - target|`` (``"l1"``, alias ``"mae"``), and

        loss = sum(mask * error) / sum(mask broadcast over channels)

    i.e. the mean error over valid elements (every element when ``masks`` is None; mask values act as
    weights when not binary). The error is reduced in float32 whatever the decode dtype (bf16 autocast).

    Memory design. Each chunk's decode and error sum run under non-reentrant activation checkpointing
    (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``): the forward frees a chunk's
    activations as soon as its partial sum exists, and ``backward()`` rebuilds and back-propagates one chunk
    at a time (the autograd engine finishes a chunk before starting the previous one: all of a chunk's nodes
    are newer than the previous chunk's). Peak memory is one chunk in forward and in backward, for one extra
    decode forward per chunk. A GradCache-style custom ``autograd.Function`` (decode without graph in
    forward, re-decode and back-propagate each chunk in its backward) has the same memory and compute, but
    must be told every tensor the decoder depends on to return their gradients; checkpointing gets the
    exact gradients of whatever ``decode`` uses (trainable or LoRA decoder parameters, non-leaf latents,
    tensors in a closure), restores the RNG and autocast state for the recompute, and leaves a normal
    autograd graph (``torch.autograd.grad``, DDP/FSDP gradient hooks, ``GradScaler`` all work unchanged).
    With grad disabled the chunks simply run one after the other.

    Args:
        decode: Latents -> images in ``[-1, 1]``: returns a tensor, an object with ``.sample`` (diffusers
            ``DecoderOutput``) or a tuple whose first element is the images; or a diffusers VAE itself
            (decoded with ``vae.decode(z)``; a decode that raises, e.g. out of memory, then leaves no frame
            cache behind: ``vae.clear_cache()`` for ``AutoencoderKLWan``, which keeps the frames of a failed
            call on the module; a lambda hides the VAE from hfpatch). For example
            ``lambda z: vae.decode(z / vae.config.scaling_factor).sample``, a frozen VAE, or a VAE patched
            by ``hfpatch.apply`` (patch-parallel decode: every rank of the VAE group calls with the same
            latents, and an int or ``"auto"`` chunk size gives every rank the same plan; do not use
            ``memory_budget_bytes`` there, as uneven shards can measure different bytes per rank). Must be
            deterministic given the RNG state (it is re-run in backward).
        latents: ``(N, C_lat, *latent_size)`` padded batch, or a list of ``N`` unbatched items
            ``(C_lat, *latent_size_i)`` of different sizes (no padding waste; same-shaped items are batched).
        targets: Ground-truth images in ``[-1, 1]``, ``(N, C, *size)`` or a list of ``(C, *size_i)``, of
            exactly the shape ``decode`` returns (images for 4D latents, videos for 5D).
        masks: Optional valid-element masks (bool or float weights) shaped like the targets with 1 or ``C``
            channels, as a tensor or list matching ``targets``; zero where a padded batch is padding.
        chunk_size: Items decoded at once: an ``int`` >= 1, or ``"auto"`` for the seed's thresholds by
            megapixels per item (frames count for videos): >= 1 MP -> 1, >= 0.25 MP -> 2, else 4.
        loss: ``"l2"``/``"mse"`` or ``"l1"``/``"mae"``.
        memory_budget_bytes: Instead of ``"auto"``: the most bytes of decoder activations one chunk may use.
            One item per shape group is probed (decoded, and back-propagated when grad is enabled, with the
            RNG state restored after) to measure its peak bytes; the chunk size is
            ``budget // item_bytes`` (at least 1). The probe costs one item's decode per call: once the
            debug log shows the chosen size, pass it as ``chunk_size``.
        reference: Use the one-shot reference (each shape group decoded in one call, no recompute) for A/B
            checks; also switched on for every call by the environment variable ``HFPATCH_PIXEL_LOSS_V0=1``.

    Returns:
        The scalar loss (float32), differentiable w.r.t. ``latents`` and whatever ``decode`` depends on.

    Raises:
        TypeError: ``latents``/``targets``/``masks`` mix tensors and lists, or ``decode`` returns no tensor.
        ValueError: Count or shape mismatches, all masks empty, an unknown ``loss``, a bad ``chunk_size`` or
            ``memory_budget_bytes``; all before any decode, except a decoded shape that differs from the
            targets (raised on the first chunk).

    Example (tiny random-weight VAE on CPU):

    >>> import torch
    >>> from hfpatch.testing import tiny_autoencoder_kl
    >>> from hfpatch.training import chunked_pixel_loss
    >>> vae = tiny_autoencoder_kl().requires_grad_(False)          # frozen, as in most recipes
    >>> decode = lambda z: vae.decode(z).sample
    >>> latents = torch.randn(4, 4, 16, 16, requires_grad=True)   # e.g. a denoiser's x0 prediction
    >>> images = torch.rand(4, 3, 32, 32) * 2 - 1
    >>> masks = torch.ones(4, 1, 32, 32)
    >>> masks[1:, :, 24:] = 0                                      # items 1-3 are padded below row 24
    >>> loss = chunked_pixel_loss(decode, latents, images, masks, chunk_size=1)
    >>> loss.backward()
    >>> reference = chunked_pixel_loss(decode, latents, images, masks, reference=True)
    >>> torch.allclose(loss, reference)
    True
    >>> latents.grad.shape
    torch.Size([4, 4, 16, 16])
    """
    loss_kind = _check_loss(loss)
    _check_plan_options(chunk_size, memory_budget_bytes)
    decode = _as_decode(decode)
    groups = _groups(latents, targets, masks)
    denominator = _denominator(groups)
    if reference or os.environ.get(REFERENCE_ENV, "0") == "1":
        logger.debug("pixel loss: one-shot reference (%s), %s", _why_reference(reference), _describe(groups))
        return _pixel_loss(
            [g.chunks(len(g)) for g in groups], decode, loss_kind, denominator, recompute=False
        )
    sizes = _plan(groups, decode, loss_kind, chunk_size, memory_budget_bytes)
    return _pixel_loss(
        [g.chunks(s) for g, s in zip(groups, sizes)], decode, loss_kind, denominator, recompute=True
    )


def _seed_variant_pixel_loss(
    decode: Decode,
    latents: torch.Tensor | Sequence[torch.Tensor],
    targets: torch.Tensor | Sequence[torch.Tensor],
    masks: torch.Tensor | Sequence[torch.Tensor] | None = None,
    chunk_size: int = 1,
    loss: str = "l2",
) -> torch.Tensor:
    """The seed's design, kept to measure against: chunked decode, every chunk's graph kept until backward."""
    loss_kind = _check_loss(loss)
    groups = _groups(latents, targets, masks)
    denominator = _denominator(groups)
    _check_chunk_size(chunk_size)
    return _pixel_loss(
        [g.chunks(chunk_size) for g in groups], decode, loss_kind, denominator, recompute=False
    )


def _pixel_loss(
    chunked_groups: list[list[_Chunk]], decode: Decode, loss_kind: str, denominator: float, recompute: bool
) -> torch.Tensor:
    recompute = recompute and torch.is_grad_enabled()
    total: torch.Tensor | None = None
    for chunks in chunked_groups:
        for chunk in chunks:
            items = (chunk.latents, chunk.targets, chunk.masks)
            if recompute:
                # Tensors as direct arguments: checkpoint finds their devices (to save and replay the CUDA
                # RNG state and pick the autocast device) by walking its arguments, not dataclass fields.
                part = checkpoint(_chunk_error_sum, decode, loss_kind, *items, use_reentrant=False)
            else:
                part = _chunk_error_sum(decode, loss_kind, *items)
            total = part if total is None else total + part
    assert total is not None  # _groups guarantees at least one item
    return total / denominator


def _chunk_error_sum(
    decode: Decode, loss_kind: str, latents: _Items, targets: _Items, masks: _Items | None
) -> torch.Tensor:
    """Masked error sum of one chunk (float32). Lists are stacked here so the copy lives one chunk long."""
    latents, targets = _stack(latents), _stack(targets)
    masks = None if masks is None else _stack(masks)
    pred = _images(decode(latents))
    if pred.shape != targets.shape:
        raise ValueError(
            f"decode returned images of shape {tuple(pred.shape)} for latents of shape {tuple(latents.shape)}, "
            f"but the targets have shape {tuple(targets.shape)}; pass targets (and masks) of the decoded size, "
            "e.g. crop or pad them to the VAE's output size."
        )
    pred01 = (pred.float() * 0.5 + 0.5).clamp(0, 1)
    target01 = (targets.float() * 0.5 + 0.5).clamp(0, 1)
    diff = pred01 - target01
    error = diff.square() if loss_kind == "l2" else diff.abs()
    if masks is not None:
        error = error * masks.float()
    return error.sum()


class _VAEDecode:
    """``vae.decode(z)`` that clears the VAE's frame cache (``clear_cache``) when it raises."""

    def __init__(self, vae: torch.nn.Module) -> None:
        self.vae = vae

    def __call__(self, latents: torch.Tensor) -> Any:
        try:
            return self.vae.decode(latents)
        except BaseException:
            clear = getattr(self.vae, "clear_cache", None)
            if callable(clear):
                clear()
            raise


def _as_decode(decode: Decode | torch.nn.Module) -> Decode:
    if isinstance(decode, torch.nn.Module) and callable(getattr(decode, "decode", None)):
        return _VAEDecode(decode)
    return decode


def _stack(items: _Items) -> torch.Tensor:
    return items if isinstance(items, torch.Tensor) else torch.stack(items)


def _images(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    sample = getattr(output, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"decode returned {type(output).__name__}; expected a tensor, an object with a tensor `.sample` "
        "(diffusers DecoderOutput) or a tuple starting with a tensor."
    )


# ----------------------------------------------------------------------------------------------------------
# Validation and planning (all before any decode)


def _check_loss(loss: str) -> str:
    if not isinstance(loss, str) or loss.lower() not in _LOSSES:
        raise ValueError(f"unknown pixel loss {loss!r}; known: {', '.join(_LOSSES)}")
    return _LOSSES[loss.lower()]


def _check_chunk_size(chunk_size: object) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1 or 'auto', got {chunk_size!r}")


def _check_plan_options(chunk_size: object, memory_budget_bytes: object) -> None:
    if memory_budget_bytes is None:
        if chunk_size != "auto":
            _check_chunk_size(chunk_size)
        return
    if chunk_size != "auto":
        raise ValueError(f"give chunk_size ({chunk_size!r}) or memory_budget_bytes, not both")
    if (
        isinstance(memory_budget_bytes, bool)
        or not isinstance(memory_budget_bytes, int)
        or memory_budget_bytes <= 0
    ):
        raise ValueError(f"memory_budget_bytes must be a positive int, got {memory_budget_bytes!r}")


def _groups(latents: Any, targets: Any, masks: Any) -> list[_Group]:
    if isinstance(latents, torch.Tensor) and isinstance(targets, torch.Tensor):
        if masks is not None and not isinstance(masks, torch.Tensor):
            raise TypeError(
                f"masks must be a tensor like targets (a padded batch), got {type(masks).__name__}"
            )
        _check_batch(latents, targets, masks)
        return [_Group(latents, targets, masks)]
    if isinstance(latents, torch.Tensor) or isinstance(targets, torch.Tensor):
        raise TypeError(
            f"latents and targets must both be padded-batch tensors or both lists of items, got "
            f"{type(latents).__name__} and {type(targets).__name__}"
        )
    latents, targets = list(latents), list(targets)
    masks = None if masks is None else list(masks)
    if len(latents) != len(targets) or (masks is not None and len(masks) != len(targets)):
        counts = f"{len(latents)} latents, {len(targets)} targets" + (
            "" if masks is None else f", {len(masks)} masks"
        )
        raise ValueError(f"pixel loss got {counts}; give one target (and mask) per latent item")
    if not latents:
        raise ValueError("pixel loss got no items; pass at least one latent and its target")
    by_shape: dict[tuple, list[int]] = {}
    for i, (z, x) in enumerate(zip(latents, targets)):
        m = None if masks is None else masks[i]
        if not all(isinstance(t, torch.Tensor) for t in (z, x) + (() if m is None else (m,))):
            raise TypeError(f"item {i}: latents, targets and masks must be tensors")
        _check_batch(z[None], x[None], None if m is None else m[None], item=i)
        key = (tuple(z.shape), tuple(x.shape), None if m is None else tuple(m.shape), z.dtype, z.device)
        by_shape.setdefault(key, []).append(i)
    return [
        _Group(
            tuple(latents[i] for i in idx),
            tuple(targets[i] for i in idx),
            None if masks is None else tuple(masks[i] for i in idx),
        )
        for idx in by_shape.values()
    ]


def _check_batch(
    latents: torch.Tensor, targets: torch.Tensor, masks: torch.Tensor | None, item: int | None = None
) -> None:
    """Check a batch (or one item given with a leading batch dim of 1, named ``item`` in messages)."""
    where, skip = ("", 0) if item is None else (f"item {item}: ", 1)
    if latents.dim() < 3 or latents.dim() != targets.dim():
        raise ValueError(
            f"{where}latents {tuple(latents.shape[skip:])} and targets {tuple(targets.shape[skip:])} must be "
            f"{'(N, ' if item is None else '('}channels, *size) with the same number of size dims "
            "(2 for images, 3 for videos)"
        )
    if latents.shape[0] != targets.shape[0]:
        raise ValueError(
            f"pixel loss got {latents.shape[0]} latents but {targets.shape[0]} targets; "
            "give one target per latent"
        )
    if latents.shape[0] == 0:
        raise ValueError("pixel loss got no items; pass at least one latent and its target")
    if masks is None:
        return
    channels = targets.shape[1]
    if (
        masks.dim() != targets.dim()
        or masks.shape[0] != targets.shape[0]
        or masks.shape[1] not in (1, channels)
        or masks.shape[2:] != targets.shape[2:]
    ):
        raise ValueError(
            f"{where}mask shape {tuple(masks.shape[skip:])} does not fit targets {tuple(targets.shape[skip:])}; "
            f"expected the targets' size with 1 or {channels} channels"
        )


def _denominator(groups: list[_Group]) -> float:
    """Number of valid elements (mask weights counted on every channel), summed in float64 to stay exact."""
    total = 0.0
    for g in groups:
        if g.masks is None:
            total += len(g) * math.prod(g.item_shape())
            continue
        if isinstance(g.masks, torch.Tensor):
            weight = g.masks.sum(dtype=torch.float64)
        else:
            weight = torch.stack([m.sum(dtype=torch.float64) for m in g.masks]).sum()
        total += float(weight) * (g.item_shape()[0] // g.masks[0].shape[0])
    if not total > 0:
        raise ValueError(
            "pixel loss masks are all empty (no valid pixel in any item), so the loss is undefined; skip the "
            "pixel loss for this batch or check the masks"
        )
    return total


def _auto_chunk_size(megapixels: float) -> int:
    for at_least, size in _AUTO_THRESHOLDS:
        if megapixels >= at_least:
            return size
    return _AUTO_SMALL_ITEMS


def _plan(
    groups: list[_Group],
    decode: Decode,
    loss_kind: str,
    chunk_size: int | str,
    memory_budget_bytes: int | None,
) -> list[int]:
    sizes, notes = [], []
    for g in groups:
        megapixels = math.prod(g.item_shape()[1:]) / 1e6
        if memory_budget_bytes is not None:
            item_bytes = _probe_item_bytes(decode, loss_kind, g)
            size, why = max(1, memory_budget_bytes // max(item_bytes, 1)), f"budget, {item_bytes} B/item"
        elif chunk_size == "auto":
            size, why = _auto_chunk_size(megapixels), "auto"
        else:
            size, why = int(chunk_size), "fixed"
        size = min(size, len(g))
        sizes.append(size)
        notes.append(
            f"{len(g)} x {g.item_shape()} ({megapixels:.3g} MP) -> {math.ceil(len(g) / size)} chunk(s) of {size} "
            f"({why})"
        )
    logger.debug(
        "pixel loss plan: %s, recompute=%s; %s", loss_kind, torch.is_grad_enabled(), "; ".join(notes)
    )
    return sizes


def _probe_item_bytes(decode: Decode, loss_kind: str, group: _Group) -> int:
    """Peak bytes of one item's decode + error (and its backward when grad is on), RNG state restored."""
    from hfpatch.testing.memory import track_memory  # torch-only; lazy to keep the common path import-light

    chunk = group.chunks(1)[0]
    latents = _stack(chunk.latents).detach()
    devices = [latents.device] if latents.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), track_memory() as memory:
        if torch.is_grad_enabled():
            latents.requires_grad_(True)
            part = _chunk_error_sum(decode, loss_kind, latents, chunk.targets, chunk.masks)
            torch.autograd.grad(part, latents)
        else:
            _chunk_error_sum(decode, loss_kind, latents, chunk.targets, chunk.masks)
    return memory.peak_bytes


def _describe(groups: list[_Group]) -> str:
    return "; ".join(f"{len(g)} x {g.item_shape()}" for g in groups)


def _why_reference(reference: bool) -> str:
    return "reference=True" if reference else f"{REFERENCE_ENV}=1"
