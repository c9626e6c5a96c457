"""checkpointed_decode / checkpointed_encode and the time-chunked pixel loss on the stock AutoencoderKLWan
(Wan 2.1 and 2.2): equal to the stock one-shot call (outputs, input and weight gradients), unsplit and split
over 2 and 3 gloo ranks (time segments x height shards), memory bounded over frames, nothing left behind by
an error.

Tolerances (``hfpatch.testing.tolerance``): the time segments run the stock frame loop's operations on the
same values; only the order in which per-segment shares of the weight gradients are summed (and, split, the
reassociations of the height split) differ. Each quantity is compared within ``reassociation_tol`` of the
stock fp32 call's own rounding noise against an fp64 copy of the VAE and inputs. Weight gradients are each
relative to their fp64 gradient's largest entry, at least 1% of the largest of all (an attention key bias has
an exactly zero true gradient: its entries are rounding noise).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist
from gradcache_helpers import fp64_float

import hfpatch
from hfpatch import InputMismatchError
from hfpatch.testing import tiny_autoencoder_kl, tiny_wan_vae
from hfpatch.testing.memory import track_memory
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64
from hfpatch.training import checkpointed_decode, checkpointed_encode, chunked_pixel_loss


@functools.cache
def _vae(version: str):
    return tiny_wan_vae(version)  # trainable: weight gradients are compared too


def _factor(version: str) -> int:
    return 8 if version == "2.1" else 16


def _latents(frames: int, height: int = 2, width: int = 3, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 4, frames, height, width, generator=torch.Generator().manual_seed(seed))


def _video(version: str, frames: int, height: int = 2, width: int = 3, seed: int = 2) -> torch.Tensor:
    f = _factor(version)
    shape = (1, 3, frames, height * f, width * f)
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _decode(vae, z):
    return vae.decode(z).sample


def _encode(vae, x):
    return vae.encode(x).latent_dist.parameters  # the moments: mean and log-variance


def _step(vae, fn, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, input gradient and weight gradients of a fixed random projection of ``fn(vae, x)``."""
    vae.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(True)
    out = fn(vae, leaf)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in vae.named_parameters() if p.grad is not None}
    vae.zero_grad(set_to_none=True)
    return {"output": out.detach(), "input": leaf.grad, **grads}


def _errors(got: dict, ref: dict, exact: dict) -> tuple[float, float]:
    """(worst error of ``got`` vs ``ref``, ``ref``'s worst noise vs ``exact``), each relative to its scale."""
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    params = [n for n in exact if n not in ("output", "input")]
    floor = 0.01 * max(exact[n].abs().max().item() for n in params) if params else 0.0
    scales = {n: max(g.abs().max().item(), floor if n in params else 0.0) for n, g in exact.items()}
    error = max(rel_error(got[n], ref[n], scales[n]) for n in ref)
    noise = max(rel_error(ref[n], exact[n], scales[n]) for n in ref)
    return error, noise


@functools.cache
def _reference(version: str, kind: str, frames: int) -> tuple[dict, dict]:
    """The stock call's step and the same step in fp64 (its rounding noise)."""
    vae = _vae(version)
    fn, x = (_decode, _latents(frames)) if kind == "decode" else (_encode, _video(version, frames))
    with fp64_float():
        return _step(vae, fn, x), _step(to_fp64(vae), fn, x.double())


# ---------------------------------------------------------------------------------------------------------
# One process


@pytest.mark.parametrize(("frames_per_segment", "snapshot_every"), [(1, "auto"), (2, 1), (3, 2)])
@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_checkpointed_decode_equals_stock_decode(version, frames_per_segment, snapshot_every):
    vae = _vae(version)
    got = _step(
        vae,
        lambda v, z: (
            checkpointed_decode(
                v, z, frames_per_segment=frames_per_segment, snapshot_every=snapshot_every
            ).sample
        ),
        _latents(5),
    )
    ref, exact = _reference(version, "decode", 5)
    assert len(got) == len(ref) > 2  # output, latents and the decoder's weights
    error, noise = _errors(got, ref, exact)
    assert error <= reassociation_tol(noise), (error, noise)


@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_checkpointed_encode_equals_stock_encode(version):
    # 14 frames: as vae.encode, the 14th (past 1 + 4 * 3) is not encoded and gets a zero gradient.
    vae = _vae(version)
    for options in [{"frames_per_segment": 1}, {"frames_per_segment": 2, "snapshot_every": 1}]:
        encode = functools.partial(_checkpointed_moments, **options)
        got = _step(vae, encode, _video(version, 14))
        ref, exact = _reference(version, "encode", 14)
        assert got["output"].shape[2] == 4 and not got["input"][:, :, 13].any()
        error, noise = _errors(got, ref, exact)
        assert error <= reassociation_tol(noise), (options, error, noise)


def _checkpointed_moments(vae, x, **options):
    return checkpointed_encode(vae, x, **options).latent_dist.parameters


def _checkpointed_sample(vae, z, **options):
    return checkpointed_decode(vae, z, **options).sample


def test_checkpointed_decode_with_slicing_runs_items_apart():
    vae = _vae("2.1")
    vae.enable_slicing()
    try:
        got = _step(vae, lambda v, z: checkpointed_decode(v, z).sample, _latents(5))
    finally:
        vae.disable_slicing()
    ref, exact = _reference("2.1", "decode", 5)
    error, noise = _errors(got, ref, exact)
    assert error <= reassociation_tol(noise), (error, noise)


def test_checkpointed_decode_without_grad_is_the_stock_decode():
    vae = _vae("2.1")
    calls = []
    handle = vae.register_forward_pre_hook(lambda *a: calls.append(1))  # untouched: decode is not forward
    original = type(vae).decode
    seen = []

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("return_dict"))
        return original(self, *args, **kwargs)

    try:
        type(vae).decode = spy
        z = _latents(3)
        with torch.no_grad():
            out = checkpointed_decode(vae, z, return_dict=False)[0]
        frozen = tiny_wan_vae("2.1").requires_grad_(False)
        checkpointed_decode(frozen, z)  # grad enabled, but nothing requires it
    finally:
        type(vae).decode = original
        handle.remove()
    assert seen == [False, True] and not calls
    with torch.no_grad():
        assert torch.equal(out, vae.decode(z).sample)


def test_checkpointed_decode_bad_arguments_raise():
    vae = _vae("2.1")
    z = _latents(3).requires_grad_(True)
    with pytest.raises(TypeError, match="AutoencoderKLWan"):
        checkpointed_decode(tiny_autoencoder_kl(), z)
    with pytest.raises(ValueError, match=r"\[B, C, frames, H, W\]"):
        checkpointed_decode(vae, z[:, :, 0])
    with pytest.raises(ValueError, match="no frames"):
        checkpointed_encode(vae, _video("2.1", 0).requires_grad_(True))
    with pytest.raises(ValueError, match="frames_per_segment"):
        checkpointed_decode(vae, z, frames_per_segment=0)
    with pytest.raises(ValueError, match="snapshot_every"):
        checkpointed_decode(vae, z, snapshot_every=0)
    vae.enable_tiling()
    try:
        with pytest.raises(ValueError, match="disable_tiling"):
            checkpointed_decode(vae, z)
    finally:
        vae.disable_tiling()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_checkpointed_decode_error_leaves_no_frame_cache(where):
    # An out-of-memory error in the middle of the decoder. The time segments never use the VAE's own cache
    # (vae._feat_map), so nothing is left on the module; once the error is dropped, no tensor made by the call
    # is alive. The stock decode, failing the same way, keeps its decoded frames in vae._feat_map.
    vae = tiny_wan_vae("2.1").requires_grad_(False)
    conv = vae.decoder.up_blocks[1].resnets[0].conv1
    seen = []
    fails = {"forward": lambda: len(seen) == 4, "backward": lambda: seen.count(True) == 2}

    def fail(module, args):
        seen.append(torch.is_grad_enabled())
        if fails[where]():
            raise MemoryError("injected")

    def cached() -> list:
        return [t for t in getattr(vae, "_feat_map", None) or () if isinstance(t, torch.Tensor)]

    handle = conv.register_forward_pre_hook(fail)
    z = _latents(6, batch=1).requires_grad_(True)
    try:
        with track_memory() as memory:
            with pytest.raises(MemoryError, match="injected"):
                checkpointed_decode(vae, z).sample.square().sum().backward()
            assert not cached()
        assert memory.live_bytes == 0, memory.live_bytes
        seen.clear()
        where = "forward"
        with torch.no_grad(), pytest.raises(MemoryError, match="injected"):
            vae.decode(z)
        assert cached(), "the stock decode keeps its frame cache after the error"
    finally:
        handle.remove()
        vae.clear_cache()


# ---------------------------------------------------------------------------------------------------------
# Split over ranks: time segments x height shards


def _from_rank0(fn, *args):
    box = [fn(*args) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _pixel_case(version: str, frames: int):
    gen = torch.Generator().manual_seed(frames)
    f = _factor(version)
    latents = torch.randn(1, 4, frames, 3, 2, generator=gen)
    targets = torch.rand(1, 3, 1 + 4 * (frames - 1), 3 * f, 2 * f, generator=gen) * 2 - 1
    return latents, targets


def _pixel_step(vae, latents, targets, **kwargs) -> tuple[dict, int]:
    leaf = latents.clone().requires_grad_(True)
    with track_memory() as memory:
        loss = chunked_pixel_loss(vae, leaf, targets, **kwargs)
        loss.backward()
    return {"output": loss.detach(), "input": leaf.grad}, memory.peak_bytes


def _split_cases(version: str, trained: str, pixel_reference: tuple[dict, dict]) -> dict:
    """The split cases of ``version`` on this rank: {case: (error, noise)} and {frames: step peak bytes}.

    The pixel loss with default settings (frozen VAE, one video of 4 and 16 latent frames; ``pixel_reference``
    the unpatched step of 16 frames and its fp64 twin), and the ``trained`` call ("decode" or "encode") with a
    trainable VAE, weight gradients averaged over the ranks.
    """
    results, peaks = {}, {}
    frozen = tiny_wan_vae(version).requires_grad_(False)
    ref, exact = pixel_reference
    with hfpatch.apply(frozen):
        for frames in (4, 16):
            step, peaks[frames] = _pixel_step(frozen, *_pixel_case(version, frames))
        # Every rank computes the whole loss: targets that differ between ranks are refused on every rank.
        latents, targets = _pixel_case(version, 4)
        try:
            chunked_pixel_loss(frozen, latents.requires_grad_(True), targets + dist.get_rank())
            mismatch = None
        except InputMismatchError as error:
            mismatch = str(error)
    results["pixel loss, 16 latent frames"] = _errors(step, ref, exact)
    vae = tiny_wan_vae(version)
    stock, ours, x = {
        "decode": (_decode, _checkpointed_sample, _latents(5, height=3, batch=1)),
        "encode": (_encode, _checkpointed_moments, _video(version, 13, height=3)),
    }[trained]
    ref, exact = _from_rank0(_reference_step, vae, stock, x)
    with hfpatch.apply(vae):
        got = _step_averaged(vae, ours, x)
    results[trained] = _errors(got, ref, exact)
    return {"results": results, "peaks": peaks, "mismatch": mismatch}


@functools.cache
def _pixel_reference(version: str) -> tuple[dict, dict]:
    """The unpatched pixel-loss step of 16 latent frames and its fp64 twin, computed once in this process for
    both world sizes (the ranks build the same frozen VAE from the same seed)."""
    vae, (latents, targets) = tiny_wan_vae(version).requires_grad_(False), _pixel_case(version, 16)
    fp32 = _pixel_step(vae, latents, targets, reference=True)[0]
    with fp64_float():
        return fp32, _pixel_step(to_fp64(vae), latents.double(), targets.double(), reference=True)[0]


def _reference_step(vae, fn, x) -> tuple[dict, dict]:
    with fp64_float():
        return _step(vae, fn, x), _step(to_fp64(vae), fn, x.double())


def _step_averaged(vae, fn, x) -> dict:
    """``_step`` with the weight gradients averaged over the VAE ranks before they are read."""
    vae.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(True)
    out = fn(vae, leaf)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    (out * weights).sum().backward()
    hfpatch.all_reduce_gradients(vae)  # the documented reduction: the mean over the VAE ranks
    grads = {n: p.grad.clone() for n, p in vae.named_parameters() if p.grad is not None}
    vae.zero_grad(set_to_none=True)
    return {"output": out.detach(), "input": leaf.grad, **grads}


@pytest.mark.parametrize(
    ("world", "version", "trained"),
    [(2, "2.1", "decode"), (2, "2.2", "encode"), (3, "2.1", "encode"), (3, "2.2", "decode")],
)
def test_split_wan_vae_time_segments_equal_unpatched_and_bounded(rank_pool, world, version, trained):
    # Latent height 3: shards of 2 + 1 rows (world 2) or 1 + 1 + 1 (world 3). Each time segment is a split
    # call of its own; its recompute in backward replays the same collectives in the same order on every
    # rank (a mismatch would hang or corrupt the halos, failing the comparison). The acceptance: loss
    # and latent gradient equal the unpatched one-shot step, and each rank's step peak grows at most 2x from 4
    # to 16 latent frames with default settings (measured 1.21-1.30x). Decode and encode with a trainable VAE
    # (weights averaged over the ranks) are each checked at one world size.
    reference = _pixel_reference(version)
    for rank, out in enumerate(rank_pool(world).run(_split_cases, version, trained, reference)):
        assert len(out["results"]) == 2
        assert out["mismatch"] is not None and "targets_0" in out["mismatch"], out["mismatch"]
        for case, (error, noise) in out["results"].items():
            assert error <= reassociation_tol(noise), (world, rank, case, error, noise)
        growth = out["peaks"][16] / out["peaks"][4]
        print(f"world {world} rank {rank} wan {version}: step peak 4 -> 16 latent frames {growth:.2f}x")
        assert growth <= 2.0, (world, rank, out["peaks"])


# ---------------------------------------------------------------------------------------------------------
# AutoencoderKLCogVideoX: its stock batches (2 latent / 8 pixel frames, the first takes the remainder) are the
# time segments, carrying its conv_cache; given as the VAE or its bound ``vae.decode``.


@functools.cache
def _cogvideox():
    from hfpatch.testing.models import tiny_model

    return tiny_model("cogvideox_vae")


def _cog_reference(kind: str, x: torch.Tensor) -> tuple[dict, dict]:
    vae = _cogvideox()
    with fp64_float():
        fn = _decode if kind == "decode" else _encode
        return _step(vae, fn, x), _step(to_fp64(vae), fn, x.double())


def test_checkpointed_cogvideox_equals_stock_decode_and_encode():
    # 5 latent frames: batches [0, 3) and [3, 5); 17 pixel frames: [0, 9) and [9, 17) (9 latent frames).
    vae = _cogvideox()
    z = _latents(5, height=3, batch=1)
    video = torch.rand(1, 3, 17, 6, 4, generator=torch.Generator().manual_seed(2)) * 2 - 1
    for name, kind, fn, x in [
        ("decode (the VAE)", "decode", lambda v, z: checkpointed_decode(v, z).sample, z),
        (
            "decode (bound)",
            "decode",
            lambda v, z: checkpointed_decode(v.decode, z, snapshot_every=1).sample,
            z,
        ),
        ("encode", "encode", _checkpointed_moments, video),
    ]:
        got = _step(vae, fn, x)
        ref, exact = _cog_reference(kind, x)
        assert got["output"].shape == ref["output"].shape and len(got) == len(ref) > 2, name
        error, noise = _errors(got, ref, exact)
        assert error <= reassociation_tol(noise), (name, error, noise)
    assert got["output"].shape[2] == 9


def test_chunked_pixel_loss_cogvideox_bound_decode_bounded_over_frames(caplog):
    # A frozen CogVideoX VAE given as its bound vae.decode: from 3 to 11 latent frames (1 to 5 batches) the
    # one-shot step's peak grows with the frames, the batch-chunked step's stays within 2x, same loss and latent
    # gradient. A lambda hides the VAE: decoded whole, with a warning once for videos over OPAQUE_FRAMES frames.
    from hfpatch.training.pixel_loss import _WARNED, OPAQUE_FRAMES

    vae = _cogvideox().requires_grad_(False)
    peaks, steps = {}, {}
    try:
        for frames in (3, 11):
            gen = torch.Generator().manual_seed(frames)
            latents = torch.randn(1, 4, frames, 4, 3, generator=gen)
            targets = torch.rand(1, 3, 2 * frames - 1 + (frames % 2 == 0), 8, 6, generator=gen) * 2 - 1
            for mode, kwargs in [("one-shot", {"reference": True}), ("hfpatch", {})]:
                leaf = latents.clone().requires_grad_(True)
                with track_memory() as memory:
                    loss = chunked_pixel_loss(vae.decode, leaf, targets, **kwargs)
                    loss.backward()
                peaks[mode, frames], steps[mode, frames] = memory.peak_bytes, (loss.detach(), leaf.grad)
        _WARNED.clear()
        with caplog.at_level(logging.WARNING, logger="hfpatch.training.pixel_loss"):
            for _ in range(2):
                chunked_pixel_loss(lambda z: vae.decode(z).sample, latents.requires_grad_(True), targets)
    finally:
        vae.requires_grad_(True)
    warnings = [r.getMessage() for r in caplog.records if "cannot see into" in r.getMessage()]
    assert frames > OPAQUE_FRAMES and len(warnings) == 1 and "11 latent frames" in warnings[0], warnings
    one_shot = peaks["one-shot", 11] / peaks["one-shot", 3]
    ours = peaks["hfpatch", 11] / peaks["hfpatch", 3]
    print(f"cogvideox peak 3 -> 11 latent frames: one-shot {one_shot:.2f}x, hfpatch {ours:.2f}x")
    assert one_shot >= 2.5 and ours <= 2.0, peaks
    leaf = latents.detach().double().requires_grad_(True)
    with fp64_float():
        exact = chunked_pixel_loss(to_fp64(vae).decode, leaf, targets.double(), reference=True)
        exact.backward()
    for got, ref, truth in zip(steps["hfpatch", 11], steps["one-shot", 11], (exact.detach(), leaf.grad)):
        error, noise = rel_error(got, ref), rel_error(ref, truth)
        assert error <= reassociation_tol(noise), (error, noise)
