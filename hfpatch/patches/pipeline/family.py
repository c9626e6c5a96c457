"""The CFG/data-parallel family of a diffusers pipeline: :class:`PipelineParallel` plans the cfg degree, checks
the pipeline, and replaces the ``forward`` of each denoiser (:mod:`hfpatch.patches.pipeline.calls`), per object
and reversibly. The design notes are :mod:`hfpatch.patches.pipeline.cfg_data`'s.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from ...core.config import ModelFacts, ParallelConfig
from ...core.registry import PatchFamily
from ...distributed import runtime
from ...distributed.agreement import install_call_guard
from ..denoisers import DENOISER_NAMES, PER_SAMPLE_ARGS, pipeline_denoisers
from .calls import CallState, ParallelForward
from .cfg_data import batches_cfg, cfg_mode, plans_cfg

__all__ = ["PipelineParallel"]


def _recording_cache_context(forward: ParallelForward) -> Callable[[Callable], Callable]:
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
        return ModelFacts(guides=plans_cfg(target), name=type(target).__name__)

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        name = type(target).__name__
        if config.cfg == 2 and cfg_mode(target) != "generic":
            if not hasattr(type(target), "do_classifier_free_guidance"):
                raise ValueError(f"cfg=2 needs {name}.do_classifier_free_guidance, which it does not have")
        if config.cfg == 2 or config.data > 1:
            models = pipeline_denoisers(target)
            if not models:
                found = ", ".join(
                    type(c).__name__ for c in target.components.values() if isinstance(c, torch.nn.Module)
                )
                raise ValueError(
                    f"data={config.data}, cfg={config.cfg} split the denoiser calls of {name}, but none of its "
                    f"components ({found or 'none'}) is a denoiser: a diffusers model named "
                    f"{'/'.join(DENOISER_NAMES)}, or one of {', '.join(PER_SAMPLE_ARGS)}"
                )
            from ..caches import check_caches

            mode = cfg_mode(target)
            two_call = mode == "two_call" or (mode == "generic" and not batches_cfg(target))
            for model in models:  # a step cache must decide alike on the ranks that split each call
                check_caches(
                    model,
                    sequence=config.ring * config.ulysses,
                    cfg=config.cfg,
                    data=config.data,
                    two_call_cfg=two_call,
                )
            if cfg_mode(target) == "two_call" and config.cfg == 2:
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
        state = CallState(plan=config)
        if config.world_size > 1 and options["check_inputs"]:
            self._guard_transformer_calls(target, patch, mesh.group("world"), state)
        if config.cfg == 1 and config.data == 1:
            return
        mode = cfg_mode(target) if config.cfg == 2 else None
        for model in pipeline_denoisers(target):
            forward = patch.wrap_method(
                model,
                "forward",
                lambda original, model=model: ParallelForward(
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
                from ..caches import agree_caches

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
    def _guard_transformer_calls(pipe: Any, patch: Any, world_group: Any, state: CallState) -> None:
        """Every rank runs the same pipeline call: each transformer call first checks, over all ranks of the
        plan, its arguments and the pipeline settings it depends on (guidance, timesteps).

        A cond-call error that cfg rank 0 deferred to the uncond call (see ``ParallelForward._two_call``) is
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

        for model in pipeline_denoisers(pipe):

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
