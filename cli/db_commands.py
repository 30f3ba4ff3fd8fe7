"""The database and the settings: `db upgrade|current|compact|copy` and `config`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from headatlas.cli import options
from headatlas.cli.console import stdout
from headatlas.cli.formats import Format, render

db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)

DbOpt, FormatOpt = options.Db, options.Fmt


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
    db_app.command("upgrade")(db_upgrade)
    db_app.command("current")(db_current)
    db_app.command("compact")(db_compact)
    db_app.command("copy")(db_copy)
    app.command()(config)


def db_upgrade(db: str = DbOpt) -> None:
    """Create the schema or apply pending migrations, then store the results (metrics, intervals, roles) of
    every finished run whose stored results are missing or stale."""
    from headatlas.service.errors import StoreBusy
    from headatlas.service.metrics import plugin_metrics
    from headatlas.service.storage.backends import label
    from headatlas.service.storage.db import backend_of, upgrade

    backend = backend_of(db)
    plugin_metrics()  # the views' plugin columns, loaded before any file is made (a plugin's fault is one line)
    new = backend.kind == "file" and not os.path.lexists(backend.label)
    try:
        before, after = upgrade(db)
    except BaseException as exc:
        # not half a database: the file this command created goes (the next upgrade starts afresh);
        # one another process holds (two upgrades of a new file at once) is that process's
        if new and not isinstance(exc, StoreBusy):
            _remove_created(Path(backend.label))
        raise
    stdout.print(f"{label(db)}: schema {before or 'none'} → {after}", markup=False)
    from headatlas.service.reports.stored import fill
    from headatlas.service.storage.store import Store

    filled = fill(Store(db))
    if filled:
        runs = ", ".join(str(r) for r in filled)
        stdout.print(f"{label(db)}: results stored for finished run(s) {runs}", markup=False)


def _remove_created(path: Path) -> None:
    """A database file an interrupted or failed `db upgrade` created, and its write-ahead log."""
    for made in (path, path.with_name(path.name + ".wal")):
        if made.is_file() and not made.is_symlink():
            made.unlink()


def db_current(db: str = DbOpt) -> None:
    """Show the schema revision of the database and the one this headatlas needs."""
    from headatlas.service.storage.backends import label
    from headatlas.service.storage.db import check_not_foreign, current_revision, head_revision, transaction

    with transaction(db, read_only=True) as conn:
        check_not_foreign(conn, db)
        current = current_revision(conn)
    stdout.print(f"{label(db)}: schema {current or 'none'}, needed {head_revision()}", markup=False)


def db_compact(
    db: str = DbOpt,
    keep_days: float = typer.Option(
        7.0,
        "--keep-days",
        min=0,
        help="A lake: keep the snapshots of the last N days (older ones expire: --at can no longer read them, and "
        "the files only they used are deleted); 0 keeps the current one only.",
    ),
    fmt: Format = FormatOpt,
) -> None:
    """Compact the storage: a lake merges its small Parquet files and expires old snapshots (DuckLake's own
    functions); a file is checkpointed."""
    from headatlas.service.storage.backends import open_backend
    from headatlas.service.storage.db import check_schema, transaction

    backend = open_backend(db)
    with transaction(backend, read_only=True) as conn:
        check_schema(conn, backend)
    done = backend.maintain(older_than_days=keep_days)
    render(list(done), [tuple(done.values())], fmt, title=f"compacted {backend.label}")


def db_copy(
    src: str = typer.Argument(..., help="Source database: a file or a ducklake:… URL."),
    dst: str = typer.Argument(..., help="Target: a new file, or a lake whose catalogue holds no runs yet."),
    fmt: Format = FormatOpt,
) -> None:
    """Copy every run and schedule from one database to another (file → lake, lake → file, …), verified by
    counting each table on both sides. With a lake, --data-path names where its files go."""
    from headatlas.service.storage.backends import label
    from headatlas.service.storage.copy import copy_database

    copied = copy_database(src, dst)
    render(
        ["table", "source_rows", "target_rows"],
        [(c.table, c.source, c.target) for c in copied],
        fmt,
        title=f"copied {label(src)} → {label(dst)}",
    )


def config() -> None:
    """Show the settings read from HEADATLAS_* environment variables; a value outside its allowed
    range is marked BAD with the reason, and the command then exits 2."""
    from headatlas.service.config import check_values

    rows, bad = check_values(os.environ)  # a lake's catalogue password is never printed
    render(["variable", "value", "default", "check", "meaning"], rows, Format.table)
    if bad:
        print(f"error: {len(bad)} bad setting{'s' if len(bad) > 1 else ''}: {', '.join(bad)}", file=sys.stderr)
        raise typer.Exit(2)
