"""Sequence-parallel DiT transformers (``hfpatch.patches.dit``) vs the unpatched stock models, gloo, fp32.

Every rank builds the same tiny model and inputs from fixed seeds, runs the unpatched model (the
reference), applies ``hfpatch.apply(model, parallel=ParallelConfig(ulysses=u, ring=r))`` and runs again.
Token counts are 25 (or 12) so that most world sizes leave padding. Many cases run per ``pool.run``.

Tolerances: sharding changes only the order of floating-point reductions (online-softmax merge across ring
steps, shorter GEMMs, gradient contributions summed over ranks), so the patched model may differ from the
unpatched one by fp32 rounding only. Each case measures that rounding scale on the unpatched model itself
(fp32 vs fp64, same weights and inputs; for gradients, the worst tensor's) and allows
``hfpatch.testing.tolerance.reassociation_tol`` of it (10x, at least 8 ulps): tiny random models can be
ill-conditioned (SD3 without qk-norm amplifies fp32 rounding to ~1e-5 in the output and ~1e-3 in some
gradients on its own), and a fixed tolerance would either hide bugs in the others or fail on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hfpatch
from hfpatch import ParallelConfig, all_reduce_gradients
from hfpatch.core.registry import Registry
from hfpatch.distributed.runtime import get_mesh
from hfpatch.testing.runner import spread
from hfpatch.testing.tolerance import (
    reassociation_tol,
    rel_error,
    stochastic_rounding_noise,
    to_fp64,
    without_inside_rounding,
)

FAMILIES = ("wan21", "wan22", "flux", "sd3", "sd35", "cogvideox")
#: More classes of the plan-driven family (hfpatch.patches.dit; FAMILIES are too): diffusers' _cp_plan,
#: translated (QwenImage, Flux.2, LTX-Video), or hfpatch's table plan (ChronoEdit, Wan VACE, HunyuanVideo,
#: HunyuanDiT and PixArt: their stock processors attend by F.scaled_dot_product_attention, like SD3's and
#: CogVideoX's).
PLANNED = (
    "qwenimage",
    "qwenimage_mask",
    "flux2",
    "ltx",
    "ltx_tokens",
    "chronoedit",
    "wan_vace",
    "hunyuanvideo",
    "hunyuanvideo15",
    "ltx2",
    "minimax_h3",
    "hunyuandit",
    "pixart",
)
#: ControlNet residuals cut with the tokens (and Flux.1's deprecated 3D ids): forward only.
CONTROLNET = ("flux_cn", "sd35_cn", "hunyuandit_cn")


# ----------------------------------------------------------------------------------------------- cases
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def build(family: str) -> tuple[torch.nn.Module, dict[str, Any], str]:
    """(tiny stock model, forward kwargs, name of the sharded input) for ``family``.

    A ``_gc`` suffix turns on the model's gradient checkpointing: blocks are recomputed in backward, so the
    split hook on the first block runs again on the full input and must cut the same shard.
    """
    from hfpatch import testing
    from hfpatch.testing.dits import TINY_DITS, tiny_dit, tiny_dit_inputs

    if family in TINY_DITS:  # the data-described rows (hfpatch.testing.dits)
        return tiny_dit(family), tiny_dit_inputs(family), "hidden_states"
    if family.endswith("_cn"):  # ControlNet residuals (lists of [B, S, D], cut like the tokens)
        model, kwargs, name = build(family.removesuffix("_cn"))
        dim = model.config.num_attention_heads * model.config.attention_head_dim
        batch, tokens = kwargs["hidden_states"].shape[0], 25

        def residuals(n: int, seed: int) -> list[torch.Tensor]:
            return [_randn(batch, tokens, dim, seed=seed + i) for i in range(n)]

        if family == "flux_cn":  # and the deprecated 3D ids [B, S, 3]
            kwargs.update(
                img_ids=kwargs["img_ids"][None],
                txt_ids=kwargs["txt_ids"][None],
                controlnet_block_samples=residuals(1, 11),
                controlnet_single_block_samples=residuals(1, 12),
            )
        elif family == "sd35_cn":  # qk-norm: tiny SD3 without it is too ill-conditioned for Ring at 10x noise
            kwargs["block_controlnet_hidden_states"] = residuals(2, 11)
        else:  # HunyuanDiT: one residual per long skip (block 3 of 4)
            kwargs["controlnet_block_samples"] = residuals(1, 11)
        return model, kwargs, name
    if family.endswith("_gc"):
        model, kwargs, name = build(family.removesuffix("_gc"))
        model.enable_gradient_checkpointing()
        return model, kwargs, name

    if family in ("wan21", "wan22"):
        model = testing.tiny_wan_transformer()
        if family == "wan21":  # 1 x 5 x 5 = 25 tokens, batch 2
            x = _randn(2, 4, 1, 10, 10, seed=1)
            timestep = torch.tensor([500, 20])
        else:  # Wan 2.2 expand_timesteps: one timestep per token, 2 x 2 x 3 = 12 tokens
            x = _randn(1, 4, 2, 4, 6, seed=1)
            timestep = torch.randint(0, 1000, (1, 12), generator=_gen(2))
        kwargs = dict(
            hidden_states=x, timestep=timestep, encoder_hidden_states=_randn(x.shape[0], 6, 16, seed=3)
        )
        return model, kwargs, "hidden_states"
    if family == "flux":  # 5 x 5 = 25 image tokens, 7 text tokens
        return testing.tiny_flux_transformer(), testing.flux_inputs(), "hidden_states"
    if family in ("sd3", "sd35"):  # 5 x 5 = 25 image tokens, 7 text tokens
        overrides = dict(dual_attention_layers=(0,), qk_norm="rms_norm") if family == "sd35" else {}
        model = testing.tiny_sd3_transformer(**overrides)
        kwargs = dict(
            hidden_states=_randn(1, 4, 10, 10, seed=1),
            encoder_hidden_states=_randn(1, 7, 16, seed=2),
            pooled_projections=_randn(1, 16, seed=3),
            timestep=torch.tensor([700]),
        )
        return model, kwargs, "hidden_states"
    if family == "cogvideox":  # 1 x 5 x 5 = 25 video tokens, 6 text tokens, rotary positions
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        model = testing.tiny_cogvideox_transformer()
        rotary = get_3d_rotary_pos_embed(16, ((0, 0), (5, 5)), (5, 5), 1, use_real=True)
        kwargs = dict(
            hidden_states=_randn(1, 1, 4, 10, 10, seed=1),
            encoder_hidden_states=_randn(1, 6, 16, seed=2),
            timestep=torch.tensor([300]),
            image_rotary_emb=tuple(t.float() for t in rotary),
        )
        return model, kwargs, "hidden_states"
    if family == "cogvideox_2b":  # 2B layout: learned positions inside the patch embedding, no rotary table;
        # batch 2, 2 frames x 5 x 5 = 50 video tokens, so the sequence length is measured at the embedding
        model = testing.tiny_cogvideox_transformer(
            use_rotary_positional_embeddings=False, sample_frames=5, sample_height=10, sample_width=10
        )
        kwargs = dict(
            hidden_states=_randn(2, 2, 4, 10, 10, seed=1),
            encoder_hidden_states=_randn(2, 8, 16, seed=2),  # the learned positions cover max_text_seq_length
            timestep=torch.tensor([300, 700]),
        )
        return model, kwargs, "hidden_states"
    if family in ("qwenimage", "qwenimage_mask"):  # 5 x 5 = 25 image tokens, 6 text tokens, joint attention
        model = testing.tiny_qwenimage_transformer()
        kwargs = dict(
            hidden_states=_randn(2, 25, 16, seed=1),
            encoder_hidden_states=_randn(2, 6, 16, seed=2),
            timestep=torch.tensor([0.7, 0.2]),
            img_shapes=[[(1, 5, 5)]] * 2,
        )
        if (
            family == "qwenimage_mask"
        ):  # padded prompts: a gap, then trailing padding (keys masked per sample)
            kwargs["encoder_hidden_states_mask"] = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
        return model, kwargs, "hidden_states"
    if family == "flux2":  # 5 x 5 = 25 image tokens, 7 text tokens, 4-axis ids
        model = testing.tiny_flux2_transformer()
        axes = torch.meshgrid(
            torch.arange(1), torch.arange(5), torch.arange(5), torch.arange(1), indexing="ij"
        )
        kwargs = dict(
            hidden_states=_randn(1, 25, 16, seed=1),
            encoder_hidden_states=_randn(1, 7, 16, seed=2),
            timestep=torch.tensor([0.7]),
            img_ids=torch.stack(axes, -1).reshape(1, 25, 4).float(),
            txt_ids=torch.cat([torch.zeros(7, 3), torch.arange(7.0)[:, None]], 1)[None],
        )
        return model, kwargs, "hidden_states"
    if family in ("ltx", "ltx_tokens"):  # video self-attention, cross-attention to masked text
        model = testing.tiny_ltx_transformer()
        if family == "ltx":  # 1 x 5 x 5 = 25 tokens, batch 2, one timestep per sample
            frames, height, width, batch = 1, 5, 5, 2
            timestep = torch.tensor([500, 20])
        else:  # 2 x 2 x 3 = 12 tokens, one timestep per token (LTX 0.9.5 conditioning)
            frames, height, width, batch = 2, 2, 3, 1
            timestep = torch.randint(0, 1000, (1, 12), generator=_gen(2))
        kwargs = dict(
            hidden_states=_randn(batch, frames * height * width, 8, seed=1),
            encoder_hidden_states=_randn(batch, 6, 16, seed=2),
            encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])[:batch],
            timestep=timestep,
            num_frames=frames,
            height=height,
            width=width,
        )
        return model, kwargs, "hidden_states"
    if family == "chronoedit":  # 2 x 5 x 5 = 50 tokens (the temporal-skip rotary of 2 frames), image keys
        model = testing.tiny_chronoedit_transformer()
        kwargs = dict(
            hidden_states=_randn(1, 4, 2, 10, 10, seed=1),
            timestep=torch.tensor([300]),
            encoder_hidden_states=_randn(1, 6, 16, seed=2),
            encoder_hidden_states_image=_randn(1, 3, 16, seed=3),
        )
        return model, kwargs, "hidden_states"
    if family == "wan_vace":  # 1 x 5 x 5 = 25 tokens, batch 2, a control video of the latent's size
        model = testing.tiny_wan_vace_transformer()
        kwargs = dict(
            hidden_states=_randn(2, 4, 1, 10, 10, seed=1),
            timestep=torch.tensor([500, 20]),
            encoder_hidden_states=_randn(2, 6, 16, seed=3),
            control_hidden_states=_randn(2, 8, 1, 10, 10, seed=4),
            control_hidden_states_scale=torch.tensor([1.0, 0.5]),
        )
        return model, kwargs, "hidden_states"
    if (
        family == "hunyuanvideo"
    ):  # 1 x 5 x 5 = 25 video tokens, batch 2, padded text (masked keys, per sample)
        model = testing.tiny_hunyuanvideo_transformer()
        kwargs = dict(
            hidden_states=_randn(2, 4, 1, 10, 10, seed=1),
            timestep=torch.tensor([500, 20]),
            encoder_hidden_states=_randn(2, 6, 16, seed=2),
            encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
            pooled_projections=_randn(2, 16, seed=3),
        )
        return model, kwargs, "hidden_states"
    if family == "hunyuanvideo15":  # 1 x 5 x 5 = 25 video tokens, batch 2, three padded texts (token mask)
        model = testing.tiny_hunyuanvideo15_transformer()
        kwargs = dict(
            hidden_states=_randn(2, 4, 1, 5, 5, seed=1),
            timestep=torch.tensor([500.0, 20.0]),
            encoder_hidden_states=_randn(2, 6, 16, seed=2),
            encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
            encoder_hidden_states_2=_randn(2, 4, 16, seed=3),
            encoder_attention_mask_2=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]),
            image_embeds=torch.zeros(2, 3, 16),  # text-to-video: the image tokens are masked
        )
        return model, kwargs, "hidden_states"
    if family in ("ltx2", "ltx2_tokens"):  # video sharded, audio replicated (5 tokens), masked text
        if family == "ltx2":  # 1 x 5 x 5 = 25 video tokens, batch 2, one timestep per sample
            model = testing.tiny_ltx2_transformer()
            frames, height, width, batch = 1, 5, 5, 2
            timesteps = dict(timestep=torch.tensor([500.0, 20.0]))
        else:  # 2 x 2 x 3 = 12 tokens, per-token video timesteps (conditioning), split rope, gated attention
            model = testing.tiny_ltx2_transformer(rope_type="split", gated_attn=True, audio_gated_attn=True)
            frames, height, width, batch = 2, 2, 3, 1
            timesteps = dict(
                timestep=torch.randint(0, 1000, (1, 12), generator=_gen(2)).float(),
                audio_timestep=torch.tensor([300.0]),
            )
        kwargs = dict(
            hidden_states=_randn(batch, frames * height * width, 8, seed=1),
            audio_hidden_states=_randn(batch, 5, 8, seed=4),
            encoder_hidden_states=_randn(batch, 6, 16, seed=2),
            audio_encoder_hidden_states=_randn(batch, 6, 16, seed=3),
            encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])[:batch],
            num_frames=frames,
            height=height,
            width=width,
            audio_num_frames=5,
            **timesteps,
        )
        return model, kwargs, "hidden_states"
    if family == "minimax_h3":  # one packed sequence: 4 text, 15 video (3 x 5 patches), 6 audio = 25 rows
        model = testing.tiny_minimax_h3_transformer()
        order = torch.randperm(25, generator=_gen(5))  # the modalities' rows interleaved in the sequence
        text_indices, video_indices, audio_indices = order[:4], order[4:19], order[19:]
        tags = (
            torch.zeros(25, dtype=torch.long).index_fill(0, text_indices, 1).index_fill(0, audio_indices, 2)
        )
        kwargs = dict(
            hidden_states=_randn(1, 15, 8, seed=1),
            audio_hidden_states=_randn(1, 6, 8, seed=4),
            encoder_hidden_states=_randn(1, 4, 16, seed=2),
            timestep=torch.tensor([0.7, 0.0]),  # noisy targets, clean text
            timestep_indices=(tags == 1).long(),
            token_tags=tags,
            position_ids=torch.randint(0, 6, (25, 3), generator=_gen(6)),
            video_indices=video_indices,
            audio_indices=audio_indices,
            text_indices=text_indices,
        )
        return model, kwargs, "hidden_states"
    if family == "hunyuandit":  # 5 x 5 = 25 image tokens, batch 2, 2D rotary, padded CLIP and T5 text
        from diffusers.models.embeddings import get_2d_rotary_pos_embed

        model = testing.tiny_hunyuandit_transformer()
        rotary = get_2d_rotary_pos_embed(8, ((0, 0), (5, 5)), (5, 5), output_type="pt")
        kwargs = dict(
            hidden_states=_randn(2, 4, 10, 10, seed=1),
            timestep=torch.tensor([500.0, 20.0]),
            encoder_hidden_states=_randn(2, 4, 16, seed=2),
            text_embedding_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
            encoder_hidden_states_t5=_randn(2, 6, 16, seed=3),
            text_embedding_mask_t5=torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
            image_rotary_emb=tuple(t.float() for t in rotary),
        )
        return model, kwargs, "hidden_states"
    if family == "pixart":  # 5 x 5 = 25 image tokens, batch 2, cross-attention to a key-masked text
        model = testing.tiny_pixart_transformer()
        kwargs = dict(
            hidden_states=_randn(2, 4, 10, 10, seed=1),
            encoder_hidden_states=_randn(2, 6, 16, seed=2),
            encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
            timestep=torch.tensor([500, 20]),
        )
        return model, kwargs, "hidden_states"
    raise ValueError(family)


def _sample(out: Any) -> torch.Tensor:
    """The model's output: ``sample``, with LTX-2's replicated ``audio_sample`` flattened after it."""
    audio = getattr(out, "audio_sample", None)
    if isinstance(out.sample, list):  # Z-Image: one [C, F, H, W] per sample
        return torch.stack(out.sample)
    if audio is None:
        return out.sample
    return torch.cat([out.sample.flatten(1), audio.flatten(1)], dim=1)


def _double(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """An fp64 copy of the model and inputs: the unpatched fp32 model's own rounding scale.

    Some stock code makes fp32 tensors on its own (``Timesteps`` embeddings ``.float()``, Motif-Video feeds them to
    a Linear uncast): every module with parameters of the copy casts its floating inputs to fp64 first.
    """
    model64 = to_fp64(model)

    def upcast(_module, args, kwargs):
        cast = lambda v: v.double() if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v  # noqa: E731
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    for module in model64.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(upcast, with_kwargs=True)
    return model64, to_fp64(kwargs)


# ----------------------------------------------------------------------------------------------- rank functions
def _gathered_layouts(model: torch.nn.Module) -> tuple[list[tuple[str, bool]], list[Any]]:
    """Record ``(path, is_contiguous)`` of the output of every module where the model's plan gathers (hooks)."""
    from hfpatch.patches.dit.family import PlannedDiTUSP
    from hfpatch.patches.dit.sequence_parallel import expand_plan
    from hfpatch.patches.dit.vocabulary import GatherOutput

    seen: list[tuple[str, bool]] = []
    handles = []
    for path, specs in expand_plan(model, PlannedDiTUSP().plan_for(model)).items():
        for spec in specs:
            if isinstance(spec, GatherOutput):

                def record(_m, _args, out, path=path, index=spec.index):
                    seen.append((path, (out if index is None else out[index]).is_contiguous()))

                handles.append(model.get_submodule(path).register_forward_hook(record))
    return seen, handles


def _rounds_inside(family: str) -> torch.dtype | None:
    """The dtype the family's stock code rounds to inside even in fp32 (:attr:`TinyDiT.rounds_inside`), or None."""
    from hfpatch.testing.dits import TINY_DITS

    name = TINY_DITS[family].rounds_inside if family in TINY_DITS else None
    return None if name is None else getattr(torch, name)


def _tolerance(
    family: str, noise: float, smooth_noise: Callable[[], float], result: Callable[[], Any], **compare
) -> float:
    """The case's tolerance: ``reassociation_tol`` of the unpatched model's fp32-vs-fp64 ``noise``. For a family
    that rounds inside, the fp64 twin rounds too and shows the flips of those roundings only by chance: then the
    smooth part's noise (``smooth_noise()`` run :func:`without_inside_rounding`) plus the
    :func:`stochastic_rounding_noise` of ``result()``, the envelope of the flips that a reassociation makes of those
    roundings on any CPU kernel (issue 53; the derivation is in tests/patches/test_dit_streams.py)."""
    dtype = _rounds_inside(family)
    if dtype is None:
        return reassociation_tol(noise)
    with without_inside_rounding(dtype):
        smooth = smooth_noise()
    return reassociation_tol(smooth) + stochastic_rounding_noise(result, dtype=dtype, **compare)


def forward_cases(
    cases: list[tuple[str, int, int]],
) -> dict[tuple[str, int, int], tuple[float, float, torch.Tensor]]:
    """Per case ``(family, ulysses, ring)``: (error vs unpatched, tolerance (:func:`_tolerance`), patched output).

    The unpatched reference and its fp64 noise are computed once per family, on one rank of the pool and shared
    (:func:`~hfpatch.testing.runner.spread`; a fresh model per case). The gathered
    outputs are contiguous wherever the unpatched ones are (the stock code may ``.view()`` them: AnyFlow does).
    """

    def reference(family: str) -> tuple[torch.Tensor, float, list]:
        model = build(family)[0]
        with torch.no_grad():
            # Inputs of their own: HunyuanDiT's stock forward pops its ControlNet residuals off the list.
            model64, kwargs64 = _double(model, build(family)[1])
            layouts, handles = _gathered_layouts(model)
            ref = _sample(model(**build(family)[1]))
            for handle in handles:
                handle.remove()
            tol = _tolerance(
                family,
                rel_error(ref, _sample(model64(**kwargs64))),
                lambda m=model, m64=model64, f=family: rel_error(
                    _sample(m(**build(f)[1])), _sample(m64(**to_fp64(build(f)[1])))
                ),
                lambda m=model, f=family: _sample(m(**build(f)[1])),
            )
        return ref, tol, layouts

    references = spread([family for family, *_ in cases], reference)  # each on one rank, shared
    results = {}
    for family, ulysses, ring in cases:
        model, kwargs, _ = build(family)
        ref, tol, unpatched_layouts = references[family]
        with torch.no_grad(), hfpatch.apply(model, parallel=ParallelConfig(ulysses=ulysses, ring=ring)):
            layouts, handles = _gathered_layouts(model)
            out = _sample(model(**kwargs))
            for handle in handles:
                handle.remove()
        assert out.shape == ref.shape and out.dtype == ref.dtype, (family, out.shape, ref.shape)
        assert all(got or not stock for (_, got), (_, stock) in zip(layouts, unpatched_layouts)), (
            family,
            layouts,
            unpatched_layouts,
        )
        assert len(layouts) == len(unpatched_layouts) > 0, (family, layouts)
        results[(family, ulysses, ring)] = (rel_error(out, ref), tol, out)
    return results


def _grads(
    model: torch.nn.Module, kwargs: dict[str, Any], weight: torch.Tensor, group=None
) -> dict[str, torch.Tensor]:
    """Gradients of a fixed linear loss; with ``group``, summed over it (the documented convention)."""
    model.zero_grad(set_to_none=True)
    inputs = {k: v.clone().requires_grad_(True) for k, v in kwargs.items() if k in _GRAD_INPUTS}
    out = _sample(model(**{**kwargs, **inputs}))
    (out * weight).sum().backward()
    all_reduce_gradients([model, *inputs.values()], group)
    grads = {f"param:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads.update({f"input:{k}": v.grad for k, v in inputs.items()})
    return grads


_GRAD_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "audio_hidden_states")


def backward_cases(cases: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], dict[str, Any]]:
    """Per case: gradient errors after the documented SUM over the ``sp`` group, and the fp32 noise.

    The unpatched gradients (fp32 and fp64) are computed once per family, on one rank of the pool and shared (a fresh
    model per case).
    """

    def reference(family: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float], float]:
        model, kwargs, _ = build(family)
        model.train()
        model64, kwargs64 = _double(model, kwargs)
        weight = _randn(*_sample(model(**kwargs)).shape, seed=7)
        ref = _grads(model, kwargs, weight)
        ref64 = _grads(model64, kwargs64, weight.double())
        # Key biases have an exactly-zero true gradient (softmax ignores a per-query constant), so their
        # values are rounding noise: errors are relative to max(|ref|, 1% of the largest gradient).
        floor = 0.01 * max(g.abs().max().item() for g in ref64.values())
        scales = {name: max(g.abs().max().item(), floor) for name, g in ref64.items()}

        # The unpatched model's own rounding scale for its gradients (its worst tensor).
        def gradient_noise(fp32: dict[str, torch.Tensor], fp64: dict[str, torch.Tensor], s=scales) -> float:
            return max(rel_error(fp32[name], fp64[name], s[name]) for name in fp32)

        tol = _tolerance(
            family,
            gradient_noise(ref, ref64),
            lambda m=model, kw=kwargs, m64=model64, kw64=kwargs64, w=weight: gradient_noise(
                _grads(m, kw, w), _grads(m64, kw64, w.double())
            ),
            lambda m=model, kw=kwargs, w=weight: _grads(m, kw, w),
            scales=scales,
        )
        return weight, ref, scales, tol

    references = spread([family for family, *_ in cases], reference)  # each on one rank, shared
    results = {}
    for family, ulysses, ring in cases:
        model, kwargs, _ = build(family)
        model.train()
        weight, ref, scales, tol = references[family]
        config = ParallelConfig(ulysses=ulysses, ring=ring)
        with hfpatch.apply(model, parallel=config):
            got = _grads(model, kwargs, weight, get_mesh(config).group("sp"))
        results[(family, ulysses, ring)] = {
            "keys_match": set(got) == set(ref),
            "errors": {name: rel_error(got[name], ref[name], scales[name]) for name in ref},
            "tol": tol,
            "n_params": sum(k.startswith("param:") for k in ref),
        }
    return results


def _snapshot(model: torch.nn.Module) -> list[tuple[Any, dict[str, Any], dict[str, tuple]]]:
    """vars() of every submodule and processor, plus the contents of every hook dict (same objects)."""
    snap = []
    for module in model.modules():
        hooks = {
            k: tuple(v.items())
            for k, v in vars(module).items()
            if k.startswith("_forward") and isinstance(v, dict)
        }
        snap.append((module, dict(vars(module)), hooks))
        processor = getattr(module, "processor", None)
        if processor is not None:
            snap.append((processor, dict(vars(processor)), {}))
    return snap


def _same(before: list, after: list) -> bool:
    if len(before) != len(after):
        return False
    for (obj_b, vars_b, hooks_b), (obj_a, vars_a, hooks_a) in zip(before, after):
        if obj_b is not obj_a or vars_b.keys() != vars_a.keys():
            return False
        if any(vars_b[k] is not vars_a[k] for k in vars_b) or hooks_b != hooks_a:
            return False
    return True


def lifecycle_cases(families: list[str]) -> dict[str, dict[str, Any]]:
    """remove() restores identity, double apply returns the live patch, a different plan raises."""
    world = dist.get_world_size()
    results = {}
    for family in families:
        model, kwargs, _ = build(family)
        with torch.no_grad():  # stock caches (AnyFlow's rotary table) are filled before the snapshot
            model(**build(family)[1])
        before = _snapshot(model)
        config = ParallelConfig(ulysses=world)
        patch = hfpatch.apply(model, parallel=config)
        swapped = sum("processor" in line for line in patch.entries())
        again = hfpatch.apply(model, parallel=config)
        try:
            hfpatch.apply(model, parallel=ParallelConfig(ring=world))
            conflict = None
        except ValueError as exc:
            conflict = str(exc)
        with torch.no_grad():
            model(**kwargs)  # hooks ran and left no state on the model
        patch.remove()
        results[family] = {
            "identity": _same(before, _snapshot(model)),
            "again_is_patch": again is patch,
            "conflict": conflict,
            "swapped": swapped,
            "repr": patch.describe(),
        }
    return results


def error_cases() -> dict[str, str]:
    """Errors raised before any collective (the same message on every rank)."""
    from diffusers import UNet2DModel

    from hfpatch.patches.dit import PlannedDiTUSP
    from hfpatch.testing import tiny_flux_transformer, tiny_wan_transformer

    world = dist.get_world_size()
    registry = Registry()
    for key in (
        "diffusers.WanTransformer3DModel",
        "diffusers.FluxTransformer2DModel",
        "diffusers.SD3Transformer2DModel",
        "diffusers.CogVideoXTransformer3DModel",
    ):
        registry.register(key, PlannedDiTUSP)
    messages: dict[str, str] = {}

    def expect(name: str, error: type[Exception], fn: Callable[[], Any]) -> None:
        try:
            fn()
        except error as exc:
            messages[name] = str(exc)
        else:
            messages[name] = "no error"

    unet = UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        block_out_channels=(4,),
        layers_per_block=1,
        down_block_types=("DownBlock2D",),
        up_block_types=("UpBlock2D",),
        norm_num_groups=2,
    )
    expect("unsupported", TypeError, lambda: hfpatch.apply(unet, parallel=world, registry=registry))
    wide = tiny_wan_transformer(num_heads=1, head_dim=16)
    expect(
        "too_many_ulysses", ValueError, lambda: hfpatch.apply(wide, parallel=ParallelConfig(ulysses=world))
    )
    flux = tiny_flux_transformer()
    flux.transformer_blocks[0].attn.processor = _CustomProcessor()
    before = _snapshot(flux)
    expect("custom_processor", ValueError, lambda: hfpatch.apply(flux, parallel=ParallelConfig(ring=world)))
    messages["untouched_after_error"] = str(_same(before, _snapshot(flux)))
    return messages


class _CustomProcessor:
    """Stands for an IP-Adapter or user processor the USP patch must not silently replace."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("not called")


# ----------------------------------------------------------------------------------------------- tests
def check_forward(results: list[dict], cases: list[tuple[str, int, int]]) -> None:
    """Every rank's output of every case within its tolerance (:func:`_tolerance`) of the unpatched model, and the
    ranks' outputs bit-identical (they gather the same shards)."""
    for case in cases:
        for error, tol, _ in (rank_result[case] for rank_result in results):
            assert error <= tol, (case, error, tol)
        outputs = [rank_result[case][2] for rank_result in results]
        assert all(torch.equal(outputs[0], o) for o in outputs[1:]), (
            f"{case}: ranks returned different outputs"
        )


def check_backward(results: list[dict], cases: list[tuple[str, int, int]]) -> None:
    """Every rank's parameter and input gradients of every case (after the sp sum) within its tolerance."""
    for rank, rank_result in enumerate(results):
        for case in cases:
            result = rank_result[case]
            assert result["keys_match"] and result["n_params"] > 10, (rank, case)
            for name, error in result["errors"].items():
                assert error <= result["tol"], (rank, case, name, error, result["tol"])


def _configs(world: int) -> list[tuple[int, int]]:
    configs = [(world, 1), (1, world)]  # Ulysses only, Ring only
    if world == 4:
        configs.append((2, 2))
    return configs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_usp_forward_every_family_and_layout_matches_unpatched(rank_pool, world):
    cases = [(family, u, r) for family in FAMILIES for u, r in _configs(world)]
    if world == 3:  # CogVideoX 2B: the sequence measured where its patch embedding's output is cut
        cases += [("cogvideox_2b", 3, 1), ("cogvideox_2b", 1, 3)]
    check_forward(rank_pool(world).run(forward_cases, cases), cases)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_usp_backward_param_and_input_grads_after_sp_sum_match_unpatched(rank_pool, world):
    cases = [(family, u, r) for family in FAMILIES for u, r in _configs(world)]
    if world == 2:
        cases += [("wan22_gc", 1, 2), ("flux_gc", 2, 1), ("cogvideox_gc", 1, 2), ("cogvideox_2b", 2, 1)]
    if world == 4:
        cases = [(family, u, r) for family in FAMILIES for u, r in [(2, 2), (1, 4)]]
    check_backward(rank_pool(world).run(backward_cases, cases), cases)


def test_usp_lifecycle_remove_restores_identity_double_apply_conflict(rank_pool):
    results = rank_pool(2).run(lifecycle_cases, list(FAMILIES))
    expected_swaps = {"wan21": 2, "wan22": 2, "flux": 2, "sd3": 2, "sd35": 3, "cogvideox": 2}
    for rank_result in results:
        for family, result in rank_result.items():
            assert result["identity"], family
            assert result["again_is_patch"], family
            assert result["conflict"] is not None and "already patched" in result["conflict"], family
            assert result["swapped"] == expected_swaps[family], (family, result["repr"])


def test_usp_errors_unsupported_class_heads_and_custom_processor_raise_before_collectives(rank_pool):
    results = rank_pool(2).run(error_cases)
    assert results[0] == results[1]
    messages = results[0]
    for name in (
        "CogVideoXTransformer3DModel",
        "FluxTransformer2DModel",
        "SD3Transformer2DModel",
        "WanTransformer3DModel",
    ):
        assert name in messages["unsupported"], messages["unsupported"]
    assert "UNet2DModel" in messages["unsupported"]
    assert "ulysses=2 exceeds the 1 attention heads" in messages["too_many_ulysses"]
    assert (
        "transformer_blocks.0.attn uses attention processor _CustomProcessor" in messages["custom_processor"]
    )
    assert messages["untouched_after_error"] == "True"


def test_usp_degree_one_patches_nothing():
    from hfpatch.testing import tiny_flux_transformer

    model = tiny_flux_transformer()
    with hfpatch.apply(model) as patch:
        assert not any("processor" in line or "hook" in line for line in patch.entries())
