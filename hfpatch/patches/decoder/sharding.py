"""How a transformers decoder's sequence is sharded: which module is the decoder (:data:`DECODERS`,
:data:`VISION`), the shard helpers, the model's mask evaluated on tiles of global positions (:class:`ModelMask`),
the attention function registered for the patch, the vision tower's split by frames and the sharded loss. The
design notes and the family are :mod:`hfpatch.patches.decoder.family`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...attention.layout import shard_len
from ...attention.masked import CausalMask, classify_tile, masked_usp_attention
from ...attention.zigzag import ZigzagLayout, ZigzagMask
from ...core.registry import class_key
from ...distributed.collectives import all_gather
from ...distributed.gradients import grad_scaled_by_group
from .table import DECODERS, TARGETS, VISION, Target

__all__ = [
    "DECODERS",
    "ORDERS",
    "VISION",
    "ModelMask",
    "decoder_of",
    "frame_split",
    "output_shard",
    "sequence_order",
    "sequence_sum",
    "shard_tokens",
    "target_of",
    "vision_of",
]

#: Token orders of the split: ``"contiguous"`` (rank ``p`` holds the ``p``-th run of tokens, the layout of
#: :mod:`hfpatch.attention.layout`), ``"zigzag"`` (one early and one late chunk, :mod:`hfpatch.attention.zigzag`:
#: causal Ring work balanced), ``"auto"`` (zigzag when the plan has a Ring degree, else contiguous).
ORDERS = ("auto", "zigzag", "contiguous")

#: Vision-tower kwargs that carry tensors precomputed for a whole ``grid_thw`` (they cannot follow a split).
_PRECOMPUTED = (
    "cu_seqlens",
    "max_seqlen",
    "position_ids",
    "interp_indices",
    "interp_weights",
    "window_index",
    "cu_window_seqlens",
    "max_window_seqlen",
)


def target_of(model: torch.nn.Module) -> tuple[type, Target]:
    """``(class, row)``: the first class along ``model``'s MRO with a row of :data:`TARGETS`, and that row.

    Raises:
        TypeError: ``model`` is no supported class.
    """
    for cls in type(model).__mro__:
        row = TARGETS.get(class_key(cls))
        if row is not None:
            return cls, row
    raise TypeError(
        f"hfpatch has no sequence-parallel decoder plan for {type(model).__name__}; supported: "
        f"{', '.join(k.split('.', 1)[1] for k in DECODERS)}"
    )


def vision_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The Qwen-style vision tower of ``model`` that attends within each frame (:data:`VISION`), or ``None`` for a
    text-only decoder or a tower that runs whole on every rank."""
    for cls in type(model).__mro__:
        path = VISION.get(class_key(cls))
        if path is not None:
            return model.get_submodule(path)
    return None


def frame_split(grid_thw: list[list[int]], world: int) -> list[list[tuple[int, int, int]]] | None:
    """Split the frames of a Qwen-VL vision call into ``world`` contiguous runs of about equal patch counts.

    Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers attend within each frame (temporal patch): cumulative lengths,
    rotary positions, learned position embeddings and Qwen2.5-VL's windows are all per frame, so an item of
    grid ``(t, h, w)`` is ``t`` independent items of grid ``(1, h, w)`` and may be cut between frames. Returns,
    per rank, ``(item, first frame, frames)`` pieces in order (the ranks' outputs concatenated in rank order
    are the whole call's), or ``None`` when there are fewer frames than ranks (the call then runs replicated).

    >>> frame_split([[1, 4, 4], [4, 2, 2], [1, 2, 4]], 2)   # 16 + 4 x 4 + 8 patches: 20 per rank
    [[(0, 0, 1), (1, 0, 1)], [(1, 1, 3), (2, 0, 1)]]
    >>> frame_split([[1, 4, 4]], 2) is None
    True
    """
    frames = [(item, f, h * w) for item, (t, h, w) in enumerate(grid_thw) for f in range(t)]
    if len(frames) < world:
        return None
    total = sum(n for _, _, n in frames)
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    done, rank = 0, 0
    for index, (item, frame, n) in enumerate(frames):
        # Move on once this rank has its share, keeping at least one frame for every later rank.
        while (
            rank < world - 1
            and (done >= total * (rank + 1) / world or len(frames) - index <= world - 1 - rank)
            and pieces[rank]
        ):
            rank += 1
        run = pieces[rank]
        if run and run[-1][0] == item and run[-1][1] + run[-1][2] == frame:
            run[-1] = (item, run[-1][1], run[-1][2] + 1)
        else:
            run.append((item, frame, 1))
        done += n
    return pieces


def decoder_of(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """``(path, decoder)`` of a supported model (:data:`DECODERS`, matched along the MRO).

    Raises:
        TypeError: ``model`` is no supported class.
    """
    path = target_of(model)[1].decoder
    return path, (model.get_submodule(path) if path else model)


def sequence_order(order: str, ring: int) -> str:
    """The token order a split uses: ``order`` (one of :data:`ORDERS`) with ``"auto"`` resolved for a Ring
    degree of ``ring`` (zigzag when it is above 1: causal Ring work is balanced only so).

    >>> sequence_order("auto", 2), sequence_order("auto", 1), sequence_order("contiguous", 4)
    ('zigzag', 'contiguous', 'contiguous')
    """
    if order not in ORDERS:
        raise ValueError(f"sp_order must be one of {ORDERS}, got {order!r}")
    if order == "auto":
        return "zigzag" if ring > 1 else "contiguous"
    return order


def shard_tokens(
    x: torch.Tensor, dim: int, world: int, rank: int, fill: Any = 0, order: str = "contiguous"
) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim`` (end padding with ``fill``), as a new tensor: the full one
    stays freeable. Differentiable. ``order="contiguous"``: the layout of :mod:`hfpatch.attention.layout`;
    ``"zigzag"``: chunks ``rank`` and ``2 world - 1 - rank`` (:class:`hfpatch.attention.zigzag.ZigzagLayout`).

    >>> x = torch.arange(5)[None]
    >>> [shard_tokens(x, 1, 2, r, fill=-1).tolist() for r in range(2)]
    [[[0, 1, 2]], [[3, 4, -1]]]
    >>> [shard_tokens(x, 1, 2, r, fill=-1, order="zigzag").tolist() for r in range(2)]
    [[[0, 1, -1, -1]], [[2, 3, 4, -1]]]
    """
    if order == "zigzag":
        return ZigzagLayout(x.shape[dim], world).shard(x, dim, rank, fill)
    if order != "contiguous":
        raise ValueError(f"shard_tokens: order must be 'contiguous' or 'zigzag', got {order!r}")
    dim %= x.dim()
    length = x.shape[dim]
    local = shard_len(length, world)
    start = rank * local
    n = max(0, min(local, length - start))
    piece = x.narrow(dim, min(start, length), n)
    if n == local:
        return piece.clone()
    shape = list(x.shape)
    shape[dim] = local - n
    return torch.cat([piece, x.new_full(shape, fill)], dim=dim)


def output_shard(patch: Any, x: torch.Tensor, dim: int = 1, fill: Any = 0) -> torch.Tensor:
    """This rank's shard of a whole-sequence tensor ``x`` (labels, a loss mask) in the order of the patched
    decoder's ``sp_output="shard"`` outputs, for a loss of your own (see :func:`sequence_sum`). ``x`` itself
    when ``patch`` splits nothing.

    >>> output_shard(None, torch.arange(3)[None]).tolist()
    [[0, 1, 2]]
    """
    group = getattr(patch, "reduce_group", None)
    if group is None:
        return x
    import torch.distributed as dist

    order = sequence_order(patch.options.get("sp_order", "auto"), patch.plan.ring)
    return shard_tokens(x, dim, dist.get_world_size(group), dist.get_rank(group), fill, order)


def sequence_sum(part: torch.Tensor, patch: Any) -> torch.Tensor:
    """The sum over the ``sp`` group of each rank's ``part`` (a scalar), for a loss of your own on the sharded
    outputs of ``sp_output="shard"``: identical on every rank, with hfpatch's gradient convention.

    Compute ``part`` from this rank's shard only, normalised by a GLOBAL count (e.g. the real tokens of the whole
    sequence: ``part = (nll * mask).sum() / total_real``), then ``loss = sequence_sum(part, patch)``; its
    gradient is scaled by the group size like every hfpatch output, so DDP's (or ``all_reduce_gradients``')
    mean is the unpatched gradient. One rank (no patch, or a degree-1 plan): ``part`` itself.

    >>> import torch
    >>> sequence_sum(torch.tensor(2.5), None)
    tensor(2.5000)
    """
    group = getattr(patch, "reduce_group", None)
    if group is None:
        return part
    parts = all_gather(part.reshape(1), 0, group, backward="slice")
    return grad_scaled_by_group(parts, group).sum()


# ----------------------------------------------------------------------------------------------- mask
@dataclass(frozen=True)
class ModelMask:
    """The mask ``create_causal_mask`` composed for one forward, read on tiles of global positions.

    Built by the patch's mask function from exactly the arguments transformers passes to ``sdpa_mask``
    (``mask_function`` with causality, packing and any overlay; the 2D ``attention_mask`` for padding), so
    a tile equals that block of the unpatched model's mask. ``causal`` marks the plain causal mask with no
    padding (SDPA's ``is_causal`` case): its tiles are classified without evaluating anything.

    Attributes:
        length: Tokens in the (unsharded) sequence.
    """

    batch_size: int
    length: int
    mask_function: Callable | None
    attention_mask: torch.Tensor | None
    use_vmap: bool
    device: torch.device
    causal: bool
    local_size: int | None = None

    def tile(self, q_start: int, q_len: int, k_start: int, k_len: int) -> bool | torch.Tensor:
        """``True``/``False``/bool ``[B, 1, q_len, k_len]``: see :class:`hfpatch.attention.masked.TileMask`."""
        if self.causal:
            return CausalMask(self.device).tile(q_start, q_len, k_start, k_len)
        from transformers.masking_utils import sdpa_mask

        mask = sdpa_mask(
            batch_size=self.batch_size,
            q_length=q_len,
            kv_length=k_len,
            q_offset=q_start,
            kv_offset=k_start,
            mask_function=self.mask_function,
            attention_mask=self.attention_mask,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
            use_vmap=self.use_vmap,
            device=self.device,
        )
        return classify_tile(mask)


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    device: Any = "cpu",
    **kwargs: Any,
) -> ModelMask:
    """What ``create_causal_mask`` calls (``ALL_MASK_ATTENTION_FUNCTIONS``) under the patch's implementation name."""
    from transformers.masking_utils import causal_mask_function

    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor) or q_offset or kv_offset:
        raise ValueError(
            "sequence parallelism runs whole sequences only: this call continues a KV cache (offset "
            f"{q_offset}). Generate under `with patch.disabled():` or after patch.remove()."
        )
    if kv_length != q_length:
        raise ValueError(
            f"sequence parallelism needs as many keys as queries, got {q_length} queries and {kv_length} keys "
            "(a static cache or prefix tuning?)"
        )
    plain = mask_function is None or mask_function is causal_mask_function
    causal = plain and local_size is None and (attention_mask is None or bool(attention_mask.all()))
    return ModelMask(
        batch_size=batch_size,
        length=q_length,
        mask_function=causal_mask_function if mask_function is None else mask_function,
        attention_mask=attention_mask,
        use_vmap=use_vmap,
        device=torch.device(device),
        causal=causal,
        local_size=local_size,
    )


def window_kept(mask: ModelMask, window: int) -> bool:
    """Whether ``mask`` rules out, for every query ``q >= window`` of every row, the key ``q - window``: the
    first key a sliding window of ``window`` tokens (transformers' ``kv > q - window``) leaves out.

    A mask built for the window (``local_size == window``) does by construction. Any other is probed on those
    pairs with its own ``mask_function`` (padding aside: a padded key is masked for every layer type): a causal
    mask fails wherever a sample is longer than the window, a window overlay (``local_size`` ``None``, Gemma's
    VLMs) passes. Packed samples no longer than the window pass too, and rightly: there the two masks are equal.

    >>> from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    >>> def mask(fn):
    ...     return ModelMask(1, 9, fn, None, False, torch.device("cpu"), False)
    >>> window_kept(mask(sliding_window_causal_mask_function(4)), 4), window_kept(mask(causal_mask_function), 4)
    (True, False)
    >>> window_kept(mask(causal_mask_function), 9)  # no key 9 tokens back in 9 tokens: the masks are equal
    True
    """
    if mask.local_size == window:
        return True
    if mask.length <= window:
        return True
    if mask.local_size is not None or mask.causal:
        return False  # another window, or the plain causal mask
    queries = torch.arange(window, mask.length, device=mask.device)
    rows = torch.arange(mask.batch_size, device=mask.device)[:, None].expand(-1, len(queries))
    function = mask.mask_function
    if mask.use_vmap:  # overlays that index tensors by position run under vmap, as sdpa_mask runs them
        function = torch.vmap(torch.vmap(function, in_dims=(None, None, 0, 0)), in_dims=(0, None, 0, 0))
        allowed = function(
            rows[:, 0], torch.tensor(0), queries.expand_as(rows), (queries - window).expand_as(rows)
        )
    else:
        allowed = function(
            rows, torch.zeros_like(rows), queries.expand_as(rows), (queries - window).expand_as(rows)
        )
    return not bool(torch.as_tensor(allowed).any())


# ----------------------------------------------------------------------------------------------- state
class DecoderSplit:
    """One patched model's groups and settings, shared by its hooks and its attention function."""

    def __init__(self, mesh: Any, tile: int, output: str, order: str) -> None:
        import torch.distributed as dist

        self.group = mesh.group("sp")
        self.ulysses_group = mesh.group("ulysses")
        self.ring_group = mesh.group("ring")
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.tile = tile
        self.output = output
        self.order = sequence_order(order, mesh.config.ring)
        # id(full tensor or tuple) -> (it, this rank's shard): cut once per forward, however many layers read it
        # (Gemma 3/4 alternate two rotary tables; Ministral 3's layers all read the same position ids).
        self._shards: dict[int, tuple[Any, Any]] = {}
        self._windows: dict[tuple[int, int], bool] = {}  # (id(mask), window) -> the mask keeps to the window

    def shard(self, x: torch.Tensor, dim: int, fill: Any = 0) -> torch.Tensor:
        return shard_tokens(x, dim, self.world, self.rank, fill, self.order)

    def shard_len(self, length: int) -> int:
        """Tokens per rank for a ``length``-token sequence (padding included)."""
        return (
            ZigzagLayout(length, self.world).shard_len
            if self.order == "zigzag"
            else shard_len(length, self.world)
        )

    def gather(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """The full ``[B, length, ...]`` tensor from every rank's ``[B, L, ...]`` shard (identical on every rank)."""
        full = all_gather(x.contiguous(), 1, self.group, backward="slice")
        if self.order == "zigzag":
            full = ZigzagLayout(length, self.world).unshard(full, 1)
        return grad_scaled_by_group(full.narrow(1, 0, length), self.group)

    def layout_mask(self, mask: ModelMask) -> tuple[Any, int]:
        """``(tile mask, valid_len)`` in layout coordinates for :func:`masked_usp_attention`."""
        if self.order != "zigzag":
            return mask, mask.length
        layout = ZigzagLayout(mask.length, self.world)
        return ZigzagMask(mask, layout), layout.padded_len

    def once(self, value: Any, cut: Callable[[Any], Any]) -> Any:
        """``cut(value)``, computed once per forward for the same ``value`` object."""
        found = self._shards.get(id(value))
        if found is None or found[0] is not value:
            found = self._shards[id(value)] = (value, cut(value))
        return found[1]

    def rotary(self, value: Any) -> Any:
        """This rank's shard of ``(cos, sin)`` (cut along the sequence dim ``-2``), once per forward."""
        return self.once(value, lambda tables: type(tables)(self.shard(t, -2) for t in tables))

    def sequence_input(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a per-token tensor whose last dim is the sequence (position ids), once per forward."""
        return self.once(value, lambda t: self.shard(t, -1))

    def keeps_window(self, mask: ModelMask, window: int) -> bool:
        """Whether ``mask`` rules out every key ``window`` or more tokens before its query (checked once per
        forward): what a sliding-window layer's mask must do, from ``create_sliding_window_causal_mask``
        (``local_size``) or composed with a window overlay (Gemma's VLM masks, ``local_size`` ``None``)."""
        key = (id(mask), window)
        if key not in self._windows:
            self._windows[key] = window_kept(mask, window)
        return self._windows[key]

    def end_call(self) -> None:
        self._shards.clear()  # the full tables are freeable once the decoder returns
        self._windows.clear()

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError(
            "cannot deepcopy a model patched for sequence parallelism by hfpatch.apply: copy it before "
            "hfpatch.apply, or patch.remove() first"
        )


def attention_function(split: DecoderSplit) -> Callable:
    """The patch's entry in ``ALL_ATTENTION_FUNCTIONS``: transformers' signature, sequence-parallel inside."""

    def sequence_parallel_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        where = type(module).__name__
        if not isinstance(attention_mask, ModelMask):
            raise RuntimeError(
                f"{where}: sequence-parallel attention got attention_mask of type {type(attention_mask).__name__}, "
                "not the mask hfpatch builds from the whole sequence: pass a 2D attention_mask (or none), not a "
                "prepared 4D mask, and call the patched model itself."
            )
        if dropout and module.training:
            raise ValueError(
                f"{where}: attention dropout ({dropout}) is not supported under sequence parallelism; set "
                "config.attention_dropout = 0 or call model.eval()"
            )
        window = kwargs.get("sliding_window")
        if window is not None and not split.keeps_window(attention_mask, window):
            raise RuntimeError(
                f"{where}: a sliding-window layer ({window} tokens) got a mask that lets a query see keys "
                f"{window} tokens back (the mask of another layer type, window {attention_mask.local_size}); "
                "sequence parallelism reads the window from the mask transformers builds for that layer type"
            )
        if softcap or kwargs.get("s_aux") is not None:
            raise ValueError(
                f"{where}: attention logit soft-capping and sinks are not supported under sequence parallelism"
            )
        expected = split.shard_len(attention_mask.length)
        if query.shape[2] != expected:
            raise RuntimeError(
                f"{where}: sequence-parallel attention got {query.shape[2]} query tokens, expected this rank's "
                f"shard of {expected} (of {attention_mask.length}): call the patched model itself, not a submodule"
            )
        mask, valid_len = split.layout_mask(attention_mask)
        out = masked_usp_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            mask=mask,
            ulysses_group=split.ulysses_group,
            ring_group=split.ring_group,
            valid_len=valid_len,
            scale=scaling,
            tile=split.tile,
        )
        return out, None

    return sequence_parallel_attention


def split_vision(split: DecoderSplit, merge: int) -> Callable:
    """A vision tower ``forward`` that encodes this rank's run of frames (:func:`frame_split`) and all-gathers
    the merged features (and DeepStack's), whose backward sums the ranks' gradients back to each frame's owner."""

    def wrap(original: Callable) -> Callable:
        def split_vision_forward(hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any):
            given = sorted(k for k in _PRECOMPUTED if kwargs.get(k) is not None)
            if given:
                raise ValueError(
                    f"sp_vision='split' cuts the vision call by frames, but it was given {given} precomputed for "
                    "the whole call; drop them, or apply with sp_vision='replicate'"
                )
            grids = grid_thw.tolist()
            pieces = frame_split(grids, split.world)
            if pieces is None:  # fewer frames than ranks: every rank encodes everything (same on every rank)
                return original(hidden_states, grid_thw=grid_thw, **kwargs)
            starts = [0]
            for t, h, w in grids:
                starts.append(starts[-1] + t * h * w)
            rows, grid = [], []
            for item, frame, frames in pieces[split.rank]:
                t, h, w = grids[item]
                first = starts[item] + frame * h * w
                rows.append(hidden_states[first : first + frames * h * w])
                grid.append([frames, h, w])
            out = original(torch.cat(rows), grid_thw=grid_thw.new_tensor(grid), **kwargs)
            merged = [sum(n * grids[i][1] * grids[i][2] for i, _, n in run) // merge**2 for run in pieces]

            def gather(x: torch.Tensor) -> torch.Tensor:
                return all_gather(x, 0, split.group, merged, backward="reduce_scatter")

            out.pooler_output = gather(out.pooler_output)
            if getattr(out, "deepstack_features", None) is not None:
                out.deepstack_features = [gather(x) for x in out.deepstack_features]
            out.last_hidden_state = None  # per-patch states stay with their rank (see the family docstring)
            if getattr(out, "hidden_states", None) is not None:
                out.hidden_states = None
            return out

        return split_vision_forward

    return wrap


def sharded_loss(original: Callable, split: DecoderSplit) -> Callable:
    """``model.loss_function`` for ``sp_output="shard"``: each rank scores its shard of the shifted labels,
    normalised by the GLOBAL count of real labels, and the ranks' sums are added (no mean of means)."""

    def sharded_causal_lm_loss(
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:  # what ForCausalLMLoss does, on the whole sequence
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        local = split.shard(shift_labels, -1, fill=ignore_index)
        if logits.shape[1] != local.shape[-1]:
            raise RuntimeError(
                f"sp_output='shard': the logits hold {logits.shape[1]} tokens but this rank's shard of the "
                f"{shift_labels.shape[-1]} labels has {local.shape[-1]}; logits_to_keep must stay 0"
            )
        if num_items_in_batch is None:
            num_items_in_batch = (shift_labels != ignore_index).sum()
        part = original(
            logits=logits,
            labels=local,
            vocab_size=vocab_size,
            num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index,
            shift_labels=local,
            **kwargs,
        )
        parts = all_gather(part.reshape(1), 0, split.group, backward="slice")
        return grad_scaled_by_group(parts, split.group).sum()

    return sharded_causal_lm_loss
