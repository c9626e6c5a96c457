"""Parallel degrees and the planner that turns ``parallel=N`` into them. Pure: no torch.distributed calls.

>>> from hfpatch.core.config import ModelFacts, plan_parallel
>>> plan_parallel(8, ModelFacts(num_heads=12, guides=True))
ParallelConfig(data=1, cfg=2, ring=1, ulysses=4, vae=8)
>>> plan_parallel(6, ModelFacts(num_heads=4))
ParallelConfig(data=1, cfg=1, ring=3, ulysses=2, vae=6)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

__all__ = ["ModelFacts", "ParallelConfig", "crosses_nodes", "plan_parallel", "resolve_parallel"]


@dataclass(frozen=True, repr=False)
class ParallelConfig:
    """Explicit parallel degrees. ``data * cfg * pipefusion * ring * ulysses`` is the number of ranks used.

    Args:
        data: Data parallel over prompts / ``num_images_per_prompt`` (whole pipeline replicas).
        cfg: Classifier-free-guidance parallel: cond and uncond branches on different ranks (1 or 2).
        ring: Ring-attention degree (K/V blocks passed rank to rank).
        ulysses: Ulysses degree (all-to-all sequence <-> heads).
        vae: Ranks the VAE splits its feature maps over; ``None`` means all ranks.
        pipefusion: PipeFusion stages: the transformer's blocks are split over this many ranks (each keeps
            only its blocks' weights) and the tokens flow through them as a pipeline of patches
            (:mod:`hfpatch.patches.pipefusion`; approximate after its warm-up steps, inference only).

    >>> ParallelConfig(cfg=2, ulysses=2).world_size
    4
    >>> ParallelConfig(cfg=2, pipefusion=2).world_size
    4
    """

    data: int = 1
    cfg: int = 1
    ring: int = 1
    ulysses: int = 1
    vae: int | None = None
    pipefusion: int = 1

    def __post_init__(self) -> None:
        for name in ("data", "cfg", "ring", "ulysses", "pipefusion"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {value!r}")
        if self.cfg not in (1, 2):
            raise ValueError(f"ParallelConfig.cfg must be 1 or 2 (cond and uncond), got {self.cfg}")
        if self.vae is not None and (
            not isinstance(self.vae, int) or isinstance(self.vae, bool) or self.vae < 1
        ):
            raise ValueError(f"ParallelConfig.vae must be a positive int or None, got {self.vae!r}")
        product = self.data * self.cfg * self.pipefusion * self.ring * self.ulysses
        if self.vae is not None and product > 1 and self.vae not in (1, product):
            raise ValueError(
                f"ParallelConfig.vae={self.vae} must be 1 or {_product_text(self)}={product}: "
                "the VAE runs after denoising, when every rank holds the full latents"
            )
        if self.vae is None:
            object.__setattr__(self, "vae", product)

    def __repr__(self) -> str:
        # pipefusion (added last) shows only when used, so plans without it print as they always did
        shown = [f"{name}={getattr(self, name)}" for name in ("data", "cfg", "ring", "ulysses", "vae")]
        if self.pipefusion != 1:
            shown.append(f"pipefusion={self.pipefusion}")
        return f"ParallelConfig({', '.join(shown)})"

    @property
    def world_size(self) -> int:
        """Ranks used: ``data*cfg*pipefusion*ring*ulysses``, or ``vae`` for a VAE-only config."""
        return max(self.data * self.cfg * self.pipefusion * self.ring * self.ulysses, self.vae)

    @property
    def sequence_parallel(self) -> int:
        return self.ring * self.ulysses


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs to know about a target.

    Args:
        num_heads: Attention heads of the transformer (``None`` when there is no transformer).
        guides: Whether the pipeline guides in a way CFG parallel speeds up (the planner then proposes cfg=2).
        name: Class name, used in error messages.
        pipeline: Whether the target is a pipeline (data parallel splits a pipeline's batch).
        num_blocks: Transformer blocks a PipeFusion family can split over stages (the fewest of a pipeline's
            transformers); ``None`` when no PipeFusion family serves the target.
        splits_vae: Whether a family splits a VAE of the target; without one the resolved plan says ``vae=1``
            (a bare transformer's plan does not claim a VAE split it does not have).
    """

    num_heads: int | None = None
    guides: bool = False
    name: str = "target"
    pipeline: bool = False
    num_blocks: int | None = None
    splits_vae: bool = True


def _product_text(config: ParallelConfig) -> str:
    return "data*cfg*pipefusion*ring*ulysses" if config.pipefusion > 1 else "data*cfg*ring*ulysses"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def crosses_nodes(ulysses: int, world: int, node_size: int | None) -> bool:
    """Whether a Ulysses group of ``ulysses`` ranks spans two nodes of ``node_size`` ranks in a world of ``world``.

    hfpatch's mesh puts Ulysses innermost, so its groups are runs of consecutive global ranks, and a launcher
    (torchrun) numbers each node's ranks consecutively: a group stays inside a node when its size divides the node
    size (or the world fits in one node). ``None`` (node size unknown) or nodes of unequal size: no constraint.

    >>> crosses_nodes(4, 8, 4), crosses_nodes(8, 8, 4), crosses_nodes(8, 8, None), crosses_nodes(3, 6, 2)
    (False, True, False, True)
    """
    if node_size is None or node_size < 1 or world <= node_size or world % node_size:
        return False
    return node_size % ulysses != 0


def _island(node_size: int | None, peer_access: bool | None) -> int | None:
    """Ranks that reach each other over fast links: a node, or one GPU when the node's GPUs lack peer access."""
    return 1 if peer_access is False else node_size


def plan_parallel(
    n: int,
    facts: ModelFacts,
    pipefusion: bool = False,
    node_size: int | None = None,
    peer_access: bool | None = None,
) -> ParallelConfig:
    """Plan ``n`` ranks: CFG parallel when the pipeline guides, then Ulysses up to the head count, then Ring.

    Ulysses gets the largest divisor of the remaining ranks that also divides the head count (Ulysses moves
    less data than Ring and needs no online softmax); the rest is Ring, which has no head constraint. On several
    nodes of ``node_size`` ranks, Ulysses (an all-to-all, on the fast links) stays inside a node: its degree also
    divides the node size, and CFG, data, PipeFusion and Ring (point-to-point) take the ranks across nodes.

    >>> plan_parallel(8, ModelFacts(num_heads=24), node_size=4)   # two nodes of 4: Ring across them
    ParallelConfig(data=1, cfg=1, ring=2, ulysses=4, vae=8)

    ``peer_access=False`` (GPUs on PCIe that cannot reach each other directly,
    :func:`hfpatch.core.ranks.peer_access`): every byte between two GPUs crosses host memory, so no link is
    fast; an all-to-all waits for all of them at once, while Ring's point-to-point passes overlap with the
    attention of the block in hand. The planner then keeps Ulysses at 1 (CFG, then Ring).

    >>> plan_parallel(4, ModelFacts(num_heads=24, guides=True), peer_access=False)
    ParallelConfig(data=1, cfg=2, ring=2, ulysses=1, vae=4)

    ``pipefusion=True`` (``hfpatch.apply(..., pipefusion=True)``; never the default, PipeFusion is approximate
    after its warm-up) gives the ranks left after CFG to PipeFusion instead: its degree is the largest divisor
    of them that does not exceed the transformer's block count. When that divisor leaves ranks over (more
    ranks than blocks), the other factor runs sequence parallel inside each stage (xDiT's hybrid, exact in
    itself): Ulysses up to the head count, then Ring, as without PipeFusion.

    >>> plan_parallel(4, ModelFacts(num_heads=4, guides=True, num_blocks=5), pipefusion=True)
    ParallelConfig(data=1, cfg=2, ring=1, ulysses=1, vae=4, pipefusion=2)
    >>> plan_parallel(3, ModelFacts(num_heads=4, num_blocks=5), pipefusion=True).pipefusion
    3
    >>> plan_parallel(8, ModelFacts(num_heads=4, guides=True, num_blocks=2), pipefusion=True)
    ParallelConfig(data=1, cfg=2, ring=1, ulysses=2, vae=8, pipefusion=2)
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"parallel must be a positive int or a ParallelConfig, got {n!r}")
    cfg = 2 if facts.guides and n % 2 == 0 else 1
    rest = n // cfg
    island = _island(node_size, peer_access)
    if pipefusion:
        return _plan_pipefusion(n, cfg, facts, island)
    if facts.num_heads is None:
        # No sequence-parallel transformer (a VAE; a UNet pipeline): CFG parallel when it fills every rank,
        # else the VAE splits over every rank and the denoiser runs whole on each.
        return ParallelConfig(cfg=2, vae=n) if cfg == 2 and rest == 1 else ParallelConfig(vae=n)
    ulysses = _ulysses_degree(rest, facts.num_heads, n, island)
    return ParallelConfig(cfg=cfg, ring=rest // ulysses, ulysses=ulysses, vae=n)


def _ulysses_degree(ranks: int, heads: int, world: int, node_size: int | None) -> int:
    """The largest divisor of ``ranks`` that divides the head count and keeps each Ulysses group in one node."""
    return max(d for d in _divisors(ranks) if heads % d == 0 and not crosses_nodes(d, world, node_size))


def _plan_pipefusion(n: int, cfg: int, facts: ModelFacts, node_size: int | None = None) -> ParallelConfig:
    """``plan_parallel(n, facts, pipefusion=True)`` once CFG took ``cfg`` ranks."""
    if facts.num_blocks is None:
        raise ValueError(
            f"pipefusion=True lets the planner split a transformer's blocks over ranks, but {facts.name} has no "
            "transformer that hfpatch's PipeFusion supports; drop pipefusion=True"
        )
    rest = n // cfg
    stages = max(d for d in _divisors(rest) if d <= facts.num_blocks)
    sp = rest // stages  # ranks per stage: sequence parallel inside it
    ulysses = _ulysses_degree(sp, facts.num_heads or 1, n, node_size)
    return ParallelConfig(cfg=cfg, pipefusion=stages, ring=sp // ulysses, ulysses=ulysses, vae=n)


def check_config(config: ParallelConfig, facts: ModelFacts) -> None:
    """Reject degrees the target cannot run. Raises ``ValueError`` with what to change."""
    # Any pipeline may ask for cfg=2 (its family decides how: see hfpatch.patches.pipeline); ``guides`` only
    # says whether the planner proposes it.
    if config.cfg == 2 and not (facts.pipeline or facts.guides):
        raise ValueError(
            f"cfg=2 splits a pipeline's classifier-free guidance; {facts.name} is not a pipeline. Apply hfpatch "
            "to the pipeline, or use cfg=1 and put the ranks into ulysses/ring."
        )
    # On a transformer, data > 1 means replicas of a sequence-parallel model: each replica's sp group splits
    # its own samples (the training script's sampler and DDP work over the data axis, hfpatch.distributed.data).
    if config.data > 1 and not facts.pipeline and not (facts.num_heads and config.sequence_parallel > 1):
        raise ValueError(
            f"data={config.data} splits a pipeline's prompts over ranks; {facts.name} is not a pipeline. "
            "Apply hfpatch to the pipeline, or use data=1 (wrap the model in DDP for data parallel training). "
            "On a transformer, data>1 only adds replicas to sequence parallel (ulysses/ring > 1)."
        )
    if config.pipefusion > 1 and facts.num_heads is None:
        raise ValueError(
            f"pipefusion={config.pipefusion} splits a transformer's blocks; {facts.name} has no transformer"
        )
    if config.pipefusion > 1 and facts.num_blocks is None:
        raise ValueError(
            f"pipefusion={config.pipefusion} splits a transformer's blocks, but {facts.name} has no transformer "
            "that hfpatch's PipeFusion supports; use ulysses/ring (and cfg/data) without PipeFusion"
        )
    if config.sequence_parallel > 1 and facts.num_heads is None:
        raise ValueError(
            f"ulysses={config.ulysses}, ring={config.ring} need a transformer; {facts.name} has none. "
            "Use ParallelConfig(vae=N) for a VAE."
        )
    if facts.num_heads is not None and config.ulysses > facts.num_heads:
        raise ValueError(
            f"ulysses={config.ulysses} exceeds the {facts.num_heads} attention heads of {facts.name}; "
            f"use ulysses <= {facts.num_heads} and put the remaining ranks into ring"
        )


def resolve_parallel(
    parallel: int | ParallelConfig | None,
    world_size: int,
    facts: ModelFacts,
    pipefusion: bool = False,
    node_size: int | None = None,
    peer_access: bool | None = None,
) -> ParallelConfig:
    """Turn the user's ``parallel`` argument into checked degrees for ``world_size`` ranks.

    ``parallel=1`` is valid in any world: the target is patched for one rank and every rank runs it alone.

    Args:
        parallel: ``None`` (all ranks), an int number of ranks, or an explicit :class:`ParallelConfig`.
        world_size: Ranks available (``torch.distributed`` world size, or the torchrun world about to start).
        facts: What the planner knows about the target.
        pipefusion: Let the planner of an int ``parallel`` give PipeFusion a degree (:func:`plan_parallel`).
        node_size: Ranks per node (torchrun's ``LOCAL_WORLD_SIZE``; ``None``: unknown). The planner keeps Ulysses
            inside a node; an explicit config whose Ulysses groups span nodes runs, with a warning naming the
            degrees that would not.
        peer_access: Whether the node's GPUs reach each other directly (``None``: unknown, or CPU). Without it
            the planner keeps Ulysses at 1, and an explicit Ulysses degree above 1 runs with a warning.

    Raises:
        ValueError: If the degrees do not fit the world or the target.
    """
    if not isinstance(pipefusion, bool):
        raise ValueError(
            f"pipefusion must be True or False (True lets the planner of parallel=N use PipeFusion), got {pipefusion!r}"
        )
    if parallel is None:
        parallel = world_size
    if isinstance(parallel, ParallelConfig):
        if pipefusion:
            raise ValueError(
                f"pipefusion=True lets the planner of an int parallel=N choose a PipeFusion degree, but parallel="
                f"{parallel} names the degrees; set ParallelConfig(pipefusion=P, ...) there instead"
            )
        config = parallel
    elif isinstance(parallel, int) and not isinstance(parallel, bool):
        config = plan_parallel(parallel, facts, pipefusion, node_size, peer_access)
    else:
        raise TypeError(
            f"parallel must be None, an int or hfpatch.ParallelConfig, got {type(parallel).__name__}"
        )
    if config.world_size != world_size and config.world_size > 1:  # parallel=1: each rank on its own
        raise ValueError(
            f"{config} uses {config.world_size} ranks ({_product_text(config)}) but the world size is {world_size}; "
            f"launch with `torchrun --nproc-per-node {config.world_size}` or choose degrees that multiply to "
            f"{world_size}"
        )
    check_config(config, facts)
    island = _island(node_size, peer_access)
    if isinstance(parallel, ParallelConfig) and crosses_nodes(config.ulysses, config.world_size, island):
        _warn_ulysses_across_nodes(config, island, facts, peer_access is False)
    product = config.data * config.cfg * config.pipefusion * config.ring * config.ulysses
    if not facts.splits_vae and product > 1 and config.vae == product:
        config = replace(config, vae=1)  # no VAE to split: the plan says so (its default is every rank)
    return config


def _warn_ulysses_across_nodes(
    config: ParallelConfig, island: int | None, facts: ModelFacts, no_peer_access: bool
) -> None:
    """Say that ``config``'s Ulysses all-to-all spans slow links, and which degrees would not."""
    heads = facts.num_heads or config.ulysses
    inside = _ulysses_degree(config.ulysses, heads, config.world_size, island)
    proposal = replace(config, ring=config.ring * config.ulysses // inside, ulysses=inside)
    if no_peer_access:
        text = (
            f"hfpatch: {config} runs Ulysses groups of {config.ulysses} ranks on GPUs without peer access: every "
            f"all-to-all goes through host memory. {proposal} passes Ring's keys and values instead, overlapped "
            "with attention (pass parallel=N to let the planner choose)"
        )
    else:
        text = (
            f"hfpatch: {config} puts Ulysses groups of {config.ulysses} ranks across nodes of {island} ranks: its "
            f"all-to-all then runs over the link between nodes. {proposal} keeps each Ulysses group inside a node "
            "and passes Ring's keys and values between nodes instead (pass parallel=N to let the planner choose)"
        )
    warnings.warn(  # the same text from the same place shows once (the warnings module's default filter)
        text,
        stacklevel=4,
    )
