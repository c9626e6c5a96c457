"""The memory tracker: storages counted once, views free, frees tracked, pre-existing tensors ignored."""

from __future__ import annotations

import torch

from hfpatch.testing.memory import measure_peak, track_memory

KIB4 = 1024 * 4  # 1024 fp32 values


def test_views_and_inplace_ops_of_tracked_tensors_add_nothing():
    with track_memory() as mem:
        x = torch.ones(1024)
        y = x.view(32, 32).t()  # view: same storage
        y.mul_(2)  # in place: same storage
        z = x[:10]
    assert mem.peak_bytes == KIB4 and mem.live_bytes == KIB4
    del x, y, z


def test_views_of_preexisting_tensors_are_not_counted():
    weight = torch.ones(1024)
    with track_memory() as mem:
        v = weight.view(32, 32).t()
        weight.add_(1)
        out = v.sum()
    assert mem.peak_bytes == out.untyped_storage().nbytes()  # only the scalar result is new


def test_freed_tensors_leave_the_live_count_and_peak_is_the_maximum():
    with track_memory() as mem:
        a = torch.ones(2048)  # 8 KiB
        del a
        b = torch.ones(1024)  # 4 KiB
        c = torch.ones(1024)  # 4 KiB -> live 8 KiB again
        mem_after = mem.live_bytes
    assert mem.peak_bytes == 2 * KIB4 and mem_after == 2 * KIB4
    del b, c


def test_backward_allocations_are_tracked():
    layer = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(32, 64, requires_grad=True)
    _, peak_forward = measure_peak(lambda: layer(x))
    _, peak_step = measure_peak(lambda: layer(x).square().sum().backward())
    assert peak_forward == 32 * 64 * 4
    assert peak_step > peak_forward + 64 * 64 * 4  # the weight gradient at least
