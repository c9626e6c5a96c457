"""Weights sharded over ranks with FSDP2 (``hfpatch.apply(..., shard_weights=True)``), for inference.

Sequence, CFG and data parallelism divide the *activations*; every rank still holds every weight. With
``shard_weights=True`` each transformer (Wan 2.2's ``transformer_2`` too) and each text/image encoder of a
pipeline is sharded with torch's FSDP2 (:func:`torch.distributed.fsdp.fully_shard`, DTensor parameters on a
1-D :class:`~torch.distributed.device_mesh.DeviceMesh`): each rank keeps ``1/N`` of every parameter, and a
block's parameters are all-gathered just before it runs and freed after it (``reshard_after_forward=True``
for every unit, the root included). On CUDA, FSDP2 runs its all-gathers on a separate stream, so block
``i + 1``'s gather overlaps block ``i``'s kernels when the CPU runs ahead (FSDP2's implicit forward
prefetch; up to two blocks are then gathered at once).

**Units.** The blocks a model names in ``_no_split_modules`` / ``_repeated_blocks`` (diffusers and
transformers both declare them; the outermost match, e.g. ``WanTransformerBlock``, ``UMT5Block``) each
become one FSDP unit; everything else (embeddings, norms, the output projection) is the root unit, gathered
for the whole forward. A block whose parameters are tied to a module outside it stays in the root (FSDP
needs a tied parameter in one unit). Without those attributes, the elements of the model's
``nn.ModuleList`` s are the units (:func:`shard_units`).

**Which ranks share a weight.** The ranks of an FSDP group must run the model's forwards in the same order,
because each block's all-gather is a collective. Sequence parallelism, data parallelism and batched CFG
compute every transformer call on every rank; under two-call CFG parallelism (``WanPipeline``, true CFG of
Flux/QwenImage/HunyuanVideo) the pipeline family runs both cfg branches in the uncond call when the weights
are sharded (:mod:`hfpatch.patches.pipeline`), and every rank runs the encoders in step. So
``shard_weights=True`` shards over every rank of the plan, cfg ranks included. A mesh axis name or a tuple
of them (``shard_weights=("ring", "ulysses")``, or ``"sp"``) shards over those axes only (e.g. within a
node, whose ranks the innermost axes hold) and replicates over the others; inference needs no traffic
between replicas.

**Restoring.** ``patch.remove()`` all-gathers every parameter back and restores the model exactly: the
original ``nn.Parameter`` objects (their data was released while sharded) with their full values, each
module's class (FSDP2 swaps it for an ``FSDP<Class>`` subclass), and every attribute, hook and
``torch.distributed`` composable-API entry ``fully_shard`` added. That is a collective: call
``patch.remove()`` on every rank, before the process group is destroyed. ``patch.disabled()`` cannot run a
sharded model (a rank alone holds ``1/N`` of it) and says so.

**Offload.** ``shard_weights_offload=True`` gives FSDP2 a ``CPUOffloadPolicy``: every rank keeps its shards
in (pinned, on CUDA) CPU memory and copies one block at a time to the accelerator when gathering it. That is
the composition that works for an idle expert (Wan 2.2's ``transformer_2`` in the high-noise steps): its
shards wait in CPU memory. diffusers' model/sequential CPU offload and group offloading move whole modules
or their parameters themselves, which FSDP2's DTensor parameters do not support: they are refused.

What is sharded and over which ranks, and the byte counters, are :mod:`hfpatch.patches.fsdp.units`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ...core.config import ParallelConfig
from ...core.patch import Patch
from ...core.registry import PatchFamily, class_key
from ...distributed import runtime
from ..checkpoint import CheckpointSource, shard_rows, source_of
from .quantized import QuantizedRows, refusal, row_sharded
from .saving import compact, install_sharded_save
from .units import shard_axes, shard_units

__all__ = ["SHARD_OPTIONS", "WeightSharding"]

#: Options of :class:`WeightSharding` (``check_inputs`` is shared with the other families: same default).
SHARD_OPTIONS: dict[str, Any] = {"shard_weights": False, "shard_weights_offload": False, "check_inputs": True}


def _is_class(obj: Any, key: str) -> bool:
    return any(class_key(c) == key for c in type(obj).__mro__)


_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ParallelMesh -> {axes: DeviceMesh}


def _shard_mesh(mesh: Any, axes: tuple[str, ...]) -> Any:
    """The 1-D DeviceMesh of this rank's shard group: the ranks that differ only along ``axes`` (every rank
    of the plan when ``axes`` is empty). Its process group is hfpatch's own, with ``HFPATCH_TIMEOUT_S``;
    one per mesh and axes (creating it is a collective of every rank)."""
    from torch.distributed.device_mesh import DeviceMesh

    cache = _GROUPS.setdefault(mesh, {})
    if axes in cache:
        return cache[axes]
    name = "shard_weights (" + (" x ".join(axes) or "all ranks") + ")"
    try:
        group = runtime.axis_group(name, runtime.axis_ranks(mesh.config, axes))
    except RuntimeError as exc:
        if not runtime.is_peer_failure(exc):
            raise
        raise runtime.collective_error("creating the shard_weights groups", None, exc) from exc
    device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    device_mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))
    cache[axes] = device_mesh
    return device_mesh


# ----------------------------------------------------------------------------------------------- checks
def _offload_hooks(model: torch.nn.Module) -> list[str]:
    """Submodules under an accelerate hook (model/sequential CPU offload, ``device_map``) or diffusers'
    group offloading: they move weights themselves, which FSDP2's DTensor parameters do not support."""
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "_hf_hook"):
            found.append(f"{name or '<root>'} (accelerate hook {type(module._hf_hook).__name__})")
        registry = getattr(module, "_diffusers_hook", None)
        hooks = getattr(registry, "hooks", {}) if registry is not None else {}
        offload = [h for h in hooks if "offload" in str(h)]
        if offload:
            found.append(f"{name or '<root>'} (diffusers hook {offload[0]})")
    return found


def _communication_device() -> str:
    """Device type the process group communicates on: that of the default group, or the one ``hfpatch.apply``
    will initialise (NCCL on CUDA, gloo on CPU)."""
    if dist.is_available() and dist.is_initialized():
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_model(model: torch.nn.Module, name: str, backend_device: str) -> None:
    """Raise ``ValueError`` when ``model`` cannot be sharded (checked on every rank before any change)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    if not params:
        raise ValueError(f"shard_weights: {name} has no parameters to shard")
    if isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            f"shard_weights: {name} is already sharded (FSDP/DTensor parameters); apply hfpatch to the unsharded "
            "model, or drop shard_weights and keep your own fully_shard"
        )
    hooked = _offload_hooks(model)
    if hooked:
        raise ValueError(
            f"shard_weights cannot shard {name}: {hooked[0]} moves its weights between devices itself "
            "(enable_model_cpu_offload, enable_sequential_cpu_offload, enable_group_offload or a device_map), "
            "which FSDP2's sharded DTensor parameters do not support. Remove the offload (pipe.remove_all_hooks() "
            "or reload without it) and use shard_weights_offload=True: each rank then keeps its 1/N shards in "
            "CPU memory and copies one block at a time to the GPU"
        )
    devices = {t.device.type for t in [*params, *model.buffers()]}
    if source_of(model) is not None:
        devices.discard("meta")  # hfpatch.from_pretrained: each rank reads its shards from the checkpoint
    if "meta" in devices:
        raise ValueError(
            f"shard_weights: {name} has parameters or buffers on the meta device; load its weights before "
            "hfpatch.apply (or load it with hfpatch.from_pretrained, which reads only this rank's shards)"
        )
    unexpected = devices - {"cpu", backend_device}
    if unexpected:
        raise ValueError(
            f"shard_weights: {name} has tensors on {sorted(unexpected)}, but the process group communicates on "
            f"{backend_device}; move the model to {backend_device} (or keep it on the CPU) before hfpatch.apply"
        )
    refused = refusal(model, name)
    if refused is not None:
        raise ValueError(refused)
    rows = {id(p) for _, _, p, _ in row_sharded(model)}  # quantized, sharded by rows (.quantized)
    bad = sorted(
        {str(p.dtype) for p in params if id(p) not in rows and not (p.is_floating_point() or p.is_complex())}
    )
    if bad:
        raise ValueError(
            f"shard_weights: {name} has parameters of dtype {', '.join(bad)} (quantized weights?); FSDP2 shards "
            "floating-point parameters only"
        )


def sharded_models(target: Any) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of what ``shard_weights`` shards in ``target``: a pipeline's denoisers and its
    transformers-library encoders (text, image), by component name, or ``[(class name, target)]`` for a model.

    >>> from hfpatch.testing import tiny_flux_pipe_with_text_encoders
    >>> [name for name, _ in sharded_models(tiny_flux_pipe_with_text_encoders())]
    ['text_encoder', 'text_encoder_2', 'transformer']
    """
    if not _is_class(target, "diffusers.DiffusionPipeline"):
        return [(type(target).__name__, target)]
    from ..denoisers import pipeline_denoisers

    denoisers = pipeline_denoisers(target)
    found: list[tuple[str, torch.nn.Module]] = []
    for key, component in target.components.items():
        if not isinstance(component, torch.nn.Module) or any(component is m for _, m in found):
            continue
        if any(component is d for d in denoisers) or _is_class(component, "transformers.PreTrainedModel"):
            found.append((key, component))
    return found


# ----------------------------------------------------------------------------------------------- shard / restore
@dataclass
class _Sharded:
    """What :func:`_shard` changed on one model, so that :meth:`restore` can undo it exactly."""

    model: torch.nn.Module
    mesh: Any
    units: list[torch.nn.Module]  # every module fully_shard was applied to; the root last
    classes: list[type]  # their classes before
    slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.device]] = field(default_factory=list)
    buffers: list[tuple[torch.Tensor, torch.device]] = field(default_factory=list)
    # (object, attribute) added by fully_shard -> its value; (dict, key) added to an existing dict -> value
    added_attrs: list[tuple[Any, str, Any]] = field(default_factory=list)
    added_items: list[tuple[dict, Any, Any]] = field(default_factory=list)
    quantized: QuantizedRows | None = None  # the quantized weights sharded by rows, outside FSDP2

    def restore(self) -> None:
        """All-gather every parameter and put the model back as it was (a collective over the shard group)."""
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.tensor import DTensor

        if self.quantized is not None:
            self.quantized.restore()
        for unit in self.units:
            unit.reshard()  # a forward that raised may have left a unit gathered
        full: dict[int, torch.Tensor] = {}
        for module, name, _, device in self.slots:
            current = module._parameters.get(name)
            if isinstance(current, DTensor) and id(current) not in full:
                full[id(current)] = _full_tensor(current, self.mesh).to(device)
        loaded: dict[int, torch.nn.Parameter] = {}  # a model read from a checkpoint: meta original -> new one
        for module, name, original, _ in self.slots:
            current = module._parameters.get(name)
            if id(current) not in full:
                continue
            if (
                original.is_meta
            ):  # never held data (hfpatch.from_pretrained): a new parameter, tied ones shared
                if id(original) not in loaded:
                    loaded[id(original)] = torch.nn.Parameter(
                        full[id(current)], requires_grad=current.requires_grad
                    )
                module._parameters[name] = loaded[id(original)]
                continue
            with torch.no_grad():
                original.data = full[id(current)]
            original.requires_grad_(current.requires_grad)
            module._parameters[name] = original
        for tensor, device in self.buffers:
            if tensor.device != device:
                tensor.data = tensor.data.to(device)
        for container, key, value in reversed(self.added_items):
            if container.get(key, None) is value:
                del container[key]
        for obj, name, value in reversed(self.added_attrs):
            if obj.__dict__.get(name, None) is value:
                del obj.__dict__[name]
        for unit, cls in zip(self.units, self.classes):
            unit.__class__ = cls
            _module_state_mapping.pop(unit, None)


def _full_tensor(param: Any, mesh: Any) -> torch.Tensor:
    """The full value of an FSDP2 parameter (all-gathered on the mesh's device; offloaded shards too)."""
    from torch.distributed.tensor import DTensor

    local = param.to_local()
    device = (
        torch.device("cpu")
        if mesh.device_type == "cpu"
        else torch.device(mesh.device_type, torch.cuda.current_device())
    )
    if local.device != device:
        local = local.to(device)
    whole = DTensor.from_local(
        local, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    ).full_tensor()
    return compact(whole)


def _snapshot(modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, dict, dict[str, dict]]]:
    """For each module: its ``__dict__`` (shallow) and a shallow copy of every dict held in it."""
    return [
        (m, dict(m.__dict__), {k: dict(v) for k, v in m.__dict__.items() if isinstance(v, dict)})
        for m in modules
    ]


def _shard(model: torch.nn.Module, mesh: Any, offload: bool, record: list[_Sharded]) -> None:
    """``fully_shard`` the units of ``model``, then the model itself; append to ``record`` (first, so that a
    failure half-way can be undone too) what :meth:`_Sharded.restore` needs to undo it."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    modules = list(model.modules())
    before = _snapshot(modules)
    source = source_of(model)
    device = _shard_device(mesh, offload)
    slots = [  # a parameter read from a checkpoint is on meta until now: remove() puts it on the shards' device
        (module, name, param, device if param.is_meta else param.device)
        for module in modules
        for name, param in module._parameters.items()
        if param is not None
    ]
    buffers = list({id(b): (b, b.device) for b in model.buffers() if not b.is_meta}.values())
    sharded = _Sharded(model, mesh, [], [], slots, buffers)
    record.append(sharded)
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    units = [m for _, m in shard_units(model)] + [model]
    quantized = QuantizedRows(model, units, mesh.get_group(), device)
    ignored = quantized.params or None  # sharded by rows below, not by FSDP2
    try:
        for unit in units:
            cls = type(unit)
            fully_shard(
                unit, mesh=mesh, reshard_after_forward=True, offload_policy=policy, ignored_params=ignored
            )
            sharded.units.append(unit)
            sharded.classes.append(cls)
            if source is None:
                _release(
                    slots
                )  # unit by unit: a model on the CPU never has more than one unit whole on the GPU
        if source is not None:
            _fill_shards(model, source, mesh, device)
        if quantized.units:
            sharded.quantized = quantized
            quantized.shard()
        # The root's forward hooks become a wrapper of its forward (WeightSharding._shard_one): hfpatch's
        # pre-hooks (same-input checks) then run before the first all-gather, and a pipeline's CFG wrapper
        # calls it only where the transformer computes.
        state = fully_shard.state(model)
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
    finally:
        for module, attrs, dicts in before:
            for name, value in module.__dict__.items():
                if name not in attrs:
                    sharded.added_attrs.append((module, name, value))
                elif name in dicts:
                    sharded.added_items += [(value, k, v) for k, v in value.items() if k not in dicts[name]]


def _shard_device(mesh: Any, offload: bool) -> torch.device:
    """Where FSDP2 keeps the shards: the mesh's device (the current CUDA device under NCCL), the CPU with
    ``shard_weights_offload``."""
    if offload or mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.cuda.current_device())


def _fill_shards(model: torch.nn.Module, source: CheckpointSource, mesh: Any, device: torch.device) -> None:
    """Give a model sharded on ``meta`` (built by ``hfpatch.from_pretrained``) its local shards, read from the
    checkpoint: FSDP2 allocates them (``to_empty``: each padded to ``ceil(rows / N)`` rows as FSDP2 pads, the
    padding zeros), then each is filled with the rows :func:`~hfpatch.patches.checkpoint.shard_rows` gives this
    rank, read from the file alone. The shards are then the very ones sharding the whole model would give (the
    same rows, the same padding), and no rank holds more than its shards plus one slice being read. Buffers
    keep their values (computed at construction), those the checkpoint holds are read whole."""
    kept = [
        (m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta
    ]
    model.to_empty(device=device)  # FSDPModule._apply re-pads each local shard (reset_sharded_param)
    for module, name, buffer in kept:
        module._buffers[name] = buffer
    rank, world = mesh.get_local_rank(), mesh.size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local()
            shape = source.entries[name].shape
            start, stop = shard_rows(shape[0], world, rank) if shape else (0, 1)
            if tuple(local.shape) != ((stop - start, *shape[1:]) if shape else ()):
                raise RuntimeError(
                    f"hfpatch: FSDP2 gave rank {rank} of {world} a shard of shape {tuple(local.shape)} of "
                    f"{source.name}.{name} {tuple(shape)}, not rows [{start}, {stop}) of dim 0: this torch's FSDP2 "
                    "shards differently from what hfpatch.from_pretrained reads. Load the model whole "
                    "(DiffusionPipeline.from_pretrained) and pass it to hfpatch.apply"
                )
            if local.numel():  # into the shard itself (no temporary) where it is on the CPU
                source.read_rows(name, start, stop, out=local) if shape else source.read_rows(name, out=local)
        for module_name, module in model.named_modules():
            for name, buffer in list(module._buffers.items()):
                full = f"{module_name}.{name}" if module_name else name
                if buffer is not None and full in source.entries:
                    module._buffers[name] = source.read_rows(full).to(device)


def _release(slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.device]]) -> None:
    """Free the full data of the original parameters FSDP2 has replaced (its shards are its own storage;
    ``remove()`` gives the originals their full values back)."""
    for module, name, original, _ in slots:
        if module._parameters.get(name) is not original and original.numel():
            with torch.no_grad():
                original.data = torch.empty(0, dtype=original.dtype, device=original.device)


def _copy_views(value: Any) -> Any:
    """``value`` (a tensor, or a model output: tuple, list, dict, ``BaseOutput``/``ModelOutput``, in place) with each
    tensor that requires grad and is a VIEW replaced by a copy, while autograd records.

    FSDP2 hooks its pre-backward (the all-gather of a unit's weights before its backward) on the root's output
    tensors. Stock output reshaping returns views (Wan's ``unflatten``/``permute``/``flatten`` chain, and
    hfpatch's sequence gather, a ``narrow``), and an in-place op on a view (``pred += x``) rebases it onto
    its base and drops that hook without a word: torch only warns that it might happen. A copy is not a view,
    so an in-place op on the output keeps the hook. Costs one output-sized copy per training forward (the
    view's base is freed with it); nothing under ``no_grad``.
    """
    if isinstance(value, torch.Tensor):
        return value.clone() if value.requires_grad and value._base is not None else value
    if isinstance(value, dict):  # diffusers' BaseOutput and transformers' ModelOutput set the attribute too
        for key, item in list(value.items()):
            copied = _copy_views(item)
            if copied is not item:
                value[key] = copied
        return value
    if isinstance(value, (tuple, list)):
        items = [_copy_views(item) for item in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _root_forward(model: torch.nn.Module, state: Any, group: Any, patch: Patch, label: str) -> Any:
    """A wrapper of ``model.forward`` that runs FSDP2's root pre- and post-forward around it (what the root's
    module hooks did), refuses to run inside ``patch.disabled()``, resets FSDP2's per-call state when the
    forward raises (the patch stays usable) and names a peer's failure as :class:`CollectiveError`."""
    from ...core.patch import get_patch

    def wrapper(original: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            own = get_patch(model)
            if patch.is_disabled or (own is not None and own.is_disabled):
                raise RuntimeError(
                    f"hfpatch: {label} has its weights sharded over ranks (shard_weights=True): this rank holds "
                    "1/N of them, so patch.disabled() cannot run it unpatched on some ranks alone. Run the patched "
                    "model on every rank (its output is the unpatched one), or call patch.remove() on every rank "
                    "to get the full weights back"
                )
            try:
                args, kwargs = state._pre_forward(model, args, kwargs)
                output = original(*args, **kwargs)
                return state._post_forward(model, args, _copy_views(output))
            except Exception as exc:
                try:
                    model.reset_iter_state()  # free what this call gathered; the next call starts afresh
                except Exception as reset_error:  # keep the first error; say the reset failed too
                    exc.add_note(f"hfpatch: resetting FSDP2's state of {label} also failed: {reset_error!r}")
                if runtime.is_peer_failure(exc):
                    raise runtime.collective_error(
                        f"the shard_weights all-gather of {label}", group, exc
                    ) from exc
                raise

        return forward

    return wrapper


# ----------------------------------------------------------------------------------------------- family
class WeightSharding(PatchFamily):
    """``shard_weights``: FSDP2 over the plan's ranks for a pipeline's transformers and encoders, or a model.

    Registered for ``DiffusionPipeline`` (before the CFG/data-parallel family, whose wrapper then calls the
    sharded forward only where the transformer computes) and for every DiT class hfpatch parallelises (a
    transformer applied on its own). Inside a pipeline, the pipeline's entry shards every denoiser and encoder
    (one place); the components' entries do nothing. ``hfpatch.apply`` has compared every rank's weights
    before (FSDP2 keeps each rank's slice of its own copy, so they must be equal).

    Options:
        shard_weights: ``False`` (default), ``True``, or the mesh axes to shard over (see :func:`shard_axes`).
        shard_weights_offload: Keep the shards in CPU memory (FSDP2 ``CPUOffloadPolicy``).
        check_inputs: ``False`` also skips ``apply``'s same-weights check (shared with the other families).
    """

    name: ClassVar[str] = "shard_weights"
    role: ClassVar[str] = "model"
    options: ClassVar[dict[str, Any]] = SHARD_OPTIONS

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        value, offload = options["shard_weights"], options["shard_weights_offload"]
        if not isinstance(offload, bool):
            raise ValueError(f"shard_weights_offload must be True or False, got {offload!r}")
        if value is False or value is None:
            if offload:
                raise ValueError(
                    "shard_weights_offload=True offloads sharded weights: it needs shard_weights"
                )
            return
        if config.world_size == 1:
            raise ValueError(
                f"shard_weights shards weights over ranks, but the plan {config} runs on one rank; launch several "
                "ranks (torchrun --nproc-per-node N) and pass parallel=N"
            )
        models = sharded_models(target)
        if not models:
            raise ValueError(
                f"shard_weights: {type(target).__name__} has no denoiser or transformers encoder to shard (it "
                "shards a pipeline's transformer/transformer_2/unet and text or image encoders)"
            )
        device = _communication_device()
        for name, model in models:
            shard_axes(value, config, name=name)
            _check_model(model, name, device)

    def apply(self, target: Any, patch: Patch, mesh: Any, options: dict[str, Any]) -> None:
        value = options["shard_weights"]
        if value is False or value is None or patch.part_of is not None:
            return  # off; or a pipeline's component: the pipeline's own entry shards it
        models = sharded_models(target)
        world = mesh.group("world")
        # Every rank's weights were compared by hfpatch.apply before any family applied (FSDP2 keeps each
        # rank's slice of ITS OWN copy: different weights would make the sharded model a silent mixture).
        quantized = []
        for name, model in models:
            axes = shard_axes(value, mesh.config, name=name)
            device_mesh = _shard_mesh(mesh, axes)
            if self._shard_one(model, name, device_mesh, patch, options["shard_weights_offload"], world):
                quantized.append(name)
        if _is_class(target, "diffusers.DiffusionPipeline"):
            if quantized:
                _refuse_quantized_save(target, patch, quantized[0])
            else:
                install_sharded_save(
                    patch, target, [model for _, model in models], world, type(target).__name__
                )
            offload = ("enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload")
            _refuse_weight_moves(target, patch, offload)
            _refuse_lora(target, patch, ("load_lora_weights",))

    @staticmethod
    def _shard_one(
        model: torch.nn.Module, name: str, device_mesh: Any, patch: Patch, offload: bool, world: Any
    ) -> bool:
        """Shard ``model``; True when some of its weights are quantized rows (:mod:`.quantized`)."""
        from torch.distributed.fsdp import fully_shard

        record: list[_Sharded] = []
        ranks = dist.get_process_group_ranks(device_mesh.get_group())
        patch.on_remove(model, f"fully_shard over ranks {ranks}", lambda: record and record.pop().restore())
        _shard(model, device_mesh, offload, record)
        group = device_mesh.get_group()
        wrapper = _root_forward(model, fully_shard.state(model), group, patch, name)
        patch.set_attr(model, "forward", wrapper(model.forward), keep_when_disabled=True)
        _refuse_weight_moves(model, patch, ("enable_group_offload", "enable_layerwise_casting"))
        _refuse_lora(model, patch, ("load_lora_adapter",))
        if record and record[0].quantized is not None:
            _refuse_quantized_save(model, patch, name)
            return True
        install_sharded_save(patch, model, [model], world, name)
        return False


def _refuse_quantized_save(obj: Any, patch: Patch, name: str) -> None:
    """``obj.save_pretrained()`` after ``apply`` raises: ``name``'s quantized weights are row shards."""

    def wrapper(original: Any) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"{type(obj).__name__}.save_pretrained() after hfpatch.apply(..., shard_weights=True): {name}'s "
                "quantized weights are row shards on each rank, which the sharded save does not gather. Call "
                "patch.remove() on every rank first (it gathers the full quantized weights back), then save"
            )

        return refused

    if callable(getattr(obj, "save_pretrained", None)):
        patch.set_attr(obj, "save_pretrained", wrapper(obj.save_pretrained), keep_when_disabled=True)


def _refuse_weight_moves(obj: Any, patch: Patch, methods: tuple[str, ...]) -> None:
    """``obj.<method>()`` after ``apply`` raises: diffusers' offloading and layerwise casting move or recast
    each parameter's data, which FSDP2's sharded DTensor parameters do not support."""

    def refuse(method: str) -> Any:
        def wrapper(original: Any) -> Any:
            def refused(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(
                    f"{type(obj).__name__}.{method}() after hfpatch.apply(..., shard_weights=True) would move or "
                    "recast sharded weights, which FSDP2 does not support. For CPU offload use "
                    "shard_weights_offload=True (the shards stay in CPU memory, one block at a time is copied to "
                    "the GPU); otherwise call it before hfpatch.apply, or patch.remove() first"
                )

            return refused

        return wrapper

    for method in methods:
        if callable(getattr(obj, method, None)):
            patch.wrap_method(obj, method, refuse(method))


def _refuse_lora(obj: Any, patch: Patch, methods: tuple[str, ...]) -> None:
    """``obj.<method>()`` after ``apply`` raises: diffusers' LoRA loading reads the shapes of FSDP2's local shards
    for the new adapter layers and fails half-way (a size mismatch on every ``lora_B``)."""

    def refuse(method: str) -> Any:
        def wrapper(original: Any) -> Any:
            def refused(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(
                    f"{type(obj).__name__}.{method}() after hfpatch.apply(..., shard_weights=True) is not supported: "
                    "the weights are FSDP2 shards, and diffusers' LoRA loading sizes the adapter layers from them. "
                    "Load the LoRA before hfpatch.apply (pipe.load_lora_weights, or fuse it: pipe.fuse_lora(), "
                    "then save_pretrained and load the fused checkpoint with hfpatch.from_pretrained)"
                )

            return refused

        return wrapper

    for method in methods:
        if callable(getattr(obj, method, None)):
            patch.wrap_method(obj, method, refuse(method))
