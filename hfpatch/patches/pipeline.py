"""CFG parallel and data parallel for diffusers pipelines, by patching the transformer calls of a pipeline.

Both parallelisms act on the batch of each transformer call and nothing else: every rank builds the same
full latents from the same generator, runs the scheduler and the VAE on the full batch, and only the
transformer work is divided. So the noise of every sample is the noise of the unpatched run (latents are
generated in full, then sliced), and every rank returns the full output.

- **CFG parallel** (``cfg=2``, mesh axis ``"cfg"``): cfg rank 0 computes the conditional prediction,
  cfg rank 1 the unconditional one, and one all-gather per step gives both ranks both predictions.
  Two call patterns are recognised:

  * *two calls per step* (``WanPipeline``): the cond call runs inside ``transformer.cache_context("cond")``,
    the uncond call inside ``cache_context("uncond")``. On cfg rank 1 the cond call returns a placeholder
    that is filled in place when the uncond call has run; on cfg rank 0 the uncond call computes nothing
    and receives. Any other order of calls raises ``RuntimeError`` instead of returning a wrong result.
    A transformer whose weights FSDP2 shards over ranks of both cfg branches (``shard_weights=True``, or the
    user's ``fully_shard``) all-gathers each block in every forward, so the branches must compute in the same
    call: there cfg rank 0 also returns a placeholder from the cond call and computes the cond prediction at
    the uncond call, in step with cfg rank 1 (still bit-exact: the same calls on the same arguments).
  * *batched* (``StableDiffusion3Pipeline``: ``torch.cat([uncond, cond])``, batch ``2B``): the batch is
    split over the cfg ranks inside the transformer call and the outputs are all-gathered.

- **Data parallel** (``data>1``, mesh axis ``"data"``): each transformer call's batch (prompts x
  ``num_images_per_prompt``, and both CFG halves where they are batched) is split over the data ranks,
  unevenly where it does not divide, and the outputs are all-gathered.

Any diffusers pipeline works, whatever its denoiser class. The denoisers are the components whose class is
in :data:`PER_SAMPLE_ARGS`, plus the diffusers models named ``transformer``, ``transformer_2`` or ``unet``
(:data:`DENOISER_NAMES`). How each forward argument is split:

- *Known classes* (:data:`PER_SAMPLE_ARGS`): an explicit list of batched arguments and of arguments passed
  whole (Flux's ``txt_ids``/``img_ids`` are ``[seq, 3]`` positions, not per sample); anything else is refused.
- *Any other class*, decided per call (:func:`generic_split`): the batch is the leading dim of the first
  forward argument (``hidden_states``, ``sample``). A tensor with that leading dim is split; ``None``, plain
  Python values, 0-d tensors and tensors of leading dim 1 pass whole; a flat dict of tensors (SDXL's
  ``added_cond_kwargs``) follows the same rule per entry; a tensor of another leading dim, or a list/tuple or
  nested structure holding tensors (``joint_attention_kwargs`` with IP-adapter embeds), raises ``TypeError``
  naming the argument, on every rank alike and before the split's collectives. **Limit:** a tensor without
  a batch dim whose leading dim happens to equal the batch (batch 3 and a ``[3, k]`` table) cannot be told
  apart from a batched one and is split: register such classes in :data:`PER_SAMPLE_ARGS`. Per-sample Python
  lists (QwenImage's ``img_shapes``) pass whole.

CFG parallel for a pipeline in neither CFG table (decided from its calls, any ``cfg=2`` request accepted):

- Calls with no ``cache_context`` or in ``cache_context("cond_uncond")`` hold the whole batch (diffusers'
  batched CFG, ``[uncond, cond]``): their batch is split over the cfg ranks, which is exact whatever it holds.
- Calls in ``cache_context("cond")``/``("uncond")`` (true CFG: Flux, QwenImage, HunyuanVideo, ...): the first
  step of every pipeline call runs each call on every cfg rank (exact) while hfpatch watches it. If it made one
  cond call, then one uncond call of the same transformer, and did not compute with the cond prediction in
  between, the later steps run cond on cfg rank 0 and uncond on cfg rank 1 (one all-gather per step,
  bit-exact); otherwise the call stays unsplit over cfg (exact, no CFG speed-up) and the reason is logged
  (``logging.INFO``: a Flux call without a negative prompt makes one call per step). The cond prediction
  returned in the parallel steps refuses any computation before its uncond call, on both cfg ranks alike, so a
  pipeline whose pattern changes after the first step raises instead of using a missing value. The planner
  proposes ``cfg=2`` (``parallel=N``) only for the tables and for batched-CFG pipelines (their ``__call__``
  builds ``torch.cat([latents] * 2)``): true CFG is opt-in per call, and without it the second cfg rank idles.

Sequence parallelism of the transformer (its own family, mesh axes ``"ring"``/``"ulysses"``) runs inside
these calls unchanged: the data and cfg groups are orthogonal to the sequence-parallel group. The wrapper
replaces the transformer's ``forward`` (per object), so module hooks on submodules run only where the
transformer really computes; a forward hook on the transformer itself would see the cfg-rank-1 placeholder
of the two-call pattern before it is filled.

>>> import hfpatch, torch
>>> from hfpatch.testing import tiny_wan_pipe
>>> from hfpatch.patches.pipeline import PipelineParallel
>>> PipelineParallel().facts(tiny_wan_pipe()).guides   # WanPipeline guides: parallel=N plans cfg=2
True
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_leaves

from ..core.config import ModelFacts, ParallelConfig
from ..core.registry import PatchFamily
from ..distributed import runtime
from ..distributed.agreement import install_call_guard
from ..distributed.collectives import all_gather, even_sizes

logger = logging.getLogger(__name__)

__all__ = [
    "BATCHED_CFG_PIPELINES",
    "DENOISER_NAMES",
    "PER_SAMPLE_ARGS",
    "PipelineParallel",
    "TWO_CALL_CFG_PIPELINES",
    "generic_split",
]

#: Pipelines that call the transformer twice per step, in ``cache_context("cond")`` then ``("uncond")``,
#: and expose ``do_classifier_free_guidance`` (read at the cond call to know that an uncond call follows).
TWO_CALL_CFG_PIPELINES: tuple[str, ...] = ("WanPipeline",)
#: Pipelines that batch ``[uncond, cond]`` into one transformer call.
BATCHED_CFG_PIPELINES: tuple[str, ...] = ("StableDiffusion3Pipeline",)

#: Transformer class -> (forward arguments with a batch dim (split), arguments that carry no batch dim
#: (passed unchanged)). Any other argument given a non-``None`` value is refused: hfpatch cannot tell how
#: to split it, and guessing could give a wrong result.
PER_SAMPLE_ARGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "WanTransformer3DModel": (
        ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
        ("return_dict", "attention_kwargs"),
    ),
    "SD3Transformer2DModel": (
        ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
        ("return_dict", "joint_attention_kwargs", "skip_layers"),
    ),
    # txt_ids/img_ids are [seq, 3] positions shared by the batch (a 3-D batched form is deprecated in
    # diffusers, which reads its first row); guidance is expanded to the batch by FluxPipeline.
    "FluxTransformer2DModel": (
        ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"),
        ("return_dict", "joint_attention_kwargs", "txt_ids", "img_ids", "controlnet_blocks_repeat"),
    ),
    # image_rotary_emb is the (cos, sin) table of the image tokens, shared by the batch.
    "HunyuanDiT2DModel": (
        (
            "hidden_states",
            "timestep",
            "encoder_hidden_states",
            "text_embedding_mask",
            "encoder_hidden_states_t5",
            "text_embedding_mask_t5",
            "image_meta_size",
            "style",
        ),
        ("return_dict", "image_rotary_emb"),
    ),
}

#: Pipeline component names of denoisers whose class is not in :data:`PER_SAMPLE_ARGS` (split by
#: :func:`generic_split`). Only diffusers models (``ModelMixin``) under these names are wrapped.
DENOISER_NAMES: tuple[str, ...] = ("transformer", "transformer_2", "unet")

#: ``cache_context`` names under which a pipeline outside the CFG tables may call its denoiser with cfg=2
#: (``None``: no context): one call holding the whole batch, ``[uncond, cond]`` when guiding.
_BATCHED_CONTEXTS: tuple[str | None, ...] = (None, "cond_uncond")


def _class_names(obj: Any) -> list[str]:
    return [cls.__name__ for cls in type(obj).__mro__]


def _known(obj: Any, table: Any) -> str | None:
    """The most specific class name of ``obj`` that is a key of (or listed in) ``table``."""
    return next((name for name in _class_names(obj) if name in table), None)


def _is_diffusers_model(obj: Any) -> bool:
    return any(
        f"{c.__module__.split('.')[0]}.{c.__name__}" == "diffusers.ModelMixin" for c in type(obj).__mro__
    )


def _transformers(pipe: Any) -> list[torch.nn.Module]:
    """The pipeline's denoisers, in component order: components whose class is in :data:`PER_SAMPLE_ARGS`
    (found by type), and diffusers models named in :data:`DENOISER_NAMES`."""
    found: list[torch.nn.Module] = []
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        known = _known(component, PER_SAMPLE_ARGS) is not None
        if known or (name in DENOISER_NAMES and _is_diffusers_model(component)):
            if all(component is not f for f in found):
                found.append(component)
    return found


def _batches_cfg(pipe: Any) -> bool:
    """Whether a pipeline outside the CFG tables shows diffusers' batched-CFG pattern: it has
    ``do_classifier_free_guidance`` (a property, or a local of ``__call__`` as in PixArt) and its ``__call__``
    builds ``torch.cat([latents] * 2)`` and makes no ``cache_context("uncond")`` call (a read of its source).
    Only the plan depends on it: the calls themselves are checked when they come (``mode="generic"``)."""
    try:
        source = inspect.getsource(type(pipe).__call__)
    except (OSError, TypeError):  # no source (compiled, interactive): not recognised
        return False
    guides = hasattr(type(pipe), "do_classifier_free_guidance") or "do_classifier_free_guidance" in source
    return guides and "[latents] * 2" in source and 'cache_context("uncond")' not in source


def _cfg_mode(pipe: Any) -> str:
    """``"two_call"``/``"batched"`` for the CFG tables, else ``"generic"`` (decided from the calls)."""
    if _known(pipe, TWO_CALL_CFG_PIPELINES):
        return "two_call"
    if _known(pipe, BATCHED_CFG_PIPELINES):
        return "batched"
    return "generic"


def _plans_cfg(pipe: Any) -> bool:
    """Whether ``parallel=N`` should plan a cfg degree: the tables, and pipelines that batch their CFG (a read
    of ``__call__``'s source). Two-call pipelines outside the tables (Flux and QwenImage true CFG, opt-in per
    call) get ``cfg=2`` only when asked for: without a negative prompt that rank would idle."""
    return _known(pipe, TWO_CALL_CFG_PIPELINES + BATCHED_CFG_PIPELINES) is not None or _batches_cfg(pipe)


def _holds_tensor(value: Any) -> bool:
    """Whether a dict/list/tuple/set holds a tensor, at any depth."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False


def _rows(value: Any) -> int | None:
    """The leading dim of a tensor of at least one dim, else ``None``."""
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None


def generic_split(model_name: str, arguments: dict[str, Any], batch_arg: str) -> tuple[str, ...]:
    """The arguments of a forward call of an unlisted denoiser class to split along dim 0 (see module doc).

    Args:
        model_name: The class name, for errors.
        arguments: Argument name -> value of the call (``**kwargs`` entries flattened in, ``self`` left out).
        batch_arg: The argument whose leading dim is the batch (the forward's first parameter).

    Raises:
        TypeError: An argument whose batch dim cannot be told: a tensor of another leading dim than the
            batch (and not 1), or a container holding tensors other than a flat dict of them.

    >>> import torch
    >>> x = torch.zeros(2, 4)
    >>> generic_split("M", {"hidden_states": x, "t": torch.zeros(2), "ids": torch.zeros(1, 3), "n": 3}, "hidden_states")
    ('hidden_states', 't')
    """
    hidden = arguments.get(batch_arg)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() == 0:
        raise TypeError(
            f"{model_name}.forward needs {batch_arg} as a batched tensor, got {type(hidden).__name__}"
        )
    batch = hidden.shape[0]
    split: list[str] = []
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            if value.dim() > 0 and value.shape[0] == batch:
                split.append(name)
            elif value.dim() > 0 and value.shape[0] != 1:
                raise TypeError(
                    f"hfpatch data/CFG parallel cannot tell whether {model_name}.forward argument {name} (shape "
                    f"{tuple(value.shape)}) carries the batch dim: its leading dim is neither the batch {batch} of "
                    f"{batch_arg} nor 1. Use cfg=1 and data=1 for this pipeline, or list {model_name} in "
                    "hfpatch.patches.pipeline.PER_SAMPLE_ARGS."
                )
        elif (
            isinstance(value, dict)
            and all(isinstance(v, torch.Tensor) or not _holds_tensor(v) for v in value.values())
            and all(_rows(v) in (None, 1, batch) for v in value.values())
        ):
            # A flat dict of per-sample tensors (SDXL's added_cond_kwargs): its tensors follow the rule above.
            if any(_rows(v) == batch for v in value.values()):
                split.append(name)
        elif _holds_tensor(value):
            raise TypeError(
                f"hfpatch data/CFG parallel cannot tell whether the tensors inside {model_name}.forward argument "
                f"{name} ({type(value).__name__}) carry the batch dim. Use cfg=1 and data=1 for this call, or list "
                f"{model_name} in hfpatch.patches.pipeline.PER_SAMPLE_ARGS."
            )
    return tuple(split)


# dtype codes of the metadata the cfg ranks exchange before gathering predictions (-1: any other dtype).
_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 8


def _meta(tensor: torch.Tensor) -> list[int]:
    """``[dtype code, ndim, *shape]`` padded with -1 to a fixed length (dims from the 8th on folded into one)."""
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1
    shape = list(tensor.shape[: _MAX_DIMS - 1])
    if tensor.dim() >= _MAX_DIMS:
        shape.append(tensor.shape[_MAX_DIMS - 1 :].numel())
    return [code, tensor.dim(), *shape, *[-1] * (_MAX_DIMS - len(shape))]


def _describe(meta: torch.Tensor) -> str:
    code, ndim, *shape = meta.tolist()
    dtype = _DTYPES[code] if code >= 0 else "an unsupported dtype"
    return f"{tuple(shape[: min(ndim, _MAX_DIMS)])} {dtype}"


# ----------------------------------------------------------------------------------------------- call state
@dataclass
class _Pending:
    """Between the cond and the uncond call of one step: what the uncond call must complete."""

    model: torch.nn.Module
    tensor: torch.Tensor  # cfg rank 0: its cond output; cfg rank 1: the placeholder it returned
    error: Exception | None  # cfg rank 0: its cond call failed; raised at the uncond call (see _uncond)
    # The plain tensor behind ``tensor`` (``tensor`` is a guarded view of it for generic pipelines).
    placeholder: torch.Tensor
    # cfg rank 0 of a transformer with sharded weights: the cond call's arguments, computed at the uncond call
    deferred: tuple[inspect.BoundArguments, tuple[str, ...]] | None = None


@dataclass
class _State:
    """Per-pipeline call state shared by the wrapped transformers (a Wan 2.2 pipe has two).

    ``phase`` is for the generic two-call CFG of pipelines outside the tables (reset by every ``__call__``):
    ``"observe"`` during the first step (every cfg rank computes every call: exact), then ``"parallel"`` once
    that step showed one cond call, then one uncond call of the same transformer, with the cond prediction
    unread in between, else ``"off"`` (still exact, no CFG speed-up; the reason is logged).
    """

    pending: _Pending | None = None
    phase: str = "observe"
    seen: list[tuple[str, torch.nn.Module]] = field(default_factory=list)  # (context, model), first step
    watched: _WatchedPrediction | None = None  # the first step's cond prediction
    shapes: dict[int, tuple[torch.Size, torch.dtype]] = field(
        default_factory=dict
    )  # id(model) -> prediction's
    noted_unguided: bool = False  # a call without guidance was reported (once per patch; not reset per call)
    plan: ParallelConfig | None = None  # the patch's degrees (for that report)

    def reset(self) -> None:
        self.pending, self.phase, self.watched = None, "observe", None
        self.seen, self.shapes = [], {}


# Tensor methods that read metadata only: allowed on a prediction before its values exist.
_METADATA_ONLY = frozenset({"__get__", "size", "dim", "numel", "__len__", "stride", "is_contiguous"})


def _used(cls: type, func: Any, args: tuple, kwargs: dict | None) -> list[Any]:
    """The ``cls`` tensors an op computes with, anywhere in its arguments (``torch.cat([t, ...])`` too);
    none for ops that read metadata only."""
    if getattr(func, "__name__", "") in _METADATA_ONLY:
        return []
    return [leaf for leaf in tree_leaves((args, kwargs or {})) if isinstance(leaf, cls)]


def _plain(func: Any, args: tuple, kwargs: dict | None) -> Any:
    """``func`` on the plain tensors behind any subclass instances: plain results."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


class _WatchedPrediction(torch.Tensor):
    """The first step's cond prediction (observe phase): records whether the pipeline computes with it before
    its uncond call; it computes as a plain tensor and its results are plain tensors."""

    read: bool
    observing: bool

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for prediction in _used(cls, func, args, kwargs):
            prediction.read = prediction.read or prediction.observing
        return _plain(func, args, kwargs)


class _PendingPrediction(torch.Tensor):
    """What a cfg rank returns for a generic pipeline's cond call in the parallel phase: on cfg rank 1 its values
    arrive with the uncond call's exchange. Computing with it before then raises, on both cfg ranks (the pattern
    seen in the first step did not hold), so a pipeline can never use it unfilled."""

    filled: bool
    message: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for prediction in _used(cls, func, args, kwargs):
            if not prediction.filled:
                raise RuntimeError(prediction.message)
        return _plain(func, args, kwargs)


class _ParallelForward:
    """Replacement ``forward`` of one transformer: splits the batch over data (and cfg) ranks.

    Args:
        model: The transformer (to name it in errors and match cond/uncond calls).
        original: Its forward before this patch (possibly already wrapped by its sequence-parallel family).
        pipe: The pipeline (read ``do_classifier_free_guidance`` at call time).
        mode: ``"two_call"``, ``"batched"``, ``"generic"`` (batched calls of a pipeline outside the CFG
            tables) or ``None`` (no CFG parallel).
        cfg_group, data_group: Process groups (``None`` when the degree is 1).
        state: Shared call state of the pipeline.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        original: Callable[..., Any],
        pipe: Any,
        mode: str | None,
        cfg_group: Any,
        data_group: Any,
        state: _State,
    ) -> None:
        self.model = model
        self.original = original
        self.pipe = pipe
        self.mode = mode
        self.cfg_group = cfg_group
        self.data_group = data_group
        self.state = state
        self.context: str | None = None  # name of the open cache_context, set by _recording_cache_context
        #: The groups that split the batch of the call running now (read by hfpatch.patches.caches: a step cache's
        #: decision metric is reduced over them, as one rank computes it over the whole batch).
        self.split_groups: list[Any] = []
        self.name = type(model).__name__
        self.signature = inspect.signature(type(model).forward)
        parameters = list(self.signature.parameters.values())
        known = _known(model, PER_SAMPLE_ARGS)
        # Known class: its table; any other: generic_split, per call (split_args/plain_args None).
        self.split_args: tuple[str, ...] | None = None
        self.plain_args: tuple[str, ...] | None = None
        if known is not None:
            self.split_args, self.plain_args = PER_SAMPLE_ARGS[known]
        # The argument whose leading dim is the batch: hidden_states, or the first parameter (UNet's sample).
        self.batch_arg = "hidden_states" if known is not None else parameters[1].name
        self.varkw = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
        # Weights sharded by FSDP2 (shard_weights=True, or the user's fully_shard): every forward all-gathers
        # each block over ranks of both cfg branches, so both must compute in the SAME call; cfg rank 0 then
        # computes the cond prediction at the uncond call, as cfg rank 1 computes the uncond one.
        self.defer_cond = any(cls.__name__ == "FSDPModule" for cls in type(model).__mro__)

    # -- argument handling ----------------------------------------------------------------------------
    def _bind(self, args: tuple, kwargs: dict) -> inspect.BoundArguments:
        bound = self.signature.bind(self.model, *args, **kwargs)
        if self.split_args is None or self.plain_args is None:
            return bound  # generic class: checked by generic_split in _split_names
        unknown = [
            name
            for name, value in bound.arguments.items()
            if name != "self" and name not in self.split_args + self.plain_args and value is not None
        ]
        if unknown:
            raise TypeError(
                f"hfpatch data/CFG parallel does not know how to split {self.name}.forward argument(s) "
                f"{', '.join(unknown)}; it splits {', '.join(self.split_args)} along the batch and passes "
                f"{', '.join(self.plain_args)} unchanged. Use cfg=1 and data=1 for this call."
            )
        for name in self.plain_args:
            value = bound.arguments.get(name)
            if isinstance(value, dict) and _holds_tensor(value):
                raise TypeError(
                    f"{self.name}.forward got tensors in {name}={sorted(value)}; hfpatch data/CFG parallel "
                    "cannot tell whether they carry a batch dim. Use cfg=1 and data=1 for this call."
                )
        return bound

    def _batch(self, bound: inspect.BoundArguments) -> int:
        hidden = bound.arguments.get(self.batch_arg)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() == 0:
            raise TypeError(
                f"{self.name}.forward needs {self.batch_arg} as a batched tensor, got {type(hidden)}"
            )
        return hidden.shape[0]

    def _arguments(self, bound: inspect.BoundArguments) -> dict[str, Any]:
        """The call's arguments by name, ``**kwargs`` entries flattened in, ``self`` left out."""
        named = {k: v for k, v in bound.arguments.items() if k not in ("self", self.varkw)}
        if self.varkw is not None:
            named.update(bound.arguments.get(self.varkw, {}))
        return named

    def _split_names(self, bound: inspect.BoundArguments) -> tuple[str, ...]:
        """The arguments this call splits along dim 0 (checked here, before any collective of the split)."""
        batch = self._batch(bound)
        if self.split_args is None:
            return generic_split(self.name, self._arguments(bound), self.batch_arg)
        names = []
        for name in self.split_args:
            value = bound.arguments.get(name)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue  # None, or a scalar timestep shared by the batch
            if value.shape[0] == batch:
                names.append(name)
            elif value.shape[0] != 1:  # size 1 broadcasts over the batch
                raise ValueError(
                    f"{self.name}.forward: {name} has leading dim {value.shape[0]}, expected the batch size "
                    f"{batch} of hidden_states (or 1)"
                )
        return tuple(names)

    def _slice(
        self, bound: inspect.BoundArguments, names: tuple[str, ...], batch: int, start: int, length: int
    ) -> inspect.BoundArguments:
        """A copy of ``bound`` (of batch ``batch``) with the arguments ``names`` narrowed to rows
        ``start:start + length``."""
        arguments = bound.arguments.copy()
        if self.varkw is not None and self.varkw in arguments:
            arguments[self.varkw] = dict(arguments[self.varkw])
        for name in names:
            holder = arguments if name in arguments else arguments[self.varkw]
            value = holder[name]
            if isinstance(value, dict):  # a flat dict of per-sample tensors (see generic_split)
                holder[name] = {
                    k: v.narrow(0, start, length) if _rows(v) == batch else v for k, v in value.items()
                }
            else:
                holder[name] = value.narrow(0, start, length)
        return inspect.BoundArguments(bound.signature, arguments)

    # -- compute ----------------------------------------------------------------------------------------
    def _compute(self, bound: inspect.BoundArguments) -> torch.Tensor:
        bound.arguments["return_dict"] = False
        out = self.original(*bound.args[1:], **bound.kwargs)
        if not isinstance(out, tuple) or len(out) != 1 or not isinstance(out[0], torch.Tensor):
            raise RuntimeError(
                f"{self.name}.forward(return_dict=False) returned {type(out).__name__}, expected a 1-tuple "
                "holding the prediction; hfpatch data/CFG parallel cannot gather it"
            )
        return out[0]

    def _split_compute(
        self, bound: inspect.BoundArguments, groups: list[Any], names: tuple[str, ...]
    ) -> torch.Tensor:
        """Split the arguments ``names`` over each group in ``groups`` in turn (``None``: degree 1), compute,
        gather back."""
        if not groups:
            return self._compute(bound)
        group, rest = groups[0], groups[1:]
        if group is None:
            return self._split_compute(bound, rest, names)
        batch = self._batch(bound)
        world = torch.distributed.get_world_size(group)
        if batch < world:
            # Only the cfg axis gets here (data batches are checked in __call__, before any collective): a
            # call without guidance and batch 1. Every cfg rank computes it: redundant, still exact.
            self._note_unguided("its batch holds no uncond half")
            return self._split_compute(bound, rest, names)
        sizes = even_sizes(batch, world)
        me = torch.distributed.get_rank(group)
        self.split_groups.append(group)
        try:
            local = self._split_compute(
                self._slice(bound, names, batch, sum(sizes[:me]), sizes[me]), rest, names
            )
        finally:
            self.split_groups.pop()
        return all_gather(local, dim=0, group=group, sizes=sizes)

    # -- the call ---------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        bound = self._bind(args, kwargs)
        names = self._split_names(bound)
        return_dict = bound.arguments.get("return_dict", True)
        batch = self._batch(bound)
        data_world = 1 if self.data_group is None else torch.distributed.get_world_size(self.data_group)
        # A generic pipeline's cond/uncond calls are its two-call CFG (observed first); its other calls batch.
        observed = self.mode == "generic" and self.context in ("cond", "uncond")
        if self.mode == "generic" and not observed and self.context not in _BATCHED_CONTEXTS:
            raise self._pattern_error(f"a call inside cache_context({self.context!r})")
        batched_cfg = self.mode in ("batched", "generic") and not observed and self.cfg_group is not None
        data_batch = batch // 2 if batched_cfg and batch >= 2 else batch  # the smaller cfg half
        if data_batch < data_world:
            raise ValueError(
                f"data={data_world} splits each {self.name} call's batch over {data_world} ranks, but this call "
                f"has batch {data_batch}{' per CFG half' if data_batch != batch else ''}; pass at least {data_world} prompts (or num_images/videos_per_prompt) per "
                "call, or use fewer data ranks"
            )
        if observed:
            out = self._observed_two_call(bound, names)
        elif self.mode == "two_call" and self.cfg_group is not None:
            out = self._two_call(bound, names)
        elif batched_cfg:
            out = self._split_compute(bound, [self.cfg_group, self.data_group], names)
        else:
            out = self._split_compute(bound, [self.data_group], names)
        # The output type of diffusers transformers (a UNet's has the same `sample` field).
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)

    def _two_call(self, bound: inspect.BoundArguments, names: tuple[str, ...]) -> torch.Tensor:
        data_only = [self.data_group]
        guiding = self.mode != "two_call" or bool(getattr(self.pipe, "do_classifier_free_guidance", False))
        if not guiding:  # guidance_scale <= 1: a single call per step, computed on both cfg ranks
            if self.state.pending is not None:
                raise self._pattern_error("a call without guidance while an uncond call was due")
            self._note_unguided("do_classifier_free_guidance is False: one call per step")
            return self._split_compute(bound, data_only, names)
        cfg_rank = torch.distributed.get_rank(self.cfg_group)
        if self.context == "cond":
            if self.state.pending is not None:
                raise self._pattern_error("two cond calls in a row")
            # cfg rank 1: filled in place with the cond prediction when the uncond call has run (see _uncond).
            tensor = placeholder = self._placeholder(bound)
            error = None
            deferred = (bound, names) if cfg_rank == 0 and self.defer_cond else None
            if cfg_rank == 0 and deferred is None:
                try:
                    tensor = self._split_compute(bound, data_only, names)
                except Exception as exc:
                    # cfg rank 1 returns without communicating and meets this rank at the uncond call's
                    # exchange: raise there, on both ranks, instead of leaving rank 1 waiting.
                    error = exc
                placeholder = tensor
            if self.mode == "generic":
                # The pattern is known from the first step only: guard every use until the uncond call, on
                # both cfg ranks alike (the same pipeline code raises at the same point on every rank).
                tensor = torch.Tensor._make_subclass(_PendingPrediction, placeholder)
                tensor.filled = False
                tensor.message = (
                    f"hfpatch CFG parallel (cfg=2): {type(self.pipe).__name__} computed with the cond prediction "
                    f"of {self.name} before its uncond call, unlike in its first step; that value exists on cfg "
                    "rank 0 only at this point. Apply with cfg=1 for this pipeline."
                )
            self.state.pending = _Pending(self.model, tensor, error, placeholder, deferred)
            return tensor
        if self.context == "uncond":
            return self._uncond(bound, cfg_rank, names)
        raise self._pattern_error(f"a call inside cache_context({self.context!r})")

    def _placeholder(self, bound: inspect.BoundArguments) -> torch.Tensor:
        """An empty prediction of the shape this call returns: for Wan, ``hidden_states`` with
        ``out_channels``; for a generic pipeline, what the first step's cond call returned."""
        hidden = bound.arguments[self.batch_arg]
        if self.mode == "generic":
            shape, dtype = self.state.shapes[id(self.model)]
            return hidden.new_empty(shape, dtype=dtype)
        channels = self.model.config.out_channels or self.model.config.in_channels
        return hidden.new_empty((hidden.shape[0], channels, *hidden.shape[2:]))

    def _observed_two_call(self, bound: inspect.BoundArguments, names: tuple[str, ...]) -> torch.Tensor:
        """Two-call CFG of a pipeline outside the tables (see :class:`_State`): watch the first step, then run
        cond and uncond on different cfg ranks if it showed the supported pattern."""
        state = self.state
        if state.phase == "observe" and self.context == "cond" and state.seen:  # the second step begins
            state.phase = self._decide()
        if state.phase == "parallel":
            return self._two_call(bound, names)
        out = self._split_compute(bound, [self.data_group], names)  # on every cfg rank: exact
        if state.phase != "observe":
            return out
        state.seen.append((self.context, self.model))
        if state.watched is not None:
            state.watched.observing = False  # reads after the uncond call are the pipeline's own business
        if self.context == "cond":
            state.shapes[id(self.model)] = (out.shape, out.dtype)
            out = torch.Tensor._make_subclass(_WatchedPrediction, out)
            out.read, out.observing = False, True
            state.watched = out
        return out

    def _decide(self) -> str:
        """``"parallel"`` if the first step was one cond then one uncond call of one transformer with the cond
        prediction unread in between (the same on every rank: same calls), else ``"off"``, logged."""
        state = self.state
        contexts = [context for context, _ in state.seen]
        if contexts == ["cond", "uncond"] and state.seen[0][1] is state.seen[1][1] and not state.watched.read:
            return "parallel"
        if contexts == ["cond"]:
            self._note_unguided("it made one cond call per step")
            return "off"
        if contexts == ["cond", "uncond"] and not state.watched.read:
            reason = "its cond and uncond calls went to different transformers"
        elif contexts == ["cond", "uncond"]:
            reason = "it computed with the cond prediction before the uncond call"
        else:
            reason = f"its first step called the transformer in cache contexts {contexts}"
        logger.info(
            "hfpatch CFG parallel: %s runs both CFG calls on every cfg rank in this call (exact, no CFG "
            "speed-up): %s; CFG parallel needs one cond then one uncond call per step.",
            type(self.pipe).__name__,
            reason,
        )
        return "off"

    def _note_unguided(self, why: str) -> None:
        """Say once per patch (on global rank 0) that a call without guidance leaves the cfg axis idle.

        Such a call is exact (every cfg rank computes the same prediction, the unpatched one) but gets nothing
        from the cfg ranks. hfpatch does not re-plan them into sequence parallelism per call: the sequence split
        is bound to the plan's groups at ``apply`` (processors, shard plans, caches), so the advice is to plan
        without cfg for models that run without guidance (distilled checkpoints, guidance_scale=1).
        """
        if self.state.noted_unguided:
            return
        self.state.noted_unguided = True
        if runtime.rank() != 0:
            return
        plan = self.state.plan
        sp = 2 * (1 if plan is None else plan.ring * plan.ulysses)
        data = 1 if plan is None else plan.data
        heads = getattr(getattr(self.model, "config", None), "num_attention_heads", None)
        if isinstance(heads, int):
            ulysses = max(d for d in range(1, sp + 1) if sp % d == 0 and heads % d == 0)
            degrees = [("data", data), ("ring", sp // ulysses), ("ulysses", ulysses)]
            advice = "so that every rank joins sequence parallelism, e.g. parallel=hfpatch.ParallelConfig({})".format(
                ", ".join(f"{k}={v}" for k, v in degrees if v > 1)
            )
        else:  # a denoiser without attention heads in its config (a UNet): no sequence parallelism
            advice = f"and data={2 * data} to split several prompts over the ranks"
        logger.warning(
            "hfpatch: this %s call does not guide (%s), so the plan's cfg=2 has nothing to split: both cfg ranks "
            "compute the same prediction, which is exact but gives no speed-up from the cfg axis. For calls "
            "without guidance, apply with cfg=1 %s. (Said once per patch.)",
            type(self.pipe).__name__,
            why,
            advice,
        )

    def _uncond(self, bound: inspect.BoundArguments, cfg_rank: int, names: tuple[str, ...]) -> torch.Tensor:
        pending = self.state.pending
        if pending is None or pending.model is not self.model:
            raise self._pattern_error("an uncond call without a cond call of the same transformer before it")
        self.state.pending = None
        if pending.placeholder.shape[0] != self._batch(bound):
            raise self._pattern_error("cond and uncond calls with different batch sizes")
        error = pending.error
        if cfg_rank == 0 and pending.deferred is None:
            local = pending.placeholder  # the cond prediction; cfg rank 1 computes the uncond one
        else:
            # cfg rank 1: this uncond call; cfg rank 0 of sharded weights: its deferred cond call
            call, call_names = pending.deferred if cfg_rank == 0 else (bound, names)
            try:
                local = self._split_compute(call, [self.data_group], call_names)
            except Exception as exc:  # re-raised below, once cfg rank 0 knows it must raise too
                error, local = exc, pending.placeholder
        self._agree_before_gather(local, pending.placeholder, error, cfg_rank)
        both = all_gather(local.unsqueeze(0), dim=0, group=self.cfg_group)  # [cond, uncond]
        if cfg_rank == 1 or pending.deferred is not None:
            pending.placeholder.copy_(both[0])  # the storage of what this rank returned for the cond call
        if isinstance(pending.tensor, _PendingPrediction):
            pending.tensor.filled = True
        return both[1] if cfg_rank == 0 else local

    def _agree_before_gather(
        self, local: torch.Tensor, expected: torch.Tensor, error: Exception | None, cfg_rank: int
    ) -> None:
        """Exchange what each cfg rank is about to gather, so that both raise or neither does.

        An error raised on one cfg rank only would leave the other blocked in the all-gather until the
        process group times out. A rank whose transformer call failed (``error``: rank 0's cond call, rank
        1's uncond call) re-raises it after the exchange; the other raises ``RuntimeError``. Each rank sends ``[ok, meta(local), meta(expected)]`` (ints); the gather is
        safe when both are ok and all four metas agree: rank 0's cond output, rank 1's uncond output and
        rank 1's placeholder have one shape and dtype.
        """
        mine = torch.tensor([error is None, *_meta(local), *_meta(expected)], dtype=torch.int64)
        metas = all_gather(mine.to(local.device)[None], dim=0, group=self.cfg_group).cpu()
        if error is not None:
            raise error
        if not metas[:, 0].all():
            other = 1 - cfg_rank
            raise RuntimeError(
                f"hfpatch CFG parallel: the {('cond', 'uncond')[other]} call of {self.name} failed on cfg rank "
                f"{other} (its error is in that rank's log); this rank stops too instead of waiting for it"
            )
        halves = metas[:, 1:].reshape(-1, len(_meta(local)))
        if not (halves == halves[0]).all():
            cond, uncond, placeholder = (_describe(m) for m in (halves[0], halves[2], halves[3]))
            raise RuntimeError(
                f"{self.name} returned {uncond} for the uncond call on cfg rank 1 and {cond} for the cond call "
                f"on cfg rank 0, but hfpatch CFG parallel expected {placeholder} (hidden_states with "
                "out_channels); the transformer's output does not match its config"
            )

    def _pattern_error(self, what: str) -> RuntimeError:
        self.state.pending = None
        if self.mode == "generic":
            return RuntimeError(
                f"hfpatch CFG parallel (cfg=2) saw {what} on {self.name} in {type(self.pipe).__name__}. For "
                "pipelines outside hfpatch's CFG tables it splits calls that hold the whole batch (no cache_context, "
                "or cache_context('cond_uncond')) and, when the first step showed it, one cache_context('cond') "
                "call then one cache_context('uncond') call per step. Apply with cfg=1 (data=N still splits the "
                "prompts)."
            )
        return RuntimeError(
            f"hfpatch CFG parallel (cfg=2) saw {what} on {self.name} in {type(self.pipe).__name__}. For "
            "pipelines outside hfpatch's CFG tables it splits only calls that hold the whole batch (no "
            "cache_context, or cache_context('cond_uncond')); the two-call pattern (cache_context('cond') then "
            f"('uncond')) is supported for {', '.join(TWO_CALL_CFG_PIPELINES)} only. Apply with cfg=1 (data=N "
            "still splits the prompts)."
        )
        return RuntimeError(
            f"hfpatch CFG parallel (cfg=2) saw {what} on {self.name} in {type(self.pipe).__name__}. It supports "
            "the pattern of diffusers' "
            f"{', '.join(TWO_CALL_CFG_PIPELINES)}: per step one call in cache_context('cond'), then one in "
            "cache_context('uncond') when do_classifier_free_guidance. Apply with cfg=1 for other call patterns."
        )


def _recording_cache_context(forward: _ParallelForward) -> Callable[[Callable], Callable]:
    """Wrap ``model.cache_context`` so the forward knows whether it is the cond or the uncond call."""

    def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        @contextmanager
        def cache_context(name: str, **kwargs: Any) -> Iterator[None]:
            previous, forward.context = forward.context, name
            try:
                with original(name, **kwargs):
                    yield
            finally:
                forward.context = previous

        return cache_context

    return wrapper


def _quiet_progress_bar(pipe: Any) -> Callable[[Callable], Callable]:
    """Wrap ``pipe.progress_bar`` so that its bars are disabled whatever ``_progress_bar_config`` says then."""

    def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def progress_bar(*args: Any, **kwargs: Any) -> Any:
            missing = "_progress_bar_config" not in vars(pipe)
            config = vars(pipe).get("_progress_bar_config")
            if config is not None and not isinstance(config, dict):
                return original(*args, **kwargs)  # diffusers raises its own error
            pipe._progress_bar_config = {**(config or {}), "disable": True}
            try:
                return original(*args, **kwargs)  # the bar reads the config now, once
            finally:
                if missing:
                    del pipe._progress_bar_config
                else:
                    pipe._progress_bar_config = config

        return progress_bar

    return wrapper


# ----------------------------------------------------------------------------------------------- family
class PipelineParallel(PatchFamily):
    """CFG parallel and data parallel for a diffusers ``DiffusionPipeline`` (applied after its components).

    Every rank calls the pipeline with the same arguments (same prompts, same generator seeds) and gets the
    full output of the unpatched pipeline. Progress bars show on global rank 0 only.

    Supported: CFG parallel for :data:`TWO_CALL_CFG_PIPELINES` and :data:`BATCHED_CFG_PIPELINES`, and for
    the batched calls of other pipelines that define ``do_classifier_free_guidance``; data parallel for any
    pipeline whose denoiser calls can be split by batch (module docstring: known classes by
    :data:`PER_SAMPLE_ARGS`, others by :func:`generic_split`).

    >>> import torch
    >>> from hfpatch.testing import tiny_sd3_pipe
    >>> facts = PipelineParallel().facts(tiny_sd3_pipe())
    >>> facts.guides, facts.name
    (True, 'StableDiffusion3Pipeline')
    """

    name: ClassVar[str] = "pipeline_parallel"
    options: ClassVar[dict[str, Any]] = {"check_inputs": True}
    role: ClassVar[str] = "pipeline"

    def facts(self, target: Any) -> ModelFacts:
        """``guides`` is True for pipelines whose classifier-free guidance hfpatch can run in parallel.

        Pipelines that guide in another pattern report False, so ``parallel=N`` plans no CFG degree for
        them and puts every rank into sequence parallelism instead.
        """
        return ModelFacts(guides=_plans_cfg(target), name=type(target).__name__)

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        name = type(target).__name__
        if config.cfg == 2 and _cfg_mode(target) != "generic":
            if not hasattr(type(target), "do_classifier_free_guidance"):
                raise ValueError(f"cfg=2 needs {name}.do_classifier_free_guidance, which it does not have")
        if config.cfg == 2 or config.data > 1:
            models = _transformers(target)
            if not models:
                found = ", ".join(
                    type(c).__name__ for c in target.components.values() if isinstance(c, torch.nn.Module)
                )
                raise ValueError(
                    f"data={config.data}, cfg={config.cfg} split the denoiser calls of {name}, but none of its "
                    f"components ({found or 'none'}) is a denoiser: a diffusers model named "
                    f"{'/'.join(DENOISER_NAMES)}, or one of {', '.join(PER_SAMPLE_ARGS)}"
                )
            from .caches import check_caches

            mode = _cfg_mode(target)
            two_call = mode == "two_call" or (mode == "generic" and not _batches_cfg(target))
            for model in models:  # a step cache must decide alike on the ranks that split each call
                check_caches(
                    model,
                    sequence=config.ring * config.ulysses,
                    cfg=config.cfg,
                    data=config.data,
                    two_call_cfg=two_call,
                )
            if _cfg_mode(target) == "two_call" and config.cfg == 2:
                for model in models:
                    if not callable(getattr(model, "cache_context", None)):
                        raise ValueError(
                            f"cfg=2 on {name} tells cond from uncond calls by {type(model).__name__}.cache_context, "
                            "which this diffusers version does not have; upgrade diffusers or use cfg=1"
                        )

    def apply(self, target: Any, patch: Any, mesh: Any, options: dict[str, Any]) -> None:
        config: ParallelConfig = mesh.config
        if runtime.rank() != 0:
            # diffusers reads the whole dict on every progress_bar(); set a new one so the old one comes back.
            current = getattr(target, "_progress_bar_config", {})
            patch.set_attr(target, "_progress_bar_config", {**current, "disable": True})
            # ... and keep it off when set_progress_bar_config() replaces that dict after apply.
            patch.wrap_method(target, "progress_bar", _quiet_progress_bar(target))
        state = _State(plan=config)
        if config.world_size > 1 and options["check_inputs"]:
            self._guard_transformer_calls(target, patch, mesh.group("world"), state)
        if config.cfg == 1 and config.data == 1:
            return
        mode = _cfg_mode(target) if config.cfg == 2 else None
        for model in _transformers(target):
            forward = patch.wrap_method(
                model,
                "forward",
                lambda original, model=model: _ParallelForward(
                    model,
                    original,
                    target,
                    mode,
                    mesh.group("cfg"),
                    mesh.group("data"),
                    state,
                ),
            )
            if mode in ("two_call", "generic") and callable(getattr(model, "cache_context", None)):
                patch.wrap_method(model, "cache_context", _recording_cache_context(forward))
            if config.ring * config.ulysses == 1:  # else its sequence-parallel family agrees the caches
                from .caches import agree_caches

                agree_caches(model, None, patch)  # decisions over the batch groups that split each call

        def reset(original: Callable[..., Any]) -> Callable[..., Any]:
            # progress_bar() opens the denoising loop: a call that failed midway leaves no stale state.
            def progress_bar(*args: Any, **kwargs: Any) -> Any:
                state.reset()
                return original(*args, **kwargs)

            return progress_bar

        def check_done(original: Callable[..., Any]) -> Callable[..., Any]:
            # maybe_free_model_hooks() ends every diffusers __call__: an unfilled placeholder means a cond call
            # had no uncond call after it, so the output would hold garbage; fail instead.
            def maybe_free_model_hooks(*args: Any, **kwargs: Any) -> Any:
                if state.pending is not None:
                    state.pending = None
                    raise RuntimeError(
                        f"hfpatch CFG parallel: {type(target).__name__} ended a step with a cond call and no "
                        "uncond call after it; the CFG pattern is not the supported one. Apply with cfg=1."
                    )
                return original(*args, **kwargs)

            return maybe_free_model_hooks

        if mode in ("two_call", "generic"):
            patch.wrap_method(target, "progress_bar", reset)
            patch.wrap_method(target, "maybe_free_model_hooks", check_done)

    @staticmethod
    def _guard_transformer_calls(pipe: Any, patch: Any, world_group: Any, state: _State) -> None:
        """Every rank runs the same pipeline call: each transformer call first checks, over all ranks of the
        plan, its arguments and the pipeline settings it depends on (guidance, timesteps).

        A cond-call error that cfg rank 0 deferred to the uncond call (see ``_ParallelForward._two_call``) is
        raised there if the uncond call's check times out: its sequence-parallel peers still wait in the
        failed cond call, so the check cannot complete, and the rank's own error says why.
        """

        def deferred_error() -> BaseException | None:
            pending = state.pending
            if pending is None or pending.error is None:
                return None
            state.pending = None
            return pending.error

        given = _record_pipeline_arguments(pipe, patch)

        def sources() -> dict[str, Any]:
            # The first transformer call of a pipeline call also compares what the user passed the pipeline
            # (its check_inputs and prepare_latents arguments), so a mismatch names prompt_embeds or the
            # generator, not the transformer arguments computed from them.
            taken = dict(given)
            given.clear()
            return taken

        for model in _transformers(pipe):

            def settings() -> dict[str, Any]:
                try:
                    guiding = bool(getattr(pipe, "do_classifier_free_guidance", False))
                except Exception:  # a property reading state this pipeline has not set
                    guiding = None
                scheduler = getattr(pipe, "scheduler", None)
                return {
                    "pipeline guidance_scale": getattr(pipe, "_guidance_scale", None),
                    "pipeline do_classifier_free_guidance": guiding,
                    "pipeline scheduler timesteps": getattr(scheduler, "timesteps", None),
                }

            what = f"{type(pipe).__name__} call of {type(model).__name__}"
            install_call_guard(
                patch,
                model,
                world_group,
                what,
                extra=settings,
                deferred_error=deferred_error,
                sources=sources,
            )


#: ``prepare_latents``/``check_inputs`` arguments that the pipeline computes itself (not the user's).
_DERIVED_ARGUMENTS = frozenset({"self", "device", "dtype"})


def _snapshot(value: Any) -> Any:
    """``value`` as it is now: a generator's state is copied (the pipeline draws from it next)."""
    if isinstance(value, torch.Generator):
        copy = torch.Generator(device=value.device)
        copy.set_state(value.get_state())
        return copy
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _record_pipeline_arguments(pipe: Any, patch: Any) -> dict[str, Any]:
    """Record the arguments of ``pipe.check_inputs`` and ``pipe.prepare_latents`` (every diffusers pipeline
    calls them at the start of ``__call__`` with the user's prompt, embeddings, sizes, generator and latents)
    into the returned dict, keyed ``"'prompt_embeds' (WanPipeline argument)"``; ``check_inputs`` starts a new
    record. Pipelines without these methods record nothing (their transformer arguments are compared alone)."""
    recorded: dict[str, Any] = {}
    label = type(pipe).__name__

    def recording(method: str) -> Callable[[Callable], Callable]:
        def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
            try:
                signature = inspect.signature(original)
            except (TypeError, ValueError):
                return original

            def record(*args: Any, **kwargs: Any) -> Any:
                if method == "check_inputs":
                    recorded.clear()
                try:
                    arguments = signature.bind(*args, **kwargs).arguments
                except TypeError:  # diffusers raises its own error
                    arguments = {}
                for name, value in arguments.items():
                    if name not in _DERIVED_ARGUMENTS:
                        recorded[f"{name!r} ({label} argument)"] = _snapshot(value)
                return original(*args, **kwargs)

            return record

        return wrapper

    for method in ("check_inputs", "prepare_latents"):
        if callable(getattr(pipe, method, None)):
            patch.wrap_method(pipe, method, recording(method))
    return recorded
