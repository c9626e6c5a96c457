"""What a run of ``hfpatch generate`` (:mod:`hfpatch.cli.generate`) leaves behind: the output tensor of a
pipeline (:func:`output_tensor`) written as images, videos or the raw tensor (:func:`write_outputs`), and the
JSON report of the run (:func:`run_report`) with the versions (:func:`package_versions`), device names
(:func:`device_name`) and peak memory (:func:`peak_memory`) of each rank; and the quiet of ranks other than 0
(:func:`quiet_unless_rank0`). :mod:`hfpatch.cli.generate` re-exports :func:`write_outputs` and
:func:`run_report`.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .arguments import IMAGE_SUFFIXES, RAW_SUFFIX


def quiet_unless_rank0(rank: int) -> Callable[[], None]:
    """On a rank other than 0: no progress bars (loading too), diffusers' and transformers' logs at error level, and
    Python warnings ignored, since every rank would print the same; returns the function that restores them all."""
    if rank == 0:
        return lambda: None
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    loggers = (diffusers_logging, transformers_logging)
    bars = [module.is_progress_bar_enabled() for module in loggers]
    levels = [module.get_verbosity() for module in loggers]
    caught = warnings.catch_warnings()
    caught.__enter__()
    warnings.simplefilter("ignore")
    for module in loggers:
        module.disable_progress_bar()
        module.set_verbosity_error()

    def restore() -> None:
        for module, bar, level in zip(loggers, bars, levels):
            module.set_verbosity(level)
            if bar:
                module.enable_progress_bar()
        caught.__exit__(None, None, None)

    return restore


def output_tensor(output: Any) -> Any:
    """The payload of a pipeline output (``images``, ``frames``, ``audios`` or ``audio``) as a tensor."""
    import numpy as np
    import torch

    for name in ("images", "frames", "audios", "audio"):
        value = getattr(output, name, None)
        if value is None:
            continue
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{type(output).__name__}.{name} is a {type(value).__name__}, not a tensor, with output_type='pt'"
            )
        return value
    raise TypeError(f"{type(output).__name__} has none of images, frames, audios, audio")


def _numbered(path: Path, index: int, count: int) -> Path:
    return path if count == 1 else path.with_name(f"{path.stem}-{index}{path.suffix}")


def write_outputs(tensor: Any, kind: str, outputs: list[str], fps: int = 16) -> list[str]:
    """Write ``tensor`` (the pipeline's ``output_type="pt"`` payload) to every path of ``outputs``; returns the
    files written. Images ``[B, C, H, W]`` and videos ``[B, F, C, H, W]`` hold values in ``[0, 1]``; their
    ``.png``/``.jpg`` and video frames are what the pipeline's ``output_type="pil"`` gives (diffusers'
    ``pt_to_numpy`` and ``numpy_to_pil``). A batch of several writes ``NAME-0``, ``NAME-1``, ...

    >>> import tempfile, torch
    >>> from PIL import Image
    >>> folder = tempfile.mkdtemp()
    >>> written = write_outputs(torch.rand(1, 3, 8, 8), "image", [f"{folder}/a.png", f"{folder}/a.pt"])
    >>> Image.open(written[0]).size, tuple(torch.load(written[1]).shape)
    ((8, 8), (1, 3, 8, 8))
    """
    import torch
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.utils import export_to_gif, export_to_video

    written = []
    for out in outputs:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        suffix = path.suffix.lower()
        if suffix == RAW_SUFFIX:
            torch.save(tensor.detach().cpu(), path)
            written.append(str(path))
            continue
        expected = 4 if kind == "image" else 5
        if tensor.dim() != expected:
            raise ValueError(f"cannot write {out}: the {kind} output has shape {tuple(tensor.shape)}")
        for index, item in enumerate(tensor):
            target = _numbered(path, index, len(tensor))
            frames = VaeImageProcessor.numpy_to_pil(
                VaeImageProcessor.pt_to_numpy(item if kind == "video" else item[None])
            )
            if suffix in IMAGE_SUFFIXES:
                frames[0].save(target)
            elif suffix == ".gif":
                export_to_gif(frames, str(target), fps=fps)
            else:
                export_to_video(VaeImageProcessor.pt_to_numpy(item), str(target), fps=fps)
            written.append(str(target))
    return written


def package_versions() -> dict[str, str]:
    """The version of Python and of hfpatch and the libraries it runs on (``"not installed"`` for one absent)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("hfpatch", "torch", "diffusers", "transformers", "accelerate", "peft"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def device_name(device: Any) -> str:
    """``device`` as the report names it: a CUDA device with its model, the CPU with its processor and cores."""
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def peak_memory(device: Any) -> tuple[int, str]:
    """``(bytes, what was measured)`` for the pipeline call on this rank."""
    import torch

    if device.type == "cuda":
        return (
            torch.cuda.max_memory_allocated(device),
            "torch.cuda.max_memory_allocated during the pipeline call (weights, activations, buffers)",
        )
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (
        rss if sys.platform == "darwin" else rss * 1024,
        "peak resident set size of the process since it started (resource.getrusage: weights, activations, "
        "Python and torch themselves; the CPU has no allocator peak counter)",
    )


def run_report(shared: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``--report`` JSON: ``shared`` (the command, plan, call, versions, outputs) and every rank's measures.

    ``times_s`` at the top is rank 0's; ``ranks`` has each rank's ``times_s``, ``peak_memory_bytes`` (with
    ``memory_measure`` saying what it is), ``bytes_sent`` by hfpatch's collectives (``bytes_sent_by_op``) and
    ``device``.

    >>> report = run_report({"plan": "ParallelConfig(cfg=2)"}, [{"rank": 0, "times_s": {"end_to_end": 1.5}}])
    >>> report["times_s"], report["world_size"]
    ({'end_to_end': 1.5}, 1)
    """
    return {
        "hfpatch_generate_report": 1,
        **shared,
        "world_size": len(ranks),
        "times_s": ranks[0].get("times_s"),
        "ranks": ranks,
    }
