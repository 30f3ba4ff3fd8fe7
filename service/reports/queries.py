"""Questions users ask of a run's heads, as SQL over the views (SPEC §5): the head table with its
anchors and probe scores, the averaged similarity matrices, and the run's summary. Returns
(columns, rows). The layer, distance, mixing and trend queries are in ``layer_queries``,
``distance_queries``, ``mixing_queries`` and ``trend_queries``; what they share in ``query_support``.

Column names are SPEC names; layers and heads are 0-based (the papers count from 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import Param, ParameterError, Phrase
from headatlas.service.metrics import EFFECT_SUMS, plugin_metrics
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
from headatlas.service.reports.query_support import Rows, fetch_rows, for_attention, with_intervals, without_intervals
from headatlas.service.storage import runs


def _check_sort(sort: str | None, allowed) -> None:
    if sort is not None and sort not in allowed:
        raise unknown_metric("sort", sort, allowed, what="a metric of the heads")


def _view_head_columns(conn: Connection, named: Sequence[tuple[str, str]]) -> list[str]:
    """``head_columns()`` that the database's ``head_metrics`` holds: an installed plugin's columns
    appear there with the ``db upgrade`` after its install (the views are built from what is
    installed then), and so do headatlas's columns derived from tables an earlier version made (the
    streaming effects'). One that ``named`` ((option, column) pairs) asks for and the views lack
    yet is refused, naming the fix."""
    wanted = head_columns()
    held = _held_columns(conn)
    for option, column in named:
        if column in wanted and column not in held:
            whose = "a column" if column in HEAD_COLUMNS else "an installed plugin's column"
            raise ParameterError(
                Param(option, column),
                f": {whose} that this database's views do not hold yet",
                hint="run `headatlas db upgrade`, which builds the views again from the declared columns",
            )
    return [c for c in wanted if c in held or c in ("layer", "head")]


def _held_columns(conn: Connection) -> set[str]:
    """The columns of the database's ``head_metrics``, from DuckDB's catalogue (a few ms, where
    binding the view to ask it costs tens), or by binding it where the catalogue lists none."""
    rows = conn.execute(
        text(
            "SELECT column_name FROM duckdb_columns() WHERE table_name = 'head_metrics' "
            "AND database_name = current_database() AND schema_name = current_schema()"
        )
    ).all()
    return {r[0] for r in rows} or set(conn.execute(text("SELECT * FROM head_metrics LIMIT 0")).keys())


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


# the anchors of each head, most frequent first (``:run``, ``:n_anchors``): ``top_anchors (layer, head, anchors)``.
# ``counts`` is the view ``anchor_counts`` of the one run, its windows summed from ``run_chance`` as
# ``chance_totals`` sums them (integers: the same sum; NULL where a row holds none): the view joins
# the replicated view chain, which DuckDB binds and plans at every read (the top anchors were the
# suite's costliest statement by CPU: benchmarks/suite_operations.py; tests/test_streaming_columns.py
# compares the two).
ANCHOR_COUNTS_SQL = """
        counts AS (
            SELECT a.layer, a.head, a.token_id, any_value(a.token) AS token, sum(a.windows) AS windows,
                   sum(a.windows) / any_value(c.windows) AS window_share
            FROM anchor_tokens a JOIN (
                SELECT run_id, CASE WHEN count(windows) = count(*) THEN sum(windows) END AS windows
                FROM run_chance WHERE run_id = :run GROUP BY run_id
            ) c USING (run_id)
            WHERE a.run_id = :run
            GROUP BY a.layer, a.head, a.token_id
        )"""
TOP_ANCHORS_SQL = f"""{ANCHOR_COUNTS_SQL},
        ranked AS (
            SELECT layer, head, token, window_share,
                   row_number() OVER (PARTITION BY layer, head ORDER BY windows DESC, token) AS rank
            FROM counts
        ),
        top_anchors AS (
            SELECT layer, head,
                   string_agg(token || ' ' || printf('%.0f%%', 100 * window_share), ', ' ORDER BY rank) AS anchors
            FROM ranked WHERE rank <= :n_anchors GROUP BY layer, head
        )
"""
NO_ANCHORS_SQL = """
        top_anchors AS (SELECT CAST(NULL AS INTEGER) AS layer, CAST(NULL AS INTEGER) AS head,
                               CAST(NULL AS VARCHAR) AS anchors WHERE false)
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
        columns, rows = without_intervals((columns, rows))
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
    if ascending and sort is None:  # one refusal for every front end, in its own terms
        from headatlas.service.errors import Param, ParameterError, Placeholder

        raise ParameterError(
            Param("asc", True),
            " orders the ",
            Param("sort"),
            " metric: pass ",
            Param("sort", Placeholder("METRIC")),
            " too",
        )
    _check_sort(sort, sortable())
    named = [("sort", sort or ""), *(("columns", c) for c in shown)]
    columns = _view_head_columns(conn, named)
    _check_held(conn, run_id, named)
    if clip and not with_df:
        kept = _stored_heads(conn, run_id, layer=layer, sort=sort, top=top, anchors=anchors, ci=ci, ascending=ascending)
        if kept is not None:
            return kept
    from headatlas.service.reports.query_support import one_read

    # every head with intervals: the values and their intervals from one read of head_metrics_reps
    with one_read(ci and layer is None and sort is None and top is None):
        order = f"{sort} {'ASC' if ascending else 'DESC'} NULLS LAST, layer, head" if sort else "layer, head"
        cols = ", ".join(f"m.{c}" for c in columns)
        probe = ", ".join(f"p.{c}" for c in PROBE_COLUMNS)
        # no anchors asked (the role tests): none ranked either (a window over every anchor of the run)
        anchors_sql = TOP_ANCHORS_SQL if anchors else NO_ANCHORS_SQL
        sql = f"""
            WITH {anchors_sql}
            SELECT {cols}, a.anchors AS top_anchors, {probe}
            FROM head_metrics m LEFT JOIN top_anchors a USING (layer, head)
            LEFT JOIN probe_scores p ON p.run_id = m.run_id AND p.layer = m.layer AND p.head = m.head
            WHERE m.run_id = :run AND (CAST(:layer AS INTEGER) IS NULL OR m.layer = :layer)
            ORDER BY {order}
            LIMIT :limit
        """
        params = {"layer": layer}
        rows = _head_rows(conn, sql, run_id, anchors, (tuple(columns), layer, sort, top, ascending), params)
        if anchors and byte_level_run(conn, run_id):
            names, values = rows
            ai = names.index("top_anchors")
            rows = names, [(*r[:ai], anchors_as_text(r[ai]), *r[ai + 1 :]) for r in values]
        if ci:
            rows = with_intervals(
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


def _head_rows(conn: Connection, sql: str, run_id: int, anchors: int, asked: tuple, params: dict) -> Rows:
    """The rows of ``heads``' statement ``sql``. Within ``shared_reads`` (a finished run's
    derivation), a read with anchors is kept, and one that asks the same (``asked``) without
    anchors (the role tests') takes its rows with ``top_anchors`` NULL: the same values of the same
    views, without a second plan of their chain."""
    from headatlas.service.reports.query_support import shared_cache

    cache = shared_cache()
    key = ("heads", run_id, *asked)
    kept = cache.get(key) if cache is not None else None
    if kept is not None and kept[0] == anchors:
        names, values = kept[1]
        return list(names), list(values)
    if kept is not None and not anchors:
        names, values = kept[1]
        ai = names.index("top_anchors")
        return list(names), [(*r[:ai], None, *r[ai + 1 :]) for r in values]
    columns, layer, sort, top, _ = asked
    if cache is not None and layer is None and sort is None and top is None:
        rows = _heads_from_reps(conn, run_id, columns, anchors)
    else:
        rows = fetch_rows(conn, sql, {"run": run_id, "limit": top or 1_000_000, "n_anchors": anchors, **params})
    if cache is not None and anchors:
        cache[key] = (anchors, rows)
    return rows


def _heads_from_reps(conn: Connection, run_id: int, columns: Sequence[str], anchors: int) -> Rows:
    """``heads``' rows of every head in layer and head order, within ``shared_reads``: ``head_metrics``
    is ``head_metrics_reps`` at ``drop_rep = -1``, and the derivation reads those rows anyway for
    the intervals (``replicate_view``), so its values come from them (one plan of the view chain
    fewer) and only the anchors and the probe's scores are read here."""
    from headatlas.service.reports.query_support import replicate_view

    names, every = replicate_view(conn, "head_metrics_reps", ("layer", "head"), run_id)
    drop = names.index("drop_rep")
    picked = [names.index(c) for c in columns]
    ranked: dict[tuple, str | None] = {}
    if anchors:
        found = conn.execute(
            text(f"WITH {TOP_ANCHORS_SQL} SELECT layer, head, anchors FROM top_anchors"),
            {"run": run_id, "n_anchors": anchors},
        )
        ranked = {(r[0], r[1]): r[2] for r in found}
    probe = ", ".join(PROBE_COLUMNS)
    scores = {
        (r[0], r[1]): tuple(r[2:])
        for r in conn.execute(
            text(f"SELECT layer, head, {probe} FROM probe_scores WHERE run_id = :run"), {"run": run_id}
        )
    }
    none = (None,) * len(PROBE_COLUMNS)
    li, hi = names.index("layer"), names.index("head")
    return [*columns, "top_anchors", *PROBE_COLUMNS], [
        (*(r[i] for i in picked), ranked.get((r[li], r[hi])), *scores.get((r[li], r[hi]), none))
        for r in every
        if r[drop] == -1
    ]


def byte_level_run(conn: Connection, run_id: int) -> bool:
    """Whether the run's anchors are strings of a byte-level vocabulary (``tokens.is_byte_level_text``);
    asked once within ``shared_reads``."""
    from headatlas.service.reports.query_support import shared_value

    def ask() -> bool:
        # a row of ``counts`` (ANCHOR_COUNTS_SQL) is a token of the run's anchors where the run
        # has chance rows: asked of the tokens themselves, not of their sums per head (this check
        # was one of that aggregation's two callers, the suite's costliest statement by CPU)
        found = conn.execute(
            text(
                "SELECT 1 FROM anchor_tokens WHERE run_id = :run AND (token LIKE 'Ġ%' OR token = 'Ċ') "
                "AND EXISTS (SELECT 1 FROM run_chance WHERE run_id = :run) LIMIT 1"
            ),
            {"run": run_id},
        ).first()
        return found is not None

    return shared_value(("byte_level_run", run_id), ask)


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
    return fetch_rows(
        conn,
        f"""
        SELECT {", ".join(CSM_COLUMNS)} FROM csm_means
        WHERE run_id = :run AND layer = :layer AND (CAST(:head AS INTEGER) IS NULL OR head = :head)
          AND (CAST(:kind AS VARCHAR) IS NULL OR kind = :kind)
        ORDER BY head, kind, bin_i, bin_j
    """,
        {"run": run_id, "layer": layer, "head": head, "kind": kind},
    )


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
