"""PipeFusion (xDiT): the blocks split over ranks as stages, the tokens pipelined through them as patches.

The machinery shared with :mod:`hfpatch.patches.pipefusion.flux` (Flux's two block lists and joint text/image
sequence) lives here too: :class:`PipeFusionState`, :func:`check_pipefusion_options`,
:func:`install_model_hooks`, :func:`wrap_stage_blocks`, :func:`release_other_blocks`, :func:`stage_rows`,
:func:`gather_stage_output`, :func:`block_spans`.

After ``hfpatch.apply(pipe, parallel=ParallelConfig(pipefusion=P), pipefusion_patches=M,
pipefusion_warmup=W)`` on every rank of a ``P``-rank group (xDiT's PipeFusion, arXiv 2405.14430):

* **Stages.** Rank ``p`` of the ``pipefusion`` group holds the blocks of stage ``p``
  (:func:`~hfpatch.patches.pipefusion.layout.stage_ranges`: contiguous, as even as possible, or
  ``pipefusion_blocks=(n0, n1, ...)``). The other blocks' parameters are released to the ``meta`` device
  (``pipefusion_release_weights=True``, the default): each rank keeps ``1/P`` of the block weights plus the
  unsplit embeddings, norms and output projection. Every rank runs the stock model around the blocks (patch
  and condition embeddings, rotary tables: every stage needs them).
* **Warm-up** (the first ``W`` calls of each stream, see below): synchronous and exact. Stage 0 runs its
  blocks on the whole sequence and sends the hidden states to stage 1, and so on; every self-attention
  stores its full K/V in the stage's per-layer buffer.
* **Pipelined calls** (after the warm-up): the tokens are cut into ``M`` contiguous patches
  (:func:`~hfpatch.patches.pipefusion.layout.patch_ranges`). Stage ``p`` runs patch ``m`` through its
  blocks as soon as stage ``p - 1`` sent it, then sends it on (point-to-point, one patch of hidden states
  per boundary). Each self-attention writes the patch's fresh K/V into its buffer and attends to the whole
  buffer: fresh K/V for the patches this call already passed through the layer, the previous call's K/V
  ("stale", the diffusion model's temporal redundancy) for the others. Cross-attention, norms, modulation
  and the MLP are per token, hence exact. This is the only approximation of PipeFusion, so its error
  grows with ``M`` and shrinks with ``W`` (README: measured PSNR).
* **Output.** The last stage sends the model output to every other rank of its group: every rank returns
  the full output.

Streams: K/V buffers and warm-up counts are kept per ``cache_context`` name (``WanPipeline`` calls the
model in ``"cond"`` then ``"uncond"``: two streams) and per input shape. A stream starts over (empty
buffers, warm-up again) when a new generation begins: the ``step_index`` of the pipeline's
``cache_context`` is not above the last one, or, without it, the timestep does not decrease. So the
first ``W`` calls of every stream are exact, a Wan 2.2 ``transformer_2`` warms up when it takes over, and
``W`` >= the number of steps gives the unpatched output.

With Ulysses/Ring (``ParallelConfig(pipefusion=P, ulysses=U, ring=R)``, xDiT's hybrid): each stage is the
``U x R`` ranks of an ``sp`` group (the mesh puts ``pipefusion`` outside ``ring`` and ``ulysses``, so the
``pipefusion`` group links the same sp rank of every stage). Each patch is padded at its end to a multiple of
``U x R`` and cut into equal shards (:class:`~hfpatch.patches.pipefusion.layout.SequenceShardLayout`); a
rank runs its shard of every patch and hands it to the same sp rank of the next stage. Self-attention
(:func:`sequence_parallel_attention`): a Ulysses all-to-all to heads, a K/V buffer holding this rank's heads of
its ring block of every patch, Ring passes of that buffer, the inverse all-to-all (xDiT: its long-context
attention with a per-patch K/V cache). Sequence parallel is exact: the output equals PipeFusion alone. The
last stage's sp ranks all-gather the sequence for the output layers. (The sequence-parallel families stand
aside when ``pipefusion > 1``: this one runs the sequence parallelism.) Flux shards its joint ``[text, image]``
patches the same way (:mod:`hfpatch.patches.pipefusion.flux`).

Unlike xDiT's engine, which rewrites the denoising loop to run the scheduler patch by patch, hfpatch keeps
the stock pipeline loop: the pipeline fills and drains at every transformer call, a bubble of ``P - 1`` of
``M + P - 1`` patch slots per call (xDiT: ``P - 1`` of ``M * steps + P - 1``). The weights split and the
point-to-point volume (one ``[B, S, C]`` tensor per boundary per call) are the same.

Inference only: a call with gradients enabled or in training mode raises before any communication.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ...core.config import ParallelConfig
from ...core.patch import Patch
from ...distributed.agreement import named_arguments
from ...distributed.collectives import all_gather
from ..checkpoint import load_tensors, source_of
from .layout import check_stage_counts
from .state import OUTPUT, PipeFusionCall, PipeFusionState

__all__ = ["PIPEFUSION_OPTIONS", "check_pipefusion_options"]


def stage_rows(call: PipeFusionCall) -> tuple[list[tuple[int, int]], bool]:
    """The row ranges a stage runs one after the other in ``call`` (the patches' tokens; with sequence
    parallel, this rank's local rows: its shard of every patch, all at once when synchronous), and whether
    they are slices (``False``: a synchronous call without sequence parallel runs the stock tensors)."""
    shard = call.shard
    if shard is None:
        return call.patches, not call.synchronous
    return ([(0, shard.rows)] if call.synchronous else shard.local_rows), True


def gather_stage_output(
    state: PipeFusionState, call: PipeFusionCall, outputs: list[torch.Tensor]
) -> torch.Tensor:
    """The last stage's outputs of every row range, as the whole ``[B, tokens, C]`` sequence in token order:
    concatenated, and with sequence parallel all-gathered over the stage's sp ranks (padding dropped)."""
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    if call.shard is not None:
        out = all_gather(out, 1, state.sp_group).index_select(1, call.shard.global_rows)
    return out


def _output_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0]
    return out.sample


def _deliver(state: PipeFusionState, out: Any) -> None:
    """The last stage sends the model output to every other stage, which receive it in place."""
    tensor = _output_tensor(out)
    if state.is_last:
        works = [w for peer in range(state.world - 1) for w in state.send(tensor, peer, OUTPUT)]
        state.wait(works, "PipeFusion output send")
        return
    target = (
        tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    )
    state.wait(state.recv(target, state.world - 1), "PipeFusion output receive")
    if target is not tensor:
        tensor.copy_(target)


def _check_inference(model: torch.nn.Module, name: str) -> None:
    if model.training:
        raise RuntimeError(
            f"PipeFusion on {name} is inference only, but the model is in training mode; call model.eval() "
            "(PipeFusion's stale K/V make it approximate, and its blocks live on other ranks)"
        )
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"PipeFusion on {name} is inference only: it does not support backward (blocks live on other ranks, "
            "stale K/V are not differentiable), but gradients are enabled. Run it under torch.no_grad() or "
            "torch.inference_mode() (diffusers pipelines do), or use ulysses/ring for training."
        )


# ----------------------------------------------------------------------------------------------- weights
def _release(modules: list[torch.nn.Module], keep: set[int]) -> int:
    """Replace the parameters and buffers of ``modules`` (those not in ``keep``, by id) by ``meta`` tensors
    of the same shape and dtype. Returns the bytes no longer held by the model."""
    released = 0
    for module in modules:
        for sub in module.modules():
            for store in (sub._parameters, sub._buffers):
                for name, tensor in list(store.items()):
                    if tensor is None or id(tensor) in keep or tensor.device.type == "meta":
                        continue
                    released += tensor.numel() * tensor.element_size()
                    empty = torch.empty_like(tensor, device="meta")
                    if isinstance(tensor, torch.nn.Parameter):
                        empty = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                    store[name] = empty
    return released


# ----------------------------------------------------------------------------------------------- family
#: Options of every PipeFusion family (see :class:`WanPipeFusion`).
PIPEFUSION_OPTIONS: dict[str, Any] = {
    "pipefusion": False,
    "pipefusion_patches": None,
    "pipefusion_warmup": 1,
    "pipefusion_blocks": None,
    "pipefusion_release_weights": True,
    "check_inputs": True,
}


def check_pipefusion_options(
    target: Any,
    config: ParallelConfig,
    options: dict[str, Any],
    num_blocks: int,
    name: str,
    sequence_parallel: bool = False,
) -> bool:
    """The checks every PipeFusion family makes at ``apply`` (pure, so they raise alike on every rank).
    ``sequence_parallel``: whether the family runs Ulysses/Ring inside its stages.

    Returns:
        Whether the plan uses PipeFusion (``config.pipefusion > 1``); the family then checks its processors.
    """
    stages = config.pipefusion
    patches, warmup = options["pipefusion_patches"], options["pipefusion_warmup"]
    blocks, release = options["pipefusion_blocks"], options["pipefusion_release_weights"]
    if stages == 1:
        if options.get("pipefusion"):
            return False  # the planner was allowed PipeFusion and gave it one rank: the options are moot
        given = [
            f"{k}={options[k]!r}"
            for k in ("pipefusion_patches", "pipefusion_blocks")
            if options[k] is not None
        ]
        given += [f"pipefusion_warmup={warmup!r}"] if warmup != 1 else []
        given += [f"pipefusion_release_weights={release!r}"] if release is not True else []
        if given:
            raise ValueError(
                f"{', '.join(given)} configure PipeFusion, but the plan has pipefusion=1; pass "
                "parallel=hfpatch.ParallelConfig(pipefusion=N, ...) (or parallel=N, pipefusion=True) or drop "
                "these options"
            )
        return False
    if patches is not None and (not isinstance(patches, int) or isinstance(patches, bool) or patches < 1):
        raise ValueError(
            f"pipefusion_patches must be a positive int (token patches) or None, got {patches!r}"
        )
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(
            f"pipefusion_warmup must be an int >= 1 (synchronous steps that fill the K/V buffers), got {warmup!r}"
        )
    if not isinstance(release, bool):
        raise ValueError(f"pipefusion_release_weights must be True or False, got {release!r}")
    check_stage_counts(num_blocks, stages, blocks, name)
    if config.sequence_parallel > 1 and not sequence_parallel:
        raise ValueError(
            f"pipefusion={stages} with ulysses={config.ulysses}, ring={config.ring} is not supported for {name} "
            "yet (it is for WanTransformer3DModel and FluxTransformer2DModel); combine PipeFusion with cfg=2 or "
            "data=N, or use "
            "ulysses/ring without PipeFusion"
        )
    if target.training:
        raise ValueError(
            f"PipeFusion is inference only, but {name} is in training mode; call .eval() before hfpatch.apply"
        )
    if source_of(target) is None and any(p.device.type == "meta" for p in target.parameters()):
        raise ValueError(
            f"{name} has parameters on the meta device (already released?); load it fully first (or with "
            "hfpatch.from_pretrained, which reads only this stage's blocks)"
        )
    if source_of(target) is not None and not release:
        raise ValueError(
            f"{name} was built on the meta device by hfpatch.from_pretrained to read only this stage's blocks, "
            "but pipefusion_release_weights=False keeps every block: load it whole instead"
        )
    return True


def stage_groups(mesh: Any) -> dict[str, Any]:
    """The process groups a PipeFusion install takes from the mesh: ``group`` (the stages), ``sp_groups``
    (sequence parallel inside each stage) and ``guard`` (every rank of the pipeline: same call arguments)."""
    return {
        "group": mesh.group("pipefusion"),
        "sp_groups": (mesh.group("sp"), mesh.group("ulysses"), mesh.group("ring")),
        "guard": mesh.group("pipefusion_sp"),
    }


def wrap_stage_blocks(
    patch: Patch,
    blocks: list[torch.nn.Module],
    own: range,
    runner: Callable[..., Any],
    passthrough: Callable[..., Any],
    stage_blocks: list[Callable[..., Any]] | None = None,
) -> None:
    """The stock loop calls every block in turn: the first one's ``forward`` becomes ``runner`` (this stage
    for the whole call), the others' ``passthrough``. ``stage_blocks`` (the list ``runner`` reads) gets the
    stock forwards of the blocks in ``own``."""
    originals: dict[int, Callable[..., Any]] = {}

    def wrap_block(index: int) -> Callable[[Callable], Callable]:
        def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
            originals[index] = original
            return runner if index == 0 else passthrough

        return wrapper

    for index, block in enumerate(blocks):
        patch.wrap_method(block, "forward", wrap_block(index))
    if stage_blocks is not None:
        stage_blocks.extend(originals[i] for i in own)


def install_model_hooks(
    target: Any,
    patch: Patch,
    state: PipeFusionState,
    name: str,
    tokens_of: Callable[[dict[str, Any]], int],
    precheck: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Wrap ``target.forward`` (inference check, ``precheck`` of the named arguments, the call's stream and
    patches, the output sent to every rank) and ``cache_context`` (the stream name); clear the buffers at
    ``remove()``. Everything that raises here raises before any communication of the call."""

    def wrap_forward(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            _check_inference(target, name)
            named = named_arguments(type(target).forward, (target, *args), kwargs)
            if precheck is not None:
                precheck(named)
            state.begin(named["hidden_states"], torch.as_tensor(named.get("timestep")), tokens_of(named))
            try:
                out = original(*args, **kwargs)
                _deliver(state, out)
            except BaseException:
                state.abort()
                raise
            state.call = None
            return out

        return forward

    patch.wrap_method(target, "forward", wrap_forward)
    if callable(getattr(target, "cache_context", None)):
        patch.wrap_method(target, "cache_context", _recording_context(state))
    patch.on_remove(target, "pipefusion buffers", state.clear)
    patch.set_attr(target, "_hfpatch_pipefusion", state)


def release_other_blocks(
    target: Any,
    patch: Patch,
    state: PipeFusionState,
    blocks: list[torch.nn.Module],
    own: range,
    containers: tuple[str, ...],
    describe: Callable[[list[int]], str],
) -> None:
    """Release the weights of ``blocks`` outside ``own`` to ``meta`` (keeping every tensor shared with this
    stage's blocks, with the children of ``target`` other than ``containers``, and ``target``'s own
    parameters), and warn at ``remove()`` that they do not come back. ``describe(indices)`` names them."""
    others = [b for i, b in enumerate(blocks) if i not in own]
    source = source_of(target)
    if not others:
        if source is not None:
            load_tensors(target, source)
        return
    keep = {id(t) for i in own for t in (*blocks[i].parameters(), *blocks[i].buffers())}
    keep |= {
        id(t)
        for n, m in target.named_children()
        if n not in containers
        for t in (*m.parameters(), *m.buffers())
    }
    keep |= {id(t) for t in target._parameters.values() if t is not None}
    if source is None:
        state.released_bytes = _release(others, keep)
    else:  # hfpatch.from_pretrained: read this stage's blocks and the unsplit rest, leave the others on meta
        skip = {id(t) for b in others for t in (*b.parameters(), *b.buffers())} - keep
        state.released_bytes = load_tensors(target, source, skip)
    released = describe([i for i in range(len(blocks)) if i not in own])

    def warn_released() -> None:
        warnings.warn(
            f"hfpatch: PipeFusion released the weights of {released} on this rank "
            f"({state.released_bytes} bytes; they are on the meta device now) and cannot restore them: "
            "patch.remove() restored everything else, but those blocks cannot run. Reload the model to run "
            "it unpatched, or apply with pipefusion_release_weights=False to keep every weight.",
            stacklevel=4,
        )

    patch.on_remove(target, "pipefusion released weights", warn_released)


def block_spans(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[str] = []
    for i in indices:
        if spans and int(spans[-1].split("-")[-1]) == i - 1:
            spans[-1] = f"{spans[-1].split('-')[0]}-{i}"
        else:
            spans.append(str(i))
    return ", ".join(spans)


def _recording_context(state: PipeFusionState) -> Callable[[Callable], Callable]:
    """Wrap ``model.cache_context`` so the calls inside it know their stream (name) and ``step_index``."""

    def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        @contextmanager
        def cache_context(name: str, **kwargs: Any) -> Iterator[None]:
            previous, state.context = state.context, (name, kwargs.get("step_index"))
            try:
                with original(name, **kwargs):
                    yield
            finally:
                state.context = previous

        return cache_context

    return wrapper
