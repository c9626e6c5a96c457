"""``hfpatch.apply(transformer, parallel=..., compile=True)``: the sequence-parallel Wan forward and backward as
one compiled graph, at world 2, Ulysses and Ring.

The splits, the routed stock attention, the Ulysses all-to-alls, Ring attention (its P2P exchanges inside one
custom op) and the output gather trace into one graph: ``torch._dynamo.explain`` of the forward finds no break.
Over 3 denoising steps (another timestep each, with a backward each) the forward compiles once, on every rank
(``error_on_recompile``), and forward outputs and parameter gradients equal the eager patched model's bit for bit
(``aot_eager`` runs the traced torch ops and the same collectives on the same values). 15 tokens over 2 ranks:
the padded shard path is in the graph too. Patched vs unpatched equality is the USP tests' subject.
"""

from __future__ import annotations

import pytest
import torch

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.testing import tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.tolerance import reassociation_tol, rel_error

KINDS = {"ulysses": ParallelConfig(ulysses=2), "ring": ParallelConfig(ring=2)}


def _step(model, x, t, text):
    model.zero_grad(set_to_none=True)
    out = model(x, torch.tensor([t]), text).sample
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _compile_cases() -> dict:
    from torch._dynamo.utils import counters

    x = torch.randn(1, 4, 1, 10, 6, generator=torch.Generator().manual_seed(1))  # 1 x 5 x 3 = 15 tokens
    text = wan_prompt_embeds()
    results = {}
    for kind, config in KINDS.items():
        eager, compiled = tiny_wan_transformer(), tiny_wan_transformer()  # same seed: same weights
        with (
            hfpatch.apply(eager, parallel=config),
            hfpatch.apply(compiled, parallel=config, compile=True, compile_backend="aot_eager"),
        ):
            # What compile=True compiles: the model's forward (its hooks run around it).
            state = eager.blocks[0].attn1.processor.state
            # A trace has no autograd history to prove a block's arguments replicated (hfpatch.patches.dit.streams:
            # the compiled forward averages only the routed attention's replicated inputs), so the eager twin
            # skips the per-block averages too: the same arithmetic, compared bit for bit.
            state.streams.enter = lambda *args, **kwargs: None
            state.begin()
            explained = torch._dynamo.explain(type(eager).forward)(eager, x, torch.tensor([900.0]), text)
            torch._dynamo.reset()
            counters.clear()
            equal = []
            with torch._dynamo.config.patch(error_on_recompile=True):
                for t in (900.0, 500.0, 100.0):
                    (out_e, grads_e), (out_c, grads_c) = (_step(m, x, t, text) for m in (eager, compiled))
                    equal.append(torch.equal(out_e, out_c) and all(map(torch.equal, grads_e, grads_c)))
            results[kind] = {
                "breaks": explained.graph_break_count,
                "graphs": counters["stats"]["unique_graphs"],
                "equal": equal,
                "ops": sorted(
                    str(n.target) for n in explained.graphs[0].graph.nodes if "hfpatch" in str(n.target)
                ),
            }
        assert compiled.forward.__func__ is type(compiled).forward  # remove() put the eager forward back
    return results


def test_compiled_sequence_parallel_wan_one_graph_no_recompile_equals_eager(rank_pool):
    ranks = rank_pool(2).run(_compile_cases)
    for kind in KINDS:
        per_rank = [r[kind] for r in ranks]
        for r in per_rank:
            assert r["breaks"] == 0 and r["graphs"] == 1, (kind, r)
            assert r["equal"] == [True] * 3, (kind, r)
        # The same graph on every rank: the same collectives in the same order.
        assert per_rank[0]["ops"] == per_rank[1]["ops"] and per_rank[0]["ops"], kind
    assert set(ranks[0]["ulysses"]["ops"]) == {"hfpatch.all_to_all.default", "hfpatch.all_gather.default"}
    assert "hfpatch.ring_attention.default" in ranks[0]["ring"]["ops"]


def test_compile_option_needs_a_sequence_split_and_a_known_backend():
    model = tiny_wan_transformer()
    with pytest.raises(ValueError, match="compile=True compiles the sequence-parallel forward"):
        hfpatch.apply(model, parallel=1, compile=True)
    with pytest.raises(ValueError, match="compile must be a bool"):
        hfpatch.apply(model, parallel=1, compile="inductor")
    with pytest.raises(ValueError, match="unknown compile_backend"):
        hfpatch.apply(model, parallel=1, compile=True, compile_backend="inductr")
    assert "forward" not in vars(model)


def _repeated_blocks_cases() -> dict:
    """diffusers' ``compile_repeated_blocks(fullgraph=True)`` on a patched model: each block compiles whole, its
    routed attention included (Ring's P2P exchanges are one custom op, so Ring traces as Ulysses does; a graph
    break would raise under ``fullgraph=True``). The forward equals the eager patched model's bit for bit; the
    gradients within 8 ulps of their scale (``reassociation_tol``'s floor), because AOT autograd's backward of a
    compiled block sums in another order than eager autograd's (measured 1.2e-7 to 1.6e-7 relative, the same
    under Ulysses and Ring)."""
    x = torch.randn(1, 4, 1, 10, 6, generator=torch.Generator().manual_seed(1))
    text = wan_prompt_embeds()
    results = {}
    for kind, config in KINDS.items():
        eager, compiled = tiny_wan_transformer(), tiny_wan_transformer()
        with hfpatch.apply(eager, parallel=config), hfpatch.apply(compiled, parallel=config):
            # A compiled block's hooks run in its trace, which cannot prove its arguments replicated
            # (hfpatch.patches.dit.streams): the eager twin skips the per-block averages too.
            eager.blocks[0].attn1.processor.state.streams.enter = lambda *args, **kwargs: None
            compiled.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
            (out_e, grads_e), (out_c, grads_c) = (_step(m, x, 900.0, text) for m in (eager, compiled))
            results[kind] = torch.equal(out_e, out_c) and all(
                rel_error(c, e) <= reassociation_tol(0.0) for c, e in zip(grads_c, grads_e)
            )
        torch._dynamo.reset()
    return results


def test_compile_repeated_blocks_fullgraph_works_under_ulysses_and_ring(rank_pool):
    assert rank_pool(2).run(_repeated_blocks_cases) == [{"ulysses": True, "ring": True}] * 2
