"""Every head metric on a subset of a run's replicate groups, with its own jackknife interval over
that subset's groups: the halves behind ``query roles --stability`` (SPEC §7).

Where a run's groups hold whole documents (SPEC §5d), alternate groups (the even and the odd ids
when all 16 hold windows) are two disjoint sets of documents. The metrics of a subset come from the same SQL as the views: the
chain of ``*_reps`` views is read from the database's own catalog (whatever migration made it)
and run as common table expressions over the additive tables restricted to the subset's groups,
so that ``run_reps`` there holds only those groups and ``head_metrics_reps`` gives the subset's
metrics (``drop_rep = -1``) and the subset without each of its groups (``drop_rep = g``).
Both halves come from one statement (``subsets_head_rows``), each half a run of its own there:
the cost of such a statement is DuckDB planning the chain, once for both.
"""

from __future__ import annotations

import re
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


def subsets_prefix(conn: Connection, subsets: Sequence[Sequence[int]]) -> str:
    """``WITH <the additive tables>, <the view chain>`` in which subset ``k`` of ``:run``'s groups is
    a run of its own, ``run_id = k``: each table with ``rep`` gives its rows of subset ``k`` as run
    ``k``, each other table of runs that the chain reads (``runs``) its row of ``:run`` once per
    subset; one statement then gives every subset's rows (one plan of the chain, not one a subset)."""
    if not subsets or not all(subsets):
        raise ValueError("subsets_prefix: an empty subset")
    from headatlas.service.storage.run_results import tables_with_column

    bodies = _view_bodies(conn, CHAIN)
    with_rep = _rep_tables(conn)
    if len({g for groups in subsets for g in groups}) < sum(len(groups) for groups in subsets):
        raise ValueError("subsets_prefix: subsets that share a group")
    # one scan a table, each row's subset named by its group
    which = " ".join(
        f"WHEN rep IN ({', '.join(str(int(g)) for g in groups)}) THEN {k}" for k, groups in enumerate(subsets)
    )
    every = ", ".join(str(int(g)) for groups in subsets for g in groups)
    ctes = [
        f"{table} AS (SELECT * REPLACE (CAST(CASE {which} END AS INTEGER) AS run_id) FROM main.{table} "
        f"WHERE run_id = :run AND rep IN ({every}))"
        for table in with_rep
    ]
    chain_text = " ".join(bodies.values())
    for table in tables_with_column(conn, "run_id"):
        if table in with_rep or not re.search(rf"\b{re.escape(table)}\b", chain_text):
            continue
        ctes.append(
            f"{table} AS (SELECT t.* REPLACE (CAST(k.subset AS INTEGER) AS run_id) FROM main.{table} AS t, "
            f"range({len(subsets)}) AS k(subset) WHERE t.run_id = :run)"
        )
    ctes += [f"{view} AS ({body})" for view, body in bodies.items()]
    return "WITH " + ",\n".join(ctes) + "\n"


def subsets_head_rows(
    conn: Connection, run_id: int, subsets: Sequence[Sequence[int]], metrics: Sequence[str]
) -> list[tuple[list[str], list[tuple], dict]]:
    """``head_rows`` of each of ``subsets`` (disjoint, non-empty sets of ``run_id``'s groups) from
    one statement (``subsets_prefix``), each head row with its subset's context, where
    ``head_rows`` takes two statements a subset: nearly all of such a statement's cost is DuckDB
    planning the view chain, not running it. A subset without head rows has no context (None).
    Every value is ``head_rows``' bit for bit but the ``*_dm`` lifts': their chances are sums
    DuckDB takes in the order its hash tables give (which follows the run id, here the pseudo
    run's) and may differ in their last bits, as they do between two executions of the same
    statement on several threads."""
    cols = ", ".join(f"m.{m}" for m in metrics)
    rows = conn.execute(
        text(
            subsets_prefix(conn, subsets) + f"SELECT m.run_id, m.layer, m.head, m.drop_rep, {cols}, "
            "x.uniform_entropy, x.short_range_chance FROM head_metrics_reps m LEFT JOIN ("
            "SELECT c.run_id, ln(c.attn_rows / nullif(c.windows, 0)) AS uniform_entropy, d.short_range_chance "
            "FROM chance_reps c LEFT JOIN chance_distance_reps d USING (run_id, drop_rep) WHERE c.drop_rep = -1"
            ") x USING (run_id) ORDER BY m.run_id, m.layer, m.head, m.drop_rep"
        ),
        {"run": run_id},
    ).all()
    columns = ["layer", "head", *metrics]
    out = []
    for k in range(len(subsets)):
        mine = [r[1:] for r in rows if r[0] == k]
        whole = [(r[0], r[1], *r[3:-2]) for r in mine if r[2] == -1]
        reps = [tuple(r[:-2]) for r in mine if r[2] >= 0]
        out_columns, out_rows = add_intervals(
            columns, whole, reps, keys=("layer", "head"), metrics=metrics, clip=False, with_df=True
        )
        context = {"uniform_entropy": mine[0][-2], "short_range_chance": mine[0][-1]} if mine else None
        out.append((out_columns, out_rows, context or {"uniform_entropy": None, "short_range_chance": None}))
    return out


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
