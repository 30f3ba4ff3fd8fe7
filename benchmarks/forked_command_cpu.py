"""A command's CPU started as the console script against forked from the tests' launcher
(tests/queue_support.py: ``run_forked_cli``, its imports done): a tiny ``analyze`` of a two-document
corpus with ``random:tiny``, the two ways alternated ``--repeats`` times in one process.

    python benchmarks/forked_command_cpu.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    from conftest import run_cli
    from queue_support import _launcher_socket, forked_cpu_seconds, run_forked_cli

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    folder = Path(tempfile.mkdtemp())
    corpus = folder / "t.txt"
    corpus.write_text("One sentence here. Another one there.\n\nA second doc.\n", encoding="utf-8")
    _launcher_socket()  # started once: its imports are the pytest process's, not the command's
    for k in range(repeats):
        for start, name in ((run_cli, "console script"), (run_forked_cli, "forked")):
            db = folder / f"{k}-{name[0]}.duckdb"
            before, forked = resource.getrusage(resource.RUSAGE_CHILDREN), forked_cpu_seconds()
            began = time.perf_counter()
            done = start("analyze", str(corpus), "--model", "random:tiny", "-q", "--db", str(db))
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime + forked_cpu_seconds() - forked
            print(f"{name}: exit {done.returncode}, {time.perf_counter() - began:.2f} s, {cpu:.2f} s of CPU")


if __name__ == "__main__":
    main()
