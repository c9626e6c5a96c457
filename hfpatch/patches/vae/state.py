"""The shard state of a height-split VAE, the collectives over its rows (scatter, gather, halo exchange,
statistics) and the state of a tiled run spread over the ranks. The mechanics are described in
:mod:`hfpatch.patches.vae.family`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...distributed.collectives import all_gather, halo_exchange
from ...distributed.gradients import grad_scaled_by_group
from .halo import row_offsets, scaled_sizes, split_rows

__all__ = ["VAEShardState"]

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
    tiles: TileRun | None = None
    checks: list[Callable[[], None]] = field(default_factory=list)
    name: str = "VAE"
    check_inputs: bool = True
    #: For byte accounting (:func:`hfpatch.patches.vae.family.analytic_split_bytes`): the modules whose input
    #: rows are exchanged, with their halo and when they are (``None``: always); the attention modules with the
    #: ``(batch, frames, rows, width, channels)`` of each attention a call runs, from its unsplit input.
    exchanges: list[tuple[torch.nn.Module, tuple[int, int], Callable[[], bool] | None]] = field(
        default_factory=list
    )
    attentions: list[tuple[torch.nn.Module, Callable[[torch.Tensor], list[tuple[int, ...]]]]] = field(
        default_factory=list
    )
    #: The coders whose every call gathers its output rows (:func:`~hfpatch.patches.vae.layers.coder_gather_forward`).
    gathers: list[torch.nn.Module] = field(default_factory=list)

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


# ----------------------------------------------------------------------------------------------- tiling
@dataclass(eq=False)
class TileRun:
    """Two passes of a stock tiled method: compute own tiles (others as fakes), exchange, replay the blend."""

    state: VAEShardState
    per_call: bool  # True: each coder call is a tile (KL); False: tiles start at ``clear_cache`` (Wan)
    #: Whether a coder call starts a new tile, from its arguments (CogVideoX: the call without a ``conv_cache``);
    #: overrides ``per_call`` where given: a tile is then a sequence of calls carrying a cache.
    starts: Callable[[tuple, dict], bool] | None = None
    tile: int = -1
    replaying: bool = False
    replayed: int = 0
    device: torch.device = torch.device("cpu")
    calls: list[tuple[int, torch.Size, torch.dtype]] = field(default_factory=list)
    mine: list[torch.Tensor] = field(default_factory=list)
    results: list[torch.Tensor] = field(default_factory=list)
    #: Coders returning ``(tile, cache, ...)`` (CogVideoX, Mochi): how many values each call returned (1: a tensor).
    arity: list[int] = field(default_factory=list)

    def new_tile(self) -> None:
        if not self.replaying:
            self.tile += 1

    def call(self, original: Callable, x: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        if self.replaying:
            self.replayed += 1
            result = self.results[self.replayed - 1]
            extra = self.arity[self.replayed - 1] - 1
            return result if extra == 0 else (result, *([None] * extra))  # the cache is not read on replay
        if self.starts is not None:
            if self.starts(args, kwargs):
                self.new_tile()
        elif self.per_call:
            self.new_tile()
        self.device = x.device
        owner = max(self.tile, 0) % self.state.world
        if owner == self.state.rank:
            value = original(x, *args, **kwargs)
            out, rest = (value[0], tuple(value[1:])) if isinstance(value, tuple) else (value, None)
            self.mine.append(out)
            # The stock blend writes into the tiles it is given (blend_v/blend_h; HunyuanVideo's ``blend_v``): this
            # first pass blends with zero stand-ins for the other ranks' tiles and is thrown away, so it gets a copy;
            # the exchange sends the tile as decoded and the replay gets the tiles.
            out = out.clone()
        else:
            # Private but stable since torch 2.0: runs the stock code for shapes only, no compute, no memory.
            # A cache it returns is made of fake tensors too, read only by this tile's next (fake) call.
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True):
                value = original(x, *args, **kwargs)
            fake, rest = (value[0], tuple(value[1:])) if isinstance(value, tuple) else (value, None)
            out = torch.zeros(fake.shape, dtype=fake.dtype, device=x.device)
        self.calls.append((owner, out.shape, out.dtype))
        self.arity.append(1 if rest is None else 1 + len(rest))
        return out if rest is None else (out, *rest)

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
