"""The base family of the height-split VAE patches (:mod:`hfpatch.patches.vae.wan`, :mod:`hfpatch.patches.vae.kl`).

How a patched ``vae.decode`` runs on N ranks (every rank passes the same latents; checked at the entry):

1. ``vae._decode`` opens a *session*; the stock code runs unchanged on the full input until it calls the
   encoder or decoder, whose entry slices the input along height (latent rows split evenly, scaled by the
   module's factor so every stride-2/patchify boundary is a shard boundary).
2. Inside, every row-coupling layer is swapped per object: convs exchange ``k // 2`` halo rows with their
   neighbours (:func:`hfpatch.distributed.collectives.halo_exchange`) and zero-pad only at the global
   border, GroupNorm combines per-rank statistics, attention gathers keys/values (queries stay local).
   Wan's causal ``feat_cache`` keeps working shard by shard; each causal conv also keeps the halo rows of
   its cached frames, so only new frames cross the wire.
3. ``vae._decode`` gathers the output rows (or returns the local shard with ``vae_output="shard"``).

With tiling on, stock tiled decoding runs twice: first every rank computes its round-robin share of the
tiles (shapes of the others come from a FakeTensor run, no compute), the tiles are exchanged, then the
stock blend replays with every tile known, so the result equals single-process tiled decoding.

Everything is differentiable: gradients of inputs equal the unpatched ones on every rank; parameter
gradients are ``N`` times per-rank partial sums, whose mean over the VAE group (DDP's, FSDP2's, or
:func:`hfpatch.all_reduce_gradients`) is the unpatched gradient (:mod:`hfpatch.distributed.gradients`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ...core.config import ParallelConfig
from ...core.registry import PatchFamily
from .halo import conv_halo, halo_bytes, row_offsets, split_rows
from .layers import coder_forward, conv2d_forward, padded_conv_forward, session_forward, tiled_forward
from .state import MODES, OUTPUTS, STATE_ATTR, VAEShardState

__all__ = [
    "VAEParallelFamily",
    "analytic_gather_bytes",
    "analytic_halo_bytes",
    "analytic_split_bytes",
    "local_rows",
    "trace_conv_inputs",
]


# ----------------------------------------------------------------------------------------------- family
class VAEParallelFamily(PatchFamily):
    """Base of the VAE families: options, the module audit, and the install walk.

    Subclasses list the module classes whose forward they have audited (:meth:`audited_types`) and install
    their wrappers in :meth:`install`. Precise mode refuses any module it has not audited, because an
    unknown layer may couple rows and silently break exactness.
    """

    options: ClassVar[dict[str, Any]] = {"vae_mode": "precise", "vae_output": "full", "check_inputs": True}
    role: ClassVar[str] = "vae"
    split_axis: ClassVar[str | None] = "vae"

    def audited_types(self) -> tuple[type, ...]:
        raise NotImplementedError

    def check_module(self, path: str, module: torch.nn.Module) -> None:
        """Raise ``TypeError`` for a configuration of an audited class that the split cannot run."""

    def validate(self, target: Any, config: ParallelConfig, options: dict[str, Any]) -> None:
        mode, output = options["vae_mode"], options["vae_output"]
        if mode not in MODES:
            raise ValueError(f"vae_mode must be one of {MODES} for {type(target).__name__}, got {mode!r}")
        if output not in OUTPUTS:
            raise ValueError(
                f"vae_output must be one of {OUTPUTS} for {type(target).__name__}, got {output!r}"
            )
        if config.vae == 1:
            return
        audited = self.audited_types()
        for path, module in target.named_modules():
            if not path:
                continue
            if type(module) not in audited:
                raise TypeError(
                    f"{type(target).__name__}.{path} is a {type(module).__module__}.{type(module).__name__}, "
                    "which the hfpatch VAE split has not audited (it may couple rows across the split); "
                    "run this VAE on one rank (ParallelConfig(vae=1)) or open an issue"
                )
            self.check_module(path, module)

    def apply(self, target: Any, patch: Any, mesh: Any, options: dict[str, Any]) -> None:
        group = mesh.group("vae")
        if group is None:
            return  # one rank: the stock VAE is already the answer
        state = VAEShardState(
            group=group,
            world=dist.get_world_size(group),
            rank=dist.get_rank(group),
            approx=options["vae_mode"] == "approx",
            output=options["vae_output"],
            name=type(target).__name__,
            check_inputs=bool(options["check_inputs"]),
        )
        self.install(target, patch, state)
        if state.halos:
            state.min_rows = max(1, *(max(h) for h in state.halos.values()))
        patch.set_attr(target, STATE_ATTR, state)

    def install(self, target: Any, patch: Any, state: VAEShardState) -> None:
        raise NotImplementedError

    # helpers for subclasses
    @staticmethod
    def patch_conv2d(
        patch: Any,
        conv: torch.nn.Conv2d,
        state: VAEShardState,
        pad_top: int | None = None,
        pad_bottom: int | None = None,
    ) -> None:
        """Halo-wrap ``conv`` when it couples rows (kernel or stride > 1 along height).

        ``pad_top``/``pad_bottom``: zero rows the unsplit layer sees (default: the conv's own padding).
        """
        kernel, stride = conv.kernel_size[0], conv.stride[0]
        if kernel == 1 and stride == 1:
            return
        top = conv.padding[0] if pad_top is None else pad_top
        bottom = conv.padding[0] if pad_bottom is None else pad_bottom
        state.halos[id(conv)] = conv_halo(kernel, stride, top)
        state.exchanges.append((conv, state.halos[id(conv)], None))
        patch.set_attr(conv, "forward", conv2d_forward(conv, state, top, bottom))

    @staticmethod
    def wrap_entries(
        patch: Any,
        target: Any,
        state: VAEShardState,
        encoder_factor: int,
        tiled: tuple[str, ...] = ("tiled_encode", "tiled_decode"),
    ) -> None:
        """The session and entry wrappers of a VAE whose ``_encode``/``_decode`` call ``encoder``/``decoder`` once
        per image (tiles: once per tile): rows split at the coders' entry (``encoder_factor`` input rows per
        latent row), outputs gathered at ``_encode``/``_decode``, the ``tiled`` methods spread over the ranks."""
        patch.wrap_method(target.encoder, "forward", lambda f: coder_forward(f, state, encoder_factor))
        patch.wrap_method(target.decoder, "forward", lambda f: coder_forward(f, state, 1))
        patch.wrap_method(target, "_encode", lambda f: session_forward(f, state, "encode"))
        patch.wrap_method(target, "_decode", lambda f: session_forward(f, state, "decode"))
        for method in tiled:
            patch.wrap_method(target, method, lambda f: tiled_forward(f, state, per_call=True))

    @staticmethod
    def refuse_gradient_checkpointing(target: Any, state: VAEShardState) -> None:
        """Refuse a differentiable call while a block of ``target`` has gradient checkpointing on: the recompute
        would run in backward, outside the split session."""

        def check() -> None:
            if torch.is_grad_enabled() and any(
                getattr(m, "gradient_checkpointing", False) is True for m in target.modules()
            ):
                raise ValueError(
                    f"{type(target).__name__}: gradient checkpointing re-runs blocks outside the split; call "
                    "vae.disable_gradient_checkpointing() (the split already divides activation memory by N)"
                )

        state.checks.append(check)


def check_conv2d(path: str, conv: torch.nn.Conv2d) -> None:
    """The split handles zero-padded, undilated convs with integer padding."""
    if (
        conv.padding_mode != "zeros"
        or isinstance(conv.padding, str)
        or conv.dilation[0] != 1
        or conv.padding[0] > conv.kernel_size[0] // 2
    ):
        raise TypeError(
            f"{path}: Conv2d(kernel={conv.kernel_size}, stride={conv.stride}, padding={conv.padding}, "
            f"dilation={conv.dilation}, padding_mode={conv.padding_mode!r}) is not supported by the VAE split; "
            "it handles zero padding, dilation 1 and padding <= kernel // 2"
        )


def check_padded_conv(path: str, module: Any) -> None:
    """A causal conv that pads with ``F.pad(x, module.time_causal_padding, module.pad_mode)``, then convolves
    with no padding of its own (HunyuanVideo 1 and 1.5)."""
    conv = module.conv
    pad = module.time_causal_padding
    if (
        any(p != 0 for p in conv.padding)
        or conv.dilation[1] != 1
        or module.pad_mode not in ("replicate", "reflect", "constant")
        or pad[2] != pad[3]
    ):
        raise TypeError(
            f"{path}: {type(module).__name__} with conv padding {conv.padding}, dilation {conv.dilation}, pad mode "
            f"{module.pad_mode!r} and padding {pad} is not supported by the VAE split"
        )


def check_conv3d(path: str, conv: torch.nn.Conv3d) -> None:
    """The split handles integer-padded, undilated (along height) 3D convs padding zeros, replicate or reflect."""
    if (
        conv.padding_mode not in ("zeros", "replicate", "reflect")
        or isinstance(conv.padding, str)
        or conv.dilation[1] != 1
        or conv.padding[1] > conv.kernel_size[1] // 2
    ):
        raise TypeError(
            f"{path}: Conv3d(kernel={conv.kernel_size}, stride={conv.stride}, padding={conv.padding}, "
            f"dilation={conv.dilation}, padding_mode={conv.padding_mode!r}) is not supported by the VAE split"
        )


def patch_padded_conv(patch: Any, module: Any, state: VAEShardState) -> None:
    """Halo-wrap a causal conv that pads with ``F.pad(x, module.time_causal_padding, module.pad_mode)`` and then
    runs ``module.conv`` (HunyuanVideo 1 and 1.5; the stock forward stays for a row-local 1x1 conv)."""
    pad = tuple(module.time_causal_padding)
    forward = padded_conv_forward(module, module.conv, state, lambda: pad, module.pad_mode)
    if forward is not None:
        patch.set_attr(module, "forward", forward)


def check_no_checkpointing(target: torch.nn.Module) -> None:
    """Refuse a differentiable call with gradient checkpointing on: it re-runs blocks outside the split."""
    if torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False) for m in target.modules()):
        raise ValueError(
            f"{type(target).__name__}: gradient checkpointing re-runs blocks outside the split; call "
            "vae.disable_gradient_checkpointing() (the split already divides activation memory by N)"
        )


def encoder_unit(
    encoder: torch.nn.Module, stride_of: Callable[[torch.nn.Module], int], patch: int = 1
) -> int:
    """Pixel rows per latent row of ``encoder``: ``patch`` times the product of its modules' height strides
    (``stride_of(module)``: 1 for a module that does not downsample by itself)."""
    unit = patch
    for module in encoder.modules():
        unit *= stride_of(module)
    return unit


# ----------------------------------------------------------------------------------------------- public helpers
def _state(vae: Any) -> VAEShardState:
    state = getattr(vae, "__dict__", {}).get(STATE_ATTR)
    if state is None:
        raise ValueError(
            f"{type(vae).__name__} is not split over ranks by hfpatch (apply it with parallel > 1)"
        )
    return state


def local_rows(vae: Any, height: int, factor: int) -> tuple[int, int]:
    """``(start, stop)`` rows of an output of ``height`` rows that this rank holds with ``vae_output="shard"``.

    Args:
        vae: A VAE patched with more than one rank.
        height: Full output height (pixels for decode, latent rows for encode).
        factor: Output rows per latent row (``vae_scale_factor`` for decode, 1 for encode).
    """
    state = _state(vae)
    sizes = [r * factor for r in split_rows(height // factor, state.world, state.min_rows)]
    offsets = row_offsets(sizes)
    return offsets[state.rank], offsets[state.rank + 1]


def _is_row_conv(m: torch.nn.Module) -> bool:
    """A conv the split may halo-wrap: ``Conv2d`` and the ``Conv3d`` subclasses (Wan's causal conv), and the
    causal convs that pad explicitly around a plain ``Conv3d`` (``time_causal_padding``: HunyuanImage's refiner).
    A plain ``Conv3d`` is either inside such a conv (it sees padded rows) or 1x1 (no halo): left out."""
    if hasattr(m, "time_causal_padding"):
        return True
    return isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)) and type(m) is not torch.nn.Conv3d


def trace_conv_inputs(
    module: torch.nn.Module, fn: Callable[[], Any]
) -> list[tuple[torch.nn.Module, torch.Size]]:
    """Input shapes of every conv call while ``fn()`` runs the *unsplit* model (FakeTensor: no compute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen: list[tuple[torch.nn.Module, torch.Size]] = []
    handles = [
        m.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0].shape)))
        for m in module.modules()
        if _is_row_conv(m)
    ]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            fn()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def conv_row_halo(conv: torch.nn.Module) -> tuple[int, int]:
    """``(before, after)`` halo rows of a stock conv from its attributes alone (test and benchmark reference)."""
    if hasattr(conv, "time_causal_padding"):  # pads itself, then a plain Conv3d
        pad_top, conv = conv.time_causal_padding[2], conv.conv
    else:
        pad_top = conv._padding[2] if hasattr(conv, "_padding") else conv.padding[-2]
    kernel, stride = conv.kernel_size[-2], conv.stride[-2]
    if kernel == 1 and stride == 1:
        return 0, 0
    return conv_halo(kernel, stride, pad_top)


def analytic_split_bytes(vae: Any, fn: Callable[[], Any], latent_rows: int) -> dict[str, int]:
    """Bytes this rank sends while ``fn()`` runs ``vae`` split, from the shapes of the unsplit run (forward only).

    ``vae`` must be patched; ``fn`` runs inside ``patch.disabled()`` (the stock model: nothing is sent), with
    hooks reading the input of every layer that exchanges rows (``state.exchanges``), of every ``GroupNorm`` and
    of every attention over the split (``state.attentions``). ``latent_rows``: the latent height of the call
    (the split of every feature map follows it). Returns ``{"halo": ..., "all_gather": ..., "ring": ...}``, the
    kinds :func:`hfpatch.distributed.collectives.count_comm` reports:

    - ``halo``: per exchange, ``(before + after) x row elements x itemsize`` (one side at the borders);
    - ``all_gather``: per GroupNorm call, ``(N - 1) x 2 x batch x groups x 4`` (fp32 mean and variance);
    - ``ring``: per attention, ``(N - 1)`` key/value blocks of ``batch x frames x max rows x width`` tokens of
      ``channels`` (:func:`hfpatch.patches.vae.attention.attention_bytes`);
    - ``all_gather`` also counts, for a coder gathering each call's output (Allegro's tiles), ``(N - 1)`` times
      this rank's rows of that output.
    """
    from ...core.patch import get_patch
    from .attention import attention_bytes

    state, patch = _state(vae), get_patch(vae)
    assert patch is not None
    rank, world = state.rank, state.world
    most = max(split_rows(latent_rows, world, state.min_rows))
    totals = {"halo": 0, "all_gather": 0, "ring": 0}

    def exchanged(halo: tuple[int, int], when: Callable[[], bool] | None) -> Callable:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            if when is None or when():
                shape = args[0].shape
                row = shape.numel() // shape[-2]
                totals["halo"] += halo_bytes(rank, world, *halo, row, args[0].element_size())

        return hook

    def norm(module: torch.nn.Module, args: tuple) -> None:
        totals["all_gather"] += (world - 1) * 2 * args[0].shape[0] * module.num_groups * 4

    def attention(calls: Callable[[torch.Tensor], list[tuple[int, ...]]]) -> Callable:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            for batch, frames, rows, width, channels in calls(args[0]):
                tokens = batch * frames * most * (rows // latent_rows) * width
                totals["ring"] += attention_bytes(
                    rank, world, tokens, channels, args[0].element_size(), False
                )

        return hook

    def gathered(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        latent = min(args[0].shape[-2], out.shape[-2])  # a decoder's input rows, an encoder's output rows
        rows = split_rows(latent, world, state.min_rows)[rank] * (out.shape[-2] // latent)
        totals["all_gather"] += (world - 1) * out.numel() // out.shape[-2] * rows * out.element_size()

    hooks = [m.register_forward_pre_hook(exchanged(h, when)) for m, h, when in state.exchanges]
    hooks += [m.register_forward_hook(gathered) for m in state.gathers]
    hooks += [m.register_forward_pre_hook(norm) for m in vae.modules() if type(m) is torch.nn.GroupNorm]
    hooks += [m.register_forward_pre_hook(attention(calls)) for m, calls in state.attentions]
    try:
        with patch.disabled():
            fn()
    finally:
        for hook in hooks:
            hook.remove()
    return totals


def analytic_halo_bytes(module: torch.nn.Module, fn: Callable[[], Any], rank: int, world: int) -> int:
    """Bytes ``rank`` sends for halos while ``fn()`` runs ``module`` split over ``world`` ranks.

    Sum over conv calls of ``(before + after) x (row elements: B x C x T x W) x itemsize`` for an interior
    rank (one side at the borders), with the shapes of the unsplit run.
    """
    total = 0
    for conv, shape in trace_conv_inputs(module, fn):
        before, after = conv_row_halo(conv)
        row_numel = shape.numel() // shape[-2]
        itemsize = (conv.conv if hasattr(conv, "time_causal_padding") else conv).weight.element_size()
        total += halo_bytes(rank, world, before, after, row_numel, itemsize)
    return total


def analytic_gather_bytes(
    vae: torch.nn.Module, fn: Callable[[], Any], latent_height: int, rank: int, world: int
) -> int:
    """Bytes ``rank`` sends in all-gathers while ``fn()`` runs ``vae`` split over ``world`` ranks: GroupNorm
    (and training BatchNorm) statistics, gathered attention keys/values and DC-AE's linear-attention sums.

    Computed from the layers' input shapes in an *unsplit* FakeTensor run: each gather sends ``(world - 1)``
    copies of this rank's part, whose rows are the layer's rows scaled to this rank's share of the
    ``latent_height`` latent rows (fp32 statistics, keys/values in the activations' dtype).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    share = split_rows(latent_height, world)[rank]
    sent: list[int] = []

    def local(rows: int) -> int:  # this rank's rows of a layer of ``rows`` rows
        return rows // latent_height * share

    def hook(module: torch.nn.Module, args: tuple) -> None:
        x = args[0]
        kind = type(module).__name__
        if isinstance(module, torch.nn.GroupNorm):
            sent.append(2 * x.shape[0] * module.num_groups * 4)
        elif isinstance(module, torch.nn.BatchNorm2d) and module.training:
            sent.append(2 * x.shape[1] * 4)
        elif (
            kind == "Attention"
        ):  # diffusers' (AutoencoderKL, Flux.2): to_k and to_v outputs, one gather each
            tokens = local(x.shape[-2]) * x.shape[-1]
            sent.append(2 * x.shape[0] * tokens * module.to_k.out_features * x.element_size())
        elif hasattr(module, "to_qkv"):  # Wan/QwenImage: per frame, keys and values in one gather
            frames = x.shape[2] if x.dim() == 5 else 1
            sent.append(
                x.shape[0] * frames * local(x.shape[-2]) * x.shape[-1] * 2 * x.shape[1] * x.element_size()
            )
        elif kind in ("HunyuanImageAttentionBlock", "HunyuanImageRefinerAttnBlock"):
            positions = x[0, 0].numel() // x.shape[-2] * local(x.shape[-2])
            sent.append(x.shape[0] * positions * 2 * x.shape[1] * x.element_size())
        elif kind == "SanaMultiscaleLinearAttention":
            d = module.attention_head_dim
            heads = (1 + len(module.to_qkv_multiscale)) * module.to_q.out_features // d
            if x.shape[-2] * x.shape[-1] > d:  # linear: the (d + 1) x d sums, fp32
                sent.append(x.shape[0] * heads * (d + 1) * d * 4)
            else:  # quadratic: the keys and values of this rank's positions
                sent.append(x.shape[0] * heads * 2 * d * local(x.shape[-2]) * x.shape[-1] * x.element_size())

    handles = [m.register_forward_pre_hook(hook) for m in vae.modules()]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            fn()
    finally:
        for handle in handles:
            handle.remove()
    return (world - 1) * sum(sent)
