"""USP / Ulysses / Ring attention vs one-process SDPA on the full sequence, forward and backward.

Every rank builds the same full q/k/v (and joint text tokens) from a seed, takes its shard with the shared
layout (`shard_sequence`, `sp_index`), runs `usp_attention`, and compares with
`F.scaled_dot_product_attention` on the full unpadded sequence (text concatenated front/back). The
objective is the sum of the ranks' losses (the documented convention): each rank weights its output shard
and the joint output with its own weights; the reference loss uses the summed weights. Sharded grads must
equal the reference shard; joint-input grads must equal the reference after an all-reduce SUM.

Tolerances (``hfpatch.testing.tolerance``): the only difference from the reference is the order of fp32
sums (block-wise softmax merge, gradient accumulation around the ring, the SUM over ranks). Outputs: within
``attention_tol`` of the full attention (the two-order bound of every sum over the keys and channels).
Gradients: within ``reassociation_tol`` of the fp32 reference gradient's own noise against the same
reference in fp64, relative to the gradient's scale; the all-reduced joint gradients add ``summation_tol``
of the world's partial sums.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfpatch.attention import ulysses_attention, usp_attention
from hfpatch.attention.layout import group_rank, shard_len, shard_sequence, sp_index
from hfpatch.core.config import ParallelConfig
from hfpatch.distributed.collectives import count_comm
from hfpatch.distributed.runtime import get_mesh
from hfpatch.testing.tolerance import (
    attention_tol,
    reassociation_tol,
    rel_error,
    rounding_noise,
    summation_tol,
)

# (ring, ulysses, seq, heads, text, joint_position[, masked]) per world size; batch 2, head dim 8. A masked
# case (batch 3) masks joint keys with ``joint_key_mask``: some keys of sample 0, every key of sample 1 (its
# queries attend to the sharded tokens only), none of sample 2.
CASES = {
    1: [(1, 1, 7, 2, 0, "front"), (1, 1, 5, 3, 3, "back"), (1, 1, 5, 3, 4, "front", True)],
    2: [
        (1, 2, 9, 3, 0, "front"),  # uneven sequence and heads
        (1, 2, 8, 4, 3, "front"),
        (2, 1, 9, 2, 3, "back"),
        (2, 1, 8, 3, 0, "front"),
        (1, 2, 9, 3, 3, "front", True),
        (2, 1, 9, 2, 4, "back", True),
    ],
    3: [
        (1, 3, 10, 4, 2, "front"),
        (3, 1, 10, 2, 2, "back"),
        (1, 3, 9, 3, 0, "front"),
        (3, 1, 10, 2, 3, "front", True),
    ],
    4: [
        (1, 4, 10, 6, 3, "front"),  # 6 heads over 4: [2, 2, 1, 1]
        (1, 4, 9, 3, 2, "back"),  # 3 heads over 4: one idle rank
        (4, 1, 10, 2, 3, "back"),
        (4, 1, 9, 2, 2, "front"),  # the last ring block is all padding
        (2, 2, 11, 3, 2, "front"),
        (2, 2, 8, 4, 0, "back"),
        (2, 2, 11, 3, 4, "front", True),
        (1, 4, 9, 3, 3, "back", True),  # with an idle Ulysses rank
    ],
}


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _groups(ring, ulysses):
    mesh = get_mesh(ParallelConfig(ring=ring, ulysses=ulysses))
    return mesh, mesh.group("ring"), mesh.group("ulysses")


def _reference(q, k, v, joint, position, joint_mask=None):
    """SDPA on the full sequence (joint keys masked by ``joint_mask``); returns (image_out, joint_out or None)."""
    if joint is None:
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        return out, None
    text = joint[0].shape[1]
    cat = [torch.cat([j, x] if position == "front" else [x, j], dim=1) for x, j in zip((q, k, v), joint)]
    mask = None
    if joint_mask is not None:
        image = torch.ones(q.shape[0], q.shape[1], dtype=torch.bool)
        mask = torch.cat([joint_mask, image] if position == "front" else [image, joint_mask], 1)[
            :, None, None
        ]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in cat), attn_mask=mask).transpose(1, 2)
    if position == "front":
        return out[:, text:], out[:, :text]
    return out[:, :-text], out[:, -text:]


def _joint_mask(batch, text):
    """Sample 0: every third key masked; sample 1: all masked; sample 2: none (the fast path per sample)."""
    rows = [[i % 3 != 1 for i in range(text)], [False] * text, [True] * text]
    return torch.tensor(rows[:batch])


def _case(ring, ulysses, seq, heads, text, position, masked=False, seed=0, dim=8):
    world = ring * ulysses
    batch = 3 if masked else 2
    joint_mask = _joint_mask(batch, text) if masked else None
    mesh, ring_group, ulysses_group = _groups(ring, ulysses)
    index = sp_index(group_rank(ring_group), group_rank(ulysses_group), ulysses)
    full = [_randn(batch, seq, heads, dim, seed=seed + i) for i in range(3)]
    joint = [_randn(batch, text, heads, dim, seed=seed + 3 + i) for i in range(3)] if text else None
    w_out = _randn(batch, seq, heads, dim, seed=seed + 6)
    w_joint = [_randn(batch, text, heads, dim, seed=seed + 10 + r) for r in range(world)] if text else None

    q, k, v = (shard_sequence(t, 1, world, index).detach().clone().requires_grad_(True) for t in full)
    jq, jk, jv = (t.clone().requires_grad_(True) for t in joint) if text else (None, None, None)
    out, joint_out = usp_attention(
        q, k, v, ulysses_group=ulysses_group, ring_group=ring_group,
        valid_len=seq if seq % world else None, joint_query=jq, joint_key=jk, joint_value=jv,
        joint_position=position, joint_key_mask=joint_mask,
    )  # fmt: skip
    loss = (out * shard_sequence(w_out, 1, world, index)).sum()
    if text:
        loss = loss + (joint_out * w_joint[index]).sum()
    loss.backward()

    def reference(dtype):
        ref_in = [t.detach().to(dtype).requires_grad_(True) for t in full]
        ref_joint = [t.detach().to(dtype).requires_grad_(True) for t in joint] if text else None
        ref_out, ref_joint_out = _reference(*ref_in, ref_joint, position, joint_mask)
        ref_loss = (ref_out * w_out.to(dtype)).sum()
        if text:
            ref_loss = ref_loss + (ref_joint_out * sum(w_joint).to(dtype)).sum()
        ref_loss.backward()
        return ref_out, ref_joint_out, ref_in, ref_joint

    ref_out, ref_joint_out, ref_in, ref_joint = reference(torch.float32)
    _, _, ref64_in, ref64_joint = reference(torch.float64)  # the fp32 reference gradients' rounding noise

    # Outputs: attention over all keys (text included) in another order; (error, tolerance) pairs.
    keys = [torch.cat([j, x], 1) for x, j in zip(full, joint)] if text else full
    out_tol, _ = attention_tol(*(t.transpose(1, 2) for t in keys))
    real = max(0, min(shard_len(seq, world), seq - index * shard_len(seq, world)))  # non-padding rows here
    errors = {
        "out": (
            (out[:, :real] - shard_sequence(ref_out, 1, world, index)[:, :real]).abs().max().item(),
            out_tol,
        )
        if real
        else (0.0, out_tol),
        "out_finite": bool(out.isfinite().all()),
        "sp_rank_matches_layout": mesh.group("sp") is None or dist.get_rank(mesh.group("sp")) == index,
    }

    # Gradient errors relative to the full gradient tensor's scale; the noise is the worst of the three
    # q/k/v (or joint) reference gradients' (as vae_helpers.gradient_error), a steadier statistic than one
    # tensor's.
    def noise(refs, refs64):
        return max(
            rounding_noise(r.grad, r64.grad, r.grad.abs().max().item()) for r, r64 in zip(refs, refs64)
        )

    tol = reassociation_tol(noise(ref_in, ref64_in))
    for name, mine, ref in zip("qkv", (q, k, v), ref_in):
        scale = ref.grad.abs().max().item()
        errors[f"d{name}"] = (rel_error(mine.grad, shard_sequence(ref.grad, 1, world, index), scale), tol)
    if text:
        errors["joint_out"] = ((joint_out - ref_joint_out).abs().max().item(), out_tol)
        tol = reassociation_tol(noise(ref_joint, ref64_joint))
        for name, mine, ref in zip(("djq", "djk", "djv"), (jq, jk, jv), ref_joint):
            grad, magnitude = mine.grad.clone(), mine.grad.abs()
            if world > 1:
                dist.all_reduce(grad)  # the documented convention: SUM over the sp group
                dist.all_reduce(magnitude)  # sum of |partial|: the scale of that sum's rounding
            scale = ref.grad.abs().max().item()
            extra = summation_tol(world) * magnitude.max().item() / scale
            errors[name] = (rel_error(grad, ref.grad, scale), tol + extra)
    return errors, (None if joint_out is None else joint_out.detach())


def _all_cases(world):
    results = [_case(*case, seed=10 * i) for i, case in enumerate(CASES[world])]
    _, _, ulysses_group = _groups(1, world)
    q, k, v = (_randn(1, 4, 2 * world, 8, seed=i) for i in range(3))
    # Exact: usp_attention without a ring group must run the very same Ulysses computation.
    same = torch.equal(
        ulysses_attention(q, k, v, group=ulysses_group)[0],
        usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=None)[0],
    )
    return results, same


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_usp_attention_matches_sdpa_forward_and_backward(rank_pool, world_size):
    per_rank = rank_pool(world_size).run(_all_cases, world_size)
    assert all(same for _, same in per_rank), (
        "ulysses_attention differs from usp_attention with ring_group=None"
    )
    per_rank = [results for results, _ in per_rank]
    for i, case in enumerate(CASES[world_size]):
        joint_outs = []
        for rank in range(world_size):
            errors, joint_out = per_rank[rank][i]
            assert errors.pop("out_finite"), f"case {case}, rank {rank}: non-finite output (padded rows?)"
            assert errors.pop("sp_rank_matches_layout"), f"case {case}, rank {rank}: sp group order != layout"
            for name, (err, tol) in errors.items():
                assert err <= tol, (
                    f"case (ring, ulysses, seq, heads, text, pos)={case}, rank {rank}: {name} err {err} > {tol}"
                )
            joint_outs.append(joint_out)
        # Replicated text stream: every rank must continue identically. Exact: every rank merges the same
        # blocks, computed by the same kernels on the same values, in the same canonical order (ring.py).
        if joint_outs[0] is not None:
            assert all(torch.equal(j, joint_outs[0]) for j in joint_outs), (
                f"case {case}: joint_out differs by rank"
            )


# ------------------------------------------------------------------------------------------ communication
COMM_CASES = {2: [(1, 2), (2, 1)], 3: [(1, 3), (3, 1)], 4: [(1, 4), (4, 1), (2, 2)]}


def _comm_case(ring, ulysses, text, batch=1, local=8, heads=12, dim=8):
    """Bytes this rank sent in forward and backward, with the analytic minimum of each (fp32 = 4 bytes)."""
    _, ring_group, ulysses_group = _groups(ring, ulysses)
    # Explicit generators: the rank processes live for the whole session, their global RNG is not ours.
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())  # per-rank shards
    q, k, v = (torch.randn(batch, local, heads, dim, generator=gen).requires_grad_() for _ in range(3))
    gen = torch.Generator().manual_seed(0)  # the joint tensors are replicated: same values on every rank
    joint = (
        [torch.randn(batch, text, heads, dim, generator=gen).requires_grad_() for _ in range(3)]
        if text
        else [None] * 3
    )
    with count_comm() as fwd:
        out, joint_out = usp_attention(
            q, k, v, ulysses_group=ulysses_group, ring_group=ring_group,
            joint_query=joint[0], joint_key=joint[1], joint_value=joint[2],
        )  # fmt: skip
    loss = out.sum() + (joint_out.sum() if text else 0)
    with count_comm() as bwd:
        loss.backward()
    shard = q.numel() * 4  # bytes of one local [B, S_local, H, D] tensor; a ring block has the same size
    joint_heads = batch * text * (heads // ulysses) * dim * 4
    a2a = 4 * (ulysses - 1) * shard // ulysses  # q, k, v in; out back (backward: their grads)
    analytic_fwd = {
        "all_to_all": a2a,
        "ring": (ring - 1) * 2 * shard,
        "all_gather": (ulysses - 1) * joint_heads,
    }
    # Backward: K/V go round again (r - 1 hops) and the dK/dV accumulators make r hops home (none if r = 1).
    ring_bwd = (2 * ring - 1) * 2 * shard if ring > 1 else 0
    analytic_bwd = {
        "all_to_all": a2a,
        "ring": ring_bwd,
        "reduce_scatter": (ulysses - 1) * joint_heads,
    }
    drop_zero = lambda d: {key: val for key, val in d.items() if val}  # noqa: E731
    # Communication pattern: one P2P round per ring hop (forward r-1; backward r-1 K/V + r dK/dV).
    hops = (fwd.calls.get("ring", 0), bwd.calls.get("ring", 0))
    expected_hops = (ring - 1, 2 * ring - 1 if ring > 1 else 0)
    return (
        drop_zero(fwd.by_op), drop_zero(analytic_fwd), drop_zero(bwd.by_op), drop_zero(analytic_bwd),
        hops, expected_hops,
    )  # fmt: skip


def _comm_cases(world):
    return [_comm_case(r, u, text) for r, u in COMM_CASES[world] for text in (0, 3)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_usp_attention_bytes_sent_equal_analytic_minimum(rank_pool, world_size):
    per_rank = rank_pool(world_size).run(_comm_cases, world_size)
    cases = [(r, u, text) for r, u in COMM_CASES[world_size] for text in (0, 3)]
    for rank, results in enumerate(per_rank):
        for case, (fwd, analytic_fwd, bwd, analytic_bwd, hops, expected_hops) in zip(cases, results):
            # Every byte is payload: the counts equal the analytic minimum exactly (well within 5%).
            assert fwd == analytic_fwd, (
                f"(ring, ulysses, text)={case}, rank {rank}: forward {fwd} vs {analytic_fwd}"
            )
            assert bwd == analytic_bwd, (
                f"(ring, ulysses, text)={case}, rank {rank}: backward {bwd} vs {analytic_bwd}"
            )
            assert hops == expected_hops, f"(ring, ulysses, text)={case}, rank {rank}: ring hops {hops}"


# ------------------------------------------------------------------------------------------ errors
ERROR_CASES = {
    "shape": (dict(key=torch.zeros(1, 5, 2, 8)), "same [B, S_local, H, D] shape"),
    "joint_partial": (
        dict(joint_query=torch.zeros(1, 3, 2, 8)),
        "all of joint_query, joint_key, joint_value",
    ),
    "joint_heads": (
        dict(
            joint_query=torch.zeros(1, 3, 1, 8),
            joint_key=torch.zeros(1, 3, 1, 8),
            joint_value=torch.zeros(1, 3, 1, 8),
        ),
        "joint_query must be [B=1, S_txt >= 1, H=2, D=8]",
    ),
    "position": (dict(joint_position="middle"), "joint_position must be 'front' or 'back'"),
    "valid_len": (dict(valid_len=9), "valid_len must be an int in [1, 8]"),
    "rank3": (dict(query=torch.zeros(4, 2, 8)), "query must be a [B, S_local, H, D] tensor"),
    "mask_without_joint": (
        dict(joint_key_mask=torch.ones(1, 3, dtype=torch.bool)),
        "joint_key_mask masks joint keys; pass joint_query/key/value too",
    ),
    "mask_float": (
        dict(
            joint_query=torch.zeros(1, 3, 2, 8),
            joint_key=torch.zeros(1, 3, 2, 8),
            joint_value=torch.zeros(1, 3, 2, 8),
            joint_key_mask=torch.zeros(1, 3),
        ),
        "joint_key_mask must be a bool [B=1 or 1, S_txt=3] tensor",
    ),
}


def _error_cases(world):
    """Each bad call must raise the same ValueError on every rank before any collective (or it would hang)."""
    _, ring_group, ulysses_group = _groups(1, world)
    messages = {}
    for name, (overrides, _) in ERROR_CASES.items():
        args = dict(query=torch.zeros(1, 4, 2, 8), key=torch.zeros(1, 4, 2, 8), value=torch.zeros(1, 4, 2, 8))
        args.update(overrides)
        try:
            usp_attention(**args, ulysses_group=ulysses_group, ring_group=ring_group)
        except ValueError as exc:
            messages[name] = str(exc)
        else:
            messages[name] = "no error"
    return messages


def test_usp_attention_bad_inputs_raise_before_communication(rank_pool):
    per_rank = rank_pool(2).run(_error_cases, 2)
    for rank, messages in enumerate(per_rank):
        for name, (_, expected) in ERROR_CASES.items():
            assert expected in messages[name], f"rank {rank}, case {name}: {messages[name]!r}"
