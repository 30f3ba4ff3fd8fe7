"""`headatlas runs`: list the stored runs; rename, delete and tag them."""

from __future__ import annotations

import typer

from headatlas.cli import options
from headatlas.cli.console import stderr, stdout
from headatlas.cli.formats import Format, TableView, render
from headatlas.cli.messages import note
from headatlas.service.wording import counted

runs_app = typer.Typer(
    help="The stored runs: list them (no subcommand), rename, delete or tag one.",
    invoke_without_command=True,
)

COLUMNS = [
    "run_id",
    "name",
    "status",
    "windows",
    "model",
    "aliases",
    "tags",
    "created_at",
    "compute_s",
    "wall_s",
    "corpus",
    "finished_at",
]
TABLE = ["run_id", "name", "status", "windows", "model", "aliases", "tags"]


def resolve(conn, ref: str | int | None):
    """The run ``ref`` names (id, name, alias), or the default run; a note on stderr when it is
    not finished, or when the latest run is in progress and the default passed it over."""
    from headatlas.service.operations.runs import find_run

    return find_run(conn, ref, notes)


def notes(event) -> None:
    """The sink of a command that asks a run a question: its notices, as ``note: …`` lines."""
    from headatlas.cli.app import cli_terms
    from headatlas.service.errors import render as render_text
    from headatlas.service.operations.events import Notice

    if isinstance(event, Notice):
        note(render_text(event.text, cli_terms()))


def _store(db: str, at: int | None = None):
    from headatlas.service.storage.store import Store

    return Store(db, at=at)


@runs_app.callback()
def runs(
    ctx: typer.Context,
    tag: list[str] = typer.Option([], "--tag", "-t", help="Only runs with this tag (repeat: with all of them)."),
    columns: str | None = options.Columns,
    wide: bool = options.Wide,
    db: str = options.Db,
    fmt: Format = options.Fmt,
    at: int | None = options.At,
) -> None:
    """List the stored runs, with their aliases and tags (names that --run also takes: aliases); on
    a lake with each run's last snapshot (`--at SNAPSHOT` reads that state again)."""
    if ctx.invoked_subcommand is not None:
        return
    rows = _store(db, at).list_runs(tags=tuple(tag))
    columns_all = [*COLUMNS[:3], "snapshot", *COLUMNS[3:]] if rows and "snapshot" in rows[0] else COLUMNS
    table_all = [*TABLE[:3], "snapshot", *TABLE[3:]] if rows and "snapshot" in rows[0] else TABLE
    labelled = any(r["aliases"] or r["tags"] for r in rows)
    if fmt == Format.table:  # lists read as text in a table
        rows = [{**r, "aliases": ", ".join(r["aliases"]), "tags": ", ".join(r["tags"])} for r in rows]
    table = table_all if labelled else [c for c in table_all if c not in ("aliases", "tags")]
    render(
        columns_all,
        [tuple(r[c] for c in columns_all) for r in rows],
        fmt,
        view=TableView.of(columns, wide),
        table_columns=table,
        pinned=2,
    )
    if not rows and fmt == Format.table:
        stderr.print("no runs" + (f" tagged {', '.join(tag)}" if tag else ""), markup=False)


@runs_app.command("rename")
def rename(
    run: str = typer.Argument(..., help="The run: id, name or alias."),
    new_name: str = typer.Argument(..., help="Its new name (an alias of the same run may become its name)."),
    db: str = options.Db,
) -> None:
    """Rename a run. Its old name no longer resolves; its controls keep their names."""
    run_, old = _store(db).rename_run(run, new_name)
    stdout.print(f"run {run_.run_id}: renamed {old!r} → {run_.name!r}", markup=False, highlight=False)


@runs_app.command("tag")
def tag_run(
    run: str = typer.Argument(..., help="The run: id, name or alias."),
    tags: list[str] = typer.Argument(None, help="Tags to add (free text; many runs may share one)."),
    remove: list[str] = typer.Option([], "--remove", help="A tag to remove (repeat)."),
    db: str = options.Db,
) -> None:
    """Tag a run (`headatlas runs --tag T` lists the runs tagged T), or remove its tags."""
    from headatlas.service.errors import ParameterError

    if not tags and not remove:
        raise ParameterError("runs tag: pass tags to add, or --remove TAG")
    run_, added, removed = _store(db).tag_run(run, list(tags or []), list(remove))
    said = [f"added {', '.join(added)}"] if added else []
    said += [f"removed {', '.join(removed)}"] if removed else []
    stdout.print(f"run {run_.run_id} ({run_.name}): {'; '.join(said) or 'no change'}", markup=False, highlight=False)


@runs_app.command("delete")
def delete(
    runs: list[str] = typer.Argument(..., help="Runs to delete: ids, names or aliases."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking."),
    force: bool = typer.Option(
        False,
        "--force",
        help="Also delete a run marked in progress: a queued run's writers drop its batches still in flight, and a "
        "waiting `submit --wait` ends (stop an embedded `analyze` of it first).",
    ),
    db: str = options.Db,
) -> None:
    """Delete runs and every row of theirs (sums, windows' records, probe, aliases, tags), after a
    question (--yes: none). Their random-weights controls stay unless named too."""
    from sqlalchemy import text

    from headatlas.service.errors import ParameterError
    from headatlas.service.operations.runs import find_run
    from headatlas.service.reports.compare import controls_of
    from headatlas.service.storage.run_labels import UNFINISHED

    store = _store(db)
    with store.checked_read() as conn:
        chosen = {r.run_id: r for r in (find_run(conn, ref) for ref in runs)}
        windows = {
            run_id: conn.execute(text("SELECT count(*) FROM run_windows WHERE run_id = :r"), {"r": run_id}).scalar()
            for run_id in chosen
        }
        kept = sorted({c.run_id for r in chosen.values() for c in controls_of(conn, r)} - set(chosen))
    for r in chosen.values():
        if r.status in UNFINISHED and not force:
            raise ParameterError(
                f"run {r.run_id} ({r.name}) is {r.status}: a process may be writing to it; let it finish, or pass "
                "--force (a queued run's writers then drop its batches in flight; stop an embedded `analyze` first)"
            )
    listed = "; ".join(
        f"run {r.run_id} ({r.name}, {r.status}, {counted(windows[r.run_id], 'window')})" for r in chosen.values()
    )
    if not yes:
        try:
            rows_of = "its rows" if len(chosen) == 1 else "their rows"
            confirmed = typer.confirm(f"delete {listed} and all {rows_of}?", default=False, err=True)
        except typer.Abort:
            confirmed = False
        if not confirmed:
            stderr.print("nothing deleted (--yes deletes without asking)", markup=False)
            raise typer.Exit(1)
    for run_id, r in chosen.items():
        counts = store.delete_run(run_id)
        rows = sum(counts.values())
        stdout.print(f"deleted run {run_id} ({r.name}): {counted(rows, 'row')}", markup=False, highlight=False)
    in_flight = {r.run_key: r.run_id for r in chosen.values() if r.engine == "queue" and r.status in UNFINISHED}
    if in_flight:
        from headatlas.service.config import Settings
        from headatlas.service.storage.db import read_database_id
        from headatlas.workers.ledger import mark_runs_deleted

        if not mark_runs_deleted(Settings.from_env().broker_url, read_database_id(store.backend), in_flight):
            note("the broker did not answer: writers drop the deleted runs' batches when they next see one")
    if kept:
        note(
            f"their random-weights controls stay (runs {', '.join(map(str, kept))}); "
            f"delete them with `headatlas runs delete {' '.join(map(str, kept))}`"
        )
