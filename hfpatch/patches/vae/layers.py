"""The per-layer forwards of a height-split VAE, installed per object by the VAE families: convolutions with halo
rows, GroupNorm with statistics over every rank, attention with gathered keys/values, the encoder/decoder entry
and the session around a call, and tiled decoding. The mechanics are described in :mod:`hfpatch.patches.vae.family`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...core.dropout import refuse_dropout
from ...distributed.agreement import check_same_inputs
from ...distributed.collectives import all_gather
from ...distributed.gradients import grad_averaged_over_group, grad_scaled_by_group
from .halo import conv_halo
from .norms import batch_norm_forward as batch_norm_forward
from .norms import group_norm_forward as group_norm_forward
from .norms import sum_over_ranks as sum_over_ranks
from .state import (
    TileRun,
    VAEShardState,
    exchange_rows,
    gather_rows,
    scatter_rows,
)

__all__: list[str] = []


def _assemble(
    x: torch.Tensor,
    top: torch.Tensor,
    bottom: torch.Tensor,
    zeros_top: int,
    zeros_bottom: int,
    pad: list[int],
) -> torch.Tensor:
    """``F.pad(cat([0 * zeros_top, top, x, bottom, 0 * zeros_bottom], H), pad)`` in one allocation.

    ``pad`` is ``F.pad``'s list for the dims other than H (its H entries are ignored), e.g. ``[wl, wr]`` or
    ``[wl, wr, 0, 0, t_front, t_back]``.
    """
    h = zeros_top + top.shape[-2] + x.shape[-2] + bottom.shape[-2] + zeros_bottom
    shape = list(x.shape)
    shape[-2] = h
    shape[-1] += pad[0] + pad[1]
    if x.dim() == 5:
        shape[2] += pad[4] + pad[5]
    out = x.new_zeros(shape)
    w = slice(pad[0], pad[0] + x.shape[-1])
    t = slice(pad[4], pad[4] + x.shape[2]) if x.dim() == 5 else slice(None)
    row = zeros_top
    # Assign even empty halos: every rank must build the same autograd graph, so that the engine runs the
    # backward halo exchanges in the same order everywhere (a skipped node reorders the ready queue).
    for part in (top, x, bottom):
        rows = part.shape[-2]
        if x.dim() == 5:
            out[:, :, t, row : row + rows, w] = part
        else:
            out[..., row : row + rows, w] = part
        row += rows
    return out


# ----------------------------------------------------------------------------------------------- wrappers
def conv2d_forward(conv: torch.nn.Conv2d, state: VAEShardState, pad_top: int, pad_bottom: int) -> Callable:
    """Forward for an ``nn.Conv2d`` on height shards: halo rows inside, zero rows only at the border.

    ``pad_top``/``pad_bottom`` are the zero rows the unsplit layer sees (its padding, or a preceding
    ``ZeroPad2d``). The shard is convolved as it is (zero rows at its edges, no padded copy of the input, as the
    stock conv pads inside its kernel), then the few output rows whose windows reach a neighbour's rows are
    recomputed from thin slabs (the halo and the shard's edge rows) and written over them
    (:func:`_edge_rows`); a shard shorter than a window is assembled whole instead. A differentiable call
    assembles the padded shard too: the conv saves it for backward in place of the shard (which it frees), where
    the overwritten rows would cost a full-size copy of the output gradient in backward.
    """
    original = conv.forward
    before, after = state.halos[id(conv)]
    kernel, stride = conv.kernel_size[0], conv.stride[0]

    def conv2d(x: torch.Tensor, pad_h: int) -> torch.Tensor:
        return F.conv2d(
            x, conv.weight, conv.bias, conv.stride, (pad_h, conv.padding[1]), conv.dilation, conv.groups
        )

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding or state.approx:
            return original(x)
        top, bottom = exchange_rows(x, before, after, state)
        # Decided on the shortest shard, so that every rank runs the same ops (the same autograd graph).
        edges = _edge_rows(min(state.sizes(x.shape[-2])), kernel, stride, before)
        differentiable = torch.is_grad_enabled() and (x.requires_grad or conv.weight.requires_grad)
        if edges is None or differentiable:
            zeros_top = pad_top if state.rank == 0 else 0
            zeros_bottom = pad_bottom if state.rank == state.world - 1 else 0
            return conv2d(_assemble(x, top, bottom, zeros_top, zeros_bottom, [0, 0]), 0)
        n_top, n_bottom = edges
        h = x.shape[-2]
        n, empty = h // stride, x.narrow(-2, 0, 0)
        out = conv2d(x, before)  # right away from the shard's edges
        n_main = out.shape[-2]
        if n_bottom:
            first = n - n_bottom  # the first output row whose window reaches below the shard
            start = first * stride - before
            slab = _assemble(
                x.narrow(-2, start, h - start), empty, bottom, 0, after - bottom.shape[-2], [0, 0]
            )
            fixed = conv2d(slab, 0)
            if n_main < n:  # a one-sided pad (ZeroPad2d((0, 1, 0, 1)) + stride 2): rows the shard lacks
                out = torch.cat([out, fixed.narrow(-2, n_main - first, n - n_main)], -2)
            if n_main > first:
                out.narrow(-2, first, n_main - first).copy_(fixed.narrow(-2, 0, n_main - first))
        if n_top:
            rows = (n_top - 1) * stride - before + kernel
            slab = _assemble(x.narrow(-2, 0, rows), top, empty, before - top.shape[-2], 0, [0, 0])
            out.narrow(-2, 0, n_top).copy_(conv2d(slab, 0))
        return out

    return forward


def _edge_rows(rows: int, kernel: int, stride: int, before: int) -> tuple[int, int] | None:
    """``(top, bottom)``: output rows of a shard of ``rows`` input rows whose conv windows reach above (the
    previous rank's rows, ``before`` of them) or below it; ``None`` when one output row needs both (a shard
    shorter than a window), which the edge recompute cannot serve.

    >>> _edge_rows(rows=4, kernel=3, stride=1, before=1)   # 3x3, padding 1: the first and last rows
    (1, 1)
    >>> _edge_rows(rows=4, kernel=3, stride=2, before=0)   # ZeroPad2d((0, 1, 0, 1)) + stride 2: the last row
    (0, 1)
    >>> _edge_rows(rows=1, kernel=3, stride=1, before=1) is None
    True
    >>> _edge_rows(rows=2, kernel=3, stride=2, before=0) is None   # no window lies inside the shard
    True
    """
    n_top = -(-before // stride)
    n_bottom = (kernel - 1 - before) // stride
    if (
        n_top + n_bottom > rows // stride or rows + 2 * before < kernel
    ):  # overlap, or no row of the shard's own
        return None
    return n_top, n_bottom


def conv_inplace_forward(conv: torch.nn.Conv2d | torch.nn.Conv3d, state: VAEShardState) -> Callable:
    """Forward for an ``nn.Conv2d``/``nn.Conv3d`` zero-padding rows alike above and below, on height shards, without
    a padded copy of its input: the stock conv runs on the shard (its zero padding is right everywhere except in
    the first and last output rows, whose windows reach into the neighbours' rows), then those rows are recomputed
    from small slabs of halo rows + shard rows and written into the output in place.

    :func:`conv2d_forward` and :func:`conv3d_rows` assemble ``[halo; shard; halo]`` in a new buffer first: a copy
    of the shard that the stock conv (padding inside the kernel) never makes, which sets the per-rank peak where a
    conv widens its input (Allegro's temporal upsampler: 2x channels). Every rank recomputes the same rows (zero
    halos at the global borders), so every rank builds the same autograd graph.
    """
    original = conv.forward
    before, after = state.halos[id(conv)]
    h = conv.weight.dim() - 2 - 2  # the height dim among the spatial dims of weight/padding/stride
    kernel, stride, pad = conv.kernel_size[h], conv.stride[h], conv.padding[h]
    run = F.conv3d if conv.weight.dim() == 5 else F.conv2d
    slab_padding = tuple(0 if d == h else p for d, p in enumerate(conv.padding))
    assembled = (
        conv2d_forward(conv, state, pad, pad)
        if run is F.conv2d
        else lambda x: conv3d_rows(x, conv, state, _pad6(conv), "zeros")
    )

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding or state.approx:
            return original(x)
        rows = x.shape[-2]
        # Output rows whose window starts above row 0, and those whose window ends below the last row.
        n_top = -(-pad // stride)
        first_bottom = max(n_top, -(-(rows + pad - kernel + 1) // stride))
        # A shard so thin that a window needs both halos (decided on the thinnest shard: same path everywhere).
        if n_top > 0 and (n_top - 1) * stride - pad + kernel > min(state.sizes(rows)):
            return assembled(x)
        top, bottom = exchange_rows(x, before, after, state)
        shape = list(x.shape)
        shape[-2] = before - top.shape[-2]
        top = torch.cat(
            [x.new_zeros(shape), top], -2
        )  # zero halos at the global borders: same graph everywhere
        shape[-2] = after - bottom.shape[-2]
        bottom = torch.cat([bottom, x.new_zeros(shape)], -2)
        out = run(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        n_bottom = out.shape[-2] - first_bottom
        if n_top:
            slab = torch.cat([top, x.narrow(-2, 0, min(rows, (n_top - 1) * stride + kernel - pad))], -2)
            fixed = run(slab, conv.weight, conv.bias, conv.stride, slab_padding, conv.dilation, conv.groups)
            out[..., :n_top, :] = fixed[..., :n_top, :]
        if n_bottom > 0:
            start = first_bottom * stride - pad
            slab = torch.cat([x.narrow(-2, start, rows - start), bottom], -2)
            fixed = run(slab, conv.weight, conv.bias, conv.stride, slab_padding, conv.dilation, conv.groups)
            out[..., first_bottom:, :] = fixed[..., :n_bottom, :]
        return out

    return forward


def _pad6(conv: torch.nn.Conv3d) -> tuple[int, int, int, int, int, int]:
    pt, ph, pw = conv.padding
    return (pw, pw, ph, ph, pt, pt)


def causal_conv3d_forward(conv: Any, state: VAEShardState, cache_frames: int) -> Callable:
    """Forward for Wan's ``WanCausalConv3d`` on height shards, with the causal frame cache.

    The stock caller passes ``cache_x``: the last ``cache_frames`` frames of this conv's input stream. Their
    halo rows were received with the previous chunk and are kept here, so only new frames are exchanged.
    """
    original = conv.forward
    before, after = state.halos[id(conv)]
    conv3d_forward = torch.nn.Conv3d.forward

    def forward(x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if not state.sharding or state.approx:
            return original(x, cache_x)
        padding = list(conv._padding)
        top, bottom = exchange_rows(x, before, after, state)
        if cache_x is not None and padding[4] > 0:
            n = cache_x.shape[2]
            tail = state.tails.get(id(conv))
            if tail is not None and tail[0].shape[2] >= n and tail[0].shape[:2] == x.shape[:2]:
                cached_top, cached_bottom = tail[0][:, :, -n:], tail[1][:, :, -n:]
            else:  # a cache this conv did not see being made: exchange its rows too (same on every rank)
                cached_top, cached_bottom = exchange_rows(cache_x.to(x.device), before, after, state)
            top, bottom = torch.cat([cached_top, top], 2), torch.cat([cached_bottom, bottom], 2)
            x = torch.cat([cache_x.to(x.device), x], 2)
            padding[4] -= n
        state.tails[id(conv)] = (top[:, :, -cache_frames:], bottom[:, :, -cache_frames:])
        x = _assemble(
            x,
            top,
            bottom,
            padding[2] if state.rank == 0 else 0,
            padding[3] if state.rank == state.world - 1 else 0,
            padding,
        )
        return conv3d_forward(conv, x)

    return forward


#: ``F.pad`` mode of each padding a VAE conv applies along height (``nn.Conv3d.padding_mode`` names included).
PAD_MODES = {"zeros": "constant", "constant": "constant", "replicate": "replicate", "reflect": "reflect"}


def _border(view: torch.Tensor, dim: int, n: int, mode: str, start: bool) -> torch.Tensor:
    """The ``n`` padding entries ``mode`` puts before (``start``) or after ``view`` along ``dim`` (a copy)."""
    length = view.shape[dim]
    if mode == "replicate":
        edge = view.narrow(dim, 0 if start else length - 1, 1)
        return edge.expand(*[n if d == dim % view.dim() else -1 for d in range(view.dim())]).clone()
    # reflect: the entries next to the edge, mirrored (the edge itself is not repeated)
    return view.narrow(dim, 1 if start else length - 1 - n, n).flip(dim)


def padded_rows(
    x: torch.Tensor,
    top: torch.Tensor,
    bottom: torch.Tensor,
    pad: tuple[int, int, int, int, int, int],
    mode: str,
    at_top: bool,
    at_bottom: bool,
    time_mode: str | None = None,
) -> torch.Tensor:
    """``F.pad(cat([top, x, bottom], H), pad, mode)`` of a ``[B, C, T, H, W]`` shard, padding H at the borders only.

    ``pad`` is ``F.pad``'s ``(w_left, w_right, h_top, h_bottom, t_front, t_back)``; the height padding is applied
    only where this shard meets the global border (``at_top``/``at_bottom``), elsewhere the halo rows ``top``/
    ``bottom`` stand in for it. ``mode``: ``"constant"`` (zeros), ``"replicate"`` or ``"reflect"``; replicate and
    reflect read the neighbouring rows through the halos, so a one-row shard reflects correctly; ``time_mode``
    pads the frames another way (causal convs repeating the first frame: ``"replicate"``). One allocation
    of the padded shape (plus copies of the border strips): padding is separable per dim, so filling H, then W
    (every row), then T (every row and column) gives ``F.pad``'s corners.
    """
    wl, wr, ht, hb, tf, tb = pad
    ht, hb = (ht if at_top else 0), (hb if at_bottom else 0)
    time_mode = mode if time_mode is None else time_mode
    b, c, t, h, w = x.shape
    rows = ht + top.shape[-2] + h + bottom.shape[-2] + hb
    shape = (b, c, tf + t + tb, rows, wl + w + wr)
    zeros = mode == "constant" or (time_mode == "constant" and (tf or tb))
    out = x.new_zeros(shape) if zeros else x.new_empty(shape)
    ts, ws = slice(tf, tf + t), slice(wl, wl + w)
    row = ht
    # Assign even empty halos: every rank builds the same autograd graph (see ``_assemble``).
    for part in (top, x, bottom):
        out[:, :, ts, row : row + part.shape[-2], ws] = part
        row += part.shape[-2]
    if mode != "constant":
        _fill_rows_and_columns(out, (ts, ws), (ht, hb, wl, wr), mode)
    if time_mode != "constant" and tf:
        out[:, :, :tf] = _border(out[:, :, tf:], 2, tf, time_mode, start=True)
    if time_mode != "constant" and tb:
        out[:, :, tf + t :] = _border(out[:, :, : tf + t], 2, tb, time_mode, start=False)
    return out


def _fill_rows_and_columns(
    out: torch.Tensor, center: tuple[slice, slice], pads: tuple[int, int, int, int], mode: str
) -> None:
    """Fill the H, then the W border of ``out`` (frames ``center[0]``) from its inner entries, per ``mode``."""
    ts, ws = center
    ht, hb, wl, wr = pads
    rows, width = out.shape[3], out.shape[4]
    if ht:
        out[:, :, ts, :ht, ws] = _border(out[:, :, ts, ht:, ws], 3, ht, mode, start=True)
    if hb:
        out[:, :, ts, rows - hb :, ws] = _border(out[:, :, ts, : rows - hb, ws], 3, hb, mode, start=False)
    if wl:
        out[:, :, ts, :, :wl] = _border(out[:, :, ts, :, wl:], 4, wl, mode, start=True)
    if wr:
        out[:, :, ts, :, width - wr :] = _border(out[:, :, ts, :, : width - wr], 4, wr, mode, start=False)


def conv3d_rows(
    x: torch.Tensor,
    conv: torch.nn.Conv3d,
    state: VAEShardState,
    pad: tuple[int, int, int, int, int, int],
    mode: str,
    time_mode: str | None = None,
) -> torch.Tensor:
    """``F.conv3d(F.pad(x, pad, mode), conv.weight, ...)`` on height shards (``conv``'s own padding is not used).

    The rows of ``state.halos[id(conv)]`` come from the neighbours; the height padding is added at the global
    border only. ``vae_mode="approx"``: no exchange, every shard pads itself as if it were the whole image.
    """
    before, after = state.halos[id(conv)]
    if state.approx:
        top = bottom = x.narrow(-2, 0, 0)
        at_top = at_bottom = True
    else:
        top, bottom = exchange_rows(x, before, after, state)
        at_top, at_bottom = state.rank == 0, state.rank == state.world - 1
    time_mode = None if time_mode is None else PAD_MODES[time_mode]
    padded = padded_rows(x, top, bottom, pad, PAD_MODES[mode], at_top, at_bottom, time_mode)
    return F.conv3d(padded, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)


def conv3d_forward(
    conv: torch.nn.Conv3d,
    state: VAEShardState,
    pad: tuple[int, int, int, int, int, int] | None = None,
    mode: str | None = None,
    time_mode: str | None = None,
) -> Callable:
    """Forward for an ``nn.Conv3d`` on height shards: its own padding (``padding_mode`` zeros, replicate or
    reflect) applied at the global border only, halo rows inside. ``pad``/``mode`` override the padding (a
    wrapper that pads before calling a conv with ``padding=0``, e.g. Hunyuan's replicate-padded causal conv)."""
    original = conv.forward
    if pad is None:
        pt, ph, pw = conv.padding
        pad = (pw, pw, ph, ph, pt, pt)
    mode = conv.padding_mode if mode is None else mode

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding:
            return original(x)
        return conv3d_rows(x, conv, state, pad, mode, time_mode)

    return forward


def padded_conv_forward(
    module: torch.nn.Module,
    conv: torch.nn.Conv3d,
    state: VAEShardState,
    pad: Callable[..., tuple[int, int, int, int, int, int]],
    mode: str,
    time_mode: str | None = None,
) -> Callable | None:
    """Forward for a module that pads its input (``F.pad``, or frames repeated) and then runs ``conv`` (with
    ``conv``'s own padding included in ``pad``): halo rows inside, the height padding at the global border.

    ``pad(*args, **kwargs)`` gives the ``F.pad`` tuple of a call from its extra arguments (LTX-2's ``causal=``),
    ``mode`` the row/column padding, ``time_mode`` the frame padding. Registers the conv's halo; returns ``None``
    for a conv that is row-local (one row, stride 1: the stock forward runs on the shard).
    """
    kernel, stride = conv.kernel_size[1], conv.stride[1]
    top = pad()[2]
    if kernel == 1 and stride == 1 and top == 0:
        return None
    state.halos[id(conv)] = conv_halo(kernel, stride, top)
    state.exchanges.append((module, state.halos[id(conv)], None))
    original = module.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not state.sharding:
            return original(hidden_states, *args, **kwargs)
        return conv3d_rows(hidden_states, conv, state, pad(*args, **kwargs), mode, time_mode)

    return forward


def gather_tokens_forward(projection: torch.nn.Module, state: VAEShardState) -> Callable:
    """Forward for an attention key/value projection ``(B, L_local, C)``: output gathered over all ranks."""
    original = projection.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        out = original(hidden_states)
        if not state.sharding:
            return out
        return all_gather(out, 1, state.group, state.sizes(out.shape[1]), backward="reduce_scatter")

    return forward


def coder_forward(original: Callable, state: VAEShardState, unit: int) -> Callable:
    """Entry of an encoder/decoder: slice the rows in a session, distribute tiles in a tiled run."""

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if state.sharding:
            return original(scatter_rows(x, state.plan(x.shape[-2], unit), state), *args, **kwargs)
        if state.mode == "tiles":
            return state.tiles.call(original, x, args, kwargs)
        return original(x, *args, **kwargs)

    return forward


def coder_gather_forward(original: Callable, state: VAEShardState, unit: int) -> Callable:
    """Entry of an encoder/decoder whose every call is split and gathered on its own (a coder the stock code
    calls once per tile of a fixed size, Allegro's): slice the rows in, gather the output rows out."""

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not state.sharding:
            return original(x, *args, **kwargs)
        state.latent_rows = None  # each call (tile) has its own height
        out = original(scatter_rows(x, state.plan(x.shape[-2], unit), state), *args, **kwargs)
        return gather_rows(out, state)

    return forward


def session_forward(
    original: Callable,
    state: VAEShardState,
    kind: str,
    cleanup: Callable[[], Any] | None = None,
    *,
    gathered: bool = False,
    same_state: Callable[[], dict[str, Any]] | None = None,
) -> Callable:
    """``vae._encode`` (``kind="encode"``, returns a tensor) or ``vae._decode`` (returns output, tuple or tensor).

    ``cleanup`` runs when the call raises (an out-of-memory error, say): the Wan VAE keeps its per-conv frame
    cache on the module (``clear_cache``), which would otherwise hold the failed call's activations (and
    their graph) until the next call. ``gathered``: the coder gathers its output rows itself
    (:func:`coder_gather_forward`), the result is already whole. ``same_state``: more values every rank must
    hold alike, checked with the inputs (the RNG state of a decoder that draws noise).
    """

    vae = getattr(original, "__self__", None)
    coder = getattr(vae, "encoder" if kind == "encode" else "decoder", vae)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if state.mode is None:
            if isinstance(coder, torch.nn.Module):  # a training-mode dropout in the coder this call splits
                refuse_dropout(coder, f"split {kind}")
            # Every rank computes its rows of ONE output from its own copy of x: copies must be identical.
            named = {"x": x, **{f"arg{i}": a for i, a in enumerate(args, 1)}, **kwargs}
            if same_state is not None:
                named.update(same_state())
            check_same_inputs(
                named,
                state.group,
                what=f"{state.name}.{kind}",
                enabled=state.check_inputs,
                hint=f"To {kind} a different batch on each rank (e.g. data-parallel training), do not split "
                "this VAE: call patch.remove() first, or apply hfpatch with ParallelConfig(..., vae=1) or to "
                "the transformer only; or gather the batches so that every rank passes the same tensor.",
            )
            if x.shape[0] == 0:  # an empty batch has no rows to split: run it as the unpatched VAE does
                return original(x, *args, **kwargs)
        if state.mode is None:
            # Each rank's input gradient covers its own rows, N-scaled: their mean is the full gradient.
            x = grad_averaged_over_group(x, state.group)
        try:
            with state.session():
                out = original(x, *args, **kwargs)
                rows = state.latent_rows
        except BaseException:
            if cleanup is not None:
                cleanup()
            raise
        if rows is None or gathered:
            return out  # tiled, or gathered per coder call: already full
        if state.output == "shard":
            # The local rows; the gradient is then that of the SUM of the ranks' losses on their rows.
            def finish(t: torch.Tensor) -> torch.Tensor:
                return _refuse_approx_backward(grad_scaled_by_group(t, state.group), state, kind)
        else:

            def finish(t: torch.Tensor) -> torch.Tensor:
                return _refuse_approx_backward(gather_rows(t, state), state, kind)

        if kind == "encode" or isinstance(out, torch.Tensor):  # AutoencoderDC's and the refiner's _decode
            return finish(out)
        if isinstance(out, tuple):
            return (finish(out[0]), *out[1:])
        out.sample = finish(out.sample)
        return out

    return forward


# ----------------------------------------------------------------------------------------------- tiling
def tiled_forward(
    original: Callable,
    state: VAEShardState,
    per_call: bool,
    starts: Callable[[tuple, dict], bool] | None = None,
) -> Callable:
    """A stock tiled method run with its tiles spread over the ranks (inference only).

    A tile is one coder call (``per_call``), the calls between two ``clear_cache`` (Wan), or the calls from one
    for which ``starts(args, kwargs)`` holds to the next (a tile decoded frame batch by frame batch)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if state.mode is None:  # called directly, outside encode/decode: stock single-process tiling
            return original(*args, **kwargs)
        if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())
        ):
            raise ValueError(
                "VAE tiling is inference-only under hfpatch (tiles are exchanged without autograd); run it under "
                "torch.no_grad(), or call vae.disable_tiling() for training: the height split alone gives 1/N "
                "activation memory"
            )
        saved_mode, run = state.mode, TileRun(state, per_call, starts)
        state.mode, state.tiles = "tiles", run
        try:
            with torch.no_grad():
                original(*args, **kwargs)
                run.exchange()
                return original(*args, **kwargs)
        finally:
            state.mode, state.tiles = saved_mode, None

    return forward


def tile_boundary(original: Callable, state: VAEShardState) -> Callable:
    """``clear_cache`` marks a new tile inside a tiled run (Wan: one cache per tile)."""

    def clear_cache(*args: Any, **kwargs: Any) -> Any:
        if state.mode == "tiles":
            state.tiles.new_tile()
        return original(*args, **kwargs)

    return clear_cache


# ----------------------------------------------------------------------------------------------- image VAEs (issue 36)
def _refuse_approx_backward(out: torch.Tensor, state: VAEShardState, kind: str) -> torch.Tensor:
    """Under ``vae_mode="approx"`` a backward through the split call raises instead of returning approximate
    gradients (the shards skip the convolution halos; the mode is inference only). Precise mode: unchanged."""
    if not state.approx or not out.requires_grad:
        return out

    def refuse(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            f"{state.name}.{kind} ran with vae_mode='approx', which is inference only: its shards skip the "
            "convolution halos, so gradients through it would be approximate. Train with vae_mode='precise' "
            "(the default; exact gradients), or run approx inference under torch.no_grad()"
        )

    out.register_hook(refuse)
    return out


def halo_pad(
    x: torch.Tensor, state: VAEShardState, before: int, after: int, pad: list[int], mode: str = "constant"
) -> torch.Tensor:
    """This rank's rows of ``F.pad(full, pad, mode)``, plus the halo a conv needs, for a height shard ``x``.

    ``full`` is the unsplit tensor (height at dim -2, width at dim -1, time at dim 2 of a 5D map); ``pad`` is
    ``F.pad``'s list (``[left, right, top, bottom]`` or ``[left, right, top, bottom, front, back]``). The
    neighbours' last ``before`` / first ``after`` rows are exchanged into the shard and the height padding
    (``pad[2]``, ``pad[3]``) applies at the global border only: zero rows (``mode="constant"``, assembled in
    one allocation) or copies of the image's first/last row (``"replicate"``: HunyuanImage's refiner and
    HunyuanVideo's causal convs). Width and time are padded as the stock layer pads them.
    """
    top, bottom = exchange_rows(x, before, after, state)
    pad = list(pad)
    pad[2] = pad[2] if state.rank == 0 else 0
    pad[3] = pad[3] if state.rank == state.world - 1 else 0
    if mode == "constant":
        return _assemble(x, top, bottom, pad[2], pad[3], pad)
    # Every rank runs the same ops (a pad of zero rows included): the same autograd graph everywhere.
    return F.pad(torch.cat([top, x, bottom], -2), pad, mode=mode)


def causal_pad_conv3d_forward(module: Any, state: VAEShardState) -> Callable:
    """Forward for a causal conv that pads explicitly, ``module.conv(F.pad(x, module.time_causal_padding,
    mode=module.pad_mode))`` (HunyuanImage's refiner, HunyuanVideo): halo rows inside, the height padding at the
    global border only, width and time padded as the stock layer pads them."""
    original = module.forward
    conv = module.conv
    before, after = state.halos[id(module)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding or state.approx:
            return original(x)
        return conv(halo_pad(x, state, before, after, list(module.time_causal_padding), module.pad_mode))

    return forward


def gathered_kv_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, state: VAEShardState
) -> torch.Tensor:
    """Single-head softmax attention of this rank's query positions over every rank's keys/values.

    ``query``, ``key`` and ``value`` are feature maps ``(B, C, *spatial)`` whose height is dim -2 (a 2D map or
    a video ``(B, C, T, H, W)``); every position attends to every position, as in the stock blocks
    (HunyuanImage's mid-block over ``H x W``, the refiner's over ``T x H x W``). Keys and values are gathered
    along height in one all-gather (``(W - 1) x`` the local K/V bytes sent per rank; memory: the full K/V of
    this layer, replicated), queries stay local. Returns the attention output as a local ``(B, C, *spatial)`` map.
    """
    tokens = [rows * (key[0, 0].numel() // key.shape[-2]) for rows in state.sizes(key.shape[-2])]
    kv = torch.cat([key.flatten(2), value.flatten(2)], 1).transpose(1, 2)  # (B, L_local, 2C)
    kv = all_gather(kv.contiguous(), 1, state.group, tokens, backward="reduce_scatter")
    k, v = kv.unsqueeze(1).chunk(2, dim=-1)
    q = query.flatten(2).transpose(1, 2).unsqueeze(1)  # (B, 1, L_local, C)
    out = F.scaled_dot_product_attention(q, k, v)
    return out.squeeze(1).transpose(1, 2).reshape(query.shape)
