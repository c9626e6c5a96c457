"""Which VAE classes hfpatch splits, and why the others are not split: ``hfpatch info``, the ``apply`` error on a
refused class, and the note a pipeline patch gives on its VAE (one process: no ranks needed)."""

from __future__ import annotations

import diffusers.models.autoencoders as autoencoders
import pytest
import torch

import hfpatch
from hfpatch.cli import info_lines
from hfpatch.core.registry import Registry
from hfpatch.patches import BUILTIN_FAMILIES, default_registry
from hfpatch.patches.vae.support import REFUSED, support_table
from hfpatch.testing import tiny_qwenimage_pipe
from hfpatch.testing.models import tiny_model

#: The VAEs of issue 36 (image and video) and the families that split them.
SPLIT = {
    "AutoencoderKL": "kl_vae",
    "AutoencoderKLWan": "wan_vae",
    "AutoencoderKLQwenImage": "qwenimage_vae",
    "AutoencoderKLQwenImage21": "qwenimage21_vae",
    "AutoencoderKLFlux2": "flux2_vae",
    "AutoencoderKLHunyuanImage": "hunyuanimage_vae",
    "AutoencoderKLHunyuanImageRefiner": "hunyuanimage_refiner_vae",
    "AutoencoderDC": "dc_ae",
    "AutoencoderKLHunyuanVideo": "hunyuanvideo_vae",
    "AutoencoderKLHunyuanVideo15": "hunyuanvideo15_vae",
    "AutoencoderKLLTXVideo": "ltx_vae",
    "AutoencoderKLLTX2Video": "ltx_vae",
    "AutoencoderKLCogVideoX": "cogvideox_vae",
    "AutoencoderKLMochi": "mochi_vae",
    "AutoencoderKLAllegro": "allegro_vae",
    "AutoencoderKLCosmos": "cosmos_vae",
}


def test_support_table_covers_every_autoencoder_class_with_a_family_or_a_reason():
    rows = dict(support_table())
    exported = {
        name
        for name in dir(autoencoders)
        if isinstance(getattr(autoencoders, name), type)
        and issubclass(getattr(autoencoders, name), torch.nn.Module)
    }
    assert set(rows) == exported
    for name, family in SPLIT.items():
        assert rows[name] == f"split by height ({family})", (name, rows[name])
    for key, reason in REFUSED.items():
        name = key.split(".", 1)[1]
        assert name in exported, f"{key} is refused but diffusers no longer exports it"
        assert rows[name] == f"not split ({reason})", name
        assert key not in dict(BUILTIN_FAMILIES), f"{key} is both split and refused"
    assert "no image height" in rows["AutoencoderOobleck"] and "ViT" in rows["AutoencoderKLMiniMaxH3"]
    lines = info_lines(classes=True)
    start = lines.index("VAE split by diffusers autoencoder class:")
    assert lines[start + 1 : start + 1 + len(rows)] == [f"  {n}: {how}" for n, how in sorted(rows.items())]
    summary = " ".join(info_lines())  # plain info: the VAE families as one entry, the classes counted
    assert f"VAE height split (vae), {len(SPLIT)} classes: " in summary, summary
    assert f"VAE split by height: {len(SPLIT)} of the {len(rows)} diffusers autoencoder classes" in summary


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_apply_to_a_refused_vae_states_the_reason():
    vae = autoencoders.AutoencoderOobleck(
        encoder_hidden_size=4, downsampling_ratios=[2], channel_multiples=[1], decoder_channels=4,
        decoder_input_channels=2, audio_channels=1,
    )  # fmt: skip
    with pytest.raises(
        TypeError,
        match=r"hfpatch does not split AutoencoderOobleck over ranks: an audio VAE .* no image height",
    ):
        hfpatch.apply(vae)


def test_a_pipeline_patch_says_whether_its_vae_is_split_and_why_not():
    pipe = tiny_qwenimage_pipe()
    with hfpatch.apply(pipe) as patch:  # one process: nothing to split
        assert patch.notes == [
            "vae: AutoencoderKLQwenImage not split: one VAE rank (ParallelConfig(vae=1) or a world of one)"
        ]
        assert "; vae: AutoencoderKLQwenImage not split: one VAE rank" in repr(patch)
        assert "note: vae: AutoencoderKLQwenImage not split: one VAE rank" in patch.describe()
    # A registry that refuses the class (the pipeline's family still applies): the reason is the note.
    registry = Registry()
    for key, family in BUILTIN_FAMILIES:
        if key == "diffusers.DiffusionPipeline":
            registry.register(key, family)
    registry.register_refusals({"diffusers.AutoencoderKLQwenImage": "a reason of the test"})
    with hfpatch.apply(pipe, registry=registry) as patch:
        assert patch.notes == ["vae: AutoencoderKLQwenImage not split: a reason of the test"]
    unknown = Registry()
    unknown.register("diffusers.DiffusionPipeline", "hfpatch.patches.pipeline.family:PipelineParallel")
    with hfpatch.apply(pipe, registry=unknown) as patch:
        assert patch.notes == [
            "vae: AutoencoderKLQwenImage not split: hfpatch has no split for this class yet"
        ]


def test_registry_refusals_match_along_the_mro_and_load_lazily():
    registry = Registry()
    registry.register_refusals("hfpatch.patches.vae.support:REFUSED")
    assert registry._refusal_sources  # nothing imported before the first lookup

    class Subclass(autoencoders.AutoencoderOobleck):
        pass

    assert registry.refusal_for_class(Subclass) == REFUSED["diffusers.AutoencoderOobleck"]
    assert registry.refusal(tiny_model("autoencoder_kl")) is None
    assert (
        default_registry()
        .refusal_for_class(autoencoders.AutoencoderKLMiniMaxH3)
        .startswith("its decoder is a ViT")
    )
