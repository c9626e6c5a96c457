"""The gradient convention: ``all_reduce_gradients`` is the MEAN over the group, and the boundaries.

Gradients here are small integers (inputs ``arange(3) + rank``), which fp32 represents exactly, and so every
partial sum; the mean divides that exact sum once, as the expected value is computed, so results compare
exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfpatch import all_reduce_gradients
from hfpatch.distributed.gradients import (
    average_input_gradients,
    grad_averaged_over_group,
    grad_scaled_by_group,
)


def _touch_case() -> dict[str, object]:
    """Three layers: ``shared`` used on every rank, ``first`` on rank 0 only, ``idle`` on none."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = torch.nn.ModuleDict({name: torch.nn.Linear(3, 2) for name in ("shared", "first", "idle")})
    x = torch.arange(3.0) + rank  # a different shard of work per rank
    loss = layers["shared"](x).sum() + (layers["first"](x).sum() if rank == 0 else 0)
    loss.backward()
    all_reduce_gradients(layers, dist.group.WORLD)
    expected_shared = torch.stack([torch.arange(3.0) + r for r in range(world)]).sum(0) / world
    once_more = layers["shared"].weight.grad.clone()
    all_reduce_gradients(layers, dist.group.WORLD)  # idempotent: what makes DDP-then-this harmless
    return {
        "shared_ok": torch.equal(once_more, expected_shared.expand(2, 3)),
        "first_ok": torch.equal(layers["first"].weight.grad, (torch.arange(3.0) / world).expand(2, 3)),
        "idle_grad": layers["idle"].weight.grad,
        "idempotent": torch.equal(layers["shared"].weight.grad, once_more),
    }


def test_all_reduce_gradients_averages_and_keeps_unused_grads_none(rank_pool):
    for world in (2, 3):
        for r, result in enumerate(rank_pool(world).run(_touch_case)):
            assert result["shared_ok"], f"world {world} rank {r}: shared grad is not the mean over ranks"
            assert result["first_ok"], f"world {world} rank {r}: a grad from rank 0 only must reach all ranks"
            assert result["idle_grad"] is None, f"world {world} rank {r}: an unused parameter got a grad"
            assert result["idempotent"], f"world {world} rank {r}: averaging twice changed the gradient"


def _boundary_case() -> dict[str, object]:
    """Output boundary scales by N; input boundary averages; a pytree of inputs is wrapped leaf by leaf."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    x = torch.full((3,), 1.0 + rank, requires_grad=True)
    (grad_scaled_by_group(x, group) * 2).sum().backward()
    scaled = x.grad.clone()
    y = torch.full((3,), 0.0, requires_grad=True)
    (grad_averaged_over_group(y, group) * (1.0 + rank)).sum().backward()
    expected_mean = sum(1.0 + r for r in range(world)) / world
    z = torch.zeros(2, requires_grad=True)
    frozen = torch.ones(2)
    args, kwargs = average_input_gradients(((z, 3), {"extra": {"inner": [z]}, "frozen": frozen}), group)
    ((args[0] + kwargs["extra"]["inner"][0]) * (1.0 + rank)).sum().backward()
    with torch.no_grad():
        untouched = average_input_gradients(((z,), {}), group)[0][0] is z
    return {
        "scaled": torch.equal(scaled, torch.full((3,), 2.0 * world)),
        "averaged": torch.equal(y.grad, torch.full((3,), expected_mean)),
        "tree": torch.equal(z.grad, torch.full((2,), 2 * expected_mean)),
        "frozen_kept": kwargs["frozen"] is frozen and args[1] == 3,
        "no_grad_untouched": untouched,
    }


def test_gradient_boundaries(rank_pool):
    for world in (2, 3):
        for r, result in enumerate(rank_pool(world).run(_boundary_case)):
            assert all(result.values()), (world, r, result)


def test_boundaries_are_identities_without_a_group():
    x = torch.ones(2, requires_grad=True)
    assert grad_scaled_by_group(x, None) is x and grad_averaged_over_group(x, None) is x
    tree = ((x,), {"a": x})
    assert average_input_gradients(tree, None) is tree
