"""Bytes each rank sends in one denoising step under a plan, inside its node and across nodes.

The analytic count of the collectives hfpatch runs in a step (what
:func:`~hfpatch.distributed.collectives.count_comm` measures; ``tests/distributed/test_nodes.py`` holds them equal
at world 4), for ``hfpatch plan``.
Pure: no process group, no weights. Per transformer call of ``B`` samples, with ``n = ceil(S / sp)`` of the ``S``
split tokens on each of the ``sp = ring * ulysses`` ranks, ``H`` heads of ``D`` dims, ``e`` bytes per element and
``L`` sequence-parallel attention layers:

* Ulysses all-to-all: ``L * 4 * (u - 1) / u * B n H D e`` (q, k, v to heads, the output back to tokens);
* Ring: ``L * 2 * (r - 1) * B n H D e`` (keys and values passed on ``r - 1`` times, to the next rank of the ring);
* joint text (Flux's ``T`` text tokens in every attention): ``L * (u - 1) * B T (H / u) D e``, this rank's heads
  of the text output to each other Ulysses rank (text keys and values are never passed around the ring);
* the output: ``(sp - 1) * B n C e``, this rank's tokens of the ``C`` output features to every other sp rank;
* the same-input check: ``(g - 1) * SLOTS * FIELDS * 8`` per call of the pipeline's transformer, to the ``g - 1``
  other ranks that share the sample (``cfg * ring * ulysses``);
* CFG parallel: this rank's prediction (``B`` latents) and ``8 * (1 + 2 * 10)`` bytes of metadata to the other cfg
  rank, once per step.

Ranks are laid out as hfpatch's mesh (:data:`~hfpatch.distributed.runtime.AXES`, Ulysses innermost) and a launcher
numbers each node's ranks consecutively, so rank ``k`` lives on node ``k // node_size``.

Wan 2.1 14B at 720p, 81 frames (21 x 45 x 80 tokens), guided, in bf16 on two nodes of 8 GPUs, as planned:

>>> from hfpatch import ParallelConfig
>>> shape = StepShape(tokens=75600, heads=40, head_dim=128, layers=40, out_features=64, guided=True,
...                   latent_numel=16 * 21 * 90 * 160)
>>> busiest = max(step_traffic(ParallelConfig(cfg=2, ulysses=8), shape, node_size=8), key=across)
>>> round(inside(busiest) / 2**30, 2), round(across(busiest) / 2**20, 2)  # GiB inside, MiB across
(12.63, 9.27)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..core.config import ParallelConfig
from .agreement.inputs import FIELDS, SLOTS
from .runtime import AXES

__all__ = ["KINDS", "StepShape", "across", "inside", "step_traffic"]

#: The collectives of a step, as :func:`~hfpatch.distributed.collectives.count_comm` names them.
KINDS = ("all_to_all", "ring", "all_gather", "guard")
#: The CFG exchange's metadata: ``[ok, meta(local), meta(expected)]`` int64, a meta being 10 ints.
_CFG_META_BYTES = 8 * (1 + 2 * 10)


@dataclass(frozen=True)
class StepShape:
    """What one denoising step computes, as far as its traffic goes.

    Args:
        tokens: Tokens of the sequence the ranks split (image or video patches of one sample).
        heads: Attention heads.
        head_dim: Dims per head.
        layers: Sequence-parallel attention calls per transformer forward (one per block in Wan and Flux).
        out_features: Features per token of the transformer's output (``out_channels * prod(patch_size)``).
        joint_text: Text tokens joined to the sequence in every attention (Flux); 0 for cross-attention (Wan).
        batch: Samples per transformer call.
        guided: The pipeline calls its transformer twice a step (cond and uncond; Wan with guidance).
        latent_numel: Elements of one sample's prediction (the CFG exchange); 0 when unknown.
        element_size: Bytes per element (2 for bf16).
    """

    tokens: int
    heads: int
    head_dim: int
    layers: int
    out_features: int
    joint_text: int = 0
    batch: int = 1
    guided: bool = False
    latent_numel: int = 0
    element_size: int = 2


def inside(sent: dict[str, tuple[int, int]]) -> int:
    """Bytes a rank sends inside its node (a :func:`step_traffic` entry)."""
    return sum(pair[0] for pair in sent.values())


def across(sent: dict[str, tuple[int, int]]) -> int:
    """Bytes a rank sends to other nodes (a :func:`step_traffic` entry)."""
    return sum(pair[1] for pair in sent.values())


def _split(per_peer: int, me: int, peers: list[int], node_size: int | None) -> tuple[int, int]:
    """``per_peer`` bytes to each of ``peers``: (inside ``me``'s node, across)."""
    if node_size is None:
        return per_peer * len(peers), 0
    far = sum(1 for p in peers if p // node_size != me // node_size)
    return per_peer * (len(peers) - far), per_peer * far


def step_traffic(
    plan: ParallelConfig, shape: StepShape, node_size: int | None = None
) -> list[dict[str, tuple[int, int]]]:
    """Per rank of ``plan``: collective kind -> (bytes sent inside its node, bytes sent across nodes) in one step.

    ``node_size`` ``None``: one node (everything inside).

    Raises:
        ValueError: A PipeFusion plan (its patch pipeline is not modelled here).
    """
    if plan.pipefusion > 1:
        raise ValueError(
            "step_traffic models sequence, CFG and data parallelism; PipeFusion's is not modelled"
        )
    dims = [getattr(plan, axis) for axis in AXES]
    world = math.prod(dims)
    u, r = plan.ulysses, plan.ring
    sp = u * r
    n = -(-shape.tokens // sp)  # tokens per rank, the last shard padded
    qkv = shape.batch * n * shape.heads * shape.head_dim * shape.element_size  # one local q, k or v
    # Calls of the transformer in a step: per rank, and through the pipeline (each checked once).
    pipeline_calls = 2 if shape.guided else 1
    rank_calls = 1 if plan.cfg == 2 else pipeline_calls
    table = SLOTS * FIELDS * 8
    out = []
    for me in range(world):
        coords = _unravel(me, dims)
        sent: dict[str, tuple[int, int]] = {}
        if u > 1:
            per_peer = rank_calls * shape.layers * 4 * qkv // u
            sent["all_to_all"] = _split(per_peer, me, _peers(coords, dims, ("ulysses",)), node_size)
        if r > 1:
            after = coords.copy()
            after[AXES.index("ring")] = (coords[AXES.index("ring")] + 1) % r
            per_step = rank_calls * shape.layers * 2 * (r - 1) * qkv
            sent["ring"] = _split(per_step, me, [_ravel(after, dims)], node_size)
        gathers = []
        if sp > 1:
            shard = shape.batch * n * shape.out_features * shape.element_size
            gathers.append(
                _split(rank_calls * shard, me, _peers(coords, dims, ("ring", "ulysses")), node_size)
            )
        if u > 1 and shape.joint_text:
            text = shape.batch * shape.joint_text * (shape.heads // u) * shape.head_dim * shape.element_size
            gathers.append(
                _split(rank_calls * shape.layers * text, me, _peers(coords, dims, ("ulysses",)), node_size)
            )
        if plan.cfg == 2:
            prediction = shape.batch * shape.latent_numel * shape.element_size + _CFG_META_BYTES
            gathers.append(_split(prediction, me, _peers(coords, dims, ("cfg",)), node_size))
        if gathers:
            sent["all_gather"] = (sum(g[0] for g in gathers), sum(g[1] for g in gathers))
        sample = _peers(coords, dims, ("cfg", "ring", "ulysses"))
        if sample:
            sent["guard"] = _split(pipeline_calls * table, me, sample, node_size)
        out.append(sent)
    return out


def _peers(coords: list[int], dims: list[int], free: tuple[str, ...]) -> list[int]:
    """The other ranks whose mesh coordinates differ from ``coords`` on the ``free`` axes only."""
    ranges = [range(d) if axis in free else [c] for axis, d, c in zip(AXES, dims, coords)]
    me = _ravel(coords, dims)
    return [rank for rank in (_ravel(list(c), dims) for c in itertools.product(*ranges)) if rank != me]


def _unravel(index: int, dims: list[int]) -> list[int]:
    coords = []
    for d in reversed(dims):
        coords.append(index % d)
        index //= d
    return coords[::-1]


def _ravel(coords: list[int], dims: list[int]) -> int:
    index = 0
    for c, d in zip(coords, dims):
        index = index * d + c
    return index
