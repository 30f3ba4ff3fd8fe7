"""Compaction: fold a run's per-batch partial sums into one row set (batch_id = -1).

Every statistics table holds additive sums, so the views give the same numbers before and
after; queries on a large run read hundreds of rows instead of millions. The batch ledger and
run_windows are kept, so a redelivered batch is still recognised and skipped, and batches
ingested later (a retried batch) are simply added as new partial rows.
"""

from __future__ import annotations

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

COMPACTED = -1

# table -> key columns besides run_id and batch_id; every other column is a sum
# (rep: the replicate group, kept so that intervals survive compaction, SPEC §5b)
ADDITIVE_TABLES: dict[str, tuple[str, ...]] = {
    "head_stats": ("rep", "layer", "head"),
    "named_head_sums": ("rep", "layer", "head", "name"),
    "dist_hist": ("rep", "layer", "head", "distance"),
    "pair_hist": ("rep", "distance"),
    "run_chance": ("rep",),
    "anchor_tokens": ("layer", "head", "token_id", "token"),
    "anchor_layers": ("layer",),
    "mixing_stats": ("method", "layer", "head"),
    "mixing_dist": ("method", "layer", "head", "distance"),
    "csm_bins": ("layer", "head", "kind", "bin_i", "bin_j"),
}


# tables compacted one value of a key column at a time: the GROUP BY, its temporary table and the
# rows re-inserted then hold one layer's cells, not the run's (the averaged similarity matrices of
# a 4,096-token window of SmolLM2 are 43 million cells, 1.4 million a layer). The sums are the
# same: the column is one of the keys grouped by
COMPACTED_BY: dict[str, str] = {"csm_bins": "layer"}


def strict_sum(column: str) -> str:
    """SQL: the sum, or NULL when any row lacks the value (a column added later, absent from
    rows stored before it): a partial sum would pass for a whole one."""
    return f"CASE WHEN count({column}) = count(*) THEN sum({column}) END"


def compact_run(conn: Connection, run_id: int) -> dict[str, tuple[int, int]]:
    """Compact one run inside the caller's transaction. Returns {table: (rows before, after)}."""
    report = {}
    # every additive table's columns in one catalogue read (DuckDB's own function: one statement of
    # information_schema.columns per table cost about 5 ms each, a tenth of a tiny run's compaction)
    table_columns: dict[str, list[str]] = {}
    for name, column in conn.execute(
        text(
            "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = current_database() "
            "AND table_name IN :tables ORDER BY table_name, column_index"
        ).bindparams(bindparam("tables", expanding=True)),
        {"tables": list(ADDITIVE_TABLES)},
    ):
        table_columns.setdefault(name, []).append(column)
    for table, keys in ADDITIVE_TABLES.items():
        sums = [c for c in table_columns.get(table, []) if c not in ("run_id", "batch_id", *keys)]
        before = conn.execute(text(f"SELECT count(*) FROM {table} WHERE run_id = :r"), {"r": run_id}).all()[0][0]
        if before == 0:
            report[table] = (0, 0)
            continue
        select = ", ".join(["run_id", f"{COMPACTED} AS batch_id", *keys, *(f"{strict_sum(c)} AS {c}" for c in sums)])
        group = ", ".join(["run_id", *keys])
        by = COMPACTED_BY.get(table)
        parts: list[dict] = [{"r": run_id}]
        where = "run_id = :r"
        if by is not None:
            found = conn.execute(
                text(f"SELECT DISTINCT {by} FROM {table} WHERE run_id = :r ORDER BY {by}"), {"r": run_id}
            ).all()
            parts = [{"r": run_id, "part": r[0]} for r in found]
            where += f" AND {by} = :part"
        after = 0
        for part in parts:
            conn.execute(
                text(f"CREATE TEMP TABLE _compact AS SELECT {select} FROM {table} WHERE {where} GROUP BY {group}"), part
            )
            conn.execute(text(f"DELETE FROM {table} WHERE {where}"), part)
            conn.execute(text(f"INSERT INTO {table} BY NAME SELECT * FROM _compact"))
            after += conn.execute(text("SELECT count(*) FROM _compact")).all()[0][0]
            conn.execute(text("DROP TABLE _compact"))
        report[table] = (before, after)
    # the heads' top examples are no sums: their best k are kept (example_rows.compact)
    from headatlas.service.storage import example_rows

    report.update(example_rows.compact(conn, run_id))
    return report
