"""The video VAEs split by height (``test_video_vaes.py``): tiny stock models, inputs, references, split results.

One row per class (:data:`SPECS`): its :mod:`hfpatch.testing` tiny model, the latent (decode) and pixel (encode)
inputs of the fidelity cases (latent height 5: no world size of 2, 3 or 4 divides it) and the larger latent of
the memory case. References are computed once, in the test process (:func:`references`: the unpatched fp32
outputs and gradients, their fp32 rounding noise against an fp64 twin), and sent to the ranks, which compute
only the split results (:func:`split_case`): a world size costs the split runs alone.

Gradients are those of a fixed random projection of the output, the same loss on every rank; the input and
parameter gradients of the split VAE are taken after the documented reduction (parameter gradients averaged
over the VAE ranks with :func:`hfpatch.all_reduce_gradients`). Each tensor's error is relative to its fp64
gradient's largest entry, at least 1% of the largest of all (a gradient that is ~0, such as an attention key
bias, holds only rounding noise).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import hfpatch
from hfpatch import all_reduce_gradients
from hfpatch.distributed.collectives import count_comm
from hfpatch.patches.vae.family import analytic_split_bytes
from hfpatch.testing.memory import track_memory
from hfpatch.testing.models import tiny_model
from hfpatch.testing.tolerance import rel_error, rounding_noise, to_fp64


@dataclass(frozen=True)
class Spec:
    """A class's tiny model and inputs: ``latent``/``pixels`` shapes ``[B, C, T, H, W]`` (fidelity), ``memory``
    the latent of the memory and bytes case."""

    model: str
    latent: tuple[int, ...]
    pixels: tuple[int, ...]
    memory: tuple[int, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()
    memory_attrs: tuple[tuple[str, Any], ...] = ()
    memory_kwargs: tuple[tuple[str, Any], ...] = ()


SPECS: dict[str, Spec] = {
    "AutoencoderKLHunyuanVideo": Spec(
        "hunyuanvideo_vae", (1, 4, 2, 5, 3), (1, 3, 5, 40, 24), (1, 4, 2, 16, 4)
    ),
    "AutoencoderKLHunyuanVideo15": Spec(
        "hunyuanvideo15_vae", (1, 4, 2, 5, 3), (1, 3, 5, 20, 12), (1, 4, 2, 16, 4)
    ),
    # LTX-Video 0.9.1+ form: noise injection and timestep conditioning in the decoder.
    "AutoencoderKLLTXVideo": Spec(
        "ltx_vae",
        (1, 8, 2, 5, 2),
        (1, 3, 9, 160, 64),
        (1, 8, 2, 16, 2),
        (("decoder_inject_noise", (True, True, False, True, False)), ("timestep_conditioning", True)),
    ),
    "AutoencoderKLLTX2Video": Spec("ltx2_vae", (1, 8, 2, 5, 3), (1, 3, 9, 80, 48), (1, 8, 2, 16, 2)),
    "AutoencoderKLCogVideoX": Spec("cogvideox_vae", (1, 4, 3, 5, 3), (1, 3, 5, 10, 6), (1, 4, 3, 16, 4)),
    "AutoencoderKLMochi": Spec("mochi_vae", (1, 4, 2, 5, 3), (1, 3, 4, 10, 6), (1, 4, 2, 16, 4)),
    # Tiles of 5 x 5 latent rows and columns (the tiny row's). Memory: one tile of 16 x 16, at 32 channels: every
    # rank holds the whole tile output (gathered), the stock tile buffers and the output, 3 channels at full
    # resolution; at 8 channels they are a third of the decoder's activations and the peak is 0.65 (N = 2) and
    # 0.38 (N = 4) of unpatched, at 32 channels the decoder's activations dominate as in the real VAE (128-512).
    "AutoencoderKLAllegro": Spec(
        "allegro_vae",
        (1, 4, 2, 5, 5),
        (1, 3, 4, 10, 10),
        (1, 4, 2, 16, 16),
        memory_attrs=(("kernel", (4, 32, 32)), ("stride", (2, 28, 28))),
        memory_kwargs=(("block_out_channels", (32, 32)), ("norm_num_groups", 8)),
    ),
    "AutoencoderKLCosmos": Spec("cosmos_vae", (1, 4, 2, 5, 3), (1, 3, 5, 20, 12), (1, 4, 2, 16, 4)),
}
KINDS = ("decode", "encode")
_MODELS: dict[str, torch.nn.Module] = {}


def vae(name: str) -> torch.nn.Module:
    """The tiny stock VAE of ``SPECS[name]`` (built once per process, the same weights on every rank)."""
    if name not in _MODELS:
        spec = SPECS[name]
        _MODELS[name] = tiny_model(spec.model, **dict(spec.kwargs))
    return _MODELS[name]


def inputs(name: str, kind: str, shape: tuple[int, ...] | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(x, call kwargs)`` of a case: latents (decode) or pixels in [-1, 1] (encode), seeded."""
    spec = SPECS[name]
    g = torch.Generator().manual_seed(1)
    if kind == "decode":
        x = torch.randn(shape or spec.latent, generator=g)
        temb = {"temb": torch.tensor([0.05])} if dict(spec.kwargs).get("timestep_conditioning") else {}
        return x, temb
    return torch.rand(shape or spec.pixels, generator=g) * 2 - 1, {}


def run(model: torch.nn.Module, kind: str, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The decoded video or the latent mean (Cosmos: its identity posterior); the RNG is reseeded first (the LTX
    decoder draws noise from the global RNG, every run and every rank must draw the same)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        if kind == "decode":
            return model.decode(x, **kwargs).sample
        dist = model.encode(x, **kwargs).latent_dist
        return dist.mean if hasattr(dist, "mean") else dist.mode()


def _projection(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(3))


def _gradients(model: torch.nn.Module, kind: str, x: torch.Tensor, kwargs: dict) -> dict[str, torch.Tensor]:
    """Input and parameter gradients of the projected output (``"input"``, then parameter names)."""
    model.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_(True)
    out = run(model, kind, leaf, kwargs)
    (out * _projection(out.shape).to(out.dtype)).sum().backward()
    grads = {
        "input": leaf.grad,
        **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    }
    model.zero_grad(set_to_none=True)
    return grads


class _Fp32Draws(TorchFunctionMode):
    """``torch.randn(..., dtype=float64)`` drawn in fp32 and widened: the fp64 twin of a decoder that injects
    noise (LTX) then adds the same numbers as the fp32 model (CPU draws other numbers per dtype)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.randn and kwargs.get("dtype") == torch.float64:
            return func(*args, **{**kwargs, "dtype": torch.float32}).double()
        return func(*args, **kwargs)


@functools.cache
def references(name: str) -> dict[str, dict[str, Any]]:
    """Per kind: the unpatched fp32 output and its rounding noise vs fp64, fp32 and fp64 gradients."""
    model = vae(name)
    twin = to_fp64(model)
    refs = {}
    for kind in KINDS:
        x, kwargs = inputs(name, kind)
        kwargs64 = {k: v.double() for k, v in kwargs.items()}
        with torch.no_grad():
            out = run(model, kind, x, kwargs)
            with _Fp32Draws():
                out64 = run(twin, kind, x.double(), kwargs64)
        with _Fp32Draws():
            grads64 = _gradients(twin, kind, x.double(), kwargs64)
        refs[kind] = {
            "out": out,
            "noise": rounding_noise(out, out64),
            "grads": _gradients(model, kind, x, kwargs),
            "grads64": grads64,
        }
    return refs


def split_case(name: str, refs: dict[str, dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """On every rank: ``{kind: (error, noise)}`` of the split output and ``{kind_grad: (error, noise)}`` of its
    gradients, against the references; plus ``{kind_params: (parameters with a gradient, 0)}``."""
    model = vae(name)
    results: dict[str, tuple[float, float]] = {}
    for kind in KINDS:
        ref = refs[kind]
        x, kwargs = inputs(name, kind)
        with torch.no_grad(), hfpatch.apply(model):
            out = run(model, kind, x, kwargs)
        assert out.shape == ref["out"].shape, (name, kind, out.shape, ref["out"].shape)
        results[kind] = (rel_error(out, ref["out"]), ref["noise"])
        with hfpatch.apply(model):
            model.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_(True)
            out = run(model, kind, leaf, kwargs)
            (out * _projection(out.shape)).sum().backward()
            all_reduce_gradients(model)  # the documented reduction: MEAN over the VAE ranks
            got = {
                "input": leaf.grad,
                **{n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            }
            model.zero_grad(set_to_none=True)
        grads, grads64 = ref["grads"], ref["grads64"]
        assert got.keys() == grads.keys(), (name, kind, sorted(set(got) ^ set(grads)))
        floor = 0.01 * max(g.abs().max().item() for g in grads64.values())
        scales = {n: max(g.abs().max().item(), floor) for n, g in grads64.items()}
        error = max(rel_error(got[n], grads[n], scales[n]) for n in grads)
        noise = max(rel_error(grads[n], grads64[n], scales[n]) for n in grads)
        results[f"{kind}_grad"] = (error, noise)
        results[f"{kind}_params"] = (float(len(got) - 1), 0.0)
    return results


@contextmanager
def memory_setup(name: str) -> Iterator[torch.nn.Module]:
    """The VAE with the memory case's attributes set (Allegro: a larger tile, wider), restored after."""
    spec = SPECS[name]
    key = f"{name}/memory"
    if spec.memory_kwargs and key not in _MODELS:
        _MODELS[key] = tiny_model(spec.model, **dict(spec.kwargs), **dict(spec.memory_kwargs))
    model = _MODELS[key] if spec.memory_kwargs else vae(name)
    saved = {k: getattr(model, k) for k, _ in SPECS[name].memory_attrs}
    for k, v in SPECS[name].memory_attrs:
        setattr(model, k, v)
    try:
        yield model
    finally:
        for k, v in saved.items():
            setattr(model, k, v)


def unpatched_peak(name: str) -> int:
    """Peak live bytes of the stock decode of the memory case's latent (computed in the test process)."""
    x, kwargs = inputs(name, "decode", SPECS[name].memory)
    with memory_setup(name) as model, torch.no_grad(), track_memory() as mem:
        run(model, "decode", x, kwargs)
    return mem.peak_bytes


def memory_case(name: str) -> dict[str, Any]:
    """On every rank: the split decode's peak live bytes (local rows kept where the class allows it) and the
    bytes it sent by kind, against the analytic count of the unsplit shapes."""
    x, kwargs = inputs(name, "decode", SPECS[name].memory)
    output = "full" if name == "AutoencoderKLAllegro" else "shard"
    with memory_setup(name) as model, torch.no_grad(), hfpatch.apply(model, vae_output=output):
        analytic = analytic_split_bytes(model, lambda: run(model, "decode", x, kwargs), x.shape[-2])
        with track_memory() as mem, count_comm() as comm:
            run(model, "decode", x, kwargs)
    return {"peak": mem.peak_bytes, "sent": dict(comm.by_op), "analytic": analytic}


# ----------------------------------------------------------------------------------------------- modes, contract
#: Spatial tiles of a few latent rows (``enable_tiling`` arguments) and the latent to decode in tiles: a tile per
#: coder call (HunyuanVideo), tiles decoded frame batch by frame batch with their cache (CogVideoX: 5 latent
#: frames are two batches), coders returning ``(tile, cache)`` (Mochi).
TILED = {
    "AutoencoderKLHunyuanVideo": (dict(tile_sample_min_height=24, tile_sample_min_width=16,
                                       tile_sample_stride_height=16, tile_sample_stride_width=8), (1, 4, 2, 5, 3)),
    "AutoencoderKLCogVideoX": (dict(tile_sample_min_height=6, tile_sample_min_width=4), (1, 4, 5, 5, 3)),
    "AutoencoderKLMochi": (dict(tile_sample_min_height=6, tile_sample_min_width=4, tile_sample_stride_height=4,
                                tile_sample_stride_width=2), (1, 4, 2, 5, 3)),
}  # fmt: skip
#: HunyuanVideo decodes more than 4 latent frames in overlapping frame tiles by default (framewise).
FRAMEWISE = ("AutoencoderKLHunyuanVideo", (1, 4, 6, 5, 3))


@contextmanager
def tiling(name: str) -> Iterator[torch.nn.Module]:
    model = vae(name)
    model.enable_tiling(**TILED[name][0])
    try:
        yield model
    finally:
        model.disable_tiling()


def _latent(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(5))


@functools.cache
def mode_references() -> dict[str, Any]:
    """Stock tiled decodes, the framewise decode (output, noise vs fp64)."""
    refs: dict[str, Any] = {}
    with torch.no_grad():
        for name, (_, shape) in TILED.items():
            with tiling(name) as model:
                refs[f"{name}/tiled"] = run(model, "decode", _latent(shape), {})
        name, shape = FRAMEWISE
        z = _latent(shape)
        out = run(vae(name), "decode", z, {})
        refs["framewise"] = (out, rounding_noise(out, run(to_fp64(vae(name)), "decode", z.double(), {})))
    refs["precise"] = references("AutoencoderKLCogVideoX")["decode"]["out"]
    return refs


def _error(fn: Any) -> str:
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def contract_case(refs: dict[str, Any]) -> dict[str, Any]:
    """World 2: tiled and framewise decodes, approx mode, refusals, and patch removal restores every attribute."""
    res: dict[str, Any] = {"threads": torch.get_num_threads()}
    with torch.no_grad():
        for name, (_, shape) in TILED.items():
            with tiling(name) as model, hfpatch.apply(model):
                res[f"{name}/tiled"] = (
                    (run(model, "decode", _latent(shape), {}) - refs[f"{name}/tiled"]).abs().max()
                )
        name, shape = FRAMEWISE
        model = vae(name)
        snapshot = {path: dict(vars(m)) for path, m in model.named_modules()}
        with hfpatch.apply(model):
            out, noise = refs["framewise"]
            res["framewise"] = (rel_error(run(model, "decode", _latent(shape), {}), out), noise)
        res["identity"] = all(
            vars(m).keys() == snapshot[path].keys()
            and all(vars(m)[k] is v for k, v in snapshot[path].items())
            for path, m in model.named_modules()
        )
        x, kwargs = inputs("AutoencoderKLCogVideoX", "decode")
        with hfpatch.apply(vae("AutoencoderKLCogVideoX"), vae_mode="approx"):
            approx = run(vae("AutoencoderKLCogVideoX"), "decode", x, kwargs)
        res["approx"] = rel_error(approx, refs["precise"])
        # Mochi's framewise decoding pads no rows (stock: it shrinks the frames): refused at the call, alike.
        mochi = vae("AutoencoderKLMochi")
        x, _ = inputs("AutoencoderKLMochi", "decode")
        with hfpatch.apply(mochi):
            modes = {m: m.pad_mode for m in mochi.modules() if hasattr(m, "pad_mode")}
            mochi._enable_framewise_decoding()
            res["mochi_framewise"] = _error(lambda: mochi.decode(x))
            for m, mode in modes.items():
                m.pad_mode = mode
            mochi.use_framewise_decoding = False
        res["allegro_shard"] = _error(lambda: hfpatch.apply(vae("AutoencoderKLAllegro"), vae_output="shard"))
    hv = vae("AutoencoderKLHunyuanVideo")
    hv.enable_gradient_checkpointing()
    with hfpatch.apply(hv):
        z = _latent((1, 4, 2, 5, 3)).requires_grad_(True)
        res["checkpointing"] = _error(lambda: hv.decode(z))
    hv.disable_gradient_checkpointing()
    # The LTX decoder's noise comes from the global RNG: ranks whose RNG states differ are refused alike.
    ltx = vae("AutoencoderKLLTXVideo")
    x, kwargs = inputs("AutoencoderKLLTXVideo", "decode")
    with torch.no_grad(), hfpatch.apply(ltx), torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.distributed.get_rank())
        res["rng"] = _error(lambda: ltx.decode(x, **kwargs))
    return res
