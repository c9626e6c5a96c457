"""Shared machinery of the height-split VAE patches (:mod:`hfpatch.patches.vae.wan`, :mod:`hfpatch.patches.vae.kl`).

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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...core.config import ParallelConfig
from ...core.registry import PatchFamily
from ...distributed.agreement import check_same_inputs
from ...distributed.collectives import all_gather, halo_exchange
from ...distributed.gradients import grad_averaged_over_group, grad_scaled_by_group
from .halo import conv_halo, halo_bytes, row_offsets, scaled_sizes, split_rows

__all__ = [
    "VAEParallelFamily",
    "VAEShardState",
    "analytic_halo_bytes",
    "local_rows",
    "trace_conv_inputs",
]

#: Instance attribute holding the :class:`VAEShardState` of a patched VAE (removed with the patch).
STATE_ATTR = "_hfpatch_vae_state"
MODES = ("precise", "approx")
OUTPUTS = ("full", "shard")


# ----------------------------------------------------------------------------------------------- state
@dataclass(eq=False)
class VAEShardState:
    """Per-VAE runtime state shared by the wrappers of one patch.

    Attributes:
        group: The ``"vae"`` process group.
        world: Ranks in it; ``rank``: this rank's index.
        approx: ``vae_mode="approx"``: convs pad each shard themselves (no halo exchange).
        output: ``"full"`` (gather the result on every rank) or ``"shard"`` (return the local rows).
        mode: ``None`` (stock behaviour), ``"shard"`` (inside a split encode/decode) or ``"tiles"``.
        latent_rows: Latent rows of every rank in the current session (set at the encoder/decoder entry).
        min_rows: Fewest latent rows a rank may hold (the largest conv halo).
        halos: ``id(conv) -> (before, after)`` rows exchanged by each patched conv.
        name: The VAE's class name (messages); ``check_inputs``: run the same-input guard at each call.
    """

    group: Any
    world: int
    rank: int
    approx: bool
    output: str
    min_rows: int = 1
    halos: dict[int, tuple[int, int]] = field(default_factory=dict)
    mode: str | None = None
    latent_rows: list[int] | None = None
    tails: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    tiles: _TileRun | None = None
    checks: list[Callable[[], None]] = field(default_factory=list)
    name: str = "VAE"
    check_inputs: bool = True

    @property
    def sharding(self) -> bool:
        return self.mode == "shard"

    @contextmanager
    def session(self) -> Iterator[None]:
        """One split encode/decode; nested calls (tiling inside ``_decode``) reuse the open one."""
        if self.mode is not None:
            yield
            return
        for check in self.checks:
            check()
        self.mode, self.latent_rows, self.tails = "shard", None, {}
        try:
            yield
        finally:
            self.mode, self.tails = None, {}

    def plan(self, height: int, unit: int) -> list[int]:
        """Row sizes of every rank for an input of ``height`` rows, ``unit`` rows per latent row.

        Pure and identical on every rank, so a bad height raises everywhere before any collective.
        """
        if height % unit:
            raise ValueError(
                f"the VAE split needs an input height that is a multiple of {unit} (the spatial factor), got "
                f"{height}; resize or pad the input to a multiple of {unit}"
            )
        rows = split_rows(height // unit, self.world, self.min_rows)
        if self.latent_rows is not None and rows != self.latent_rows:
            raise ValueError(f"input height changed inside one VAE call: {rows} vs {self.latent_rows} rows")
        self.latent_rows = rows
        return [r * unit for r in rows]

    def sizes(self, local: int) -> list[int]:
        """Every rank's extent of a dim that is ``local`` long here and proportional to the latent rows."""
        assert self.latent_rows is not None
        return scaled_sizes(self.latent_rows, local, self.rank)


# ----------------------------------------------------------------------------------------------- ops
def scatter_rows(x: torch.Tensor, sizes: list[int], state: VAEShardState) -> torch.Tensor:
    """This rank's rows (dim -2) of ``x``, which every rank holds in full.

    Its backward puts the row gradients into a zero tensor of the full shape, so everything upstream (e.g.
    Wan's ``post_quant_conv`` on the full latents) gets its rank's part only; the session entry averages the
    input gradient over the ranks, parameter gradients are averaged by DDP or
    :func:`hfpatch.all_reduce_gradients` (:mod:`hfpatch.distributed.gradients`).
    """
    return x.narrow(-2, row_offsets(sizes)[state.rank], sizes[state.rank])


def gather_rows(x: torch.Tensor, state: VAEShardState) -> torch.Tensor:
    """All ranks' rows (dim -2) concatenated; backward takes the local slice of ``N`` x the gradient (every rank
    has the same loss; :func:`hfpatch.distributed.gradients.grad_scaled_by_group`)."""
    full = all_gather(x, x.dim() - 2, state.group, state.sizes(x.shape[-2]), backward="slice")
    return grad_scaled_by_group(full, state.group)


def all_reduce_stats(x: torch.Tensor, state: VAEShardState) -> torch.Tensor:
    """``(world, *x.shape)``: every rank's ``x``; backward sums the gradients of each slot over the ranks."""
    return all_gather(x.unsqueeze(0), 0, state.group, backward="reduce_scatter")


def exchange_rows(
    x: torch.Tensor, before: int, after: int, state: VAEShardState
) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous rank's last ``before`` rows and the next rank's first ``after`` rows (dim -2).

    Only the boundary rows enter the exchange, so no copy of the shard is made. Empty at the global borders.
    """
    n = x.shape[-2]
    edge = torch.cat([x.narrow(-2, 0, min(after, n)), x.narrow(-2, n - min(before, n), min(before, n))], -2)
    out = halo_exchange(edge, edge.dim() - 2, before, after, state.group)
    n_top = before if state.rank > 0 else 0
    n_bottom = after if state.rank < state.world - 1 else 0
    return out.narrow(-2, 0, n_top), out.narrow(-2, out.shape[-2] - n_bottom, n_bottom)


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
    ``ZeroPad2d``).
    """
    original = conv.forward
    before, after = state.halos[id(conv)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding or state.approx:
            return original(x)
        top, bottom = exchange_rows(x, before, after, state)
        x = _assemble(
            x,
            top,
            bottom,
            pad_top if state.rank == 0 else 0,
            pad_bottom if state.rank == state.world - 1 else 0,
            [conv.padding[1], conv.padding[1]],
        )
        return F.conv2d(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)

    return forward


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


class _UpcastVarMean(torch.autograd.Function):
    """``torch.var_mean(x.float(), dim=-1, correction=0)`` that keeps ``x`` in its own dtype for backward.

    Autograd would save the upcast copy (two bytes per bf16 byte) until backward. Backward, in the upcast
    dtype: ``d mean / dx = 1 / n``, ``d var / dx = 2 (x - mean) / n`` (the biased variance).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        var, mean = torch.var_mean(x.to(_compute_dtype(x.dtype)), dim=-1, correction=0)
        ctx.save_for_backward(x, mean)
        return var, mean

    @staticmethod
    def backward(ctx, grad_var: torch.Tensor, grad_mean: torch.Tensor) -> torch.Tensor:
        x, mean = ctx.saved_tensors
        n = x.shape[-1]
        grad = x.to(mean.dtype) - mean.unsqueeze(-1)  # a new tensor: safe to update in place
        grad.mul_(grad_var.unsqueeze(-1) * (2 / n)).add_(grad_mean.unsqueeze(-1) / n)
        return grad.to(x.dtype)


class _UpcastScaleShift(torch.autograd.Function):
    """``(x.to(scale.dtype) * scale + shift).to(x.dtype)`` that keeps ``x`` in its own dtype for backward.

    ``scale`` and ``shift`` broadcast against ``x``. The arithmetic stays in ``scale``'s (fp32) dtype: with
    a bf16 shift, ``|mean| >> std`` would lose the result to cancellation. Backward recomputes the upcast
    ``x`` for the scale gradient instead of saving it.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, scale)
        ctx.shift_shape = shift.shape
        return torch.addcmul(shift, x.to(scale.dtype), scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, scale = ctx.saved_tensors
        grad = grad.to(scale.dtype)
        grad_x = grad_scale = grad_shift = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad * scale).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_scale = x.to(scale.dtype, copy=True).mul_(grad).sum_to_size(scale.shape)
        if ctx.needs_input_grad[2]:
            grad_shift = grad.sum_to_size(ctx.shift_shape)
        return grad_x, grad_scale, grad_shift


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """GroupNorm statistics and normalisation run in at least fp32 (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def group_norm_forward(norm: torch.nn.GroupNorm, state: VAEShardState) -> Callable:
    """Forward for ``nn.GroupNorm`` on height shards: statistics over all ranks, one small all-gather.

    Each rank reduces its rows to (count, mean, M2) per group; these merge exactly (Chan et al.'s
    parallel variance), so there is no ``E[x^2] - E[x]^2`` cancellation. The normalisation is one fused
    ``x * scale + shift`` in fp32 (or wider), and autograd keeps only ``x`` itself: in fp32 the stock ops
    already do; for bf16/fp16 inputs :class:`_UpcastVarMean` and :class:`_UpcastScaleShift` save ``x``
    rather than the two fp32 copies that plain autograd would keep (4x a bf16 input's bytes per norm).
    """
    original = norm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not state.sharding:
            return original(x)
        b, c = x.shape[:2]
        groups = norm.num_groups
        compute = _compute_dtype(x.dtype)
        grouped = x.reshape(b, groups, -1)
        if x.dtype == torch.float32:
            var_local, mean_local = torch.var_mean(grouped, dim=-1, correction=0)
        else:
            var_local, mean_local = _UpcastVarMean.apply(grouped)
        counts = torch.tensor(state.sizes(grouped.shape[-1]), dtype=torch.float64, device=x.device)
        stats = all_reduce_stats(torch.stack([mean_local, var_local]), state).double()  # (world, 2, b, g)
        weights = (counts / counts.sum()).view(-1, 1, 1)
        mean = (weights * stats[:, 0]).sum(0)
        var = (weights * (stats[:, 1] + (stats[:, 0] - mean) ** 2)).sum(0)
        scale = torch.rsqrt(var + norm.eps).to(compute).repeat_interleave(c // groups, dim=1)  # (b, c)
        shift = -mean.to(compute).repeat_interleave(c // groups, dim=1) * scale
        if norm.affine:
            # Upcast once: the weight's two gradient terms cancel when |mean| >> std, so they must be summed
            # in fp32 before the one rounding to the parameter's dtype (a no-op for fp32 parameters).
            weight, bias = norm.weight.to(compute), norm.bias.to(compute)
            scale, shift = scale * weight, shift * weight + bias
        view = (b, c) + (1,) * (x.dim() - 2)
        if x.dtype == torch.float32:
            return torch.addcmul(shift.view(view), x, scale.view(view))
        return _UpcastScaleShift.apply(x, scale.view(view), shift.view(view))

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


def session_forward(
    original: Callable, state: VAEShardState, kind: str, cleanup: Callable[[], Any] | None = None
) -> Callable:
    """``vae._encode`` (``kind="encode"``, returns a tensor) or ``vae._decode`` (returns output or tuple).

    ``cleanup`` runs when the call raises (an out-of-memory error, say): the Wan VAE keeps its per-conv frame
    cache on the module (``clear_cache``), which would otherwise hold the failed call's activations (and
    their graph) until the next call.
    """

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if state.mode is None:
            # Every rank computes its rows of ONE output from its own copy of x: copies must be identical.
            named = {"x": x, **{f"arg{i}": a for i, a in enumerate(args, 1)}, **kwargs}
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
        if rows is None:
            return out  # tiled: already full
        if state.output == "shard":
            # The local rows; the gradient is then that of the SUM of the ranks' losses on their rows.
            def finish(t: torch.Tensor) -> torch.Tensor:
                return grad_scaled_by_group(t, state.group)
        else:

            def finish(t: torch.Tensor) -> torch.Tensor:
                return gather_rows(t, state)

        if kind == "encode":
            return finish(out)
        if isinstance(out, tuple):
            return (finish(out[0]), *out[1:])
        out.sample = finish(out.sample)
        return out

    return forward


# ----------------------------------------------------------------------------------------------- tiling
@dataclass(eq=False)
class _TileRun:
    """Two passes of a stock tiled method: compute own tiles (others as fakes), exchange, replay the blend."""

    state: VAEShardState
    per_call: bool  # True: each coder call is a tile (KL); False: tiles start at ``clear_cache`` (Wan)
    tile: int = -1
    replaying: bool = False
    replayed: int = 0
    device: torch.device = torch.device("cpu")
    calls: list[tuple[int, torch.Size, torch.dtype]] = field(default_factory=list)
    mine: list[torch.Tensor] = field(default_factory=list)
    results: list[torch.Tensor] = field(default_factory=list)

    def new_tile(self) -> None:
        if not self.replaying:
            self.tile += 1

    def call(self, original: Callable, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        if self.replaying:
            self.replayed += 1
            return self.results[self.replayed - 1]
        if self.per_call:
            self.new_tile()
        self.device = x.device
        owner = max(self.tile, 0) % self.state.world
        if owner == self.state.rank:
            out = original(x, *args, **kwargs)
            self.mine.append(out)
        else:
            # Private but stable since torch 2.0: runs the stock code for shapes only, no compute, no memory.
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True):
                fake = original(x, *args, **kwargs)
            out = torch.zeros(fake.shape, dtype=fake.dtype, device=x.device)
        self.calls.append((owner, out.shape, out.dtype))
        return out

    def exchange(self) -> None:
        """Every rank gets every tile, in call order."""
        state = self.state
        numels = [[s.numel() for o, s, _ in self.calls if o == r] for r in range(state.world)]
        flat = (
            torch.cat([t.reshape(-1) for t in self.mine]) if self.mine else torch.empty(0, device=self.device)
        )
        dtype = self.calls[0][2] if self.calls else torch.float32
        gathered = all_gather(flat.to(dtype), 0, state.group, [sum(n) for n in numels])
        per_rank = [list(p.split(n)) for p, n in zip(gathered.split([sum(n) for n in numels]), numels)]
        self.results = [per_rank[owner].pop(0).view(shape) for owner, shape, _ in self.calls]
        self.mine, self.replaying, self.replayed = [], True, 0


def tiled_forward(original: Callable, state: VAEShardState, per_call: bool) -> Callable:
    """A stock tiled method run with its tiles spread over the ranks (inference only)."""

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
        saved_mode, run = state.mode, _TileRun(state, per_call)
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
        patch.set_attr(conv, "forward", conv2d_forward(conv, state, top, bottom))


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


def trace_conv_inputs(
    module: torch.nn.Module, fn: Callable[[], Any]
) -> list[tuple[torch.nn.Module, torch.Size]]:
    """Input shapes of every conv call while ``fn()`` runs the *unsplit* model (FakeTensor: no compute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen: list[tuple[torch.nn.Module, torch.Size]] = []
    handles = [
        m.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0].shape)))
        for m in module.modules()
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))
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
    pad_top = conv._padding[2] if hasattr(conv, "_padding") else conv.padding[0]
    kernel, stride = conv.kernel_size[-2], conv.stride[-2]
    if kernel == 1 and stride == 1:
        return 0, 0
    return conv_halo(kernel, stride, pad_top)


def analytic_halo_bytes(module: torch.nn.Module, fn: Callable[[], Any], rank: int, world: int) -> int:
    """Bytes ``rank`` sends for halos while ``fn()`` runs ``module`` split over ``world`` ranks.

    Sum over conv calls of ``(before + after) x (row elements: B x C x T x W) x itemsize`` for an interior
    rank (one side at the borders), with the shapes of the unsplit run.
    """
    total = 0
    for conv, shape in trace_conv_inputs(module, fn):
        before, after = conv_row_halo(conv)
        row_numel = shape.numel() // shape[-2]
        total += halo_bytes(rank, world, before, after, row_numel, conv.weight.element_size())
    return total
