"""How `headatlas analyze` ends when Ctrl-C comes at a given moment of its start.

    python benchmarks/ctrl_c_delays.py [--processes 2] [--delays 0,0.5,0.8,0.85,0.9,1,3] [--repeats 2]

Writes a corpus of 60,000 one-line documents (about 50 MB) in a temporary folder, and for each
delay (seconds after the command prints its ``corpus:`` line) and repeat starts ``headatlas analyze
CORPUS --model random:tiny`` (HEADATLAS_PREPARE_PROCESSES = ``--processes``) in a session of its
own, sends SIGINT to its process group (the terminal's Ctrl-C), and prints the exit code, the
seconds from the signal to the exit, and whether the end was clean: exit 130, the resume hint, no
traceback. A command still running 60 s after the signal is a hang (killed). Around 0.8-0.9 s a
press used to land as the sentence segmenter loads, inside a destructor, where Python drops it
(docs/reliability.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HANG_S = 60.0


def write_corpus(path: Path) -> None:
    words = "the cat sat on a mat while dogs ran far away under big green trees and birds sang".split()
    with path.open("w", encoding="utf-8") as out:
        for i in range(60_000):
            out.write(f"Document {i}. " + " ".join(words[(i + k) % len(words)] for k in range(190)) + ".\n\n")


def press(folder: Path, corpus: Path, delay: float, processes: int) -> tuple[str, str, str]:
    db = folder / "big.duckdb"
    for old in folder.glob("big.duckdb*"):
        old.unlink()
    headatlas = shutil.which("headatlas") or str(Path(sys.executable).with_name("headatlas"))
    env = dict(os.environ, HEADATLAS_PREPARE_PROCESSES=str(processes))
    proc = subprocess.Popen(
        [headatlas, "analyze", str(corpus), "--model", "random:tiny", "--db", str(db)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    read = threading.Event()

    def reader() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("corpus:"):
                read.set()

    threading.Thread(target=reader, daemon=True).start()
    read.wait(240)
    time.sleep(delay)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        code = proc.wait(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "-", f"> {HANG_S:.0f}", "no: still running (killed)"
    took = time.monotonic() - sent
    said = "".join(lines)
    clean = code == 130 and "re-run the same command to resume" in said and "Traceback" not in said
    return str(code), f"{took:.2f}", "yes" if clean else "no: " + " ".join(said.split())[-160:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="HEADATLAS_PREPARE_PROCESSES")
    parser.add_argument("--delays", default="0,0.5,0.8,0.85,0.9,1,3", help="seconds after `corpus:`")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="headatlas-ctrl-c-"))
    try:
        corpus = folder / "big.txt"
        write_corpus(corpus)
        print("| delay s | exit | s to exit | clean |\n|---|---|---|---|")
        for delay in (float(d) for d in args.delays.split(",")):
            for _ in range(args.repeats):
                code, took, clean = press(folder, corpus, delay, args.processes)
                print(f"| {delay:g} | {code} | {took} | {clean} |", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
