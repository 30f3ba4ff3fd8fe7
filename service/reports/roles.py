"""The head atlas: roles earned by each head from its metrics and their 95% intervals (SPEC §7).

A head earns a role when the *lower* bound of its metric's interval clears the role's threshold
(the upper bound, for the test that attention is not uniform), so a role is never given on a
value whose interval still reaches chance. A head may hold several roles; its primary role is
the first it holds in ``ROLE_ORDER`` (most specific first). Heads that earn none are ``none
established``. Runs stored before replicate groups existed have no intervals: there the value
itself is tested and the evidence says so (``bound = value``).

Pure functions over metric rows (``assign``) plus the store query (``roles``). numpy-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.reports import queries

NONE = "none established"

# thresholds, derived in SPEC §7 from the default model and its random control on the shipped excerpt
POSITION_MIN = 0.2  # mean attention on the previous / next token (uniform: 1/n̄ ≈ 0.008)
LOCAL_FACTOR = 3.0  # short_range_share over short_range_chance
SENTENCE_MIN = 1.05  # within_sentence_lift_dm (1 = distance-matched chance)
REPETITION_MIN = 10.0  # repetition_words_lift_dm (1 = distance-matched chance)
SINK_MIN = 10.0  # attn_to_cls_lift / attn_to_sep_lift (1 = uniform attention)
PUNCT_MIN = 1.5  # attn_to_punct_lift (1 = uniform attention)
BROAD_MIN, BROAD_MAX = 0.75, 0.97  # attn_entropy as a share of uniform attention's entropy ln n̄


@dataclass(frozen=True)
class Rule:
    role: str
    metric: str
    side: str  # "lo": the interval's lower bound must reach the threshold; "hi": the upper bound stay under it
    threshold: Callable[[Mapping], float | None]  # from the run's context (chances, ln n̄)
    rule: str  # the test in words, with what it is measured against


def _ctx(name: str, factor: float = 1.0) -> Callable[[Mapping], float | None]:
    return lambda c: None if c.get(name) is None else factor * c[name]


RULES: tuple[Rule, ...] = (
    Rule(
        "previous-token",
        "attn_to_prev",
        "lo",
        lambda c: POSITION_MIN,
        f"mean attention on the previous token ≥ {POSITION_MIN} (uniform: 1/n̄)",
    ),
    Rule(
        "next-token",
        "attn_to_next",
        "lo",
        lambda c: POSITION_MIN,
        f"mean attention on the next token ≥ {POSITION_MIN} (uniform: 1/n̄)",
    ),
    Rule(
        "repetition",
        "repetition_words_lift_dm",
        "lo",
        lambda c: REPETITION_MIN,
        f"word repetition ≥ {REPETITION_MIN:g}× distance-matched chance",
    ),
    Rule(
        "sentence-bound",
        "within_sentence_lift_dm",
        "lo",
        lambda c: SENTENCE_MIN,
        f"within-sentence share ≥ {SENTENCE_MIN:g}× distance-matched chance",
    ),
    Rule(
        "punctuation",
        "attn_to_punct_lift",
        "lo",
        lambda c: PUNCT_MIN,
        f"attention on . and , ≥ {PUNCT_MIN:g}× uniform attention",
    ),
    Rule(
        "local",
        "short_range_share",
        "lo",
        _ctx("short_range_chance", LOCAL_FACTOR),
        f"share of similar pairs within short_range ≥ {LOCAL_FACTOR:g}× short_range_chance",
    ),
    Rule(
        "[CLS] sink",
        "attn_to_cls_lift",
        "lo",
        lambda c: SINK_MIN,
        f"attention on [CLS] ≥ {SINK_MIN:g}× uniform attention",
    ),
    Rule(
        "[SEP] sink",
        "attn_to_sep_lift",
        "lo",
        lambda c: SINK_MIN,
        f"attention on [SEP] ≥ {SINK_MIN:g}× uniform attention",
    ),
    Rule(
        "broad",
        "attn_entropy",
        "lo",
        _ctx("uniform_entropy", BROAD_MIN),
        f"attention entropy ≥ {BROAD_MIN:g}·ln n̄ and its upper bound ≤ {BROAD_MAX:g}·ln n̄ "
        "(spread, yet measurably not uniform)",
    ),
)
ROLE_ORDER = tuple(r.role for r in RULES)
ROLE_METRICS = tuple(dict.fromkeys(r.metric for r in RULES))

ROLES_NOTE = (
    "a role is earned when the lower bound of the metric's 95% interval reaches the threshold (SPEC §7); "
    "*_lift_dm: against distance-matched chance; attn_*_lift: against uniform attention; primary: the head's "
    "most specific role"
)
COLUMNS = ["layer", "head", "role", "primary", "metric", "value", "value_lo", "value_hi", "threshold", "bound", "rule"]


def _num(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _evidence(rule: Rule, row: Mapping, context: Mapping) -> tuple | None:
    """(value, lo, hi, threshold, bound) when ``row`` earns ``rule``'s role, else None."""
    value, lo, hi = (_num(row.get(k)) for k in (rule.metric, f"{rule.metric}_lo", f"{rule.metric}_hi"))
    threshold = rule.threshold(context)
    if value is None or threshold is None:
        return None
    if lo is not None and hi is not None:
        low, high, bound = lo, hi, "lower bound"
    else:
        low, high, bound = value, value, "value"
    if low < threshold:
        return None
    if rule.role == "broad":
        ceiling = BROAD_MAX * context["uniform_entropy"]
        if high > ceiling:  # indistinguishable from uniform attention: chance, not a role
            return None
    return value, lo, hi, threshold, bound


def assign(rows: Sequence[Mapping], context: Mapping) -> list[tuple]:
    """One tuple per (head, role) in ``COLUMNS`` order, heads in (layer, head) order, roles in
    ``ROLE_ORDER``; a head without any role gets one ``none established`` row.

    ``rows``: per head, ``layer``, ``head`` and each metric of ``ROLE_METRICS`` with ``_lo``/``_hi``.
    ``context``: ``short_range_chance`` and ``uniform_entropy`` (ln n̄, n̄ = valid tokens per window).
    """
    out: list[tuple] = []
    for row in sorted(rows, key=lambda r: (r["layer"], r["head"])):
        earned = [(rule, ev) for rule in RULES if (ev := _evidence(rule, row, context)) is not None]
        if not earned:
            out.append(
                (
                    row["layer"],
                    row["head"],
                    NONE,
                    True,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    "no metric's interval clears its threshold",
                )
            )
        for k, (rule, (value, lo, hi, threshold, bound)) in enumerate(earned):
            out.append(
                (row["layer"], row["head"], rule.role, k == 0, rule.metric, value, lo, hi, threshold, bound, rule.rule)
            )
    return out


def run_context(conn: Connection, run_id: int) -> dict:
    """The run-level chances the thresholds are measured against."""
    row = (
        conn.execute(
            text(
                "SELECT ln(c.attn_rows / nullif(c.windows, 0)) AS uniform_entropy, d.short_range_chance "
                "FROM chance_totals c LEFT JOIN chance_distance d USING (run_id) WHERE c.run_id = :run"
            ),
            {"run": run_id},
        )
        .mappings()
        .first()
    )
    return dict(row) if row else {"uniform_entropy": None, "short_range_chance": None}


def roles(conn: Connection, run_id: int) -> queries.Rows:
    """Per (head, role): the evidence that earned it (metric, value, 95% interval, threshold)."""
    columns, rows = queries.heads(conn, run_id, anchors=0, ci=True)
    dicts = [dict(zip(columns, r)) for r in rows]
    return list(COLUMNS), assign(dicts, run_context(conn, run_id))


def primary_grid(columns: list[str], rows: list[tuple], n_layers: int, n_heads: int) -> list[list[str | None]]:
    """``[layer][head]`` → the head's primary role (None where the run stored no head)."""
    grid: list[list[str | None]] = [[None] * n_heads for _ in range(n_layers)]
    li, hi, ri, pi = (columns.index(c) for c in ("layer", "head", "role", "primary"))
    for r in rows:
        if r[pi]:
            grid[r[li]][r[hi]] = r[ri]
    return grid


def role_counts(columns: list[str], rows: list[tuple]) -> dict[str, int]:
    """Heads holding each role (a head with several counts once per role), ``none established`` last."""
    ri = columns.index("role")
    counts = {role: 0 for role in (*ROLE_ORDER, NONE)}
    for r in rows:
        counts[r[ri]] += 1
    return counts
