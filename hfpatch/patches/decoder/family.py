"""Sequence parallelism for transformers decoders: text LLMs (Qwen3, Llama) and Qwen2/2.5/3-VL.

``hfpatch.apply(model, parallel=N)`` cuts the decoder's token sequence (after the vision merge, for a VLM)
into ``N = ring x ulysses`` shards, one per rank, from the first decoder layer to the final norm; every rank
returns the unpatched model's output (``sp_output="full"``, the default) or its own shard of the logits and
the exact loss over real tokens (``sp_output="shard"``). Per object and reversible:

* **Attention** goes through transformers' attention interface. The decoder's modules get a shallow copy
  of their config whose ``_attn_implementation`` is a name unique to this patch, registered in
  ``ALL_ATTENTION_FUNCTIONS`` (and ``ALL_MASK_ATTENTION_FUNCTIONS``) for the life of the patch: another
  model of the same class, even one built from the same config object, keeps its own attention; the
  names are deleted and the original config objects put back by ``patch.remove()``.
* **The mask** is transformers' own. The decoder still sees the whole sequence when it builds its mask
  (``create_causal_mask``: causal, padded keys from the 2D ``attention_mask``, packed samples detected
  from position ids that restart, as the unpatched model decides), so hfpatch's mask function receives
  transformers' composed ``mask_function`` and returns a :class:`ModelMask` that evaluates it on tiles of
  GLOBAL positions (:func:`transformers.masking_utils.sdpa_mask` with offsets): each rank reads exactly
  the entries of its own (query block, key block) pairs, and never the ``S x S`` mask.
* **The split** is four hooks: layer 0 takes this rank's shard of ``hidden_states`` (after the
  embedding and the vision merge), every layer takes its shard of the rotary ``position_embeddings``
  (M-RoPE's ``[3, B, S, D]`` too; cut once per forward), Qwen3-VL's DeepStack adds each rank's own visual
  tokens' features, and the decoder's output is gathered (or left sharded).
* **The vision tower** attends within each frame, so each rank encodes a contiguous run of about ``1/N``
  of a call's frames (:func:`frame_split`) and the merged features are all-gathered (``sp_vision="split"``,
  the default), or every rank encodes everything (``"replicate"``); both measured in
  ``benchmarks/decoder_sp.py``.

Gradients follow :mod:`hfpatch.distributed.gradients`: the gather (or the sharded loss's sum) scales the
gradient by ``N``, so each rank's parameter gradients are ``N`` times its shard's share and their mean over
the ``sp`` group, DDP's or FSDP2's or :func:`hfpatch.all_reduce_gradients`', is the unpatched gradient.

>>> from hfpatch.patches.decoder import decoder_of
>>> from hfpatch.testing import tiny_qwen3_vl
>>> path, decoder = decoder_of(tiny_qwen3_vl())
>>> path, type(decoder).__name__
('language_model', 'Qwen3VLTextModel')
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ...attention.layout import shard_len
from ...attention.masked import DEFAULT_TILE, CausalMask, classify_tile, masked_usp_attention
from ...core.config import ModelFacts, ParallelConfig
from ...core.patch import Patch
from ...core.registry import PatchFamily, class_key
from ...distributed.agreement import check_same_inputs, named_arguments
from ...distributed.collectives import all_gather
from ...distributed.gradients import average_input_gradients, grad_scaled_by_group

__all__ = [
    "DECODERS",
    "DecoderUSP",
    "ModelMask",
    "decoder_of",
    "frame_split",
    "sequence_sum",
    "shard_tokens",
    "vision_of",
]

#: Class key -> path of its decoder (the module with ``layers``, ``norm`` and ``rotary_emb``), ``""`` for itself.
DECODERS: dict[str, str] = {
    "transformers.Qwen3ForCausalLM": "model",
    "transformers.Qwen3Model": "",
    "transformers.LlamaForCausalLM": "model",
    "transformers.LlamaModel": "",
    "transformers.Qwen3VLForConditionalGeneration": "model.language_model",
    "transformers.Qwen3VLModel": "language_model",
    "transformers.Qwen2_5_VLForConditionalGeneration": "model.language_model",
    "transformers.Qwen2_5_VLModel": "language_model",
    "transformers.Qwen2VLForConditionalGeneration": "model.language_model",
    "transformers.Qwen2VLModel": "language_model",
}
#: Attention implementations whose semantics (softmax attention under ``create_causal_mask``'s mask) the
#: patched model reproduces; rows with no key (left padding) are zeros as with SDPA.
_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
_OUTPUTS = ("full", "shard")
_VISION_MODES = ("split", "replicate")


#: Class key -> path of its vision tower (Qwen-VL: it encodes images and videos frame by frame).
VISION: dict[str, str] = {
    "transformers.Qwen3VLForConditionalGeneration": "model.visual",
    "transformers.Qwen3VLModel": "visual",
    "transformers.Qwen2_5_VLForConditionalGeneration": "model.visual",
    "transformers.Qwen2_5_VLModel": "visual",
    "transformers.Qwen2VLForConditionalGeneration": "model.visual",
    "transformers.Qwen2VLModel": "visual",
}
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


def vision_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The Qwen-VL vision tower of ``model`` (:data:`VISION`), or ``None`` for a text-only decoder."""
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
    for cls in type(model).__mro__:
        path = DECODERS.get(class_key(cls))
        if path is not None:
            return path, (model.get_submodule(path) if path else model)
    raise TypeError(
        f"hfpatch has no sequence-parallel decoder plan for {type(model).__name__}; supported: "
        f"{', '.join(k.split('.', 1)[1] for k in DECODERS)}"
    )


def shard_tokens(x: torch.Tensor, dim: int, world: int, rank: int, fill: Any = 0) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim`` in the layout of :mod:`hfpatch.attention.layout` (end padding
    with ``fill``), as a new tensor: the full one stays freeable. Differentiable.

    >>> x = torch.arange(5)[None]
    >>> [shard_tokens(x, 1, 2, r, fill=-1).tolist() for r in range(2)]
    [[[0, 1, 2]], [[3, 4, -1]]]
    """
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


def _mask_interface(
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
    )


# ----------------------------------------------------------------------------------------------- state
class _Split:
    """One patched model's groups and settings, shared by its hooks and its attention function."""

    def __init__(self, mesh: Any, tile: int, output: str) -> None:
        import torch.distributed as dist

        self.group = mesh.group("sp")
        self.ulysses_group = mesh.group("ulysses")
        self.ring_group = mesh.group("ring")
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.tile = tile
        self.output = output
        self._rotary: tuple[Any, Any] | None = None  # (full position embeddings, this rank's shard)

    def shard(self, x: torch.Tensor, dim: int, fill: Any = 0) -> torch.Tensor:
        return shard_tokens(x, dim, self.world, self.rank, fill)

    def gather(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """The full ``[B, length, ...]`` tensor from every rank's ``[B, L, ...]`` shard (identical on every rank)."""
        full = all_gather(x.contiguous(), 1, self.group, backward="slice")
        return grad_scaled_by_group(full.narrow(1, 0, length), self.group)

    def rotary(self, value: Any) -> Any:
        """This rank's shard of ``(cos, sin)`` (cut along the sequence dim ``-2``), once per forward."""
        if self._rotary is not None and self._rotary[0] is value:
            return self._rotary[1]
        shards = type(value)(self.shard(t, -2) for t in value)
        self._rotary = (value, shards)
        return shards

    def end_call(self) -> None:
        self._rotary = None  # the full tables are freeable once the decoder returns

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError(
            "cannot deepcopy a model patched for sequence parallelism by hfpatch.apply: copy it before "
            "hfpatch.apply, or patch.remove() first"
        )


def _attention_function(split: _Split) -> Callable:
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
        if softcap or kwargs.get("s_aux") is not None:
            raise ValueError(
                f"{where}: attention logit soft-capping and sinks are not supported under sequence parallelism"
            )
        expected = shard_len(attention_mask.length, split.world)
        if query.shape[2] != expected:
            raise RuntimeError(
                f"{where}: sequence-parallel attention got {query.shape[2]} query tokens, expected this rank's "
                f"shard of {expected} (of {attention_mask.length}): call the patched model itself, not a submodule"
            )
        out = masked_usp_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            mask=attention_mask,
            ulysses_group=split.ulysses_group,
            ring_group=split.ring_group,
            valid_len=attention_mask.length,
            scale=scaling,
            tile=split.tile,
        )
        return out, None

    return sequence_parallel_attention


def _split_vision(split: _Split, merge: int) -> Callable:
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


def _sharded_loss(original: Callable, split: _Split) -> Callable:
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


# ----------------------------------------------------------------------------------------------- family
def _cache_length(value: Any) -> int:
    get = getattr(value, "get_seq_length", None)
    return int(get()) if callable(get) else 0


class DecoderUSP(PatchFamily):
    """Sequence parallelism (Ulysses x Ring under the model's mask) for the decoders of :data:`DECODERS`.

    Options:
        sp_output: ``"full"`` (every rank gets the unpatched outputs: hidden states, logits, loss) or
            ``"shard"`` (hidden states and logits stay this rank's shard of the sequence, in the layout of
            :mod:`hfpatch.attention.layout`; with ``labels`` the loss is the exact mean over every real
            token of every rank, identical on all ranks, without ever holding ``[B, S, vocab]`` logits).
        sp_vision: Qwen-VL vision tower: ``"split"`` (each rank encodes a contiguous run of about ``1/N`` of
            the frames, :func:`frame_split`, and the merged and DeepStack features are all-gathered; the
            tower's ``last_hidden_state`` and ``hidden_states`` in ``image_outputs``/``video_outputs`` are then
            ``None``, as they stay per rank) or ``"replicate"`` (every rank encodes everything, the stock
            outputs). A call with fewer frames than ranks runs replicated.
        sp_tile: Tile edge of the attention (tokens), see :func:`hfpatch.attention.masked.masked_usp_attention`.
        check_inputs: Same-input guard over the ``sp`` group on every call.
    """

    name: ClassVar[str] = "decoder_usp"
    role: ClassVar[str] = "model"
    split_axis: ClassVar[str | None] = "sp"
    options: ClassVar[dict[str, Any]] = {
        "sp_output": "full",
        "sp_vision": "split",
        "sp_tile": DEFAULT_TILE,
        "check_inputs": True,
    }

    def facts(self, target: Any) -> ModelFacts:
        _, decoder = decoder_of(target)
        return ModelFacts(num_heads=decoder.config.num_attention_heads, name=type(target).__name__)

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        name = type(target).__name__
        if options["sp_output"] not in _OUTPUTS:
            raise ValueError(f"sp_output must be one of {_OUTPUTS} for {name}, got {options['sp_output']!r}")
        if options["sp_vision"] not in _VISION_MODES:
            raise ValueError(
                f"sp_vision must be one of {_VISION_MODES} for {name}, got {options['sp_vision']!r}"
            )
        tile = options["sp_tile"]
        if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
            raise ValueError(f"sp_tile must be a positive int (tokens) for {name}, got {tile!r}")
        if config.pipefusion > 1:
            raise ValueError(
                f"pipefusion={config.pipefusion}: {name} has no PipeFusion support; use ulysses/ring"
            )
        if config.sequence_parallel == 1:
            return
        path, decoder = decoder_of(target)
        where = f"{name}.{path}" if path else name
        implementation = decoder.config._attn_implementation
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(
                f"{where} uses attn_implementation={implementation!r}; sequence parallelism replaces one of "
                f"{', '.join(_IMPLEMENTATIONS)}. Load the model with attn_implementation='sdpa'."
            )
        layer_types = getattr(decoder.config, "layer_types", None) or ()
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"{where} has layer types {sorted(set(layer_types))}; sequence parallelism supports "
                "full-attention layers only (sliding windows are not supported)"
            )
        for i, layer in enumerate(decoder.layers):
            attention = getattr(layer, "self_attn", None)
            if getattr(attention, "config", None) is not decoder.config:
                raise ValueError(
                    f"{where}.layers.{i}.self_attn does not dispatch through the decoder's config "
                    "(a replaced attention module?); sequence parallelism cannot route it"
                )
        if options["sp_output"] == "shard" and hasattr(target, "lm_head"):
            from transformers.loss.loss_utils import ForCausalLMLoss

            if target.loss_function is not ForCausalLMLoss:
                raise ValueError(
                    f"sp_output='shard' shards transformers' causal-LM loss (ForCausalLMLoss); {name}.loss_function "
                    f"is {getattr(target.loss_function, '__name__', target.loss_function)!r}"
                )

    def apply(self, target: Any, patch: Patch, mesh: Any, options: dict[str, Any]) -> None:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        if mesh.config.sequence_parallel == 1:
            return
        _, decoder = decoder_of(target)
        split = _Split(mesh, options["sp_tile"], options["sp_output"])

        # 1. A name of its own in transformers' interfaces, and a config copy that selects it.
        implementation = f"hfpatch_sp_{id(split):x}"
        AttentionInterface.register(implementation, _attention_function(split))
        AttentionMaskInterface.register(implementation, _mask_interface)

        def unregister() -> None:
            AttentionInterface._global_mapping.pop(implementation, None)
            AttentionMaskInterface._global_mapping.pop(implementation, None)

        patch.on_remove(split, f"attention implementation {implementation}", unregister)
        original = decoder.config
        config = copy.copy(original)
        config._attn_implementation_internal = implementation
        routed = [m for m in decoder.modules() if m.__dict__.get("config") is original]
        for module in routed:
            patch.set_attr(module, "config", config)

        # 2. The split: layer 0 cuts the hidden states, every layer its rotary tables.
        layers = list(decoder.layers)
        position = (
            list(inspect.signature(type(layers[0]).forward).parameters).index("position_embeddings") - 1
        )

        def split_layer_input(layer, args, kwargs):
            args = list(args)
            if layer is layers[0]:
                if args:
                    args[0] = split.shard(args[0], 1)
                else:
                    kwargs["hidden_states"] = split.shard(kwargs["hidden_states"], 1)
            if kwargs.get("position_embeddings") is not None:
                kwargs["position_embeddings"] = split.rotary(kwargs["position_embeddings"])
            elif len(args) > position and args[position] is not None:
                args[position] = split.rotary(args[position])
            return tuple(args), kwargs

        for layer in layers:
            patch.add_forward_pre_hook(layer, split_layer_input)

        if hasattr(decoder, "_deepstack_process"):  # Qwen3-VL: visual features added after early layers

            def local_deepstack(original_process):
                def deepstack_process(hidden_states, visual_pos_masks, visual_embeds):
                    order = visual_pos_masks.reshape(-1).cumsum(0).view_as(visual_pos_masks) - 1
                    local_mask = split.shard(visual_pos_masks, -1, fill=False)
                    rows = split.shard(order, -1)[local_mask].to(visual_embeds.device)
                    return original_process(hidden_states, local_mask, visual_embeds.index_select(0, rows))

                return deepstack_process

            patch.wrap_method(decoder, "_deepstack_process", local_deepstack)

        # 3. The decoder's outputs: gathered, or this rank's shard.
        def decoder_output(_module, args, kwargs, output):
            split.end_call()
            if split.output == "shard":
                return output
            if not hasattr(output, "last_hidden_state"):
                raise TypeError(
                    f"{type(decoder).__name__} returned {type(output).__name__}; sequence parallelism needs its "
                    "ModelOutput (do not pass return_dict=False to the decoder)"
                )
            embeds = kwargs.get("inputs_embeds")
            ids = kwargs.get("input_ids")
            length = (embeds if embeds is not None else ids).shape[1]
            local = output.last_hidden_state
            output.last_hidden_state = split.gather(local, length)
            states = getattr(output, "hidden_states", None)
            if states:
                output.hidden_states = tuple(
                    output.last_hidden_state if s is local else split.gather(s, length) for s in states
                )
            return output

        patch.add_forward_hook(decoder, decoder_output)

        vision = vision_of(target)
        if vision is not None and options["sp_vision"] == "split":
            patch.wrap_method(vision, "forward", _split_vision(split, vision.spatial_merge_size))

        # 4. sp_output="shard" with labels: the loss over every real token, from sharded logits.
        if split.output == "shard" and hasattr(target, "lm_head"):
            patch.set_attr(target, "_loss_function", _sharded_loss(target.loss_function, split))

        # 5. Every call: checks (the same on every rank, before any collective), same inputs, input grads.
        forward = type(target).forward
        what = f"{type(target).__name__}.forward"

        def begin_call(_module, args, kwargs):
            named = named_arguments(forward, (target, *args), kwargs)
            named.pop("self", None)
            extra = named.pop("kwargs", None)
            if isinstance(extra, dict):
                named.update(extra)
            if any(m.__dict__.get("config") is not config for m in routed) or (
                config._attn_implementation != implementation
            ):
                raise RuntimeError(
                    f"{what}: the attention implementation of the sequence-parallel decoder was changed after "
                    "hfpatch.apply (set_attn_implementation?); its layers would attend within this rank's shard "
                    "only. Change it before hfpatch.apply, or patch.remove() and apply again."
                )
            if named.get("output_attentions"):
                raise ValueError(
                    f"{what}: output_attentions=True is not available under sequence parallelism"
                )
            for key in ("cache", "past_key_values"):
                if _cache_length(named.get(key)) > 0:
                    raise ValueError(
                        f"{what}: a KV cache holding {_cache_length(named[key])} tokens was passed; sequence "
                        "parallelism runs whole sequences (training, scoring, prefill). Generate under "
                        "`with patch.disabled():` or after patch.remove()."
                    )
            if split.output == "shard" and named.get("logits_to_keep", 0) not in (0, None):
                raise ValueError(f"{what}: logits_to_keep must be 0 with sp_output='shard'")
            check_same_inputs(named, split.group, what=what, enabled=bool(options["check_inputs"]))
            return average_input_gradients((args, kwargs), split.group)

        patch.add_forward_pre_hook(target, begin_call)
