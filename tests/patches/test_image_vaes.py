"""Height-split image VAEs vs the unpatched stock VAEs on gloo ranks: ``AutoencoderKLQwenImage``,
``AutoencoderKLQwenImage21``, ``AutoencoderKLFlux2``, ``AutoencoderKLHunyuanImage``,
``AutoencoderKLHunyuanImageRefiner`` and ``AutoencoderDC``.

One ``pool.run`` per world size carries every class's cases: decode and encode outputs, input and parameter
gradients (worlds 2, 3, 4, latent heights no world divides), and at worlds 2 and 4 the decode's peak memory per
rank and its bytes per rank against the analytic halo and all-gather volumes. A contract run at world 2 covers
tiling, ``vae_mode="approx"`` (its backward refused), DC-AE's quadratic-attention branch and training-mode
BatchNorm, the refusals, and a pipeline patch's note on its VAE.

Tolerances (``hfpatch.testing.tolerance``): the split reorders floating-point sums only (GroupNorm and BatchNorm
statistics merged over ranks, attention over gathered keys, DC-AE's ``V K^T`` summed over ranks, convolution
edge rows recomputed from slabs, gradients summed over ranks), so every case measures the unpatched fp32 VAE's
own rounding against an fp64 twin and allows ``reassociation_tol`` of it (``vae_helpers``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from vae_helpers import from_rank0, gradient_error, run, unpatched_reference

import hfpatch
from hfpatch.distributed.collectives import count_comm
from hfpatch.patches.vae.family import analytic_gather_bytes, analytic_halo_bytes
from hfpatch.testing.memory import track_memory
from hfpatch.testing.models import VAE_MEMORY_CONFIGS, tiny_model
from hfpatch.testing.tolerance import reassociation_tol, rel_error

#: tiny model row -> (frames: None for a 4D image, pixel rows per latent row, a latent height no world divides).
IMAGE_VAES: dict[str, tuple[int | None, int, int]] = {
    "qwenimage_vae": (1, 2, 5),
    "qwenimage21_vae": (1, 8, 5),
    "flux2_vae": (None, 2, 5),
    "hunyuanimage_vae": (None, 2, 5),
    "hunyuanimage_refiner_vae": (2, 4, 5),
    "autoencoder_dc": (None, 2, 11),  # its 5x5 attention projections need 2 latent rows on every rank
}
LATENT_W = 3
#: Latent height x width of the memory cases (the VAEs in their released proportions, VAE_MEMORY_CONFIGS).
MEMORY_LATENT = (12, 8)
_MODELS: dict[str, torch.nn.Module] = {}


def _vae(name: str) -> torch.nn.Module:
    if name not in _MODELS:
        _MODELS[name] = tiny_model(name)
    return _MODELS[name]


def _latents(name: str, height: int | None = None, width: int = LATENT_W) -> torch.Tensor:
    frames, _, latent_h = IMAGE_VAES[name]
    time = () if frames is None else (frames,)
    return torch.randn(1, 4, *time, height or latent_h, width, generator=torch.Generator().manual_seed(1))


def _pixels(name: str) -> torch.Tensor:
    frames, factor, latent_h = IMAGE_VAES[name]
    time = () if frames is None else (frames,)
    shape = (1, 3, *time, latent_h * factor, LATENT_W * factor)
    return torch.rand(shape, generator=torch.Generator().manual_seed(2)) * 2 - 1


def _peak(vae, z: torch.Tensor) -> int:
    with torch.no_grad(), track_memory() as mem:
        vae.decode(z)
    return mem.peak_bytes


def _split_cases(memory: bool) -> dict[tuple[str, str], tuple]:
    """Every class: (error, noise) of decode/encode outputs and gradients; with ``memory``, the decode's peak per
    rank (split, shard output) and unpatched, and its halo/all-gather bytes measured and analytic."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[tuple[str, str], tuple] = {}
    for name in IMAGE_VAES:
        vae = _vae(name)
        for kind, x in (("decode", _latents(name)), ("encode", _pixels(name))):
            reference, noise = unpatched_reference(vae, kind, x)
            with torch.no_grad(), hfpatch.apply(vae):
                result = run(vae, kind, x)
            assert result.shape == reference.shape, (name, kind, result.shape, reference.shape)
            out[(name, kind)] = (rel_error(result, reference), noise)
            error, noise, with_grad = gradient_error(vae, kind, x)
            out[(name, f"{kind}_grad")] = (error, noise, with_grad)
        if memory:
            vae = tiny_model(name, **VAE_MEMORY_CONFIGS[name])
            z = _latents(name, *MEMORY_LATENT)
            unpatched = from_rank0(_peak, vae, z)
            with torch.no_grad():
                halo = analytic_halo_bytes(vae, lambda z=z, vae=vae: vae.decode(z), rank, world)
                gather = analytic_gather_bytes(
                    vae, lambda z=z, vae=vae: vae.decode(z), MEMORY_LATENT[0], rank, world
                )
            with hfpatch.apply(vae, vae_output="shard"), count_comm() as comm:
                peak = _peak(vae, z)
            sent = comm.by_op
            out[(name, "memory")] = (
                peak / unpatched,
                sent.get("halo", 0),
                halo,
                sent.get("all_gather", 0),
                gather,
            )
    return out


#: The acceptance bounds of the decode's peak per rank vs unpatched.
MEMORY_LIMITS = {2: 0.6, 4: 0.35}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_image_vaes_split_equals_unpatched_with_gradients_memory_and_bytes(rank_pool, world):
    results = rank_pool(world).run(_split_cases, world in MEMORY_LIMITS)
    for rank, res in enumerate(results):
        for (name, case), values in res.items():
            if case == "memory":
                ratio, halo, halo_analytic, gather, gather_analytic = values
                assert ratio <= MEMORY_LIMITS[world], (world, rank, name, ratio)
                assert halo_analytic > 0 and halo == halo_analytic, (world, rank, name, halo, halo_analytic)
                assert gather == gather_analytic, (world, rank, name, gather, gather_analytic)
                continue
            error, noise = values[:2]
            assert error <= reassociation_tol(noise), (world, rank, name, case, error, noise)
            if case.endswith("_grad"):
                assert values[2] > 10, (
                    name,
                    case,
                    values,
                )  # the decoder's or encoder's parameters have grads
        assert len(res) == len(IMAGE_VAES) * (5 if world in MEMORY_LIMITS else 4), sorted(res)


#: tiny model row -> (enable tiling with tiles of a few latent rows, whether the stock tiled encode runs at that
#: size: the Flux.2, HunyuanImage and refiner encoders cannot encode tiles that small or 4D images).
TILING = {
    "qwenimage_vae": (lambda v: v.enable_tiling(4, 4, 2, 2), True),
    "qwenimage21_vae": (lambda v: v.enable_tiling(16, 16, 8, 8), True),
    "flux2_vae": (lambda v: (v.enable_tiling(), setattr(v, "tile_sample_min_size", 4)), False),
    "hunyuanimage_vae": (lambda v: v.enable_tiling(4), False),
    "hunyuanimage_refiner_vae": (lambda v: v.enable_tiling(16, 16, 12, 12), False),
    "autoencoder_dc": (lambda v: v.enable_tiling(4, 4, 2, 2), True),
}


def _contract() -> dict[str, object]:
    """World 2: tiling, approx (differs; backward refused), DC-AE's quadratic attention and training BatchNorm,
    refusals, and the note a pipeline patch gives on its VAE."""
    res: dict[str, object] = {}
    for name, (enable, encodes) in TILING.items():
        vae = tiny_model(name)
        z, x = _latents(name), _pixels(name)
        with torch.no_grad():
            exact = from_rank0(run, vae, "decode", z)
            with hfpatch.apply(vae, vae_mode="approx"):
                res[f"{name} approx"] = (run(vae, "decode", z) - exact).abs().max().item()
            enable(vae)
            if name == "flux2_vae":
                vae.tile_latent_min_size = 2
            tiled = from_rank0(
                lambda vae=vae, z=z, x=x, encodes=encodes: (
                    run(vae, "decode", z),
                    run(vae, "encode", x) if encodes else None,
                )
            )
            with hfpatch.apply(vae):
                res[f"{name} tiled decode"] = (run(vae, "decode", z) - tiled[0]).abs().max().item()
                if encodes:
                    res[f"{name} tiled encode"] = (run(vae, "encode", x) - tiled[1]).abs().max().item()
    for name in ("flux2_vae", "autoencoder_dc"):  # a DecoderOutput and a tensor from _decode
        vae = _vae(name)
        with hfpatch.apply(vae, vae_mode="approx"):
            out = run(vae, "decode", _latents(name))
            try:
                out.sum().backward()
                res[f"{name} approx backward"] = "no error"
            except RuntimeError as exc:
                res[f"{name} approx backward"] = str(exc)
        vae.zero_grad(set_to_none=True)

    # DC-AE's attention on a map of at most head_dim positions: the stock quadratic ReLU attention.
    quadratic = tiny_model("autoencoder_dc", attention_head_dim=16)
    z = _latents("autoencoder_dc", height=5)  # 15 positions <= 16
    reference, noise = unpatched_reference(quadratic, "decode", z)
    with torch.no_grad(), hfpatch.apply(quadratic):
        res["dc quadratic"] = (rel_error(run(quadratic, "decode", z), reference), noise)
    res["dc quadratic grad"] = gradient_error(quadratic, "decode", z)[:2]

    # Training-mode BatchNorm (the DC-AE decoder's batch_norm blocks): batch statistics merged over the ranks,
    # running statistics updated as the stock layer updates them.
    def train_step(patched: bool, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        vae = tiny_model("autoencoder_dc").to(dtype).train()
        leaf = _latents("autoencoder_dc").to(dtype).requires_grad_(True)
        patch = hfpatch.apply(vae) if patched else None
        out = vae.decode(leaf).sample
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(
            dtype
        )  # one draw for both
        (out * weights).sum().backward()
        if patch is not None:
            hfpatch.all_reduce_gradients(vae)
            patch.remove()
        stats = {n: b.clone() for n, b in vae.named_buffers() if "running" in n}
        grads = {n: p.grad for n, p in vae.named_parameters() if p.grad is not None}
        return {"output": out.detach(), "input grad": leaf.grad, **stats, **grads}

    reference, reference64 = from_rank0(lambda: (train_step(False), train_step(False, torch.float64)))
    split = train_step(True)
    scales = {n: max(t.abs().max().item(), 1e-6) for n, t in reference64.items()}
    res["dc train"] = (
        max(rel_error(split[n], reference[n], scales[n]) for n in reference),
        max(rel_error(reference[n], reference64[n], scales[n]) for n in reference),
    )
    res["dc train tracked"] = sorted(n for n in reference if "running" in n)
    res["dc batch norms"] = sorted(
        f"{n}.{b}"
        for n, m in tiny_model("autoencoder_dc").named_modules()
        if isinstance(m, torch.nn.BatchNorm2d)
        for b in ("running_mean", "running_var")
    )

    # Refusals: gradient checkpointing, a custom attention processor.
    refiner = tiny_model("hunyuanimage_refiner_vae")
    refiner.enable_gradient_checkpointing()
    with hfpatch.apply(refiner):
        try:
            refiner.decode(_latents("hunyuanimage_refiner_vae").requires_grad_(True))
            res["checkpointing"] = "no error"
        except ValueError as exc:
            res["checkpointing"] = str(exc)
    dc = tiny_model("autoencoder_dc")
    from diffusers.models.attention_processor import AttnProcessor

    dc.decoder.up_blocks[1][0].attn.processor = AttnProcessor()
    try:
        hfpatch.apply(dc)
        res["processor"] = "no error"
    except TypeError as exc:
        res["processor"] = str(exc)
    return res


def test_image_vaes_tiling_approx_quadratic_batch_norm_and_refusals(rank_pool):
    results = rank_pool(2).run(_contract)
    for res in results:
        for name, (_, encodes) in TILING.items():
            # Tiles run the stock tile code on the same inputs on some rank: bit-identical to one-process tiling.
            assert res[f"{name} tiled decode"] == 0.0, (name, res)
            assert not encodes or res[f"{name} tiled encode"] == 0.0, (name, res)
            assert res[f"{name} approx"] > 1e-3, (name, res)  # approx skips the halos: it must differ
        for name in ("flux2_vae", "autoencoder_dc"):
            message = res[f"{name} approx backward"]
            assert "vae_mode='approx', which is inference only" in message and "precise" in message, message
        for case in ("dc quadratic", "dc quadratic grad"):
            error, noise = res[case]
            assert error <= reassociation_tol(noise), (case, error, noise)
        error, noise = res["dc train"]  # outputs, gradients and the updated running statistics
        assert error <= reassociation_tol(noise), res["dc train"]
        assert res["dc train tracked"] == res["dc batch norms"] and res["dc batch norms"], res
        assert "gradient checkpointing re-runs blocks outside the split" in res["checkpointing"], res
        assert "attention processor AttnProcessor is not supported" in res["processor"], res
