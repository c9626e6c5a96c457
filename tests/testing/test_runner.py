"""The rank runner: results by rank, remote errors reported with their rank, no hang on failure."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from hfpatch.testing.runner import RankError, RankPool, run_ranks, spread


def _rank_and_sum():
    # Ranks are small integers: fp32 sums them exactly in any order, so callers compare with ==.
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 waits for rank 1 forever: the runner must not
    return "unreachable"


def test_run_ranks_returns_results_ordered_by_rank():
    assert run_ranks(3, _rank_and_sum) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_failing_rank_is_reported_and_others_do_not_hang():
    pool = RankPool(2, timeout_s=60)
    try:
        assert [r for r, _ in pool.run(_rank_and_sum)] == [0, 1]
        start = time.monotonic()
        with pytest.raises(RankError) as info:
            pool.run(_fail_on_rank_one)
        # Waiting for the blocked rank would last the pool's 60 s timeout (and raise TimeoutError, not RankError).
        assert time.monotonic() - start < pool.timeout_s, "runner waited for the blocked rank"
        assert 1 in info.value.failures
        assert "deliberate failure on rank 1" in info.value.failures[1]
        # The pool restarts cleanly after a failure.
        assert pool.run(_rank_and_sum) == [(0, 1.0), (1, 1.0)]
    finally:
        pool.close()


def _set_threads(n: int) -> int:
    torch.set_num_threads(n)
    return torch.get_num_threads()


def _threads_under_accelerate() -> tuple[int, str | None]:
    from accelerate.state import PartialState

    PartialState._reset_state()
    try:
        PartialState(cpu=True)  # on CPU, with OMP_NUM_THREADS unset: torch.set_num_threads(all cores)
        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    finally:
        PartialState._reset_state()


def test_pool_ranks_keep_their_thread_count(rank_pool):
    # A rank left with more threads than the pool's made a later test's bit-exact comparison with the test
    # process fail by one ulp (Mochi's tiled decode at 2 threads), and oversubscribed the cores.
    pool = rank_pool(2)
    assert pool.run(_threads_under_accelerate) == [(1, "1"), (1, "1")]
    assert pool.run(_set_threads, 2) == [2, 2]
    assert pool.run(torch.get_num_threads) == [1, 1]  # reset before every call


def _environment_and_preloaded(name: str) -> tuple[str | None, bool]:
    import sys

    return os.environ.get(name), "diffusers" in sys.modules


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_and_forkserver_ranks_start_preloaded(start_method, monkeypatch):
    # A forkserver's children inherit the server's environment, frozen when the first pool started it: the
    # ranks must see the caller's (as spawned ones do), or a variable set since would silently not reach them.
    monkeypatch.setenv("HFPATCH_RUNNER_PROBE", start_method)
    with RankPool(2, start_method=start_method) as pool:
        preloaded = start_method == "forkserver"  # spawned ranks import only what the task needs
        assert pool.run(_environment_and_preloaded, "HFPATCH_RUNNER_PROBE") == [(start_method, preloaded)] * 2


def test_start_method_is_checked():
    with pytest.raises(ValueError, match="start_method"):
        RankPool(2, start_method="fork")


def test_ranks_are_spawned_where_cuda_is_available(monkeypatch):
    """A fork of the forkserver cannot use CUDA once its preload queried it (seen on an H200: "Cannot
    re-initialize CUDA in forked subprocess"), so where CUDA exists the default is spawn."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert RankPool(2).start_method == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert RankPool(2).start_method == "forkserver"


def _spread_keys() -> tuple[dict, list]:
    computed = []

    def compute(key: str) -> tuple[int, torch.Tensor]:
        computed.append(key)
        return dist.get_rank(), torch.full((2,), float(len(key)))

    return spread(["a", "bb", "a", "ccc", "dddd"], compute), computed


def test_spread_computes_each_key_once_on_one_rank_and_shares_it(rank_pool):
    results = rank_pool(3).run(_spread_keys)
    shared = [values for values, _ in results]
    computed = sorted(key for _, keys in results for key in keys)
    assert computed == ["a", "bb", "ccc", "dddd"]  # once each, the duplicate dropped
    for values in shared:
        assert list(values) == ["a", "bb", "ccc", "dddd"]
        assert {key: rank for key, (rank, _) in values.items()} == {"a": 0, "bb": 1, "ccc": 2, "dddd": 0}
        assert all(torch.equal(t, torch.full((2,), float(len(k)))) for k, (_, t) in values.items())
