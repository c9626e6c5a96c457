"""``hfpatch.from_pretrained`` itself (:mod:`hfpatch.loading` tells the whole load): the snapshot folder
resolved once per node, the pipeline assembled with the models read in part on ``meta`` and the plan ``apply``
will use, the checks every rank shares through one handshake before anything is read (:class:`LoadError`), then
``hfpatch.apply`` reading each rank's part from the files.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from ..core.config import ParallelConfig
from ..core.patch import Patch
from ..distributed import runtime
from ..distributed.agreement import compared_as_files
from ..patches.checkpoint import CheckpointSource, TensorEntry, attach_source, detach_source
from . import files as loading_files
from .gguf_files import mapped_gguf_state_dict
from .models import component_dtype, meta_model, model_components, target_dtypes

__all__ = ["LoadError", "from_pretrained", "meta_pipeline"]

#: safetensors dtype names -> torch dtypes.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
#: The weight file names of each library: (index, single file).
_WEIGHTS = {
    "diffusers": ("diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors"),
    "transformers": ("model.safetensors.index.json", "model.safetensors"),
}


class LoadError(ValueError):
    """``hfpatch.from_pretrained`` cannot load the checkpoint as asked (raised alike on every rank, before any
    collective and before any weight is read)."""


# ----------------------------------------------------------------------------------------------- files
def _snapshot(repo_id: str, revision: str | None, cache_dir: str | None, local_files_only: bool) -> str:
    """The local folder of ``repo_id`` (downloaded unless ``local_files_only``): diffusers' own choice of files."""
    from diffusers import DiffusionPipeline

    return str(
        DiffusionPipeline.download(
            repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
        )
    )


def _node() -> tuple[str, int]:
    """(this node's id, this rank's local rank): torchrun's ``GROUP_RANK`` (else the host name) and ``LOCAL_RANK``."""
    return os.environ.get("GROUP_RANK") or socket.gethostname(), int(os.environ.get("LOCAL_RANK", "0"))


def _download_timeout() -> timedelta:
    text = os.environ.get("HFPATCH_DOWNLOAD_TIMEOUT_S", str(4 * 3600))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"HFPATCH_DOWNLOAD_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return timedelta(seconds=seconds)


def _resolve_folder(
    name: str, revision: str | None, cache_dir: str | None, local_files_only: bool, distributed: bool
) -> str:
    """A local folder as it is; a hub id downloaded once per node (see the module docstring)."""
    if os.path.isdir(name):
        return os.path.abspath(name)
    if not distributed:
        return _snapshot(name, revision, cache_dir, local_files_only)
    import torch.distributed as dist

    store = runtime.default_store()
    node, local_rank = _node()
    count = store.add(f"hfpatch/download/calls/{dist.get_rank()}", 1)
    key = f"hfpatch/download/{count}/{node}"
    if local_rank == 0:
        try:
            folder = _snapshot(name, revision, cache_dir, local_files_only)
        except Exception as exc:
            store.set(key, json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            raise
        store.set(key, json.dumps({"folder": folder}))
        return folder
    timeout = _download_timeout()
    try:
        store.wait([key], timeout)
    except RuntimeError as exc:
        raise runtime.CollectiveError(
            f"hfpatch.from_pretrained: local rank 0 of node {node} did not finish downloading {name} within "
            f"HFPATCH_DOWNLOAD_TIMEOUT_S={timeout.total_seconds():g}s (it may have failed or exited); this rank "
            f"saw: {exc}",
            op="from_pretrained download",
            group=f"node {node}",
            timeout=timeout,
        ) from exc
    posted = json.loads(store.get(key))
    if "error" in posted:
        raise LoadError(f"local rank 0 of this node could not download {name}: {posted['error']}")
    return _snapshot(name, revision, cache_dir, local_files_only=True)  # what local rank 0 put in the cache


def _headers(
    folder: str, library: str
) -> tuple[dict[str, tuple[str, tuple[int, ...], torch.dtype]], list[str]]:
    """Key -> (file, shape, dtype) of a model folder's safetensors weights, and the files, checked: the index's
    files exist and hold the keys it names.

    Raises:
        LoadError: No safetensors weights, a missing file, a key the index names that its file lacks, an
            unknown dtype, or a file safetensors cannot read.
    """
    from safetensors import safe_open

    index_name, single = _WEIGHTS[library]
    index, whole = os.path.join(folder, index_name), os.path.join(folder, single)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted({os.path.join(folder, v) for v in weight_map.values()})
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise LoadError(
                f"{folder}: {index_name} names {len(missing)} file(s) that are missing: {', '.join(missing[:4])}"
                " (an interrupted download or copy?)"
            )
    elif os.path.isfile(whole):
        weight_map, files = {}, [whole]
    else:
        found = sorted(f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".ckpt", ".gguf")))
        raise LoadError(
            f"{folder} has no safetensors weights ({index_name} or {single})"
            + (f"; found {', '.join(found[:3])}" if found else "")
            + ". hfpatch.from_pretrained reads slices of safetensors files only: convert the checkpoint, or load "
            "it with DiffusionPipeline.from_pretrained and pass it to hfpatch.apply"
        )
    keys: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    if view.get_dtype() not in _DTYPES:
                        raise LoadError(
                            f"{path}: tensor {key} has dtype {view.get_dtype()}, unknown to hfpatch"
                        )
                    keys[key] = (path, tuple(view.get_shape()), _DTYPES[view.get_dtype()])
        except LoadError:
            raise
        except Exception as exc:
            raise LoadError(f"{path} cannot be read as safetensors: {type(exc).__name__}: {exc}") from exc
    wrong = [k for k, v in weight_map.items() if keys.get(k, ("",))[0] != os.path.join(folder, v)]
    if wrong:
        raise LoadError(
            f"{folder}: {index_name} places {len(wrong)} tensor(s) in files that do not hold them, e.g. {wrong[0]} "
            f"in {weight_map[wrong[0]]} (the index and the shards come from different saves?)"
        )
    return keys, files


def _source(
    name: str, model: torch.nn.Module, cls: type, library: str, folder: str, dtype: torch.dtype
) -> tuple[CheckpointSource, list[str]]:
    """The :class:`CheckpointSource` of ``model`` (its meta parameters recast to the dtypes the library would
    give them), and the safetensors files it reads.

    Raises:
        LoadError: A quantized checkpoint, a parameter the checkpoint lacks or holds in another shape.
    """
    config = os.path.join(folder, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            quantization = json.load(f).get("quantization_config")
        if quantization:
            method = (
                quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else "unknown"
            )
            raise LoadError(
                f"{name} is a quantized checkpoint (quantization_config: {method}): hfpatch.from_pretrained reads "
                "floating-point weights only, and FSDP2 shards floating-point parameters only. Load it with "
                "DiffusionPipeline.from_pretrained (without shard_weights), or use a floating-point checkpoint"
            )
    keys, files = _headers(folder, library)
    target_of = target_dtypes(model, cls, library, dtype)
    state = model.state_dict(keep_vars=True)
    params = {id(p) for p in model.parameters()}
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for key, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(key)
        tensors[id(tensor)] = tensor
    entries: dict[str, TensorEntry] = {}
    missing, mismatched, quantized = [], [], []
    recast: dict[int, torch.dtype] = {}
    for ident, names in aliases.items():
        tensor = tensors[ident]
        stored = next((n for n in names if n in keys), None)
        if stored is None:
            if ident in params:
                missing.append(names[0])
            continue  # a persistent buffer the checkpoint lacks keeps the value it was built with
        path, shape, file_dtype = keys[stored]
        if shape != tuple(tensor.shape):
            mismatched.append(f"{stored} {list(shape)} (the model has {list(tensor.shape)})")
            continue
        if file_dtype.is_floating_point:
            target = target_of(stored, tensor)
        elif file_dtype == tensor.dtype and ident not in params:
            target = file_dtype  # an integer buffer (position ids)
        else:
            quantized.append(f"{stored} ({str(file_dtype).replace('torch.', '')})")
            continue
        if ident in params and tensor.dtype != target:
            recast[ident] = target
        for alias in names:
            entries[alias] = TensorEntry(path, stored, shape, file_dtype, target)
    if quantized:
        raise LoadError(
            f"{name}: {len(quantized)} parameter(s) are stored as integers, e.g. {quantized[0]}: a quantized "
            "checkpoint, which hfpatch.from_pretrained cannot shard; load it with DiffusionPipeline.from_pretrained"
        )
    if missing or mismatched:
        problems = [f"missing {k}" for k in missing[:3]] + [f"mismatched {k}" for k in mismatched[:3]]
        raise LoadError(
            f"{name} ({cls.__name__}) does not match its checkpoint in {folder}: {len(missing)} parameter(s) "
            f"missing and {len(mismatched)} of another shape ({'; '.join(problems)}). The config and the weights "
            "come from different models or saves"
        )
    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():  # meta parameters in the dtype they will be read in (ties kept)
        for pname, param in list(module._parameters.items()):
            if param is not None and id(param) in recast:
                if id(param) not in replaced:
                    empty = torch.empty(param.shape, dtype=recast[id(param)], device="meta")
                    replaced[id(param)] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
                module._parameters[pname] = replaced[id(param)]
    return CheckpointSource(name, entries), files


# ----------------------------------------------------------------------------------------------- memory
def _available_memory(device: torch.device) -> int | None:
    """Bytes free for this process on ``device``: the GPU's free memory, or for the CPU the node's
    ``MemAvailable`` shared by its ranks (``LOCAL_WORLD_SIZE``); ``None`` when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    return available // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------------------------- the plan
@dataclass
class _Part:
    """A model read in part: its component name, how (``"shard"``: FSDP2 shards; ``"stage"``: PipeFusion),
    the meta model, its source and files."""

    name: str
    mode: str
    model: torch.nn.Module
    source: CheckpointSource
    files: list[str]


@dataclass
class _Load:
    """What this rank found before the handshake."""

    folder: str = ""
    pipeline: Any = None
    parts: list[_Part] = field(default_factory=list)
    config: ParallelConfig | None = None
    digest: str = ""
    files: list[dict[str, Any]] = field(
        default_factory=list
    )  # loading_files.file_identities of the parts' files
    needs: dict[str, int] = field(default_factory=dict)  # device type -> bytes this rank will hold there


def _pipeline_class(folder: str, pipeline_class: Any) -> type:
    import diffusers

    if pipeline_class not in (None, "auto"):
        if isinstance(pipeline_class, str):
            found = getattr(diffusers, pipeline_class, None)
            if found is None:
                raise LoadError(f"pipeline_class={pipeline_class!r} is not a diffusers class")
            return found
        return pipeline_class
    name = diffusers.DiffusionPipeline.load_config(folder).get("_class_name")
    found = getattr(diffusers, name, None) if isinstance(name, str) else None
    if found is None:
        raise LoadError(
            f"{folder}/model_index.json names pipeline class {name!r}, which diffusers does not have; pass "
            "pipeline_class="
        )
    return found


def meta_pipeline(
    folder: str, torch_dtype: Any = None, pipeline_class: Any = None
) -> tuple[Any, dict[str, tuple[type, str]], dict[str, torch.nn.Module]]:
    """The pipeline of ``folder`` with its diffusers and transformers models on the meta device (configs read,
    no weight): ``(pipeline, {name: (class, library)}, {name: meta model})``; the rest (scheduler, tokenizers)
    loads as diffusers loads it.

    Raises:
        LoadError: ``pipeline_class`` or the class ``model_index.json`` names is not a diffusers class.
    """
    cls = _pipeline_class(folder, pipeline_class)
    components = model_components(folder)
    metas = {
        name: meta_model(c, library, os.path.join(folder, name), component_dtype(torch_dtype, name))
        for name, (c, library) in components.items()
    }
    return cls.from_pretrained(folder, **metas), components, metas


def _shard_count(value: Any, config: ParallelConfig) -> int:
    from ..patches.fsdp import shard_axes

    axes = shard_axes(value, config)
    count = 1
    for axis in axes or ():
        count *= getattr(config, axis)
    return count if axes else config.world_size


def _prepare(
    folder: str,
    pipeline_class: Any,
    torch_dtype: Any,
    parallel: Any,
    options: dict[str, Any],
    device: torch.device,
    whole: dict[str, int] | None = None,
    mapped: Collection[str] = (),
) -> _Load:
    """Everything before the handshake (see the module docstring): the plan, the parts, their checks, the
    memory this rank will need and the digest. Reads no weight. ``whole``: the components loaded whole by
    diffusers (quantized at load, or from a single file), with the bytes of their single file (0 when read from the
    folder); ``None`` for none. ``mapped``: those of them read through a mapping (a rank holds its shards of them)."""
    from .. import api
    from ..patches import default_registry
    from ..patches.fsdp import shard_units, sharded_models

    load = _Load(folder=folder)
    skeleton, components, metas = meta_pipeline(folder, torch_dtype, pipeline_class)
    dtypes = {name: component_dtype(torch_dtype, name) for name in components}
    load.config = config = api._plan(skeleton, parallel, options)
    chosen: dict[str, str] = {}
    shard = options.get("shard_weights", False)
    if config.pipefusion > 1:
        if options.get("pipefusion_release_weights", True):
            registry = default_registry()
            for name, model in metas.items():
                families = registry.families_for(model)
                if any("pipefusion_release_weights" in family.options for family in families):
                    chosen[name] = "stage"
    elif shard not in (False, None) and config.world_size > 1:
        chosen = {name: "shard" for name, _ in sharded_models(skeleton) if name in metas}
    whole = whole or {}
    chosen = {name: mode for name, mode in chosen.items() if name not in whole}
    shards = _shard_count(shard, config) if "shard" in chosen.values() else 1
    kept = largest = 0
    for name, mode in chosen.items():
        c, library = components[name]
        source, files = _source(name, metas[name], c, library, os.path.join(folder, name), dtypes[name])
        source.device = device
        load.parts.append(_Part(name, mode, metas[name], source, files))
        sizes = {e.key: e for e in source.entries.values()}.values()
        largest = max([largest, *(e.nbytes for e in sizes)])
        if mode == "shard":
            kept += sum(-(-e.shape[0] // shards) * e.row_bytes if e.shape else e.nbytes for e in sizes)
        else:  # a stage: the unsplit rest, its share of the blocks and at most one block more (uneven stages)
            blocks = [
                sum(p.numel() * p.element_size() for p in u.parameters()) for _, u in shard_units(metas[name])
            ]
            total = sum(e.nbytes for e in sizes)
            kept += total - sum(blocks) + sum(blocks) // config.pipefusion + max(blocks, default=0)
    mapped_shards = _shard_count(shard, config) if shard not in (False, None) and config.world_size > 1 else 1
    # the single files; a mapped one (each rank copies its rows): its share
    loaded = sum(-(-size // mapped_shards) if name in mapped else size for name, size in whole.items())
    for name in components:
        if name not in chosen:
            for root, _, names in os.walk(os.path.join(folder, name)):
                loaded += sum(
                    os.path.getsize(os.path.join(root, f)) for f in names if f.endswith(".safetensors")
                )
    on_gpu = device.type == "cuda" or (
        "shard" in chosen.values()
        and not options.get("shard_weights_offload", False)
        and runtime.launched_world_size() > 1
        and torch.cuda.is_available()
    )
    if on_gpu:
        load.needs = {"cuda": kept, "cpu": loaded + largest}
    else:
        load.needs = {"cpu": kept + loaded + largest}
    files = [f for part in load.parts for f in part.files]
    load.digest = loading_files.revision_digest(folder, files)
    load.files = loading_files.file_identities(folder, files)
    return load


def _memory_problem(needs: dict[str, int]) -> str | None:
    for kind, needed in needs.items():
        device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
        available = _available_memory(device)
        if available is not None and needed > available:
            where = (
                "GPU memory free"
                if kind == "cuda"
                else "host memory available to this rank (MemAvailable / LOCAL_WORLD_SIZE)"
            )
            return (
                f"this rank needs about {_gib(needed)} of {kind} memory for its part of the weights (its shards or "
                f"stage, the components loaded whole and the largest tensor being read), but only {_gib(available)} "
                f"of {where} is there. Use more ranks, shard_weights_offload=True, a smaller torch_dtype, or free "
                "memory"
            )
    return None


def _agree(mine: dict[str, Any], error: Exception | None) -> list[dict[str, Any]]:
    """The handshake: every rank's findings (returned); the same :class:`LoadError` on every rank if any rank
    has a problem or the ranks read different files (by their revision digests)."""
    every = runtime.exchange(
        "from_pretrained",
        mine,
        what="hfpatch.from_pretrained",
        hint="; every rank loads its part of the weights",
    )
    failed: dict[str, list[int]] = {}
    for rank, p in enumerate(every):
        if p["error"]:
            failed.setdefault(p["error"], []).append(rank)
    if failed:
        listing = "\n".join(
            f"  rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {e}" for e, r in failed.items()
        )
        raise LoadError(
            f"hfpatch.from_pretrained: {sum(map(len, failed.values()))} of {len(every)} ranks cannot load the "
            f"checkpoint; nothing was loaded on any rank:\n{listing}"
        ) from error
    digests: dict[tuple[str, str], list[int]] = {}
    for rank, p in enumerate(every):
        digests.setdefault((p["digest"], p["folder"]), []).append(rank)
    if len({d for d, _ in digests}) > 1:
        listing = "\n".join(
            f"  rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {folder} (digest {d})"
            for (d, folder), r in digests.items()
        )
        raise LoadError(
            "hfpatch.from_pretrained: the ranks read different checkpoints (their files differ: another "
            "revision, or a copy that differs on some node); nothing was loaded on any rank:\n"
            f"{listing}\nPoint every rank at the same revision (pass revision=, or sync the copies)"
        )
    return every


# ----------------------------------------------------------------------------------------------- entry point
def from_pretrained(
    pretrained_model_name_or_path: str | os.PathLike,
    parallel: int | ParallelConfig | None = None,
    *,
    pipeline_class: type | str | None = None,
    torch_dtype: torch.dtype | dict[str, torch.dtype] | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    device: str | torch.device | None = None,
    prepare: Callable[[Any], None] | None = None,
    check_files: str = "full",
    quantization_config: Any = None,
    single_files: Mapping[str, str | os.PathLike] | None = None,
    **options: Any,
) -> tuple[Any, Patch]:
    """Load a diffusers pipeline and patch it, each rank reading only the weights it keeps.

    What ``DiffusionPipeline.from_pretrained(path, torch_dtype=...)`` followed by ``hfpatch.apply(pipe,
    parallel, **options)`` gives, bit for bit, without any rank holding the weights it does not keep: with
    ``shard_weights``, each rank reads only its FSDP2 shards of the denoisers and transformers encoders; under
    PipeFusion, only its stage's blocks (see :mod:`hfpatch.loading`). Without either, it is exactly those two
    calls. Every rank must call it with the same arguments.

    Args:
        pretrained_model_name_or_path: A local diffusers folder (``model_index.json`` and one folder per
            component, the models' weights in safetensors: one file or an index and its shards) or a hub id
            (downloaded once per node).
        parallel: As in :func:`hfpatch.apply`.
        pipeline_class: The pipeline class, or its diffusers name; ``None``/``"auto"``: ``model_index.json``'s.
        torch_dtype: As in diffusers (a dtype, or a dict of component name -> dtype with ``"default"``).
        revision: The hub revision.
        cache_dir: The hub cache.
        local_files_only: Use the cache only (no network).
        device: Where weights read whole go (PipeFusion's stage); default the CPU. Shards go where FSDP2 keeps
            them (the process group's device, or the CPU with ``shard_weights_offload``); the components
            loaded the usual way stay on the CPU, as with diffusers.
        prepare: Called with the pipeline after it is assembled and before ``hfpatch.apply`` (to enable a
            cache or an attention backend); the models read in part are still on ``meta`` then.
        check_files: How the ranks' files are compared before anything is read (several ranks only):
            ``"full"`` (default), the sha256 of every byte of every safetensors file read in part, computed
            once per node (the node's ranks split the files: one more read of the checkpoint per node);
            ``"sampled"``, an opt-out that compares each file's size, header and three 4 KiB windows only: a
            copy that differs elsewhere on some rank (a partial rsync, a re-saved shard) then loads silently and
            generates from mixed weights.
        quantization_config: A diffusers ``PipelineQuantizationConfig`` (or a model's quantization config), as
            ``DiffusionPipeline.from_pretrained`` takes it: the components it quantizes are loaded whole on every
            rank by diffusers (quantized at load), then ``hfpatch.apply`` runs (with ``shard_weights``, their
            quantized rows are sharded after loading where the kind splits by rows:
            :doc:`/capabilities/quantized`).
        single_files: Component name -> a single-file checkpoint of it, as diffusers' ``from_single_file`` takes
            it (``{"transformer": "wan2.1-t2v-14b-Q8_0.gguf"}``): a ``.gguf`` file is loaded with
            ``GGUFQuantizationConfig`` (computing in ``torch_dtype``, fp32 by default), other files as they are,
            the config from the folder's component; loaded whole on every rank, then passed to the pipeline.
            With ``shard_weights`` on several ranks a ``.gguf`` file is read through a mapping instead
            (:mod:`hfpatch.loading.gguf_files`: each rank copies only the rows it keeps) and compared over the
            ranks as a file (``check_files="full"``).
        **options: :func:`hfpatch.apply`'s options (``shard_weights=True``, ``shard_weights_offload``, ...).

    Returns:
        ``(pipe, patch)``: the pipeline, patched, and the :class:`~hfpatch.Patch` that undoes it
        (``patch.remove()`` gathers the full weights back on every rank).

    Raises:
        LoadError: (a ``ValueError``) The checkpoint cannot be loaded as asked: a missing or inconsistent
            file, a model that does not match its weights, a quantized checkpoint, too little memory for this
            rank's part, or ranks that read different files. Raised alike on every rank before any collective.
        TypeError, ValueError: As :func:`hfpatch.apply` (an unknown option, degrees that do not fit).
        CollectiveError: A rank did not take part within ``HFPATCH_TIMEOUT_S`` (the download wait:
            ``HFPATCH_DOWNLOAD_TIMEOUT_S``).

    >>> import tempfile, torch, hfpatch
    >>> from hfpatch.testing import tiny_flux_pipe_with_text_encoders
    >>> folder = tempfile.mkdtemp()
    >>> tiny_flux_pipe_with_text_encoders().save_pretrained(folder)
    >>> pipe, patch = hfpatch.from_pretrained(folder, parallel=1)   # one process: the two calls, nothing split
    >>> type(pipe).__name__, patch.plan.world_size
    ('FluxPipeline', 1)
    """
    if not isinstance(local_files_only, bool):
        raise TypeError(f"local_files_only must be True or False, got {local_files_only!r}")
    dtypes = list(torch_dtype.values()) if isinstance(torch_dtype, dict) else [torch_dtype]
    if not all(d is None or (isinstance(d, torch.dtype) and d.is_floating_point) for d in dtypes):
        raise TypeError(
            f"torch_dtype must be a floating-point torch.dtype or a dict of them, got {torch_dtype!r}"
        )
    if check_files not in ("full", "sampled"):
        raise ValueError(f'check_files must be "full" or "sampled", got {check_files!r}')
    if prepare is not None and not callable(prepare):
        raise TypeError(f"prepare must be a callable taking the pipeline, got {prepare!r}")
    target_device = torch.device("cpu" if device is None else device)
    if single_files is not None and not (
        isinstance(single_files, Mapping)
        and all(isinstance(k, str) and isinstance(v, (str, os.PathLike)) for k, v in single_files.items())
    ):
        raise TypeError(f"single_files must map component names to file paths, got {single_files!r}")
    world = runtime.launched_world_size()
    distributed = world > 1 and parallel != 1
    if distributed:
        runtime.ensure_process_group(world)
    load: _Load | None = None
    error: Exception | None = None
    mapped: dict[str, str] = {}
    folder = str(pretrained_model_name_or_path)
    try:
        folder = _resolve_folder(
            folder, revision, None if cache_dir is None else str(cache_dir), local_files_only, distributed
        )
        whole = _loaded_whole(folder, quantization_config, single_files)
        mapped = _mapped_single_files(single_files, options, distributed, check_files)
        load = _prepare(folder, pipeline_class, torch_dtype, parallel, options, target_device, whole, mapped)
        for name, path in mapped.items():  # compared whole over the ranks: their weights are not digested
            load.files += [
                {**f, "path": f"single_files[{name!r}]"}
                for f in loading_files.file_identities(folder, [path])
            ]
        problem = _memory_problem(load.needs)
        if problem is not None:
            raise LoadError(problem)
    except runtime.CollectiveError:
        raise
    except Exception as exc:  # told to the other ranks first, then raised alike everywhere
        error = exc
    if distributed:
        mine = {
            "folder": folder,
            "digest": load.digest if load is not None else "",
            "files": load.files if load is not None else [],
            "error": None if error is None else f"{type(error).__name__}: {error}",
        }
        every = _agree(mine, error)
        problem = loading_files.agree_contents([p["files"] for p in every]) if check_files == "full" else None
        if problem is not None:
            raise LoadError(problem)
    elif error is not None:
        raise error
    assert load is not None
    extra, regions = _whole_components(load.folder, torch_dtype, quantization_config, single_files, mapped)
    with compared_as_files(regions):
        return _load(load, pipeline_class, torch_dtype, parallel, prepare, options, extra)


def _mapped_single_files(
    single_files: Mapping[str, Any] | None, options: dict[str, Any], distributed: bool, check_files: str
) -> dict[str, str]:
    """The ``.gguf`` single files read through a mapping of the file (:mod:`hfpatch.loading.gguf_files`: each
    rank copies only the rows it keeps): with ``shard_weights`` on several ranks and the files compared whole
    (``check_files="full"``, which then stands for the weight check of their tensors)."""
    if not distributed or options.get("shard_weights") in (None, False) or check_files != "full":
        return {}
    paths = {name: os.fspath(path) for name, path in (single_files or {}).items()}
    return {name: path for name, path in paths.items() if path.endswith(".gguf")}


def _loaded_whole(folder: str, quantization_config: Any, single_files: Any) -> dict[str, int]:
    """The components diffusers loads whole (every model component with a ``quantization_config``: diffusers
    quantizes while loading; each single file) -> the bytes of its single file (0: read from the folder).

    Raises:
        LoadError: A single file that is not there, or a component the folder does not have.
    """
    whole: dict[str, int] = {}
    if quantization_config is not None:
        whole.update({name: 0 for name in model_components(folder)})
    with open(os.path.join(folder, "model_index.json")) as f:
        names = json.load(f)
    for name, path in (single_files or {}).items():
        if name not in names or name.startswith("_"):
            raise LoadError(f"single_files names {name!r}, which is not a component of {folder}")
        if not os.path.isfile(path):
            raise LoadError(f"single_files[{name!r}]: {os.fspath(path)} is not a file")
        whole[name] = os.path.getsize(path)
    return whole


def _whole_components(
    folder: str, torch_dtype: Any, quantization_config: Any, single_files: Any, mapped: Mapping[str, str]
) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """The ``from_pretrained`` arguments of what diffusers loads whole: ``quantization_config`` and each single
    file's component, loaded with its class's ``from_single_file`` (a ``.gguf`` with ``GGUFQuantizationConfig``);
    and the address ranges of the ``mapped`` files' mappings (their state dicts: :func:`mapped_gguf_state_dict`)."""
    extra: dict[str, Any] = {}
    regions: list[tuple[int, int]] = []
    if quantization_config is not None:
        extra["quantization_config"] = quantization_config
    components = model_components(folder)
    for name, path in (single_files or {}).items():
        cls = components[name][0] if name in components else None
        if cls is None or not hasattr(cls, "from_single_file"):
            raise LoadError(
                f"single_files[{name!r}]: its class cannot load a single file (no from_single_file)"
            )
        dtype = component_dtype(torch_dtype, name)
        kwargs: dict[str, Any] = {"config": folder, "subfolder": name}
        if dtype is not None:
            kwargs["torch_dtype"] = dtype
        if os.fspath(path).endswith(".gguf"):
            from diffusers import GGUFQuantizationConfig

            compute = dtype or torch.float32
            kwargs.update(
                quantization_config=GGUFQuantizationConfig(compute_dtype=compute), torch_dtype=compute
            )
        checkpoint: Any = os.fspath(path)
        if name in mapped:
            checkpoint, region = mapped_gguf_state_dict(checkpoint)
            regions.append(region)
        extra[name] = cls.from_single_file(checkpoint, **kwargs)
    return extra, regions


def _load(
    load: _Load,
    pipeline_class: Any,
    torch_dtype: Any,
    parallel: Any,
    prepare: Callable[[Any], None] | None,
    options: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> tuple[Any, Patch]:
    """Assemble the pipeline (the parts on meta with their sources, the rest loaded the usual way, ``extra``:
    components loaded whole and ``quantization_config``) and apply."""
    from ..api import apply

    cls = _pipeline_class(load.folder, pipeline_class)
    kwargs = {} if torch_dtype is None else {"torch_dtype": torch_dtype}
    kwargs.update(extra or {})
    pipe = cls.from_pretrained(load.folder, **kwargs, **{part.name: part.model for part in load.parts})
    for part in load.parts:
        attach_source(part.model, part.source)
    try:
        if prepare is not None:
            prepare(pipe)
            lora = [p.name for p in load.parts if any("lora_" in n for n, _ in p.model.named_parameters())]
            if lora:
                raise LoadError(
                    f"prepare() added LoRA layers to {', '.join(lora)}, whose weights hfpatch.from_pretrained has not "
                    "read yet (they are read while hfpatch.apply splits them): call pipe.load_lora_weights after "
                    "hfpatch.from_pretrained returns instead"
                )
        patch = apply(pipe, parallel, **options)
    finally:
        for part in load.parts:
            detach_source(part.model)
    for part in load.parts:
        if part.mode == "shard":
            left = [n for n, t in [*part.model.named_parameters(), *part.model.named_buffers()] if t.is_meta]
            if left:
                patch.remove()
                raise RuntimeError(f"hfpatch: {part.name}.{left[0]} was not read from the checkpoint")
    return pipe, patch
