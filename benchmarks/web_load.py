"""`headatlas serve` under load, as a process on a loopback port: its memory after large SQL answers,
how long a page (already read once) takes while slow SQL statements run, and while idle connections
are held open.

    python benchmarks/web_load.py [--answer-mb 100] [--answers 4] [--slow 8] [--slow-limit-s 10]
        [--idle 8] [--give-up-s 60] [--keep DIR] [--preload MODULE]

The database is a small synthetic run (``web_pages.synthetic_database``: 512 windows, 2×4 heads).

- memory: the server's resident size (VmRSS) at the start, then after ``--answers`` different
  statements each answering ``--answer-mb`` MB (1,000 rows of a long string) through
  ``/runs/1/sql.json``; each answer's status is printed (400: refused over the web's byte cap);
- slow statements: ``--slow`` parallel ``SELECT count(*) + k FROM range(100000000000)`` (each runs to
  the time limit, ``HEADATLAS_SQL_TIMEOUT_S`` = ``--slow-limit-s``), and meanwhile ``/runs`` asked
  every half second: the longest it took, and the statements' statuses (503: told busy);
- idle connections: ``--idle`` connections opened and left silent, then ``/runs``: how long it took.

A request that takes more than ``--give-up-s`` is given up on and said as "> N s". ``--preload
MODULE``: a module the server imports first (a shim that loads another version of service/web, to
measure the code before a change the same way).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.web_pages import synthetic_database  # noqa: E402

SLOW = "SELECT count(*) + {k} AS n FROM range(100000000000)"
BIG = "SELECT repeat('x', {width}) || k || '-{i}' AS v FROM range(1000) t(k)"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def timed_get(url: str, give_up_s: float) -> tuple[int | str, float]:
    """(status, seconds); the status is "gave up" past ``give_up_s``."""
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=give_up_s) as answer:  # noqa: S310 - our loopback server
            answer.read()
            status: int | str = answer.status
    except urllib.error.HTTPError as error:
        error.read()
        status = error.code
    except (TimeoutError, urllib.error.URLError, ConnectionError) as error:
        status = f"gave up ({type(getattr(error, 'reason', error)).__name__})"
    return status, time.perf_counter() - started


def seconds(status: int | str, took: float, give_up_s: float) -> str:
    return f"> {give_up_s:g} s" if isinstance(status, str) else f"{took:.2f} s"


def serve(db: Path, preload: str | None, limit_s: float) -> tuple[subprocess.Popen, str]:
    code = (f"import {preload}; " if preload else "") + "from headatlas.cli.main import main; main()"
    env = {**os.environ, "HEADATLAS_SQL_TIMEOUT_S": str(limit_s)}
    process = subprocess.Popen(
        [sys.executable, "-c", code, "serve", "--db", str(db), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    line = process.stdout.readline() if process.stdout else ""
    port = re.search(r":(\d+)/", line)
    if not port:
        process.kill()
        raise SystemExit(f"error: the server did not print its address ({line!r})")
    return process, f"http://127.0.0.1:{port.group(1)}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answer-mb", type=int, default=100)
    parser.add_argument("--answers", type=int, default=4)
    parser.add_argument("--slow", type=int, default=8)
    parser.add_argument("--slow-limit-s", type=float, default=10.0)
    parser.add_argument("--idle", type=int, default=8)
    parser.add_argument("--give-up-s", type=float, default=60.0)
    parser.add_argument("--keep", type=Path, help="keep the database in this folder (and reuse it)")
    parser.add_argument("--preload", help="a module the server imports first")
    args = parser.parse_args(argv)
    give_up = args.give_up_s
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        db = folder / "web-load.duckdb"
        if not db.exists():
            synthetic_database(db, 512, 2, 4)
        print(f"# load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.preload or 'this checkout'}")

        process, base = serve(db, args.preload, args.slow_limit_s)
        try:
            timed_get(f"{base}/runs", give_up)  # read once: kept
            print(f"memory: {rss_mb(process.pid):.0f} MB at the start")
            width = args.answer_mb * 1000
            for i in range(args.answers):
                q = urllib.parse.quote(BIG.format(width=width, i=i))
                status, took = timed_get(f"{base}/runs/1/sql.json?q={q}", give_up)
                print(
                    f"memory: {rss_mb(process.pid):.0f} MB after answer {i + 1} of {args.answer_mb} MB "
                    f"(status {status}, {seconds(status, took, give_up)})",
                    flush=True,
                )

            statuses: list[int | str] = []

            def slow(k: int) -> None:
                statuses.append(timed_get(f"{base}/runs/1/sql.json?q={urllib.parse.quote(SLOW.format(k=k))}", 600)[0])

            threads = [threading.Thread(target=slow, args=(k,), daemon=True) for k in range(args.slow)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            waits: list[tuple[int | str, float]] = []
            began = time.perf_counter()
            while time.perf_counter() - began < args.slow_limit_s - 1:
                waits.append(timed_get(f"{base}/runs", give_up))
                if isinstance(waits[-1][0], str):
                    break
                time.sleep(0.5)
            worst = max(waits, key=lambda w: w[1])
            print(
                f"/runs while {args.slow} slow statements run ({args.slow_limit_s:g} s limit): {len(waits)} asked, "
                f"longest {seconds(*worst, give_up)} (status {worst[0]})",
                flush=True,
            )
            for t in threads:
                t.join(args.slow * args.slow_limit_s + 60)
            said = [str(s) for s in statuses]
            counted = {s: said.count(s) for s in sorted(set(said))}
            print(f"slow statements answered: {counted}", flush=True)

            host, port = base.removeprefix("http://").rsplit(":", 1)
            idle = [socket.create_connection((host, int(port))) for _ in range(args.idle)]
            time.sleep(0.5)
            status, took = timed_get(f"{base}/runs", give_up)
            print(f"/runs with {args.idle} idle connections open: {seconds(status, took, give_up)} (status {status})")
            for sock in idle:
                sock.close()
            print(f"memory: {rss_mb(process.pid):.0f} MB at the end")
        finally:
            process.kill()
            process.wait(30)


if __name__ == "__main__":
    main()
