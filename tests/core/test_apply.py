"""`hfpatch.apply` contract with toy families on real tiny diffusers objects (private registries)."""

from __future__ import annotations

import os

import pytest
import torch

import hfpatch
from hfpatch.core.registry import PatchFamily, Registry
from hfpatch.testing import tiny_autoencoder_kl, tiny_wan_pipe


class ScaleDecode(PatchFamily):
    """Toy family: multiplies decoder output by ``factor`` (an option)."""

    name = "scale_decode"
    options = {"factor": 2.0}
    role = "vae"

    def validate(self, target, config, options):
        if options["factor"] <= 0:
            raise ValueError(f"factor must be > 0, got {options['factor']}")

    def apply(self, target, patch, mesh, options):
        patch.wrap_method(target, "forward", lambda orig: lambda *a, **k: orig(*a, **k))
        patch.set_attr(target, "_toy_factor", options["factor"])


class Heads(PatchFamily):
    name = "heads"
    options = {"marker": None}

    def facts(self, target):
        return hfpatch.ModelFacts(num_heads=target.config.num_attention_heads, name=type(target).__name__)

    def apply(self, target, patch, mesh, options):
        for block in target.blocks:
            patch.swap_processor(block.attn1, object.__new__(type(block.attn1.processor)))


class NoOpPipeline(PatchFamily):
    name = "noop_pipeline"
    role = "pipeline"

    def apply(self, target, patch, mesh, options):
        pass


class Explodes(PatchFamily):
    name = "explodes"

    def apply(self, target, patch, mesh, options):
        patch.set_attr(target, "_half_done", True)
        raise RuntimeError("failure half-way through apply")


@pytest.fixture
def registry():
    reg = Registry()
    reg.register("diffusers.AutoencoderKL", ScaleDecode)
    return reg


def test_apply_unsupported_target_names_supported_classes(registry):
    with pytest.raises(TypeError) as info:
        hfpatch.apply(torch.nn.Linear(2, 2), registry=registry)
    assert str(info.value) == (
        "hfpatch has no patch for Linear (torch.nn.modules.linear); supported classes: AutoencoderKL"
    )


def test_apply_to_a_namesake_of_a_supported_class_names_both_modules(registry):
    """A trainer's own copy of a diffusers class (SimpleTuner ships its own ``WanTransformer3DModel``): the error
    names the copy's module and the supported class of the same name."""
    copy = type("AutoencoderKL", (torch.nn.Module,), {"__module__": "simpletuner.helpers.models.vae"})
    with pytest.raises(TypeError) as info:
        hfpatch.apply(copy(), registry=registry)
    assert str(info.value) == (
        "hfpatch has no patch for AutoencoderKL (simpletuner.helpers.models.vae); hfpatch supports "
        "diffusers.AutoencoderKL, another class of the same name: this one is not a subclass of it (a copy of its "
        "code in another package?). If it computes what that class does, `hfpatch.register_like(AutoencoderKL, "
        "diffusers.AutoencoderKL)` patches it as that class; supported classes: AutoencoderKL"
    )


def test_apply_unknown_option_is_type_error_listing_known(registry):
    with pytest.raises(TypeError) as info:
        hfpatch.apply(tiny_autoencoder_kl(), registry=registry, facter=3.0)
    assert str(info.value) == "unknown option 'facter' for AutoencoderKL; known: factor"


def test_apply_twice_same_options_returns_live_patch_different_raises(registry):
    vae = tiny_autoencoder_kl()
    first = hfpatch.apply(vae, registry=registry, factor=3.0)
    assert hfpatch.apply(vae, registry=registry, factor=3.0) is first
    with pytest.raises(ValueError, match="already patched"):
        hfpatch.apply(vae, registry=registry, factor=4.0)
    first.remove()
    second = hfpatch.apply(vae, registry=registry, factor=4.0)  # after remove a new apply works
    assert second is not first and vae._toy_factor == 4.0
    second.remove()


def test_apply_validation_error_leaves_target_untouched(registry):
    vae = tiny_autoencoder_kl()
    before = dict(vars(vae))
    with pytest.raises(ValueError, match="factor must be > 0, got -1"):
        hfpatch.apply(vae, registry=registry, factor=-1)
    assert dict(vars(vae)) == before and hfpatch.get_patch(vae) is None


def test_apply_failure_mid_mutation_rolls_back(registry):
    registry.register("diffusers.AutoencoderKL", Explodes)
    vae = tiny_autoencoder_kl()
    before = dict(vars(vae))
    with pytest.raises(RuntimeError, match="half-way"):
        hfpatch.apply(vae, registry=registry)
    assert vars(vae).keys() == before.keys() and all(vars(vae)[k] is v for k, v in before.items())


def test_apply_pipeline_patches_components_by_type_and_remove_restores_identity():
    reg = Registry()
    reg.register("diffusers.AutoencoderKLWan", ScaleDecode)  # matched by MRO key, not attribute name
    reg.register("diffusers.WanTransformer3DModel", Heads)
    reg.register("diffusers.DiffusionPipeline", NoOpPipeline)
    pipe = tiny_wan_pipe()
    processors = {name: block.attn1.processor for name, block in enumerate(pipe.transformer.blocks)}
    vae_vars = dict(vars(pipe.vae))
    patch = hfpatch.apply(pipe, registry=reg, factor=5.0)
    assert {child.name for child in patch.children} == {"AutoencoderKLWan", "WanTransformer3DModel"}
    assert pipe.vae._toy_factor == 5.0
    assert all(block.attn1.processor is not processors[i] for i, block in enumerate(pipe.transformer.blocks))
    assert hfpatch.get_patch(pipe.transformer) is not None
    with pytest.raises(ValueError, match="WanTransformer3DModel is already patched as part of WanPipeline"):
        hfpatch.apply(pipe.transformer, registry=reg, marker=1)
    patch.remove()
    assert all(block.attn1.processor is processors[i] for i, block in enumerate(pipe.transformer.blocks))
    assert vars(pipe.vae).keys() == vae_vars.keys() and all(
        vars(pipe.vae)[k] is v for k, v in vae_vars.items()
    )
    assert hfpatch.get_patch(pipe) is None and hfpatch.get_patch(pipe.vae) is None


def test_apply_plan_is_readable(registry):
    vae = tiny_autoencoder_kl()
    with hfpatch.apply(vae, registry=registry) as patch:
        assert patch.plan == hfpatch.ParallelConfig()
        text = repr(patch)  # one line: the object, the plan, the families that changed it
        assert text.startswith("<hfpatch.Patch AutoencoderKL (active): one rank") and "\n" not in text, text
        assert "scale_decode" in text and "factor" not in text, text  # options only when passed
        assert "_toy_factor" in patch.describe() and "factor': 2.0" in patch.describe()


def test_apply_many_ranks_without_launcher_explains_how_to_launch(registry, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    vae = tiny_autoencoder_kl()
    with pytest.raises(RuntimeError, match=r"torchrun --nproc-per-node 4 your_script.py"):
        hfpatch.apply(vae, parallel=4, registry=registry)
    assert hfpatch.get_patch(vae) is None


def _mismatched_world_case():
    reg = Registry()
    reg.register("diffusers.AutoencoderKL", ScaleDecode)
    vae = tiny_autoencoder_kl()
    try:
        hfpatch.apply(vae, parallel=4, registry=reg)
    except ValueError as exc:
        return str(exc), hfpatch.get_patch(vae) is None
    return "no error", False


def test_apply_wrong_world_size_raises_same_error_on_every_rank(rank_pool):
    results = rank_pool(2).run(_mismatched_world_case)
    assert results[0] == results[1]
    message, untouched = results[0]
    assert "uses 4 ranks" in message and "world size is 2" in message and untouched


def test_import_has_no_side_effects():
    import subprocess
    import sys

    code = (
        "import sys, torch; before = dict(vars(torch.nn.Module)); import hfpatch, hfpatch.training, "
        "hfpatch.testing; heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('diffusers', 'transformers', 'xformers', 'flash_attn', 'peft', 'accelerate')]; "
        "assert not heavy, heavy; assert dict(vars(torch.nn.Module)) == before; print('ok')"
    )
    env = {k: v for k, v in os.environ.items()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
