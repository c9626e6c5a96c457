"""Built-in patch families, one sub-package per kind of HF object they patch, imported lazily on first lookup.

* :mod:`hfpatch.patches.dit`: diffusers DiT transformers, sequence parallelism (USP) read from a table of plans;
* :mod:`hfpatch.patches.decoder`: transformers decoders (text LLMs and VLMs), sequence parallelism;
* :mod:`hfpatch.patches.pipefusion`: DiT transformers (Wan, Flux), PipeFusion;
* :mod:`hfpatch.patches.vae`: VAEs, encode and decode split by height;
* :mod:`hfpatch.patches.pipeline`: diffusers pipelines, CFG and data parallel;
* :mod:`hfpatch.patches.fsdp`: pipelines and DiT transformers, weights sharded with FSDP2.

A family imports the core, distributed and attention layers and the shared modules beside it, never another family
(``tests/test_imports.py``): :mod:`hfpatch.patches.caches` (diffusers' step caches, agreed over the ranks),
:mod:`hfpatch.patches.denoisers` (a pipeline's denoisers) and :mod:`hfpatch.patches.wan_attention` (the stock Wan
self-attention arithmetic). The block-causal streaming patch lives with the rest of streaming
(:mod:`hfpatch.streaming.transformer`).

Each entry of :data:`BUILTIN_FAMILIES` is ``(class key, "module:Family")``, each of :data:`BUILTIN_REFUSALS`
``(library or None, "module:TABLE")`` (class name, or class key without a library -> why it is not patched, read
when such a class is looked up); :func:`default_registry` (the registry ``hfpatch.apply`` uses) reads both tables,
so ``import hfpatch`` imports no diffusers or transformers module.
"""

from __future__ import annotations

from ..core.registry import Registry

#: The DiT transformer classes with a row in ``hfpatch.patches.dit.PLANS`` (a test keeps the two equal; listed here
#: so that looking a class up imports nothing from diffusers).
DIT_USP_CLASSES: tuple[str, ...] = (
    "FluxTransformer2DModel",
    "SD3Transformer2DModel",
    "CogVideoXTransformer3DModel",
    "HunyuanDiT2DModel",
    "PixArtTransformer2DModel",
    "WanTransformer3DModel",
    "QwenImageTransformer2DModel",
    "Flux2Transformer2DModel",
    "LTXVideoTransformer3DModel",
    "ChronoEditTransformer3DModel",
    "WanVACETransformer3DModel",
    "HunyuanVideoTransformer3DModel",
    "HunyuanVideo15Transformer3DModel",
    "LTX2VideoTransformer3DModel",
    "MiniMaxH3Transformer3DModel",
    "ChromaTransformer2DModel",
    "BriaTransformer2DModel",
    "BriaFiboTransformer2DModel",
    "LongCatImageTransformer2DModel",
    "OvisImageTransformer2DModel",
    "Flux3Transformer2DModel",
    "SkyReelsV2Transformer3DModel",
    "HunyuanImageTransformer2DModel",
    "CogView4Transformer2DModel",
    "ErnieImageTransformer2DModel",
    "Krea2Transformer2DModel",
    "GlmImageTransformer2DModel",
    "ZImageTransformer2DModel",
    "Lumina2Transformer2DModel",
    "PRXTransformer2DModel",
    "JoyImageEditTransformer3DModel",
    "JoyImageEditPlusTransformer3DModel",
    "MochiTransformer3DModel",
    "CosmosTransformer3DModel",
    "MotifVideoTransformer3DModel",
    "AnyFlowTransformer3DModel",
    "DiTTransformer2DModel",
    "CogView3PlusTransformer2DModel",
    "EasyAnimateTransformer3DModel",
    "AuraFlowTransformer2DModel",
    "ConsisIDTransformer3DModel",
    "Ideogram4Transformer2DModel",
    "HiDreamImageTransformer2DModel",
    "Kandinsky5Transformer3DModel",
    "HunyuanVideoFramepackTransformer3DModel",
    "StableAudioDiTModel",
    "Kandinsky6Transformer3DModel",
    "StableAudio3DiTModel",
    "MiniMaxMusic3Transformer1DModel",
    "LongCatAudioDiTTransformer",
)

#: The transformers classes with a row in ``hfpatch.patches.decoder.table.TARGETS`` (a test keeps the two equal;
#: listed here so that looking a class up imports nothing from transformers).
DECODER_USP_CLASSES: tuple[str, ...] = (
    "Qwen3ForCausalLM", "Qwen3Model", "LlamaForCausalLM", "LlamaModel",
    "Qwen3VLForConditionalGeneration", "Qwen3VLModel", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel",
    "Qwen2VLForConditionalGeneration", "Qwen2VLModel", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeModel",
    "Gemma3ForCausalLM", "Gemma3TextModel", "Gemma3ForConditionalGeneration", "Gemma3Model",
    "Gemma4ForCausalLM", "Gemma4TextModel", "Gemma4ForConditionalGeneration", "Gemma4Model",
    "MistralForCausalLM", "MistralModel", "MinistralForCausalLM", "MinistralModel",
    "Ministral3ForCausalLM", "Ministral3Model", "Mistral3ForConditionalGeneration", "Mistral3Model",
    "Glm4vForConditionalGeneration", "Glm4vModel", "Glm4vMoeForConditionalGeneration", "Glm4vMoeModel",
    "Glm46VForConditionalGeneration", "Glm46VModel", "InternVLForConditionalGeneration", "InternVLModel",
)  # fmt: skip

#: Trainers' own copies of diffusers DiT classes with a row in ``hfpatch.patches.dit.PLANS``, by class key (their
#: package, then the class name): SimpleTuner ships its own model code (``hfpatch.training.simpletuner``).
TRAINER_DIT_CLASSES: tuple[str, ...] = (
    "simpletuner.WanTransformer3DModel",
    "simpletuner.FluxTransformer2DModel",
    "simpletuner.LTXVideoTransformer3DModel",
)

BUILTIN_FAMILIES: list[tuple[str, str]] = [
    # Sequence-parallel attention (USP) for DiT transformers, plan-driven (hfpatch.patches.dit.PLANS:
    # diffusers' _cp_plan or hfpatch's table entry).
    *((f"diffusers.{name}", "hfpatch.patches.dit.family:PlannedDiTUSP") for name in DIT_USP_CLASSES),
    *((key, "hfpatch.patches.dit.family:PlannedDiTUSP") for key in TRAINER_DIT_CLASSES),
    # Sequence parallelism for transformers decoders (text LLMs and VLMs), through the attention interface.
    *((f"transformers.{name}", "hfpatch.patches.decoder.family:DecoderUSP") for name in DECODER_USP_CLASSES),
    # PipeFusion: blocks split over ranks, token patches pipelined with stale K/V.
    ("diffusers.WanTransformer3DModel", "hfpatch.patches.pipefusion.wan:WanPipeFusion"),
    ("diffusers.FluxTransformer2DModel", "hfpatch.patches.pipefusion.flux:FluxPipeFusion"),
    # Block-causal streaming with KV cache.
    ("diffusers.WanTransformer3DModel", "hfpatch.streaming.transformer:WanStreamingPatch"),
    # Patch-parallel VAEs.
    ("diffusers.AutoencoderKLWan", "hfpatch.patches.vae.wan:WanVAEParallel"),
    ("diffusers.AutoencoderKL", "hfpatch.patches.vae.kl:KLVAEParallel"),
    ("diffusers.AutoencoderKLFlux2", "hfpatch.patches.vae.kl:Flux2VAEParallel"),
    ("diffusers.AutoencoderKLQwenImage", "hfpatch.patches.vae.qwenimage:QwenImageVAEParallel"),
    ("diffusers.AutoencoderKLQwenImage21", "hfpatch.patches.vae.qwenimage:QwenImage21VAEParallel"),
    ("diffusers.AutoencoderKLHunyuanImage", "hfpatch.patches.vae.hunyuanimage:HunyuanImageVAEParallel"),
    (
        "diffusers.AutoencoderKLHunyuanImageRefiner",
        "hfpatch.patches.vae.hunyuanimage:HunyuanImageRefinerVAEParallel",
    ),
    ("diffusers.AutoencoderDC", "hfpatch.patches.vae.dc:DCAEParallel"),
    ("diffusers.AutoencoderKLHunyuanVideo", "hfpatch.patches.vae.hunyuan_video:HunyuanVideoVAEParallel"),
    (
        "diffusers.AutoencoderKLHunyuanVideo15",
        "hfpatch.patches.vae.hunyuan_video15:HunyuanVideo15VAEParallel",
    ),
    ("diffusers.AutoencoderKLLTXVideo", "hfpatch.patches.vae.ltx:LTXVideoVAEParallel"),
    ("diffusers.AutoencoderKLLTX2Video", "hfpatch.patches.vae.ltx:LTXVideoVAEParallel"),
    ("diffusers.AutoencoderKLCogVideoX", "hfpatch.patches.vae.cogvideox:CogVideoXVAEParallel"),
    ("diffusers.AutoencoderKLMochi", "hfpatch.patches.vae.mochi:MochiVAEParallel"),
    ("diffusers.AutoencoderKLAllegro", "hfpatch.patches.vae.allegro:AllegroVAEParallel"),
    ("diffusers.AutoencoderKLCosmos", "hfpatch.patches.vae.cosmos:CosmosVAEParallel"),
    # Weights sharded over ranks (FSDP2, option shard_weights): a pipeline's transformers and encoders, before
    # the CFG/data-parallel wrapper (which must call the sharded forward only where the transformer computes).
    ("diffusers.DiffusionPipeline", "hfpatch.patches.fsdp.sharding:WeightSharding"),
    # CFG / data parallel at the pipeline level.
    ("diffusers.DiffusionPipeline", "hfpatch.patches.pipeline.family:PipelineParallel"),
]

# ... and every DiT transformer applied on its own (after its other families: the sharded forward is outermost).
BUILTIN_FAMILIES += [
    (key, "hfpatch.patches.fsdp.sharding:WeightSharding")
    for key, family in list(BUILTIN_FAMILIES)
    if family == "hfpatch.patches.dit.family:PlannedDiTUSP"
]


#: Classes hfpatch does not patch, with the reason (``hfpatch.apply``'s error, a pipeline patch's notes,
#: ``hfpatch info``): ``(library, "module:NAME")`` of a mapping class name -> reason, or ``(None, ...)`` of class
#: key -> reason; read on the first lookup.
BUILTIN_REFUSALS: list[tuple[str | None, str]] = [
    ("diffusers", "hfpatch.patches.dit.plans:UNSUPPORTED"),
    (None, "hfpatch.patches.vae.support:REFUSED"),
    (None, "hfpatch.patches.decoder.table:REFUSED"),
]


_default: Registry | None = None


def default_registry() -> Registry:
    """The registry :func:`hfpatch.apply` uses, filled with the built-in families on first use."""
    global _default
    if _default is None:
        registry = Registry()
        for key, family in BUILTIN_FAMILIES:
            registry.register(key, family)
        for library, reasons in BUILTIN_REFUSALS:
            registry.register_refusals(reasons, library)
        _default = registry
    return _default
