"""The Ulysses exchange (:mod:`hfpatch.attention.exchange`): exact where it was, the fewest copies, overlap, FP8.

One ``pool.run`` per world size runs every case: Ulysses ``u`` = world (ring 1) with uneven heads at 3 and 4
(6 heads over 4: ``[2, 2, 1, 1]``), batch 2, padded sequences, replicated text in front and at the back, and USP
2 x 2 at world 4. Every rank builds the same full q/k/v from seeds and takes its shard (the shared layout).

* **Default path, bit-exact**: at a ring degree of 1 each rank's kernel sees the stock call for its heads, so its
  output equals ``F.scaled_dot_product_attention`` on the full sequence *exactly* (``torch.equal``), text included.
* **Copies**: bytes written by copying ops in one attention call (``count_copies``) equal
  :func:`~hfpatch.attention.exchange.copy_minimum` exactly (no tolerance: both count whole tensors).
* **Overlap** (``ExchangeConfig(overlap=True, chunks=2)``): forward and every gradient equal the default path
  bit for bit (the same elements through the same kernels, per chunk of heads).
* **FP8**: the output equals attention over the values as the receivers see them (each travelling piece rounded to
  e4m3 with its own per-sample-and-head scale ``amax / 448``, this rank's own pieces exact, the text output rounded
  for every rank) within ``attention_tol``; bytes sent equal the FP8 analytic count exactly, half of bf16's plus
  the scales; refused under training unless ``training=True``, which then backpropagates (exact exchange of the
  gradients).
* **Async and projected**: :func:`start_sequence_to_heads` then ``wait()`` equals ``sequence_to_heads`` (forward and
  backward, exactly); :func:`project_heads_to_sequence` with 1 and 2 head chunks equals ``heads_to_sequence``
  followed by the projection within ``summation_tol`` of the products' magnitudes (a sum over head chunks), and
  so do the gradients (the output's difference through ``W`` plus a reassociation of ``C_out`` terms).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfpatch.attention import usp_attention
from hfpatch.attention.exchange import (
    ExchangeConfig,
    copy_minimum,
    project_heads_to_sequence,
    start_sequence_to_heads,
)
from hfpatch.attention.layout import group_rank, head_sizes, shard_len, shard_sequence, sp_index, valid_prefix
from hfpatch.attention.ulysses import heads_to_sequence, sequence_to_heads
from hfpatch.core.config import ParallelConfig
from hfpatch.distributed.collectives import count_comm
from hfpatch.distributed.runtime import get_mesh
from hfpatch.testing.memory import count_copies
from hfpatch.testing.tolerance import attention_tol, rel_error, summation_tol

# (ring, ulysses, batch, seq, heads, text, position) per world size; head dim 8.
CASES = {
    2: [(1, 2, 2, 9, 4, 3, "front"), (1, 2, 1, 8, 3, 0, "front"), (1, 2, 2, 9, 4, 2, "back")],
    3: [(1, 3, 2, 10, 4, 3, "front"), (1, 3, 1, 9, 5, 2, "back")],
    4: [(1, 4, 2, 10, 6, 3, "back"), (1, 4, 1, 9, 4, 0, "front"), (2, 2, 2, 11, 3, 2, "front")],
}
OVERLAP = ExchangeConfig(overlap=True, chunks=2)
FP8 = ExchangeConfig(dtype=torch.float8_e4m3fn)
DIM = 8


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` ([B, S, H, D]) as an FP8 receiver sees it: e4m3 of ``x / s``, times ``s = amax / 448`` per sample and head."""
    amax = x.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x / s).to(torch.float8_e4m3fn).float() * s


def _reference(q, k, v, joint, position, rounded=None):
    """SDPA on the full sequence, text joined at ``position``; ``(image out, text out or None)``."""
    if joint is not None:
        q, k, v = (torch.cat([j, x] if position == "front" else [x, j], 1) for x, j in zip((q, k, v), joint))
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    if joint is None:
        return out, None
    text = joint[0].shape[1]
    return (out[:, text:], out[:, :text]) if position == "front" else (out[:, :-text], out[:, -text:])


def _fp8_reference(full, joint, position, seq, world, me, heads):
    """What the FP8 exchange computes on rank ``me`` (ring 1): every (shard, head group) piece of q/k/v that travels
    rounded with its own scales, attention, then the output pieces that travel (and all text heads) rounded."""
    local, sizes = shard_len(seq, world), head_sizes(heads, world)
    starts = [sum(sizes[:j]) for j in range(world)]
    rounded = []
    for x in full:
        y = x.clone()
        for i in range(world):  # shard i's rows of rank j's heads travel from i to j unless i == j
            rows = slice(i * local, min((i + 1) * local, seq))
            for j in range(world):
                if j != i and sizes[j] and rows.stop > rows.start:
                    y[:, rows, starts[j] : starts[j] + sizes[j]] = _fp8(
                        x[:, rows, starts[j] : starts[j] + sizes[j]]
                    )
        rounded.append(y)
    out, text_out = _reference(*rounded, joint, position)
    rows = slice(me * local, min((me + 1) * local, seq))
    mine = out[:, rows].clone()
    for j in range(world):  # rank j's heads of my rows come from j
        if j != me and sizes[j] and mine.shape[1]:
            mine[:, :, starts[j] : starts[j] + sizes[j]] = _fp8(
                out[:, rows, starts[j] : starts[j] + sizes[j]]
            )
    if text_out is not None:  # the text heads: rounded for every rank, their owner included
        text_out = torch.cat(
            [_fp8(text_out[:, :, starts[j] : starts[j] + sizes[j]]) for j in range(world) if sizes[j]], 2
        )
    return mine, text_out


def _run(q, k, v, joint, groups, position, valid, exchange=None):
    ring_group, ulysses_group = groups
    jq, jk, jv = joint if joint is not None else (None, None, None)
    return usp_attention(
        q, k, v, ulysses_group=ulysses_group, ring_group=ring_group, valid_len=valid, joint_query=jq,
        joint_key=jk, joint_value=jv, joint_position=position, exchange=exchange,
    )  # fmt: skip


def _case(ring, ulysses, batch, seq, heads, text, position, seed):
    world = ring * ulysses
    mesh = get_mesh(ParallelConfig(ring=ring, ulysses=ulysses))
    groups = (mesh.group("ring"), mesh.group("ulysses"))
    index = sp_index(group_rank(groups[0]), group_rank(groups[1]), ulysses)
    full = [_randn(batch, seq, heads, DIM, seed=seed + i) for i in range(3)]
    joint = [_randn(batch, text, heads, DIM, seed=seed + 3 + i) for i in range(3)] if text else None
    valid = seq if seq % world else None
    local = shard_len(seq, world)
    real = valid_prefix(index * local, local, seq)
    weights = (
        _randn(batch, local, heads, DIM, seed=seed + 7),
        _randn(batch, max(text, 1), heads, DIM, seed=seed + 8),
    )
    result = {}

    def leaves():
        shards = [shard_sequence(t, 1, world, index).clone().requires_grad_() for t in full]
        texts = [t.clone().requires_grad_() for t in joint] if text else None
        return shards, texts

    def step(exchange):
        shards, texts = leaves()
        out, text_out = _run(*shards, texts, groups, position, valid, exchange)
        loss = (out * weights[0]).sum() + ((text_out * weights[1]).sum() if text else 0)
        loss.backward()
        grads = [t.grad for t in shards] + ([t.grad for t in texts] if text else [])
        return out.detach(), None if text_out is None else text_out.detach(), grads

    out, text_out, grads = step(None)
    ref, ref_text = _reference(*full, joint, position)
    ref = shard_sequence(ref, 1, world, index)
    if ring == 1:  # bit-exact: each rank's kernel sees the stock call for its heads
        result["exact"] = torch.equal(out[:, :real], ref[:, :real]) and (
            text_out is None or torch.equal(text_out, ref_text)
        )
        shards = [shard_sequence(t, 1, world, index) for t in full]
        with torch.no_grad(), count_copies() as copies:
            _run(*shards, joint, groups, position, valid)
        me_heads = head_sizes(heads, ulysses)[group_rank(groups[1])]
        result["copies"] = (copies.bytes_copied, copy_minimum(batch, real, heads, me_heads, DIM, text, 4))
    else:  # Ring merges blocks: reassociation only
        tol, _ = attention_tol(*(t.transpose(1, 2) for t in full))
        result["ring"] = ((out[:, :real] - ref[:, :real]).abs().max().item(), tol)

    out_o, text_o, grads_o = step(OVERLAP)
    result["overlap"] = torch.equal(out_o, out) and all(torch.equal(a, b) for a, b in zip(grads_o, grads))
    if text:
        result["overlap"] &= torch.equal(text_o, text_out)
    result["fp8"] = _fp8_checks(full, joint, groups, position, valid, index, world, heads, real, ring, seq)
    return result


def _fp8_checks(full, joint, groups, position, valid, index, world, heads, real, ring, seq):
    """FP8 forward vs its emulation (ring 1), bytes vs bf16 and the analytic count, the training refusal."""
    checks = {}
    shards = [shard_sequence(t, 1, world, index) for t in full]
    with torch.no_grad(), count_comm() as comm:
        out, text_out = _run(*shards, joint, groups, position, valid, FP8)
    if ring == 1:
        ref, ref_text = _fp8_reference(full, joint, position, seq, world, index, heads)
        keys = [torch.cat([j, x], 1) for x, j in zip(full, joint)] if joint is not None else full
        tol, _ = attention_tol(*(t.transpose(1, 2) for t in keys))
        errors = [(out[:, :real] - ref[:, :real]).abs().max().item() if real else 0.0]
        if joint is not None:
            errors.append((text_out - ref_text).abs().max().item())
        checks["emulated"] = (max(errors), tol)
        exact, _ = _run(*shards, joint, groups, position, valid)
        checks["error_vs_exact"] = rel_error(out[:, :real], exact[:, :real]) if real else 0.0
    with torch.no_grad(), count_comm() as exact_comm:
        _run(*(t.bfloat16() for t in shards), None if joint is None else [t.bfloat16() for t in joint], groups,
             position, valid)  # fmt: skip
    with torch.no_grad(), count_comm() as bf16_fp8:
        _run(*(t.bfloat16() for t in shards), None if joint is None else [t.bfloat16() for t in joint], groups,
             position, valid, FP8)  # fmt: skip
    ulysses = ("all_to_all", "all_gather")  # Ring's K/V passes stay exact
    checks["bytes"] = tuple(
        {op: n for op, n in c.by_op.items() if op in ulysses} for c in (comm, bf16_fp8, exact_comm)
    )
    leaves = [t.clone().requires_grad_() for t in shards]
    try:
        _run(*leaves, joint, groups, position, valid, FP8)
        checks["refused"] = "no error"
    except ValueError as exc:
        checks["refused"] = str(exc)
    out, _ = _run(
        *leaves, joint, groups, position, valid, ExchangeConfig(dtype=torch.float8_e4m3fn, training=True)
    )
    out.sum().backward()
    checks["trains"] = all(t.grad is not None and bool(t.grad.isfinite().all()) for t in leaves)
    return checks


def _fp8_bytes(ring, ulysses, batch, seq, heads, text, rank):
    """Analytic bytes one rank sends with FP8 on the wire: ``(payload, scales)`` per op, 1 byte per element and
    a float32 scale per sample and head of every message."""
    world = ring * ulysses
    local = shard_len(seq, world)
    me = rank % ulysses  # ulysses innermost
    block = (rank // ulysses) * ulysses
    sizes = head_sizes(heads, ulysses)
    real = [valid_prefix((block + i) * local, local, seq) for i in range(ulysses)]
    payload = {"all_to_all": 0, "all_gather": 0}
    scales = {"all_to_all": 0, "all_gather": 0}
    for j in range(ulysses):
        if j == me:
            continue
        if real[me] and sizes[j]:  # q, k, v: my rows of j's heads
            payload["all_to_all"] += 3 * batch * real[me] * sizes[j] * DIM
            scales["all_to_all"] += 3 * 4 * batch * sizes[j]
        if real[j] and sizes[me]:  # the output: j's rows of my heads
            payload["all_to_all"] += batch * real[j] * sizes[me] * DIM
            scales["all_to_all"] += 4 * batch * sizes[me]
        if text and sizes[me]:  # my text output heads to every rank
            payload["all_gather"] += batch * text * sizes[me] * DIM
            scales["all_gather"] += 4 * batch * sizes[me]
    keep = [op for op in payload if payload[op]]
    return {op: payload[op] for op in keep}, {op: scales[op] for op in keep}


def _async_and_projected(world):
    """start/wait vs sequence_to_heads, and the projected output exchange vs heads_to_sequence + matmul."""
    mesh = get_mesh(ParallelConfig(ulysses=world))
    group = mesh.group("ulysses")
    heads, local = world + 1, 3  # uneven heads
    x = _randn(2, local, heads, DIM, seed=dist.get_rank()).requires_grad_()
    w_loss = _randn(2, world * local, head_sizes(heads, world)[dist.get_rank()], DIM, seed=40)
    pending = start_sequence_to_heads(x, group, heads)
    busy = torch.randn(64, 64) @ torch.randn(64, 64)  # computed while the exchange travels
    got = pending.wait()
    (got * w_loss).sum().backward()
    grad = x.grad
    x2 = x.detach().clone().requires_grad_()
    want = sequence_to_heads(x2, group, heads)
    (want * w_loss).sum().backward()
    result = {"async": torch.equal(got, want) and torch.equal(grad, x2.grad) and busy.shape == (64, 64)}
    y = _randn(2, world * local, head_sizes(heads, world)[dist.get_rank()], DIM, seed=50 + dist.get_rank())
    weight, bias = _randn(5, heads * DIM, seed=60), _randn(5, seed=61)
    for chunks in (1, 2):
        y1 = y.clone().requires_grad_()
        out = project_heads_to_sequence(y1, group, heads, weight, bias, chunks=chunks)
        out.square().sum().backward()
        y2 = y.clone().requires_grad_()
        gathered = heads_to_sequence(y2, group, heads)
        ref = gathered.flatten(2) @ weight.T + bias
        ref.square().sum().backward()
        # Every output sums H * D products and the bias, in another order: bounded by their magnitudes.
        magnitude = gathered.detach().abs().flatten(2) @ weight.abs().T + bias.abs()
        out_err = (out - ref).abs().max().item()
        out_tol = summation_tol(heads * DIM + 1) * magnitude.max().item()
        # dy = 2 out W: the outputs' difference through |W|, plus C_out products summed in another order.
        grad_tol = (
            2 * out_tol * weight.abs().sum(0).max().item()
            + summation_tol(5) * (2 * ref.detach().abs() @ weight.abs()).max().item()
        )
        grad_err = (
            (heads_to_sequence(y1.grad, group, heads) - heads_to_sequence(y2.grad, group, heads)).abs().max()
        )
        result[f"projected{chunks}"] = ((out_err, out_tol), (grad_err.item(), grad_tol))
    return result


def _all(world):
    return [_case(*case, seed=10 * i) for i, case in enumerate(CASES[world])], _async_and_projected(world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchange_exact_fewest_copies_overlap_fp8_async_projected(rank_pool, world):
    per_rank = rank_pool(world).run(_all, world)
    for rank, (results, extra) in enumerate(per_rank):
        for case, r in zip(CASES[world], results):
            where = f"(ring, ulysses, batch, seq, heads, text, position)={case}, rank {rank}"
            if "exact" in r:
                assert r["exact"], f"{where}: the default path is no longer bit-exact"
                assert r["copies"][0] == r["copies"][1], (
                    f"{where}: copied {r['copies']} (bytes, analytic minimum)"
                )
            else:
                assert r["ring"][0] <= r["ring"][1], (where, r["ring"])
            assert r["overlap"], f"{where}: the overlapped exchange differs from the blocking one"
            fp8 = r["fp8"]
            if "emulated" in fp8:
                assert fp8["emulated"][0] <= fp8["emulated"][1], (where, fp8["emulated"])
            fp8_fp32, fp8_bf16, exact_bf16 = fp8["bytes"]
            payload, scales = _fp8_bytes(*case[:-1], rank)
            # The payload is exactly half of bf16's (one byte per element); the scales come on top.
            assert {op: 2 * n for op, n in payload.items()} == exact_bf16, (where, fp8["bytes"], payload)
            assert fp8_fp32 == fp8_bf16 == {op: payload[op] + scales[op] for op in payload}, (
                where,
                fp8["bytes"],
            )
            assert "refused while autograd records" in fp8["refused"], (where, fp8["refused"])
            assert fp8["trains"], where
        assert extra["async"], f"rank {rank}: start/wait differs from sequence_to_heads"
        for chunks in (1, 2):
            (err, tol), (grad_err, grad_tol) = extra[f"projected{chunks}"]
            assert err <= tol and grad_err <= grad_tol, (rank, chunks, err, tol, grad_err, grad_tol)
