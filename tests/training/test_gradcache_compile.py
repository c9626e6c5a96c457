"""``GradCache(..., compile=True)``: the chunk passes through ``torch.compile`` without a break or a recompilation.

One compiled forward per kind of chunk call (autograd off in pass 1, on in pass 2 and for the kept chunk; a
smaller last chunk has shapes of its own), each its own code object, so each compiles once: 10 equal chunks of
two inputs over two steps are two graphs, with a smaller last chunk four. Nothing is padded: every chunk
computes what the eager forward computes, so with a backend that runs the traced torch ops (the recording
backend below, like ``backend="eager"``) losses and gradients equal the eager GradCache bit for bit, dropout
included (the same generator draws the same masks, replayed in pass 2). Under DDP the compiled forward is
installed inside the wrapper, whose own forward (and gradient all-reduce) runs as usual.
"""

from __future__ import annotations

import pytest
import torch

from hfpatch.core.compile import fresh_copy
from hfpatch.testing import tiny_bert
from hfpatch.training import GradCache
from hfpatch.training.trainer import info_nce


def _text(n: int, seed: int, length: int = 12) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[::3, -2:] = 0  # some right padding
    return {"input_ids": ids, "attention_mask": mask}


def _recording(graphs: list):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def _steps(batch: int, backend=None, dropout: float = 0.1, steps: int = 2):
    model = tiny_bert(dropout=dropout).train()
    options = {} if backend is None else {"compile": True, "compile_backend": backend}
    cache = GradCache(model, info_nce, chunk_size=4, pooling="mean", **options)
    torch.manual_seed(0)
    losses = [cache.step(_text(batch, 2 * s), _text(batch, 2 * s + 1)) for s in range(steps)]
    return model, losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("batch, kinds", [(40, 2), (42, 4)])
def test_compiled_chunks_no_recompile_and_equal_eager_with_dropout(batch, kinds):
    _, eager_losses, eager_grads = _steps(batch)
    graphs: list = []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        model, losses, grads = _steps(batch, _recording(graphs))
    # 40 = 10 chunks of 4 per input: one graph without autograd (pass 1), one with (pass 2 and the kept
    # chunk). 42: 10 chunks of 4 and one of 2 per input, two shapes of each.
    assert len(graphs) == kinds
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, losses))
    assert grads.keys() == eager_grads.keys()
    assert all(torch.equal(grads[n], eager_grads[n]) for n in grads)  # same ops on the same values and masks
    assert "forward" not in vars(model)  # the compiled forward lives only as long as a chunk call


def test_compiled_chunk_forward_has_no_graph_break():
    # What GradCache compiles is the encoder's forward on one chunk, with and without autograd.
    model = tiny_bert(dropout=0.1).train()
    chunk = {k: v[:4] for k, v in _text(8, 0).items()}
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            explained = torch._dynamo.explain(fresh_copy(lambda **c: model(**c), "chunk"))(**chunk)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_compiled_forward_is_installed_inside_wrappers_and_restored():
    # An instance-level forward (what accelerate's autocast wrapper installs) is what gets compiled, and is put
    # back after every chunk call.
    model = tiny_bert().eval()
    stock_forward = model.forward

    def instance_forward(*args, **kwargs):  # a wrapper that changes the output: seen in the loss
        out = stock_forward(*args, **kwargs)
        out.last_hidden_state = out.last_hidden_state + 1.0
        return out

    model.forward = instance_forward
    losses, graphs = [], []
    for options in ({}, {"compile": True, "compile_backend": _recording(graphs)}):
        cache = GradCache(model, info_nce, chunk_size=4, pooling="mean", **options)
        losses.append(cache.step(_text(8, 0), _text(8, 1)))
        assert model.forward is instance_forward
    plain = GradCache(tiny_bert().eval(), info_nce, chunk_size=4, pooling="mean").step(
        _text(8, 0), _text(8, 1)
    )
    assert torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], plain)
    assert len(graphs) == 2 and "compile=True" in repr(cache)


def test_compile_option_checked():
    with pytest.raises(ValueError, match="compile must be a bool"):
        GradCache(tiny_bert(), info_nce, chunk_size=2, compile="inductor")
    with pytest.raises(ValueError, match="unknown compile_backend"):
        GradCache(tiny_bert(), info_nce, chunk_size=2, compile=True, compile_backend="inductr")


def _ddp_case() -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    grads = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = tiny_bert(dropout=0.0).train()
        ddp = DistributedDataParallel(model)
        options = {"compile": True, "compile_backend": "eager"} if compiled else {}
        cache = GradCache(ddp, info_nce, chunk_size=4, pooling="mean", cross_rank=True, **options)
        with torch._dynamo.config.patch(error_on_recompile=True):
            cache.step(_text(8, 10 + rank), _text(8, 20 + rank))
        grads[compiled] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {
        "equal": all(torch.equal(grads[False][n], grads[True][n]) for n in grads[False]),
        "synced": grads[True]["embeddings.word_embeddings.weight"],
    }


def test_compiled_gradcache_under_ddp_equals_eager_and_all_reduces(rank_pool):
    results = rank_pool(2).run(_ddp_case)
    assert all(r["equal"] for r in results)
    assert torch.equal(results[0]["synced"], results[1]["synced"])  # DDP's all-reduce ran around the graph
