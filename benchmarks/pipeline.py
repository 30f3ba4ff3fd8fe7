"""The pipeline around the model, stage by stage and whole, in windows/s.

    python benchmarks/pipeline.py [--corpus PATH] [--processes 2] [--repeats 3] [--quick]

Each figure is printed as ``N windows/s`` on a line that names its stage and shape, e.g.
``preparation, segmenter, 2 processes: 2,610 windows/s``:

- preparation: corpus → documents → tokens (and sentences) → windows → collated batches, with the
  default sentence segmenter and with ``punct``, in 1 process and in N;
- payload: one batch's message on the queue (``BatchResult.to_bytes`` in a ``BatchAnalysed``
  message), encoded and decoded, with its bytes, for a batch of MiniLM's shape (6 × 12 heads) and
  one of SmolLM2's (30 × 9), both analysed for real (random weights) on the corpus's first windows;
- storing: what the writer and the embedded engine do with those results (``store_batches``, one
  transaction per group of as many batches as the writer takes with a backlog: messages up to
  ``GROUP_BYTES``, workers/policy.py; or ``--group``), into a file, and into a lake when PostgreSQL
  answers at ``HEADATLAS_TEST_PG`` (tests/lake_support.py), with the CPU seconds per window of
  this process (DuckDB's threads included; a lake's PostgreSQL not); ``--stored N``: into a run
  (a database) already holding N windows, as a long run's later transactions are;
- whole run: ``random:tiny`` (a nearly free model) embedded, and queued (a writer and one worker
  on a Redis of its own), from the start to the last stored batch.

The corpus: ``--corpus``, else the development corpus (``build/corpora/wikipedia_dev.txt``,
``../shared/corpora/``), else text generated here (``generated_corpus``: distinct sentences).
Figures are medians of ``--repeats``; stages run one after the other in one process, so compare
ratios within one run. The machine's load average is printed with each part.
"""

from __future__ import annotations

import argparse
import base64
import copy
import inspect
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CORPUS_CANDIDATES = (
    ROOT / "build" / "corpora" / "wikipedia_dev.txt",  # `make corpus` copies it here (it travels with the tree)
    ROOT.parent / "shared" / "corpora" / "wikipedia_dev.txt",
    ROOT.parent.parent / "shared" / "corpora" / "wikipedia_dev.txt",
)
SHAPES = {"MiniLM": "random:minilm", "SmolLM2": "random:smollm2"}

_WORDS = (
    "river valley empire council harbour railway cathedral province language treaty museum island "
    "festival mountain bridge university scientist composer novel battle village market parliament "
    "engine orchestra monastery theorem forest colony dynasty observatory ferry garrison canal"
).split()


def generated_corpus(path: Path, *, documents: int = 150, paragraphs: int = 40, seed: int = 0) -> Path:
    """Distinct English-like text where no corpus is at hand: ``documents`` documents of
    ``paragraphs`` paragraphs, each sentence numbered so that no two windows are alike (about
    6,000 windows of 128 tokens at the defaults)."""
    rng = random.Random(seed)
    docs = []
    for d in range(documents):
        paras = []
        for p in range(paragraphs):
            sentences = []
            for s in range(rng.randint(3, 6)):
                words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 16)))
                sentences.append(f"In {1000 + d * 7 + p}, the {words} was number {s} of Dr. Ames's list.")
            paras.append(" ".join(sentences))
        docs.append("\n".join(paras))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def find_corpus(given: str | None, folder: Path) -> tuple[Path, str]:
    if given:
        return Path(given), given
    for path in CORPUS_CANDIDATES:
        if path.exists():
            return path, str(path)
    return generated_corpus(folder / "generated.txt"), "generated (no development corpus found)"


def load() -> str:
    one, five, _fifteen = os.getloadavg()
    return f"load average {one:.1f} (5 min {five:.1f}) on {os.cpu_count()} CPUs"


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process, and of its children that have ended (a pool's
    processes, once it is closed)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def rate(windows: int, seconds: float) -> str:
    return f"{windows / seconds:,.0f} windows/s"


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls (one untimed warm-up first) and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


# --- preparation -----------------------------------------------------------------------------


def preparation(corpus: Path, processes: list[int], repeats: int) -> None:
    from headatlas.service.engine.model import load_model_info
    from headatlas.service.engine.run_plan import iter_batches
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.params import AnalysisParams

    info = load_model_info("default")
    tokens = TokenClasses.for_model(info)
    parallel = "workers" in inspect.signature(iter_batches).parameters
    print(f"# preparation: corpus → windows → batches of 32 (MiniLM's tokenizer); {load()}")
    for sentences in ("segmenter", "punct"):
        params = AnalysisParams(sentences=sentences)
        base = None
        for n in processes:
            if n > 1 and not parallel:
                print(f"preparation, {sentences}, {n} processes: not available (one process only)")
                continue
            extra = {"workers": n} if parallel else {}

            def run(params=params, extra=extra) -> int:
                return sum(
                    len(b.windows)
                    for b, _d, _c in iter_batches(str(corpus), info, params, tokens, batch_size=32, **extra)
                )

            before = cpu_seconds()
            seconds, windows = timed(run, repeats)
            assert isinstance(windows, int)
            own, workers = (a - b for a, b in zip(cpu_seconds(), before))
            passes = repeats + 1  # the warm-up too
            cpu = (
                f"; CPU per window: calling process {own / passes / windows * 1e3:.2f} ms, "
                f"workers {workers / passes / windows * 1e3:.2f} ms"
            )
            per_s = windows / seconds
            base = base or per_s
            scale = f" ({per_s / base:.2f}× 1 process)" if n > 1 else ""
            label = "1 process" if n == 1 else f"{n} processes"
            print(
                f"preparation, {sentences}, {label}: {rate(windows, seconds)}{scale}; {windows:,} windows{cpu}",
                flush=True,
            )
        if sentences == "segmenter":
            parent_ceiling(corpus, info, params, tokens, repeats)


def parent_ceiling(corpus: Path, info, params, tokens, repeats: int) -> None:
    """What the calling process does per window when a pool prepares them: take each task's
    windows off the pipe (unpickle) and collate them into batches. Its rate bounds a pool of any
    size (the projection to many cores)."""
    import pickle

    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.windows import collate, document_windows

    key = info.tokenizer_key
    windows = [
        w for doc in iter_documents(str(corpus)) for w in document_windows(doc, info.tokenizer, tokens, key, params)
    ]
    blobs = [pickle.dumps(windows[i : i + 32]) for i in range(0, len(windows), 32)]

    def take() -> int:
        n = 0
        for blob in blobs:
            batch = pickle.loads(blob)
            collate(batch, tokens.pad_id)
            n += len(batch)
        return n

    seconds, n = timed(take, repeats)
    assert isinstance(n, int)
    print(f"preparation, segmenter, the calling process's part (unpickle, collate): {rate(n, seconds)}", flush=True)


# --- payloads ------------------------------------------------------------------------------


def real_results(corpus: Path, spec: str, windows: int, cache: Path | None = None):
    """One batch of ``windows`` windows of the corpus analysed by a model of ``spec``'s shape,
    and the model's description; kept in ``cache`` (a folder) when given, read from it after."""
    import json

    from headatlas.service.engine.results import BatchResult

    kept = None if cache is None else cache / f"{spec.replace(':', '-')}-{windows}"
    if kept is not None and kept.with_suffix(".bin").exists():
        described = json.loads(kept.with_suffix(".json").read_text())
        return BatchResult.from_bytes(kept.with_suffix(".bin").read_bytes()), described
    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.run_plan import iter_batches
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.params import AnalysisParams

    model = load_model(spec, device="cpu")
    tokens = TokenClasses.for_model(model)
    params = AnalysisParams().resolved(100)
    batch, docs, _ = next(iter(iter_batches(str(corpus), model, params, tokens, batch_size=windows)))
    result = analyze_batch(model, batch, params, tokens, documents=docs)
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.with_suffix(".bin").write_bytes(result.to_bytes())
        kept.with_suffix(".json").write_text(json.dumps(model.describe()))
    return result, model.describe()


def relabelled(result, batch_id: int):
    """A copy of ``result`` whose windows are other windows (ids made from ``batch_id``): the same
    payload, storable again in the same run."""
    out = copy.copy(result)
    out.window_ids = [f"{batch_id:06d}{w[6:]}" for w in result.window_ids]
    out.windows = [dict(w, window_id=i) for w, i in zip(result.windows, out.window_ids)]
    return out


def payloads(results: dict, repeats: int) -> None:
    from headatlas.service.engine.results import BatchResult
    from headatlas.workers.messages import BatchAnalysed, decode, encode

    print(f"# payload: one batch's message on the queue, encoded and decoded; {load()}")
    for shape, (result, _model) in results.items():
        n = len(result.window_ids)

        def enc(result=result) -> str:
            blob = result.to_bytes()
            return encode(BatchAnalysed("db", "run", 0, base64.b64encode(blob).decode("ascii")))

        enc_s, message = timed(enc, repeats)
        assert isinstance(message, str)

        def dec(message=message) -> BatchResult:
            msg = decode(message)
            assert isinstance(msg, BatchAnalysed)
            return msg.result()

        dec_s, _ = timed(dec, repeats)
        size = len(message.encode())
        print(f"payload, {shape} shape, encode: {rate(n, enc_s)}; {size:,} bytes per batch of {n} windows")
        print(f"payload, {shape} shape, decode: {rate(n, dec_s)}", flush=True)


# --- storing -------------------------------------------------------------------------------


def message_bytes(result) -> int:
    """The bytes of ``result``'s message on the queue (a ``BatchAnalysed``, as a worker sends it)."""
    from headatlas.workers.messages import BatchAnalysed, encode

    blob = base64.b64encode(result.to_bytes()).decode("ascii")
    return len(encode(BatchAnalysed("0" * 32, "0" * 32, 0, blob)).encode())


def writer_group(size: int) -> int:
    """The messages of ``size`` bytes each that the writer takes for one transaction with a backlog
    (``workers.writer.take_group``: until their bytes reach GROUP_BYTES, at most GROUP_MESSAGES)."""
    from headatlas.workers.policy import GROUP_BYTES_BOUND, GROUP_MESSAGES_BOUND, bound

    return min(bound(GROUP_MESSAGES_BOUND), -(-bound(GROUP_BYTES_BOUND) // size))


DEFAULT_FORMAT = "DuckDB's default storage format"  # a target's marker: a file, made in that format
DEFAULT_TARGET = "file in DuckDB's default format"


def storing(
    results: dict, folder: Path, batches: int, repeats: int, group: int = 0, stored: int = 0, formats: bool = False
) -> None:
    """``group``: batches per transaction (0: the writer's, ``writer_group``); ``batches``: per
    repeat (0: two transactions' worth); ``stored``: windows the run (and the database) already
    holds, stored first in the same transactions and not timed; ``formats``: also into a file of
    DuckDB's default storage format, in turn with the others."""
    from benchmarks.common import in_default_format
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.store import Store, store_batches

    print(f"# storing: transactions of store_batches; {load()}")
    targets: list[tuple[str, object]] = [("file", None)]
    if formats:  # the same into a file of DuckDB's default storage format (duckdb_settings.STORAGE_VERSION)
        targets.append((DEFAULT_TARGET, DEFAULT_FORMAT))
    lake_support = None
    try:
        import lake_support

        why = lake_support.unavailable()
    except ImportError as exc:
        why = f"tests/lake_support.py not importable ({exc})"
    if why is None:
        targets.append(("lake", lake_support))
    asked_group, asked_batches = group, batches
    for shape, (result, described) in results.items():
        size = message_bytes(result)
        group = asked_group or writer_group(size)
        batches = asked_batches or 2 * group
        print(
            f"storing, {shape} shape: {batches} batches of {len(result.window_ids)} windows in transactions of {group} "
            f"({'--group' if asked_group else 'the writer with a backlog'}; {size:,} bytes a message)"
            + (f", into a run already holding {stored:,} windows" if stored else ""),
            flush=True,
        )
        figures = {}
        times: dict[str, list[float]] = {target: [] for target, _ in targets}
        cpu: dict[str, list[float]] = {target: [] for target, _ in targets}
        sizes: dict[str, float] = {}  # a file's MB once stored
        for k in range(repeats):  # the targets in turn, so that the machine's drift falls on each alike
            for target, support in targets:
                place = folder / f"store-{shape}-{target.replace(' ', '-')}-{k}"
                place.mkdir()
                lake = None
                if support is None:
                    store = Store(place / "bench.duckdb")
                elif support == DEFAULT_FORMAT:  # a new headatlas file, copied into that format
                    Store(place / "made.duckdb").ensure_schema()
                    in_default_format(place / "made.duckdb", place / "bench.duckdb")
                    store = Store(place / "bench.duckdb")
                else:
                    lake = support.new_lake(place)
                    store = Store(lake.url, data_path=lake.data_path)
                try:
                    store.ensure_schema()
                    run, _ = store.find_or_create_run(
                        run_key=f"bench-{shape}",
                        name=f"bench-{shape}",
                        corpus="bench",
                        corpus_fingerprint="-",
                        model=described,
                        params=AnalysisParams().resolved(100).to_dict(),
                        engine="queue",
                        device="cpu",
                    )
                    before = -(-stored // len(result.window_ids))  # batches stored first, not timed
                    for g in range(0, before, group):
                        ids = range(g, min(g + group, before))
                        store_batches(store, run.run_id, [(b, relabelled(result, b)) for b in ids])
                    items = [(before + b, relabelled(result, before + b)) for b in range(batches)]
                    start, own = time.perf_counter(), cpu_seconds()[0]
                    for g in range(0, batches, group):
                        store_batches(store, run.run_id, items[g : g + group])
                    times[target].append(time.perf_counter() - start)
                    cpu[target].append(cpu_seconds()[0] - own)  # DuckDB's threads included
                    if lake is None:
                        sizes[target] = (place / "bench.duckdb").stat().st_size / 1e6
                finally:
                    if lake is not None:
                        support.remove_lake(lake)
        for target, _support in targets:
            windows = batches * len(result.window_ids)
            figures[target] = windows / statistics.median(times[target])
            per_window = statistics.median(cpu[target]) / windows * 1e3
            print(
                f"storing, {shape} shape, {target}: {figures[target]:,.0f} windows/s; {windows:,} windows; "
                f"CPU per window {per_window:.3f} ms (1 / CPU: {1e3 / per_window:,.0f} windows per CPU-second)"
                + (f"; the file {sizes[target]:.1f} MB" if target in sizes else ""),
                flush=True,
            )
        if DEFAULT_TARGET in figures:
            print(f"storing, {shape} shape, file / {DEFAULT_TARGET}: {figures['file'] / figures[DEFAULT_TARGET]:.2f}×")
        if "lake" in figures:
            print(f"storing, {shape} shape, lake / file: {figures['lake'] / figures['file']:.2f}×")
        else:
            print(f"storing, {shape} shape, lake: not measured ({why})")


# --- whole runs ----------------------------------------------------------------------------


def whole_runs(corpus: Path, folder: Path, queued: bool) -> None:
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.store import Store

    print(f"# whole run: random:tiny, batch 32, default parameters; {load()}")
    params = AnalysisParams()
    model = load_model("random:tiny", device="cpu")
    start = time.perf_counter()
    run = analyze_corpus(
        str(corpus),
        store=Store(folder / "embedded.duckdb"),
        model=model,
        params=params,
        corpus=survey_corpus(str(corpus)),
        batch_size=32,
    )
    wall = time.perf_counter() - start
    windows = Store(folder / "embedded.duckdb").get_run(run.run_id)
    count = _windows_of(folder / "embedded.duckdb", run.run_id)
    print(
        f"whole run, random:tiny, embedded: {rate(count, wall)}; {count:,} windows in {wall:.1f} s ({windows.status})"
    )
    if not queued:
        return
    try:
        from queue_support import Cluster, RedisServer
    except ImportError as exc:
        print(f"whole run, random:tiny, queued: not measured ({exc})")
        return
    from headatlas.service.config import Settings
    from headatlas.workers.submit import submit

    server = RedisServer(folder / "redis", persist=False).start()
    cluster = Cluster(server.url, folder / "cluster", time_limit_s=600)
    cluster.env.pop("OMP_NUM_THREADS", None)
    try:
        cluster.start_writer()
        cluster.start_worker()
        settings = Settings(broker_url=server.url, db=cluster.db)
        warm = folder / "warm.txt"
        warm.write_text("A short warm-up document. It loads the model in the worker.\n", encoding="utf-8")
        sub = submit(str(warm), settings=settings, model="random:tiny", dtype="float32", params=params, batch_size=32)
        cluster.wait_status(sub.name, timeout=600)
        start = time.perf_counter()
        sub = submit(str(corpus), settings=settings, model="random:tiny", dtype="float32", params=params, batch_size=32)
        submitted = time.perf_counter() - start
        status = cluster.wait_status(sub.name, timeout=3600)
        wall = time.perf_counter() - start
    finally:
        cluster.stop()
        server.stop()
    print(
        f"whole run, random:tiny, queued (1 worker, writer): {rate(sub.windows, wall)}; {sub.windows:,} windows in "
        f"{wall:.1f} s, submit {submitted:.1f} s of it ({status})"
    )


def _windows_of(db: Path, run_id: int) -> int:
    from sqlalchemy import text

    from headatlas.service.storage.db import transaction

    with transaction(str(db), read_only=True) as conn:
        return int(conn.execute(text("SELECT count(*) FROM run_windows WHERE run_id = :r"), {"r": run_id}).scalar_one())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", help="a .txt corpus (default: the development corpus, else generated text)")
    parser.add_argument(
        "--max-chars", type=int, default=0, help="only the corpus's first documents, about this many characters"
    )
    parser.add_argument("--processes", default=f"1,{min(os.cpu_count() or 1, 16)}", help="preparation: process counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batches", type=int, default=0, help="storing: batches of 32 windows per repeat (default: two transactions)"
    )
    parser.add_argument(
        "--group",
        type=int,
        default=0,
        help="storing: batches per transaction (default: the writer's with a backlog, up to GROUP_BYTES of messages)",
    )
    parser.add_argument(
        "--stored",
        type=int,
        default=0,
        help="storing: windows the run already holds, stored first and not timed (default: a new database)",
    )
    parser.add_argument("--parts", default="preparation,payload,storing,run", help="which parts, comma-separated")
    parser.add_argument("--no-queue", action="store_true", help="whole run: the embedded engine only")
    parser.add_argument(
        "--formats",
        action="store_true",
        help="storing: also into a file of DuckDB's default storage format, in turn (duckdb_settings.STORAGE_VERSION)",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="analyse the payloads' batches again (else kept in build/pipeline-results)"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (a smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.batches, args.max_chars = 1, 32, args.max_chars or 200_000
    folder = Path(tempfile.mkdtemp(prefix="headatlas-pipeline-"))
    try:
        corpus, named = find_corpus(args.corpus, folder)
        if args.max_chars:
            from benchmarks.common import corpus_prefix

            corpus = corpus_prefix(corpus, args.max_chars, folder / "prefix.txt")
            named += f", first {args.max_chars:,} characters"
        print(f"corpus: {named}")
        parts = set(args.parts.split(","))
        if "preparation" in parts:
            preparation(corpus, [int(n) for n in args.processes.split(",")], args.repeats)
        if parts & {"payload", "storing"}:
            cache = None if args.fresh else ROOT / "build" / "pipeline-results"
            results = {shape: real_results(corpus, spec, 32, cache) for shape, spec in SHAPES.items()}
            if "payload" in parts:
                payloads(results, args.repeats)
            if "storing" in parts:
                storing(results, folder, args.batches, args.repeats, args.group, args.stored, args.formats)
        if "run" in parts:
            whole_runs(corpus, folder, queued=not args.no_queue)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
