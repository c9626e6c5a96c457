"""The same-input guard's description of a call (``hfpatch.distributed.agreement``), on one process.

Two calls get equal tables exactly when their arguments are equal bit for bit: the content digests must see
any single flipped bit anywhere, a permutation and a tiny scale, on both digest paths (BLAKE2b of the bytes for
CPU tensors; the weighted word sum that accelerator tensors use, forced here on CPU).
"""

from __future__ import annotations

import pytest
import torch

from hfpatch.distributed.agreement import SLOTS, content_digest, describe_inputs


def _x(n: int = 1000, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8])
def test_digest_sees_every_single_bit(on_device, dtype):
    x = _x(257, dtype) if dtype != torch.uint8 else torch.arange(257, dtype=torch.uint8)
    base = content_digest(x, on_device=on_device)
    assert content_digest(x.clone(), on_device=on_device) == base
    raw = x.view(torch.uint8)
    for byte in range(raw.numel()):  # every bit of every element
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            assert content_digest(flipped.view(dtype), on_device=on_device) != base, (byte, bit)


@pytest.mark.parametrize("on_device", [False, True])
def test_digest_sees_permutations_and_tiny_scales(on_device):
    x = _x(70_000)  # more than one device chunk
    base = content_digest(x, on_device=on_device)
    swapped = x.clone()
    swapped[[3, 69_999]] = swapped[[69_999, 3]]
    assert content_digest(swapped, on_device=on_device) != base
    assert content_digest(x.flip(0), on_device=on_device) != base
    assert content_digest(x * (1 + 1e-6), on_device=on_device) != base
    assert content_digest(x.reshape(700, 100).t(), on_device=on_device) != base  # values in another order
    expanded = torch.tensor(5.0).expand(3)
    assert content_digest(expanded, on_device=on_device) == content_digest(
        torch.full((3,), 5.0), on_device=on_device
    )


def test_table_compares_names_kinds_shapes_values_and_nested_arguments():
    x = _x().reshape(10, 100)
    call = dict(x=x, t=torch.tensor([500]), scale=5.0, mode="a", extra={"k": [x[:2], None]}, gen=None)
    base = describe_inputs(call)
    assert base.shape[0] == SLOTS and torch.equal(describe_inputs({**call, "x": x.clone()}), base)
    variants = {
        "bit": {
            **call,
            "x": (x.view(-1).view(torch.int32) ^ (torch.arange(1000) == 999))
            .view(torch.float32)
            .view(10, 100),
        },
        "shape": {**call, "x": x.reshape(100, 10)},
        "dtype": {**call, "x": x.double()},
        "grad": {**call, "x": x.clone().requires_grad_(True)},
        "timestep": {**call, "t": torch.tensor([501])},
        "float": {**call, "scale": 5.0 + 1e-12},
        "int vs float": {**call, "scale": 5},
        "string": {**call, "mode": "b"},
        "nested": {**call, "extra": {"k": [x[:2] * 2, None]}},
        "missing": {k: v for k, v in call.items() if k != "mode"},
        "generator": {**call, "gen": torch.Generator().manual_seed(1)},
    }
    for name, variant in variants.items():
        assert not torch.equal(describe_inputs(variant), base), name
    seeded = {**call, "gen": torch.Generator().manual_seed(1)}
    assert torch.equal(
        describe_inputs(seeded), describe_inputs({**call, "gen": torch.Generator().manual_seed(1)})
    )
    nan = torch.tensor([float("nan"), 1.0])
    assert torch.equal(describe_inputs({"v": nan}), describe_inputs({"v": nan.clone()}))  # same bits agree
