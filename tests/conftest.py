"""Shared fixtures: one pool of gloo ranks per world size for the whole session (spawning costs seconds)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch

from hfpatch.testing.runner import RankPool

#: World sizes whose pools live for the whole session (many modules use them).
SHARED_WORLDS = 4


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models on a 2-core machine that also hosts the rank processes: one intra-op thread is fastest.

    Set again before every test: a library may change it (accelerate's ``PartialState`` on CPU sets all
    physical cores when ``OMP_NUM_THREADS`` is unset), and references computed here must sum in the same order
    as the pool ranks, which :class:`RankPool` keeps at one thread too.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def rank_pool():
    """``rank_pool(n)`` -> a live :class:`RankPool` of ``n`` ranks, shared by every test in the session (a pool of
    more than :data:`SHARED_WORLDS` ranks by the tests of one module).

    Run many cases in one ``pool.run`` call where you can: each call is a round trip through all ranks.
    """
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size, timeout_s=300)
        return pools[world_size]

    get.pools = pools
    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module", autouse=True)
def _close_large_pools(rank_pool):
    """Close a pool of more than :data:`SHARED_WORLDS` ranks with the module that asked for it: one module uses
    it, and its idle ranks would go on waking (gloo polls every group's sockets every 10 ms) for the rest of
    the session."""
    yield
    pools = rank_pool.pools
    for world in [w for w in pools if w > SHARED_WORLDS]:
        pools.pop(world).close()


@pytest.fixture(scope="module")
def background(request):
    """``background(test_name, fn, *args, **kwargs)`` -> a future of ``fn(*args, **kwargs)`` started now in a thread
    when the test ``test_name`` of this module is selected (``None`` otherwise).

    For a test whose work is mostly waiting (out a timeout on ranks of its own, or on one process importing on
    one core): a module-scoped fixture starts it early, so other work uses the idle cores meanwhile.
    """
    selected = {
        item.name for item in request.session.items if getattr(item, "module", None) is request.module
    }
    with ThreadPoolExecutor(max_workers=2) as pool:

        def start(test_name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future | None:
            return pool.submit(fn, *args, **kwargs) if test_name in selected else None

        yield start
