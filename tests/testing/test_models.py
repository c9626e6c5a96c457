"""The tiny models' weights are pinned: the same factory and seed give bit-identical parameters, release to release.

Tests, examples and benchmarks compare against numbers computed from these models, and ranks rebuild them
independently (every rank must get the same weights), so a refactor of :mod:`hfpatch.testing.models` or
:mod:`hfpatch.testing.dits` must not change a single bit. The digests were computed before the factories
became data rows (``TINY_MODELS``) and must never change; a new factory adds a line. A pipeline's digest covers
every module component's state dict and every other component's public config.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import hfpatch.testing as T
from hfpatch.testing import dits

CASES = {
    "tiny_wan_transformer": lambda: T.tiny_wan_transformer(),
    "tiny_wan_transformer(seed=3,num_layers=1)": lambda: T.tiny_wan_transformer(seed=3, num_layers=1),
    "tiny_wan_vae('2.1')": lambda: T.tiny_wan_vae("2.1"),
    "tiny_wan_vae('2.2')": lambda: T.tiny_wan_vae("2.2"),
    "tiny_autoencoder_kl": lambda: T.tiny_autoencoder_kl(),
    "tiny_flux_transformer": lambda: T.tiny_flux_transformer(),
    "tiny_sd3_transformer": lambda: T.tiny_sd3_transformer(),
    "tiny_cogvideox_transformer": lambda: T.tiny_cogvideox_transformer(),
    "tiny_qwenimage_transformer": lambda: T.tiny_qwenimage_transformer(),
    "tiny_flux2_transformer": lambda: T.tiny_flux2_transformer(),
    "tiny_ltx_transformer": lambda: T.tiny_ltx_transformer(),
    "tiny_chronoedit_transformer": lambda: T.tiny_chronoedit_transformer(),
    "tiny_hunyuanvideo_transformer": lambda: T.tiny_hunyuanvideo_transformer(),
    "tiny_wan_vace_transformer": lambda: T.tiny_wan_vace_transformer(),
    "tiny_hunyuanvideo15_transformer": lambda: T.tiny_hunyuanvideo15_transformer(),
    "tiny_ltx2_transformer": lambda: T.tiny_ltx2_transformer(),
    "tiny_minimax_h3_transformer": lambda: T.tiny_minimax_h3_transformer(),
    "tiny_hunyuandit_transformer": lambda: T.tiny_hunyuandit_transformer(),
    "tiny_pixart_transformer": lambda: T.tiny_pixart_transformer(),
    "tiny_wan_pipe": lambda: T.tiny_wan_pipe(),
    "tiny_wan_pipe(two_transformers)": lambda: T.tiny_wan_pipe(two_transformers=True),
    "tiny_sd3_pipe": lambda: T.tiny_sd3_pipe(),
    "tiny_flux_pipe": lambda: T.tiny_flux_pipe(),
    "tiny_sdxl_pipe": lambda: T.tiny_sdxl_pipe(),
    "tiny_qwenimage_pipe": lambda: T.tiny_qwenimage_pipe(),
    "tiny_ltx_pipe": lambda: T.tiny_ltx_pipe(),
    "tiny_hunyuanvideo_pipe": lambda: T.tiny_hunyuanvideo_pipe(),
    "tiny_pixart_pipe": lambda: T.tiny_pixart_pipe(),
    "tiny_hunyuandit_pipe": lambda: T.tiny_hunyuandit_pipe(),
    "tiny_flux_pipe_with_text_encoders": lambda: T.tiny_flux_pipe_with_text_encoders(),
    "tiny_qwen2_vl": lambda: T.tiny_qwen2_vl(),
    "tiny_qwen2_vl(causal_lm)": lambda: T.tiny_qwen2_vl(causal_lm=True),
    "tiny_qwen2_5_vl": lambda: T.tiny_qwen2_5_vl(),
    "tiny_qwen3_vl": lambda: T.tiny_qwen3_vl(),
    "tiny_qwen3_vl(causal_lm)": lambda: T.tiny_qwen3_vl(causal_lm=True),
    "tiny_qwen3_causal_lm": lambda: T.tiny_qwen3_causal_lm(),
    "tiny_llama_causal_lm": lambda: T.tiny_llama_causal_lm(),
    "tiny_bert": lambda: T.tiny_bert(),
    "tiny_clip_text_model": lambda: T.tiny_clip_text_model(),
    "tiny_t5_encoder": lambda: T.tiny_t5_encoder(),
    # The VAEs split by height (issue 36), rows of TINY_MODELS without a factory of their own.
    **{
        f"tiny_model({row!r})": (lambda r: lambda: T.models.tiny_model(r))(row)
        for row in (
            "hunyuanvideo15_vae",
            "ltx2_vae",
            "cogvideox_vae",
            "mochi_vae",
            "allegro_vae",
            "cosmos_vae",
            "flux2_vae",
            "qwenimage21_vae",
            "hunyuanimage_vae",
            "hunyuanimage_refiner_vae",
            "autoencoder_dc",
        )
    },
    **{f"tiny_dit({name!r})": (lambda n: lambda: dits.tiny_dit(n))(name) for name in dits.TINY_DITS},
    **{
        f"tiny_dit_pipe({name!r})": (lambda n: lambda: dits.tiny_dit_pipe(n))(name)
        for name in dits.TINY_DIT_PIPES
    },
}

#: sha256 (first 16 hex digits) of each case, computed on the factories before they became rows (b7f6fbf + 5aeac19).
PINNED = {
    "tiny_wan_transformer": "14850a3d85cc31cd",
    "tiny_wan_transformer(seed=3,num_layers=1)": "d1d688a522368946",
    "tiny_wan_vae('2.1')": "c5a72cd829e424ca",
    "tiny_wan_vae('2.2')": "96a508be09858efb",
    "tiny_autoencoder_kl": "fdbba78afc2633ca",
    "tiny_flux_transformer": "47c102ec75d02c62",
    "tiny_sd3_transformer": "721ac59f00d2ac14",
    "tiny_cogvideox_transformer": "61ad4a43660184d7",
    "tiny_qwenimage_transformer": "80bf33ae7404ce53",
    "tiny_flux2_transformer": "1a11941e65106599",
    "tiny_ltx_transformer": "28686f4ffaa9bd61",
    "tiny_chronoedit_transformer": "b90830c3b93ea9db",
    "tiny_hunyuanvideo_transformer": "d85d36dc4622b5a4",
    "tiny_wan_vace_transformer": "869c83185a389a87",
    "tiny_hunyuanvideo15_transformer": "a16ae58626a524ae",
    "tiny_ltx2_transformer": "435b5284475fda87",
    "tiny_minimax_h3_transformer": "e8ba3239fe5ee7d2",
    "tiny_hunyuandit_transformer": "16ffe28492e4db5e",
    "tiny_pixart_transformer": "c5427864c2d4a371",
    "tiny_wan_pipe": "cde25aff8d6aa885",
    "tiny_wan_pipe(two_transformers)": "11595b8ff91f257b",
    "tiny_sd3_pipe": "35b41814d56eb1ed",
    "tiny_flux_pipe": "596920a5b84767d0",
    "tiny_sdxl_pipe": "9b5b99caacea8e00",
    "tiny_qwenimage_pipe": "a1c8d52993ece1ec",
    "tiny_ltx_pipe": "a880f11792f0d993",
    "tiny_hunyuanvideo_pipe": "7fd5fbe7985f931f",
    "tiny_pixart_pipe": "1a08068614e63e56",
    "tiny_hunyuandit_pipe": "0789c259f501eb84",
    "tiny_flux_pipe_with_text_encoders": "c993990269d0f732",
    "tiny_qwen2_vl": "96969b5afb4b43aa",
    "tiny_qwen2_vl(causal_lm)": "aaf18289d5bc7b7b",
    "tiny_qwen2_5_vl": "8819ac0494dcc983",
    "tiny_qwen3_vl": "22c62b65e554193d",
    "tiny_qwen3_vl(causal_lm)": "7fd9371d4330b2c2",
    "tiny_qwen3_causal_lm": "9bf87eb03cc4b19d",
    "tiny_llama_causal_lm": "96eaea5e6ea8d1c3",
    "tiny_bert": "0e2ed2608b4a08fc",
    "tiny_clip_text_model": "bce0690f58fd987e",
    "tiny_t5_encoder": "83b7732806cb4826",
    "tiny_model('hunyuanvideo15_vae')": "770d25d5783da00d",
    "tiny_model('ltx2_vae')": "26bf3880ba7bab9e",
    "tiny_model('cogvideox_vae')": "d0b5198db95fd90c",
    "tiny_model('mochi_vae')": "d04187ea949b9ce2",
    "tiny_model('allegro_vae')": "0e69c46625dd641e",
    "tiny_model('cosmos_vae')": "5ea805acc3f88bad",
    "tiny_model('flux2_vae')": "4037c7dec892199a",
    "tiny_model('qwenimage21_vae')": "7058cc4e8f4b91b8",
    "tiny_model('hunyuanimage_vae')": "f7f82792eec6c204",
    "tiny_model('hunyuanimage_refiner_vae')": "aeade2f1483edce2",
    "tiny_model('autoencoder_dc')": "de6b99ea5e58a99d",
    "tiny_dit('chroma')": "fc75eb5ffdb2b07e",
    "tiny_dit('bria')": "69e08eca20ef01e5",
    "tiny_dit('bria_fibo')": "5520d7b029c42f8d",
    "tiny_dit('longcat_image')": "69e08eca20ef01e5",
    "tiny_dit('ovis_image')": "e260ecee967c8a7b",
    "tiny_dit('chroma_mask')": "fc75eb5ffdb2b07e",
    "tiny_dit('flux3')": "6d49def4d5059e1c",
    "tiny_dit('skyreels_v2')": "e3dc7673449650a5",
    "tiny_dit('hunyuanimage')": "510cd2274928badc",
    "tiny_dit('cogview4')": "f5d8e8fcb1972014",
    "tiny_dit('ernie_image')": "f9d5fbbc2bfdec55",
    "tiny_dit('krea2')": "9b44da5315445196",
    "tiny_dit('glm_image')": "bb03e3e0aac3ebf0",
    "tiny_dit('zimage')": "79bf86f0374d0a16",
    "tiny_dit('lumina2')": "1fcbcacdb0a40d61",
    "tiny_dit('prx')": "2816ff6d11c2c56c",
    "tiny_dit('joyimage_edit')": "a24f1e4f37e41c4d",
    "tiny_dit('joyimage_edit_plus')": "a24f1e4f37e41c4d",
    "tiny_dit('mochi')": "a8362c0e28b3932e",
    "tiny_dit('cosmos')": "0c084005f9728be1",
    "tiny_dit('motif_video')": "c9b4581f9375b865",
    "tiny_dit('anyflow')": "ded3daade80dda5a",
    "tiny_dit('dit')": "41617473559a13f8",
    "tiny_dit('cogview3plus')": "f5d8e8fcb1972014",
    "tiny_dit('easyanimate')": "e3a273afd1875039",
    "tiny_dit('auraflow')": "7fc650244ac2fd30",
    "tiny_dit('consisid')": "2024110032cdc101",
    "tiny_dit('ideogram4')": "be10100bf5a26c96",
    "tiny_dit('hidream')": "d6e1d0ea5bb71720",
    "tiny_dit('kandinsky5')": "146d57091812638b",
    "tiny_dit('hunyuanvideo_framepack')": "1debf5036304b596",
    "tiny_dit('stable_audio')": "5b074715622fb755",
    "tiny_dit('kandinsky6')": "72dad336ae2527c1",
    "tiny_dit('stable_audio3')": "46984585523ef499",
    "tiny_dit('minimax_music3')": "3e7beb59c1767d51",
    "tiny_dit('longcat_audio')": "bb9a9b16bae4c8f2",
    "tiny_dit_pipe('cogview4')": "d5f3bd57fe1292bb",
    "tiny_dit_pipe('skyreels_v2')": "7498412aaaaffb0f",
    "tiny_dit_pipe('cogview3plus')": "b7a328e65f4c11e9",
    "tiny_dit_pipe('zimage')": "af36114a1b7a53f4",
}


def _digest_module(h, prefix: str, module: torch.nn.Module) -> None:
    for name, tensor in sorted(module.state_dict().items()):
        h.update(f"{prefix}{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())


def digest(obj) -> str:
    h = hashlib.sha256()
    if isinstance(obj, torch.nn.Module):
        _digest_module(h, "", obj)
    else:  # a pipeline
        for key, component in sorted(obj.components.items()):
            h.update(f"[{key}:{type(component).__name__}]".encode())
            if isinstance(component, torch.nn.Module):
                _digest_module(h, key + ".", component)
            elif component is not None and hasattr(component, "config"):  # private keys hold sets (unordered)
                public = {k: v for k, v in component.config.items() if not k.startswith("_")}
                h.update(json.dumps(public, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def test_every_case_is_pinned():
    assert set(CASES) == set(PINNED)


@pytest.mark.parametrize("case", sorted(PINNED))
def test_weights_are_pinned(case):
    assert digest(CASES[case]()) == PINNED[case]


def test_every_factory_and_row_is_covered():
    """Every public factory and every row of TINY_MODELS / TINY_DITS / TINY_DIT_PIPES is built by some case."""
    from hfpatch.testing import models

    tokenizers = {"tiny_clip_tokenizer", "tiny_t5_tokenizer"}
    builders = {n for n in models.__all__ if n.startswith("tiny_")} - tokenizers - {"tiny_model"}
    assert builders <= {case.split("(")[0] for case in CASES}
    rows_used = set()
    original = models.tiny_model

    def spy(name, *args, **kwargs):
        rows_used.add(name)
        return original(name, *args, **kwargs)

    models.tiny_model = spy
    try:
        for case in CASES.values():
            case()
    finally:
        models.tiny_model = original
    assert rows_used == set(models.TINY_MODELS)


def test_tiny_model_overrides_and_derived_fields():
    """Config arguments override a row; fields derived from the heads follow them unless given."""
    model = T.tiny_sd3_transformer(num_heads=2, head_dim=4)
    assert model.config.caption_projection_dim == 8
    assert T.tiny_sd3_transformer(caption_projection_dim=16).config.caption_projection_dim == 16
    with pytest.raises(ValueError, match="version must be"):
        T.tiny_wan_vae("3.0")
