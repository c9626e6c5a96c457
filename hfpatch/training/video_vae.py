"""Wan VAE decode and encode for training, with memory bounded over frames (Wan 2.1 and 2.2).

``AutoencoderKLWan`` decodes a video one latent frame at a time: every causal convolution keeps its last two
input frames in a cache (``feat_cache``), which is all a frame needs from the past. Differentiated as it is,
the decode holds the graph of every frame until ``backward()``, so the memory of a training step grows with
the video (one 480x832 video with the Wan 2.1 VAE in bf16: 23.7 GiB at 5 frames, 69.7 GiB at 17, out of
memory on 80 GB at 33). :func:`checkpointed_decode` and :func:`checkpointed_encode` run the same frame loop
under :func:`hfpatch.training.causal_checkpoint.causal_checkpoint`: the forward keeps no graph, only some of
the caches, and the backward recomputes one time segment at a time, newest first, back-propagating the
gradient of each segment's outgoing cache into the previous one. Results and gradients (latents, video,
trainable VAE weights, LoRA) equal ``vae.decode``/``vae.encode`` up to floating-point reassociation.

With a VAE split over ranks by ``hfpatch.apply(vae, parallel=N)``, each segment is a split call of its own:
time segments x height shards. Every rank passes the same input (checked once, on entry), every recompute
replays the same collectives in the same order on every rank (each segment starts by exchanging the halo
rows of the cache it is given), and the gradients follow hfpatch's convention (the input gradient is the
full one on every rank; parameter gradients average over the VAE ranks: DDP or
:func:`hfpatch.all_reduce_gradients`).

:func:`hfpatch.training.chunked_pixel_loss` uses the same machinery when given the VAE itself, and also
computes the loss per segment, so not even the decoded video is held.

``AutoencoderKLCogVideoX`` (CogVideoX, ConsisID) runs the same way over its own frame loop
(:class:`CogVideoXFrames`): its stock decode calls the decoder on batches of 2 latent frames (the first batch takes
the odd one), carrying a ``conv_cache``; its GroupNorm statistics are per batch, so the segments are exactly those
batches. The other video VAEs (HunyuanVideo 1 and 1.5, LTX-Video, LTX-2, Mochi, Cosmos, Allegro) decode all
frames in one pass (statistics or attention over every frame, or no cache to carry): there is no frame loop to
cut exactly, and :func:`frames_for` returns ``None`` for them (a split divides their memory by the ranks instead).

>>> import torch
>>> from hfpatch.testing import tiny_wan_vae
>>> from hfpatch.training import checkpointed_decode
>>> vae = tiny_wan_vae("2.1")
>>> z = torch.randn(1, 4, 3, 2, 2, requires_grad=True)
>>> video = checkpointed_decode(vae, z).sample                 # 1 + 4 * 2 pixel frames
>>> video.square().mean().backward()
>>> ours = z.grad.clone(); z.grad = None
>>> vae.decode(z).sample.square().mean().backward()           # the stock decode, one shot
>>> tuple(video.shape), torch.allclose(ours, z.grad, atol=1e-6)
((1, 3, 9, 16, 16), True)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from ..core.registry import class_key
from ..distributed.agreement import check_same_inputs
from ..distributed.gradients import grad_averaged_over_group, grad_scaled_by_group
from .causal_checkpoint import Segment, causal_checkpoint, snapshot_stride

__all__ = [
    "CogVideoXFrames",
    "WanFrames",
    "checkpointed_decode",
    "checkpointed_encode",
    "frames_for",
    "is_wan_vae",
    "span_segments",
    "time_segments",
    "vae_behind",
]

WAN_VAE = "diffusers.AutoencoderKLWan"
COGVIDEOX_VAE = "diffusers.AutoencoderKLCogVideoX"


def _is(obj: Any, key: str) -> bool:
    return any(class_key(cls) == key for cls in type(obj).__mro__)


def is_wan_vae(obj: Any) -> bool:
    """Whether ``obj`` is a diffusers ``AutoencoderKLWan`` (or a subclass); imports nothing."""
    return _is(obj, WAN_VAE)


def vae_behind(decode: Any) -> Any:
    """The VAE a ``decode`` argument stands for: a diffusers VAE itself, or its bound ``vae.decode`` (the stock
    method, not an override); ``None`` for anything else (a lambda or a function: opaque to hfpatch).

    >>> from hfpatch.testing import tiny_wan_vae
    >>> vae = tiny_wan_vae("2.1")
    >>> vae_behind(vae.decode) is vae, vae_behind(lambda z: vae.decode(z)) is None
    (True, True)
    """
    if isinstance(decode, torch.nn.Module) and callable(getattr(decode, "decode", None)):
        return decode
    owner, function = getattr(decode, "__self__", None), getattr(decode, "__func__", None)
    if isinstance(owner, torch.nn.Module) and function is not None:
        stock = getattr(type(owner), "decode", None)
        if function is stock or getattr(function, "__wrapped__", None) is getattr(
            stock, "__wrapped__", stock
        ):
            return owner
    return None


def frames_for(vae: Any) -> WanFrames | CogVideoXFrames | None:
    """The frame loop of a causal video VAE that carries a cache from one segment to the next (Wan 2.1/2.2,
    CogVideoX), or ``None`` (a VAE that decodes all frames in one pass, or not a VAE)."""
    if is_wan_vae(vae):
        return WanFrames(vae)
    if _is(vae, COGVIDEOX_VAE):
        return CogVideoXFrames(vae)
    return None


def span_segments(items: int, item_chunk: int, spans: list[tuple[int, int]]) -> list[Segment]:
    """The sweep over ``items`` videos in chunks of ``item_chunk`` items, each read frame span by frame span
    (``spans``: ``[start, stop)`` along dim 2); a segment reads ``x[index]``, the first span of a chunk is fresh.

    >>> [(s.index[0], s.index[2], s.fresh) for s in span_segments(2, 2, [(0, 3), (3, 5)])]
    [(slice(0, 2, None), slice(0, 3, None), True), (slice(0, 2, None), slice(3, 5, None), False)]
    """
    return [
        Segment((slice(i, min(i + item_chunk, items)), slice(None), slice(a, b)), fresh=a == spans[0][0])
        for i in range(0, items, item_chunk)
        for a, b in spans
    ]


def time_segments(items: int, item_chunk: int, latent_frames: int, frame_chunk: int) -> list[Segment]:
    """The sweep over ``items`` videos of ``latent_frames`` latent frames: chunks of ``item_chunk`` items, each
    decoded ``frame_chunk`` latent frames at a time; a segment reads ``latents[index]``.

    >>> [(s.index[0], s.index[2], s.fresh) for s in time_segments(3, 2, 3, 2)]  # doctest: +NORMALIZE_WHITESPACE
    [(slice(0, 2, None), slice(0, 2, None), True), (slice(0, 2, None), slice(2, 3, None), False),
     (slice(2, 3, None), slice(0, 2, None), True), (slice(2, 3, None), slice(2, 3, None), False)]
    """
    return [
        Segment(
            (
                slice(i, min(i + item_chunk, items)),
                slice(None),
                slice(t, min(t + frame_chunk, latent_frames)),
            ),
            fresh=t == 0,
        )
        for i in range(0, items, item_chunk)
        for t in range(0, latent_frames, frame_chunk)
    ]


class WanFrames:
    """The stock frame loops of an ``AutoencoderKLWan`` (``_decode``, ``_encode``), one time segment per call.

    Each call takes the causal cache entering the segment (``None`` at a video's start) and returns the
    segment's output and the cache leaving it; the VAE's own cache (``vae._feat_map``) is never used. On a VAE
    split by ``hfpatch.apply``, a call is one split session (the height is sliced at the decoder's/encoder's
    entry, the output rows are gathered, or kept with ``vae_output="shard"`` unless ``full=True``).

    Args:
        vae: A stock ``AutoencoderKLWan`` (Wan 2.1 or 2.2), split or not.
    """

    def __init__(self, vae: Any) -> None:
        if not is_wan_vae(vae):
            raise TypeError(f"WanFrames needs a diffusers AutoencoderKLWan, got {type(vae).__name__}")
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

        self.vae = vae
        self.state = _split_state(vae)
        self.patch_size = vae.config.patch_size
        self.temporal = 2 ** sum(bool(u) for u in vae.temperal_upsample)  # pixel frames per latent frame
        self.spatial = int(vae.config.scale_factor_spatial)
        self.decoder_convs = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        self.encoder_convs = sum(isinstance(m, WanCausalConv3d) for m in vae.encoder.modules())

    # ------------------------------------------------------------------------------------------- geometry
    def pixel_frame(self, latent_frame: int) -> int:
        """First pixel frame decoded from ``latent_frame`` (frame 0 decodes to one pixel frame)."""
        return 0 if latent_frame == 0 else 1 + self.temporal * (latent_frame - 1)

    def latent_frames(self, pixel_frames: int) -> int:
        """Latent frames the stock encoder makes of ``pixel_frames`` (trailing frames past ``1 + 4k`` dropped)."""
        return 1 + (pixel_frames - 1) // self.temporal

    def decoded_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """``(C, frames, H, W)`` of one decoded item of latent shape ``(C_lat, T, h, w)``."""
        _, t, h, w = latent_shape
        channels = self.vae.config.out_channels // (self.patch_size or 1) ** 2
        return (channels, self.pixel_frame(t), h * self.spatial, w * self.spatial)

    def spans(self, latent_frames: int, per_segment: int) -> list[tuple[int, int]]:
        """Latent frame spans of the decode segments: ``per_segment`` frames each."""
        return [(t, min(t + per_segment, latent_frames)) for t in range(0, latent_frames, per_segment)]

    def pixel_span(self, latent_frames: int, start: int, stop: int) -> tuple[int, int]:
        """Pixel frames decoded from latent frames ``[start, stop)``."""
        return self.pixel_frame(start), self.pixel_frame(stop)

    def encode_spans(self, pixel_frames: int, per_segment: int) -> list[tuple[int, int]]:
        """Pixel frame spans of the encode segments (``per_segment`` latent frames each; frames past the last
        ``1 + 4k`` are not encoded, as in ``vae.encode``)."""
        latent = self.latent_frames(pixel_frames)
        return [self.pixel_span(latent, a, b) for a, b in self.spans(latent, per_segment)]

    def decoder_params(self) -> list[torch.nn.Parameter]:
        return [*self.vae.post_quant_conv.parameters(), *self.vae.decoder.parameters()]

    def encoder_params(self) -> list[torch.nn.Parameter]:
        return [*self.vae.encoder.parameters(), *self.vae.quant_conv.parameters()]

    # ------------------------------------------------------------------------------------------- entry
    def enter(self, x: torch.Tensor, what: str, **others: Any) -> torch.Tensor:
        """Before the first segment of a split call: the same-input check (of ``x`` and of ``others``, e.g. the
        loss targets computed on every rank), and the input gradient's average over the VAE ranks (each
        rank's covers its own rows, N-scaled). Identity on an unsplit VAE."""
        if self.state is None:
            return x
        check_same_inputs(
            {"x": x, **others},
            self.state.group,
            what=f"{self.state.name}.{what}",
            enabled=self.state.check_inputs,
            hint="Every rank of a split VAE must pass the same video/latents (and loss targets): gather them "
            "first, or do not split this VAE (ParallelConfig(..., vae=1)).",
        )
        return grad_averaged_over_group(x, self.state.group)

    # ------------------------------------------------------------------------------------------- segments
    def decode(
        self, cache: list[Any] | None, z: torch.Tensor, first: bool, full: bool = False
    ) -> tuple[torch.Tensor, list[Any]]:
        """Decode latent frames ``z`` (``[B, C, f, h, w]``) following ``cache`` (``None``: ``z`` starts the
        video, ``first``). Returns pixel frames in ``[-1, 1]`` as ``vae.decode(...).sample`` has them."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        vae = self.vae
        feat = [None] * self.decoder_convs if cache is None else cache
        try:
            with self._session() as state:
                x = vae.post_quant_conv(z)  # 1x1x1: frame- and row-local
                frames = [
                    vae.decoder(
                        x[:, :, i : i + 1], feat_cache=feat, feat_idx=[0], first_chunk=first and i == 0
                    )
                    for i in range(x.shape[2])
                ]
                out = frames[0] if len(frames) == 1 else torch.cat(frames, 2)
                del frames, x
                if self.patch_size is not None:
                    out = unpatchify(out, patch_size=self.patch_size)
                out = out.clamp(-1.0, 1.0)
                if state is not None:
                    out = self._finish(out, state, full)
        except BaseException:
            feat.clear()  # the failed segment's frames: not kept by this frame while the error is handled
            raise
        return out, feat

    def encode(
        self, cache: list[Any] | None, x: torch.Tensor, first: bool, full: bool = False
    ) -> tuple[torch.Tensor, list[Any]]:
        """Encode pixel frames ``x`` (``[B, C, F, H, W]``; ``1 + 4k`` frames when ``first``, else ``4k``) following
        ``cache``. Returns the latent moments (``vae._encode``'s output) of the ``k (+1)`` latent frames."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

        vae = self.vae
        feat = [None] * self.encoder_convs if cache is None else cache
        try:
            with self._session() as state:
                if self.patch_size is not None:
                    x = patchify(x, patch_size=self.patch_size)
                sizes = ([1] if first else []) + [self.temporal] * ((x.shape[2] - first) // self.temporal)
                parts = [vae.encoder(part, feat_cache=feat, feat_idx=[0]) for part in x.split(sizes, 2)]
                out = vae.quant_conv(parts[0] if len(parts) == 1 else torch.cat(parts, 2))
                del parts
                if state is not None:
                    out = self._finish(out, state, full)
        except BaseException:
            feat.clear()
            raise
        return out, feat

    @contextmanager
    def _session(self) -> Iterator[Any]:
        if self.state is None:
            yield None
            return
        with self.state.session():  # a fresh session: no halo rows of an earlier segment's cache are kept
            yield self.state

    @staticmethod
    def _finish(out: torch.Tensor, state: Any, full: bool) -> torch.Tensor:
        from ..patches.vae.state import gather_rows

        if full or state.output == "full":
            return gather_rows(out, state)
        return grad_scaled_by_group(out, state.group)  # vae_output="shard": this rank's rows


class CogVideoXFrames(WanFrames):
    """The stock frame loops of an ``AutoencoderKLCogVideoX`` (``_decode``: batches of
    ``vae.num_latent_frames_batch_size`` latent frames, ``_encode``: of ``vae.num_sample_frames_batch_size`` pixel
    frames; the first batch takes the remainder), one batch per segment, carrying the ``conv_cache``.

    Each batch is a segment of its own and segments never span two batches: the GroupNorm statistics of the
    stock VAE are per batch, so any other cut would compute something else. The cache (a nested dict) travels as
    its list of leaves. Split by ``hfpatch.apply``, each call is a split session, its cache holds this rank's rows.
    """

    def __init__(self, vae: Any) -> None:
        if not _is(vae, COGVIDEOX_VAE):
            raise TypeError(
                f"CogVideoXFrames needs a diffusers AutoencoderKLCogVideoX, got {type(vae).__name__}"
            )
        from diffusers.models.downsampling import CogVideoXDownsample3D
        from diffusers.models.upsampling import CogVideoXUpsample3D

        self.vae = vae
        self.state = _split_state(vae)
        self.up = sum(isinstance(m, CogVideoXUpsample3D) and m.compress_time for m in vae.decoder.modules())
        self.down = sum(
            isinstance(m, CogVideoXDownsample3D) and m.compress_time for m in vae.encoder.modules()
        )
        self.temporal = 2**self.up
        self.spatial = 2 ** (len(vae.config.block_out_channels) - 1)
        self._spec: Any = None  # the cache's tree structure (the same for every batch)

    @staticmethod
    def _batches(frames: int, size: int) -> list[tuple[int, int]]:
        """The stock loop's ``[start, stop)`` batches of ``frames``: the first takes the remainder."""
        remainder = frames % size
        count = max(frames // size, 1)
        return [
            (size * i + (0 if i == 0 else remainder), min(size * (i + 1) + remainder, frames))
            for i in range(count)
        ]

    def _up(self, frames: int) -> int:
        for _ in range(self.up):  # CogVideoXUpsample3D: an odd count keeps its first frame, the rest double
            frames = 1 + 2 * (frames - 1) if frames > 1 and frames % 2 else (2 * frames if frames > 1 else 1)
        return frames

    def _down(self, frames: int) -> int:
        for _ in range(
            self.down
        ):  # CogVideoXDownsample3D: an odd count keeps its first frame, the rest halve
            frames = 1 + (frames - 1) // 2 if frames % 2 else frames // 2
        return frames

    def spans(self, latent_frames: int, per_segment: int) -> list[tuple[int, int]]:
        """The stock decode's batches (``per_segment`` is not used: the batches are the VAE's)."""
        return self._batches(latent_frames, self.vae.num_latent_frames_batch_size)

    def pixel_span(self, latent_frames: int, start: int, stop: int) -> tuple[int, int]:
        first = sum(self._up(b - a) for a, b in self.spans(latent_frames, 1) if b <= start)
        return first, first + sum(
            self._up(b - a) for a, b in self.spans(latent_frames, 1) if start <= a < stop
        )

    def encode_spans(self, pixel_frames: int, per_segment: int) -> list[tuple[int, int]]:
        return self._batches(pixel_frames, self.vae.num_sample_frames_batch_size)

    def latent_frames(self, pixel_frames: int) -> int:
        return sum(self._down(b - a) for a, b in self.encode_spans(pixel_frames, 1))

    def decoded_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        _, t, h, w = latent_shape
        return (self.vae.config.out_channels, self.pixel_span(t, 0, t)[1], h * self.spatial, w * self.spatial)

    def decoder_params(self) -> list[torch.nn.Parameter]:
        quant = self.vae.post_quant_conv
        return [*(quant.parameters() if quant is not None else ()), *self.vae.decoder.parameters()]

    def encoder_params(self) -> list[torch.nn.Parameter]:
        quant = self.vae.quant_conv
        return [*self.vae.encoder.parameters(), *(quant.parameters() if quant is not None else ())]

    def _call(
        self, coder: Any, quant: Any, cache: list[Any] | None, x: torch.Tensor, full: bool, after: bool
    ):
        from torch.utils._pytree import tree_flatten, tree_unflatten

        conv_cache = None if cache is None else tree_unflatten(cache, self._spec)
        with self._session() as state:
            if quant is not None and not after:
                x = quant(x)
            out, conv_cache = coder(x, conv_cache=conv_cache)
            if quant is not None and after:
                out = quant(out)
            if state is not None:
                out = self._finish(out, state, full)
        leaves, self._spec = tree_flatten(conv_cache)
        return out, leaves

    def decode(
        self, cache: list[Any] | None, z: torch.Tensor, first: bool, full: bool = False
    ) -> tuple[torch.Tensor, list[Any]]:
        """Decode one batch of latent frames ``z`` following ``cache`` (``None``: the video's first batch)."""
        return self._call(self.vae.decoder, self.vae.post_quant_conv, cache, z, full, after=False)

    def encode(
        self, cache: list[Any] | None, x: torch.Tensor, first: bool, full: bool = False
    ) -> tuple[torch.Tensor, list[Any]]:
        """Encode one batch of pixel frames ``x`` following ``cache``; returns the latent moments."""
        return self._call(self.vae.encoder, self.vae.quant_conv, cache, x, full, after=True)


def _split_state(vae: Any) -> Any:
    from ..patches.vae.state import STATE_ATTR

    return getattr(vae, "__dict__", {}).get(STATE_ATTR)


def _needs_graph(x: torch.Tensor, params: list[torch.nn.Parameter]) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))


def _check_video(x: Any, what: str, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what} takes a video batch [B, C, frames, H, W], got {got}")
    if x.shape[2] == 0:
        raise ValueError(f"{what} got a video with no frames ({tuple(x.shape)}); pass at least one {name}")


def _check_frames(frames_per_segment: object) -> int:
    if (
        isinstance(frames_per_segment, bool)
        or not isinstance(frames_per_segment, int)
        or frames_per_segment < 1
    ):
        raise ValueError(
            f"frames_per_segment must be an int >= 1 (latent frames), got {frames_per_segment!r}"
        )
    return frames_per_segment


def _check_no_tiling(vae: Any, what: str) -> None:
    if getattr(vae, "use_tiling", False):
        raise ValueError(
            f"{what} decodes/encodes frame by frame without tiles, so it would not equal the tiled "
            f"{type(vae).__name__}; call vae.disable_tiling() (tiling does not bound training memory: the "
            "graph of every tile is kept) or use the stock method"
        )


def checkpointed_decode(
    vae: Any,
    latents: torch.Tensor,
    *,
    frames_per_segment: int = 1,
    snapshot_every: int | Literal["auto"] = "auto",
    return_dict: bool = True,
) -> Any:
    """``vae.decode(latents)`` for training: the memory of one time segment, not of the whole video.

    Without gradients (``torch.no_grad()``, or neither the latents nor the decoder's weights require grad)
    this is ``vae.decode(latents)`` itself: its frame loop keeps no graph.

    Args:
        vae: A diffusers ``AutoencoderKLWan`` (Wan 2.1 or 2.2) or ``AutoencoderKLCogVideoX`` (or its bound
            ``decode``), possibly split by ``hfpatch.apply``.
        latents: ``[B, C_lat, T, h, w]``, as ``vae.decode`` takes them.
        frames_per_segment: Latent frames per time segment (Wan: each decodes to 4 pixel frames, the first
            latent frame to 1; CogVideoX: not used, its segments are its stock batches of 2). The step's
            activations are those of one segment.
        snapshot_every: Caches kept by the forward (:func:`~hfpatch.training.causal_checkpoint.causal_checkpoint`):
            ``"auto"`` (every ``ceil(sqrt(segments))``-th: one extra no-grad decode of most segments, caches
            held grow as ``2 sqrt(segments)``) or an int (``1``: every cache, no extra decode).
        return_dict: As ``vae.decode``: a ``DecoderOutput`` (default) or a one-element tuple.

    Returns:
        ``DecoderOutput(sample=video)`` (or ``(video,)``): the video ``vae.decode`` returns, differentiable
        w.r.t. the latents and the decoder's weights. With ``vae.enable_slicing()`` the items run one by one.

    Raises:
        TypeError: ``vae`` is not an ``AutoencoderKLWan`` or ``AutoencoderKLCogVideoX``.
        ValueError: Not a 5-D batch, no frames, a bad ``frames_per_segment``/``snapshot_every``, or tiling on
            while gradients are needed (all before any decode).
    """
    vae = vae_behind(vae) or vae
    frames = _frames(vae, "checkpointed_decode")
    _check_video(latents, "checkpointed_decode", "latent frame")
    per_segment = _check_frames(frames_per_segment)
    snapshot_stride(1, snapshot_every)
    if not _needs_graph(latents, frames.decoder_params()) or latents.shape[0] == 0:
        return vae.decode(latents, return_dict=return_dict)
    _check_no_tiling(vae, "checkpointed_decode")
    z = frames.enter(latents, "decode")
    items = z.split(1) if vae.use_slicing else (z,)
    video = torch.cat([_decode_sequence(frames, item, per_segment, snapshot_every) for item in items])
    if not return_dict:
        return (video,)
    from diffusers.models.autoencoders.vae import DecoderOutput

    return DecoderOutput(sample=video)


def _frames(vae: Any, what: str) -> WanFrames | CogVideoXFrames:
    frames = frames_for(vae)
    if frames is None:
        raise TypeError(
            f"{what} needs a diffusers AutoencoderKLWan or AutoencoderKLCogVideoX (a causal VAE whose frame loop "
            f"carries a cache), got {type(vae).__name__}"
        )
    return frames


def _decode_sequence(
    frames: WanFrames, z: torch.Tensor, per_segment: int, snapshot_every: int | str
) -> torch.Tensor:
    segments = span_segments(z.shape[0], z.shape[0], frames.spans(z.shape[2], per_segment))
    return causal_checkpoint(
        lambda k, cache, z_k: frames.decode(cache, z_k, first=segments[k].fresh),
        z,
        segments,
        frames.decoder_params(),
        reduce="cat",
        dim=2,
        snapshot_every=snapshot_every,
    )


def checkpointed_encode(
    vae: Any,
    video: torch.Tensor,
    *,
    frames_per_segment: int = 1,
    snapshot_every: int | Literal["auto"] = "auto",
    return_dict: bool = True,
) -> Any:
    """``vae.encode(video)`` for training (a loss through the encoder, VAE fine-tuning) with the memory of one
    time segment; without gradients it is ``vae.encode(video)`` itself.

    Args:
        vae: A diffusers ``AutoencoderKLWan`` (Wan 2.1 or 2.2) or ``AutoencoderKLCogVideoX``, possibly split
            by ``hfpatch.apply``.
        video: ``[B, C, F, H, W]`` in ``[-1, 1]``; as in ``vae.encode``, frames past the last ``1 + 4k`` are
            not encoded (Wan).
        frames_per_segment: Latent frames per time segment (Wan: 4 pixel frames each, the first latent frame
            encodes 1 pixel frame; CogVideoX: not used, its segments are its stock batches of 8 frames).
        snapshot_every: As in :func:`checkpointed_decode`.
        return_dict: As ``vae.encode``: an ``AutoencoderKLOutput`` (default) or a one-element tuple.

    Returns:
        ``AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution(moments))`` (or ``(latent_dist,)``),
        differentiable w.r.t. the video and the encoder's weights.

    Raises:
        TypeError, ValueError: As :func:`checkpointed_decode`.

    >>> import torch
    >>> from hfpatch.testing import tiny_wan_vae
    >>> vae = tiny_wan_vae("2.2")
    >>> video = torch.rand(1, 3, 9, 32, 32, requires_grad=True)
    >>> posterior = checkpointed_encode(vae, video).latent_dist
    >>> tuple(posterior.mean.shape)
    (1, 4, 3, 2, 2)
    >>> torch.allclose(posterior.mean, vae.encode(video).latent_dist.mean, atol=1e-6)
    True
    """
    vae = vae_behind(vae) or vae
    frames = _frames(vae, "checkpointed_encode")
    _check_video(video, "checkpointed_encode", "frame")
    per_segment = _check_frames(frames_per_segment)
    snapshot_stride(1, snapshot_every)
    if not _needs_graph(video, frames.encoder_params()) or video.shape[0] == 0:
        return vae.encode(video, return_dict=return_dict)
    _check_no_tiling(vae, "checkpointed_encode")
    x = frames.enter(video, "encode")
    spans = frames.encode_spans(x.shape[2], per_segment)
    x = x[:, :, : spans[-1][1]]
    items = x.split(1) if vae.use_slicing else (x,)
    moments = torch.cat([_encode_sequence(frames, item, spans, snapshot_every) for item in items])
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from diffusers.models.modeling_outputs import AutoencoderKLOutput

    posterior = DiagonalGaussianDistribution(moments)
    return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)


def _encode_sequence(
    frames: WanFrames, x: torch.Tensor, spans: list[tuple[int, int]], snapshot_every: int | str
) -> torch.Tensor:
    # Segments index pixel frames: each encodes to its latent frames, in order.
    segments = span_segments(x.shape[0], x.shape[0], spans)
    return causal_checkpoint(
        lambda k, cache, x_k: frames.encode(cache, x_k, first=segments[k].fresh),
        x,
        segments,
        frames.encoder_params(),
        reduce="cat",
        dim=2,
        snapshot_every=snapshot_every,
    )
