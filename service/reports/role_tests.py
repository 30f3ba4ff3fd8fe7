"""The role tests (SPEC §7): pure functions from metric rows and their intervals to the roles each
head earns, with the evidence (``assign``).

Each (head, role) is a one-sided test, H0: metric ≤ threshold (for ``broad`` also H0: metric ≥
its ceiling, the mirror; both must reject). The statistic is t = (value − threshold) / se with
se the jackknife's standard error (the interval's half-width over its quantile) and R − 1
degrees of freedom (R replicate groups); for a lift, the interval `query heads --ci` shows: t =
(ln value − ln threshold) / se(ln θ) with the interval's own degrees of freedom (SPEC §5d). Every test of a run is one family: a role is earned
when its Holm–Bonferroni adjusted p is ≤ ``ALPHA``, and the output names the family's size.
Runs stored before replicate groups existed have no intervals: there each value is tested
against its threshold, without a correction, and the evidence says so (``test = value (no
interval)``). Rules with a probe condition (SPEC §8) also need the head's probe score to reach
the rule's ``probe_min``.

The rules: ``role_rules``; a run's roles from the store: ``roles``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from headatlas.service.reports.intervals import clip_interval, jackknife_halfwidth, t95
from headatlas.service.reports.role_rules import BROAD_MAX, NONE, Rule, rules_for
from headatlas.service.reports.significance import holm, t_sf

ALPHA = 0.05  # family-wise error rate of a run's role tests (Holm–Bonferroni)
HOLM = "one-sided jackknife t, Holm"
VALUE_TEST = "value (no interval)"

ROLES_NOTE = (
    "a role is earned when its one-sided test (H0: metric ≤ threshold; t = (value − threshold) / se, se = the "
    "jackknife's, R − 1 df) rejects at α = 0.05 after Holm–Bonferroni over every (head, role) test of the run "
    "(family; p_holm: the adjusted p); runs without replicate groups test the value, uncorrected (SPEC §7). "
    "*_lift_dm: against distance-matched chance; attn_*_lift: against uniform attention; primary: the head's "
    "most specific role"
)
PROBE_NOTE = (
    "induction / duplicate-token (causal runs): the corpus test and, where the run has a probe, probe_score (the "
    "head's induction_score / duplicate_score on repeated random tokens, one probe per run: no interval) ≥ probe_min"
)
COLUMNS = [
    "layer",
    "head",
    "role",
    "primary",
    "metric",
    "value",
    "value_lo",
    "value_hi",
    "threshold",
    "test",
    "p",
    "p_holm",
    "family",
    "probe_score",
    "probe_min",
    "rule",
]
NO_ROLE = "no role's test rejects"


def _num(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def interval_quantile(groups: int) -> float | None:
    """The multiplier q of the 95% interval of ``intervals.jackknife_halfwidth`` over ``groups``
    groups, read back from that function itself (the half-width of leave-one-out values whose
    jackknife standard error is 1), so that ``se = half-width / q`` holds whatever quantile the
    intervals use."""
    if groups < 2:
        return None
    a = math.sqrt(groups / (2.0 * (groups - 1)))  # (R − 1) / R · (a² + a²) = 1
    return jackknife_halfwidth([a, -a] + [0.0] * (groups - 2))


@dataclass(frozen=True)
class Tested:
    """One (head, role) test: the evidence, its p-value (None: the value was tested)."""

    row: Mapping
    rule: Rule
    value: float
    lo: float | None
    hi: float | None
    threshold: float
    p: float | None
    value_holds: bool  # the value itself clears the threshold (and, for broad, the ceiling)
    probe: float | None = None  # the head's probe score the rule also reads (None: no probe condition)
    probe_holds: bool = True  # the probe score reaches the rule's probe_min (True where there is none)


def _one_sided_p(estimate: float, bound: float, se: float, df: float, *, log_scale: bool = False) -> float:
    """P(T_df > (estimate − bound) / se): H0 estimate ≤ bound; ``log_scale``: the same on ln of
    both (``se``: of ln estimate; a bound ≤ 0 lies below every positive estimate)."""
    if log_scale:
        if bound <= 0:
            return 0.0
        estimate, bound = math.log(estimate), math.log(bound)
    if se > 0:
        return t_sf((estimate - bound) / se, df)
    return 0.0 if estimate > bound else 1.0


def on_log_scale(value: float, lo: float, hi: float) -> bool:
    """Whether an interval was formed on the log scale (a lift's, ``intervals.jackknife_pivot``):
    positive and symmetric in ln, lo · hi = value² (a linear interval's lo · hi is value² − half²)."""
    return value > 0 and lo > 0 and math.isclose(lo * hi, value * value, rel_tol=1e-9)


def _test(rule: Rule, row: Mapping, context: Mapping, groups: int | None) -> Tested | None:
    """The test of ``rule`` on ``row``, or None where it cannot be made (no value, no threshold,
    or, in a run with replicate groups, no interval)."""
    value, lo, hi = (_num(row.get(k)) for k in (rule.metric, f"{rule.metric}_lo", f"{rule.metric}_hi"))
    threshold = rule.threshold(context)
    if value is None or threshold is None:
        return None
    ceiling = BROAD_MAX * context["uniform_entropy"] if rule.role == "broad" else None
    holds = value >= threshold and (ceiling is None or value <= ceiling)
    # the probe (SPEC §8): one per run, no interval: its score is a condition on the value
    probe = _num(row.get(rule.probe)) if rule.probe else None
    probe_holds = probe is None or probe >= rule.probe_min
    q = interval_quantile(groups) if groups is not None else None
    if groups is None or q is None:  # a run stored before replicate groups: the value is tested
        return Tested(row, rule, value, lo, hi, threshold, None, holds, probe, probe_holds)
    if lo is None or hi is None:  # the interval is undefined (a ratio without a denominator in some group)
        return None
    # the test reads the interval query heads --ci shows, unclipped: a lift's on the log scale with
    # its own degrees of freedom (``<metric>_df``), every other metric's symmetric with R − 1
    df = _num(row.get(f"{rule.metric}_df")) or float(groups - 1)
    log_scale = on_log_scale(value, lo, hi)
    se = (math.log(hi / lo) if log_scale else hi - lo) / 2.0 / t95(df)
    p = _one_sided_p(value, threshold, se, df, log_scale=log_scale)
    if ceiling is not None:  # both must hold: the larger p of the two one-sided tests (intersection–union)
        p = max(p, _one_sided_p(ceiling, value, se, df, log_scale=log_scale))
    # the interval shown is clipped to the metric's range
    lo, hi = clip_interval(rule.metric, lo, hi)
    return Tested(row, rule, value, lo, hi, threshold, p, holds, probe, probe_holds)


def assign(rows: Sequence[Mapping], context: Mapping, *, groups: int | None, alpha: float = ALPHA) -> list[tuple]:
    """One tuple per (head, role) in ``COLUMNS`` order, heads in (layer, head) order, roles in
    ``ROLE_ORDER``; a head without any role gets one ``none established`` row.

    ``rows``: per head, ``layer``, ``head`` and each metric of ``ROLE_METRICS`` with ``_lo``/``_hi``.
    ``context``: ``short_range_chance`` and ``uniform_entropy`` (ln n̄, n̄ = valid tokens per window);
    ``causal`` (default False): the run's attention is causal, which chooses the rules (``rules_for``).
    Rules with a probe condition read the row's probe score (``induction_score``, ``duplicate_score``;
    None: the run has no probe, and the corpus test alone decides).
    ``groups``: the replicate groups R behind the intervals (t with R − 1 df); None or < 2: no
    intervals, and each value is tested against its threshold without a correction.
    Every (head, role) with a p-value is one test of the family; Holm–Bonferroni over it at ``alpha``.
    """
    ordered = sorted(rows, key=lambda r: (r["layer"], r["head"]))
    rules = rules_for(bool(context.get("causal")))
    tests = [[t for rule in rules if (t := _test(rule, row, context, groups)) is not None] for row in ordered]
    family = [t for head_tests in tests for t in head_tests if t.p is not None]
    adjusted = dict(zip(map(id, family), holm([t.p for t in family if t.p is not None])))
    out: list[tuple] = []
    for row, head_tests in zip(ordered, tests):
        earned = [
            t
            for t in head_tests
            if t.probe_holds and (t.value_holds if t.p is None else adjusted[id(t)] <= alpha and t.value_holds)
        ]
        if not earned:
            out.append((row["layer"], row["head"], NONE, True, *([None] * 8), len(family) or None, None, None, NO_ROLE))
        for k, t in enumerate(earned):
            out.append(
                (
                    row["layer"],
                    row["head"],
                    t.rule.role,
                    k == 0,
                    t.rule.metric,
                    t.value,
                    t.lo,
                    t.hi,
                    t.threshold,
                    VALUE_TEST if t.p is None else HOLM,
                    t.p,
                    None if t.p is None else adjusted[id(t)],
                    len(family) or None,
                    t.probe,
                    None if t.probe is None else t.rule.probe_min,
                    t.rule.rule,
                )
            )
    return out
