"""The public surface of hfpatch: ``hfpatch.__all__`` and the ``__all__`` of every public module, as they were
before ``hfpatch/patches/`` was regrouped into one sub-package per target (issue 35), recorded as data, plus the
names and modules added on purpose since (each addition is a change of this table).

A public module is one whose dotted name has no ``_``-prefixed part. Every one of them still imports under its
name, with the same ``__all__`` and every name of it defined, except the four that moved into a package of their
target (:data:`MOVED`), which keep their ``__all__`` at the new path. A name added to or removed from a public
``__all__``, or a public module renamed, is a change of this table, made on purpose.
"""

from __future__ import annotations

import importlib

import pytest

#: Module -> its sorted ``__all__``, space-separated (``None``: a package without one), recorded before the
#: regrouping.
PUBLIC: dict[str, str | None] = {
    "hfpatch": (
        "ApplyMismatchError CollectiveError InputMismatchError LoadError ModelFacts ParallelConfig Patch "
        "PatchError PatchFamily StepRNG WeightMismatchError __version__ all_reduce_gradients apply "
        "data_parallel_loaders data_parallel_sampler from_pretrained get_patch prepare_accelerator "
        "register_ddp_hook register_like register_patch step_generator step_rng"
    ),
    "hfpatch.api": "ApplyMismatchError WeightMismatchError apply get_patch plan_of",  # plan_of: issue 48
    "hfpatch.loading": "LoadError from_pretrained",
    "hfpatch.generate": (
        "CACHES ModelInfo UsageError add_arguments check_arguments check_model inspect_model load_pipeline main "
        "mp4_unavailable parse_cache parse_quantize quantize_arguments requested_ranks run_report write_outputs"
    ),
    "hfpatch.attention": (
        "AttentionBackend available_backends head_sizes local_attention merge_attention merge_blocks "
        "padded_len register_backend ring_attention shard_len shard_positions shard_sequence sp_index "
        "ulysses_attention unshard_sequence usp_attention"
    ),
    "hfpatch.attention.exchange": (
        "ExchangeConfig PendingExchange copy_minimum project_heads_to_sequence start_sequence_to_heads"
    ),
    "hfpatch.attention.layout": (
        "group_rank group_size head_sizes pad_sequence padded_len shard_len shard_positions shard_sequence "
        "sp_index unshard_sequence valid_prefix"
    ),
    "hfpatch.attention.local": (
        "AttentionBackend accum_dtype available_backends local_attention local_attention_backward "
        "register_backend resolve_backend to_layout"
    ),
    "hfpatch.attention.masked": (
        "CausalMask DenseMask TileMask classify_tile kv_repeats masked_usp_attention ring_work"  # ring_work: issue 49
    ),
    "hfpatch.attention.merge": "merge_attention merge_blocks",
    "hfpatch.attention.ring": "ring_attention",
    "hfpatch.attention.sharded_keys": "sharded_keys_attention",
    "hfpatch.attention.ulysses": "gather_joint_heads heads_to_sequence sequence_to_heads slice_joint_heads",
    "hfpatch.attention.usp": "sdpa_bshd ulysses_attention usp_attention usp_attention_joined",
    "hfpatch.attention.zigzag": "ZigzagLayout ZigzagMask",  # issue 49
    "hfpatch.cli": "benchmark_dir benchmarks build_parser info_lines main",
    "hfpatch.core": None,
    "hfpatch.core.compile": (
        "check_compile_backend check_cuda_graphs compile_function compiled_variant fresh_copy"
    ),
    "hfpatch.core.config": "ModelFacts ParallelConfig crosses_nodes plan_parallel resolve_parallel",
    "hfpatch.core.dropout": "active_dropouts refuse_dropout",  # issue 51: dropout inside a split forward
    "hfpatch.core.patch": "ABSENT MARKER Patch PatchError get_patch",
    "hfpatch.core.ranks": (  # peer_access, topology: issue 48
        "data_coordinates data_position launched_world_size node_size peer_access rank topology world_size"
    ),
    "hfpatch.core.registry": "LikeRegistration PatchFamily Registry class_key register_like",
    "hfpatch.core.wrappers": "unwrap_model unwrap_once",
    "hfpatch.demo": (
        "DEFAULT_ATOL DemoResult MAX_DEMO_NPROC MAX_SELFTEST_NPROC demo_limit_reason demo_rank "
        "exactness_lines format_report format_selftest run_demo run_selftest selftest_rank "
        "sequence_parallel_plan"
    ),
    "hfpatch.distributed": None,
    "hfpatch.distributed.agreement": (
        "FIELDS InputMismatchError SLOTS WeightMismatchError WeightWatch bulk_digest bytes_per_check "
        "check_same_inputs compared_as_files content_digest describe_inputs install_call_guard named_arguments "
        "weight_digests weight_watch_of weights_mismatch_message"
    ),
    "hfpatch.distributed.collectives": (
        "CommCounter PendingP2P all_gather all_reduce_sum all_to_all count_comm even_sizes halo_exchange "
        "reduce_scatter ring_shift start_p2p"
    ),
    "hfpatch.distributed.data": (
        "StepRNG data_coordinates data_parallel_loaders data_parallel_position data_parallel_sampler "
        "prepare_accelerator step_generator step_rng step_seed"
    ),
    "hfpatch.distributed.gradients": (
        "all_reduce_gradients grad_averaged_over_group grad_scaled_by_group grads_averaged_over_group "
        "register_ddp_hook"
    ),
    "hfpatch.distributed.traffic": "KINDS StepShape across inside step_traffic",  # issue 48
    "hfpatch.distributed.liveness": "BEAT_S WINDOW_S ensure_heartbeat silent_ranks stop_heartbeat",  # issue 48
    "hfpatch.distributed.stored": (  # issue 50
        "RowSplit UnsupportedTensorError class_path get_part is_plain quantized_kind rebuilt row_split set_part "
        "storage_stamp stored_bytes stored_tensors"
    ),
    "hfpatch.distributed.runtime": (
        "AXES CollectiveError ParallelMesh axis_group axis_ranks check_launch_agrees collective_error default_timeout "
        "describe_group ensure_process_group exchange get_mesh is_peer_failure launched_world_size rank "
        "wait_timeout world_size"
    ),
    "hfpatch.patches": None,
    "hfpatch.patches.caches": "CACHE_HOOKS FirstBlockDecision agree_caches cache_names check_caches",
    "hfpatch.patches.checkpoint": (
        "CheckpointSource TensorEntry attach_source detach_source load_tensors shard_rows source_of"
    ),
    "hfpatch.patches.decoder": (
        "DECODERS DecoderUSP ModelMask ORDERS REFUSED TARGETS decoder_of frame_split output_shard sequence_order "
        "sequence_sum shard_tokens support_table vision_of"  # REFUSED TARGETS support_table: issue 49
    ),
    "hfpatch.patches.decoder.adapt": "ADAPTATIONS adapt",  # issue 49
    "hfpatch.patches.decoder.moe": "RouterLogits exact_load_balancing_loss install_exact_aux_loss",  # issue 49
    "hfpatch.patches.decoder.table": (  # issue 49
        "DECODERS DECODER_NEEDS FRAME_TOWERS REFUSED TARGETS Target VISION support_markdown support_table"
    ),
    "hfpatch.patches.dit": (
        "AttentionRoute DiTPlan PLANS PlannedDiTUSP UNSUPPORTED USPDispatchProcessor USPSDPAProcessor "
        "plan_from_cp plan_source"
    ),
    "hfpatch.patches.dit.streams": "ReplicatedStreams install_streams units",  # added by issue 34
    "hfpatch.patches.fsdp": (
        "GatheredPeak SHARD_OPTIONS WeightSharding gathered_parameter_bytes parameter_bytes shard_axes "
        "shard_units sharded_models"
    ),
    "hfpatch.patches.kl_vae": "Flux2VAEParallel KLVAEParallel",
    "hfpatch.patches.pipefusion": (
        "PIPEFUSION_OPTIONS PipeFusionAttnProcessor PipeFusionState PipeFusionWanAttnProcessor "
        "WanPipeFusion check_pipefusion_options parameter_bytes"
    ),
    "hfpatch.patches.pipefusion_flux": (
        "FluxPipeFusion PipeFusionFluxAttnProcessor apply_flux_pipefusion block_bytes flux_blocks"
    ),
    "hfpatch.patches.pipeline": (
        "BATCHED_CFG_PIPELINES DENOISER_NAMES PER_SAMPLE_ARGS PipelineParallel TWO_CALL_CFG_PIPELINES "
        "generic_split"
    ),
    "hfpatch.patches.wan_streaming": "StreamingConfig WanStreamingPatch",
    "hfpatch.patches.wan_vae": "WanVAEParallel",
    # Added by issue 36 (the image VAEs).
    "hfpatch.patches.vae.dc": "DCAEParallel",
    "hfpatch.patches.vae.hunyuanimage": "HunyuanImageRefinerVAEParallel HunyuanImageVAEParallel",
    "hfpatch.patches.vae.qwenimage": "QwenImage21VAEParallel QwenImageVAEParallel",
    "hfpatch.patches.vae.support": "REFUSED support_table",
    "hfpatch.streaming": (
        "ChunkInfo CrossAttentionCache StreamingConfig StreamingKVCache StreamingOutput "
        "StreamingTrainingModel StreamingWanDecoder StreamingWanPipeline convert_diffusers_to_native "
        "convert_native_to_diffusers recache visible_frames warp_denoising_steps"
    ),
    "hfpatch.streaming.convert": "convert_diffusers_to_native convert_native_to_diffusers",
    "hfpatch.streaming.kv_cache": "CrossAttentionCache StreamingConfig StreamingKVCache visible_frames",
    "hfpatch.streaming.pipeline": "StreamingOutput StreamingWanPipeline recache warp_denoising_steps",
    "hfpatch.streaming.sequence_parallel": (  # added by issue 37 (streaming on several GPUs)
        "BlockCausalMask StreamShard block_bytes contiguous_layout frame_layout ring_block_tokens ring_read_index "
        "shard_text"
    ),
    "hfpatch.streaming.training": "ChunkInfo StreamingTrainingModel",
    "hfpatch.streaming.vae": "StreamingWanDecoder",
    "hfpatch.testing": (
        "RankError RankPool flux_inputs qwen2_vl_inputs qwen3_vl_inputs run_ranks spread tiny_autoencoder_kl tiny_bert "
        "tiny_chronoedit_transformer tiny_clip_text_model tiny_clip_tokenizer tiny_cogvideox_transformer "
        "tiny_flux2_transformer tiny_flux_pipe tiny_flux_pipe_with_text_encoders tiny_flux_transformer "
        "tiny_hunyuandit_pipe tiny_hunyuandit_transformer tiny_hunyuanvideo15_transformer "
        "tiny_hunyuanvideo_pipe tiny_hunyuanvideo_transformer tiny_llama_causal_lm tiny_ltx2_transformer "
        "tiny_ltx_pipe tiny_ltx_transformer tiny_minimax_h3_transformer tiny_model tiny_pixart_pipe "
        "tiny_pixart_transformer tiny_qwen2_5_vl tiny_qwen2_vl tiny_qwen3_causal_lm tiny_qwen3_vl "
        "tiny_qwenimage_pipe tiny_qwenimage_transformer tiny_sd3_pipe tiny_sd3_transformer tiny_sdxl_pipe "
        "tiny_t5_encoder tiny_t5_tokenizer tiny_wan_pipe tiny_wan_transformer tiny_wan_vace_transformer "
        "tiny_wan_vae track_memory wan_prompt_embeds"
    ),
    "hfpatch.testing.decoders": "TINY_DECODERS TinyDecoder tiny_decoder tiny_decoder_inputs",  # issue 49
    "hfpatch.testing.devices": "GeneratorDeviceRule generator_device_rule",
    "hfpatch.testing.dits": (
        "Grid Randn TINY_DITS TINY_DIT_PIPES Tensor TinyDiT TinyDiTPipe split_gradients tiny_dit tiny_dit_inputs "
        "tiny_dit_pipe tiny_dit_pipe_inputs"
    ),
    "hfpatch.testing.memory": "CopyCounter MemoryTracker count_copies measure_peak resident_peak track_memory",
    "hfpatch.testing.models": (
        "flux_inputs qwen2_vl_inputs qwen3_vl_inputs tiny_autoencoder_kl tiny_bert tiny_chronoedit_transformer "
        "tiny_clip_text_model tiny_clip_tokenizer tiny_cogvideox_transformer tiny_flux2_transformer "
        "tiny_flux_pipe tiny_flux_pipe_with_text_encoders tiny_flux_transformer tiny_hunyuandit_pipe "
        "tiny_hunyuandit_transformer tiny_hunyuanvideo15_transformer tiny_hunyuanvideo_pipe "
        "tiny_hunyuanvideo_transformer tiny_llama_causal_lm tiny_ltx2_transformer tiny_ltx_pipe "
        "tiny_ltx_transformer tiny_minimax_h3_transformer tiny_model tiny_pixart_pipe tiny_pixart_transformer "
        "tiny_qwen2_5_vl tiny_qwen2_vl tiny_qwen3_causal_lm tiny_qwen3_vl tiny_qwenimage_pipe "
        "tiny_qwenimage_transformer tiny_sd3_pipe tiny_sd3_transformer tiny_sdxl_pipe tiny_t5_encoder "
        "tiny_t5_tokenizer tiny_wan_pipe tiny_wan_transformer tiny_wan_vace_transformer tiny_wan_vae "
        "wan_prompt_embeds"
    ),
    "hfpatch.testing.quantized": "KINDS available_kinds quantize_q4_k quantized tiny_quantizable write_gguf",  # issue 50
    "hfpatch.testing.runner": "RankError RankPool run_ranks spread",
    "hfpatch.testing.tolerance": (
        "FLOOR_ULPS MAX_NOISE NOISE_FACTOR attention_tol eps low_precision_tol perturbation_noise "
        "reassociation_tol rel_error rounding_noise stochastic_rounding_noise summation_tol to_fp64 "
        "without_inside_rounding"
    ),
    "hfpatch.training": (
        "CLIPLoss ContrastiveLoss GISTLoss GradCache GradCacheLoss GradCacheTrainer InfoNCELoss RngState SigLIPLoss "
        "VisionTokenSpec checkpointed_decode "
        "checkpointed_encode chunked_pixel_loss is_sentence_transformer pool split_inputs split_vlm_inputs "
        "tiny_sentence_transformer"
    ),
    "hfpatch.training.causal_checkpoint": "Segment causal_checkpoint snapshot_stride",
    "hfpatch.training.contrastive": (
        "CLIPLoss ContrastiveLoss DEFAULT_BLOCK_BYTES GISTLoss InfoNCELoss SigLIPLoss cross_rank_world "
        "takes_local_embeddings"
    ),
    "hfpatch.training.gradcache": "GradCache RngState is_sentence_transformer split_inputs",
    "hfpatch.training.pixel_loss": "OPAQUE_FRAMES REFERENCE_ENV chunked_pixel_loss",
    "hfpatch.training.pooling": "Pooling default_rep pool",
    "hfpatch.training.sentence_transformers": "GradCacheLoss row_blocked_equivalent tiny_sentence_transformer",
    "hfpatch.training.simpletuner": "SimpleTunerPatch main patch_simpletuner refused_options",  # issue 51
    "hfpatch.training.trainer": "GradCacheTrainer info_nce",
    "hfpatch.training.video_vae": (
        "CogVideoXFrames WanFrames checkpointed_decode checkpointed_encode frames_for is_wan_vae "
        "span_segments time_segments vae_behind"
    ),
    "hfpatch.training.vlm_split": (
        "MEDIA_KEYS VisionTokenSpec has_grids has_media media_per_sample plan_chunks split_vlm_inputs "
        "validate_vlm_chunk"
    ),
}

#: Public modules that moved (issue 35): the old path -> the module that is now the same module.
MOVED = {
    "hfpatch.patches.kl_vae": "hfpatch.patches.vae.kl",
    "hfpatch.patches.wan_vae": "hfpatch.patches.vae.wan",
    "hfpatch.patches.pipefusion_flux": "hfpatch.patches.pipefusion.flux",
    "hfpatch.patches.wan_streaming": "hfpatch.streaming.transformer",
    # issue 47: the command line is one package
    "hfpatch.generate": "hfpatch.cli.generate",
    "hfpatch.demo": "hfpatch.cli.demo",
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_module_keeps_its_all(name):
    module = importlib.import_module(MOVED.get(name, name))
    recorded = None if PUBLIC[name] is None else PUBLIC[name].split()
    found = getattr(module, "__all__", None)
    assert (None if found is None else sorted(found)) == recorded
    missing = [n for n in recorded or () if not hasattr(module, n)]
    assert not missing, f"{module.__name__}.__all__ names {missing}, which it does not define"


def test_moved_modules_are_gone_from_their_old_path():
    """No shim is left behind: the old path of a moved module does not import."""
    for old in MOVED:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
