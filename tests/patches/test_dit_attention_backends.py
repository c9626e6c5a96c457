"""A diffusers attention backend chosen by the user is honoured under sequence parallelism (2 gloo ranks).

- Ulysses alone (ring degree 1) attends through diffusers' own ``dispatch_attention_fn`` with the processor's
  backend, as the stock model does: any backend (here ``flex``), no hfpatch kernel, same output.
- Ring maps the backend to its log-sum-exp form (``_native_math`` -> hfpatch ``math``, ``native`` -> ``auto``,
  i.e. ``flash_cpu`` here), set per processor (``set_attention_backend``) or for a block of code
  (``attention_backend(...)``); a backend without one (``flex``) is refused by name on every rank.

Outputs are compared with the unpatched model under the same backend within ``reassociation_tol`` of its fp32
rounding noise (fp64 run of the same model), as in ``test_dit_usp``.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.nn.functional as F
from test_dit_usp import build

import hfpatch
from hfpatch import ParallelConfig
from hfpatch.testing.tolerance import reassociation_tol, rel_error, to_fp64


class _CountSDPA(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is F.scaled_dot_product_attention
        return func(*args, **(kwargs or {}))


def backend_cases() -> dict[str, object]:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry, attention_backend

    from hfpatch.attention import local

    kernels: collections.Counter = collections.Counter()
    for name in ("math", "flash_cpu"):  # count the lse kernels each case runs
        backend = local._BACKENDS[name]

        def counted(*args, _name=name, _forward=backend.forward):
            kernels[_name] += 1
            return _forward(*args)

        local._BACKENDS[name] = dataclasses.replace(backend, forward=counted)
    results: dict[str, object] = {}

    def run(case, ulysses, ring, setting=None, context=None):
        model, kwargs, _ = build("wan21")
        active = (
            _AttentionBackendRegistry._active_backend
        )  # set_attention_backend also sets diffusers' global
        try:
            if setting:
                model.set_attention_backend(setting)
            _case(case, model, kwargs, ulysses, ring, context)
        finally:
            _AttentionBackendRegistry.set_active_backend(active)

    def _case(case, model, kwargs, ulysses, ring, context):
        with torch.no_grad(), attention_backend(context) if context else _nothing():
            ref = model(**kwargs).sample
            noise = rel_error(ref, to_fp64(model)(**to_fp64(kwargs)).sample)
            kernels.clear()
            try:
                with (
                    hfpatch.apply(model, parallel=ParallelConfig(ulysses=ulysses, ring=ring)),
                    _CountSDPA() as sdpa,
                ):
                    out = model(**kwargs).sample
            except ValueError as error:
                results[case] = f"ValueError: {error}"
                return
        results[case] = {"ok": rel_error(out, ref) <= reassociation_tol(noise), "kernels": dict(kernels),
                         "sdpa": sdpa.calls}  # fmt: skip

    try:
        run("ulysses default", 2, 1)
        run("ulysses flex", 2, 1, setting="flex")
        run("ring default", 1, 2)
        run("ring _native_math per processor", 1, 2, setting="_native_math")
        run("ring _native_math context", 1, 2, context="_native_math")
        run("ring flex", 1, 2, setting="flex")
    finally:
        for name in ("math", "flash_cpu"):
            local._BACKENDS[name] = dataclasses.replace(
                local._BACKENDS[name], forward=getattr(local, f"_{name}_forward")
            )
    return results


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_diffusers_attention_backend_is_honoured_or_refused_by_name(rank_pool):
    for rank, results in enumerate(rank_pool(2).run(backend_cases)):
        # Ulysses: diffusers' dispatch with the stock backend; SDPA for "native", flex's own kernel for flex.
        # (2 blocks x self- and cross-attention: 4 SDPA calls with "native"; none with flex, attn2 included.)
        assert results["ulysses default"] == {"ok": True, "kernels": {}, "sdpa": 4}, (rank, results)
        assert results["ulysses flex"] == {"ok": True, "kernels": {}, "sdpa": 0}, (rank, results)
        # Ring: the lse kernel of the backend (native -> auto -> flash_cpu on CPU; _native_math -> math).
        assert results["ring default"]["ok"] and set(results["ring default"]["kernels"]) == {"flash_cpu"}
        for case in ("ring _native_math per processor", "ring _native_math context"):
            assert results[case]["ok"] and set(results[case]["kernels"]) == {"math"}, (
                rank,
                case,
                results[case],
            )
        assert results["ring flex"].startswith(
            "ValueError: WanTransformer3DModel.blocks.0.attn1: diffusers attention backend 'flex' has no form that returns the "
            "log-sum-exp, which Ring attention (ring degree 2) needs"
        ), (rank, results["ring flex"])
