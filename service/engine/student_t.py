"""Student's t distribution: its upper tail (through the regularized incomplete beta function) and
its quantiles, in plain Python. A leaf: the intervals of the reports (``reports.intervals``) and
the interval the storage's SQL views compute (``storage.views``) read the same multiplier."""

from __future__ import annotations

import math


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for aa in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), for a, b > 0 and x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_upper_tail(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom, t ≥ 0."""
    return 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom, for p in [0.5, 1):
    bisection on the upper tail (t_{15, 0.975} = 2.131)."""
    if not 0.5 <= p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile({p}, {df}): p must be in [0.5, 1) and df positive")
    tail = 1.0 - p
    lo, hi = 0.0, 1.0
    while t_upper_tail(hi, df) > tail:
        lo, hi = hi, hi * 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if t_upper_tail(mid, df) > tail:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


_T95: dict[float, float] = {}
DF_STEP = 0.05  # a lift's degrees of freedom are rounded down to this step (t95 caches per step)


def t95(df: float) -> float:
    """t_{df, 0.975}: the two-sided 95% multiplier for an interval from ``df + 1`` groups (``df``
    need not be whole: a lift's are effective degrees of freedom, ``lift_df``)."""
    if df not in _T95:
        _T95[df] = t_quantile(0.975, df)
    return _T95[df]
