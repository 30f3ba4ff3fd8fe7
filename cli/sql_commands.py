"""Read-only SQL over the results (`sql`) and the reference of the metric columns it reads
(`metrics`)."""

from __future__ import annotations

import sys

import typer

from headatlas.cli import options
from headatlas.cli.formats import Format, render
from headatlas.cli.messages import note
from headatlas.cli.metric_tables import render_metrics
from headatlas.cli.query_commands import _run, _store
from headatlas.service.storage import relations

DbOpt, FormatOpt, AtOpt = options.Db, options.Fmt, options.At


def register(app: typer.Typer) -> None:
    # the help lists the relations, as tests/test_cli_sql.py checks them against a new database
    app.command(help=f"Run one read-only SELECT against the results; --run keeps to one run. {relations.sql_help()}")(
        sql
    )
    app.command()(metrics)


def sql(
    statement: str = typer.Argument(..., help="One SELECT or WITH … SELECT statement, or - to read it from stdin."),
    run: str | None = typer.Option(
        None,
        "--run",
        "-r",
        help="Only this run (id, name or alias): every table and view with a run_id column holds its rows alone.",
    ),
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    max_rows: int = options.setting("sql_max_rows", "--max-rows", help="Row cap."),
    timeout_s: float = options.setting("sql_timeout_s", "--timeout", help="Time limit in seconds."),
    memory_limit: str | None = typer.Option(
        None,
        "--memory-limit",
        help="Memory the query may use, e.g. 4GB (default: a quarter of this machine's, at most 2 GiB).",
    ),
    temp_limit: str = typer.Option("4GB", "--temp-limit", help="Disk the query may spill to, e.g. 10GB."),
    max_bytes: str = typer.Option(
        "64MiB",
        "--max-bytes",
        help="Cap on the answer's size (its values' bytes), e.g. 1GB: past it the query stops (add LIMIT).",
    ),
    at: int | None = AtOpt,
) -> None:
    from headatlas.service.storage import confined
    from headatlas.service.storage.readonly import run_readonly_sql

    confined.prepare()  # the query's clean helper starts while the statement is read (it inspects it)
    text = sys.stdin.read() if statement == "-" else statement
    run_id = None
    if run is not None:
        with _store(db, at).checked_read() as conn:
            run_id = _run(conn, run).run_id
    result = run_readonly_sql(
        db,
        text,
        max_rows=max_rows,
        timeout_s=timeout_s,
        memory_limit=memory_limit,
        temp_limit=temp_limit,
        run_id=run_id,
        at=at,
        max_bytes=max_bytes,
    )
    # a table within the width, as every table: text wraps, then columns are left out from the right
    render(
        result.columns,
        result.rows,
        fmt,
        truncated=result.truncated,
        left_out_hint="select fewer, or --format csv|json for every column",
    )
    if run is None and fmt == Format.table and result.runs > 1 and "run_id" not in text.lower():
        note(
            f"the database holds {result.runs} runs and the views hold them all: pass --run RUN for one, or select run_id"
        )


def metrics(fmt: Format = FormatOpt) -> None:
    """List every metric of the views (head_metrics, layer_metrics): its column, SPEC section and
    one-line definition, as declared once in service/metrics.py or by an installed plugin (its
    origin)."""
    from headatlas.service.metrics import reference

    columns, rows = reference()
    plugged = any(row[columns.index("origin")] != "headatlas" for row in rows)
    render_metrics(
        columns,
        rows,
        fmt,
        title="metrics (columns of head_metrics and layer_metrics)",
        table_columns=["column", "spec", "definition", *(["origin"] if plugged else [])],
    )
