"""A whole run on a GPU, measured: windows/s, the ratio to the bare forward pass, each stage's share.

    python benchmarks/gpu_check.py                 # make gpu-check: 20,000 BERT-base-shaped windows in
                                                   # bfloat16, then 5,000 of SmolLM2's shape
    python benchmarks/gpu_check.py --small --device cpu --dtype float32   # tiny shapes and counts: does it run?

For each shape (random weights: the work per window of the real model): the corpus is cut to the
first documents that give the windows asked (``--windows``); then, each timed on its own,

- preparation: reading, tokenising, segmenting and windowing that corpus, with the processes a
  run uses beside the model (HEADATLAS_PREPARE_PROCESSES, default the cores left);
- the bare forward pass over its batches (inference mode, autocast, synchronised);
- the whole run, ``analyze_corpus`` into a fresh DuckDB file: wall time, windows/s, its ratio to
  the bare forward pass; within it, the analysis (forward, hooks and statistics: the run's
  ``compute_s``) and storing (the store's transactions) as shares of its wall time; preparation
  and storing overlap the analysis (a thread or processes ahead of it, a thread behind it).

The corpus: ``--corpus``, else ``build/corpora/wikipedia_dev.txt`` (``make gpu-check`` copies the
development corpus there, an ignored folder that travels with the working tree), else
``../shared/corpora/wikipedia_dev.txt``, else generated text; the development corpus gives about
6,250 windows of 128 tokens, so it is repeated, each copy's documents opened by their copy number
("Copy 2.", shifting every window's tokens): distinct windows, the same prose. A corpus that gives
fewer windows than asked is refused: no ratio from a run whose fixed costs dominate.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from benchmarks.pipeline import CORPUS_CANDIDATES, generated_corpus  # noqa: E402


@dataclass(frozen=True)
class Shape:
    label: str
    spec: str
    windows: int
    batch_size: int


def shapes(args) -> list[Shape]:
    if args.small:
        return [
            Shape("BERT-base shape (small: random:tiny)", "random:tiny", args.windows or 40, 8),
            Shape("SmolLM2 shape (small: random:llama)", "random:llama", args.decoder_windows or 20, 8),
        ]
    return [
        Shape("BERT-base shape", "random:bert-base", args.windows or 20_000, args.batch_size or 256),
        Shape("SmolLM2 shape", "random:smollm2", args.decoder_windows or 5_000, args.decoder_batch_size or 128),
    ]


def source_documents(given: str | None, folder: Path, small: bool) -> tuple[list[str], str, bool]:
    """The documents to cut the corpus from, what they are, and whether copies may be made."""
    if given:
        text = Path(given).read_text(encoding="utf-8")
        return [d.strip() for d in text.split("\n\n") if d.strip()], given, False
    if small:
        from headatlas.service.engine.corpus import demo_corpus_path

        path, named = demo_corpus_path(), "the shipped excerpt"
    else:
        path = next((p for p in CORPUS_CANDIDATES if p.exists()), None)
        named = str(path)
        if path is None:
            path, named = generated_corpus(folder / "generated.txt"), "generated text (no development corpus found)"
    text = path.read_text(encoding="utf-8")
    return [d.strip() for d in text.split("\n\n") if d.strip()], named, True


def cut_corpus(docs: list[str], copies_allowed: bool, model, params, wanted: int, out: Path) -> tuple[Path, int]:
    """The first documents (copies numbered after the first pass) that give ``wanted`` windows,
    written to ``out``; with the windows they give (fewer than asked when the source runs out)."""
    from headatlas.service.engine.corpus import Document, document_id
    from headatlas.service.engine.windows import TokenClasses, iter_document_windows

    tokens = TokenClasses.for_model(model)
    kept: list[str] = []
    windows = copy = 0
    while windows < wanted:
        for doc in docs:
            text = doc if copy == 0 else f"Copy {copy}. {doc}"
            document = Document(document_id(text), "gpu-check", len(kept), 1, text)
            windows += sum(
                1 for _ in iter_document_windows(document, model.tokenizer, tokens, model.tokenizer_key, params)
            )
            kept.append(text)
            if windows >= wanted:
                break
        copy += 1
        if not copies_allowed:
            break
    out.write_text("\n\n".join(kept) + "\n", encoding="utf-8")
    return out, windows


def measure(shape: Shape, args, folder: Path) -> None:
    import torch

    from headatlas.service.config import Settings
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.preparation import preparation_processes
    from headatlas.service.engine.run_plan import iter_batches, survey_corpus
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.store import Store

    model = load_model(shape.spec, device=args.device, dtype=args.dtype)
    params = AnalysisParams(dtype=args.dtype)
    tokens = TokenClasses.for_model(model)
    docs, named, copies = source_documents(args.corpus, folder, args.small)
    corpus, windows = cut_corpus(docs, copies, model, params, shape.windows, folder / f"{shape.spec[7:]}.txt")
    where = f"{shape.label}, {args.dtype}, {model.device}"
    if windows < shape.windows:
        raise SystemExit(
            f"{where}: the corpus ({named}) gives {windows:,} windows of the {shape.windows:,} asked: no ratio is "
            "reported from fewer (fixed costs would dominate); give a larger --corpus or ask fewer --windows"
        )
    threads = 2 if model.device.type != "cpu" else torch.get_num_threads()
    processes = preparation_processes(Settings.from_env().prepare_processes, model_threads=threads)

    start = time.perf_counter()
    batches = [
        b
        for b, _, _ in iter_batches(str(corpus), model, params, tokens, batch_size=shape.batch_size, workers=processes)
    ]
    prepare_s = time.perf_counter() - start
    assert sum(len(b.windows) for b in batches) == windows

    def bare() -> float:
        start = time.perf_counter()
        with torch.inference_mode(), model.autocast():
            for b in batches:
                model.model(input_ids=b.input_ids.to(model.device), attention_mask=b.attention_mask.to(model.device))
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode(), model.autocast():  # warm-up: kernels chosen, memory pooled
        model.model(
            input_ids=batches[0].input_ids.to(model.device), attention_mask=batches[0].attention_mask.to(model.device)
        )
    bare_s = min(bare() for _ in range(2))
    batches.clear()  # the run prepares its own

    stored_s = 0.0

    class TimedStore(Store):
        def ingest(self, run_id, items):
            nonlocal stored_s
            begun = time.perf_counter()
            try:
                return super().ingest(run_id, items)
            finally:
                stored_s += time.perf_counter() - begun

    store = TimedStore(folder / f"{shape.spec[7:]}.duckdb")
    store.ensure_schema()  # a database's one-time set-up, not part of a run
    summary = survey_corpus(str(corpus))
    start = time.perf_counter()
    run = analyze_corpus(
        str(corpus), store=store, model=model, params=params, corpus=summary, batch_size=shape.batch_size
    )
    wall = time.perf_counter() - start
    done = store.get_run(run.run_id)
    print(
        f"gpu-check, {where}: {windows / wall:,.0f} windows/s; {windows:,} windows in {wall:.1f} s, "
        f"{wall / bare_s:.2f}× the bare forward pass ({windows / bare_s:,.0f} windows/s, {bare_s:.2f} s); "
        f"batch {shape.batch_size}; {done.status}"
    )
    prep_label = "1 process" if processes == 1 else f"{processes} processes"
    print(
        f"gpu-check, {where}, preparation alone, {prep_label}: {windows / prepare_s:,.0f} windows/s; {prepare_s:.1f} s"
    )
    for stage, seconds in (
        ("analysis (forward, hooks, statistics)", done.compute_s),
        (f"preparation ({prep_label}, timed alone)", prepare_s),
        ("storing", stored_s),
        ("bare forward (timed alone)", bare_s),
    ):
        print(f"gpu-check, {where}, share of the run: {stage}: {seconds:.2f} s, {seconds / wall:.0%}")
    if args.small:
        print(f"gpu-check, {where}: small counts: a check that it runs, not a measurement")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=0, help="BERT-base-shaped windows (default 20,000)")
    parser.add_argument("--decoder-windows", type=int, default=0, help="SmolLM2-shaped windows (default 5,000)")
    parser.add_argument("--batch-size", type=int, default=0, help="BERT-base shape (default 256)")
    parser.add_argument("--decoder-batch-size", type=int, default=0, help="SmolLM2 shape (default 128)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--corpus", help="a .txt corpus, used as it is (not repeated)")
    parser.add_argument("--only", choices=["encoder", "decoder"], help="one shape only")
    parser.add_argument("--small", action="store_true", help="tiny shapes and counts: a check that the script runs")
    args = parser.parse_args(argv)
    import torch

    from benchmarks.common import machine

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"no CUDA device visible to torch {torch.__version__}: run with --small --device cpu to check the script"
        )
    print(f"# gpu-check: {machine()}; load average {os.getloadavg()[0]:.1f}")
    chosen = shapes(args)
    if args.only:
        chosen = chosen[:1] if args.only == "encoder" else chosen[1:]
    with tempfile.TemporaryDirectory() as tmp:
        for shape in chosen:
            measure(shape, args, Path(tmp))


if __name__ == "__main__":
    main()
