"""Where a command's CPU goes, by what the code was doing: every Python process the command starts
sampled by py-spy (``pip install py-spy``), the samples summed by kind of process and by category.

    python benchmarks/suite_profile.py [--rate 40] [--raw FILE] -- .venv/bin/python -m pytest -q -n 3 --dist loadgroup
    python benchmarks/suite_profile.py --read FILE     # the tables again from a saved profile

A sample is one thread of one process seen running (py-spy leaves idle threads out); time spent in
C (DuckDB, torch's kernels) counts for the Python frame that called it. Kinds, by command line:
pytest-xdist's workers (and the processes they fork without exec), the processes the queue tests'
launcher forks (``tests/queue_support.py``), console scripts and snippets the tests start, the rest
as named. Categories, the first that matches a sample's stack, in this order: imports; migrations
and new files; opening and closing a database (its instance, catalogue, engine, close); the schema
and file checks; a finished run's derivation; compaction; storing batches; loading a model; the
model's forward pass and the measures; figures; reports and queries; the web app; the ``sql``
sandbox; DuckDB statements run elsewhere; other storage; tokenising; Celery, kombu and Redis; the
tests' own code; the rest. Then the test functions with the most samples in the workers. Shares only: sampling slows the command, and a
sample is not a fixed number of CPU seconds.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("imports", ("_find_and_load",)),
    ("migrations, new database files", ("upgrade (service/storage/db.py", "_migrate", "new_file.py", "rebuild_views")),
    (
        "opening and closing a database",
        (
            "FileBackend.connected",
            "FileBackend.held",
            "FileBackend.engine",
            # the kept instances' own work (every statement runs through AttachedConnection.execute,
            # which is not opening a file: until 2026-12-07 it counted here, a third of all samples)
            ";attach (service/storage/backends/file_instances.py",
            ";release (service/storage/backends/file_instances.py",
            ";connect (service/storage/backends/file_instances.py",
            "_Kept.__init__ (service/storage/backends/file_instances.py",
            "AttachedConnection.close",
            "ConnectionWrapper.close",
            "Dialect.initialize",
            "Dialect.__init__",
            "LakeBackend.connect",
            "LakeBackend.prepare_connection",
            "do_rollback",
        ),
    ),
    ("schema and file checks", ("check_schema", "check_file", "check_headatlas_file")),
    ("a finished run's derivation", ("derive (service/reports/stored.py",)),
    ("compaction", ("compact_run",)),
    ("storing batches", ("ingest_batch", "store_batches", "insert_stream")),
    ("loading a model", ("load_model",)),
    ("forward pass and measures", ("analyze_batch", "forward (torch", "_call_impl", "attribution.py", "effects.py")),
    ("figures (matplotlib)", ("matplotlib",)),
    ("reports and queries", ("service/reports/",)),
    ("web app", ("service/web/",)),
    ("sql sandbox", ("readonly.py",)),
    ("DuckDB statements, elsewhere", ("AttachedConnection.execute", "CursorWrapper.execute")),
    ("other storage", ("service/storage/",)),
    ("tokenising, windows", ("service/engine/corpus", "service/engine/windows", "sentences.py", "tokeniz")),
    ("Celery, kombu, Redis", ("celery/", "kombu/", "redis/")),
    ("the tests' own code", ("(test_", "(conftest.py", "(queue_support.py", "(lake_support.py")),
]
TEST = re.compile(r";(test_\w+) \((test_\w+\.py):")


def kind(command: str) -> str:
    if "exec(eval(sys.stdin" in command:
        return "pytest workers (xdist) and their forks"
    if "import celery, kombu" in command:
        return "queue processes forked by the tests' launcher"
    if "headatlas" in command:
        return "headatlas console scripts and snippets"
    if "pytest" in command:
        return "pytest main process"
    return Path(command.split(" ", 1)[0]).name or "(unnamed)"


def category(stack: str) -> str:
    for name, keys in CATEGORIES:
        if any(key in stack for key in keys):
            return name
    return "the rest"


def records(raw: str):
    """(innermost process's command line, its frames, samples) per line of py-spy's raw output; a
    command line may hold newlines and quotes (``python -c``), so a record ends at its count."""
    for record in re.split(r"(?<=\d)\n(?=process )", raw):
        stack, _, count = record.strip().rpartition(" ")
        if not count.isdigit():
            continue
        starts = [m.start() for m in re.finditer(r'(?:^|;)process \d+:"', stack)]
        own = stack[starts[-1] :] if starts else stack
        begin, end = own.find(':"') + 2, own.find('";')
        yield (own[begin:end], own[end + 2 :]) if end >= 0 else (own, ""), int(count)


def report(raw: str) -> None:
    kinds: collections.Counter[str] = collections.Counter()
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    tests: collections.Counter[str] = collections.Counter()
    for (command, frames), count in records(raw):
        k = kind(command)
        kinds[k] += count
        by_kind[k][category(frames)] += count
        if k.startswith("pytest workers") and (found := TEST.search(";" + frames)):
            tests[f"{found.group(2)}::{found.group(1)}"] += count
    total = sum(kinds.values())
    print(f"{total} samples\n\n| samples | share | kind of process |\n|---|---|---|")
    for name, count in kinds.most_common(8):
        print(f"| {count} | {100 * count / total:.1f} % | {name} |")
    for name, _count in kinds.most_common(3):
        print(f"\n| {name}: category | samples | share of all |\n|---|---|---|")
        for part, n in by_kind[name].most_common(12):
            print(f"| {part} | {n} | {100 * n / total:.1f} % |")
    print("\n| test (in the workers) | samples |\n|---|---|")
    for name, count in tests.most_common(15):
        print(f"| {name} | {count} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=40, help="samples a second per thread (py-spy's --rate)")
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw output here")
    parser.add_argument("--read", type=Path, help="read a saved raw output instead of running a command")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.read:
        report(args.read.read_text(errors="replace"))
        return
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to profile after --")
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        sys.exit("py-spy is not installed: pip install py-spy")
    raw = args.raw or Path(tempfile.mkdtemp()) / "profile.raw"
    spied = [spy, "record", "--subprocesses", "--nonblocking", "--rate", str(args.rate), "--format", "raw"]
    done = subprocess.run([*spied, "-o", str(raw), "--", *command])
    print(f"`{' '.join(command)}`: exit {done.returncode}; raw profile {raw}\n")
    report(raw.read_text(errors="replace"))


if __name__ == "__main__":
    main()
