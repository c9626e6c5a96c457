"""``hfpatch.apply(..., exchange=...)`` on stock DiTs: the Ulysses exchange's modes through the patched models.

The exchange itself (every layout, uneven heads at worlds 3 and 4, USP 2 x 2, gradients, the copy and byte counts)
is tested in ``tests/attention/test_exchange.py``; this file checks the option's plumbing on two stock classes
with the text joined in different ways (Flux: text tokens in front of the image tokens; QwenImage: joint
attention with a key mask on the text), at Ulysses 2 (one ``pool.run``), inference:

* ``exchange="overlap"`` gives the default exchange's output bit for bit (the same elements through the same
  kernels, per chunk of heads), and the default is bit-exact with the unpatched model at a ring degree of 1
  (each rank's kernel sees the stock call for its heads);
* ``exchange="fp8"`` stays within 0.1 of the output's largest magnitude (a sanity bound:
  ``benchmarks/ulysses_exchange.py`` measures 2.0e-2 on this Flux and 2.1e-2 on QwenImage unmasked; the
  attention-level test checks FP8 against an exact emulation of its rounding), differs from the exact exchange
  (so it ran), and is refused, on every rank before any message, while autograd records a model whose parameters
  require grad;
* bad options are refused at ``apply``, before any collective: an unknown name, an exchange without Ulysses
  (Ring alone), the FP8 exchange with ``compile=True``.
"""

from __future__ import annotations

from typing import Any

import torch
from test_dit_usp import build

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.testing.tolerance import rel_error

FAMILIES = ("flux", "qwenimage_mask")


def _sample(out: Any) -> torch.Tensor:
    return out.sample if hasattr(out, "sample") else out[0]


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


def exchange_cases() -> dict[str, Any]:
    results: dict[str, Any] = {}
    u2 = ParallelConfig(ulysses=2)
    for family in FAMILIES:
        model, kwargs, _ = build(family)
        with torch.no_grad():
            reference = _sample(model(**kwargs))
            outs = {}
            for exchange in (None, "overlap", "fp8"):
                with hfpatch.apply(model, parallel=u2, exchange=exchange):
                    outs[exchange] = _sample(model(**kwargs))
        with hfpatch.apply(model, parallel=u2, exchange="fp8"):  # grad enabled, parameters require grad
            refused = _error(model, **kwargs)
        results[family] = {
            "default_exact": torch.equal(outs[None], reference),
            "overlap_equal": torch.equal(outs["overlap"], outs[None]),
            "fp8_error": rel_error(outs["fp8"], outs[None]),
            "fp8_training": refused,
        }
    model, _, _ = build("flux")
    results["errors"] = {
        "unknown": _error(hfpatch.apply, model, parallel=u2, exchange="fp16"),
        "no_ulysses": _error(hfpatch.apply, model, parallel=ParallelConfig(ring=2), exchange="overlap"),
        "fp8_compiled": _error(hfpatch.apply, model, parallel=u2, exchange="fp8", compile=True),
    }
    return results


def test_dit_exchange_overlap_exact_fp8_bounded_and_refused(rank_pool):
    per_rank = rank_pool(2).run(exchange_cases)
    for rank, results in enumerate(per_rank):
        for family in FAMILIES:
            r = results[family]
            where = f"rank {rank}, {family}"
            assert r["default_exact"], f"{where}: Ulysses 2 is no longer bit-exact with the unpatched model"
            assert r["overlap_equal"], f"{where}: exchange='overlap' differs from the default exchange"
            assert 0 < r["fp8_error"] < 0.1, (where, r["fp8_error"])
            assert "refused while autograd records" in r["fp8_training"], (where, r["fp8_training"])
        errors = results["errors"]
        assert "exchange must be None" in errors["unknown"], errors["unknown"]
        assert "has none (ulysses = 1" in errors["no_ulysses"], errors["no_ulysses"]
        assert "eager mode only" in errors["fp8_compiled"], errors["fp8_compiled"]
    assert per_rank[0]["errors"] == per_rank[1]["errors"]  # the same message on every rank
