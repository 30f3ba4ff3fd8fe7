"""How soon `headatlas serve` prints its address, and what it imports before it does.

    python benchmarks/serve_start.py [--repeats 5] [--db PATH]

Starts `headatlas serve --port 0` ``repeats`` times (on a database made with `db upgrade` when none is
given) and times the line with the address, against a bare `python -c pass` started the same way
in the same loop (on a shared machine the ratio says more than the seconds); then lists, from
`python -X importtime`, the heaviest modules the command line loads before it parses the command,
and says whether numpy, torch, transformers, sqlalchemy or duckdb are among them (none need be: the
port is bound and the address printed before the library loads). Target: the address within 2 s.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median  # noqa: E402

# as pip installs a package: with its bytecode written (a shell with PYTHONDONTWRITEBYTECODE set compiles
# every module from source at every start, a second or more of the start on its own)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
HEAVY = ("numpy", "torch", "transformers", "sqlalchemy", "duckdb", "pandas", "matplotlib")


def address_after(headatlas: Path, db: Path) -> float:
    started = time.perf_counter()
    process = subprocess.Popen(
        [str(headatlas), "serve", "--db", str(db), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=ENV,
    )
    try:
        line = process.stdout.readline() if process.stdout else ""
        seconds = time.perf_counter() - started
        assert re.search(r"http://127\.0\.0\.1:\d+/", line), line
        return seconds
    finally:
        process.terminate()
        process.wait(30)


def bare_python() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True, env=ENV)
    return time.perf_counter() - started


def imports() -> tuple[list[tuple[int, str]], set[str]]:
    """(cumulative µs, module) of the heaviest imports of the command line, and the HEAVY ones loaded."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import headatlas.cli.main"],
        capture_output=True,
        text=True,
        check=True,
        env=ENV,
    )
    rows = []
    for line in done.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    loaded = {name.strip().split(".")[0] for _, name in rows} & set(HEAVY)
    return sorted(rows, reverse=True), loaded


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--db", type=Path)
    args = parser.parse_args(argv)
    headatlas = Path(sys.executable).parent / "headatlas"
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or Path(tmp) / "empty.duckdb"
        if args.db is None:
            subprocess.run([str(headatlas), "db", "upgrade", "--db", str(db)], check=True, capture_output=True, env=ENV)
        address_after(headatlas, db)  # once, not timed: writes the bytecode a first start compiles
        serve, bare = [], []
        for _ in range(args.repeats):  # interleaved: both see the same load
            serve.append(address_after(headatlas, db))
            bare.append(bare_python())
    print(
        f"serve printed its address after {median(serve):.2f} s (median of {args.repeats}; "
        f"{min(serve):.2f}–{max(serve):.2f}); a bare python start {median(bare):.2f} s: "
        f"{median(serve) / median(bare):.1f}× it"
    )
    rows, loaded = imports()
    print("heaviest imports of the command line (cumulative, python -X importtime):")
    for micros, name in rows[:12]:
        print(f"  {micros / 1e6:7.3f} s  {name.strip()}")
    print("loaded before the address: " + (", ".join(sorted(loaded)) if loaded else f"none of {', '.join(HEAVY)}"))


if __name__ == "__main__":
    main()
