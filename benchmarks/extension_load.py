"""What loading a shipped DuckDB extension costs a new instance, with DuckDB's signature check and
as headatlas's own instances load them (``duckdb_settings.OWN_EXTENSIONS``: unchecked).

    python benchmarks/extension_load.py [--repeats 7]

For each of ``ducklake`` and ``postgres_scanner`` (the wheels' binaries, ``extension_directory``):
a new in-memory instance with headatlas's settings, checked (``SIGNED_EXTENSIONS``, as the `sql`
sandbox makes it) and unchecked in turn, ``--repeats`` times, and ``LOAD`` timed in process CPU
(``time.process_time``: DuckDB hashes the binary on several threads) and wall-clock seconds.
Prints the median of each and the binaries' sizes. Every instance that attaches a lake loads
both (its catalogue is PostgreSQL's); the sandbox's lake instance loads DuckLake alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import duckdb

    from headatlas.service.storage.duckdb_settings import SIGNED_EXTENSIONS, duckdb_config, extension_directory

    folder = extension_directory()
    if folder is None:
        raise SystemExit("the DuckDB extension wheels are not installed (make install)")
    ways = {"checked (the sandbox)": SIGNED_EXTENSIONS, "unchecked (headatlas's own)": {}}
    print(f"{os.cpu_count()} CPUs; median of {args.repeats} loads, each in a new instance")
    print("| extension | size, MB | load | CPU s | wall s |")
    print("|---|---|---|---|---|")
    for extension in ("ducklake", "postgres_scanner"):
        size = sum(p.stat().st_size for p in Path(folder).rglob(f"{extension}.duckdb_extension")) / 1e6
        spent: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        for _ in range(args.repeats):
            for way, settings in ways.items():  # in turn: the machine's drift falls on both
                instance = duckdb.connect(config=duckdb_config(threads=1, **settings))
                began, cpu = time.perf_counter(), time.process_time()
                instance.execute(f"LOAD {extension}")
                spent[way].append((time.process_time() - cpu, time.perf_counter() - began))
                instance.close()
        for way, times in spent.items():
            cpu_s = statistics.median(c for c, _ in times)
            wall_s = statistics.median(w for _, w in times)
            print(f"| {extension} | {size:.1f} | {way} | {cpu_s:.3f} | {wall_s:.3f} |")


if __name__ == "__main__":
    main()
