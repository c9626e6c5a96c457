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

A video is one item, and a long one does not fit even alone (the Wan 2.1 VAE on one 480x832 video: 69.7 GiB
at 17 frames). Given the ``AutoencoderKLWan`` itself as ``decode``, each chunk is also cut along time: the
decoder's causal frame loop runs under :func:`hfpatch.training.causal_checkpoint.causal_checkpoint`, the
loss of each time chunk is computed as soon as its frames exist, and the backward recomputes one time chunk
at a time (:mod:`hfpatch.training.video_vae`).
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

from .causal_checkpoint import causal_checkpoint, snapshot_stride
from .video_vae import CogVideoXFrames, WanFrames, frames_for, span_segments, vae_behind

__all__ = ["OPAQUE_FRAMES", "REFERENCE_ENV", "chunked_pixel_loss"]

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
    frame_chunk_size: int | Literal["auto"] | None = "auto",
    snapshot_every: int | Literal["auto"] = "auto",
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

    Videos. When ``decode`` is a diffusers ``AutoencoderKLWan`` (Wan 2.1 or 2.2) or ``AutoencoderKLCogVideoX``
    (the object itself or its bound ``vae.decode``, split by ``hfpatch.apply`` or not) and gradients are needed, a
    chunk of videos is also cut along time: the decoder runs ``frame_chunk_size`` latent frames at a time
    (CogVideoX: its own batches of 2) carrying its causal cache, each time chunk's error sum
    is taken as soon as its frames are decoded, and the backward recomputes the time chunks newest first,
    passing the gradient of each one's outgoing cache to the previous one
    (:func:`hfpatch.training.causal_checkpoint.causal_checkpoint`). The step then holds one time chunk's
    activations plus a few caches, whatever the number of frames, with the same loss and gradients (to the
    latents and to the decoder's trainable weights, LoRA included: the VAE is all the time chunks depend on).
    A VAE split over ranks runs time chunks x height shards; every rank must pass the same latents, targets
    and masks (checked before any decode, on every rank alike). The other video VAEs decode all frames in one
    pass (GroupNorm statistics or attention over every frame): their videos are decoded whole (split over ranks,
    1/N of it per rank). A ``decode`` function hfpatch cannot see into (a lambda) decodes videos whole too, and
    logs a warning once for videos of more than :data:`OPAQUE_FRAMES` latent frames.

    Args:
        decode: Latents -> images in ``[-1, 1]``: returns a tensor, an object with ``.sample`` (diffusers
            ``DecoderOutput``) or a tuple whose first element is the images; or a diffusers VAE itself
            (decoded with ``vae.decode(z)``; a decode that raises, e.g. out of memory, then leaves no frame
            cache behind: ``vae.clear_cache()`` for ``AutoencoderKLWan``, which keeps the frames of a failed
            call on the module; an ``AutoencoderKLWan`` or ``AutoencoderKLCogVideoX`` given this way, or its bound
            ``vae.decode``, is also chunked over time, see Videos; a lambda hides the VAE from hfpatch). For example
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
            megapixels per item (frames count for videos; with time chunks, the pixel frames of one time
            chunk): >= 1 MP -> 1, >= 0.25 MP -> 2, else 4.
        loss: ``"l2"``/``"mse"`` or ``"l1"``/``"mae"``.
        memory_budget_bytes: Instead of ``"auto"``: the most bytes of decoder activations one chunk may use.
            One item per shape group is probed (decoded, and back-propagated when grad is enabled, with the
            RNG state restored after) to measure its peak bytes; the chunk size is
            ``budget // item_bytes`` (at least 1). The probe costs one item's decode per call: once the
            debug log shows the chosen size, pass it as ``chunk_size``.
        frame_chunk_size: Latent frames decoded at once when ``decode`` is an ``AutoencoderKLWan`` and
            gradients are needed (each latent frame decodes to 4 pixel frames): an ``int`` >= 1, ``"auto"``
            (1 for videos of 2 or more latent frames: the stock decoder's own step; not with VAE tiling on,
            which the time chunks would bypass) or ``None`` (whole items). An ``AutoencoderKLCogVideoX`` takes
            ``"auto"`` (or its batch size, 2) or ``None``: its stock batches are its time chunks (its GroupNorm
            statistics are per batch). Ignored for other decoders.
        snapshot_every: With time chunks: the forward keeps the decoder's cache entering every
            ``snapshot_every``-th time chunk, the backward rebuilds the others from it. ``"auto"``:
            ``ceil(sqrt(time chunks))`` (caches held grow as the square root of the frames, for one extra
            no-grad decode of most time chunks); ``1`` keeps them all (no extra decode).
        reference: Use the one-shot reference (each shape group decoded in one call, no recompute) for A/B
            checks; also switched on for every call by the environment variable ``HFPATCH_PIXEL_LOSS_V0=1``.

    Returns:
        The scalar loss (float32), differentiable w.r.t. ``latents`` and whatever ``decode`` depends on.

    Raises:
        TypeError: ``latents``/``targets``/``masks`` mix tensors and lists, or ``decode`` returns no tensor.
        ValueError: Count or shape mismatches, all masks empty, an unknown ``loss``, a bad ``chunk_size``,
            ``memory_budget_bytes``, ``frame_chunk_size`` or ``snapshot_every``, an int ``frame_chunk_size``
            with VAE tiling on; all before any decode, except a decoded shape that differs from the targets
            (raised on the first chunk; before any decode with time chunks).

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
    _check_frame_options(frame_chunk_size, snapshot_every)
    vae = vae_behind(decode)
    decode = _as_decode(decode)
    groups = _groups(latents, targets, masks)
    denominator = _denominator(groups)
    if reference or os.environ.get(REFERENCE_ENV, "0") == "1":
        logger.debug("pixel loss: one-shot reference (%s), %s", _why_reference(reference), _describe(groups))
        return _pixel_loss(
            [g.chunks(len(g)) for g in groups], decode, loss_kind, denominator, recompute=False
        )
    frames = _frames_plan(vae, frame_chunk_size, snapshot_every)
    plans = _plan(groups, decode, loss_kind, chunk_size, memory_budget_bytes, frames, vae)
    total: torch.Tensor | None = None
    for group, plan in zip(groups, plans):
        if plan.frames is None:
            part = _pixel_loss([group.chunks(plan.items)], decode, loss_kind, 1.0, recompute=True)
        else:
            part = _video_error_sum(frames, loss_kind, group, plan)
        total = part if total is None else total + part
    assert total is not None
    return total / denominator


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
    _check_decoded(tuple(pred.shape), tuple(latents.shape), tuple(targets.shape))
    return _error_sum(pred, targets, masks, loss_kind)


def _check_decoded(pred: tuple[int, ...], latents: tuple[int, ...], targets: tuple[int, ...]) -> None:
    if pred != targets:
        raise ValueError(
            f"decode returned images of shape {pred} for latents of shape {latents}, but the targets have "
            f"shape {targets}; pass targets (and masks) of the decoded size, e.g. crop or pad them to the VAE's "
            "output size."
        )


def _error_sum(
    pred: torch.Tensor, targets: torch.Tensor, masks: torch.Tensor | None, loss_kind: str
) -> torch.Tensor:
    """Masked sum of the pointwise error in float32 (the seed's [-1, 1] -> [0, 1] mapping and clamp)."""
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
    vae = vae_behind(decode)  # the VAE, or its bound stock ``decode``
    return decode if vae is None else _VAEDecode(vae)


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


@dataclass(frozen=True)
class _GroupPlan:
    """How one shape group runs: ``items`` per chunk, and ``frames`` latent frames per time chunk (or whole)."""

    items: int
    frames: int | None = None


@dataclass(frozen=True)
class _Frames:
    """The causal video VAE given as ``decode`` (Wan, CogVideoX), and the options of its time chunks."""

    runner: WanFrames | CogVideoXFrames
    chunk: int | str | None
    snapshot_every: int | str

    def chunk_for(self, group: _Group) -> tuple[int | None, str]:
        """(latent frames per time chunk or None, why), for a group; raises for a chunk that cannot run."""
        latent_frames = group.latents[0].shape[1] if group.latents[0].dim() == 4 else 0
        if self.chunk is None:
            return None, "frame_chunk_size=None"
        if not torch.is_grad_enabled():
            return None, "no grad: the stock frame loop keeps no graph"
        if latent_frames < 2:
            return None, "one latent frame"
        name = type(self.runner.vae).__name__
        if getattr(self.runner.vae, "use_tiling", False):
            if self.chunk == "auto":
                return None, "VAE tiling on: whole items"
            raise ValueError(
                f"frame_chunk_size={self.chunk} decodes frame by frame without tiles, which would not equal the "
                f"tiled {name}; call vae.disable_tiling() (it does not bound training memory) or pass "
                "frame_chunk_size=None"
            )
        if isinstance(self.runner, CogVideoXFrames):
            batch = self.runner.vae.num_latent_frames_batch_size
            if self.chunk not in ("auto", batch):
                raise ValueError(
                    f"frame_chunk_size={self.chunk}: {name} decodes {batch} latent frames per call with GroupNorm "
                    f"statistics per call, so its time chunks are its own batches; pass 'auto' (or {batch}) or None"
                )
            return batch, f"{name}'s batches of {batch}"
        return (1 if self.chunk == "auto" else int(self.chunk)), str(self.chunk)


def _frames_plan(vae: Any, frame_chunk_size: int | str | None, snapshot_every: int | str) -> _Frames | None:
    runner = None if vae is None else frames_for(vae)
    if runner is None:
        return None
    return _Frames(runner, frame_chunk_size, snapshot_every)


#: Latent frames above which a video decoded whole by an opaque ``decode`` gets a warning (once per message).
OPAQUE_FRAMES = 4
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def _check_frame_options(frame_chunk_size: object, snapshot_every: object) -> None:
    if frame_chunk_size not in (None, "auto") and (
        isinstance(frame_chunk_size, bool) or not isinstance(frame_chunk_size, int) or frame_chunk_size < 1
    ):
        raise ValueError(f"frame_chunk_size must be an int >= 1, 'auto' or None, got {frame_chunk_size!r}")
    snapshot_stride(1, snapshot_every)  # raises for a bad value


def _plan(
    groups: list[_Group],
    decode: Decode,
    loss_kind: str,
    chunk_size: int | str,
    memory_budget_bytes: int | None,
    frames: _Frames | None,
    vae: Any = None,
) -> list[_GroupPlan]:
    plans, notes = [], []
    for g in groups:
        frame_chunk, frame_note = (None, "") if frames is None else frames.chunk_for(g)
        if frame_chunk is not None:
            assert frames is not None
            _check_video_targets(frames.runner, g)
            latent_frames = g.latents[0].shape[1]
            chunk_frames = min(frame_chunk, latent_frames) * frames.runner.temporal
            megapixels = chunk_frames * math.prod(g.item_shape()[2:]) / 1e6
        else:
            megapixels = math.prod(g.item_shape()[1:]) / 1e6
        if memory_budget_bytes is not None:
            item_bytes = _probe_item_bytes(decode, loss_kind, g, frames, frame_chunk)
            size, why = max(1, memory_budget_bytes // max(item_bytes, 1)), f"budget, {item_bytes} B/item"
        elif chunk_size == "auto":
            size, why = _auto_chunk_size(megapixels), "auto"
        else:
            size, why = int(chunk_size), "fixed"
        size = min(size, len(g))
        plans.append(_GroupPlan(size, frame_chunk))
        note = (
            f"{len(g)} x {g.item_shape()} ({megapixels:.3g} MP{' per time chunk' if frame_chunk else ''}) -> "
            f"{math.ceil(len(g) / size)} chunk(s) of {size} ({why})"
        )
        if frame_chunk is not None:
            assert frames is not None
            latent_frames = g.latents[0].shape[1]
            time_chunks = math.ceil(latent_frames / frame_chunk)
            stride = snapshot_stride(math.ceil(len(g) / size) * time_chunks, frames.snapshot_every)
            split = frames.runner.state
            note += (
                f" x {time_chunks} time chunk(s) of {frame_chunk} latent frame(s) ({frame_note}; "
                f"{type(frames.runner.vae).__name__}, cache kept every {stride} time chunk(s)"
                f"{'' if split is None else f', height split over {split.world} ranks'})"
            )
        elif frames is not None:
            note += f" (whole items: {frame_note})"
        elif len(g.item_shape()) == 4 and g.item_shape()[1] > 1 and torch.is_grad_enabled():
            latent_frames = g.latents[0].shape[-3]
            if vae is not None:
                note += (
                    f" (whole videos: {type(vae).__name__} decodes all frames in one pass, no frame loop carrying "
                    "a cache to cut; split it over ranks to divide its memory)"
                )
            else:
                note += (
                    " (whole videos: decode is a function hfpatch cannot see into; pass the VAE itself or its "
                    "bound vae.decode, with unnormalised latents, to chunk videos over time)"
                )
                if latent_frames > OPAQUE_FRAMES:
                    _warn_once(
                        f"chunked_pixel_loss: decode is a function hfpatch cannot see into, so each video of "
                        f"{latent_frames} latent frames is decoded whole and its activations are held until "
                        "backward; pass the VAE itself or its bound vae.decode (with unnormalised latents) to "
                        "decode AutoencoderKLWan/AutoencoderKLCogVideoX videos over time with bounded memory"
                    )
        notes.append(note)
    logger.debug(
        "pixel loss plan: %s, recompute=%s; %s", loss_kind, torch.is_grad_enabled(), "; ".join(notes)
    )
    return plans


def _check_video_targets(runner: WanFrames | CogVideoXFrames, group: _Group) -> None:
    """Targets of the decoded size, checked before any decode (the time chunks decode piece by piece)."""
    latents = tuple(group.latents[0].shape)
    expected, got = runner.decoded_shape(latents), group.item_shape()
    if expected != got:
        raise ValueError(
            f"{type(runner.vae).__name__} decodes latents of shape {latents} to videos of shape {expected}, but "
            f"the targets have shape {got}; pass targets (and masks) of the decoded size (1 + 4 (T - 1) frames), "
            "e.g. crop or pad them to the VAE's output size."
        )


def _probe_item_bytes(
    decode: Decode,
    loss_kind: str,
    group: _Group,
    frames: _Frames | None = None,
    frame_chunk: int | None = None,
) -> int:
    """Peak bytes of one item's decode + error (and its backward when grad is on), RNG state restored."""
    from hfpatch.testing.memory import track_memory  # torch-only; lazy to keep the common path import-light

    chunk = group.chunks(1)[0]
    latents = _stack(chunk.latents).detach()
    grad = torch.is_grad_enabled()
    devices = [latents.device] if latents.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), track_memory() as memory:
        latents.requires_grad_(grad)
        if frame_chunk is not None:
            assert frames is not None
            item = _Group(
                latents, _stack(chunk.targets), None if chunk.masks is None else _stack(chunk.masks)
            )
            part = _video_error_sum(frames, loss_kind, item, _GroupPlan(1, frame_chunk))
        else:
            part = _chunk_error_sum(decode, loss_kind, latents, chunk.targets, chunk.masks)
        if grad:
            torch.autograd.grad(part, latents)
    return memory.peak_bytes


def _video_error_sum(frames: _Frames, loss_kind: str, group: _Group, plan: _GroupPlan) -> torch.Tensor:
    """Error sum of a group of videos, decoded ``plan.items`` videos x ``plan.frames`` latent frames at a time
    under :func:`causal_checkpoint` (each time chunk's loss taken as soon as its frames exist)."""
    runner = frames.runner
    # A split VAE: every rank must hold the same latents and targets (each computes the whole loss).
    named = {"targets": group.targets, "masks": group.masks}
    others = {f"{k}_{i}": t for k, v in named.items() if v is not None for i, t in enumerate(_items(v))}
    latents = runner.enter(_stack(group.latents), "decode", **others)
    assert plan.frames is not None
    latent_frames = latents.shape[2]
    segments = span_segments(len(group), plan.items, runner.spans(latent_frames, plan.frames))

    def step(k: int, cache: list | None, z: torch.Tensor) -> tuple[torch.Tensor, list]:
        segment = segments[k]
        items, span = segment.index[0], segment.index[2]
        pixels = slice(*runner.pixel_span(latent_frames, span.start, span.stop))
        pred, cache = runner.decode(cache, z, first=segment.fresh, full=True)
        targets = _frame_slice(group.targets, items, pixels)
        masks = None if group.masks is None else _frame_slice(group.masks, items, pixels)
        _check_decoded(tuple(pred.shape), tuple(z.shape), tuple(targets.shape))
        return _error_sum(pred, targets, masks, loss_kind), cache

    return causal_checkpoint(
        step, latents, segments, runner.decoder_params(), reduce="sum", snapshot_every=frames.snapshot_every
    )


def _items(items: _Items) -> tuple[torch.Tensor, ...]:
    return (items,) if isinstance(items, torch.Tensor) else tuple(items)


def _frame_slice(items: _Items, which: slice, frames: slice) -> torch.Tensor:
    """Frames ``frames`` of items ``which`` as one batch (a copy of these frames only, for lists)."""
    if isinstance(items, torch.Tensor):
        return items[which][:, :, frames]
    return torch.stack([item[:, frames] for item in items[which]])


def _describe(groups: list[_Group]) -> str:
    return "; ".join(f"{len(g)} x {g.item_shape()}" for g in groups)


def _why_reference(reference: bool) -> str:
    return "reference=True" if reference else f"{REFERENCE_ENV}=1"
