"""What one transaction on a headatlas file costs in CPU, by part, and how many times a command
opens its file.

    python benchmarks/transaction_cpu.py [--repeats 60]

Makes a new headatlas database (the current schema) in a temporary folder and prints the mean
process CPU (``time.process_time``) of ``--repeats`` of each: a read transaction through the file
backend (``SELECT 1``: the file attached to an instance kept between transactions, file_instances);
the same statement on a SQLAlchemy engine of its own kept between transactions; a bare
``duckdb.connect`` of the file (read-only) and its close; ``duckdb.connect`` of an empty DuckDB file
and of ``:memory:`` (DuckDB's instance alone); a cursor on an open instance; a new database (from the second on, a copy
of one this process migrated, ``new_file``). Then the storage
format (``duckdb_settings.STORAGE_VERSION``): the same database copied into a file of DuckDB's
default format (``COPY FROM DATABASE``), each file's size, and the median over ``--rounds`` rounds,
taken in turn, of a read transaction and of a write transaction (one row updated, the file
checkpointed as it is detached) on each, and on the file with its views dropped; and a read of the
view chain (``head_metrics``, no rows). Then analyses the
shipped excerpt's first two documents with ``random:tiny`` (``--seq-len 32``) and runs ``query
heads``, ``query layers`` and ``sql`` on it, in this process, counting the openings of the file
(``duckdb.connect`` of it, or its attachment to a kept instance) for each command.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def mean_ms(work, repeats: int) -> float:
    work()  # once, not counted (imports, caches)
    start = time.process_time()
    for _ in range(repeats):
        work()
    return (time.process_time() - start) / repeats * 1000


def formats(path: Path, repeats: int, rounds: int) -> None:
    """Each transaction on ``path`` (headatlas's storage format), on a copy of it in DuckDB's
    default format and on one without its views, in turn, ``rounds`` times: the median CPU ms of
    each, and the files' sizes; then the median of a read of the view chain on ``path``."""
    import shutil
    import statistics

    import duckdb
    from sqlalchemy import text

    from benchmarks.common import in_default_format
    from headatlas.service.storage.backends.file import FileBackend
    from headatlas.service.storage.duckdb_settings import STORAGE_VERSION

    default = path.with_name("default-format.duckdb")
    made = in_default_format(path, default)
    ours = FileBackend(path)
    files = {
        f"{STORAGE_VERSION} (headatlas's)": ours,
        f"{made} (DuckDB's default)": FileBackend(default),
    }

    def read(backend: FileBackend) -> None:
        with backend.transaction(read_only=True) as conn:
            conn.execute(text("SELECT 1")).scalar()

    def write(backend: FileBackend) -> None:
        with backend.transaction() as conn:
            conn.execute(text("UPDATE database_info SET value = value WHERE key = 'database_id'"))

    # what the views add to a read transaction, and what one read of the view chain costs to plan
    bare = path.with_name("without-views.duckdb")
    shutil.copy(path, bare)
    with duckdb.connect(str(bare)) as conn:
        for (view,) in conn.execute(
            "SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY view_oid DESC"
        ).fetchall():
            conn.execute(f'DROP VIEW "{view}"')
    files[f"{STORAGE_VERSION}, its views dropped"] = FileBackend(bare)

    def chain(backend: FileBackend) -> None:
        with backend.transaction(read_only=True) as conn:
            conn.execute(text("SELECT * FROM head_metrics WHERE run_id = 1")).all()

    planned = statistics.median(mean_ms(functools.partial(chain, ours), repeats) for _ in range(rounds))
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, backend in files.items():
            for kind, work in (("read", read), ("write", write)):
                times.setdefault((name, kind), []).append(mean_ms(functools.partial(work, backend), repeats))
    print("\n| storage format | file size, MB | read transaction, CPU ms | write transaction, CPU ms |")
    print("|---|---|---|---|")
    for name, backend in files.items():
        size = backend.path.stat().st_size / 1e6
        read_ms, write_ms = (statistics.median(times[(name, kind)]) for kind in ("read", "write"))
        print(f"| {name} | {size:.1f} | {read_ms:.1f} | {write_ms:.1f} |", flush=True)
    print(
        f"\na read transaction of `SELECT * FROM head_metrics WHERE run_id = 1` (no rows; the view chain planned): {planned:.1f} ms of CPU"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the storage formats' transactions, in turn")
    args = parser.parse_args()

    import duckdb
    from sqlalchemy import text
    from typer.testing import CliRunner

    from headatlas.cli.main import app
    from headatlas.service.storage.backends import file as filebackend
    from headatlas.service.storage.backends import file_instances
    from headatlas.service.storage.store import Store

    folder = Path(tempfile.mkdtemp())
    path = folder / "schema.duckdb"
    Store(path).ensure_schema()
    empty = folder / "empty.duckdb"
    duckdb.connect(str(empty)).close()
    backend = filebackend.FileBackend(path)
    kept = backend.engine(read_only=True)

    def transaction() -> None:
        with backend.transaction(read_only=True) as conn:
            conn.execute(text("SELECT 1")).scalar()

    def on_kept_engine() -> None:
        with kept.connect() as conn, conn.begin():
            conn.execute(text("SELECT 1")).scalar()

    instance = duckdb.connect(":memory:")  # not the empty file: a second connect would share its instance
    Store(folder / "second.duckdb").ensure_schema()  # the process's copy of a new database made (new_file)
    new_files = itertools.count()

    def new_database() -> None:
        Store(folder / f"new-{next(new_files)}.duckdb").ensure_schema()

    parts = {
        "read transaction (file backend)": transaction,
        "the same on a kept SQLAlchemy engine": on_kept_engine,
        "duckdb.connect of the file, read-only, and close": lambda: duckdb.connect(str(path), read_only=True).close(),
        "duckdb.connect of an empty file": lambda: duckdb.connect(str(empty)).close(),
        "duckdb.connect(':memory:')": lambda: duckdb.connect(":memory:").close(),
        "a cursor on an open instance": lambda: instance.cursor().close(),
        "a new database file (a copy of this process's, its id set)": new_database,
    }
    with duckdb.connect(str(path), read_only=True) as conn:
        views, tables = (
            conn.execute(f"SELECT count(*) FROM {what}").fetchone()[0]  # type: ignore[index]
            for what in ("duckdb_views() WHERE NOT internal", "duckdb_tables()")
        )
    print(f"| part (a headatlas file: {views} views, {tables} tables) | CPU ms |")
    print("|---|---|")
    for name, work in parts.items():
        print(f"| {name} | {mean_ms(work, args.repeats):.1f} |", flush=True)
    formats(path, max(1, args.repeats // 4), args.rounds)

    # an opening of the file: an instance of its own made on it, or the file attached to a kept one
    opened: list[str] = []
    real = filebackend.duckdb.connect
    real_attach = file_instances.attach

    def counting(*a, **k):
        opened.append(str(a[0] if a else k.get("database")))
        return real(*a, **k)

    def counting_attach(instance, where, alias, *, read_only):
        opened.append(where)
        return real_attach(instance, where, alias, read_only=read_only)

    filebackend.duckdb.connect = counting  # type: ignore[assignment]
    file_instances.attach = counting_attach  # type: ignore[assignment]
    excerpt = (ROOT / "service" / "data" / "wiki_excerpt.txt").read_text(encoding="utf-8")
    corpus = folder / "two.txt"
    documents = [d.strip() for d in excerpt.split("\n\n") if d.strip()][:2]
    corpus.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    db = str(folder / "run.duckdb")
    commands = {
        "analyze (random:tiny, 2 documents)": [
            "analyze",
            str(corpus),
            "--model",
            "random:tiny",
            "--seq-len",
            "32",
            "-q",
        ],
        "query heads": ["query", "heads"],
        "query layers": ["query", "layers"],
        "sql (its query runs in a confined process of its own)": ["sql", "SELECT count(*) FROM runs"],
    }
    print("\n| command | opens of its file | exit |")
    print("|---|---|---|")
    for name, command in commands.items():
        opened.clear()
        done = CliRunner().invoke(app, [*command, "--db", db])
        print(f"| {name} | {sum(1 for o in opened if o.endswith('run.duckdb'))} | {done.exit_code} |")


if __name__ == "__main__":
    main()
