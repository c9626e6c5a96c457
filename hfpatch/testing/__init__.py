"""Public testing support: tiny random-weight stock HF models, a multi-rank runner and a memory tracker.

Everything here runs on CPU without hub access, in well under a second per model; demos, examples and the
test-suite use it. Every builder seeds its own generator (``seed=``), so the same call gives the same
weights on every rank. The model builders import diffusers/transformers only when first used.

Tiny stock models (random weights, :mod:`hfpatch.testing.models`):

* VAEs: :func:`tiny_wan_vae` (``AutoencoderKLWan``, ``"2.1"`` or ``"2.2"``),
  :func:`tiny_autoencoder_kl` (``AutoencoderKL``).
* Transformers: :func:`tiny_wan_transformer`, :func:`tiny_flux_transformer` (inputs: :func:`flux_inputs`),
  :func:`tiny_sd3_transformer`,
  :func:`tiny_cogvideox_transformer`, :func:`tiny_qwenimage_transformer`, :func:`tiny_flux2_transformer`,
  :func:`tiny_ltx_transformer`, :func:`tiny_chronoedit_transformer`, :func:`tiny_hunyuanvideo_transformer`,
  :func:`tiny_wan_vace_transformer`, :func:`tiny_hunyuanvideo15_transformer`, :func:`tiny_ltx2_transformer`,
  :func:`tiny_minimax_h3_transformer`, :func:`tiny_hunyuandit_transformer`, :func:`tiny_pixart_transformer`.
* More transformers and their pipelines, described as data (one builder each): :mod:`hfpatch.testing.dits`
  (``TINY_DITS``, ``tiny_dit(name)``, ``tiny_dit_inputs(name)``; ``TINY_DIT_PIPES``, ``tiny_dit_pipe(name)``): Chroma,
  Bria, FLUX.3, SkyReels-V2, HunyuanImage, CogView4, Z-Image, Lumina 2, Mochi, Cosmos, HiDream and more.
* Pipelines (no text encoders: pass embeddings): :func:`tiny_wan_pipe` with :func:`wan_prompt_embeds`,
  :func:`tiny_sd3_pipe`, :func:`tiny_flux_pipe`, :func:`tiny_sdxl_pipe` (UNet), :func:`tiny_qwenimage_pipe`,
  :func:`tiny_ltx_pipe`, :func:`tiny_hunyuanvideo_pipe`, :func:`tiny_pixart_pipe`, :func:`tiny_hunyuandit_pipe`; with text encoders and in-memory tokenizers:
  :func:`tiny_flux_pipe_with_text_encoders`.
* Vision-language models: :func:`tiny_qwen2_vl`, :func:`tiny_qwen2_5_vl`, :func:`tiny_qwen3_vl` (``causal_lm=True``:
  the ``...ForConditionalGeneration`` class), with processor-style batches from :func:`qwen2_vl_inputs` and
  :func:`qwen3_vl_inputs`.
* Text decoders: :func:`tiny_qwen3_causal_lm`, :func:`tiny_llama_causal_lm`.
* Text encoders: :func:`tiny_bert`, :func:`tiny_clip_text_model` with :func:`tiny_clip_tokenizer`,
  :func:`tiny_t5_encoder` with :func:`tiny_t5_tokenizer`.
* The DiTs, VAEs and text models above are rows of ``hfpatch.testing.models.TINY_MODELS`` (class and config, as data);
  :func:`tiny_model` builds a row by name with config overrides.

Running and measuring:

* :func:`run_ranks` (one-shot) and :class:`RankPool` (N ranks kept alive): run a module-level function on
  N local gloo ranks and collect each rank's result; :class:`RankError` carries the ranks' tracebacks;
  :func:`spread`, inside the ranks, computes each of a list of values on one rank and shares them.
* :func:`track_memory`: peak bytes of the tensors created inside a ``with`` block, on any device.
* :mod:`hfpatch.testing.tolerance` (import it by name): tolerances for "patched equals unpatched" derived
  from fp32 rounding.

>>> import torch
>>> from hfpatch.testing import tiny_wan_vae, track_memory
>>> vae = tiny_wan_vae("2.1")
>>> with torch.no_grad(), track_memory() as mem:
...     video = vae.decode(torch.zeros(1, 4, 1, 4, 4)).sample
>>> tuple(video.shape), mem.peak_bytes > 0
((1, 3, 1, 32, 32), True)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from .memory import track_memory
    from .models import (
        flux_inputs,
        qwen2_vl_inputs,
        qwen3_vl_inputs,
        tiny_autoencoder_kl,
        tiny_bert,
        tiny_chronoedit_transformer,
        tiny_clip_text_model,
        tiny_clip_tokenizer,
        tiny_cogvideox_transformer,
        tiny_flux2_transformer,
        tiny_flux_pipe,
        tiny_flux_pipe_with_text_encoders,
        tiny_flux_transformer,
        tiny_hunyuandit_pipe,
        tiny_hunyuandit_transformer,
        tiny_hunyuanvideo15_transformer,
        tiny_hunyuanvideo_pipe,
        tiny_hunyuanvideo_transformer,
        tiny_llama_causal_lm,
        tiny_ltx2_transformer,
        tiny_ltx_pipe,
        tiny_ltx_transformer,
        tiny_minimax_h3_transformer,
        tiny_model,
        tiny_pixart_pipe,
        tiny_pixart_transformer,
        tiny_qwen2_5_vl,
        tiny_qwen2_vl,
        tiny_qwen3_causal_lm,
        tiny_qwen3_vl,
        tiny_qwenimage_pipe,
        tiny_qwenimage_transformer,
        tiny_sd3_pipe,
        tiny_sd3_transformer,
        tiny_sdxl_pipe,
        tiny_t5_encoder,
        tiny_t5_tokenizer,
        tiny_wan_pipe,
        tiny_wan_transformer,
        tiny_wan_vace_transformer,
        tiny_wan_vae,
        wan_prompt_embeds,
    )
    from .runner import RankError, RankPool, run_ranks, spread

# The public names, imported from their submodule on first access (PEP 562): the model builders pull in
# diffusers/transformers, which ``import hfpatch.testing`` must not. Every name of ``models.__all__`` is
# here (a test checks it); the ones not from ``.models`` are in ``_SUBMODULE``.
__all__ = [
    "RankError",
    "RankPool",
    "flux_inputs",
    "qwen2_vl_inputs",
    "qwen3_vl_inputs",
    "run_ranks",
    "spread",
    "tiny_autoencoder_kl",
    "tiny_bert",
    "tiny_chronoedit_transformer",
    "tiny_clip_text_model",
    "tiny_clip_tokenizer",
    "tiny_cogvideox_transformer",
    "tiny_flux2_transformer",
    "tiny_flux_pipe",
    "tiny_flux_pipe_with_text_encoders",
    "tiny_flux_transformer",
    "tiny_hunyuandit_pipe",
    "tiny_hunyuandit_transformer",
    "tiny_hunyuanvideo15_transformer",
    "tiny_hunyuanvideo_pipe",
    "tiny_hunyuanvideo_transformer",
    "tiny_llama_causal_lm",
    "tiny_ltx2_transformer",
    "tiny_ltx_pipe",
    "tiny_ltx_transformer",
    "tiny_minimax_h3_transformer",
    "tiny_model",
    "tiny_pixart_pipe",
    "tiny_pixart_transformer",
    "tiny_qwen2_5_vl",
    "tiny_qwen2_vl",
    "tiny_qwen3_causal_lm",
    "tiny_qwen3_vl",
    "tiny_qwenimage_pipe",
    "tiny_qwenimage_transformer",
    "tiny_sd3_pipe",
    "tiny_sdxl_pipe",
    "tiny_sd3_transformer",
    "tiny_t5_encoder",
    "tiny_t5_tokenizer",
    "tiny_wan_pipe",
    "tiny_wan_transformer",
    "tiny_wan_vace_transformer",
    "tiny_wan_vae",
    "track_memory",
    "wan_prompt_embeds",
]
_SUBMODULE = {
    "RankError": ".runner",
    "RankPool": ".runner",
    "run_ranks": ".runner",
    "spread": ".runner",
    "track_memory": ".memory",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_SUBMODULE.get(name, ".models"), __name__), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
