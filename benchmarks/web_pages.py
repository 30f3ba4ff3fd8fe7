"""`headatlas serve`: how long each page takes to render on the server for a 20,000-window run, how long
a head's example window takes for MiniLM on CPU, and how soon the command prints its address.

    python benchmarks/web_pages.py [--windows 20000] [--layers 6] [--heads 12] [--repeats 5] [--no-example]

The 20,000-window runs are synthesised (``query_speed.synthetic_batch``: random sums of a real run's
shape, stored through the real ingest and compacted, two runs of the same shape so that compare has a
pair); the example window is a real MiniLM run of the shipped excerpt. Pages are rendered through the
app's WSGI entry (``WebApp.respond``), without a socket: cold = the first request after the server
started (the library's queries run), written = the same page after a write to the database that is
not to run 1 (run 2 tagged: as while other runs are stored; a finished run's results are kept under
its own fingerprint), warm = the same page again (results are kept per state of the database).
Target: every page under 300 ms; the example window under 3 s. Each time is also given in CPU seconds of this process (DuckDB's threads included): on a
machine shared with other work, the wall-clock times say more about the machine than the pages.
"""

from __future__ import annotations

import argparse
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


def page_times(db: Path, repeats: int) -> list[tuple[str, float, float, float, float, float, float]]:
    from headatlas.service.web.app import WebApp
    from headatlas.service.web.context import Request
    from headatlas.service.web.reads import Memo

    app = WebApp(str(db))
    for path in PAGES:  # the modules each page imports, once (a server has them after its first page)
        app.respond(Request.of("GET", *path.split("?", 1)))
    from headatlas.service.storage.store import Store

    out = []
    for k, path in enumerate(PAGES):
        request = Request.of("GET", *path.split("?", 1))
        app.memo = Memo()  # as a server that has not shown this database yet
        started, cpu = time.perf_counter(), time.process_time()
        answer = app.respond(request)
        cold, cold_cpu = time.perf_counter() - started, time.process_time() - cpu
        assert answer.status == 200, (path, answer.body[:300])
        # a write to the database, not to run 1 (run 2 tagged): what a server sees while other runs are stored
        Store(db).tag_run(2, [f"bench{k}"], [f"bench{k - 1}"])
        started, cpu = time.perf_counter(), time.process_time()
        app.respond(request)
        written, written_cpu = time.perf_counter() - started, time.process_time() - cpu
        warm, warm_cpu = [], []
        for _ in range(repeats):
            started, cpu = time.perf_counter(), time.process_time()
            app.respond(request)
            warm.append(time.perf_counter() - started)
            warm_cpu.append(time.process_time() - cpu)
        out.append((path, cold, cold_cpu, written, written_cpu, median(warm), median(warm_cpu)))
    Store(db).tag_run(2, [], [f"bench{len(PAGES) - 1}"])
    return out


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
        # CPU: this process's (DuckDB's threads included): what the page costs whatever else the machine runs
        print(f"{'page':<100} {'cold s':>7} {'(CPU)':>7} {'written':>7} {'(CPU)':>7} {'warm s':>7} {'(CPU)':>7}")
        for path, *times in page_times(db, args.repeats):
            print(f"{path:<100} " + " ".join(f"{t:>7.3f}" for t in times), flush=True)
        printed, answered = start_time(db)
        print(f"serve: address printed after {printed:.2f} s, first page (/runs.json) after {answered:.2f} s")
        if not args.no_example:
            for label, seconds in example_times(folder).items():
                print(f"example window, MiniLM on CPU, {label}: {seconds:.2f} s", flush=True)


if __name__ == "__main__":
    main()
