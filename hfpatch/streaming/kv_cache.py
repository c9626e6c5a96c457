"""Streaming configuration, the block-causal visibility rule, and the bounded KV cache of a streaming Wan DiT.

Frames are addressed by their absolute latent-frame index. A *stream* starts at ``start`` (the first frame
written after a reset). Frames are grouped in blocks of ``num_frame_per_block`` frames; every frame of block
``b`` (frames ``[s, e)``) sees exactly the frames

* ``[start, start + sink_size)`` (the pinned *sink*), and
* ``[e - (local_attn_size - sink_size), e)`` (the recent *window*, its own block included),

clipped to ``[start, e)``; ``local_attn_size=-1`` means every frame in ``[start, e)``. This one rule
(:func:`visible_frames`) drives both the block-causal full forward used for training and the cached
block-by-block forward used for generation, so the two agree by construction and the tests check it. The
one exception is the re-encode after a prompt switch (:func:`~hfpatch.streaming.recache`): its frames run as
one chunk that sees itself whole and the cached frames visible from its end (:meth:`StreamingKVCache.plan_chunk`).

The cache keeps one preallocated key/value buffer per transformer block with room for
``StreamingConfig.cache_frames`` frames: sink frames get fixed slots, window frames rotate through the
remaining slots (a frame evicts the frame ``local_attn_size - sink_size`` before it, which no later block
can see). Memory is therefore fixed once allocated and readable from :attr:`StreamingKVCache.nbytes`.

>>> from hfpatch.streaming import StreamingConfig, visible_frames
>>> config = StreamingConfig(num_frame_per_block=2, local_attn_size=6, sink_size=2)
>>> visible_frames(config, start=0, block_end=10)
[0, 1, 6, 7, 8, 9]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CrossAttentionCache", "StreamingConfig", "StreamingKVCache", "visible_frames"]


@dataclass(frozen=True)
class StreamingConfig:
    """How a Wan transformer streams: block size, attention window, sink and cache capacity.

    Args:
        num_frame_per_block: Latent frames generated together (attend to each other bidirectionally).
        local_attn_size: Latent frames one block attends to, sink and its own block included; ``-1`` for
            every earlier frame of the stream (then the cache holds ``max_frames`` frames).
        sink_size: The first frames of the stream, always visible (attention sink, as in LongLive).
        max_frames: Cache capacity in frames when ``local_attn_size == -1``; a longer stream is an error.
        compile: Run each cached block's forward (a denoising step or the context pass on one block of
            ``num_frame_per_block`` frames) through ``torch.compile(fullgraph=True)``. Shapes are static (every
            block attends to the whole preallocated cache, the frames it may not see masked out), so two graphs
            serve a whole stream, each compiled once: the warm-up blocks, while the cache still has empty or
            invisible slots (key mask), and the steady blocks once every cached frame is visible (no mask, the
            kernel the stock attention gets). The first block of a new cache (which allocates it), re-encodes
            (``recache``) and calls without a cache run eagerly. Outputs equal the eager forward (bit for bit
            with ``compile_backend="eager"``/``"aot_eager"``; up to the compiler's fused arithmetic with inductor).
        compile_backend: The ``torch.compile`` backend (``"inductor"``; ``"aot_eager"``/``"eager"`` to debug).
        cuda_graphs: Also capture the compiled graphs as CUDA graphs (``mode="reduce-overhead"``; needs
            ``compile=True``, inductor and a CUDA model): the cache and text keys/values stay at fixed
            addresses, so each block replays its graph instead of launching its kernels one by one.

    Raises:
        ValueError: If the window cannot hold the sink plus one block, a size is not positive, or the compile
            options do not fit together.

    >>> StreamingConfig(num_frame_per_block=3, local_attn_size=12, sink_size=3).cache_frames
    12
    """

    num_frame_per_block: int = 3
    local_attn_size: int = -1
    sink_size: int = 0
    max_frames: int = 240
    compile: bool = False
    compile_backend: str = "inductor"
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        for name in ("compile", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StreamingConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.cuda_graphs and not self.compile:
            raise ValueError(
                "StreamingConfig(cuda_graphs=True) captures the compiled block forward as CUDA graphs: set "
                "compile=True too"
            )
        if self.compile:
            from ..core.compile import check_compile_backend

            check_compile_backend(self.compile_backend, self.cuda_graphs, "StreamingConfig")
        for name in ("num_frame_per_block", "max_frames"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StreamingConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.sink_size, int) or self.sink_size < 0:
            raise ValueError(f"StreamingConfig.sink_size must be an int >= 0, got {self.sink_size!r}")
        if self.local_attn_size != -1:
            if self.local_attn_size < self.sink_size + self.num_frame_per_block:
                raise ValueError(
                    f"StreamingConfig.local_attn_size={self.local_attn_size} must be -1 (global) or at least "
                    f"sink_size + num_frame_per_block = {self.sink_size + self.num_frame_per_block}, so that "
                    "a block sees the sink and itself"
                )
        elif self.max_frames < self.num_frame_per_block:
            raise ValueError(
                f"StreamingConfig.max_frames={self.max_frames} must hold at least one block "
                f"({self.num_frame_per_block} frames)"
            )

    @property
    def cache_frames(self) -> int:
        """Frames the KV cache holds (its preallocated capacity)."""
        return self.max_frames if self.local_attn_size == -1 else self.local_attn_size


def visible_frames(config: StreamingConfig, start: int, block_end: int) -> list[int]:
    """Absolute indices of the frames a block ending at ``block_end`` attends to (ascending)."""
    if config.local_attn_size == -1:
        return list(range(start, block_end))
    sink_end = min(start + config.sink_size, block_end)
    window_start = max(block_end - (config.local_attn_size - config.sink_size), sink_end)
    return list(range(start, sink_end)) + list(range(window_start, block_end))


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``; to CUDA from pinned memory without waiting for the queued kernels (a
    copy from pageable memory first waits for the stream, so the host could not queue the next block ahead)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _tensor_version(tensor: torch.Tensor) -> int | None:
    """The in-place modification counter of ``tensor``; ``None`` for inference tensors, which keep none."""
    try:
        return tensor._version
    except RuntimeError:  # created under torch.inference_mode()
        return None


@dataclass
class CrossAttentionCache:
    """Text keys/values of one block's cross-attention, and the prompt tensor they were computed from.

    The entry serves a later call only for the same prompt tensor, unchanged since: same object, same
    storage and same version counter (``prompt.copy_(other)`` bumps the version, so the entry goes stale),
    and only while the transformer's weights are unchanged (``weights_version``, the sum of the parameters'
    version counters, which an optimizer step or ``load_state_dict`` bumps). Inference tensors
    (``torch.inference_mode()``) keep no version counter: their keys/values are never reused, since an
    in-place change could not be seen; use ``torch.no_grad()`` to cache them. Changes that bump no counter
    (a peft adapter switch or LoRA scale, ``attention_kwargs``) are not seen: call
    :meth:`StreamingKVCache.reset_cross_attention` after them.
    """

    key: torch.Tensor | None = None  # [B, T, heads, head_dim]
    value: torch.Tensor | None = None
    source: torch.Tensor | None = None  # the prompt embeds passed to the transformer
    source_version: int | None = None  # source._version when key/value were computed
    source_ptr: int | None = None  # source.data_ptr() then (``set_`` swaps storage without a new object)
    weights_version: int | None = None  # weights_version(transformer) then

    def matches(self, prompt: torch.Tensor, weights: int | None) -> bool:
        """Whether ``key``/``value`` were computed from ``prompt`` as it is now, by weights of version ``weights``."""
        version = _tensor_version(prompt)
        return (
            self.source is prompt
            and version is not None
            and self.source_version == version
            and self.source_ptr == prompt.data_ptr()
            and weights is not None
            and self.weights_version == weights
        )

    def store(
        self, key: torch.Tensor, value: torch.Tensor, prompt: torch.Tensor, weights: int | None
    ) -> None:
        """Keep ``key``/``value`` computed from ``prompt`` now (its version and storage recorded)."""
        self.key, self.value, self.source = key, value, prompt
        self.source_version, self.source_ptr = _tensor_version(prompt), prompt.data_ptr()
        self.weights_version = weights

    def clear(self) -> None:
        self.key = self.value = self.source = self.source_version = self.source_ptr = None
        self.weights_version = None


def weights_version(module: torch.nn.Module) -> int | None:
    """Sum of the version counters of ``module``'s parameters: it changes whenever any of them is modified in
    place (optimizer steps, ``load_state_dict``, ``copy_``), as counters only grow. ``None`` if a parameter
    keeps no counter (an inference tensor)."""
    total = 0
    for param in module.parameters():
        version = _tensor_version(param)
        if version is None:
            return None
        total += version
    return total


class StreamingKVCache:
    """Self-attention KV cache (sink + rolling window, preallocated) and cross-attention cache of a Wan DiT.

    One cache serves one sequence of one guidance branch. Buffers are allocated on the first write (when
    batch size, tokens per frame, heads, dtype and device are known) and never grow. Keys and values are
    stored detached: gradients of a training step flow through the frames of the current call only. Under a
    sequence-parallel split (:mod:`hfpatch.streaming.sequence_parallel`) each rank's cache holds its part of
    every frame and its heads (``shard`` says which; ``nbytes`` is this rank's), with the same slots.

    Args:
        config: The :class:`StreamingConfig` the transformer was patched with.
        num_layers: Transformer blocks (``len(transformer.blocks)``).

    >>> import torch, hfpatch
    >>> from hfpatch.streaming import StreamingConfig, StreamingKVCache
    >>> from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
    >>> model = tiny_wan_transformer()
    >>> config = StreamingConfig(num_frame_per_block=2, local_attn_size=4, sink_size=0)
    >>> patch = hfpatch.apply(model, streaming=config)
    >>> cache = StreamingKVCache(config, num_layers=len(model.blocks))
    >>> x, prompt = torch.randn(1, 4, 6, 4, 4), wan_prompt_embeds()
    >>> with torch.no_grad():
    ...     for s in range(0, 6, 2):
    ...         _ = model(x[:, :, s:s + 2], torch.tensor([500]), prompt, kv_cache=cache, frame_offset=s)
    >>> # k and v x 2 layers x fp32 x 32 channels x (4 frames x 4 tokens + 6 text tokens)
    >>> cache.frames(), cache.nbytes == 2 * 2 * 4 * 32 * (4 * 4 + 6)
    ([2, 3, 4, 5], True)
    >>> patch.remove()
    """

    def __init__(self, config: StreamingConfig, num_layers: int) -> None:
        self.config = config
        self.num_layers = num_layers
        self.keys: list[torch.Tensor] | None = None  # per layer [B, cache_frames * tokens_per_frame, H, D]
        self.values: list[torch.Tensor] | None = None
        self.cross = [CrossAttentionCache() for _ in range(num_layers)]
        self.tokens_per_frame: int | None = None  # buffer positions per frame (this rank's, when split)
        self.frame_tokens: int | None = None  # tokens of a latent frame of the stream
        self.shard: str | None = None  # which part of each frame a rank of a sequence-parallel split holds
        self.start: int | None = None
        self._slot_frames: list[int] = [-1] * config.cache_frames  # absolute frame held by each slot

    # ---------------------------------------------------------------------------------------- state
    def frames(self) -> list[int]:
        """Absolute indices of the frames whose keys/values are cached (ascending)."""
        return sorted(f for f in self._slot_frames if f >= 0)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache (on this rank): self-attention buffers plus cached text keys/values."""
        total = sum(t.nbytes for t in (self.keys or []) + (self.values or []))
        for layer in self.cross:
            total += sum(t.nbytes for t in (layer.key, layer.value) if t is not None)
        return total

    def reset(self) -> None:
        """Forget every frame and prompt (buffers stay allocated and are zeroed); the next write starts a stream."""
        for buffer in (self.keys or []) + (self.values or []):
            buffer.zero_()
        self._slot_frames = [-1] * self.config.cache_frames
        self.start = None
        self.reset_cross_attention()

    def reset_cross_attention(self) -> None:
        """Drop the cached text keys/values (a prompt switch)."""
        for layer in self.cross:
            layer.clear()

    # ------------------------------------------------------------------------------- slot geometry
    def slot(self, frame: int) -> int:
        """Buffer slot of an absolute frame: sink frames are pinned, window frames rotate."""
        rel = frame - self.start
        sink = self.config.sink_size
        if self.config.local_attn_size == -1:
            if rel >= self.config.max_frames:
                raise ValueError(
                    f"frame {frame} is past the cache capacity of {self.config.max_frames} frames from the stream "
                    f"start {self.start}; raise StreamingConfig.max_frames or use a local_attn_size window"
                )
            return rel
        if rel < sink:
            return rel
        return sink + (rel - sink) % (self.config.local_attn_size - sink)

    def _begin(self, frame_offset: int) -> None:
        """Start the stream at ``frame_offset`` (first call) or check that it does not go back before its start."""
        if self.start is None:
            self.start = frame_offset
        if frame_offset < self.start:
            raise ValueError(
                f"frame_offset={frame_offset} is before the start {self.start} of the cached stream; "
                "call cache.reset() to start a new stream"
            )

    def plan_block(self, frame_offset: int, num_frames: int) -> tuple[list[int], list[int]]:
        """Slots to read (earlier visible frames, ascending) and to write (the block's frames) for one block.

        Raises:
            ValueError: If a visible earlier frame is not cached (blocks run out of order without a recache).
        """
        self._begin(frame_offset)
        block_end = frame_offset + num_frames
        earlier = [f for f in visible_frames(self.config, self.start, block_end) if f < frame_offset]
        missing = [f for f in earlier if self._slot_frames[self.slot(f)] != f]
        if missing:
            raise ValueError(
                f"frames {missing} are visible from the block at frame_offset={frame_offset} but not cached; "
                "run the blocks of a stream in order (or recache the frames first)"
            )
        return [self.slot(f) for f in earlier], [self.slot(f) for f in range(frame_offset, block_end)]

    def plan_chunk(self, frame_offset: int, num_frames: int) -> tuple[list[int], list[int]]:
        """Slots to read and to write for a chunk re-encoded in one forward (:func:`~hfpatch.streaming.recache`).

        The chunk's frames attend to each other without the block-causal mask, and to the cached frames
        visible from the chunk's end that the chunk does not rewrite (the sink, with a global sink); they need
        not be whole blocks. An empty cache starts its stream at ``frame_offset``.

        Raises:
            ValueError: If the cache cannot hold the chunk's frames together (more than the window, or past
                ``max_frames``), or a visible earlier frame is not cached.
        """
        self._begin(frame_offset)
        end = frame_offset + num_frames
        write = [self.slot(f) for f in range(frame_offset, end)]
        if len(set(write)) != len(write):
            raise ValueError(
                f"frames {frame_offset}..{end - 1} do not fit the cache together (sink {self.config.sink_size} + "
                f"window {self.config.local_attn_size - self.config.sink_size} frames from the stream start "
                f"{self.start}); re-encode at most the frames the cache holds"
            )
        earlier = [f for f in visible_frames(self.config, self.start, end) if f < frame_offset]
        missing = [f for f in earlier if self._slot_frames[self.slot(f)] != f]
        if missing:
            raise ValueError(
                f"frames {missing} are visible from the chunk {frame_offset}..{end - 1} but not cached; "
                "re-encode them too (or start from an empty cache)"
            )
        return [self.slot(f) for f in earlier], write

    def commit(self, frame_offset: int, num_frames: int) -> None:
        """Record that every layer wrote frames ``[frame_offset, frame_offset + num_frames)``."""
        for frame in range(frame_offset, frame_offset + num_frames):
            self._slot_frames[self.slot(frame)] = frame

    def invalidate(self, frame_offset: int, num_frames: int) -> None:
        """Forget the slots of frames ``[frame_offset, frame_offset + num_frames)``: a forward that failed part
        way has overwritten them in some layers, so neither the old nor the new frames are there."""
        for frame in range(frame_offset, frame_offset + num_frames):
            self._slot_frames[self.slot(frame)] = -1

    def key_mask(self, slots: list[int], tokens_per_frame: int, device: torch.device) -> torch.Tensor | None:
        """The visible ``slots`` as a key mask over the whole buffer, ``[1, 1, 1, cache_frames * tokens]`` bool
        (``True``: attend), or ``None`` when every slot is visible (a full window: no mask needed)."""
        visible = sorted(set(slots))
        if len(visible) == self.config.cache_frames:
            return None
        mask = torch.zeros(self.config.cache_frames, dtype=torch.bool)
        mask[visible] = True
        return to_device(mask.repeat_interleave(tokens_per_frame).view(1, 1, 1, -1), device)

    # -------------------------------------------------------------------------------- buffer access
    def ensure_allocated(
        self,
        key: torch.Tensor,
        tokens_per_frame: int,
        frame_tokens: int | None = None,
        shard: str | None = None,
    ) -> None:
        """Allocate the buffers for keys shaped like ``key`` ([B, tokens, H, D]) on first use; check later calls.

        ``tokens_per_frame`` buffer positions hold a frame; a rank of a sequence-parallel split holds part of
        every frame (``shard`` says which) of ``frame_tokens`` tokens (default: ``tokens_per_frame``).
        """
        if self.keys is None:
            shape = (key.shape[0], self.config.cache_frames * tokens_per_frame, *key.shape[2:])
            self.keys = [key.new_zeros(shape) for _ in range(self.num_layers)]
            self.values = [key.new_zeros(shape) for _ in range(self.num_layers)]
            self.tokens_per_frame = tokens_per_frame
            self.frame_tokens = tokens_per_frame if frame_tokens is None else frame_tokens
            self.shard = shard
            return
        self.check_layout(key.shape[0], tokens_per_frame, *key.shape[2:], dtype=key.dtype, shard=shard)

    def check_layout(
        self,
        batch: int,
        tokens_per_frame: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype | None = None,
        shard: str | None = None,
    ) -> None:
        """Raise ``ValueError`` unless the allocated buffers hold keys of this layout (``dtype`` if given) and of
        this part of the frames (``shard``: ``None`` for a whole-frame cache)."""
        if shard != self.shard:
            raise ValueError(
                f"this StreamingKVCache holds {self.shard or 'whole frames (one process)'}, the transformer "
                f"now computes {shard or 'whole frames (one process)'}; use one cache per sequence-parallel "
                "split (or a new cache)"
            )
        expected = (self.keys[0].shape[0], self.tokens_per_frame, *self.keys[0].shape[2:])
        given = (batch, tokens_per_frame, heads, head_dim)
        if dtype is not None:
            expected, given = (*expected, self.keys[0].dtype), (*given, dtype)
        if given != expected:
            names = "batch, tokens per frame, heads, head_dim" + (", dtype" if dtype is not None else "")
            raise ValueError(
                f"this StreamingKVCache holds ({names}) = {expected}, got {given}; use one cache per sequence shape "
                "(or a new cache)"
            )
