"""``all_reduce_gradients``: the SUM over the group, and parameters no rank used keep ``.grad`` None.

Gradients here are sums of small integers (inputs ``arange(3) + rank``), which fp32 represents exactly, and so
every partial sum: the all-reduce result is exact in any summation order and is compared exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfpatch import all_reduce_gradients


def _touch_case() -> dict[str, object]:
    """Three layers: ``shared`` used on every rank, ``first`` on rank 0 only, ``idle`` on none."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = torch.nn.ModuleDict({name: torch.nn.Linear(3, 2) for name in ("shared", "first", "idle")})
    x = torch.arange(3.0) + rank  # a different shard of work per rank
    loss = layers["shared"](x).sum() + (layers["first"](x).sum() if rank == 0 else 0)
    loss.backward()
    all_reduce_gradients(layers, dist.group.WORLD)
    expected_shared = torch.stack([torch.arange(3.0) + r for r in range(world)]).sum(0)
    return {
        "shared_ok": torch.equal(layers["shared"].weight.grad, expected_shared.expand(2, 3)),
        "first_ok": torch.equal(layers["first"].weight.grad, torch.arange(3.0).expand(2, 3)),
        "idle_grad": layers["idle"].weight.grad,
    }


def test_all_reduce_gradients_sums_and_keeps_unused_grads_none(rank_pool):
    for world in (2, 3):
        for r, result in enumerate(rank_pool(world).run(_touch_case)):
            assert result["shared_ok"], f"world {world} rank {r}: shared grad is not the sum over ranks"
            assert result["first_ok"], f"world {world} rank {r}: a grad from rank 0 only must reach all ranks"
            assert result["idle_grad"] is None, f"world {world} rank {r}: an unused parameter got a grad"
