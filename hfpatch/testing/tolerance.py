"""Tolerances for "patched equals unpatched", derived from floating-point rounding instead of guessed.

A patch that splits work over ranks computes the same mathematical function as the unpatched model, but
sums in another order (GroupNorm statistics merged over ranks, online-softmax merges across Ring steps,
shorter GEMMs, gradients summed over ranks). Two fp32 results of the same function computed in different
orders differ by rounding only, and how much rounding a model amplifies depends on the model, its weights
and the CPU kernels (``ATEN_CPU_CAPABILITY``): a fixed ``1e-5`` is too loose for a well-conditioned model
and too tight for an ill-conditioned one. So the suite measures the rounding scale instead:

* :func:`rounding_noise` -- the unpatched fp32 computation against the same computation in fp64 (same
  weights, same inputs): how far fp32 rounding alone moves this model on this machine.
* :func:`reassociation_tol` -- the tolerance for patched vs unpatched: ``NOISE_FACTOR`` times that noise
  (both fp32 results sit within about one noise of the fp64 one, so their distance is about two; ten leaves
  room for the tail of the error distribution) and never below ``FLOOR_ULPS`` units of roundoff of the
  output scale (where both are single roundings, e.g. a model with few reductions).
* :func:`perturbation_noise` -- for a model that rounds to a lower precision *inside* even in fp32 (Kandinsky
  5's rotary rounds q/k to bf16): the largest change of its fp32 output when its inputs move by one fp32 ulp. A
  reassociation-sized change just before such a rounding can move a value by one ulp of the lower precision;
  the fp64 twin rounds the same way, so :func:`rounding_noise` shows that amplification only by chance. A lower
  estimate of those flips (what one ulp moves on this machine's kernels).
* :func:`stochastic_rounding_noise` -- for the same models, an envelope of what those flips can do on any CPU
  kernel: the largest change of the fp32 result (forward or gradients) when every rounding to the lower precision
  inside is stochastic (to either neighbour) instead of to nearest. A patch's reassociation flips a small subset
  of those roundings; this flips a quarter of all of them, so it bounds the flips whatever order the kernels sum in.
* :func:`low_precision_tol` -- for two bf16/fp16 results that differ in summation order: they share most
  roundings, so their gap is bounded by the reduced-precision result's own noise against fp64 (factor 1).
* :func:`summation_tol` -- for a single reduction of ``terms`` values: two summation orders differ by at
  most ``(terms - 1) * eps`` times the sum of magnitudes (the textbook recursive-summation bound, applied to
  both orders).
* :func:`attention_tol` -- for one softmax attention (and its log-sum-exp) computed in two orders (keys in
  blocks merged by their log-sum-exp, a fused kernel against matmuls): the same bound carried through the
  scores, the normaliser and the weighted sum of values.

Errors are relative to a scale (the reference's largest magnitude unless given), so the same tolerance fits
outputs of size 1 and gradients of size 100.

>>> import torch
>>> from hfpatch.testing.tolerance import reassociation_tol, rel_error, rounding_noise, summation_tol
>>> x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
>>> split = x[:1000].sum() + x[1000:].sum()                      # another summation order
>>> rel_error(split, x.sum(), scale=x.abs().sum().item()) <= summation_tol(4096)
True
>>> noise = rounding_noise(x.sum(), x.double().sum())
>>> rel_error(split, x.sum()) <= reassociation_tol(noise)
True
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "FLOOR_ULPS",
    "MAX_NOISE",
    "NOISE_FACTOR",
    "attention_tol",
    "eps",
    "low_precision_tol",
    "perturbation_noise",
    "reassociation_tol",
    "rel_error",
    "rounding_noise",
    "stochastic_rounding_noise",
    "summation_tol",
    "to_fp64",
    "without_inside_rounding",
]

#: Patched-vs-unpatched error allowed, in multiples of the unpatched fp32 model's own error against fp64.
NOISE_FACTOR = 10
#: Lower bound of every relative tolerance, in units of roundoff (``eps``) of the output scale.
FLOOR_ULPS = 8
#: Largest credible relative fp32-vs-fp64 noise (~80,000 fp32 ulps); above it the twin is not comparable.
MAX_NOISE = 1e-2


def eps(dtype: torch.dtype = torch.float32) -> float:
    """Machine epsilon (spacing of floats at 1.0) of ``dtype``: 1.19e-7 for fp32."""
    return torch.finfo(dtype).eps


def rel_error(actual: torch.Tensor, reference: torch.Tensor, scale: float | None = None) -> float:
    """``max |actual - reference|`` divided by ``scale`` (default: the reference's largest magnitude).

    Computed in fp64 so the comparison adds no rounding of its own. An all-zero reference with no scale
    compares absolutely.
    """
    difference = (actual.detach().double() - reference.detach().double()).abs().max().item()
    if scale is None:
        scale = reference.detach().abs().max().item()
    return difference / scale if scale > 0 else difference


def rounding_noise(fp32: torch.Tensor, fp64: torch.Tensor, scale: float | None = None) -> float:
    """The relative error fp32 rounding alone causes: the fp32 result against the fp64 one (same inputs)."""
    return rel_error(fp32, fp64, fp64.detach().abs().max().item() if scale is None else scale)


def perturbation_noise(
    fn: Callable[[dict[str, Any]], torch.Tensor | Mapping[str, torch.Tensor]],
    inputs: Mapping[str, Any],
    *,
    ulps: float = 1.0,
    trials: int = 4,
    scales: Mapping[str, float] | None = None,
    seed: int = 0,
) -> float:
    """The largest relative change of ``fn(inputs)`` when every floating tensor in ``inputs`` moves by up to
    ``ulps`` fp32 ulps (random, ``trials`` draws): how far a reassociation-sized change moves this computation.

    For a smooth fp32 computation this is about its :func:`rounding_noise`. One that rounds to a lower precision
    inside (a cast to bf16 between fp32 operations) turns some of those tiny changes into one ulp of that
    precision: every draw moves a few such roundings, so the result shows the amplification that the fp64
    twin's noise shows only by chance. It is a lower estimate: one ulp flips fewer roundings than a patch's
    reassociation of several ulps may, and which ones depends on the CPU kernels (issue 53: a Kandinsky 5 gradient
    1.9x over ``reassociation_tol`` of it on one ISA). For a bound on any kernel use
    :func:`stochastic_rounding_noise`.
    ``fn`` returns a tensor, or a dict of tensors compared each relative to ``scales[name]`` (default: its own
    largest magnitude).

    >>> import torch
    >>> from hfpatch.testing.tolerance import perturbation_noise
    >>> w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) / 16
    >>> x = {"x": torch.randn(64, 256, generator=torch.Generator().manual_seed(1))}
    >>> smooth = perturbation_noise(lambda i: i["x"] @ w, x)
    >>> rounded = perturbation_noise(lambda i: (i["x"] @ w).bfloat16().float(), x)  # some roundings flip
    >>> smooth < 1e-6 < rounded
    True
    """
    generator = torch.Generator().manual_seed(seed)

    def moved(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            noise = (torch.rand(value.shape, generator=generator, dtype=value.dtype) * 2 - 1).to(value.device)
            return value + value * noise * (
                ulps * eps(value.dtype) / 2
            )  # eps / 2: one ulp of a value in [1, 2)
        return value

    def compare(got: Any, ref: Any) -> float:
        if isinstance(ref, torch.Tensor):
            return rel_error(got, ref)
        return max(rel_error(got[k], ref[k], None if scales is None else scales[k]) for k in ref)

    reference = fn(dict(inputs))
    return max(compare(fn({k: moved(v) for k, v in inputs.items()}), reference) for _ in range(trials))


class _InsideCasts(TorchDispatchMode):
    """Every cast of an fp32/fp64 tensor to ``dtype`` (forward and backward casts alike) rounds stochastically
    (with ``generator``) or, with ``generator=None``, does not round at all: the value keeps its dtype."""

    def __init__(self, dtype: torch.dtype, generator: torch.Generator | None) -> None:
        super().__init__()
        self.dtype, self.generator, self.casts = dtype, generator, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if not (
            func is torch.ops.aten._to_copy.default
            and kwargs.get("dtype") == self.dtype
            and isinstance(source, torch.Tensor)
            and source.dtype in (torch.float32, torch.float64)
        ):
            return func(*args, **kwargs)
        self.casts += 1
        if self.generator is None:
            return source.clone()
        # x in [2^(e-1), 2^e) has neighbours spaced 2^(e-1) * eps apart in ``dtype``; x + U * spacing with
        # U in (-1/2, 1/2) rounds to nearest onto the upper neighbour with probability (x - lower) / spacing:
        # unbiased stochastic rounding, each result at most one ulp of ``dtype`` from the nearest.
        spacing = torch.ldexp(torch.full_like(source, eps(self.dtype)), torch.frexp(source).exponent - 1)
        draw = torch.rand(source.shape, generator=self.generator, dtype=source.dtype).to(source.device)
        moved = torch.where((source == 0) | ~source.isfinite(), source, source + (draw - 0.5) * spacing)
        return func(moved, *args[1:], **kwargs)


def without_inside_rounding(dtype: torch.dtype = torch.bfloat16) -> _InsideCasts:
    """A context in which casts of fp32/fp64 tensors to ``dtype`` do nothing: the smooth computation around the
    roundings of a model that rounds inside (its fp32-vs-fp64 noise is then reassociation alone).

    >>> import torch
    >>> from hfpatch.testing.tolerance import without_inside_rounding
    >>> x = torch.tensor([1.001])
    >>> with without_inside_rounding():
    ...     kept = x.bfloat16()
    >>> kept.dtype, x.bfloat16().item()
    (torch.float32, 1.0)
    """
    return _InsideCasts(dtype, None)


def stochastic_rounding_noise(
    fn: Callable[[], torch.Tensor | Mapping[str, torch.Tensor]],
    *,
    dtype: torch.dtype = torch.bfloat16,
    trials: int = 4,
    scales: Mapping[str, float] | None = None,
    seed: int = 0,
) -> float:
    """The largest relative change of ``fn()`` when every cast to ``dtype`` inside it (in the forward and, for
    gradients, in the backward) rounds stochastically instead of to nearest, over ``trials`` draws.

    For a model that rounds to ``dtype`` between fp32 operations (Kandinsky 5's rotary casts q/k to bf16, and
    their gradients back through bf16): a patch sums in another order, so some values arrive a few fp32 ulps
    away from the unpatched ones, and those within that distance of a rounding midpoint land on the other
    neighbour, one ulp of ``dtype`` away. Which ones depends on the CPU kernels' order of sums
    (``ATEN_CPU_CAPABILITY``), so no single machine's gap bounds another's. Stochastic rounding moves each value
    to either neighbour (a quarter of them off the nearest on average, each by up to one ulp, in directions
    independent of what follows): a superset of the flips that a reassociation of ``delta`` fp32 ulps makes
    (about ``2 * delta`` in ``2 ** 16`` of the values, for bf16). The variance of that sum is at most
    ``8 * delta / 2 ** 16`` of the stochastic one's (0.01 for delta = 100), so its largest draw bounds the
    patched gap with a wide margin, on every kernel. Add it to the smooth part's tolerance,
    ``reassociation_tol(noise)`` with ``noise`` measured :func:`without_inside_rounding` (the fp64 twin's
    noise with the roundings in place counts some of the flips again). ``fn`` returns a tensor, or a dict of tensors
    compared each relative to ``scales[name]`` (default: its own largest magnitude). Raises ``ValueError`` when
    ``fn`` casts nothing to ``dtype`` (the envelope would be 0 and bound nothing).

    >>> import torch
    >>> from hfpatch.testing.tolerance import stochastic_rounding_noise
    >>> w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) / 16
    >>> x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    >>> noise = stochastic_rounding_noise(lambda: (x @ w).bfloat16().float() @ w)
    >>> 1e-4 < noise < torch.finfo(torch.bfloat16).eps    # a fraction of one bf16 ulp, far above fp32's
    True
    """

    def compare(got: Any, ref: Any) -> float:
        if isinstance(ref, torch.Tensor):
            return rel_error(got, ref)
        return max(rel_error(got[k], ref[k], None if scales is None else scales[k]) for k in ref)

    def detached(result: Any) -> Any:
        if isinstance(result, torch.Tensor):
            return result.detach().clone()
        return {k: v.detach().clone() for k, v in result.items()}

    reference = detached(fn())
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(trials):
        with _InsideCasts(dtype, generator) as mode:
            result = detached(fn())
        if mode.casts == 0:
            raise ValueError(f"the computation casts nothing to {dtype}: no rounding to envelope")
        worst = max(worst, compare(result, reference))
    return worst


def reassociation_tol(
    noise: float,
    *,
    factor: float = NOISE_FACTOR,
    floor_ulps: float = FLOOR_ULPS,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Relative tolerance for a patched fp32 result against the unpatched one: ``factor * noise``, at least
    ``floor_ulps`` units of roundoff of ``dtype``.

    A noise above :data:`MAX_NOISE` is refused: the fp64 twin then computes something else (other random
    draws, a dtype-dependent branch), and a tolerance derived from it would let any result pass.
    """
    if not noise <= MAX_NOISE:
        raise ValueError(
            f"rounding noise {noise:.3g} > {MAX_NOISE}: the fp64 reference is not the same computation as the "
            "fp32 one (different random draws or code path?), so it cannot bound reassociation error"
        )
    return max(factor * noise, floor_ulps * eps(dtype))


def low_precision_tol(noise: float, dtype: torch.dtype) -> float:
    """Relative tolerance for two reduced-precision results (bf16/fp16 autocast) that differ only in summation
    order, e.g. chunked against one-shot: ``noise``, at least ``FLOOR_ULPS`` units of roundoff of ``dtype``.

    ``noise`` is the reduced-precision reference against fp64 (same weights and inputs): the effect of all its
    roundings to ``dtype``. Both results round the same values the same way except where an fp32
    reassociation flips a rounding (one ulp of ``dtype``, then carried through the model): a subset of those
    roundings, so their gap is about ``noise`` at most. ``NOISE_FACTOR`` times it would allow ten times the
    whole reduced-precision error, which bounds nothing. ``dtype`` is that of the compared values' last
    rounding (bf16 for gradients through bf16 matmuls; float32 for a loss reduced in fp32).
    """
    return max(noise, FLOOR_ULPS * eps(dtype))


def summation_tol(terms: int, dtype: torch.dtype = torch.float32) -> float:
    """Bound on two summation orders of ``terms`` values, relative to the sum of their magnitudes.

    Each order errs by at most ``(terms - 1) * u * sum|x|`` with ``u = eps / 2``, so the two differ by at
    most ``(terms - 1) * eps * sum|x|``.
    """
    return max(terms - 1, 1) * eps(dtype)


def attention_tol(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[float, float]:
    """Absolute bounds ``(out, lse)`` on two evaluations of ``softmax(scale * q k^T) v`` and of its log-sum-exp
    that differ only in summation order (keys split into blocks and merged, a fused kernel against matmuls).

    ``q``, ``k``, ``v`` are ``[..., S, D]`` (SDPA's layout), ``n = k.shape[-2]`` keys of ``D`` channels;
    ``dtype`` is the dtype of the arithmetic (default: ``q``'s, at least float32: half-precision kernels
    accumulate in float32 and the caller adds their roundings to half precision). With ``u = eps / 2`` per
    rounding, each bound below is for both orders together (twice one order's worst case):

    * a score ``scale * q.k`` sums ``D`` products and is scaled once: it errs by at most
      ``ds = (D + 1) * eps * scale * A``, ``A`` the largest ``sum_d |q_d k_d|``;
    * the log-sum-exp: that score error, ``n`` roundings of the normaliser sum, up to ``n`` rescalings by a
      new running maximum (online softmax, block merges), the exp/log roundings and the rounding of ``lse``
      itself (``|lse|`` ulps): ``dlse = ds + (3n + 2 + max|lse|) * eps``;
    * a probability ``exp(s - lse)`` then errs by ``ds + dlse`` (plus 2 roundings) relative, and the output
      sums ``n`` probability-weighted values (``n`` roundings of at most ``max|v|``) and is normalised once:
      ``dout = max|v| * (2 ds + (4n + 5 + max|lse|) * eps)``.

    A worst case over every sum, so it holds on any kernel and blocking (``ATEN_CPU_CAPABILITY``), typically
    10-100x above what two orders really differ by; wrong rows, keys or scales are off by O(max|v|).

    >>> import torch
    >>> from hfpatch.testing.tolerance import attention_tol
    >>> q, k, v = (torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    >>> scores = q @ k.mT * 8**-0.5
    >>> full, full_lse = torch.softmax(scores, -1) @ v, scores.logsumexp(-1)
    >>> blocks = [(scores[..., s], v[:, s]) for s in (slice(0, 2), slice(2, 5))]  # two key blocks, merged
    >>> lses = [s.logsumexp(-1, keepdim=True) for s, _ in blocks]
    >>> lse = torch.logaddexp(*lses)
    >>> merged = sum((s - lse).exp() @ vb for s, vb in blocks)
    >>> out_tol, lse_tol = attention_tol(q, k, v)
    >>> bool((merged - full).abs().max() <= out_tol), bool((lse[..., 0] - full_lse).abs().max() <= lse_tol)
    (True, True)
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32) if dtype is None else dtype
    n, d, e = k.shape[-2], q.shape[-1], eps(dtype)
    q64, k64 = q.detach().double(), k.detach().double()
    magnitude = (q64.abs() @ k64.abs().transpose(-1, -2)).max().item()  # A: largest sum_d |q_d k_d|
    lse = (q64 @ k64.transpose(-1, -2) * scale).logsumexp(-1).abs().max().item()
    ds = (d + 1) * e * scale * magnitude
    lse_tol = ds + (3 * n + 2 + lse) * e
    out_tol = v.detach().abs().max().item() * (2 * ds + (4 * n + 5 + lse) * e)
    return out_tol, lse_tol


def to_fp64(value: Any) -> Any:
    """An fp64 copy of a module or a diffusers pipeline (deep copy), or of the floating tensors inside
    (nested) tuples, lists and dicts; everything else is returned as it is."""
    if isinstance(value, torch.nn.Module):
        return copy.deepcopy(value).double()
    if hasattr(value, "components") and callable(getattr(value, "to", None)):  # a DiffusionPipeline
        return copy.deepcopy(value).to(dtype=torch.float64)
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(to_fp64(v) for v in value)
    if isinstance(value, dict):
        return {k: to_fp64(v) for k, v in value.items()}
    return value
