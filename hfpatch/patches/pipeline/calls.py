"""The replacement ``forward`` of a pipeline's denoiser under CFG/data parallelism: each call's batch split over
the ranks and the outputs all-gathered, and the two-call CFG pattern (cond on cfg rank 0, uncond on cfg rank 1)
run with placeholders that are filled when the other branch has computed. See :mod:`hfpatch.patches.pipeline.cfg_data`
for what is split and why.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from tqdm import tqdm

from ...core.config import ParallelConfig
from ...distributed import runtime
from ...distributed.collectives import all_gather, even_sizes
from ..denoisers import PER_SAMPLE_ARGS, known_class
from . import cfg_data
from .cfg_data import generic_split, holds_tensor, leading_dim

logger = logging.getLogger(__package__)  # hfpatch.patches.pipeline, as before the package was split

__all__: list[str] = []


#: ``cache_context`` names under which a pipeline outside the CFG tables may call its denoiser with cfg=2
#: (``None``: no context): one call holding the whole batch, ``[uncond, cond]`` when guiding.
_BATCHED_CONTEXTS: tuple[str | None, ...] = (None, "cond_uncond")


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
class CallState:
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


class ParallelForward:
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
        state: CallState,
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
        known = known_class(model, PER_SAMPLE_ARGS)
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
            if isinstance(value, dict) and holds_tensor(value):
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
                    k: v.narrow(0, start, length) if leading_dim(v) == batch else v for k, v in value.items()
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
        """Two-call CFG of a pipeline outside the tables (see :class:`CallState`): watch the first step, then run
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
        # Said inside the denoising loop: tqdm clears its bar first, so the note is on a line of its own.
        with tqdm.external_write_mode():
            logger.warning(
                "hfpatch: this %s call does not guide (%s), so the plan's cfg=2 has nothing to split: both cfg "
                "ranks compute the same prediction, which is exact but gives no speed-up from the cfg axis. For "
                "calls without guidance, apply with cfg=1 %s. (Said once per patch.)",
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
            f"('uncond')) is supported for {', '.join(cfg_data.TWO_CALL_CFG_PIPELINES)} only. Apply with cfg=1 (data=N "
            "still splits the prompts)."
        )
        return RuntimeError(
            f"hfpatch CFG parallel (cfg=2) saw {what} on {self.name} in {type(self.pipe).__name__}. It supports "
            "the pattern of diffusers' "
            f"{', '.join(cfg_data.TWO_CALL_CFG_PIPELINES)}: per step one call in cache_context('cond'), then one in "
            "cache_context('uncond') when do_classifier_free_guidance. Apply with cfg=1 for other call patterns."
        )
