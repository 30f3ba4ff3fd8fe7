"""Student's t distribution and the Holm–Bonferroni correction, for the role tests (SPEC §7).

math only, so that the query path stays free of scipy and torch. The t CDF is the regularized
incomplete beta function, ``P(T_ν ≤ t) = 1 − I_x(ν/2, 1/2) / 2`` with ``x = ν / (ν + t²)`` for
``t ≥ 0`` (symmetric below), evaluated by its continued fraction (modified Lentz), as in
Numerical Recipes §6.4.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_EPS = 1e-15
_TINY = 1e-300
_MAX_TERMS = 500


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (converges fast for x < (a + 1) / (a + b + 2))."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, _MAX_TERMS + 1):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + aa / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            return h
    return h  # not reached for the (a, b) of a t distribution; the last convergent is within 1e-12


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), ``0 ≤ x ≤ 1``, ``a, b > 0``."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"incomplete_beta: x = {x} is outside [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T_df ≤ t) for Student's t with ``df > 0`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"t_cdf: df = {df} must be positive")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T ≥ |t|)
    return 1.0 - tail if t >= 0 else tail


def t_sf(t: float, df: float) -> float:
    """P(T_df > t): the one-sided p-value of a statistic ``t``."""
    return t_cdf(-t, df)


def t_quantile(p: float, df: float) -> float:
    """The t with P(T_df ≤ t) = p (bisection on ``t_cdf``; to 1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p = {p} must lie strictly between 0 and 1")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the order given: sorted ascending, the i-th
    (from 0) becomes ``max over j ≤ i of min(1, (m − j) · p_(j))``; a test rejects at level α
    when its adjusted p is ≤ α, which controls the family-wise error rate at α."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted
