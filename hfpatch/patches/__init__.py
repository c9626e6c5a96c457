"""Built-in patch families: one module per HF target family, imported lazily on first lookup.

Each entry is ``(class key, "module:Family")``; :func:`hfpatch.core.registry.default_registry` reads this
table, so ``import hfpatch`` imports no diffusers or transformers module.
"""

BUILTIN_FAMILIES: list[tuple[str, str]] = [
    # Sequence-parallel attention (USP) for DiT transformers, plan-driven (hfpatch.patches.dit.PLANS:
    # diffusers' _cp_plan or hfpatch's table entry).
    ("diffusers.FluxTransformer2DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.SD3Transformer2DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.CogVideoXTransformer3DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.HunyuanDiT2DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.PixArtTransformer2DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.WanTransformer3DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.QwenImageTransformer2DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.Flux2Transformer2DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.LTXVideoTransformer3DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.ChronoEditTransformer3DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.WanVACETransformer3DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.HunyuanVideoTransformer3DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.HunyuanVideo15Transformer3DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.LTX2VideoTransformer3DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    ("diffusers.MiniMaxH3Transformer3DModel", "hfpatch.patches.dit:PlannedDiTUSP"),
    # Sequence parallelism for transformers decoders (text LLMs and Qwen-VL), through the attention interface.
    ("transformers.Qwen3ForCausalLM", "hfpatch.patches.decoder:DecoderUSP"),
    ("transformers.Qwen3Model", "hfpatch.patches.decoder:DecoderUSP"),
    ("transformers.LlamaForCausalLM", "hfpatch.patches.decoder:DecoderUSP"),
    ("transformers.LlamaModel", "hfpatch.patches.decoder:DecoderUSP"),
    ("transformers.Qwen3VLForConditionalGeneration", "hfpatch.patches.decoder:DecoderUSP"),
    ("transformers.Qwen3VLModel", "hfpatch.patches.decoder:DecoderUSP"),
    ("transformers.Qwen2_5_VLForConditionalGeneration", "hfpatch.patches.decoder:DecoderUSP"),
    ("transformers.Qwen2_5_VLModel", "hfpatch.patches.decoder:DecoderUSP"),
    ("transformers.Qwen2VLForConditionalGeneration", "hfpatch.patches.decoder:DecoderUSP"),
    ("transformers.Qwen2VLModel", "hfpatch.patches.decoder:DecoderUSP"),
    # PipeFusion: blocks split over ranks, token patches pipelined with stale K/V.
    ("diffusers.WanTransformer3DModel", "hfpatch.patches.pipefusion:WanPipeFusion"),
    ("diffusers.FluxTransformer2DModel", "hfpatch.patches.pipefusion_flux:FluxPipeFusion"),
    # Block-causal streaming with KV cache.
    ("diffusers.WanTransformer3DModel", "hfpatch.patches.wan_streaming:WanStreamingPatch"),
    # Patch-parallel VAEs.
    ("diffusers.AutoencoderKLWan", "hfpatch.patches.wan_vae:WanVAEParallel"),
    ("diffusers.AutoencoderKL", "hfpatch.patches.kl_vae:KLVAEParallel"),
    # Weights sharded over ranks (FSDP2, option shard_weights): a pipeline's transformers and encoders, before
    # the CFG/data-parallel wrapper (which must call the sharded forward only where the transformer computes).
    ("diffusers.DiffusionPipeline", "hfpatch.patches.fsdp:WeightSharding"),
    # CFG / data parallel at the pipeline level.
    ("diffusers.DiffusionPipeline", "hfpatch.patches.pipeline:PipelineParallel"),
]

# ... and every DiT transformer applied on its own (after its other families: the sharded forward is outermost).
BUILTIN_FAMILIES += [
    (key, "hfpatch.patches.fsdp:WeightSharding")
    for key, family in list(BUILTIN_FAMILIES)
    if family == "hfpatch.patches.dit:PlannedDiTUSP"
]
