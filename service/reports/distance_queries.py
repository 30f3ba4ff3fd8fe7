"""Distances of a run's high-similarity pairs (SPEC §5, §5b): one head's or a layer's distribution
against chance, split into attended and not-attended pairs, and the within-sentence share by
distance. Returns (columns, rows).
"""

from __future__ import annotations

from sqlalchemy.engine import Connection

from headatlas.service.errors import Param, ParameterError
from headatlas.service.reports.query_support import Rows, fetch_rows, replicate_scheme


def _distance_sql(every_head: bool, split: bool = True) -> str:
    """``distances``' SQL: of one head (``:layer``, ``:head``; or the layer's heads pooled), or, with
    ``every_head``, of each head of the run (rows led by ``layer, head``): the same sums and ratios.
    ``split=False``: without the attended and not-attended pairs' columns (the same values of the
    others, for a read that shows none of them)."""
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
    # the attended count is unavailable for runs stored before it existed
    has_attended = (
        ",\n                   count(h.attended_pairs) OVER w = count(h.high_pairs) OVER w AS has_attended"
        if split
        else ""
    )
    window = f"\n            WINDOW w AS (PARTITION BY {c_keys}c.drop_rep)" if split else ""
    split_columns = (
        """,
               CASE WHEN has_attended THEN attended_pairs END AS attended_pairs,
               CASE WHEN has_attended THEN attended_pairs / nullif(sum(attended_pairs) OVER w, 0) END
                   AS attended_share,
               attended_share / nullif(chance_share, 0) AS attended_lift,
               CASE WHEN has_attended THEN noise_pairs END AS noise_pairs,
               CASE WHEN has_attended THEN noise_pairs / nullif(sum(noise_pairs) OVER w, 0) END AS noise_share,
               noise_share / nullif(chance_share, 0) AS noise_lift"""
        if split
        else ""
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
                   coalesce(h.attended_pairs, 0) AS attended_pairs, c.chance_share{has_attended}
            FROM {joined}{window}
        )
        SELECT {keys}drop_rep, distance, high_pairs,
               high_pairs / nullif(sum(high_pairs) OVER w, 0) AS share,
               chance_share,
               share / nullif(chance_share, 0) AS lift{split_columns}
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
    sql = _distance_sql(False, split)
    columns, all_rows = fetch_rows(conn, sql, {"run": run_id, "layer": layer, "head": head, "ci": ci})
    return _distance_result(columns, all_rows, split=split, ci=ci, scheme=replicate_scheme(conn, run_id) if ci else "")


def head_distances(conn: Connection, run_id: int) -> Rows:
    """``distances(…, layer=L, head=H, ci=True)`` of every head of the run, each row led by its
    ``layer`` and ``head``: one query for the run (what is stored for a head's page), its intervals
    formed for every head at once (``add_intervals`` keyed by layer, head and distance)."""
    columns, all_rows = fetch_rows(conn, _distance_sql(True, split=False), {"run": run_id, "ci": True})
    # each row (layer, head, drop_rep, …) as _distance_result reads it, (drop_rep, …), led by the head
    rows = sorted(all_rows, key=lambda r: (r[0], r[1]))
    out_columns, out_rows = _distance_result(
        columns[2:],
        [r[2:] for r in rows],
        split=False,
        ci=True,
        scheme=replicate_scheme(conn, run_id),
        heads=[r[:2] for r in rows],
    )
    return ["layer", "head", *out_columns], out_rows


def _distance_result(
    columns: list[str],
    all_rows: list[tuple],
    *,
    split: bool,
    ci: bool,
    scheme: str,
    heads: list[tuple] | None = None,
) -> Rows:
    """The kept columns of ``all_rows`` (each ``(drop_rep, distance, …)``), the whole run's rows
    (drop_rep -1) with their intervals. ``heads``: each row's ``(layer, head)``, leading its output
    row; the intervals then are each head's own."""
    keep = ["distance", "high_pairs", "share", "chance_share", "lift"]
    if split:
        keep += ["attended_pairs", "attended_share", "attended_lift", "noise_pairs", "noise_share", "noise_lift"]
    idx = [columns.index(c) for c in keep]
    lead = heads or [()] * len(all_rows)
    rows = [(*h, *(r[i] for i in idx)) for h, r in zip(lead, all_rows) if r[0] == -1]
    keys = ("layer", "head", "distance") if heads else ("distance",)
    shown = [*keys[:-1], *keep]
    if not ci:
        return shown, rows
    from headatlas.service.reports.intervals import add_intervals

    metrics = [c for c in keep if c.endswith(("share", "lift")) and c != "chance_share"]
    midx = [columns.index(c) for c in metrics]
    reps = [(*h, r[1], r[0], *(r[i] for i in midx)) for h, r in zip(lead, all_rows) if r[0] >= 0]
    out_columns, out_rows = add_intervals(shown, rows, reps, keys=keys, metrics=metrics, scheme=scheme)
    return (out_columns[len(keys) - 1 :], out_rows) if heads else (out_columns, out_rows)


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
    columns, rows = fetch_rows(conn, sql, {"run": run_id, "layer": layer})
    if rows and any(r[columns.index("same_sentence_high")] is None for r in rows):
        raise ParameterError(
            f"run {run_id} was stored before within-sentence pairs were counted by distance",
            hint=("analyse the corpus again into a new database (", Param("db"), ") to draw them"),
        )
    return columns, rows
