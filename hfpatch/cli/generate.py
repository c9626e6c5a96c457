"""``hfpatch generate``: a diffusers checkpoint on N ranks from the command line.

.. code-block:: bash

    torchrun --nproc-per-node 8 -m hfpatch generate Wan-AI/Wan2.1-T2V-1.3B-Diffusers \\
        --prompt "a cat surfing a wave" --out cat.mp4 --report cat.json
    hfpatch generate ./my-flux --prompt "a red fox" --steps 28 --out fox.png   # one process

Every rank runs the same command. It loads the pipeline with diffusers' ``DiffusionPipeline.from_pretrained``
(:func:`load_pipeline`), loads the LoRA and enables the cache asked for, calls ``hfpatch.apply(pipe, parallel=...)``
and calls the pipeline with ``output_type="pt"`` and a seeded CPU generator: the same noise on every rank and on
every device, so every rank computes the unpatched pipeline's output (as exactly as the plan's paths are, see
:doc:`/contract`). Rank 0 prints the plan, shows the one progress bar and writes the outputs: ``.png``/``.jpg``
for image pipelines, ``.mp4``/``.gif`` for video pipelines (diffusers' ``export_to_video``/``export_to_gif``),
``.pt`` for the raw output tensor; ``--out`` may repeat, so one run writes several formats. ``--report`` writes
a JSON with the plan, the time of each denoising step, the VAE and the whole call, peak memory and bytes sent
per rank, versions and device names (:func:`run_report`).

What can be checked without the weights is checked first, alike on every rank, and is a usage error (exit status
2, ``hfpatch generate: error: ...``, no traceback) within seconds: degrees that do not multiply to the launched
world size (:func:`check_arguments`, before torch is imported), an output suffix the pipeline cannot produce or
this machine cannot write, a denoiser hfpatch cannot split (with the reason ``hfpatch info`` gives), options the
pipeline's ``__call__`` does not take (:func:`check_model`, from the checkpoint's ``model_index.json``).

>>> from hfpatch.cli.generate import parse_cache, requested_ranks
>>> parse_cache("first-block:0.1")
('first-block', 0.1)
>>> import argparse
>>> requested_ranks(argparse.Namespace(parallel=None, cfg=2, ulysses=2, ring=None, pipefusion=None, vae=None))
(4, '--cfg 2 --ulysses 2')
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arguments import (
    CACHES,
    CALL_OPTIONS,
    DEGREES,
    DTYPES,
    FRAME_ARGUMENTS,
    IMAGE_SUFFIXES,
    RAW_SUFFIX,
    RESERVED,
    VIDEO_SUFFIXES,
    add_arguments,
    parse_cache,
    parse_quantize,
    requested_ranks,
)
from .outputs import device_name, output_tensor, package_versions, peak_memory, run_report, write_outputs

__all__ = [
    "CACHES",
    "ModelInfo",
    "UsageError",
    "add_arguments",
    "check_arguments",
    "check_model",
    "inspect_model",
    "load_pipeline",
    "main",
    "mp4_unavailable",
    "parse_cache",
    "parse_quantize",
    "quantize_arguments",
    "requested_ranks",
    "run_report",
    "write_outputs",
]

#: Components that denoise (diffusers' own CLI finds them by the same prefixes).
DENOISER_PREFIXES = ("transformer", "unet")


class UsageError(ValueError):
    """A request ``hfpatch generate`` refuses before loading any weight: exit status 2 on every rank."""


def _writable(path: Path) -> bool:
    """Whether ``path`` can be created: its nearest existing ancestor is a writable directory."""
    parent = path.resolve().parent
    while not parent.exists():
        parent = parent.parent
    return parent.is_dir() and os.access(parent, os.W_OK)


def mp4_unavailable() -> str | None:
    """Why diffusers' ``export_to_video`` cannot write ``.mp4`` here (a missing package), or ``None``.

    ``export_to_video`` uses imageio when it is installed (then imageio-ffmpeg must be too), else OpenCV.

    >>> reason = mp4_unavailable()
    >>> reason is None or "pip install" in reason
    True
    """
    have = {name: importlib.util.find_spec(name) is not None for name in ("imageio", "imageio_ffmpeg", "cv2")}
    if have["imageio"] and have["imageio_ffmpeg"]:
        return None
    if have["imageio"]:
        return "imageio is installed without imageio-ffmpeg (pip install imageio-ffmpeg)"
    if have["cv2"]:
        return None
    return "neither imageio with imageio-ffmpeg nor opencv is installed (pip install imageio imageio-ffmpeg)"


def check_arguments(args: argparse.Namespace, world_size: int) -> None:
    """Every check that needs neither torch nor the checkpoint, for a launch of ``world_size`` ranks.

    Raises:
        UsageError: Degrees that do not multiply to ``world_size``, options that do not combine, an unknown
            output suffix or a folder that cannot be written.

    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="hfpatch generate")
    >>> add_arguments(parser)
    >>> args = parser.parse_args(["org/model", "--prompt", "a fox", "--parallel", "3", "--out", "fox.png"])
    >>> check_arguments(args, world_size=2)
    Traceback (most recent call last):
    ...
    hfpatch.cli.generate.UsageError: --parallel 3 uses 3 ranks but 2 processes were launched (WORLD_SIZE=2); ...
    """
    degrees = [f"--{name}" for name in (*DEGREES, "vae") if getattr(args, name) is not None]
    if args.parallel is not None and degrees:
        raise UsageError(
            f"--parallel plans the degrees itself; give either --parallel or {' '.join(degrees)}"
        )
    ranks, asked = requested_ranks(args)
    if ranks is not None and ranks != world_size:
        launched = (
            f"{world_size} processes were launched (WORLD_SIZE={world_size})"
            if world_size > 1
            else "1 process was launched (no torchrun)"
        )
        raise UsageError(
            f"{asked} uses {ranks} rank{'s' if ranks > 1 else ''} but {launched}; launch "
            f"`torchrun --nproc-per-node {ranks} -m hfpatch generate ...`, or "
            + (
                f"pass --parallel {world_size}"
                if args.parallel is not None
                else f"degrees that multiply to {world_size}"
            )
        )
    if args.cfg is not None and args.cfg > 2:
        raise UsageError(f"--cfg {args.cfg}: CFG parallel splits cond and uncond over 1 or 2 ranks")
    product = math.prod(getattr(args, name) or 1 for name in DEGREES)
    if args.vae is not None and product > 1 and args.vae not in (1, product):
        raise UsageError(
            f"--vae {args.vae}: the VAE decodes after denoising, over 1 rank or all {product} ranks of the plan"
        )
    pipefusion = (args.pipefusion or 1) > 1
    if args.shard_weights and world_size == 1:
        raise UsageError(
            "--shard-weights shards the weights over the ranks; launch more than one with torchrun"
        )
    if args.shard_weights and pipefusion:
        raise UsageError(
            "--shard-weights with --pipefusion: PipeFusion already keeps only each stage's blocks"
        )
    if args.compile is not None and pipefusion:
        raise UsageError(
            "--compile with --pipefusion: PipeFusion's stages are not compiled by hfpatch generate"
        )
    if args.pipeline_kwargs:
        reserved = sorted(set(args.pipeline_kwargs) & set(RESERVED))
        if reserved:
            raise UsageError(f"--pipeline-kwargs may not set {', '.join(reserved)}: hfpatch generate sets it")
        dedicated = {call: option for option, call in CALL_OPTIONS.items()}
        dedicated.update({name: "frames" for name in FRAME_ARGUMENTS})
        clash = sorted(set(args.pipeline_kwargs) & set(dedicated))
        if clash:
            raise UsageError(
                "--pipeline-kwargs sets "
                + ", ".join(f"{k} (use --{dedicated[k].replace('_', '-')})" for k in clash)
            )
    seen: set[Path] = set()
    for out in [*args.out, *([args.report] if args.report else [])]:
        path = Path(out)
        if path.resolve() in seen:
            raise UsageError(f"{out} is given twice")
        seen.add(path.resolve())
        if not _writable(path):
            raise UsageError(f"cannot write {out}: its folder is not writable")
    if args.report and Path(args.report).suffix.lower() != ".json":
        raise UsageError(f"--report {args.report}: the report is JSON, name it FILE.json")
    known = (*IMAGE_SUFFIXES, *VIDEO_SUFFIXES, RAW_SUFFIX)
    for out in args.out:
        suffix = Path(out).suffix.lower()
        if suffix not in known:
            raise UsageError(f"--out {out}: unknown suffix {suffix or '(none)'!r}; known: {', '.join(known)}")


# ----------------------------------------------------------------------------------------------- the checkpoint
@dataclass(frozen=True)
class ModelInfo:
    """What ``model_index.json`` and the pipeline class tell before any weight loads.

    Attributes:
        pipeline: The pipeline class name (``"WanPipeline"``).
        components: Component name -> ``(library, class name)`` of the components present.
        kind: ``"image"``, ``"video"`` (its ``__call__`` takes ``num_frames``/``video_length``) or ``"other"``
            (audio, ...: only ``.pt`` outputs).
        parameters: The ``__call__`` argument names.
        accepts_kwargs: Whether ``__call__`` takes ``**kwargs``.
    """

    pipeline: str
    components: Mapping[str, tuple[str, str]]
    kind: str
    parameters: frozenset[str] = field(default_factory=frozenset)
    accepts_kwargs: bool = False

    @property
    def denoisers(self) -> dict[str, str]:
        """Component name -> class name of the transformers and UNets."""
        return {
            name: cls
            for name, (library, cls) in self.components.items()
            if name.startswith(DENOISER_PREFIXES) and library == "diffusers"
        }

    @property
    def frame_argument(self) -> str | None:
        return next((name for name in FRAME_ARGUMENTS if name in self.parameters), None)


def inspect_model(model: str) -> ModelInfo:
    """Read ``model_index.json`` of ``model`` (a local folder, or only that file from the hub) and the pipeline
    class's ``__call__`` signature; loads no weight.

    Raises:
        UsageError: No ``model_index.json`` there, or a pipeline class this diffusers does not have.

    >>> import json, tempfile
    >>> folder = tempfile.mkdtemp()  # a model_index.json and no weights: nothing else is read
    >>> index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
    ...          "vae": ["diffusers", "AutoencoderKLWan"], "transformer_2": [None, None]}
    >>> _ = open(f"{folder}/model_index.json", "w").write(json.dumps(index))
    >>> info = inspect_model(folder)
    >>> info.kind, info.denoisers, info.frame_argument
    ('video', {'transformer': 'WanTransformer3DModel'}, 'num_frames')
    """
    import diffusers

    try:
        config = diffusers.DiffusionPipeline.load_config(model)
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"{model} is not a diffusers pipeline (a folder or hub repository with model_index.json): {exc}"
        ) from None
    name = str(config.get("_class_name"))
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise UsageError(
            f"{model}: model_index.json names the pipeline class {name!r}, which diffusers "
            f"{diffusers.__version__} does not have (a modular or custom pipeline?); hfpatch generate runs the "
            "pipelines of diffusers' DiffusionPipeline.from_pretrained"
        )
    components = {
        key: (value[0], value[1])
        for key, value in config.items()
        if not key.startswith("_") and isinstance(value, (list, tuple)) and len(value) == 2 and value[1]
    }
    signature = inspect.signature(cls.__call__).parameters
    parameters = frozenset(signature)
    if any(n in parameters for n in FRAME_ARGUMENTS):
        kind = "video"
    elif "height" in parameters and "width" in parameters:
        kind = "image"
    else:
        kind = "other"
    accepts_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    return ModelInfo(name, components, kind, parameters, accepts_kwargs)


def _diffusers_class(name: str) -> type | None:
    import diffusers

    cls = getattr(diffusers, name, None)
    return cls if isinstance(cls, type) else None


def _families(cls_name: str) -> list[str]:
    """Names of hfpatch's families registered for the diffusers class ``cls_name`` (along its MRO)."""
    from ..core.registry import class_key
    from ..patches import default_registry

    cls = _diffusers_class(cls_name)
    keys = [class_key(c) for c in cls.__mro__] if cls is not None else [f"diffusers.{cls_name}"]
    supported = default_registry().supported()
    return [family for key in keys for family in supported.get(key, [])]


def _why_not_split(cls_name: str) -> str:
    """The reason ``hfpatch info`` gives for a transformer class hfpatch does not split (or a U-Net's)."""
    from ..patches.dit.family import support_table

    how = dict(support_table()).get(cls_name)
    if how is not None and how.startswith("not supported (") and how.endswith(")"):
        return how[len("not supported (") : -1]
    if "UNet" in cls_name:
        return (
            "a U-Net, whose convolutions mix neighbouring positions; hfpatch splits transformers by sequence"
        )
    return "hfpatch has no sequence-parallel plan for it (hfpatch info lists the supported classes)"


def check_model(info: ModelInfo, args: argparse.Namespace, world_size: int) -> None:
    """Every check that needs the checkpoint's ``model_index.json`` (:func:`inspect_model`) but no weight.

    Raises:
        UsageError: An output suffix that does not fit the pipeline's output (or ``.mp4`` without a writer
            installed: :func:`mp4_unavailable`), an option its ``__call__`` does not take, or degrees that need
            a denoiser hfpatch cannot split.

    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="hfpatch generate")
    >>> add_arguments(parser)
    >>> args = parser.parse_args(["org/wan", "--prompt", "a cat", "--out", "cat.png"])
    >>> info = ModelInfo("WanPipeline", {"transformer": ("diffusers", "WanTransformer3DModel")}, "video",
    ...                  frozenset({"prompt", "num_frames", "output_type"}))
    >>> check_model(info, args, world_size=2)
    Traceback (most recent call last):
    ...
    hfpatch.cli.generate.UsageError: --out cat.png: WanPipeline makes videos; write .mp4, .gif, .pt
    """
    fits = {"image": IMAGE_SUFFIXES, "video": VIDEO_SUFFIXES}.get(info.kind, ()) + (RAW_SUFFIX,)
    for out in args.out:
        if Path(out).suffix.lower() not in fits:
            makes = {"image": "images", "video": "videos"}.get(info.kind, "neither images nor videos")
            raise UsageError(f"--out {out}: {info.pipeline} makes {makes}; write {', '.join(fits)}")
        missing = mp4_unavailable() if Path(out).suffix.lower() == ".mp4" else None
        if missing:
            raise UsageError(
                f"--out {out}: cannot write .mp4 here: diffusers' export_to_video needs imageio with "
                f"imageio-ffmpeg, or opencv-python, and {missing}. Write .gif (or .pt) instead."
            )
    given = {call: option for option, call in CALL_OPTIONS.items() if getattr(args, option) is not None}
    if args.frames is not None:
        if info.frame_argument is None:
            raise UsageError(
                f"--frames: {info.pipeline} is not a video pipeline (its __call__ takes no num_frames)"
            )
    for call, option in given.items():
        if call not in info.parameters:
            raise UsageError(f"--{option.replace('_', '-')}: {info.pipeline}.__call__ takes no {call}")
    unknown = sorted(set(args.pipeline_kwargs or {}) - info.parameters)
    if unknown and not info.accepts_kwargs:
        raise UsageError(
            f"--pipeline-kwargs: {info.pipeline}.__call__ takes no {', '.join(unknown)}"
            f" (it takes: {', '.join(sorted(info.parameters - {'self'}))})"
        )
    if "output_type" not in info.parameters:
        raise UsageError(
            f"{info.pipeline}.__call__ takes no output_type; hfpatch generate asks for output_type='pt'"
        )

    denoisers = info.denoisers
    if args.cache is not None:
        for name, cls_name in denoisers.items():
            cls = _diffusers_class(cls_name)
            if cls is None or not hasattr(cls, "enable_cache"):
                raise UsageError(
                    f"--cache: {cls_name} ({name} of {info.pipeline}) has no diffusers step cache"
                )
        if not denoisers:
            raise UsageError(f"--cache: {info.pipeline} has no transformer or unet to cache")
    if args.quantize is not None and args.quantize[0] == "gguf":
        cls = _diffusers_class(info.denoisers.get("transformer", ""))
        if cls is None or not hasattr(cls, "from_single_file"):
            raise UsageError(f"--quantize gguf: {info.pipeline} has no transformer that loads a single file")
    if args.lora is not None and not hasattr(_diffusers_class(info.pipeline), "load_lora_weights"):
        raise UsageError(f"--lora: {info.pipeline} has no load_lora_weights")
    if world_size == 1:
        return
    if (args.pipefusion or 1) > 1:
        for name, cls_name in denoisers.items():
            if not any(f.endswith("pipefusion") for f in _families(cls_name)):
                raise UsageError(
                    f"--pipefusion {args.pipefusion}: hfpatch has no PipeFusion family for {cls_name} ({name} of "
                    f"{info.pipeline}); `hfpatch info` lists the classes of the *_pipefusion families"
                )
    # Explicit degrees split the sequence when they say so; --parallel N (or every launched rank) is planned
    # after loading and puts ranks into Ulysses/Ring, so the denoisers must be splittable.
    if any(getattr(args, name) is not None for name in (*DEGREES, "vae")):
        if (args.ulysses or 1) * (args.ring or 1) == 1:
            return
    if not denoisers:
        raise UsageError(
            f"{info.pipeline} has no transformer or unet component for hfpatch to split; run it on one process, "
            "or with --cfg 2 alone if it guides"
        )
    for name, cls_name in denoisers.items():
        if not any(f.endswith("usp") for f in _families(cls_name)):
            asked = requested_ranks(args)[1] or f"{world_size} launched ranks"
            raise UsageError(
                f"{asked}: hfpatch cannot split {cls_name} ({name} of {info.pipeline}) over ranks: "
                f"{_why_not_split(cls_name)}. Run it on one process, or with --cfg 2 alone (CFG parallel runs any "
                "pipeline that guides)"
            )


# ----------------------------------------------------------------------------------------------- running
def load_pipeline(model: str, dtype: Any, **kwargs: Any) -> Any:
    """The pipeline of ``model`` in ``dtype`` on the CPU: diffusers' ``DiffusionPipeline.from_pretrained``.

    The seam for other loaders (a sharded loader that reads only this rank's weights): ``hfpatch generate``
    calls this, then moves the components to the rank's device.

    >>> import tempfile, torch
    >>> from hfpatch.testing import tiny_flux_pipe_with_text_encoders
    >>> folder = tempfile.mkdtemp()
    >>> tiny_flux_pipe_with_text_encoders().save_pretrained(folder)
    >>> pipe = load_pipeline(folder, torch.float32)
    >>> type(pipe).__name__, pipe.transformer.dtype
    ('FluxPipeline', torch.float32)
    """
    import diffusers
    import torch

    cls = diffusers.DiffusionPipeline
    if any(isinstance(value, torch.nn.Module) for value in kwargs.values()):
        # A component passed in (a GGUF transformer): the folder's own class takes it (diffusers 0.42's generic
        # DiffusionPipeline.from_pretrained loads the folder's component instead).
        cls = getattr(diffusers, cls.load_config(model)["_class_name"], cls)
    return cls.from_pretrained(model, dtype=dtype, **kwargs)


def quantize_arguments(quantize: tuple[str, str | None], model: str, info: ModelInfo, dtype: Any) -> dict:
    """``load_pipeline``'s arguments for ``--quantize``: a ``PipelineQuantizationConfig`` quantizing every denoiser
    (int8, fp8: torchao; nf4: bitsandbytes), or the transformer read from a GGUF file."""
    from diffusers import PipelineQuantizationConfig

    kind, path = quantize
    if kind == "gguf":
        from diffusers import GGUFQuantizationConfig

        cls = _diffusers_class(info.denoisers["transformer"])  # check_model: it loads a single file
        transformer = cls.from_single_file(
            path,
            config=model,
            subfolder="transformer",
            quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
            torch_dtype=dtype,
        )
        return {"transformer": transformer}
    if kind == "nf4":
        from diffusers import BitsAndBytesConfig

        config: Any = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
    else:
        from diffusers import TorchAoConfig
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

        config = TorchAoConfig(Int8WeightOnlyConfig() if kind == "int8" else Float8WeightOnlyConfig())
    return {
        "quantization_config": PipelineQuantizationConfig(quant_mapping=dict.fromkeys(info.denoisers, config))
    }


def _is_sharded_by_fsdp(name: str, module: Any) -> bool:
    """Whether ``shard_weights`` shards this component (a denoiser or a transformers encoder)."""
    return name.startswith(DENOISER_PREFIXES) or type(module).__module__.startswith("transformers.")


def _place_pipeline(pipe: Any, device: Any, shard_weights: bool) -> None:
    """Move ``pipe``'s modules to ``device``; with ``shard_weights`` the modules FSDP2 shards stay on the CPU
    (``hfpatch.apply`` moves them block by block), so no rank ever holds their full weights on the GPU."""
    import torch

    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and not (
            shard_weights and _is_sharded_by_fsdp(name, component)
        ):
            component.to(device)


def _enable_cache(pipe: Any, kind: str, value: float | int) -> None:
    """``--cache KIND:VALUE``: the diffusers cache config on each denoiser of ``pipe`` (before ``hfpatch.apply``)."""
    import diffusers

    cls_name, argument, _, _ = CACHES[kind]
    for name, module in pipe.components.items():
        if not (name.startswith(DENOISER_PREFIXES) and module is not None):
            continue
        options: dict[str, Any] = {argument: value}
        if kind == "pab":
            options["current_timestep_callback"] = lambda: pipe.current_timestep
        module.enable_cache(getattr(diffusers, cls_name)(**options))


def _compile_denoisers(pipe: Any, backend: str) -> list[str]:
    """``--compile BACKEND``: each denoiser's repeated blocks (``compile_repeated_blocks(fullgraph=True)``), or
    the whole module in place (``nn.Module.compile``) when it declares none; returns what was compiled."""
    import torch

    compiled = []
    for name, module in pipe.components.items():
        if not (name.startswith(DENOISER_PREFIXES) and isinstance(module, torch.nn.Module)):
            continue
        if getattr(module, "_repeated_blocks", None):
            module.compile_repeated_blocks(fullgraph=True, backend=backend)
            compiled.append(f"{name} (repeated blocks)")
        else:
            module.compile(backend=backend)
            compiled.append(name)
    return compiled


def _parallel(args: argparse.Namespace, world_size: int) -> Any:
    """The ``parallel=`` argument of ``hfpatch.apply``."""
    from ..core.config import ParallelConfig

    if any(getattr(args, name) is not None for name in (*DEGREES, "vae")):
        return ParallelConfig(**{name: getattr(args, name) or 1 for name in DEGREES}, vae=args.vae)
    return args.parallel or world_size


def _call_arguments(args: argparse.Namespace, info: ModelInfo) -> dict[str, Any]:
    """The pipeline call's arguments from the options (without the generator and the output type)."""
    call = {
        name: getattr(args, option)
        for option, name in CALL_OPTIONS.items()
        if getattr(args, option) is not None
    }
    if args.frames is not None:
        call[info.frame_argument] = args.frames
    call.update(args.pipeline_kwargs or {})
    return call


class _Clock:
    """Timestamps of a pipeline call: its start, the first denoiser forward, each step's end, its end."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.start = self.denoising = self.end = None
        self.steps: list[float] = []

    def first_forward(self, module: Any, args: Any) -> None:
        if self.denoising is None:
            self.sync()
            self.denoising = time.perf_counter()

    def step_end(self, pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        self.sync()
        self.steps.append(time.perf_counter())
        return {}

    def times(self) -> dict[str, Any]:
        """Seconds: ``end_to_end``, ``before_denoising`` (prompt encoding, latents), ``steps``, ``vae_decode``."""
        result: dict[str, Any] = {"end_to_end": self.end - self.start}
        if self.denoising is not None and self.steps:
            marks = [self.denoising, *self.steps]
            result["before_denoising"] = self.denoising - self.start
            result["steps"] = [b - a for a, b in zip(marks, marks[1:])]
            result["vae_decode"] = self.end - self.steps[-1]
        return result


def _launched_world_size() -> int:
    """The launcher's world size, read from the environment before torch is imported."""
    if "torch" in sys.modules:
        from ..core.ranks import launched_world_size

        return launched_world_size()
    if all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["WORLD_SIZE"])
    return 1


def main(args: argparse.Namespace) -> int:
    """Run ``hfpatch generate`` with parsed ``args`` on this rank; returns the exit status (2: usage error)."""
    world_size = _launched_world_size()
    try:
        check_arguments(args, world_size)
        info = inspect_model(args.model)
        check_model(info, args, world_size)
    except UsageError as exc:
        print(f"hfpatch generate: error: {exc}", file=sys.stderr)
        return 2
    _generate(args, info, world_size)
    return 0


def rank_device(args: argparse.Namespace) -> tuple[Any, Any]:
    """This rank's device (its ``LOCAL_RANK``'s GPU, made current, or the CPU) and the compute dtype (``--dtype``,
    else bf16 on a GPU and fp32 on the CPU)."""
    import torch

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return device, getattr(torch, DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")])


def load_and_patch(
    args: argparse.Namespace, info: ModelInfo, world_size: int, device: Any, dtype: Any, times: dict[str, Any]
) -> tuple[Any, Any, list[str]]:
    """The pipeline the options fix (``--quantize``, ``--lora``, ``--cache``), placed on ``device``, patched with
    the plan (``--parallel``/degrees, ``--shard-weights``) and compiled (``--compile``): ``(pipe, patch, compiled
    denoisers)``; ``times`` gets ``load`` and ``apply`` in seconds (with ``--shard-weights``, ``load`` holds both:
    ``hfpatch.from_pretrained`` reads each rank's shards while it applies, ``apply`` the compile). Shared by
    ``hfpatch generate`` and ``hfpatch serve``."""
    import hfpatch

    def prepare(pipe: Any) -> None:  # the components loaded whole, before apply
        _place_pipeline(pipe, device, args.shard_weights)
        if args.cache is not None:
            _enable_cache(pipe, *args.cache)

    started = time.perf_counter()
    if args.shard_weights and args.lora is None and world_size > 1:
        # hfpatch.from_pretrained: each rank reads only the shards it keeps, and applies (a LoRA loads after the
        # base weights: the path below, which loads whole then shards).
        gguf = args.quantize is not None and args.quantize[0] == "gguf"
        quantized = (
            quantize_arguments(args.quantize, args.model, info, dtype) if args.quantize and not gguf else {}
        )
        pipe, patch = hfpatch.from_pretrained(
            args.model,
            _parallel(args, world_size),
            torch_dtype=dtype,
            prepare=prepare,
            single_files={"transformer": args.quantize[1]} if gguf else None,
            shard_weights=True,
            **quantized,
        )
        times["load"] = time.perf_counter() - started
        started = time.perf_counter()
    else:
        quantized = quantize_arguments(args.quantize, args.model, info, dtype) if args.quantize else {}
        pipe = load_pipeline(args.model, dtype, **quantized)
        if args.lora is not None:
            pipe.load_lora_weights(args.lora)
        prepare(pipe)
        times["load"] = time.perf_counter() - started
        started = time.perf_counter()
        options = {"shard_weights": True} if args.shard_weights else {}
        patch = hfpatch.apply(pipe, parallel=_parallel(args, world_size), **options)
    compiled = _compile_denoisers(pipe, args.compile) if args.compile is not None else []
    times["apply"] = time.perf_counter() - started
    return pipe, patch, compiled


def _generate(args: argparse.Namespace, info: ModelInfo, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    from ..distributed import runtime
    from ..distributed.collectives import count_comm
    from .outputs import quiet_unless_rank0

    rank = int(os.environ.get("RANK", "0")) if world_size > 1 else 0
    device, dtype = rank_device(args)
    initialised_here = world_size > 1 and not dist.is_initialized()
    restore_voices = quiet_unless_rank0(rank)  # one progress bar and one copy of each warning: rank 0's
    try:
        times: dict[str, Any] = {}
        pipe, patch, compiled = load_and_patch(args, info, world_size, device, dtype, times)
        pipe.set_progress_bar_config(disable=rank != 0)
        backend = dist.get_backend() if dist.is_initialized() else "none"
        if rank == 0:
            print(
                f"hfpatch generate: {info.pipeline} ({', '.join(sorted(set(info.denoisers.values()))) or 'no denoiser'}) "
                f"from {args.model} on {world_size} rank{'s' if world_size > 1 else ''} ({device.type}, "
                f"backend {backend}), {str(dtype).removeprefix('torch.')}"
                + (f", compiled: {', '.join(compiled)} ({args.compile})" if compiled else ""),
                flush=True,
            )
            print(f"plan: {patch.plan}", flush=True)

        call = _call_arguments(args, info)
        clock = _Clock(sync=torch.cuda.synchronize if device.type == "cuda" else lambda: None)
        if "callback_on_step_end" in info.parameters:
            call["callback_on_step_end"] = clock.step_end
            call["callback_on_step_end_tensor_inputs"] = []
        hooks = [
            module.register_forward_pre_hook(torch.compiler.disable(clock.first_forward))
            for name, module in pipe.components.items()
            if name.startswith(DENOISER_PREFIXES) and isinstance(module, torch.nn.Module)
        ]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            with count_comm() as comm:
                clock.sync()
                clock.start = time.perf_counter()
                output = pipe(**call, output_type="pt", generator=torch.Generator().manual_seed(args.seed))
                clock.sync()
                clock.end = time.perf_counter()
        finally:
            for hook in hooks:
                hook.remove()
        tensor = output_tensor(output)
        times.update(clock.times())
        written: list[str] = []
        if rank == 0:
            started = time.perf_counter()
            written = write_outputs(tensor, info.kind, args.out, fps=args.fps)
            times["write"] = time.perf_counter() - started
            print(
                f"wrote {', '.join(written)}: {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}, "
                f"{times['end_to_end']:.2f} s for the pipeline call",
                flush=True,
            )
        if args.report is not None:
            peak, measure = peak_memory(device)
            mine = {
                "rank": rank,
                "device": device_name(device),
                "times_s": times,
                "peak_memory_bytes": peak,
                "memory_measure": measure,
                "bytes_sent": comm.bytes_sent,
                "bytes_sent_by_op": dict(comm.by_op),
                "collective_calls": dict(comm.calls),
            }
            ranks = (
                runtime.exchange("generate-report", mine, what="hfpatch generate")
                if world_size > 1
                else [mine]
            )
            if rank == 0:
                shared = {
                    "arguments": {k: v for k, v in vars(args).items() if k != "command"},
                    "model": args.model,
                    "pipeline": info.pipeline,
                    "components": {k: v[1] for k, v in info.components.items()},
                    "plan": str(patch.plan),
                    "options": {
                        "dtype": str(dtype).removeprefix("torch."),
                        "shard_weights": args.shard_weights,
                        "cache": None if args.cache is None else f"{args.cache[0]}:{args.cache[1]}",
                        "compile": args.compile,
                        "lora": args.lora,
                    },
                    "call": {k: v for k, v in call.items() if not k.startswith("callback")}
                    | {"seed": args.seed},
                    "backend": backend,
                    "versions": package_versions() | {"cuda": torch.version.cuda},
                    "outputs": written,
                    "output": {
                        "shape": list(tensor.shape),
                        "dtype": str(tensor.dtype).removeprefix("torch."),
                    },
                    "bytes_sent_note": "bytes this rank sent through hfpatch's collectives during the pipeline "
                    "call (hfpatch.distributed.collectives.count_comm); FSDP2's weight all-gathers "
                    "(--shard-weights) are torch's own and not counted",
                }
                Path(args.report).parent.mkdir(parents=True, exist_ok=True)
                Path(args.report).write_text(json.dumps(run_report(shared, ranks), indent=2) + "\n")
                print(f"report: {args.report}", flush=True)
    finally:
        restore_voices()
    if initialised_here:
        # hfpatch.apply initialised the default group for this command: destroy it when the process exits (NCCL
        # warns otherwise), not now: a process group cannot be re-initialised from the launcher's store, and a
        # script may run several commands in one process (tests/test_generate.py does).
        atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
