"""Questions users ask of a run, as SQL over the views (SPEC §5). Returns (columns, rows).

Column names are SPEC names; layers and heads are 0-based (the papers count from 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.engine.results import MIXING_METHODS
from headatlas.service.errors import Param, ParameterError, Phrase
from headatlas.service.metrics import COLUMNS, EFFECT_SUMS, plugin_metrics
from headatlas.service.reports.attention_kind import causal_run
from headatlas.service.reports.columns import (
    HEAD_COLUMNS,
    PROBE_COLUMNS,
    head_columns,
    sortable,
    unknown_metric,
)
from headatlas.service.reports.columns import (
    SORTABLE as SORTABLE,  # headatlas's own: what `plot` checks its --metric against
)
from headatlas.service.storage import runs

# counts and run-level chances carry no interval of their own
NO_INTERVAL = {
    *(c.name for c in COLUMNS if not c.interval),
    "layer",
    "head",
    "windows",
    "heads",
    "top_anchors",
    "top_head",
    "heads_above_chance",
    "heads_above_chance_dm",
    "max_head_within_sentence",
    *PROBE_COLUMNS,  # one probe per run: no replicate groups
}

# What each lift is measured against, in one line (shown wherever lifts are printed).
LIFT_NOTE = (
    "lift = share / chance; *_lift: chance = all pairs of the window (ignores distance); "
    "*_lift_dm: chance matched to the head's own distances (SPEC §5b); "
    "attn_*_lift, dup_lift, induction_lift: against uniform attention over each row's visible keys. "
    ">1 = above that chance."
)

Rows = tuple[list[str], list[tuple]]


def _rows(conn: Connection, sql: str, params: dict) -> Rows:
    result = conn.execute(text(sql), params)
    # fetched at once: row by row, a head's distances (72,000 rows for MiniLM) took a second
    return list(result.keys()), [tuple(r) for r in result.fetchall()]


def interval_metrics(columns: list[str]) -> list[str]:
    """The columns of ``columns`` that get an interval (``--ci``): not NO_INTERVAL's, nor an
    installed plugin's declared without one."""
    plugged = {c.name for m in plugin_metrics() for c in m.columns if not c.interval}
    return [c for c in columns if c not in NO_INTERVAL and c not in plugged]


def replicate_scheme(conn: Connection, run_id: int) -> str:
    """The replicate scheme a run's intervals use, as the run recorded it (SPEC §5d): ``document``,
    ``block:B``, or ``window`` for runs stored before the scheme was recorded."""
    from headatlas.service.reports.intervals import WINDOW_SCHEME

    value = conn.execute(
        text("SELECT json_extract_string(params, '$.replicates') FROM runs WHERE run_id = :run"), {"run": run_id}
    ).scalar()
    return value or WINDOW_SCHEME


def _with_intervals(
    conn: Connection,
    rows: Rows,
    *,
    view: str,
    keys: tuple[str, ...],
    run_id: int,
    where: str = "",
    params: dict | None = None,
    clip: bool = True,
    with_df: bool = False,
) -> Rows:
    """Add ``<metric>_lo``/``<metric>_hi`` (95%, delete-one-group jackknife) from ``view``'s
    leave-one-group-out rows, and ``interval_by``: the run's replicate scheme. ``clip``: bounds
    clipped to what each metric can take (``intervals.add_intervals``); False: unclipped, the
    interval the role tests read. ``with_df``: also ``<metric>_df``, the degrees of freedom of
    each interval's t quantile (the role tests' too). Lifts' intervals are on the log scale either way."""
    from headatlas.service.reports.intervals import add_intervals

    columns, values = rows
    metrics = [c for c in interval_metrics(columns) if c not in keys]
    rep_rows = conn.execute(
        text(
            f"SELECT {', '.join(keys)}, drop_rep, {', '.join(metrics)} FROM {view} "
            f"WHERE run_id = :run AND drop_rep >= 0 {where}"
        ),
        {"run": run_id, **(params or {})},
    ).all()
    return add_intervals(
        columns,
        values,
        rep_rows,
        keys=keys,
        metrics=metrics,
        scheme=replicate_scheme(conn, run_id),
        clip=clip,
        with_df=with_df,
        groups_of=effect_groups_of(conn, run_id, metrics),
    )


def effect_groups_of(conn: Connection, run_id: int, metrics: list[str]) -> dict[str, frozenset[int]]:
    """The causal effects among ``metrics`` (SPEC §9), each with the replicate groups that hold
    the run's effect windows: their intervals rest on those groups alone."""
    from headatlas.service.metrics import EFFECT_COLUMNS
    from headatlas.service.storage.effect_rows import effect_groups

    chosen = [m for m in metrics if m in EFFECT_COLUMNS]
    if not chosen:
        return {}
    groups = effect_groups(conn, run_id)
    return {m: groups for m in chosen}


def interval_groups(conn: Connection, run_id: int) -> tuple[int, int]:
    """(replicate groups holding windows, windows) of a run: what its intervals rest on."""
    groups, windows = conn.execute(
        text(
            "SELECT (SELECT count(*) FROM run_reps WHERE run_id = :run), "
            "(SELECT coalesce(sum(windows), 0) FROM run_chance WHERE run_id = :run)"
        ),
        {"run": run_id},
    ).one()
    return int(groups), int(windows)


def interval_warning(conn: Connection, run_id: int) -> str | None:
    """The warning to show beside a run's intervals when they rest on too few replicate groups
    (``intervals.unreliable_note``), else None."""
    from headatlas.service.reports.intervals import unreliable_note

    note = unreliable_note(*interval_groups(conn, run_id))
    return None if note is None else f"run {run_id}: {note}"


def _check_sort(sort: str | None, allowed) -> None:
    if sort is not None and sort not in allowed:
        raise unknown_metric("sort", sort, allowed, what="a metric of the heads")


def _view_head_columns(conn: Connection, named: Sequence[tuple[str, str]]) -> list[str]:
    """``head_columns()`` that the database's ``head_metrics`` holds: an installed plugin's columns
    appear there with the ``db upgrade`` after its install (the views are built from what is
    installed then). One that ``named`` ((option, column) pairs) asks for and the views lack yet is
    refused, naming the fix."""
    wanted = head_columns()
    if wanted == HEAD_COLUMNS:
        return list(wanted)
    held = set(conn.execute(text("SELECT * FROM head_metrics LIMIT 0")).keys())
    for option, column in named:
        if column in wanted and column not in HEAD_COLUMNS and column not in held:
            raise ParameterError(
                Param(option, column),
                ": an installed plugin's column that this database's views do not hold yet",
                hint="run `headatlas db upgrade`, which builds the installed plugins' columns into the views",
            )
    return [c for c in wanted if c in HEAD_COLUMNS or c in held]


def _check_held(conn: Connection, run_id: int, named: Sequence[tuple[str, str]]) -> None:
    """A column a measure the run was analysed without fills (a probe score, a causal effect:
    every value NULL) sorts or shows nothing: refused, naming the option that named it (``named``:
    (option, column) pairs, such as ``("sort", "effect_zero")``) and how to get the measure; so
    is an installed plugin's column the run holds no value of (its sums were never stored)."""
    plugged = {c.name: m for m in plugin_metrics() for c in m.columns if c.heads}
    for option, column in named:
        if column in plugged:
            held = conn.execute(
                text(f"SELECT count({column}) FROM head_metrics WHERE run_id = :run"), {"run": run_id}
            ).scalar()
            if not held:
                metric = plugged[column]
                sums = ", ".join(s.name for s in metric.sums)
                raise ParameterError(
                    Param(option, column),
                    f": run {run_id} holds no value of it",
                    hint=(
                        f"its sums ({sums}) were not stored by the run's batches: analyse with the measure that "
                        "computes them"
                        if sums
                        else f"{metric.origin}'s column is undefined for every head of the run"
                    ),
                )
        elif column in PROBE_COLUMNS:
            probed = conn.execute(
                text("SELECT 1 FROM probe_scores WHERE run_id = :run LIMIT 1"), {"run": run_id}
            ).first()
            if probed is None:
                raise ParameterError(
                    Param(option, column),
                    f": run {run_id} has no probe",
                    hint=(
                        "run its analyze command again with ",
                        Param("probe", True),
                        " (only the probe is computed), or its submit command with ",
                        Param("probe", True),
                    ),
                )
        elif column in EFFECT_KIND:
            held = conn.execute(
                text(f"SELECT count({column}) FROM head_metrics WHERE run_id = :run"), {"run": run_id}
            ).scalar()
            kind = EFFECT_KIND[column]
            asked = runs.resolve_run(conn, run_id, any_status=True).params.get("effects") or ()
            if not held and kind in asked:  # measured, but no effect window stored yet (a run under way)
                raise ParameterError(
                    Param(option, column), f": run {run_id} holds no {column} yet: none of its effect windows is stored"
                )
            if not held:
                raise ParameterError(
                    Param(option, column),
                    f": run {run_id} holds no {column}: it was analysed without ",
                    Param("effects", kind),
                    hint=(
                        "analyse its corpus again with ",
                        Param("effects", kind),
                        " (a new run), or measure them without storing with ",
                        Phrase("`headatlas effects CORPUS`", "`headatlas.effects(corpus)`"),
                    ),
                )


# the per-head causal effects (SPEC §9) and the --effects kind that measures each
EFFECT_KIND = {column: kind for kind, columns in EFFECT_SUMS.items() for column in columns}


# the anchors of each head, most frequent first (``:run``, ``:n_anchors``): ``top_anchors (layer, head, anchors)``
TOP_ANCHORS_SQL = """
        ranked AS (
            SELECT layer, head, token, window_share,
                   row_number() OVER (PARTITION BY layer, head ORDER BY windows DESC, token) AS rank
            FROM anchor_counts WHERE run_id = :run
        ),
        top_anchors AS (
            SELECT layer, head,
                   string_agg(token || ' ' || printf('%.0f%%', 100 * window_share), ', ' ORDER BY rank) AS anchors
            FROM ranked WHERE rank <= :n_anchors GROUP BY layer, head
        )
"""
STORED_ANCHORS = 3  # the anchors of the stored heads (``query heads``' default)


def _stored_heads(
    conn: Connection,
    run_id: int,
    *,
    layer: int | None,
    sort: str | None,
    top: int | None,
    anchors: int,
    ci: bool,
    ascending: bool,
) -> Rows | None:
    """``heads`` from the run's stored results (``reports.stored``: ``query heads --ci``), or None
    where none are current: the same rows, filtered, sorted and cut as the SQL would."""
    from headatlas.service.storage import run_results as stored

    kept = stored.load(conn, run_id, "heads")
    if kept is None:
        return None
    columns, rows = kept
    if sort is not None and sort not in columns:
        return None  # a column the run's kind of attention leaves out: sorted by SQL
    if anchors != STORED_ANCHORS and "top_anchors" in columns:
        ai = columns.index("top_anchors")
        listed = stored.load(conn, run_id, f"anchors:{anchors}")
        named = {(r[0], r[1]): r[2] for r in listed[1]} if listed else top_anchors(conn, run_id, anchors)
        rows = [(*r[:ai], named.get((r[0], r[1])), *r[ai + 1 :]) for r in rows]
    if not ci:
        added = {n for c in columns if f"{c}_lo" in columns and f"{c}_hi" in columns for n in (f"{c}_lo", f"{c}_hi")}
        added.add("interval_by")
        keep = [i for i, c in enumerate(columns) if c not in added]
        columns, rows = [columns[i] for i in keep], [tuple(r[i] for i in keep) for r in rows]
    if layer is not None:
        rows = [r for r in rows if r[0] == layer]
    if sort is not None:
        si = columns.index(sort)
        present = [r for r in rows if r[si] is not None]
        # NULLS LAST either way; ties by layer and head, the order rows are stored in (a sort
        # reversed is still stable)
        present.sort(key=lambda r: _sort_value(r[si]), reverse=not ascending)
        rows = present + [r for r in rows if r[si] is None]
    if top is not None:
        rows = rows[:top]
    return list(columns), rows


def _sort_value(value) -> float:
    """A value as DuckDB orders it: NaN above every number."""
    number = float(value)
    return math.inf if math.isnan(number) else number


def top_anchors(conn: Connection, run_id: int, n: int) -> dict[tuple[int, int], str | None]:
    """Each head's ``n`` most frequent anchors, as ``heads`` shows them in ``top_anchors``."""
    if n <= 0:
        return {}
    rows = conn.execute(
        text(f"WITH {TOP_ANCHORS_SQL} SELECT layer, head, anchors FROM top_anchors"), {"run": run_id, "n_anchors": n}
    ).all()
    byte_level = byte_level_run(conn, run_id)
    return {(r[0], r[1]): anchors_as_text(r[2]) if byte_level else r[2] for r in rows}


def heads(
    conn: Connection,
    run_id: int,
    *,
    layer: int | None = None,
    sort: str | None = None,
    top: int | None = None,
    anchors: int = 3,
    ci: bool = False,
    clip: bool = True,
    ascending: bool = False,
    with_df: bool = False,
    shown: Sequence[str] = (),
) -> Rows:
    """Per head, every column of HEAD_COLUMNS and the installed plugins' head columns (those the
    views hold: ``head_columns``), ``top_anchors`` and the probe's scores; sorted by
    ``sort`` (descending, or ``ascending``; heads without a value last), else by layer and head.
    ``ci``: with 95% intervals (``clip=False``: not clipped to each metric's range, for tests that
    read them; ``with_df``: with each interval's degrees of freedom, ``<metric>_df``, the role tests').
    ``sort`` or a column of ``shown`` (the columns picked to show, ``--columns``) that a measure the
    run was analysed without would fill (every value NULL: a probe score, an effect) is refused."""
    _check_sort(sort, sortable())
    named = [("sort", sort or ""), *(("columns", c) for c in shown)]
    columns = _view_head_columns(conn, named)
    _check_held(conn, run_id, named)
    if clip and not with_df:
        kept = _stored_heads(conn, run_id, layer=layer, sort=sort, top=top, anchors=anchors, ci=ci, ascending=ascending)
        if kept is not None:
            return kept
    order = f"{sort} {'ASC' if ascending else 'DESC'} NULLS LAST, layer, head" if sort else "layer, head"
    cols = ", ".join(f"m.{c}" for c in columns)
    probe = ", ".join(f"p.{c}" for c in PROBE_COLUMNS)
    sql = f"""
        WITH {TOP_ANCHORS_SQL}
        SELECT {cols}, a.anchors AS top_anchors, {probe}
        FROM head_metrics m LEFT JOIN top_anchors a USING (layer, head)
        LEFT JOIN probe_scores p ON p.run_id = m.run_id AND p.layer = m.layer AND p.head = m.head
        WHERE m.run_id = :run AND (CAST(:layer AS INTEGER) IS NULL OR m.layer = :layer)
        ORDER BY {order}
        LIMIT :limit
    """
    params = {"layer": layer}
    rows = _rows(conn, sql, {"run": run_id, "limit": top or 1_000_000, "n_anchors": anchors, **params})
    if anchors and byte_level_run(conn, run_id):
        names, values = rows
        ai = names.index("top_anchors")
        rows = names, [(*r[:ai], anchors_as_text(r[ai]), *r[ai + 1 :]) for r in values]
    if ci:
        rows = _with_intervals(
            conn,
            rows,
            view="head_metrics_reps",
            keys=("layer", "head"),
            run_id=run_id,
            where="AND (CAST(:layer AS INTEGER) IS NULL OR layer = :layer)",
            params=params,
            clip=clip,
            with_df=with_df,
        )
    return for_attention(conn, run_id, rows)


# A decoder has no [CLS] and no [SEP], and its rows never see the next token (SPEC §8): for a causal
# run the views' attn_to_cls is attn_to_first again, attn_to_sep is 0 or NULL and attn_to_next
# NULL. Its tables, figures and the report leave these out and show attn_to_first (BOS, the
# first token) instead; the SQL views keep them, with these values, for every run.
ENCODER_ONLY_COLUMNS = ("attn_to_cls", "attn_to_cls_lift", "attn_to_sep", "attn_to_sep_lift", "attn_to_next")
FIRST_TOKEN_COLUMNS = ("attn_to_first", "attn_to_first_lift")


def for_attention(conn: Connection, run_id: int, rows: Rows, *, encoder_hides: tuple[str, ...] = ()) -> Rows:
    """``rows`` without the columns the run's kind of attention has no use for: a causal run's
    ``ENCODER_ONLY_COLUMNS``, a bidirectional run's ``encoder_hides`` (with their intervals)."""
    hidden = ENCODER_ONLY_COLUMNS if causal_run(conn, run_id) else encoder_hides
    columns, data = rows
    if not hidden or not any(c in columns for c in hidden):
        return rows
    gone = {n for c in hidden for n in (c, f"{c}_lo", f"{c}_hi")}
    keep = [i for i, c in enumerate(columns) if c not in gone]
    return [columns[i] for i in keep], [tuple(r[i] for i in keep) for r in data]


def decoder_table(table: list[str], columns: list[str]) -> list[str]:
    """A table's default columns for the columns a query returned: ``attn_to_first_lift`` where a
    decoder's rows hold no ``attn_to_cls_lift``."""
    return [
        "attn_to_first_lift" if c == "attn_to_cls_lift" and c not in columns and "attn_to_first_lift" in columns else c
        for c in table
    ]


def byte_level_run(conn: Connection, run_id: int) -> bool:
    """Whether the run's anchors are strings of a byte-level vocabulary (``tokens.is_byte_level_text``)."""
    found = conn.execute(
        text("SELECT 1 FROM anchor_counts WHERE run_id = :run AND (token LIKE 'Ġ%' OR token = 'Ċ') LIMIT 1"),
        {"run": run_id},
    ).first()
    return found is not None


def anchors_as_text(anchors: str | None) -> str | None:
    """``"Ġthe 63%, Ġ 12%"`` → ``"the 63%, ␣ 12%"``: each anchor of a byte-level run as its text
    (``tokens.token_label``). A byte-level string holds no space, so the last space of an item
    parts the token from its share."""
    if not anchors:
        return anchors
    from headatlas.service.reports.tokens import token_label

    items = []
    for item in anchors.split("%, "):
        token, _, share = item.rpartition(" ")
        items.append(f"{token_label(token, True)} {share}")
    return "%, ".join(items)


def _distance_sql(every_head: bool) -> str:
    """``distances``' SQL: of one head (``:layer``, ``:head``; or the layer's heads pooled), or, with
    ``every_head``, of each head of the run (rows led by ``layer, head``): the same sums and ratios."""
    keys, c_keys = ("layer, head, ", "k.layer, k.head, ") if every_head else ("", "")
    where = "" if every_head else " AND layer = :layer AND (CAST(:head AS INTEGER) IS NULL OR head = :head)"
    heads = (
        ",\n        heads AS (SELECT DISTINCT layer, head FROM distance_reps WHERE run_id = :run)" if every_head else ""
    )
    joined = (
        "chance c CROSS JOIN heads k LEFT JOIN high h ON h.layer = k.layer AND h.head = k.head "
        "AND h.drop_rep = c.drop_rep AND h.distance = c.distance"
        if every_head
        else "chance c LEFT JOIN high h USING (drop_rep, distance)"
    )
    return f"""
        WITH chance AS (
            SELECT drop_rep, distance, pairs, pairs / sum(pairs) OVER (PARTITION BY drop_rep) AS chance_share
            FROM pair_reps WHERE run_id = :run AND (drop_rep = -1 OR :ci)
        ),
        high AS (
            SELECT {keys}drop_rep, distance, sum(high_pairs) AS high_pairs, sum(attended_pairs) AS attended_pairs
            FROM distance_reps
            WHERE run_id = :run{where}
              AND (drop_rep = -1 OR :ci)
            GROUP BY {keys}drop_rep, distance
        ){heads},
        j AS (
            SELECT {c_keys}c.drop_rep, c.distance, coalesce(h.high_pairs, 0) AS high_pairs,
                   coalesce(h.high_pairs, 0) - coalesce(h.attended_pairs, 0) AS noise_pairs,
                   coalesce(h.attended_pairs, 0) AS attended_pairs, c.chance_share,
                   -- the attended count is unavailable for runs stored before it existed
                   count(h.attended_pairs) OVER w = count(h.high_pairs) OVER w AS has_attended
            FROM {joined}
            WINDOW w AS (PARTITION BY {c_keys}c.drop_rep)
        )
        SELECT {keys}drop_rep, distance, high_pairs,
               high_pairs / nullif(sum(high_pairs) OVER w, 0) AS share,
               chance_share,
               share / nullif(chance_share, 0) AS lift,
               CASE WHEN has_attended THEN attended_pairs END AS attended_pairs,
               CASE WHEN has_attended THEN attended_pairs / nullif(sum(attended_pairs) OVER w, 0) END
                   AS attended_share,
               attended_share / nullif(chance_share, 0) AS attended_lift,
               CASE WHEN has_attended THEN noise_pairs END AS noise_pairs,
               CASE WHEN has_attended THEN noise_pairs / nullif(sum(noise_pairs) OVER w, 0) END AS noise_share,
               noise_share / nullif(chance_share, 0) AS noise_lift
        FROM j
        WINDOW w AS (PARTITION BY {keys}drop_rep)
        ORDER BY {keys}drop_rep, distance
    """


def distances(
    conn: Connection, run_id: int, *, layer: int, head: int | None = None, split: bool = False, ci: bool = False
) -> Rows:
    """Distance distribution of H (one head, or the layer's heads pooled) against chance;
    ``split``: also the attended (signal) and not-attended (noise) pairs' distributions. One head's
    with intervals, unsplit (a head's page), is read from the run's stored results while current."""
    if head is not None and ci and not split:
        from headatlas.service.storage import run_results as stored

        kept = stored.load(conn, run_id, "distances")
        if kept is not None:
            mine = [r[2:] for r in kept[1] if (r[0], r[1]) == (layer, head)]
            if mine:
                return kept[0][2:], mine
    columns, all_rows = _rows(conn, _distance_sql(False), {"run": run_id, "layer": layer, "head": head, "ci": ci})
    return _distance_result(columns, all_rows, split=split, ci=ci, scheme=replicate_scheme(conn, run_id) if ci else "")


def head_distances(conn: Connection, run_id: int) -> Rows:
    """``distances(…, layer=L, head=H, ci=True)`` of every head of the run, each row led by its
    ``layer`` and ``head``: one query for the run (what is stored for a head's page)."""
    columns, all_rows = _rows(conn, _distance_sql(True), {"run": run_id, "ci": True})
    scheme = replicate_scheme(conn, run_id)
    by_head: dict[tuple, list[tuple]] = {}
    for r in all_rows:
        by_head.setdefault((r[0], r[1]), []).append(r[2:])
    out_columns: list[str] = []
    rows: list[tuple] = []
    for key in sorted(by_head):
        out_columns, mine = _distance_result(columns[2:], by_head[key], split=False, ci=True, scheme=scheme)
        rows += [(*key, *r) for r in mine]
    return ["layer", "head", *out_columns], rows


def _distance_result(columns: list[str], all_rows: list[tuple], *, split: bool, ci: bool, scheme: str) -> Rows:
    keep = ["distance", "high_pairs", "share", "chance_share", "lift"]
    if split:
        keep += ["attended_pairs", "attended_share", "attended_lift", "noise_pairs", "noise_share", "noise_lift"]
    idx = [columns.index(c) for c in keep]
    rows = [tuple(r[i] for i in idx) for r in all_rows if r[0] == -1]
    if not ci:
        return keep, rows
    from headatlas.service.reports.intervals import add_intervals

    metrics = [c for c in keep if c.endswith(("share", "lift")) and c != "chance_share"]
    midx = [columns.index(c) for c in metrics]
    reps = [(r[1], r[0], *(r[i] for i in midx)) for r in all_rows if r[0] >= 0]
    return add_intervals(keep, rows, reps, keys=("distance",), metrics=metrics, scheme=scheme)


def boundaries(conn: Connection, run_id: int, *, ci: bool = False) -> Rows:
    """Per layer: do high-similarity pairs stay within sentences beyond what their distances
    explain, and does attention go to sentence separators beyond uniform?"""
    sql = """
        WITH per_head AS (
            SELECT layer, count(*) FILTER (WHERE within_sentence_lift > 1) AS heads_above_chance,
                   count(within_sentence_lift_dm) FILTER (WHERE within_sentence_lift_dm > 1) AS heads_above_chance_dm,
                   max(within_sentence) AS max_head_within_sentence,
                   -- the lowest of tied heads: arg_max picks any of them, and not always the same
                   -- (within_sentence is a ratio of counts, so small runs have exact ties)
                   arg_max(head, [within_sentence, -head]) FILTER (WHERE within_sentence IS NOT NULL) AS top_head
            FROM head_metrics WHERE run_id = :run GROUP BY layer
        )
        SELECT l.layer, l.within_sentence, l.within_sentence_chance, l.within_sentence_lift,
               l.within_sentence_chance_dm, l.within_sentence_lift_dm,
               p.heads_above_chance, p.heads_above_chance_dm, p.max_head_within_sentence, p.top_head,
               l.attn_to_punct, l.attn_to_punct_lift, l.attn_to_sep, l.attn_to_sep_lift,
               l.attn_to_cls, l.attn_to_cls_lift, l.attn_to_first, l.attn_to_first_lift
        FROM layer_metrics l JOIN per_head p USING (layer)
        WHERE l.run_id = :run ORDER BY l.layer
    """
    rows = _rows(conn, sql, {"run": run_id})
    if ci:
        rows = _with_intervals(conn, rows, view="layer_metrics_reps", keys=("layer",), run_id=run_id)
    # an encoder's first token is its [CLS]: attn_to_first would repeat attn_to_cls here
    return for_attention(conn, run_id, rows, encoder_hides=FIRST_TOKEN_COLUMNS)


def sentence_by_distance(conn: Connection, run_id: int, *, layer: int | None = None) -> Rows:
    """Per layer (its heads pooled) and distance: the within-sentence share of the high-similarity
    pairs at that distance against its chance, the share of all pairs at that distance sharing a
    sentence (SPEC §5b ``same_sentence_hist``); ``lift`` = share / that chance."""
    sql = """
        WITH h AS (
            SELECT layer, distance, sum(high_pairs) AS high_pairs,
                   CASE WHEN count(same_sentence_high) = count(*) THEN sum(same_sentence_high) END
                       AS same_sentence_high,
                   any_value(pairs) AS pairs, any_value(same_sentence_pairs) AS same_sentence_pairs
            FROM sentence_distance
            WHERE run_id = :run AND (CAST(:layer AS INTEGER) IS NULL OR layer = :layer)
            GROUP BY layer, distance
        )
        SELECT layer, distance, high_pairs, same_sentence_high,
               same_sentence_high / nullif(high_pairs, 0) AS within_sentence,
               same_sentence_pairs / nullif(pairs, 0) AS within_sentence_chance,
               within_sentence / nullif(within_sentence_chance, 0) AS within_sentence_lift
        FROM h ORDER BY layer, distance
    """
    columns, rows = _rows(conn, sql, {"run": run_id, "layer": layer})
    if rows and any(r[columns.index("same_sentence_high")] is None for r in rows):
        raise ParameterError(
            f"run {run_id} was stored before within-sentence pairs were counted by distance",
            hint=("analyse the corpus again into a new database (", Param("db"), ") to draw them"),
        )
    return columns, rows


CSM_COLUMNS = ("layer", "head", "kind", "bin_i", "bin_j", "pairs", "mean", "pair_share")


def csm(conn: Connection, run_id: int, *, layer: int, head: int | None = None, kind: str | None = None) -> Rows:
    """Cells of the corpus-averaged similarity matrices (SPEC §5c) of one head, or of every head of
    ``layer``: ``mean`` = mean C_ij of the cell's pairs, ``pair_share`` = the cell's pairs of this
    kind / all its pairs of P (1 for ``all``). Upper triangle (bin_i ≤ bin_j); cells without
    pairs are absent. ``kind``: one of CSM_KINDS, or None for all three."""
    from headatlas.service.engine.results import CSM_KINDS

    if kind is not None and kind not in CSM_KINDS:
        raise ParameterError(Param("kind", kind, quoted=True), f": choose one of {', '.join(CSM_KINDS)}")
    windows, covered = conn.execute(
        text(
            "SELECT sum(windows), CASE WHEN count(csm_windows) = count(*) THEN sum(csm_windows) END "
            "FROM run_chance WHERE run_id = :run"
        ),
        {"run": run_id},
    ).one()
    if covered is None or (windows and covered and covered < windows):
        raise ParameterError(
            f"run {run_id}: its averaged similarity matrices cover only some windows (batches stored "
            "before they existed)",
            hint=("analyse the corpus again into a new database (", Param("db"), ") to draw them"),
        )
    if not covered:
        raise ParameterError(
            f"run {run_id} has no averaged similarity matrices (analysed with ",
            Param("csm_bin", 0),
            ")",
            hint=("analyse again with ", Param("csm_bin", 8), " (the default) or 1 (full resolution)"),
        )
    return _rows(
        conn,
        f"""
        SELECT {", ".join(CSM_COLUMNS)} FROM csm_means
        WHERE run_id = :run AND layer = :layer AND (CAST(:head AS INTEGER) IS NULL OR head = :head)
          AND (CAST(:kind AS VARCHAR) IS NULL OR kind = :kind)
        ORDER BY head, kind, bin_i, bin_j
    """,
        {"run": run_id, "layer": layer, "head": head, "kind": kind},
    )


LAYER_COLUMNS = ("layer", *(c.name for c in COLUMNS if c.layers))


def layers(conn: Connection, run_id: int, *, ci: bool = False) -> Rows:
    """Per-layer summary: the progression from early to final layers, and anchor distinctness
    (SPEC §5): ``anchor_distinct_share`` = distinct anchors among the layer's anchored heads per
    window, over those heads, pooled over windows (1: every head its own anchor; 1/H: one anchor
    for all H heads)."""
    if ci:
        from headatlas.service.storage import run_results as stored

        kept = stored.load(conn, run_id, "layers")
        if kept is not None:
            return kept
    cols = ", ".join(f"l.{c}" for c in LAYER_COLUMNS)
    # the view's distinct_share (windows in which *all* the layer's anchors differ) stays for SQL:
    # with 12 heads that event almost never happens, so it measures the head count, not the heads
    sql = f"""
        SELECT {cols}, d.distinct_anchor_ratio AS anchor_distinct_share
        FROM layer_metrics l LEFT JOIN anchor_distinctness d USING (run_id, layer)
        WHERE l.run_id = :run ORDER BY l.layer
    """
    rows = _rows(conn, sql, {"run": run_id})
    if ci:
        columns, values = rows
        rows = _with_intervals(
            conn,
            (columns[: len(LAYER_COLUMNS)], [r[: len(LAYER_COLUMNS)] for r in values]),
            view="layer_metrics_reps",
            keys=("layer",),
            run_id=run_id,
        )
        rows = (rows[0] + columns[len(LAYER_COLUMNS) :], [a + b[len(LAYER_COLUMNS) :] for a, b in zip(rows[1], values)])
    return for_attention(conn, run_id, rows)


def run_summary(conn: Connection, run_id: int) -> dict:
    row = (
        conn.execute(
            text(
                "SELECT r.run_id, r.name, r.status, r.model_name, r.n_layers, r.n_heads, r.params, "
                f"coalesce(c.windows, 0) AS windows, {runs.compute_s_sql(conn)} AS compute_s, r.wall_s "
                "FROM runs r LEFT JOIN chance_totals c USING (run_id) WHERE r.run_id = :run"
            ),
            {"run": run_id},
        )
        .mappings()
        .first()
    )
    return dict(row) if row else {}


# --- mixing measures (SPEC §6) -------------------------------------------------------------------
MIXING_MEASURES = {
    # name shown: SQL over mixing_metrics
    "self": "to_self",
    "neighbours": "to_prev + to_next",
    "specials": "to_cls + to_sep",
    "punctuation": "to_punct",
    "mean_distance": "mean_distance",
}
METHOD_ORDER = MIXING_METHODS


def _mixing_methods(
    conn: Connection, run_id: int, methods: list[str] | None, *, parameter: str = "methods"
) -> list[str]:
    """The stored methods asked for (all stored when none); ``parameter``: the option that asked."""
    stored = [
        r[0]
        for r in conn.execute(text("SELECT DISTINCT method FROM mixing_metrics WHERE run_id = :run"), {"run": run_id})
    ]
    if not stored:
        raise ParameterError(
            f"run {run_id} has no mixing measures: analyse with ",
            Param("attribution", True),
            " and/or ",
            Param("mixing", "rollout,norm,alti"),
        )
    if not methods:
        return [m for m in METHOD_ORDER if m in stored]
    for m in methods:
        if m not in METHOD_ORDER:
            raise ParameterError(Param(parameter, m, quoted=True), f": choose one of {', '.join(METHOD_ORDER)}")
        if m not in stored:
            adds = Param("attribution", True) if m == "attribution" else Param("mixing", m)
            raise ParameterError(
                Param(parameter, m),
                f": run {run_id} has only {', '.join(x for x in METHOD_ORDER if x in stored)}",
                hint=("analyse with ", adds, " to add it"),
            )
    return list(dict.fromkeys(methods))


def mixing(conn: Connection, run_id: int, *, layer: int | None = None, methods: list[str] | None = None) -> Rows:
    """Where each output's mixture comes from: mass to self / neighbours / specials / punctuation
    and the mean distance, one column per method. Per layer (the layer-level rows), or per head
    of ``layer`` (head -1 = the layer-level row)."""
    chosen = _mixing_methods(conn, run_id, methods)
    measures = ", ".join(f"{sql} AS {name}" for name, sql in MIXING_MEASURES.items())
    where = "head = -1" if layer is None else "layer = :layer"
    result = conn.execute(
        text(
            f"SELECT layer, head, method, {measures} FROM mixing_metrics "
            f"WHERE run_id = :run AND {where} ORDER BY layer, head"
        ),
        {"run": run_id, "layer": layer},
    )
    values: dict[tuple, dict] = {}
    for row in result.mappings():
        if row["method"] in chosen:
            values.setdefault((row["layer"], row["head"]), {})[row["method"]] = row
    keys = sorted(values, key=lambda k: (k[0], k[1] if k[1] >= 0 else 10_000))  # layer row after its heads
    columns = (["layer"] if layer is None else ["layer", "head"]) + ["measure"] + chosen
    rows = []
    for key in keys:
        for measure in MIXING_MEASURES:
            by_method = values[key]
            cells = [by_method[m][measure] if m in by_method else None for m in chosen]
            lead = (key[0],) if layer is None else (key[0], "layer" if key[1] < 0 else key[1])
            rows.append((*lead, measure, *cells))
    return columns, rows


def discrepancy(conn: Connection, run_id: int, *, method: str = "attribution", top: int | None = None) -> Rows:
    """Per head: how far ``method``'s rows are from the head's attention rows (mean JSD, bits),
    ranked, with the layer's mean and what each says about self and distance."""
    _mixing_methods(conn, run_id, [method], parameter="method")
    sql = """
        WITH m AS (SELECT * FROM mixing_metrics WHERE run_id = :run AND head >= 0)
        SELECT row_number() OVER (ORDER BY x.jsd_attention DESC, x.layer, x.head) AS rank,
               x.layer, x.head, x.jsd_attention AS jsd,
               avg(x.jsd_attention) OVER (PARTITION BY x.layer) AS layer_mean_jsd,
               a.to_self AS attention_self, x.to_self AS method_self,
               a.mean_distance AS attention_distance, x.mean_distance AS method_distance,
               a.entropy AS attention_entropy, x.entropy AS method_entropy
        FROM m x JOIN m a ON a.method = 'attention' AND a.layer = x.layer AND a.head = x.head
        WHERE x.method = :method
        ORDER BY rank LIMIT :limit
    """
    return _rows(conn, sql, {"run": run_id, "method": method, "limit": top or 1_000_000})


def discrepancy_layers(conn: Connection, run_id: int, *, method: str = "attribution") -> Rows:
    """Per layer: mean and spread of the per-head JSD, and the layer-level rows' JSD and self share."""
    _mixing_methods(conn, run_id, [method], parameter="method")
    sql = """
        SELECT layer,
               avg(jsd_attention) FILTER (WHERE head >= 0) AS mean_head_jsd,
               min(jsd_attention) FILTER (WHERE head >= 0) AS min_head_jsd,
               max(jsd_attention) FILTER (WHERE head >= 0) AS max_head_jsd,
               any_value(jsd_attention) FILTER (WHERE head = -1) AS layer_jsd,
               any_value(to_self) FILTER (WHERE head = -1) AS layer_self,
               any_value(mean_distance) FILTER (WHERE head = -1) AS layer_mean_distance
        FROM mixing_metrics WHERE run_id = :run AND method = :method
        GROUP BY layer ORDER BY layer
    """
    return _rows(conn, sql, {"run": run_id, "method": method})


LAYER_METRICS = tuple(c for c in HEAD_COLUMNS[2:] if c not in ("high_pairs", "windows"))


def _check_schedule_shape(conn: Connection, schedule_id: int, layer: int, head: int | None) -> None:
    """``--layer``/``--head`` within every run of the schedule (a layer no run has would show as a
    trend of empty values)."""
    n_layers, n_heads = conn.execute(
        text(
            "SELECT min(n_layers), min(n_heads) FROM runs WHERE run_key IN "
            "(SELECT run_key FROM schedule_fires WHERE schedule_id = :s)"
        ),
        {"s": schedule_id},
    ).one()
    if n_layers is None:  # no run yet: nothing to check against, and an empty trend is the truth
        return
    if not 0 <= layer < n_layers:
        raise ParameterError(Param("layer", layer), f": the schedule's runs have layers 0..{n_layers - 1} (0-based)")
    if head is not None and not 0 <= head < n_heads:
        raise ParameterError(Param("head", head), f": the schedule's runs have heads 0..{n_heads - 1} (0-based)")


def trend(
    conn: Connection,
    schedule_id: int,
    *,
    metric: str,
    layer: int | None = None,
    head: int | None = None,
    ci: bool = False,
) -> Rows:
    """A metric across a schedule's runs, in fire order: one head (``layer`` and ``head``, from
    head_metrics), one layer (``layer``, from layer_metrics) or the mean over layers. A run
    shared by several fires (nothing changed between them) appears once, at its first fire."""
    if head is not None and layer is None:
        raise ParameterError(Param("head"), " needs ", Param("layer"), ": a head is named by its layer and its index")
    allowed = sortable() if head is not None else LAYER_METRICS
    if metric not in allowed:
        raise unknown_metric("metric", metric, allowed)
    if layer is not None:
        _check_schedule_shape(conn, schedule_id, layer, head)
    if head is not None:
        value = (
            f"SELECT run_id, drop_rep, {metric} AS value FROM head_metrics_reps WHERE layer = :layer AND head = :head"
        )
    elif layer is not None:
        value = f"SELECT run_id, drop_rep, {metric} AS value FROM layer_metrics_reps WHERE layer = :layer"
    else:
        value = f"SELECT run_id, drop_rep, avg({metric}) AS value FROM layer_metrics_reps GROUP BY run_id, drop_rep"
    sql = f"""
        WITH fired AS (
            SELECT run_key, min(fire_time) AS fire_time FROM schedule_fires
            WHERE schedule_id = :s AND run_key IS NOT NULL GROUP BY run_key
        ),
        mine AS (SELECT r.run_id, r.name, r.status, f.fire_time FROM fired f JOIN runs r USING (run_key)),
        v AS (SELECT * FROM ({value}) WHERE run_id IN (SELECT run_id FROM mine) AND (drop_rep = -1 OR :ci))
        SELECT mine.fire_time, mine.run_id, mine.name AS run, mine.status, v.drop_rep, v.value AS {metric}
        FROM mine LEFT JOIN v USING (run_id)
        ORDER BY mine.fire_time, v.drop_rep
    """
    columns, all_rows = _rows(conn, sql, {"s": schedule_id, "layer": layer, "head": head, "ci": ci})
    keep = [c for c in columns if c != "drop_rep"]
    rows = [tuple(v for c, v in zip(columns, r) if c != "drop_rep") for r in all_rows if r[4] is None or r[4] == -1]
    if not ci:
        return keep, rows
    from headatlas.service.reports.intervals import add_intervals

    reps = [(r[1], r[4], r[5]) for r in all_rows if r[4] is not None and r[4] >= 0]
    columns, rows = add_intervals(keep, rows, reps, keys=("run_id",), metrics=[metric])
    # each fire's run says its own replicate scheme (SPEC §5d)
    run_idx = columns.index("run_id")
    return [*columns, "interval_by"], [(*r, replicate_scheme(conn, r[run_idx])) for r in rows]
