"""The options of ``hfpatch generate`` (:mod:`hfpatch.cli.generate`): the command's vocabulary (output suffixes,
dtypes, cache kinds, the pipeline arguments it sets itself, the degree options), the parsers of its option values,
the options themselves (:func:`add_arguments`) and the world size they ask for (:func:`requested_ranks`). The
checks (raising :class:`~hfpatch.cli.generate.UsageError`), the loading and the run are in
:mod:`hfpatch.cli.generate`, which re-exports the functions and :data:`CACHES` here.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
VIDEO_SUFFIXES = (".mp4", ".gif")
RAW_SUFFIX = ".pt"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


#: ``--cache`` kinds: (diffusers config class, the argument VALUE sets, its type, its default).
CACHES: dict[str, tuple[str, str, type, float | int]] = {
    "first-block": ("FirstBlockCacheConfig", "threshold", float, 0.05),
    "taylorseer": ("TaylorSeerCacheConfig", "cache_interval", int, 5),
    "pab": ("PyramidAttentionBroadcastConfig", "spatial_attention_block_skip_range", int, 2),
}
#: Pipeline ``__call__`` arguments the command sets itself (``--pipeline-kwargs`` may not).
RESERVED = (
    "generator",
    "output_type",
    "return_dict",
    "callback_on_step_end",
    "callback_on_step_end_tensor_inputs",
)
#: Dedicated option -> the ``__call__`` argument it sets (``--frames`` is resolved per pipeline).
CALL_OPTIONS = {
    "prompt": "prompt",
    "negative_prompt": "negative_prompt",
    "steps": "num_inference_steps",
    "height": "height",
    "width": "width",
    "guidance_scale": "guidance_scale",
}
#: The ``__call__`` arguments ``--frames`` sets, the first one a pipeline takes.
FRAME_ARGUMENTS = ("num_frames", "video_length")
#: The degree options whose product is the world size they ask for (``--vae`` is not one: it splits the VAE only).
DEGREES = ("cfg", "ulysses", "ring", "pipefusion")


# ----------------------------------------------------------------------------------------------- arguments
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _finite_float(text: str, at_least: float | None = None) -> float:
    """An argparse ``type=``: a finite float (``>= at_least`` when given)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value) or (at_least is not None and value < at_least):
        bound = "" if at_least is None else f" >= {at_least:g}"
        raise argparse.ArgumentTypeError(f"must be a finite number{bound}, got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object like '{{\"max_sequence_length\": 256}}', got {text!r}"
        )
    return value


def parse_cache(text: str) -> tuple[str, float | int]:
    """``KIND[:VALUE]`` of ``--cache`` -> ``(kind, value)``; VALUE defaults per kind (:data:`CACHES`).

    >>> parse_cache("taylorseer"), parse_cache("pab:3")
    (('taylorseer', 5), ('pab', 3))
    """
    kind, _, value = text.partition(":")
    if kind not in CACHES:
        raise argparse.ArgumentTypeError(f"unknown cache {kind!r}; known: {', '.join(CACHES)}")
    _, name, kind_type, default = CACHES[kind]
    if not value:
        return kind, default
    try:
        parsed = kind_type(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{kind}:{value}: {name} must be a {kind_type.__name__}") from None
    if not (math.isfinite(parsed) and parsed > 0):
        raise argparse.ArgumentTypeError(f"{kind}:{value}: {name} must be > 0")
    return kind, parsed


#: ``--quantize`` kinds -> what diffusers quantizes each denoiser with while loading.
QUANTIZE = {
    "int8": "torchao int8 weight-only (TorchAoConfig(Int8WeightOnlyConfig()))",
    "fp8": "torchao float8 weight-only (TorchAoConfig(Float8WeightOnlyConfig()), a GPU)",
    "nf4": "bitsandbytes 4-bit nf4 (BitsAndBytesConfig, a GPU)",
    "gguf:PATH": "the transformer read from a GGUF file (from_single_file + GGUFQuantizationConfig)",
}


def parse_quantize(text: str) -> tuple[str, str | None]:
    """``--quantize`` -> ``(kind, GGUF path or None)``.

    >>> parse_quantize("int8"), parse_quantize("gguf:wan-Q8_0.gguf")
    (('int8', None), ('gguf', 'wan-Q8_0.gguf'))
    """
    kind, colon, path = text.partition(":")
    if kind == "gguf" and colon and path:
        return kind, path
    if kind in QUANTIZE and not colon:
        return kind, None
    raise argparse.ArgumentTypeError(f"unknown quantization {text!r}; known: {', '.join(QUANTIZE)}")


def add_arguments(parser: argparse.ArgumentParser, serve: bool = False) -> None:
    """The options of ``hfpatch generate`` (imports no torch: ``--help`` and usage errors are instant); with
    ``serve``, those of ``hfpatch serve``: the same pipeline options, the call's options as the defaults of every
    request, no ``--prompt``, ``--out`` or ``--report``."""
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a local diffusers pipeline folder (with model_index.json) or a Hugging Face hub id, loaded with "
        "diffusers' DiffusionPipeline.from_pretrained",
    )
    if not serve:
        _add_outputs(parser)
    _add_call(parser, serve)
    _add_pipeline(parser)
    if not serve:
        parser.add_argument(
            "--report",
            metavar="FILE.json",
            help="write a JSON report (rank 0): plan, time per denoising step, VAE and end-to-end time, peak "
            "memory and bytes sent per rank, versions and device names (default: none)",
        )


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        action="append",
        required=True,
        metavar="FILE",
        help="output file, written once by rank 0; repeat it to write several formats from one run. Images: "
        ".png, .jpg; videos: .mp4 (needs imageio and imageio-ffmpeg, or opencv), .gif; any pipeline: .pt, the "
        "raw output tensor (output_type='pt'). A batch of several writes NAME-0.png, NAME-1.png, ... "
        "(required, no default)",
    )


def _add_call(parser: argparse.ArgumentParser, serve: bool) -> None:
    call = parser.add_argument_group(
        "the defaults of every request's call (an option left out keeps the pipeline's own default)"
        if serve
        else "the pipeline call (an option left out keeps the pipeline's own default)"
    )
    if not serve:
        call.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt (required, no default)")
    call.add_argument(
        "--negative-prompt",
        metavar="TEXT",
        help="the negative prompt (default: the pipeline's, usually none)",
    )
    call.add_argument(
        "--steps",
        type=_positive_int,
        metavar="N",
        help="denoising steps, num_inference_steps (default: the pipeline's)",
    )
    call.add_argument(
        "--height", type=_positive_int, metavar="PIXELS", help="height in pixels (default: the pipeline's)"
    )
    call.add_argument(
        "--width", type=_positive_int, metavar="PIXELS", help="width in pixels (default: the pipeline's)"
    )
    call.add_argument(
        "--frames",
        type=_positive_int,
        metavar="N",
        help="frames of a video pipeline, num_frames or video_length (default: the pipeline's)",
    )
    call.add_argument(
        "--guidance-scale",
        type=_finite_float,
        metavar="SCALE",
        help="guidance_scale (default: the pipeline's)",
    )
    call.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the CPU generator every rank draws the same noise from (default: %(default)s)",
    )
    call.add_argument(
        "--pipeline-kwargs",
        type=_json_object,
        metavar="JSON",
        help='more arguments of the pipeline call as a JSON object, e.g. \'{"max_sequence_length": 256, '
        '"true_cfg_scale": 4.0}\' (default: none)',
    )
    call.add_argument(
        "--fps",
        type=_positive_int,
        default=16,
        metavar="N",
        help="frames per second of .mp4/.gif outputs (default: %(default)s)",
    )


def _add_pipeline(parser: argparse.ArgumentParser) -> None:
    plan = parser.add_argument_group(
        "parallelism (their product must equal the launched world size, e.g. torchrun --nproc-per-node N)"
    )
    plan.add_argument(
        "--parallel",
        type=_positive_int,
        metavar="N",
        help="ranks to plan automatically, as hfpatch.apply(pipe, parallel=N): CFG parallel when the pipeline "
        "guides by default (not Flux's optional true CFG: --cfg 2 for that), then Ulysses up to the head count, the rest Ring (default: every launched rank)",
    )
    for name, what in (
        ("cfg", "CFG parallel: cond and uncond on different ranks, 1 or 2"),
        ("ulysses", "Ulysses degree"),
        ("ring", "Ring-attention degree"),
        ("pipefusion", "PipeFusion stages (Wan, Flux; approximate after its warm-up step)"),
    ):
        plan.add_argument(
            f"--{name}",
            type=_positive_int,
            metavar=name[0].upper(),
            help=f"{what}; explicit degrees replace --parallel (default: 1 when another degree is given)",
        )
    plan.add_argument(
        "--vae",
        type=_positive_int,
        metavar="V",
        help="ranks the VAE decode splits over, 1 or the product of the degrees (default: all ranks)",
    )
    plan.add_argument(
        "--shard-weights",
        action="store_true",
        help="shard the transformers and text encoders over the ranks with FSDP2, hfpatch.apply(..., "
        "shard_weights=True); bit-identical to the same plan unsharded (default: off)",
    )
    speed = parser.add_argument_group("speed and memory")
    speed.add_argument(
        "--cache",
        type=parse_cache,
        metavar="KIND[:VALUE]",
        help="a diffusers step cache on each denoiser, enabled before hfpatch.apply (every rank then takes the "
        "same skip decision): first-block[:THRESHOLD] (FirstBlockCacheConfig, threshold 0.05), "
        "taylorseer[:INTERVAL] (TaylorSeerCacheConfig, cache_interval 5), pab[:RANGE] "
        "(PyramidAttentionBroadcastConfig, spatial_attention_block_skip_range 2) (default: none)",
    )
    speed.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="torch.compile each denoiser after hfpatch.apply: its repeated blocks (compile_repeated_blocks, "
        "fullgraph) or, without them, the whole module; the bare flag uses the inductor backend, eager and "
        "aot_eager run the traced ops unchanged, to debug (default: off)",
    )
    speed.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        help="weights and compute dtype (default: bf16 with CUDA, fp32 on CPU)",
    )
    speed.add_argument(
        "--lora",
        metavar="PATH",
        help="LoRA weights loaded with pipe.load_lora_weights(PATH) before hfpatch.apply: a file, a folder or a "
        "hub id (default: none)",
    )
    speed.add_argument(
        "--quantize",
        type=parse_quantize,
        metavar="KIND",
        help="quantized denoisers, loaded with diffusers' quantizers: "
        + "; ".join(f"{k}: {v}" for k, v in QUANTIZE.items())
        + ". Sequence, CFG and Ring parallelism run on them exactly; --shard-weights shards the quantized rows of "
        "int8, GGUF and nf4 (default: none)",
    )


def requested_ranks(args: argparse.Namespace) -> tuple[int | None, str]:
    """``(ranks, how they were asked for)``: ``--parallel N``, the product of explicit degrees, or ``None``."""
    explicit = [name for name in (*DEGREES, "vae") if getattr(args, name) is not None]
    degrees = [name for name in DEGREES if getattr(args, name) is not None]
    if args.parallel is not None:
        return args.parallel, f"--parallel {args.parallel}"
    if not explicit:
        return None, ""
    if not degrees:  # --vae alone: the VAE-only plan, over --vae ranks
        return args.vae, f"--vae {args.vae}"
    return math.prod(getattr(args, name) for name in degrees), " ".join(
        f"--{n} {getattr(args, n)}" for n in degrees
    )
