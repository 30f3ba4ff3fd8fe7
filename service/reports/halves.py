"""Every head metric on a subset of a run's replicate groups, with its own jackknife interval over
that subset's groups: the halves behind ``query roles --stability`` (SPEC §7).

Where a run's groups hold whole documents (SPEC §5d), alternate groups (the even and the odd ids
when all 16 hold windows) are two disjoint sets of documents. The metrics of a subset come from the same SQL as the views: the
chain of ``*_reps`` views is read from the database's own catalog (whatever migration made it)
and run as common table expressions over the additive tables restricted to the subset's groups,
so that ``run_reps`` there holds only those groups and ``head_metrics_reps`` gives the subset's
metrics (``drop_rep = -1``) and the subset without each of its groups (``drop_rep = g``).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from headatlas.service.reports.intervals import add_intervals

# the views between the additive tables and head_metrics_reps, each after those it reads
CHAIN = (
    "run_reps",
    "chance_reps",
    "pair_reps",
    "head_reps",
    "distance_reps",
    "chance_distance_reps",
    "head_distance_reps",
    "streaming_reps",
    "streaming_kv_reps",
    "head_metrics_reps",
)


def run_groups(conn: Connection, run_id: int) -> list[int]:
    """The replicate groups of a run that hold windows (empty: a run stored before groups)."""
    rows = conn.execute(text("SELECT rep FROM run_reps WHERE run_id = :run ORDER BY rep"), {"run": run_id})
    return [int(r[0]) for r in rows]


def split(groups: Sequence[int]) -> tuple[list[int], list[int]]:
    """The two halves: the 1st, 3rd, 5th … and the 2nd, 4th … of the groups that hold windows, in
    id order. With all 16 groups held these are the even and the odd ids; with fewer (a short run,
    blocks) the halves still differ in size by one at most, where even / odd ids could split 7
    groups 2 : 5 and leave one half a single degree of freedom."""
    ordered = sorted(groups)
    return ordered[0::2], ordered[1::2]


def _view_bodies(conn: Connection, names: Sequence[str]) -> dict[str, str]:
    """The SELECT each of the views ``names`` is defined by, read from the catalog in one query."""
    found: dict[str, str] = dict(
        conn.execute(
            text("SELECT view_name, sql FROM duckdb_views() WHERE view_name IN :names AND NOT internal").bindparams(
                bindparam("names", expanding=True)
            ),
            {"names": list(names)},
        ).all()
    )
    bodies = {}
    for name in names:
        if name not in found:
            raise RuntimeError(f"view {name}: not in the database")
        head = f"CREATE VIEW {name} AS"
        sql = found[name].strip().rstrip(";")
        if not sql.upper().startswith(head.upper()):
            raise RuntimeError(f"view {name}: unexpected definition {sql[:60]!r}")
        bodies[name] = sql[len(head) :]
    return bodies


def _rep_tables(conn: Connection) -> list[str]:
    """The additive tables that carry a replicate group (``rep``)."""
    from headatlas.service.storage.run_results import tables_with_column

    return tables_with_column(conn, "rep")


def subset_prefix(conn: Connection, groups: Sequence[int]) -> str:
    """``WITH <the additive tables restricted to :run and groups>, <the view chain>``, for
    statements that each add their own select (the catalog read once for them all)."""
    if not groups:
        raise ValueError("subset_prefix: no groups")
    listed = ", ".join(str(int(g)) for g in groups)
    ctes = [
        f"{table} AS (SELECT * FROM main.{table} WHERE run_id = :run AND rep IN ({listed}))"
        for table in _rep_tables(conn)
    ]
    ctes += [f"{view} AS ({body})" for view, body in _view_bodies(conn, CHAIN).items()]
    return "WITH " + ",\n".join(ctes) + "\n"


def head_rows(
    conn: Connection, run_id: int, groups: Sequence[int], metrics: Sequence[str]
) -> tuple[list[str], list[tuple], dict]:
    """Per head of ``run_id`` on ``groups`` only: ``layer``, ``head`` and each metric with
    ``_lo``/``_hi`` (the jackknife over those groups, ``intervals.add_intervals``, not clipped), and the
    subset's run context (``uniform_entropy`` = ln n̄, ``short_range_chance``)."""
    cols = ", ".join(metrics)
    prefix = subset_prefix(conn, groups)
    rows = conn.execute(
        text(
            prefix + f"SELECT layer, head, drop_rep, {cols} FROM head_metrics_reps WHERE run_id = :run "
            "ORDER BY layer, head, drop_rep"
        ),
        {"run": run_id},
    ).all()
    columns = ["layer", "head", *metrics]
    whole = [(r[0], r[1], *r[3:]) for r in rows if r[2] == -1]
    reps = [tuple(r) for r in rows if r[2] >= 0]
    context = (
        conn.execute(
            text(
                prefix + "SELECT ln(c.attn_rows / nullif(c.windows, 0)) AS uniform_entropy, d.short_range_chance "
                "FROM chance_reps c LEFT JOIN chance_distance_reps d USING (run_id, drop_rep) "
                "WHERE c.run_id = :run AND c.drop_rep = -1"
            ),
            {"run": run_id},
        )
        .mappings()
        .first()
    )
    # not clipped, with their degrees of freedom: the role tests read them (lifts' on the log scale)
    out_columns, out_rows = add_intervals(
        columns, whole, reps, keys=("layer", "head"), metrics=metrics, clip=False, with_df=True
    )
    return out_columns, out_rows, dict(context) if context else {"uniform_entropy": None, "short_range_chance": None}
