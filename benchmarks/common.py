"""Shared helpers for the benchmarks: corpora, timing, medians."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

SHARED_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpora" / "wikipedia_dev.txt"


def default_corpus() -> Path:
    """The development corpus where it exists (a checkout beside ../shared), else the shipped excerpt."""
    from headatlas.service.engine.corpus import demo_corpus_path

    return SHARED_CORPUS if SHARED_CORPUS.exists() else demo_corpus_path()


def corpus_prefix(source: Path, max_chars: int, out: Path) -> Path:
    """The first documents of ``source`` up to about ``max_chars`` characters, as a .txt corpus."""
    kept, size = [], 0
    for doc in source.read_text(encoding="utf-8").split("\n\n"):
        if size >= max_chars:
            break
        kept.append(doc.strip())
        size += len(doc)
    out.write_text("\n\n".join(kept) + "\n", encoding="utf-8")
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        return False


def threads() -> int:
    import torch

    return torch.get_num_threads()


def machine() -> str:
    import platform

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {gpu}"


def forward_passes(model, batches, params, tokens, repeats: int) -> dict[str, list[float]]:
    """Seconds of each pass over ``batches``, ``repeats`` times, interleaved so that drifts in
    machine load hit all three: the bare forward, the forward with the capture hooks, and the whole
    analysis (``analyze_batch``). One warm-up of each first."""
    import torch

    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.hooks import capture_attention

    def bare():
        with torch.inference_mode():
            for b in batches:
                model.model(input_ids=b.input_ids, attention_mask=b.attention_mask)

    def hooked():
        with torch.inference_mode(), capture_attention(model.model, on_layer=lambda *_: None):
            for b in batches:
                model.model(input_ids=b.input_ids, attention_mask=b.attention_mask)

    def full():
        for b in batches:
            analyze_batch(model, b, params, tokens)

    runs: dict[str, list[float]] = {"bare forward": [], "forward + hooks": [], "analyze_batch": []}
    for fn in (bare, hooked, full):
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in zip(runs, (bare, hooked, full)):
            with Timer() as t:
                fn()
            runs[name].append(t.seconds)
    return runs


def in_default_format(source: Path, copy: Path) -> str:
    """``source`` (a headatlas file) copied whole into ``copy``, a new file in DuckDB's default
    storage format (``COPY FROM DATABASE``), which headatlas made its files in before
    (``duckdb_settings.STORAGE_VERSION``); returns that format's name."""
    import duckdb

    with duckdb.connect(":memory:") as instance:  # DuckDB's own settings: the default format
        (made,) = instance.execute("SELECT current_setting('storage_compatibility_version')").fetchone()  # type: ignore[misc]
        quoted = [str(p).replace("'", "''") for p in (source, copy)]
        instance.execute(f"ATTACH '{quoted[0]}' AS src (READ_ONLY)")
        instance.execute(f"ATTACH '{quoted[1]}' AS dst")
        instance.execute("COPY FROM DATABASE src TO dst")
    return str(made)


def command_after_dashes(parser, example: str) -> tuple:
    """Parse ``parser``'s options and the command after ``--`` (``example``: one, for the error when
    none is named). Returns (options, the command's words)."""
    import argparse

    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error(f"name the command after --, e.g. -- {example}")
    return args, command
