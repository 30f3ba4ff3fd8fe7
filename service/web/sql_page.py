"""Read-only SQL over one run: the sandbox of ``headatlas sql --run RUN`` (``run_readonly_sql``), with its
limits (one SELECT, ``HEADATLAS_SQL_MAX_ROWS`` rows, ``HEADATLAS_SQL_TIMEOUT_S`` seconds, a quarter of
the machine's memory), every table and view holding the run's rows alone.

``/runs/R/sql?q=SELECT …``: the result as a table (numbers to ``DIGITS`` significant digits, sorted by
a header clicked, narrowed by layer, role or stable, a row naming a layer and a head linked to that
head's page); ``sql.csv`` and ``sql.json`` hold it, at full precision, as ``headatlas sql --run R
--format csv|json`` writes it. A result is kept for the database's state, as every page's
values are: the same statement on an unchanged database answers at once (and so gives its first
answer again, even where it calls ``random()`` or ``now()``).

At most ``SQL_AT_ONCE`` statements run at once (each in a process of its own, which may take a quarter
of the machine's memory); another waits up to ``SQL_WAIT_S`` seconds for its turn, then is answered
503 "busy, try again". Pages, and statements whose answer is kept, never wait for them. An answer
over ``SQL_MAX_BYTES`` is stopped in the query's own process (the sandbox's ``max_bytes``) and refused
with the line that says to narrow it: neither this process, a page nor a CSV holds hundreds of
megabytes, and the cache never keeps it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from headatlas.service.config import Settings
from headatlas.service.errors import Param, ParameterError, Placeholder, StoreError
from headatlas.service.storage import relations
from headatlas.service.storage.readonly import QueryResult, run_readonly_sql
from headatlas.service.web.context import WEB, Busy, Ctx, run_path
from headatlas.service.web.documents import records
from headatlas.service.web.html import e, facets, table
from headatlas.service.web.views import View

SQL_AT_ONCE = 2  # statements the server runs at once
SQL_WAIT_S = 1.0  # how long a statement waits for its turn before it is answered 503
SQL_MAX_BYTES = 16 * 2**20  # the largest answer the page, its CSV or its JSON holds (its values' bytes)
DIGITS = 4  # significant digits the page shows (each cell keeps its full value to sort by; CSV and JSON hold it)

EXAMPLE = "SELECT layer, head, within_sentence_lift_dm, repetition_words_lift_dm\nFROM head_metrics\nORDER BY 3 DESC\nLIMIT 10"


def sql_view(ctx: Ctx, ref: str, *, wants_data: bool = False) -> View:
    run = ctx.run(ref)
    statement = ctx.request.arg("q")
    title = f"SQL over run {run.run_id} ({run.name})"
    crumbs = [(f"run {run.run_id}", ctx.url(run_path(run))), ("SQL", ctx.url(run_path(run, "sql")))]
    if statement is None:
        if wants_data:
            raise ParameterError("pass the statement as ", Param("q", Placeholder("SELECT …")))
        return View(title, [], lambda: _form(ctx, run, EXAMPLE), crumbs=crumbs)
    settings = Settings.from_env()

    def query() -> QueryResult:
        # The sandbox's child is forked from this process only while it runs one thread (then no
        # other request's transaction is open, and this one's is closed here: a child inherits DuckDB's
        # open databases); a server runs several, so its children come from the sandbox's clean helper,
        # which has opened nothing. No lock is held while the query runs: pages go on meanwhile.
        ctx.reads.close()
        with _turn():
            return run_readonly_sql(
                ctx.store.backend,
                statement,
                max_rows=settings.sql_max_rows,
                timeout_s=settings.sql_timeout_s,
                run_id=run.run_id,
                at=ctx.store.at,
                max_bytes=SQL_MAX_BYTES,
            )

    try:
        # a result is kept for the database's state, as every page's: its CSV and JSON come at once
        limits = (settings.sql_max_rows, settings.sql_timeout_s)
        result = ctx.reads.get(("sql", run.run_id, statement, limits), query)
    except (StoreError, ParameterError) as refused:
        message = refused.render(WEB)
        return View(
            title,
            {"error": message, "status": 400},
            lambda: _form(ctx, run, statement) + f'<p class="error" id="sql-error">error: {e(message)}</p>',
            crumbs=crumbs,
            status=400,
        )

    def body() -> str:
        csv_url = ctx.url(run_path(run, "sql.csv"), q=statement)
        json_url = ctx.url(run_path(run, "sql.json"), q=statement)
        cut = (
            f' <strong class="warning">truncated: the first {len(result.rows):,} rows (HEADATLAS_SQL_MAX_ROWS); narrow the '
            "query</strong>"
            if result.truncated
            else ""
        )
        said = (
            f'<p id="sql-said">{len(result.rows):,} rows in {result.elapsed_s:.2f} s.{cut} Download: '
            f'<a id="download-csv" href="{e(csv_url)}" download>CSV</a> · <a id="download-json" href="{e(json_url)}">JSON</a></p>'
        )
        columns, rows = result.columns, result.rows
        return (
            _form(ctx, run, statement)
            + said
            + facets("sql-result", columns, rows)
            + table(columns, rows, table_id="sql-result", digits=DIGITS, links=_head_links(ctx, run, columns))
        )

    return View(title, records(result.columns, result.rows), body, crumbs=crumbs, table=(result.columns, result.rows))


def _head_links(ctx: Ctx, run, columns: list[str]) -> dict:
    """Where a result names a layer and a head (integers of the run's shape), its head cell links to
    that head's page."""
    if "layer" not in columns or "head" not in columns:
        return {}

    def link(row: dict) -> str | None:
        layer, head = row["layer"], row["head"]
        if type(layer) is not int or type(head) is not int:
            return None
        if not (0 <= layer < run.n_layers and 0 <= head < run.n_heads):
            return None
        return ctx.url(run_path(run, "heads", layer, head))

    return {"head": link}


_turns = threading.BoundedSemaphore(SQL_AT_ONCE)


@contextmanager
def _turn() -> Iterator[None]:
    """One of the ``SQL_AT_ONCE`` turns to run a statement, waited for ``SQL_WAIT_S`` at most."""
    if not _turns.acquire(timeout=SQL_WAIT_S):
        raise Busy(
            f"busy: {SQL_AT_ONCE} SQL statements are running (at most {SQL_AT_ONCE} at once); try again in a "
            "few seconds, or add LIMIT to make them quicker",
            retry_after_s=5,
        )
    try:
        yield
    finally:
        _turns.release()


def _form(ctx: Ctx, run, statement: str) -> str:
    at = f'<input type="hidden" name="at" value="{e(ctx.request.arg("at"))}">' if ctx.request.arg("at") else ""
    views = " ".join(
        f'<a href="{e(ctx.url(run_path(run, "sql"), q=f"SELECT * FROM {name} LIMIT 20"))}"><code>{e(name)}</code></a>'
        for name in (*relations.VIEWS, *relations.TABLES)
    )
    return f"""<form method="get" id="sql-form" class="sql"><textarea name="q" rows="6" spellcheck="false">{e(statement)}</textarea>
{at}<p><button type="submit" id="run-sql">run</button> <span class="muted">one read-only SELECT; every table and view
holds run {e(run.run_id)}'s rows alone; at most {Settings.from_env().sql_max_rows:,} rows, {Settings.from_env().sql_timeout_s:g} s.</span></p></form>
<details><summary>tables and views</summary><p>{views}</p><p class="muted">{e(relations.sql_help())}</p></details>"""
