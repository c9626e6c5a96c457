"""The DiT plan table, as data: a row per diffusers transformer class (:data:`PLANS`) and, beside it, the classes
hfpatch looked at and does not shard, with the reason (:data:`UNSUPPORTED`).

A row says which attention modules run through USP and where the token sequence is cut: diffusers' own ``_cp_plan``
translated (``plan=None``; the row names the entries that stay replicated) or a plan of hfpatch's own. Rows are
written in the words of :mod:`hfpatch.patches.dit.vocabulary`; :class:`~hfpatch.patches.dit.family.PlannedDiTUSP`
reads them. ``hfpatch.patches.DIT_USP_CLASSES`` names the same classes (a test keeps the two equal), so that the
registry imports nothing from diffusers.

>>> from hfpatch.patches.dit.plans import PLANS
>>> PLANS["diffusers.QwenImageTransformer2DModel"].plan is None   # diffusers' _cp_plan, translated
True
"""

from __future__ import annotations

from .vocabulary import (
    COGVIDEOX_LAYOUT,
    CONTROLNET,
    HUNYUAN_PLAN,
    IMAGE_TOKENS_PLAN,
    SIMPLETUNER_REFUSED_ARGUMENTS,
    SIMPLETUNER_TIMESTEPS,
    SIMPLETUNER_WAN_PLAN,
    TOKEN_REPLACE_REFUSED,
    WAN_PLAN,
    AttentionRoute,
    DiTPlan,
    FullLength,
    GatherOutput,
    MeasureInput,
    ReplicatedInput,
    ReplicatedOutput,
    SplitInput,
    SplitOutput,
    flux_like,
    kandinsky_heads,
    no_padded_patches,
    no_token_routing,
    one_segment,
    refused_unless,
    same_caption_lengths,
    same_size_images,
    simpletuner_flux_checks,
)

__all__ = ["PLANS", "UNSUPPORTED"]

#: Class key -> how hfpatch parallelises it. Classes whose ``_cp_plan`` is used say so by ``plan=None``.
PLANS: dict[str, DiTPlan] = {
    "diffusers.WanTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("WanAttnProcessor",)),), plan=WAN_PLAN
    ),
    # ChronoEdit: Wan 2.1 I2V's forward with a temporal-skip rotary table (its own WanAttnProcessor class, the
    # same code). Wan's plan rather than its _cp_plan: the same memory argument. attn2's image keys are
    # attended with parallel_config=None by the stock code: local, exact (replicated keys, local queries).
    "diffusers.ChronoEditTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("WanAttnProcessor",)),), plan=WAN_PLAN
    ),
    # Wan VACE: Wan's plan, plus the control video's patch embedding cut the same way (the hints the VACE
    # blocks add to the main blocks are per token); the VACE blocks' self-attention is routed too. A control
    # video with fewer tokens than the latent (zero-padded by the stock code after the embedding) gets a
    # sequence-length error from the split on every rank, before any collective.
    "diffusers.WanVACETransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("blocks.*.attn1", ("WanAttnProcessor",)),
            AttentionRoute("vace_blocks.*.attn1", ("WanAttnProcessor",)),
        ),
        plan={
            **{k: v for k, v in WAN_PLAN.items() if k != ""},  # VACE takes timesteps [B] only
            "vace_patch_embedding": (SplitOutput(dim=2, flatten_from=2),),
        },
    ),
    # Flux.1 (dev, schnell, Kontext): diffusers' plan, text replicated. Single-stream blocks attend over
    # [text, local image] in one sequence (text = len - local_len, in front).
    "diffusers.FluxTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("FluxAttnProcessor",), joint="front"),
            AttentionRoute("single_transformer_blocks.*.attn", ("FluxAttnProcessor",), joint="front"),
        ),
        replicate=(("", "encoder_hidden_states"), ("", "txt_ids")),
        extra={
            "": (
                SplitInput("img_ids", dim=1, ndim=3),  # deprecated [B, S, 3] (the plan cuts [S, 3])
                SplitInput("controlnet_block_samples", dim=1),  # lists of [B, S, D], added per token
                SplitInput("controlnet_single_block_samples", dim=1),
            )
        },
    ),
    # SD3 / SD3.5: no _cp_plan. The patch embedding's output (learned positions added) and the ControlNet
    # residuals are cut; the stock JointAttnProcessor2_0 (F.scaled_dot_product_attention) joins the text
    # *behind* the image tokens; SD3.5's dual-attention attn2 is image-only self-attention.
    "diffusers.SD3Transformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("JointAttnProcessor2_0",), joint="back"),
            AttentionRoute("transformer_blocks.*.attn2", ("JointAttnProcessor2_0",), optional=True),
        ),
        plan={
            "": (SplitInput("block_controlnet_hidden_states", dim=1),),  # list of [B, S, D]
            "pos_embed": (SplitOutput(dim=1),),  # [B, S, D] patch tokens with positions added
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # CogVideoX (2B/5B/1.5): no _cp_plan. The video tokens entering block 0 (after the stock embedding, which
    # splits them from the text) and the rotary table (cos, sin), each [S, D], are cut. The stock processor
    # concatenates [text, local video] before projecting and rotates [text_len:]: with the local rotary shard,
    # exactly this rank's video tokens (text = len - local_len, in front).
    "diffusers.CogVideoXTransformer3DModel": COGVIDEOX_LAYOUT,
    # HunyuanDiT: no _cp_plan. The patch embedding's output (no positions: rotary), the rotary table (cos, sin),
    # each [S, D], and ControlNet residuals are cut; the long skips between blocks are per token. attn2 is the
    # cross-attention to the replicated text (rotary on the local queries only): left alone, exact.
    "diffusers.HunyuanDiT2DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("HunyuanAttnProcessor2_0",)),),
        plan={
            "": (SplitInput("image_rotary_emb", dim=0), SplitInput("controlnet_block_samples", dim=1)),
            "pos_embed": (SplitOutput(dim=1),),  # [B, S, D]
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # PixArt-alpha/sigma: no _cp_plan. The patch embedding's output (sin-cos positions added) is cut; attn1
    # (AttnProcessor2_0, shared with many models: only these modules are routed) is the self-attention, attn2
    # the cross-attention to the replicated, key-masked text, left alone.
    "diffusers.PixArtTransformer2DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("AttnProcessor2_0",)),),
        plan={"pos_embed": (SplitOutput(dim=1),), "proj_out": (GatherOutput(dim=1),)},
        refuse={"attention_mask": "a mask over the image tokens, which are sharded over the ranks"},
    ),
    "diffusers.QwenImageTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("QwenDoubleStreamAttnProcessor2_0",), joint="front"),
        ),
        replicate=(
            ("transformer_blocks.0", "encoder_hidden_states"),
            ("transformer_blocks.*", "encoder_hidden_states_mask"),
            ("pos_embed", 1),  # the text rotary table
        ),
        earlier=(("transformer_blocks.0", "hidden_states"),),
        extra={"img_in": (SplitOutput(dim=1),)},  # image tokens [B, S, C], cut as they are embedded
        refuse={"controlnet_block_samples": "ControlNet residuals are not sharded by the QwenImage plan"},
    ),
    "diffusers.Flux2Transformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("Flux2AttnProcessor",), joint="front"),
            AttentionRoute(
                "single_transformer_blocks.*.attn", ("Flux2ParallelSelfAttnProcessor",), joint="front"
            ),
        ),
        replicate=(("", "encoder_hidden_states"), ("", "txt_ids")),
        extra={"": (SplitInput("img_ids", dim=0, ndim=2),)},  # 2D ids [S, 4] as well as [B, S, 4]
        refuse={
            "kv_cache": "the reference-token KV cache attends per block outside dispatch_attention_fn",
            "kv_cache_mode": "the reference-token KV cache attends per block outside dispatch_attention_fn",
        },
    ),
    "diffusers.LTXVideoTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("LTXVideoAttnProcessor",)),),
        replicate=(("", "encoder_hidden_states"), ("", "encoder_attention_mask")),
        extra={"": (SplitInput("timestep", dim=1, ndim=2),)},  # per-token timesteps [B, S] (LTX 0.9.5+)
    ),
    # HunyuanVideo (T2V): no _cp_plan. The video tokens are cut at the patch embedding's output and the rotary
    # tables ([S, D] each) at the rope's; the text (after its token refiner, which attends within the text)
    # stays replicated and joins every attention *behind* the video tokens; the stock key mask over
    # [video, text] masks only the padded text.
    "diffusers.HunyuanVideoTransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("HunyuanVideoAttnProcessor2_0",), joint="back"),
            AttentionRoute(
                "single_transformer_blocks.*.attn", ("HunyuanVideoAttnProcessor2_0",), joint="back"
            ),
        ),
        plan=HUNYUAN_PLAN,
        refuse_config=TOKEN_REPLACE_REFUSED,
    ),
    # HunyuanVideo 1.5: no _cp_plan. HunyuanVideo's layout (video tokens cut at the patch embedding, rotary
    # tables [S, D] at the rope, text replicated and joined *behind* the video). The text (refined MLLM text,
    # ByT5 glyph text and the image tokens, valid ones first) comes with a query x key mask m[i] & m[j] over
    # [video, text] (video unmasked): a key mask plus fully masked padded-text query rows, honoured exactly
    # (_token_masks). The token refiner attends within the replicated text only (not routed).
    "diffusers.HunyuanVideo15Transformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("HunyuanVideo15AttnProcessor2_0",), joint="back"),
        ),
        plan=HUNYUAN_PLAN,
    ),
    # LTX-2 (audio + video): _cp_plan minus the text. Only the video tokens are cut (hidden_states, the
    # self-attention and a2v/v2a rotary tables: [B, S, D] for interleaved rope, [B, H, S, D/2] for split rope,
    # per-token timesteps and keyframe markers); the audio stream stays replicated on every rank, with its
    # self-attention and text cross-attention local. Video self-attention (attn1) is routed; the audio-to-video
    # attention (video queries, audio keys) is local and exact; the video-to-audio attention (audio queries,
    # video keys) is routed as joint="queries" (exact merge over the video shards). The audio output is
    # replicated on every rank (ReplicatedOutput), and so is the audio entering every block, with its rotary table
    # (ReplicatedInput): its gradient is averaged there, so the audio stream runs the unpatched backward.
    "diffusers.LTX2VideoTransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn1", ("LTX2AudioVideoAttnProcessor",)),
            AttentionRoute(
                "transformer_blocks.*.video_to_audio_attn", ("LTX2AudioVideoAttnProcessor",), joint="queries"
            ),
        ),
        replicate=(("", "encoder_hidden_states"), ("", "encoder_attention_mask")),
        extra={
            "": (
                SplitInput("timestep", dim=1, ndim=2),  # per-token timesteps [B, S] (conditioning pipelines)
                SplitInput("video_keyframes_mask", dim=1, ndim=3),  # [B, S, 1]
            ),
            "rope": (SplitOutput(dim=2, ndim=4),),  # split rope: (cos, sin), each [B, H, S, D/2]
            "cross_attn_rope": (SplitOutput(dim=1, ndim=3), SplitOutput(dim=2, ndim=4)),
            "transformer_blocks.*": (
                ReplicatedInput("audio_hidden_states"),
                ReplicatedInput("audio_rotary_emb"),
                ReplicatedInput("ca_audio_rotary_emb"),
            ),
            "audio_proj_out": (ReplicatedOutput(),),
        },
        refuse={
            "video_self_attention_mask": "a query x key mask over the video tokens, which are sharded both ways",
        },
    ),
    # MiniMax-H3: its _cp_plan as it is. One packed sequence of video, text and audio rows (the text refined
    # before packing) attends to itself without a mask; the packed rows are cut at block 0 with their rotary
    # tables and per-row AdaLN indices, and both heads gather the full sequence before selecting their rows.
    "diffusers.MiniMaxH3Transformer3DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn", ("MiniMaxH3AttnProcessor",)),),
    ),
    # Chroma (Flux.1-schnell derived): Flux's layout; the key mask over [text, image] ([B, T + S]) is cut like
    # the tokens (its text part replicated). The blocks make it a token mask m[i] * m[j]: exact when boolean;
    # the 0/1 float mask ChromaPipeline passes is an additive bias (+1 on unmasked pairs), refused by the
    # attention with a clear error.
    "diffusers.ChromaTransformer2DModel": flux_like(
        "FluxAttnProcessor",
        plan={
            "": (*IMAGE_TOKENS_PLAN[""], SplitInput("attention_mask", dim=1, joint="front"), *CONTROLNET),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # Bria 3.x, LongCat-Image, Ovis-Image: Flux.1's layout with processors of their own (same code shape).
    "diffusers.BriaTransformer2DModel": flux_like(
        "BriaAttnProcessor",
        plan={
            "": (*IMAGE_TOKENS_PLAN[""], *CONTROLNET),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    "diffusers.LongCatImageTransformer2DModel": flux_like("LongCatImageAttnProcessor"),
    "diffusers.OvisImageTransformer2DModel": flux_like("OvisImageAttnProcessor"),
    # Bria FIBO: dual-stream blocks with its own processor, single-stream blocks with Bria's; per-block text
    # encoder layers (replicated) are mixed into the text stream.
    "diffusers.BriaFiboTransformer2DModel": flux_like("BriaFiboAttnProcessor", "BriaAttnProcessor"),
    # FLUX.3: per-mode blocks (image, reference image, text: each self-attends within its mode), then single
    # blocks over [text, image, reference]. The image tokens and their ids are cut at the input (the stock code
    # takes the image length from the shard), the text stays replicated; only the image mode's blocks and the
    # joint blocks are routed (the text mode's, same processor class, run the stock code).
    "diffusers.Flux3Transformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("mode_blocks.image.*.attn", ("Flux3AttnProcessor",)),
            AttentionRoute("single_transformer_blocks.*.attn", ("Flux3AttnProcessor",), joint="front"),
        ),
        plan=IMAGE_TOKENS_PLAN,
        refuse={
            "image_cond_hidden_states": (
                "the reference image tokens are a second sequence of their own length, joined behind the image "
                "tokens: the replicated tokens would sit on both sides of the shard"
            )
        },
    ),
    # SkyReels-V2 (T2V, I2V): Wan's layout (rope output and patch embedding cut, attn1 routed, cross-attention
    # local). Diffusion forcing expands per-frame timesteps to per-token modulation inside forward, and the
    # block-causal variant builds a token x token mask: both refused.
    "diffusers.SkyReelsV2Transformer3DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("SkyReelsV2AttnProcessor",)),),
        plan={k: v for k, v in WAN_PLAN.items() if k != ""},
        refuse={
            "enable_diffusion_forcing": (
                "the per-frame timesteps become a per-token modulation inside forward, which no plan entry reaches"
            )
        },
        refuse_config={
            "num_frame_per_block": (
                refused_unless(1),
                "the block-causal variant attends through a token x token mask over the sharded video",
            )
        },
    ),
    # HunyuanImage 2.1: HunyuanVideo's layout (video tokens behind which the refined, replicated text joins;
    # a key mask over [image, text] with the image part all True).
    "diffusers.HunyuanImageTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("HunyuanImageAttnProcessor",), joint="back"),
            AttentionRoute("single_transformer_blocks.*.attn", ("HunyuanImageAttnProcessor",), joint="back"),
        ),
        plan=HUNYUAN_PLAN,
    ),
    # CogView4: the patch embedding returns (image, text): the image tokens are cut, with the rotary table
    # ([S, D] each); the stock processor (SDPA) attends over [text, image].
    "diffusers.CogView4Transformer2DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("CogView4AttnProcessor",), joint="front"),),
        plan={
            "rope": (SplitOutput(dim=0),),
            "patch_embed": (SplitOutput(dim=1, index=0),),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # ERNIE-Image: one packed, sequence-first [image, text] stream ([S, B, H]). The image tokens are cut at the
    # patch embedding's output; the rotary table over [image, text] and the key mask (the text padded) are cut
    # at their image part; the packed output of the last layer is gathered (the stock code slices the image off).
    "diffusers.ErnieImageTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("layers.*.self_attention", ("ErnieImageSingleStreamAttnProcessor",), joint="back"),
        ),
        plan={
            "x_embedder": (SplitOutput(dim=1),),  # [B, S, H]
            "pos_embed": (SplitOutput(dim=1, joint="back"),),  # [B, S + T, 1, D]
            "layers.*": (SplitInput("attention_mask", dim=-1, joint="back"),),  # [B, 1, 1, S + T]
            "final_linear": (GatherOutput(dim=0, joint="back"),),  # [S + T, B, C]
        },
    ),
    # Krea 2: a single stream over [text, image] (the text fused from the encoder's layers first, replicated).
    # The image tokens are cut at their embedding, the rotary table over [text, image] (from position_ids) and
    # the key mask at their image part; the output layer gathers the image tokens.
    "diffusers.Krea2Transformer2DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn", ("Krea2AttnProcessor",), joint="front"),),
        plan={
            "img_in": (SplitOutput(dim=1),),
            "rotary_emb": (SplitOutput(dim=0, joint="front"),),  # (cos, sin), each [T + S, D]
            "transformer_blocks.*": (
                SplitInput("attention_mask", dim=-1, joint="front"),
            ),  # [B, 1, 1, T + S]
            "final_layer": (GatherOutput(dim=1),),
        },
    ),
    # GLM-Image: CogView4's layout (rotary table and image tokens cut, text replicated in front), plus the
    # per-token prior (AR) tokens, cut after their projection. The KV cache of the reference images (kv_caches)
    # holds keys of another pass: refused.
    "diffusers.GlmImageTransformer2DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("GlmImageAttnProcessor",), joint="front"),),
        plan={
            "rope": (SplitOutput(dim=0),),
            "image_projector": (SplitOutput(dim=1),),
            "prior_projector": (SplitOutput(dim=1),),
            "proj_out": (GatherOutput(dim=1),),
        },
        refuse={"kv_caches": "the cached reference keys come from another forward, not cut by this plan"},
    ),
    # Z-Image (Turbo, base): the image tokens (padded to a multiple of 32 with a learned pad token, which takes part
    # in attention) are cut entering the noise refiner, whose blocks attend within the image; the unified
    # sequence [image, text] then holds this rank's shard and the whole (replicated) text: its rotary table and
    # key mask (captions of different padded lengths) are cut at their image part, and the final layer's output
    # is gathered the same way. The caption refiner attends within the text (not routed).
    "diffusers.ZImageTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("noise_refiner.*.attention", ("ZSingleStreamAttnProcessor",)),
            AttentionRoute("layers.*.attention", ("ZSingleStreamAttnProcessor",), joint="back"),
        ),
        plan={
            "noise_refiner.0": (SplitInput("x", dim=1),),  # [B, S, D], S padded to a multiple of 32
            "noise_refiner.*": (SplitInput("freqs_cis", dim=1),),  # complex [B, S, D/2]
            "layers.*": (
                SplitInput("freqs_cis", dim=1, joint="back"),  # [B, S + T, D/2]
                SplitInput("attn_mask", dim=1, joint="back"),  # [B, S + T] when the captions differ in length
            ),
            "all_final_layer.*": (GatherOutput(dim=1, joint="back"),),
        },
        refuse={"controlnet_block_samples": "the residuals span the packed [image, text] sequence"},
        check=same_size_images,
        heads="n_heads",
    ),
    # Lumina-Image 2.0: the refiners run on the text and on the image apart; then one packed [text, image] sequence
    # (the valid caption tokens, then the image). The image tokens are cut at their embedding (x_embedder) with
    # their rotary table (the rope embedder's third output), so the noise refiner runs on this rank's tokens, its
    # attention routed over the image; its output is gathered for the stock code to pack, and the packed sequence
    # is cut again at its image part entering the first main block (with its rotary table per block); the
    # output norm's projection is gathered the same way. The caption refiner runs whole (replicated text).
    "diffusers.Lumina2Transformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("noise_refiner.*.attn", ("Lumina2AttnProcessor2_0",)),
            AttentionRoute("layers.*.attn", ("Lumina2AttnProcessor2_0",), joint="front"),
        ),
        plan={
            "rope_embedder": (SplitOutput(dim=1, index=2),),  # the image's rotary table [B, S, D/2]
            "x_embedder": (SplitOutput(dim=1),),  # the image tokens [B, S, C]
            "noise_refiner.-1": (GatherOutput(dim=1, recut=True),),
            "layers.0": (SplitInput("hidden_states", dim=1, joint="front"),),
            "layers.*": (SplitInput("image_rotary_emb", dim=1, joint="front"),),  # complex [B, T + S, D/2]
            "norm_out": (GatherOutput(dim=1, joint="front"),),
        },
        check=same_caption_lengths,
    ),
    # PRX: the image tokens query [text, image] keys (no text queries; the text is projected to keys/values
    # only, replicated). The image tokens are cut at their embedding, the rotary table ([B, 1, S, ...]) at the
    # rope's output; the final layer's output is gathered.
    "diffusers.PRXTransformer2DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attention", ("PRXAttnProcessor2_0",), joint="keys"),),
        plan={
            "img_in": (SplitOutput(dim=1),),
            "pe_embedder": (SplitOutput(dim=2),),
            "final_layer": (GatherOutput(dim=1),),
        },
        heads="num_heads",
    ),
    # JoyImage-Edit: Wan-like patch embedding (cut as tokens), double-stream blocks attending over [image, text]
    # (text replicated, behind); the image rotary table ((cos, sin), each [S, D]) is the first element of the
    # blocks' rotary argument. Several images (edit inputs) form one longer token sequence.
    "diffusers.JoyImageEditTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("double_blocks.*.attn", ("JoyImageAttnProcessor",), joint="back"),),
        plan={
            "img_in": (SplitOutput(dim=2, flatten_from=2),),
            "double_blocks.*": (SplitInput("image_rotary_emb", dim=0, index=0),),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # JoyImage-Edit-Plus: per-sample packed patches (padded to the batch's longest, padding masked); the patch
    # tokens are cut entering the first block, with their rotary table ([B, N, D]) and the [image, text] key mask.
    # A padded patch (a sample shorter than the batch's longest) would be a masked image token: refused per call.
    "diffusers.JoyImageEditPlusTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("double_blocks.*.attn", ("JoyImageEditPlusAttnProcessor",), joint="back"),),
        plan={
            "double_blocks.0": (SplitInput("hidden_states", dim=1),),
            "double_blocks.*": (
                SplitInput("image_rotary_emb", dim=1),
                SplitInput("attention_mask", dim=-1, joint="back"),
            ),
            "proj_out": (GatherOutput(dim=1),),
        },
        check=no_padded_patches,
    ),
    # Mochi 1: the video tokens cut entering the first block (the patch embedding runs per frame), with the rotary
    # table ((cos, sin), each [S, H, D/2]); the stock processor (SDPA) attends once per sample over [video, that
    # sample's valid text tokens] (text replicated, behind).
    "diffusers.MochiTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("MochiAttnProcessor2_0",), joint="back"),),
        plan={
            "rope": (SplitOutput(dim=0),),
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # Cosmos Predict 2 / 2.5: the video tokens cut at the patch embedding's [B, T, H, W, C] output (the model
    # flattens the grid itself), with the rotary table ([S, D] each), the learned positions ([B, S, D]),
    # ControlNet residuals and, for per-frame timesteps (video-to-world), the per-token modulation ([B, S, D]) the
    # blocks and the output norm take: the stock forward builds it whole (a per-frame embedding expanded over the
    # tokens between modules), so it is cut entering each block. The self-attention (whose stock processor calls
    # dispatch_attention_fn without parallel_config) is routed per stand-in; the cross-attention to the text (and
    # image context) is local.
    "diffusers.CosmosTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("CosmosAttnProcessor2_0",)),),
        plan={
            "rope": (SplitOutput(dim=0),),
            # [B, T, H, W, C]: the grid cut as one sequence, handed back as [B, S/N, 1, 1, C]
            "patch_embed": (SplitOutput(dim=1, flatten_from=1, flatten_to=3),),
            "transformer_blocks.*": (
                SplitInput("extra_pos_emb", dim=1),  # learned positions [B, S, D] (None without them)
                SplitInput("embedded_timestep", dim=1, ndim=3),
                SplitInput("temb", dim=1, ndim=3),
                SplitInput("controlnet_residual", dim=1),
            ),
            "norm_out": (SplitInput("embedded_timestep", dim=1, ndim=3), SplitInput("temb", dim=1, ndim=3)),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # Motif-Video: HunyuanVideo's layout (video tokens cut at the patch embedding, rotary tables at the rope, the
    # text and image-prompt tokens replicated and joined behind). Its decoder layers attend from a second copy of
    # the embedded video to the main stream's output as their context: refused.
    "diffusers.MotifVideoTransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("MotifVideoAttnProcessor2_0",), joint="back"),
            AttentionRoute("single_transformer_blocks.*.attn", ("MotifVideoAttnProcessor2_0",), joint="back"),
        ),
        plan=HUNYUAN_PLAN,
        refuse_config={
            "num_decoder_layers": (
                refused_unless(0),
                "the decoder layers take the main stream's whole output as their context, which the split leaves "
                "on its rank's shard",
            )
        },
    ),
    # AnyFlow (bidirectional): Wan's layout; its per-frame timesteps reach the blocks and the output norm as
    # per-token embeddings returned by the condition embedder ([B, S, D] and [B, S, 6D]), cut there; the rotary
    # table is a dict {query, key} of [1, 1, S, D].
    "diffusers.AnyFlowTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("AnyFlowAttnProcessor",)),),
        plan={
            "rope": (SplitOutput(dim=2),),
            "patch_embedding": (SplitOutput(dim=2, flatten_from=2),),
            "condition_embedder": (SplitOutput(dim=1, index=0), SplitOutput(dim=1, index=1)),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # DiT (class-conditional): PixArt's layout (the patch embedding's output, sin-cos positions added, cut; attn1
    # routed, SDPA); the output projection's result is gathered before the unpatchify.
    "diffusers.DiTTransformer2DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("AttnProcessor2_0",)),),
        plan={"pos_embed": (SplitOutput(dim=1),), "proj_out_2": (GatherOutput(dim=1),)},
    ),
    # CogView3-Plus: the patch embedding returns [text, image] (positions added); the image tokens are cut entering
    # the first block; CogVideoX's processor (SDPA) attends over [text, image].
    "diffusers.CogView3PlusTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn1", ("CogVideoXAttnProcessor2_0",), joint="front"),
        ),
        plan={
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # EasyAnimate: the video tokens (embedded per frame) cut entering the first block, with the rotary table;
    # its processor (SDPA) attends over [text, video].
    "diffusers.EasyAnimateTransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn1", ("EasyAnimateAttnProcessor2_0",), joint="front"),
        ),
        plan={
            "rope_embedding": (SplitOutput(dim=0),),
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # AuraFlow: the patch embedding's output (positions added) cut; register tokens and text replicated in front,
    # in the joint blocks and in the single blocks' packed [text, image] sequence (AuraFlow's processor, SDPA).
    "diffusers.AuraFlowTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("joint_transformer_blocks.*.attn", ("AuraFlowAttnProcessor2_0",), joint="front"),
            AttentionRoute("single_transformer_blocks.*.attn", ("AuraFlowAttnProcessor2_0",), joint="front"),
        ),
        plan={"pos_embed": (SplitOutput(dim=1),), "proj_out": (GatherOutput(dim=1),)},
    ),
    # ConsisID: CogVideoX's layout (the video tokens cut entering the first block, after the stock code separates
    # them from the text; rotary table [S, D] each); the face perceiver's queries are the video tokens and its
    # keys the replicated face embedding: local, exact.
    "diffusers.ConsisIDTransformer3DModel": COGVIDEOX_LAYOUT,
    # Ideogram 4: one packed sequence per sample (LLM tokens and output-image tokens, told apart by `indicator`) with
    # one row of position ids per token: every per-token input is cut at the model's input. Tokens attend within
    # their segment (segment_ids): one segment is a full (all True) token mask per shard, exact; several segments
    # (packed samples) make a block-diagonal mask over the shards: refused per call.
    "diffusers.Ideogram4Transformer2DModel": DiTPlan(
        attention=(AttentionRoute("layers.*.attention", ("Ideogram4AttnProcessor",)),),
        plan={
            "": (
                SplitInput("hidden_states", dim=1),
                SplitInput("encoder_hidden_states", dim=1),
                SplitInput("position_ids", dim=1),
                SplitInput("segment_ids", dim=1),
                SplitInput("indicator", dim=1),
                SplitInput("timestep", dim=1, ndim=2),  # per-token timesteps [B, L]
            ),
            "final_layer": (GatherOutput(dim=1),),
        },
        check=one_segment,
    ),
    # HiDream-I1: image tokens cut at the patch embedding, text (T5 and Llama layers) replicated and joined behind
    # the image tokens in dual- and single-stream blocks (HiDream's processor, SDPA); the rotary table over
    # [image, text] and the key multipliers (hidden_states_masks: [image] in the dual, [image, text] in the single
    # blocks) cut at their image part. The MoE routes each token on its own (top-k, no capacity): exact per shard.
    "diffusers.HiDreamImageTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("double_stream_blocks.*.block.attn1", ("HiDreamAttnProcessor",), joint="back"),
            AttentionRoute("single_stream_blocks.*.block.attn1", ("HiDreamAttnProcessor",), joint="back"),
        ),
        plan={
            "x_embedder": (SplitOutput(dim=1),),
            "pe_embedder": (SplitOutput(dim=1, joint="back"),),  # [B, S + T, 1, D/4, 2, 2]
            "double_stream_blocks.*": (SplitInput("hidden_states_masks", dim=1),),
            "single_stream_blocks.*": (SplitInput("hidden_states_masks", dim=1, joint="back"),),
            "final_layer": (GatherOutput(dim=1),),
        },
    ),
    # Kandinsky 5 (regular attention): the video tokens cut entering the first visual block (their rotary table at
    # every block) and gathered at the last block's output, before the stock code reshapes them to the [B, F, H, W]
    # grid for the output layer. The text blocks attend within the text (not routed), the visual blocks' cross-
    # attention to the text is local. NABLA sparse attention (sparse_params) selects key blocks over the whole grid:
    # refused.
    "diffusers.Kandinsky5Transformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("visual_transformer_blocks.*.self_attention", ("Kandinsky5AttnProcessor",)),
        ),
        plan={
            "visual_transformer_blocks.0": (SplitInput("visual_embed", dim=1),),
            "visual_transformer_blocks.*": (SplitInput("rope", dim=1),),  # [B, S, 1, D/2, 2, 2]
            "visual_transformer_blocks.-1": (GatherOutput(dim=1),),
        },
        refuse={"sparse_params": "NABLA sparse attention picks key blocks from scores over the whole grid"},
        heads=kandinsky_heads,
    ),
    # HunyuanVideo FramePack: HunyuanVideo's blocks over one packed sequence (the history latents, each patchified
    # at its own scale, then the current latents), cut entering the first block with its rotary table ([S, D]
    # each; `freqs_cis` in the dual blocks) and the [video, text] key mask at every block; the last single block's
    # video output is gathered
    # before the stock code slices the current latents off by position.
    "diffusers.HunyuanVideoFramepackTransformer3DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("HunyuanVideoAttnProcessor2_0",), joint="back"),
            AttentionRoute(
                "single_transformer_blocks.*.attn", ("HunyuanVideoAttnProcessor2_0",), joint="back"
            ),
        ),
        plan={
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1),),
            "transformer_blocks.*": (
                SplitInput("freqs_cis", dim=0),
                SplitInput("attention_mask", dim=-1, joint="back"),
            ),
            "single_transformer_blocks.*": (
                SplitInput("image_rotary_emb", dim=0),
                SplitInput("attention_mask", dim=-1, joint="back"),
            ),
            "single_transformer_blocks.-1": (GatherOutput(dim=1, index=0),),
        },
        refuse_config=TOKEN_REPLACE_REFUSED,
    ),
    # Stable Audio Open: the audio latent frames cut at the input projection (the pre-convolution runs on the
    # whole clip first); the global (duration + time) token joins in front, replicated; the caller's rotary table
    # over [global, audio] and the key mask are cut at their audio part per block; the projected output is
    # gathered before the stock code drops the global token and runs its post-convolution over the whole clip.
    "diffusers.StableAudioDiTModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn1", ("StableAudioAttnProcessor2_0",), joint="front"),
        ),
        plan={
            "proj_in": (SplitOutput(dim=1),),
            "transformer_blocks.*": (
                SplitInput("rotary_embedding", dim=0, joint="front"),  # (cos, sin), each [1 + S, D']
                SplitInput("attention_mask", dim=-1, joint="front"),
            ),
            "proj_out": (GatherOutput(dim=1, joint="front"),),
        },
    ),
    # Kandinsky 6 (video + audio): LTX-2's layout. The video tokens are cut entering the first fused block (their
    # rotary table at every block) and gathered from the last block's (video, audio) output before the stock code
    # reshapes them to the grid; the audio stream stays replicated (entering every block and leaving the model). The
    # video self-attention is routed, and so is the audio-to-video cross-attention (audio queries over the sharded
    # video keys: exact merge over the shards); the video-to-audio and text cross-attentions are local.
    "diffusers.Kandinsky6Transformer3DModel": DiTPlan(
        attention=(
            AttentionRoute(
                "visual_transformer_blocks.*.video_dec_block.self_attention", ("Kandinsky6AttnProcessor",)
            ),
            AttentionRoute(
                "visual_transformer_blocks.*.av_cross_attention",
                ("Kandinsky6AttnProcessor",),
                joint="queries",
            ),
        ),
        plan={
            "visual_transformer_blocks.0": (SplitInput("vis", dim=1),),
            "visual_transformer_blocks.*": (
                SplitInput("vis_rope", dim=0),
                ReplicatedInput("aud"),
                ReplicatedInput("aud_rope"),
            ),
            "visual_transformer_blocks.-1": (GatherOutput(dim=1, index=0),),
            "audio_out_layer": (ReplicatedOutput(),),
        },
        heads=kandinsky_heads,
    ),
    # Stable Audio 3: the memory tokens join in front of the audio frames (replicated); the rotary table is built
    # from the whole packed length before the first block, so the frames are cut entering it (their count taken at
    # the input projection) with the table and the inpainting frames per block; the projected frames are gathered
    # before the stock code's post-convolution over the whole clip. Its differential attention attends twice per
    # module.
    "diffusers.StableAudio3DiTModel": DiTPlan(
        attention=(
            AttentionRoute(
                "transformer_blocks.*.self_attn", ("StableAudio3SelfAttnProcessor",), joint="front"
            ),
        ),
        plan={
            "proj_in": (MeasureInput("input", dim=1),),
            "transformer_blocks.0": (SplitInput("hidden_states", dim=1, joint="front"),),
            "transformer_blocks.*": (
                SplitInput("rope", dim=0, joint="front"),  # [M + S, D']
                SplitInput("local_seq", dim=1),  # inpainting frames [B, S, C]
            ),
            "proj_out": (GatherOutput(dim=1),),
        },
        heads="num_heads",
    ),
    # MiniMax-Music 3: the timestep token joins in front of the frames (replicated). The frames are cut at the input
    # projection's output (the packed [timestep, frames] sequence is then built per rank, never whole); the rotary
    # table, which the stock forward sizes from that sequence's length, is built for the whole packed length and cut
    # at its frames; the projection's output is gathered before the post-convolution.
    "diffusers.MiniMaxMusic3Transformer1DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("MiniMaxMusic3AttnProcessor",), joint="front"),
        ),
        plan={
            "proj_in": (SplitOutput(dim=1),),  # frames [B, S, D]
            # built for 1 + S positions (the stock length is 1 + S/N); (cos, sin), each [1 + S, D']
            "rotary_emb": (FullLength("seq_len"), SplitOutput(dim=0, joint="front")),
            "proj_out": (GatherOutput(dim=1),),
        },
    ),
    # LongCat-AudioDiT: the rotary table (built from the whole clip's length by a module the text shares) and the
    # frame mask are cut at every block, the frames entering the first; the last block's output is gathered, so the
    # long skip (the embedded clip, held in forward) adds to the whole sequence. Padded frames would be masked keys
    # of the sharded sequence: refused by the attention with a clear error.
    "diffusers.LongCatAudioDiTTransformer": DiTPlan(
        attention=(AttentionRoute("blocks.*.self_attn", ("AudioDiTSelfAttnProcessor",)),),
        plan={
            "blocks.0": (SplitInput("hidden_states", dim=1),),
            "blocks.*": (SplitInput("mask", dim=1), SplitInput("rope", dim=0)),
            "blocks.-1": (GatherOutput(dim=1),),
        },
        heads="dit_heads",
    ),
    # ---- Trainers' own copies of diffusers' classes (keyed by their package; hfpatch.training.simpletuner).
    # SimpleTuner's Wan: diffusers' Wan with one complex rotary table [1, 1, S, D], flow-map timesteps cut like the
    # timestep, and training extras that need the whole token grid refused by name (TREAD routing, the hidden-state
    # captures of CREPA and the layer regularisers, GLIGEN grounding).
    "simpletuner.WanTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("blocks.*.attn1", ("WanAttnProcessor2_0",)),),
        plan=SIMPLETUNER_WAN_PLAN,
        refuse=SIMPLETUNER_REFUSED_ARGUMENTS,
        check=no_token_routing,
    ),
    # SimpleTuner's Flux: diffusers' Flux.1 layout and _cp_plan (text in front of the image tokens, the single-stream
    # blocks over [text, image]), with its own SDPA processor; it passes the ids as [B, S, 3]. Its attention_mask
    # becomes an additive 0/1 bias (not a key mask) and its per-token timesteps a mean over the image tokens: refused.
    "simpletuner.FluxTransformer2DModel": DiTPlan(
        attention=(
            AttentionRoute("transformer_blocks.*.attn", ("FluxAttnProcessor2_0",), joint="front"),
            AttentionRoute("single_transformer_blocks.*.attn", ("FluxAttnProcessor2_0",), joint="front"),
        ),
        replicate=(("", "encoder_hidden_states"), ("", "txt_ids")),
        extra={"": (SplitInput("img_ids", dim=1, ndim=3), *CONTROLNET)},
        refuse={
            **SIMPLETUNER_REFUSED_ARGUMENTS,
            "attention_mask": "the processor adds the mask as a 0/1 bias over [text, image], not a mask of keys",
        },
        check=simpletuner_flux_checks,
    ),
    # SimpleTuner's LTX-Video: diffusers' layout and _cp_plan (the rope's full-length tables cut at its output), with
    # its processor (dispatch_attention_fn without parallel_config: bound per stand-in); its flow-map timesteps are
    # cut like the timestep when they are per token.
    "simpletuner.LTXVideoTransformer3DModel": DiTPlan(
        attention=(AttentionRoute("transformer_blocks.*.attn1", ("LTXVideoAttnProcessor",)),),
        replicate=(("", "encoder_hidden_states"), ("", "encoder_attention_mask")),
        extra={"": SIMPLETUNER_TIMESTEPS},
        refuse=SIMPLETUNER_REFUSED_ARGUMENTS,
        check=no_token_routing,
    ),
}


#: Classes hfpatch looked at and does not shard, with the reason ``hfpatch info`` prints (README: "Not supported").
UNSUPPORTED: dict[str, str] = {
    "HeliosTransformer3DModel": (
        "one forward attends over sequences of different lengths (history + current chunk, current chunk only) "
        "split at a positional boundary; an exact plan needs several sharded sequences per forward"
    ),
    # Attention that is not full softmax attention over the sequence (a key mask at most).
    "AceStepTransformer1DModel": (
        "its sliding-window layers let each token attend only to keys within a window of its own position (a banded "
        "token x token mask); sequence-parallel attention is full attention with a key mask"
    ),
    "AnyFlowFARTransformer3DModel": (
        "frame-autoregressive: its self-attention is block-causal over frame chunks (a block mask and a KV cache of "
        "earlier chunks), not full attention"
    ),
    "Cosmos3OmniTransformer": (
        "its understanding tokens attend causally (is_causal) while generation tokens attend fully over one packed "
        "multimodal sequence addressed by per-modality index tensors: a causal token x token mask"
    ),
    "Kandinsky6SRTransformer3DModel": (
        "NABLA sparse attention: each query block attends to the key blocks whose pooled scores over the whole grid "
        "pass a threshold, plus a sliding-tile mask: a data-dependent block pattern over the full sequence"
    ),
    "MiniMaxMusic3RVQDepthDecoder": (
        "a causal (is_causal) decoder over the few RVQ levels of one frame: no long token sequence, and causal"
    ),
    "OmniGenTransformer2DModel": (
        "the caller's 3D attention mask over the packed [text, images] sequence is causal for the text and "
        "bidirectional within each image: a token x token mask"
    ),
    "PriorTransformer": "a causal mask over a short token sequence (the CLIP prior's 77 + 4 tokens)",
    "QwenImage21Transformer2DModel": (
        "text and image tokens are interleaved in one sequence and attend block-causally by segment (a flex block "
        "mask or per-segment boundaries), with a reference KV cache: not full attention"
    ),
    "RFD4ProteinaTransformer": (
        "pair-biased attention: every head adds a bias from an [N, N] pair representation (updated per layer), a "
        "token x token term"
    ),
    "SanaTransformer2DModel": (
        "linear (ReLU-kernel) attention sums over all keys without softmax (no log-sum-exp merge), and its Mix-FFN "
        "runs a 3x3 depthwise convolution over the 2D token grid, mixing tokens across any cut"
    ),
    "SanaVideoTransformer3DModel": (
        "linear (ReLU-kernel) attention without softmax, and its Mix-FFN runs depthwise convolutions over the "
        "video's token grid, mixing tokens across any cut"
    ),
    "SanaWMTransformer3DModel": (
        "gated delta-rule (linear recurrent) attention and short convolutions along time: a recurrence over the "
        "sequence, not softmax attention"
    ),
    "SanaWMLTX2RefinerTransformer3DModel": (
        "a chunk-causal autoregressive refiner: each chunk attends to a KV cache of earlier chunks"
    ),
    "T5FilmDecoder": "a causal decoder over note tokens (spectrogram diffusion), not a DiT over a token grid",
    "WanAnimate2Transformer3DModel": (
        "runs in two passes sharing a reference KV cache (kv_cache_mode 'extract' then 'cached'), with block masks "
        "built from the packed grid"
    ),
    "NucleusMoEImageTransformer2DModel": (
        "expert-choice MoE routing: each expert takes its top-C tokens over the whole image sequence, so a shard's "
        "routing depends on the other shards' tokens"
    ),
    # The tokens are regrouped by position.
    "WanAnimateTransformer3DModel": (
        "the face adapter regroups the video tokens per frame by position (query.unflatten(1, (T, -1))) to attend "
        "each frame to its own face-motion tokens, and the pose latents are added per frame to the patch grid: a "
        "shard is not a whole number of frames"
    ),
    # The sequence is gathered before layers with parameters.
    "LatteTransformer3DModel": (
        "its temporal blocks fold the spatial tokens into the batch ([B * S, F, D]) with a timestep repeated per "
        "spatial token, a batch-flattened tensor a sequence cut cannot reach"
    ),
    "AllegroTransformer3DModel": (
        "its rotary embedding is a pair (per-axis frequency tables, per-token position grids) the processor indexes "
        "per token, and its video mask is an additive -10000 bias over the video tokens"
    ),
    "LuminaNextDiT2DModel": (
        "its proportional attention scales the softmax by log(sequence length) of the tokens the processor sees "
        "(the pipeline passes base_sequence_length by default), which a cut changes"
    ),
    # Not a DiT over a token sequence of its own.
    "DualTransformer2DModel": (
        "a UNet component (two Transformer2DModel over one feature map, mixed by a ratio) inside UNet blocks whose "
        "convolutions mix neighbouring positions"
    ),
    "Transformer2DModel": (
        "the UNet block transformer: its continuous-input form normalises (GroupNorm) and projects a 2D feature "
        "map inside UNet blocks whose convolutions mix neighbouring positions (the patched form is "
        "PixArtTransformer2DModel's)"
    ),
    "TransformerTemporalModel": (
        "a UNet motion module: it attends over the frames of each pixel inside UNet blocks, whose convolutions mix "
        "neighbouring positions"
    ),
    "DreamLiteTransformer2DModel": (
        "a component of the DreamLite U-Net (continuous input: GroupNorm over a 2D feature map inside U-Net blocks "
        "whose convolutions mix neighbouring positions); hfpatch does not sequence-split U-Nets"
    ),
    "BriaFibo2Transformer2DModel": (
        "the per-token noise mask and the output's image tokens are taken by position from counts of the whole "
        "sequence (hidden_states[:, image_start : image_start + num_image_tokens]), and the gist tokens join in "
        "front or behind depending on the batch's text lengths"
    ),
}
