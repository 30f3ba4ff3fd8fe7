"""What one `sql` call costs end to end: the CLI, and the Python API from a process that holds DuckDB threads.

    python benchmarks/sql_latency.py [--repeats 7] [--lake] [--run]

Times ``SELECT count(*) FROM runs`` on an empty database (the schema only, so that the figure is
the sandbox's own cost, not the query's):

- ``headatlas sql`` as a fresh process (wall clock, interpreter start included);
- ``run_readonly_sql`` in this process, twice: as it is after ``import duckdb`` (DuckDB's default
  connection keeps worker threads), and with a lake attached here too (``--lake``: a PostgreSQL
  catalogue from ``HEADATLAS_TEST_PG``, as the tests make them);
- ``--run``: three statements on a finished ``random:tiny`` run of the shipped excerpt's first two
  documents, unscoped and scoped to the run (``sql --run``, ``run_readonly_sql(run_id=…)``), where
  the scope's temporary views are most of a small query's cost.

Prints the median and range of ``--repeats`` calls each (the first in-process call, which may start a
helper process, is shown apart).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.common import median  # noqa: E402
from headatlas.service.storage import db  # noqa: E402
from headatlas.service.storage.readonly import run_readonly_sql  # noqa: E402
from headatlas.service.storage.store import Store  # noqa: E402

SQL = "SELECT count(*) FROM runs"


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(the first call's seconds, the seconds of the ``repeats`` calls after it)."""
    began = time.perf_counter()
    fn()
    first = time.perf_counter() - began
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return first, times


def row(what: str, first: float, times: list[float]) -> str:
    return f"| {what} | {first:.3f} | {median(times):.3f} ({min(times):.3f}–{max(times):.3f}) |"


def cli(target: str, env: dict[str, str]) -> None:
    command = [str(Path(sys.executable).with_name("headatlas")), "sql", SQL, "--db", target, "--format", "csv"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"headatlas sql failed: {done.stderr.strip()}")


SCOPED = (
    "SELECT 1",
    "SELECT count(*) FROM runs",
    "SELECT layer, head, within_sentence_lift_dm FROM head_metrics",
)


def scoped(folder: Path, repeats: int) -> None:
    import headatlas
    from headatlas.service.engine.corpus import demo_corpus_path

    corpus = folder / "two.txt"
    corpus.write_text("\n\n".join(demo_corpus_path().read_text(encoding="utf-8").split("\n\n")[:2]), encoding="utf-8")
    path = folder / "tiny.duckdb"
    headatlas.analyze(corpus, db=path, model="random:tiny", name="tiny", progress=False)
    run = run_readonly_sql(path, "SELECT run_id FROM runs WHERE name = 'tiny'").rows[0][0]
    for sql in SCOPED:
        for run_id in (None, run):
            what = f"`{sql}`" + (", `--run`" if run_id else "")
            print(row(what, *timed(lambda sql=sql, run_id=run_id: run_readonly_sql(path, sql, run_id=run_id), repeats)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lake", action="store_true", help="also a lake (needs PostgreSQL)")
    parser.add_argument("--run", action="store_true", help="also statements scoped to a finished tiny run")
    args = parser.parse_args()
    env = dict(os.environ)
    print(f"{os.cpu_count()} CPUs; seconds per call")
    print("| call | first | median (range) of the next |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "empty.duckdb"
        db.upgrade(Store(path).backend)
        print(row("`headatlas sql`, file", *timed(lambda: cli(str(path), env), args.repeats)))
        print(
            row(
                "`run_readonly_sql`, file, after `import duckdb`",
                *timed(lambda: run_readonly_sql(path, SQL), args.repeats),
            )
        )
        if args.run:
            scoped(Path(folder), args.repeats)
        if not args.lake:
            return
        import lake_support

        lake = lake_support.new_lake(Path(folder))
        try:
            backend = lake.backend()
            db.upgrade(backend)
            env_lake = {**env, **lake.env}
            print(row("`headatlas sql`, lake", *timed(lambda: cli(lake.url, env_lake), args.repeats)))
            print(row("`run_readonly_sql`, lake", *timed(lambda: run_readonly_sql(backend, SQL), args.repeats)))
            with backend.transaction(read_only=True):
                pass  # the lake stays attached in this process: its DuckDB threads and catalogue sessions
            print(
                row(
                    "`run_readonly_sql`, file, a lake attached here",
                    *timed(lambda: run_readonly_sql(path, SQL), args.repeats),
                )
            )
        finally:
            lake.release()
            lake_support.remove_lake(lake)


if __name__ == "__main__":
    main()
