"""Two runs side by side: each metric per layer (or per head) of both, their difference, and
whether the difference is beyond the runs' 95% intervals (SPEC §5d, §7).

Returns (columns, rows) like ``service.reports.queries``. Layers and heads are 0-based.

- Each run's interval is its own jackknife with t_{R-1} over its replicate groups, grouped by the
  scheme the run recorded (``interval_by``: document, block:B, or window for runs stored before
  SPEC §5d) — the same intervals as ``query`` and roles.
- Difference = run A − run B. Its 95% interval is the delete-one-group jackknife of the
  difference itself when both runs counted exactly the same windows under the same replicate
  scheme (the groups then hold the same windows in both, so the leave-one-group-out differences
  are paired; a run and its random-weights control are such a pair). Otherwise the runs are
  independent samples and the half-width is ``sqrt(h_A² + h_B²)`` from each run's own
  jackknife half-width (each ``h = t_{R−1} · se`` at its own groups). ``benchmarks/halves.py``
  tests such a difference otherwise: one t at Welch's degrees of freedom times
  ``sqrt(se_A² + se_B²)``, never wider than this when both runs have as many groups (docs/baselines.md).
- Verdict: ``beyond`` when the difference's interval excludes 0, ``within`` when it holds 0,
  ``no interval`` when either run lacks replicate groups (stored before they existed) and
  ``no value`` when a metric is undefined in either run.
- Depth: layer l of an L-layer model sits at relative depth (l + 0.5) / L. Runs of equal depth
  pair layer l with layer l; otherwise each layer of the shallower run is paired with the
  layer of the deeper run nearest in relative depth (the lower one on a tie), and both layer
  numbers are shown. Heads are compared only between runs of the same shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import ParameterError
from headatlas.service.layer_head import NAMED_BY_LAYER, check_head_has_layer, check_layer_head
from headatlas.service.reports import query_support, trend_queries
from headatlas.service.reports.columns import unknown_metric
from headatlas.service.reports.intervals import add_intervals, clip_interval, jackknife_halfwidth, scheme_of

if TYPE_CHECKING:
    from headatlas.service.storage.store import Run

# the lifts and shares that carry the findings (each lift against its named chance)
DEFAULT_METRICS = (
    "within_sentence_lift_dm",
    "repetition_words_lift_dm",
    "mean_distance",
    "short_range_share",
    "noise_share",
    "attn_to_punct_lift",
    "attn_to_cls_lift",
    "anchor_frequency_share",
)
METRICS = trend_queries.LAYER_METRICS
COLUMNS = [
    "layer_a",
    "layer_b",
    "head",
    "depth_a",
    "depth_b",
    "metric",
    "value_a",
    "value_a_lo",
    "value_a_hi",
    "value_b",
    "value_b_lo",
    "value_b_hi",
    "difference",
    "difference_lo",
    "difference_hi",
    "interval",
    "interval_by",
    "verdict",
]
TABLE_COLUMNS = ["layer_a", "layer_b", "head", "metric", "value_a", "value_b", "difference", "verdict"]
TABLE_INTERVALS = ("difference",)  # the interval a table shows: the one the verdict reads
VERDICT_NOTE = (
    "difference = A − B; verdict: beyond = the difference's 95% interval excludes 0, within = it holds 0 "
    "(interval: paired jackknife when both runs counted the same windows in the same replicate groups, "
    "else sqrt(hA² + hB²))"
)

Rows = tuple[list[str], list[tuple]]


def relative_depth(layer: int, n_layers: int) -> float:
    return (layer + 0.5) / n_layers


def align_layers(n_a: int, n_b: int) -> list[tuple[int, int]]:
    """Pairs (layer of A, layer of B): one per layer of the shallower run, matched to the
    deeper run's layer nearest in relative depth (the lower layer on a tie)."""
    if n_a == n_b:
        return [(l, l) for l in range(n_a)]
    shallow, deep = min(n_a, n_b), max(n_a, n_b)
    pairs = []
    for s in range(shallow):
        target = relative_depth(s, shallow)
        # rounded: equal distances must tie exactly (then the lower layer wins), whatever float error says
        d = min(range(deep), key=lambda l: (round(abs(relative_depth(l, deep) - target), 9), l))
        pairs.append((s, d) if n_a < n_b else (d, s))
    return pairs


def check_metrics(metrics: Sequence[str] | None) -> list[str]:
    chosen = list(dict.fromkeys(metrics or DEFAULT_METRICS))
    for m in chosen:
        if m not in METRICS:
            raise unknown_metric("metric", m, METRICS)
    return chosen


def metric_values(conn: Connection, run_id: int, metrics: Sequence[str], *, heads: bool) -> dict:
    """{(layer,) or (layer, head): {drop_rep: {metric: value}}} from the ``*_reps`` views:
    drop_rep -1 is the whole run, g ≥ 0 the run without replicate group g."""
    view, keys = ("head_metrics_reps", ("layer", "head")) if heads else ("layer_metrics_reps", ("layer",))
    # a causal effect (SPEC §9) rests on the groups that hold the run's effect windows alone (asked
    # first: a query on the connection would end the cursor below)
    effects = query_support.effect_groups_of(conn, run_id, list(metrics))
    kept = _stored_reps(conn, run_id, "head_reps" if heads else "layer_reps", [*keys, "drop_rep", *metrics])
    result: Iterable[Sequence] = (
        kept
        if kept is not None
        else conn.execute(
            text(f"SELECT {', '.join(keys)}, drop_rep, {', '.join(metrics)} FROM {view} WHERE run_id = :run"),
            {"run": run_id},
        )
    )
    out: dict = {}
    k = len(keys)
    for row in result:
        drop = row[k]
        values = dict(zip(metrics, row[k + 1 :]))
        for metric, groups in effects.items():
            if drop >= 0 and drop not in groups:
                del values[metric]
        out.setdefault(tuple(row[:k]), {})[drop] = values
    return out


def same_windows(conn: Connection, run_a: int, run_b: int) -> bool:
    """Whether both runs counted exactly the same windows (then their replicate groups match)."""
    differ = conn.execute(
        text("""
        SELECT count(*) FROM (SELECT window_id FROM run_windows WHERE run_id = :a) x
        FULL OUTER JOIN (SELECT window_id FROM run_windows WHERE run_id = :b) y ON x.window_id = y.window_id
        WHERE x.window_id IS NULL OR y.window_id IS NULL
    """),
        {"a": run_a, "b": run_b},
    ).scalar()
    return differ == 0


def _value(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _groups(reps: dict, metric: str) -> list[int]:
    """The groups whose leave-one-out value of ``metric`` the jackknife reads."""
    return sorted(g for g in reps if g >= 0 and metric in reps[g])


def verdict(lo: float | None, hi: float | None) -> str:
    if lo is None or hi is None:
        return "no interval"
    return "beyond" if lo > 0 or hi < 0 else "within"


def _compare_cell(reps_a: dict, reps_b: dict, metric: str, paired: bool) -> tuple:
    a, b = _value(reps_a.get(-1, {}).get(metric)), _value(reps_b.get(-1, {}).get(metric))
    # each run's groups and leave-one-out values, read once (a page compares hundreds of cells)
    groups_a, groups_b = _groups(reps_a, metric), _groups(reps_b, metric)
    loo_a = [_value(reps_a[g][metric]) for g in groups_a]
    loo_b = [_value(reps_b[g][metric]) for g in groups_b]
    half_a, half_b = jackknife_halfwidth(loo_a), jackknife_halfwidth(loo_b)
    a_lo, a_hi = clip_interval(metric, a - half_a, a + half_a) if a is not None and half_a is not None else (None, None)
    b_lo, b_hi = clip_interval(metric, b - half_b, b + half_b) if b is not None and half_b is not None else (None, None)
    if a is None or b is None:
        return a, a_lo, a_hi, b, b_lo, b_hi, None, None, None, "no value"
    diff = a - b
    if paired and groups_a == groups_b:
        half = jackknife_halfwidth([None if x is None or y is None else x - y for x, y in zip(loo_a, loo_b)])
    elif half_a is not None and half_b is not None:
        half = math.hypot(half_a, half_b)
    else:
        half = None
    lo, hi = (diff - half, diff + half) if half is not None else (None, None)
    return a, a_lo, a_hi, b, b_lo, b_hi, diff, lo, hi, verdict(lo, hi)


def compare(
    conn: Connection,
    run_a,
    run_b,
    *,
    metrics: Sequence[str] | None = None,
    layer: int | None = None,
    head: int | None = None,
    heads: bool = False,
) -> Rows:
    """Per layer (or per head with ``heads``/``head``), each metric of runs A and B (store
    ``Run``s), A − B with its 95% interval, and the verdict. ``layer`` and ``head`` use run A's
    numbering (0-based)."""
    chosen = check_metrics(metrics)
    check_head_has_layer(layer, head, then=NAMED_BY_LAYER)
    heads = heads or head is not None
    check_layer_head(layer, head, n_layers=run_a.n_layers, n_heads=run_a.n_heads, whose=f"run A ({run_a.name})")
    if heads and (run_a.n_layers, run_a.n_heads) != (run_b.n_layers, run_b.n_heads):
        raise ParameterError(
            f"compare heads: run {run_a.name} is {run_a.n_layers}×{run_a.n_heads} (layers × heads), run "
            f"{run_b.name} is {run_b.n_layers}×{run_b.n_heads}; heads pair up only between runs of one shape: "
            "drop --heads/--head to compare layers (aligned by relative depth)"
        )
    schemes = scheme_of(run_a.params), scheme_of(run_b.params)
    # the same windows grouped by different schemes do not pair group by group
    paired = schemes[0] == schemes[1] and same_windows(conn, run_a.run_id, run_b.run_id)
    interval = "paired" if paired else "independent"
    interval_by = schemes[0] if schemes[0] == schemes[1] else " / ".join(schemes)
    values_a = metric_values(conn, run_a.run_id, chosen, heads=heads)
    # one read for a run compared with itself: float sums need not add up in the same order twice
    values_b = values_a if run_b.run_id == run_a.run_id else metric_values(conn, run_b.run_id, chosen, heads=heads)
    units: list[tuple[tuple[int, ...], tuple[int, ...]]]
    if heads:
        units = [
            ((l, h), (l, h))
            for l in range(run_a.n_layers)
            for h in range(run_a.n_heads)
            if (layer is None or l == layer) and (head is None or h == head)
        ]
    else:
        pairs = align_layers(run_a.n_layers, run_b.n_layers)
        units = [((la,), (lb,)) for la, lb in pairs if layer is None or la == layer]
        if not units:  # a deeper A has layers with no partner in the shallower B
            raise ParameterError(
                f"--layer {layer}: run A ({run_a.name}, {run_a.n_layers} layers) pairs only its layers "
                f"{', '.join(str(la) for la, _ in pairs)} with run B's {run_b.n_layers} (nearest relative depth); "
                "pass one of those"
            )
    rows = []
    for key_a, key_b in units:
        reps_a, reps_b = values_a.get(key_a, {}), values_b.get(key_b, {})
        depths = (relative_depth(key_a[0], run_a.n_layers), relative_depth(key_b[0], run_b.n_layers))
        for metric in chosen:
            *cells, word = _compare_cell(reps_a, reps_b, metric, paired)
            rows.append(
                (key_a[0], key_b[0], key_a[1] if heads else None, *depths, metric, *cells, interval, interval_by, word)
            )
    return list(COLUMNS), rows


def comparisons(
    conn: Connection,
    run_a,
    run_b=None,
    *,
    metrics: Sequence[str] | None = None,
    layer: int | None = None,
    head: int | None = None,
    heads: bool = False,
) -> list[tuple[Run, list[str], list[tuple]]]:
    """Run A against run B, or (``run_b`` None) against each of A's random-weights controls:
    (B, columns, rows of ``compare``) each. A run without controls, and no B, is refused."""
    bs = [run_b] if run_b is not None else controls_of(conn, run_a)
    if not bs:
        raise ParameterError(
            f"compare {run_a.name}: run {run_a.run_id} ({run_a.name}) has no control run; pass RUN_B, "
            "or analyse again with --control"
        )
    out = []
    for b in bs:
        names, rows = compare(conn, run_a, b, metrics=metrics, layer=layer, head=head, heads=heads)
        out.append((b, names, rows))
    return out


def first_token_note(conn: Connection, runs: Sequence[Run], rows: list[tuple]) -> str | None:
    """For a causal run among ``runs`` whose compared metrics hold the [CLS] columns: a decoder has
    no [CLS], and there they measure attention to the first token (BOS, the attention sink)."""
    from headatlas.service.reports.attention_kind import causal_run

    at = COLUMNS.index("metric")
    named = sorted({r[at] for r in rows if r[at] in ("attn_to_cls", "attn_to_cls_lift")})
    causal = [r for r in runs if causal_run(conn, r.run_id)]
    if not named or not causal:
        return None
    which = ", ".join(f"run {r.run_id} ({r.name})" for r in causal)
    return (
        f"{', '.join(named)}: for a causal model ({which}) the [CLS] column means the first token, the sink most "
        "heads attend to (attn_to_first in its own tables)"
    )


def floor_note(run_a, run_b) -> str:
    """`` (B is A's random-weights control, seed N: …)`` where it is, else empty."""
    if not is_control(run_a, run_b):
        return ""
    return f" (B is A's random-weights control, seed {control_seed(run_b)}: the floor every claim should beat)"


def parameter_differences(run_a, run_b) -> list[str]:
    """The analysis parameters in which the runs differ ("select: top:0.02 vs top:0.05"): a
    difference in metrics may come from them rather than from the models or corpora."""
    keys = sorted((set(run_a.params) | set(run_b.params)) - set(CONTROL_PARAMS))
    return [
        f"{k}: {run_a.params.get(k)} vs {run_b.params.get(k)}"
        for k in keys
        if run_a.params.get(k) != run_b.params.get(k)
    ]


CONTROL_PARAMS = ("control_of", "control_seed")  # the link to the parent run, not an analysis parameter


def control_seed(run) -> int:
    """The seed of a control run's random weights (controls stored before seeds were recorded: 0)."""
    return int(run.params.get("control_seed", 0))


def controls_of(conn: Connection, run) -> list[Run]:
    """Every random-weights control of ``run`` (``analyze --control N``), by seed; for a seed
    analysed twice, the latest run."""
    from headatlas.service.storage.store import resolve_run

    rows = conn.execute(
        text("SELECT run_id FROM runs WHERE json_extract_string(params, '$.control_of') = :key ORDER BY run_id"),
        {"key": run.run_key},
    ).all()
    by_seed = {}
    for (run_id,) in rows:
        control = resolve_run(conn, run_id)
        by_seed[control_seed(control)] = control
    return [by_seed[s] for s in sorted(by_seed)]


def control_of(conn: Connection, run) -> Run | None:
    """The random-weights control of ``run`` with the smallest seed (0 unless only others were
    analysed), or None."""
    controls = controls_of(conn, run)
    return controls[0] if controls else None


def is_control(run_a, run_b) -> bool:
    """Whether ``run_b`` is a random-weights control of ``run_a``."""
    return run_b.params.get("control_of") == run_a.run_key


def _stored_reps(conn: Connection, run_id: int, kind: str, columns: list[str]) -> list[tuple] | None:
    """The run's stored ``*_metrics_reps`` rows (``reports.stored``), these columns only; None where
    none are current or a column is not among them."""
    from headatlas.service.storage import run_results

    kept = run_results.load(conn, run_id, kind)
    if kept is None or any(c not in kept[0] for c in columns):
        return None
    pick = itemgetter(*(kept[0].index(c) for c in columns))
    return [pick(r) for r in kept[1]] if len(columns) > 1 else [(pick(r),) for r in kept[1]]


def layer_profile(conn: Connection, run, metrics: Sequence[str]) -> Rows:
    """Per layer of ``run``: each metric with its 95% interval (``<metric>_lo``, ``_hi``) — what
    ``plot compare`` draws."""
    chosen = check_metrics(metrics)
    values = metric_values(conn, run.run_id, chosen, heads=False)
    columns = ["layer", *chosen]
    rows = [(l, *(values.get((l,), {}).get(-1, {}).get(m) for m in chosen)) for l in range(run.n_layers)]
    reps = [(l, g, *(v[m] for m in chosen)) for (l,), by in values.items() for g, v in by.items() if g >= 0]
    return add_intervals(columns, rows, reps, keys=("layer",), metrics=chosen, scheme=scheme_of(run.params))
