"""Where a command's CPU goes, by process: every process on the machine read from ``/proc`` once a
second while the command runs (Linux), summed by kind.

    python benchmarks/process_cpu.py [--every 1.0] -- make test

Prints the command's wall-clock time, then a table: CPU seconds, processes, kind. A process's CPU
is its own (user + system) as last read before it ended, so a process that lived under a second
may be missed (its parent's reaped-children time holds it); one read only after it ended has no
command line (kernel threads have none either). Kinds, by command line: pytest's
workers (and what they fork), pytest's main process, the processes the queue tests' launcher
forks (``tests/queue_support.py``: Celery workers, writers and beats, whose command line is the
launcher's), console scripts (``headatlas …``), servers (Redis, PostgreSQL, Chromium), and the
rest by program name. The whole machine is read: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import command_after_dashes  # noqa: E402


def kind(cmd: str) -> str:
    if "exec(eval(sys.stdin.readline()))" in cmd:
        return "pytest workers (xdist) and their forks"
    if "import celery, kombu" in cmd:
        return "queue processes forked by the tests' launcher (workers, writers, beats)"
    if "bin/headatlas" in cmd or "headatlas.cli" in cmd or "from headatlas" in cmd:
        return "headatlas console scripts and snippets the tests start"
    if "-m pytest" in cmd or "bin/pytest" in cmd:
        return "pytest main process"
    for name in ("redis", "postgres", "chrom", "mypy", "pip", "ruff"):
        if name in cmd:
            return name
    return os.path.basename(cmd.split(" ", 1)[0]) or "(kernel threads, unnamed)"


def sample(seen: dict[str, tuple[str, float]]) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as line:
                cmd = line.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        key = f"{pid}:{fields[19]}"  # pid and start time: pids are reused
        if not cmd and key in seen:  # ended (a zombie has no command line): the one it had
            cmd = seen[key][0]
        seen[key] = (cmd, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between two readings")
    args, command = command_after_dashes(parser, "make test")
    seen: dict[str, tuple[str, float]] = {}
    sample(seen)
    before = {key: cpu for key, (_cmd, cpu) in seen.items()}  # what ran before the command
    started = time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        sample(seen)
        time.sleep(args.every)
    sample(seen)
    wall = time.monotonic() - started
    sums: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for key, (cmd, cpu) in seen.items():
        used = cpu - before.get(key, 0.0)
        if used > 0:
            sums[kind(cmd)] += used
            counts[kind(cmd)] += 1
    print(
        f"\n`{' '.join(command)}`: exit {proc.returncode}, {wall:.0f} s of wall-clock time, {sum(sums.values()):.0f} s of CPU"
    )
    print("| CPU s | processes | kind |\n|---|---|---|")
    for name, cpu in sums.most_common():
        print(f"| {cpu:.1f} | {counts[name]} | {name} |")


if __name__ == "__main__":
    main()
