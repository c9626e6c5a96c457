"""Which diffusers VAE classes hfpatch splits by height, and why the others are not split.

:data:`REFUSED` is data (registry key -> reason), read by the registry without importing diffusers
(:data:`hfpatch.patches.BUILTIN_REFUSALS`): ``hfpatch.apply`` on a refused VAE raises with the reason, a pipeline
patch's ``repr`` says for its VAE whether it is split and, if not, why, and ``hfpatch info`` prints
:func:`support_table` (every class of ``diffusers.models.autoencoders``).

The classes split are those registered for a VAE family in :data:`hfpatch.patches.BUILTIN_FAMILIES`. A refused
class is one whose layers the height split cannot carry exactly (a transformer decoder attending over every
patch token, a diffusion decoder), one without an image height (the audio VAEs: waveforms and spectrograms), or
one no DiT pipeline of diffusers uses (not audited). A class in neither list has no split yet.

>>> from hfpatch.patches.vae.support import REFUSED
>>> REFUSED["diffusers.AutoencoderOobleck"][:8]
'an audio'
"""

from __future__ import annotations

__all__ = ["REFUSED", "support_table"]


def _audio(what: str, signal: str, used_by: str) -> str:
    return f"an audio {what} ({used_by}) over {signal}: no image height to split"


def _unused(used_by: str) -> str:
    return f"not audited: no DiT pipeline of diffusers uses it ({used_by})"


#: Registry key -> why hfpatch does not split the class (``hfpatch info``, the ``apply`` error, a pipeline patch's
#: ``repr``).
REFUSED: dict[str, str] = {
    # Used by DiT pipelines, not split.
    "diffusers.AutoencoderKLMiniMaxH3": (
        "its decoder is a ViT (MiniMaxH3VideoViTDecoder3d): every patch token attends to every other token of the "
        "video, with 3D rotary positions and LayerNorm per token, not a convolution stack; splitting it is "
        "sequence parallelism of a transformer, not a height split with halos"
    ),
    "diffusers.AutoencoderRAE": (
        "a representation autoencoder: a pretrained ViT encoder (DINOv2, SigLIP2 or MAE) and a ViT-MAE decoder, "
        "full attention over every patch token (plus a class token), not a convolution stack"
    ),
    "diffusers.LTX2VideoDiffusionDecoderModel": (
        "a diffusion decoder: each decode runs denoising steps of a transformer with neighbourhood attention "
        "(a FlexAttention block mask over T x H x W windows, or NATTEN) and adaptive norms; its windows are not "
        "carried by the height split yet"
    ),
    "diffusers.Kandinsky6SRVAE": (
        "not audited yet: causal 3D convs that thread a per-call cache dict through every block, a SpatialNorm3D "
        "conditioned on the upsampled latents and time-chunked SafeConv3d; no split family for it yet"
    ),
    "diffusers.AutoencoderKLMagvit": (
        "EasyAnimate's VAE has no family module yet; its causal 3D convs and GroupNorms are of kinds the split "
        "already carries for the other video VAEs, so it is planned, not ruled out"
    ),
    "diffusers.RFD4ProteinaAutoencoder": (
        "a protein-structure autoencoder (RFD4 Proteina): atoms and residues with pair-biased attention, no "
        "image height"
    ),
    "diffusers.AutoencoderOobleck": _audio("VAE", "a waveform (1D convolutions)", "Stable Audio, ACE-Step"),
    "diffusers.AutoencoderSAME": _audio(
        "VAE", "a waveform (1D convolutions and transformers)", "Stable Audio 3"
    ),
    "diffusers.AutoencoderKLLTX2Audio": _audio(
        "VAE", "a mel spectrogram (time x mel bins)", "LTX-2's audio_vae"
    ),
    "diffusers.AutoencoderKLMiniMaxH3Audio": _audio("VAE", "a waveform (1D convolutions)", "MiniMax-H3"),
    "diffusers.LongCatAudioDiTVae": _audio("VAE", "a waveform (1D convolutions)", "LongCat-Audio-DiT"),
    "diffusers.MMAudioVAE": _audio(
        "VAE", "a mel spectrogram (1D convolutions over time)", "Kandinsky 6 audio"
    ),
    "diffusers.MMAudioVocoder": _audio(
        "vocoder", "a mel spectrogram, its output a waveform", "Kandinsky 6 audio"
    ),
    "diffusers.MiniMaxMusic3Vocoder": _audio(
        "vocoder", "codec latents, its output a waveform", "MiniMax Music 3"
    ),
    "diffusers.Cosmos3AVAEAudioTokenizer": _audio(
        "tokenizer", "a waveform and its spectrogram", "Cosmos 3 Omni's sound_tokenizer"
    ),
    "diffusers.AutoencoderKLKVAEAudio": _audio(
        "VAE", "a waveform (1D convolutions)", "no diffusers pipeline"
    ),
    # Not used by a DiT pipeline: not audited.
    "diffusers.AsymmetricAutoencoderKL": _unused("Stable Diffusion inpainting, a U-Net pipeline"),
    "diffusers.AutoencoderKLTemporalDecoder": _unused("Stable Video Diffusion, a U-Net pipeline"),
    "diffusers.AutoencoderTiny": _unused("DreamLite's U-Net pipelines; an optional drop-in elsewhere"),
    "diffusers.ConsistencyDecoderVAE": _unused("an optional consistency decoder for Stable Diffusion"),
    "diffusers.VQModel": _unused("aMUSEd, Kandinsky 2 and VQ-Diffusion, U-Net or token pipelines"),
    "diffusers.AutoencoderKLKVAE": _unused("no diffusers pipeline"),
    "diffusers.AutoencoderKLKVAEVideo": _unused("no diffusers pipeline"),
    "diffusers.AutoencoderVidTok": _unused("no diffusers pipeline"),
}


def support_table() -> list[tuple[str, str]]:
    """``(class name, how hfpatch handles it)`` for every model class ``diffusers.models.autoencoders`` exports:
    the VAE family that splits it, or why it is not split (what ``hfpatch info`` prints).
    """
    import diffusers.models.autoencoders as autoencoders
    import torch

    from .. import default_registry

    registry = default_registry()
    rows = []
    for name in sorted(dir(autoencoders)):
        cls = getattr(autoencoders, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            continue
        family = next((f for f in registry.families_for_class(cls) if f.role == "vae"), None)
        if family is not None:
            rows.append((name, f"split by height ({family.name})"))
        else:
            why = registry.refusal_for_class(cls) or "no split family for this class yet"
            rows.append((name, f"not split ({why})"))
    return rows
