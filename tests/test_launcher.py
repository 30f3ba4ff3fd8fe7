"""The queue tests' launcher (tests/queue_support.py) never outlives the process that started it:
a pytest worker that is killed, or exits without running its atexit hooks, leaves no launcher
behind and no socket folder in the temporary folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a stand-in for a pytest worker: starts the launcher (without the model stack: the same server),
# says its pid and socket, and is killed with SIGKILL (no atexit, no cleanup of its own)
PARENT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import queue_support
proc, path = queue_support.start_launcher(preload=False)
print(proc.pid, path, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie no init has reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state != "Z"


def test_the_launcher_dies_with_its_parent_and_removes_its_folder():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(tests=str(ROOT / "tests"))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert parent.stdout is not None and parent.stdin is not None
    pid_text, path = parent.stdout.readline().split()
    launcher, folder = int(pid_text), Path(path).parent
    try:
        assert _alive(launcher) and folder.is_dir() and folder.name.startswith("headatlas-launcher-")
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while (_alive(launcher) or folder.exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(launcher), "the launcher outlived its parent"
        assert not folder.exists(), f"the launcher left {folder}"
    finally:
        if _alive(launcher):
            os.kill(launcher, signal.SIGKILL)


def test_a_forked_command_is_attached_as_a_child_process_is(tmp_path):
    """ForkedCommand: its stdout and stderr apart, its stdin given, its exit code (2 for a refusal,
    -9 for SIGKILL), its own session (os.killpg reaches it), as subprocess gives them."""
    sys.path.insert(0, str(ROOT / "tests"))
    from queue_support import fork_cli, run_forked_cli

    version = run_forked_cli("--version")
    assert (version.returncode, version.stdout.split()[0], version.stderr) == (0, "headatlas", "")
    refused = run_forked_cli("runs", "--db", str(tmp_path / "none.duckdb"))
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.startswith("error: no database at ")
    db = str(tmp_path / "made.duckdb")
    assert run_forked_cli("db", "upgrade", "--db", db).returncode == 0
    waiting = fork_cli("sql", "-", "--db", db)  # reads its statement from stdin, which stays open
    time.sleep(0.5)
    assert waiting.poll() is None and os.getpgid(waiting.pid) == waiting.pid != os.getpgid(0)
    os.killpg(waiting.pid, signal.SIGKILL)
    assert waiting.wait(timeout=30) == -signal.SIGKILL
    given = run_forked_cli("sql", "-", "--db", db, "--format", "csv", input="SELECT 41 + 1 AS a")
    assert (given.returncode, given.stdout.split()) == (0, ["a", "42"]), given.stderr


def test_a_forked_process_is_watched_by_its_pidfd_not_by_a_pid_another_process_may_take():
    """The launcher's children are reaped as they end, so an ended child's pid is free at once, and a
    suite run goes round this machine's pids. Watched by its number, a process that had ended looked
    alive while another held the number, and a cluster's stop signalled that process's group."""
    import queue_support

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        forked = queue_support.Forked(ended.pid)
        ended.wait()
        forked.pid = other.pid  # the number taken by another process, as after the pids went round
        assert forked.wait(10) == -1 and forked.poll() == -1
        queue_support.signal_group(forked, signal.SIGKILL)  # an ended process: nothing is signalled
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
