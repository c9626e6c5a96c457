"""diffusers' step caches under hfpatch's parallelism: every rank of a call decides alike, as one rank would.

A step cache (``transformer.enable_cache(...)``, :mod:`diffusers.hooks`) skips blocks of some denoising steps
and reuses what earlier steps computed. Under sequence parallelism each rank holds a shard of the tokens, and under
batched CFG or data parallelism a part of the batch: a cache that decides "skip" from what one rank sees can decide
differently on another rank, which then runs other collectives (a hang) or mixes stale and fresh shards (a wrong
result). What hfpatch does for each of diffusers' caches:

* **FirstBlockCache**: its decision compares the first block's residual with the previous step's by
  ``mean|r - r_prev| / mean|r_prev|`` over the whole ``[B, S, D]`` tensor. hfpatch replaces the decision of the
  leader hook (per object, undone by ``patch.remove()``) with the same ratio computed over the *whole* call: the two
  sums over this rank's real tokens (its shard's padding excluded) are all-reduced over the sequence-parallel group
  and over the groups that split this call's batch (batched CFG, data parallel), then every rank votes and the
  vote is all-reduced (``MAX``: compute if any rank would), so the decision is the one-rank decision (up to fp32
  reassociation of the two sums) and identical on every rank. Each decision is appended to ``.decisions``.
* **TaylorSeerCache**, **MagCache**: they decide from step counters (and MagCache's configured ratios), per cache
  context: identical on every rank and equal to one rank's, with nothing to agree on. MagCache's calibration
  (``calibrate=True``) measures a mean over the whole sequence: refused under sequence parallelism.
* **PyramidAttentionBroadcastConfig**: counters per attention module, no cache context. Sequence parallel and
  batched CFG run every call on every rank: fine. Two-call CFG parallel (cond on one rank, uncond on the other)
  would advance the counters once per step instead of twice: refused.
* **FasterCacheConfig**: its denoiser hook splits the batch as ``[uncond, cond]`` and its counters have no cache
  context: refused with CFG or data parallelism; fine with sequence parallelism alone (its frequency filter runs
  on the gathered output).
* **SeaCacheConfig**: it all-reduces its own vote over the default process group (every rank, including ranks
  running other calls under CFG/data parallelism) from model-specific metadata: refused under hfpatch's
  parallelism.

Under sequence parallelism, a cache enabled *after* ``hfpatch.apply`` is found at the next call and refused on
every rank before any collective ("enable the cache before hfpatch.apply"); with CFG/data parallelism alone, enable
caches before ``apply`` (they are checked there).

>>> from hfpatch.patches.caches import cache_names
>>> from hfpatch.testing import tiny_qwenimage_transformer
>>> from diffusers import FirstBlockCacheConfig
>>> model = tiny_qwenimage_transformer()
>>> model.enable_cache(FirstBlockCacheConfig(threshold=0.2))
>>> cache_names(model)
['FirstBlockCache']
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CACHE_HOOKS", "FirstBlockDecision", "agree_caches", "cache_names", "check_caches"]

#: diffusers hook name -> the cache it belongs to.
CACHE_HOOKS: dict[str, str] = {
    "fbc_leader_block_hook": "FirstBlockCache",
    "fbc_block_hook": "FirstBlockCache",
    "mag_cache_leader_block_hook": "MagCache",
    "mag_cache_block_hook": "MagCache",
    "taylorseer_cache": "TaylorSeerCache",
    "pyramid_attention_broadcast": "PyramidAttentionBroadcast",
    "faster_cache_denoiser": "FasterCache",
    "faster_cache_block": "FasterCache",
    "sea_cache_root": "SeaCache",
    "sea_cache_leader_block": "SeaCache",
    "sea_cache_block": "SeaCache",
    "sea_cache_post_norm": "SeaCache",
}


def cache_hooks(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(hook name, hook)`` of every diffusers cache hook on ``model`` and its submodules."""
    found = []
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for name, hook in getattr(registry, "hooks", {}).items():
            if name in CACHE_HOOKS:
                found.append((name, hook))
    return found


def cache_names(model: torch.nn.Module) -> list[str]:
    """The diffusers step caches enabled on ``model`` (sorted class-style names)."""
    return sorted({CACHE_HOOKS[name] for name, _ in cache_hooks(model)})


def check_caches(model: torch.nn.Module, *, sequence: int, cfg: int, data: int, two_call_cfg: bool) -> None:
    """Raise ``ValueError`` for a cache that cannot agree across ranks under these degrees (see module doc).

    Args:
        model: The transformer.
        sequence, cfg, data: The degrees its calls run under.
        two_call_cfg: CFG parallel puts the cond and uncond calls on different ranks (true CFG pipelines).
    """
    name = type(model).__name__
    hooks = cache_hooks(model)
    caches = {CACHE_HOOKS[hook_name] for hook_name, _ in hooks}
    parallel = sequence * cfg * data > 1
    if "SeaCache" in caches and parallel:
        raise ValueError(
            f"{name} has SeaCache enabled: it all-reduces its skip vote over the default process group (every rank, "
            "including ranks running other calls under CFG/data parallelism) from model-specific metadata hfpatch "
            "does not cut; use FirstBlockCache, MagCache or TaylorSeerCache, or disable the cache"
        )
    if "FasterCache" in caches and cfg * data > 1:
        raise ValueError(
            f"{name} has FasterCache enabled: its denoiser hook splits each call's batch as [uncond, cond] and its "
            "counters follow every call, which CFG/data parallelism changes; use it with sequence parallelism only "
            "(cfg=1, data=1), or use FirstBlockCache/MagCache/TaylorSeerCache"
        )
    if "PyramidAttentionBroadcast" in caches and cfg > 1 and two_call_cfg:
        raise ValueError(
            f"{name} has PyramidAttentionBroadcast enabled: its counters advance at every call with no cache "
            "context, so with the cond and uncond calls on different CFG ranks each rank would skip at other "
            "steps than one rank does; use cfg=1, or FirstBlockCache/MagCache/TaylorSeerCache"
        )
    for hook_name, hook in hooks:
        if hook_name == "mag_cache_leader_block_hook" and hook.config.calibrate and sequence * cfg * data > 1:
            raise ValueError(
                f"{name} has MagCache in calibration mode: it measures mean ratios over the whole sequence and batch "
                "of one rank; calibrate unpatched (parallel=1) and pass the ratios to MagCacheConfig(mag_ratios=...)"
            )


class FirstBlockDecision:
    """FirstBlockCache's decision over the whole call, agreed by every rank (replaces the leader hook's
    ``_should_compute_remaining_blocks`` per object).

    Args:
        hook: diffusers' ``FBCHeadBlockHook``.
        state: The model's :class:`~hfpatch.patches.dit.sequence_parallel.SequenceShard`, or ``None`` when its
            sequence is not split (only CFG/data parallelism split its calls' batches).
        model: The transformer (its ``forward``, when hfpatch's pipeline wrapper, names the groups that split
            the current call's batch).

    Attributes:
        decisions: ``(cache context name, decision)`` per call, in call order: ``True`` computes the remaining
            blocks, ``False`` reuses the cached residual.
    """

    def __init__(self, hook: Any, state: Any, model: torch.nn.Module) -> None:
        self.hook = hook
        self.state = state
        self.model = model
        self.decisions: list[tuple[str | None, bool]] = []

    def _groups(self) -> list[Any]:
        groups = [self.state.group] if self.state is not None and self.state.world > 1 else []
        return groups + list(getattr(self.model.forward, "split_groups", ()))

    @torch.compiler.disable
    def __call__(self, residual: torch.Tensor) -> bool:
        shared = self.hook.state_manager.get_state()
        previous = shared.head_block_residual
        if previous is None:
            decision = True
        else:
            real = residual.shape[1]
            if self.state is not None:  # this rank's shard: its real tokens, not the end padding
                local = self.state.local_len
                if local is None or residual.shape[1] != local:
                    raise RuntimeError(
                        f"{type(self.model).__name__}: FirstBlockCache's first block returned {residual.shape[1]} "
                        f"tokens where this rank's shard holds {local} (a packed [text, image] stream); hfpatch "
                        "cannot agree its decision over the ranks: disable the cache or use MagCache/TaylorSeerCache"
                    )
                real = max(0, min(local, self.state.valid_len - self.state.rank * local))
            sums = torch.stack(
                [
                    (residual[:, :real] - previous[:, :real]).abs().sum(dtype=torch.float64),
                    previous[:, :real].abs().sum(dtype=torch.float64),
                ]
            )
            for group in self._groups():
                dist.all_reduce(sums, group=group)
            decision = bool((sums[0] / sums[1]).item() > self.hook.threshold)
        vote = torch.tensor([int(decision)], device=residual.device)
        for group in self._groups():
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
        decision = bool(vote.item())
        context = getattr(self.hook.state_manager, "_context", None)
        self.decisions.append((getattr(context, "name", None), decision))
        return decision


def agree_caches(model: torch.nn.Module, state: Any, patch: Any) -> list[FirstBlockDecision]:
    """Make every metric-driven cache decision of ``model`` agree over the ranks of each call (see module doc).

    Returns the installed :class:`FirstBlockDecision` objects (one per FirstBlockCache).
    """
    installed = []
    for hook_name, hook in cache_hooks(model):
        if hook_name == "fbc_leader_block_hook":
            decision = FirstBlockDecision(hook, state, model)
            patch.set_attr(hook, "_should_compute_remaining_blocks", decision)
            installed.append(decision)
    return installed
