"""`headatlas serve`: how long each page takes to render on the server for a 20,000-window run, how long
a head's example window takes for MiniLM on CPU, and how soon the command prints its address.

    python benchmarks/web_pages.py [--windows 20000] [--layers 6] [--heads 12] [--repeats 5] [--no-example]
        [--keep DIR] [--profile DIR]

The 20,000-window runs are synthesised (``query_speed.synthetic_batch``: random sums of a real run's
shape, stored through the real ingest and compacted, two runs of the same shape so that compare has a
pair), and their results are stored as a run's end stores them (``reports.stored.refresh``); a
database kept from an earlier version of headatlas has them stored again first (said, with the
seconds it took: what ``headatlas db upgrade`` does). The example window is a real MiniLM run of the
shipped excerpt. Pages are rendered through the app's WSGI entry (``WebApp.respond``), without a
socket, ``--repeats`` times each: cold = the first request of a server that has not shown the
database (nothing remembered: the file opened, its schema checked, the run's stored results read),
written = the same page after a write to the database that is not to run 1 (run 2 tagged: as while
other runs are stored, or a new run arrives; a finished run's results are kept under its own
fingerprint), warm = the same page again (results are kept per state of the database); each the
median. Target: every page under 300 ms; the example window under 3 s. Each time is also given in
CPU seconds of this process (DuckDB's threads included): on a machine shared with other work, the
wall-clock times say more about the machine than the pages; the load average is printed with them.
``--profile DIR``: one more cold request of each page under cProfile, its statistics written to DIR.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.common import median  # noqa: E402
from benchmarks.query_speed import SEQ, synthetic_batch  # noqa: E402

PAGES = (
    "/runs",
    "/runs/1",
    "/runs/1?color=within_sentence_lift_dm&sort=mean_distance&metric=repetition_words_lift_dm",
    "/runs/1.json",
    "/runs/1/heads/3/5",
    "/compare/1/2",
    "/compare/1/2?by=head",
    "/compare/1/2?by=depth",
    "/runs/1/sql?q=SELECT+layer,+head,+within_sentence_lift_dm+FROM+head_metrics+ORDER+BY+3+DESC+LIMIT+20",
)


def synthetic_database(db: Path, windows: int, layers: int, heads: int, batch_size: int = 32) -> None:
    from headatlas.service.reports.stored import refresh
    from headatlas.service.storage.store import Store

    store = Store(db)
    store.ensure_schema()
    for seed, name in ((0, "synthetic-a"), (1, "synthetic-b")):
        rng = np.random.default_rng(seed)
        run, _ = store.find_or_create_run(
            run_key=name,
            name=name,
            corpus="synthetic",
            corpus_fingerprint=name,
            model={"spec": "random:bert-base", "name": "synthetic", "layers": layers, "heads": heads, "d_head": 64},
            params={"seq_len": SEQ, "short_range": 4},
            engine="embedded",
            device="cpu",
        )
        batches = windows // batch_size
        for start in range(0, batches, 20):
            items = [
                (b, synthetic_batch(rng, b * batch_size + seed * 10**7, batch_size, layers, heads))
                for b in range(start, min(batches, start + 20))
            ]
            store.ingest(run.run_id, items)
        store.compact(run.run_id)
        store.set_status(run.run_id, "done")
        refresh(store, run.run_id)  # as a run's end does: its results derived once and stored


Times = tuple[str, float, float, float, float, float, float]


def page_times(db: Path, repeats: int, profile: Path | None = None) -> list[Times]:
    """Per page: the medians of cold, written and warm, wall and CPU seconds (see the docstring)."""
    from headatlas.service.storage.store import Store
    from headatlas.service.web.app import WebApp
    from headatlas.service.web.context import Request
    from headatlas.service.web.reads import Memo

    app = WebApp(str(db))
    for path in PAGES:  # the modules each page imports, once (a server has them after its first page)
        app.respond(Request.of("GET", *path.split("?", 1)))
    writes = 0

    def write_elsewhere() -> None:
        # a write to the database, not to run 1 (run 2 tagged): what a server sees while other runs are stored
        nonlocal writes
        writes += 1
        Store(db).tag_run(2, [f"bench{writes}"], [f"bench{writes - 1}"])

    def timed(request) -> tuple[float, float]:
        started, cpu = time.perf_counter(), time.process_time()
        answer = app.respond(request)
        assert answer.status == 200, (request.path, answer.body[:300])
        return time.perf_counter() - started, time.process_time() - cpu

    out = []
    for k, path in enumerate(PAGES):
        request = Request.of("GET", *path.split("?", 1))
        cold, written, warm = [], [], []
        for _ in range(repeats):
            app.memo = Memo()  # as a server that has not shown this database yet
            cold.append(timed(request))
            write_elsewhere()
            written.append(timed(request))
            warm.append(timed(request))
        if profile is not None:
            import cProfile

            app.memo = Memo()
            profile.mkdir(parents=True, exist_ok=True)
            with cProfile.Profile() as profiler:
                app.respond(request)
            profiler.dump_stats(profile / f"{k:02d}-{re.sub(r'[^A-Za-z0-9]+', '-', path).strip('-')[:60]}.prof")
        out.append((path, *(median([t[i] for t in times]) for times in (cold, written, warm) for i in (0, 1))))
    Store(db).tag_run(2, [], [f"bench{writes}"])
    return out


def stored_results(db: Path) -> str:
    """Store the runs' results where they are missing or stale (a database built by another version of
    headatlas), as ``headatlas db upgrade`` does; what it did, in words."""
    from headatlas.service.reports.stored import fill
    from headatlas.service.storage.store import Store

    started, cpu = time.perf_counter(), time.process_time()
    refreshed = fill(Store(db))
    if not refreshed:
        return "the runs' stored results are current"
    return (
        f"results stored again for runs {', '.join(map(str, refreshed))} (another version of headatlas stored them) "
        f"in {time.perf_counter() - started:.1f} s ({time.process_time() - cpu:.1f} s of CPU)"
    )


def example_times(folder: Path) -> dict[str, float]:
    """The example window of a MiniLM run of the shipped excerpt, through the app."""
    from headatlas.service.engine.corpus import demo_corpus_path
    from headatlas.service.web.app import WebApp
    from headatlas.service.web.context import Request

    db = folder / "minilm.duckdb"
    if not db.exists():
        headatlas = Path(sys.executable).parent / "headatlas"
        subprocess.run(
            [str(headatlas), "analyze", str(demo_corpus_path()), "--name", "demo", "--db", str(db), "--quiet"],
            check=True,
            capture_output=True,
        )
    app = WebApp(str(db))
    out = {}
    for label, path in (
        ("first window (model loaded first)", "/runs/1/heads/2/3/example.json"),
        ("another window", "/runs/1/heads/2/3/example.json?window=7"),
        ("another head of that window", "/runs/1/heads/4/1/example.json?window=7"),
    ):
        started = time.perf_counter()
        answer = app.respond(Request.of("GET", *path.split("?", 1)))
        assert answer.status == 200, answer.body[:300]
        import json

        doc = json.loads(answer.body)
        out[label] = time.perf_counter() - started
        if doc.get("model_load_s"):
            out["  of which loading MiniLM"] = doc["model_load_s"]
    return out


def start_time(db: Path) -> tuple[float, float]:
    """Seconds until `headatlas serve` prints its address, and until it answers /runs.json."""
    headatlas = Path(sys.executable).parent / "headatlas"
    started = time.perf_counter()
    process = subprocess.Popen(
        [str(headatlas), "serve", "--db", str(db), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = process.stdout.readline() if process.stdout else ""
        printed = time.perf_counter() - started
        port = re.search(r":(\d+)/", line)
        assert port, line
        with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/runs.json", timeout=120) as answer:
            answer.read()
        return printed, time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(30)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=20_000)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-example", action="store_true", help="leave out the MiniLM example window")
    parser.add_argument("--keep", type=Path, help="keep the databases in this folder (and reuse them)")
    parser.add_argument("--profile", type=Path, help="write each cold page's cProfile statistics to this folder")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        db = folder / f"synthetic-{args.windows}-{args.layers}x{args.heads}.duckdb"
        if not db.exists():
            started = time.perf_counter()
            synthetic_database(db, args.windows, args.layers, args.heads)
            print(
                f"# two synthetic runs of {args.windows:,} windows, {args.layers}×{args.heads} heads "
                f"(stored in {time.perf_counter() - started:.0f} s)"
            )
        print(f"# {stored_results(db)}")
        # CPU: this process's (DuckDB's threads included): what the page costs whatever else the machine runs
        load = os.getloadavg()[0]
        print(f"# medians of {args.repeats}; load average {load:.1f} on {os.cpu_count()} cores at the start")
        print(f"{'page':<100} {'cold s':>7} {'(CPU)':>7} {'written':>7} {'(CPU)':>7} {'warm s':>7} {'(CPU)':>7}")
        for path, *times in page_times(db, args.repeats, args.profile):
            print(f"{path:<100} " + " ".join(f"{t:>7.3f}" for t in times), flush=True)
        print(f"# load average {os.getloadavg()[0]:.1f} at the end")
        printed, answered = start_time(db)
        print(f"serve: address printed after {printed:.2f} s, first page (/runs.json) after {answered:.2f} s")
        if not args.no_example:
            for label, seconds in example_times(folder).items():
                print(f"example window, MiniLM on CPU, {label}: {seconds:.2f} s", flush=True)


if __name__ == "__main__":
    main()
