"""A run's causal effects and a run's pruning curves survive their command being stopped: the
command killed with SIGKILL (nothing of it runs on), and stopped with Ctrl-C (SIGINT: it says so,
exits 130), then the same command run again. The stopped commands are processes of their own
forked from the tests' launcher, the console script's imports done (tests/queue_support.py:
ForkedCommand); Ctrl-C to the installed script itself, interpreter start and all, is
tests/test_settings_and_plugins.py's.

`analyze --effects zero,mean` stores each batch's effects with its statistics, so a stopped run
resumes: every effect stored at the end equals, to the bit, the run never stopped (each batch is
one window here, so the rows compare window by window). `prune` stores its curves in one
transaction once every curve is measured: a stopped prune leaves nothing, and the same command
run again measures them afresh (curves equal to the bit to a prune never stopped)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from conftest import invoke_cli
from queue_support import ForkedCommand, fork_cli
from sqlalchemy import text

pytestmark = pytest.mark.slow

EFFECT_COLUMNS = ("effect_zero", "effect_mean", "importance", "drift_zero", "drift_mean")
# one window per batch, every window an effect window, stored after every batch: an interruption
# lands among the effect windows, and the rows compare window by window
ANALYZE = ["--model", "random:tiny", "--seq-len", "32", "--effects", "zero,mean", "--effect-windows", "64"]
ANALYZE += ["--effect-reference", "4", "--batch-size", "1", "--quiet"]
PRUNE = ["--seeds", "1", "--windows", "4", "--step", "25%", "--reference", "4"]
ENV = {"HEADATLAS_STORE_EVERY_S": "0", "HEADATLAS_PREPARE_PROCESSES": "1"}


@pytest.fixture()
def corpus(tmp_path, demo_corpus) -> Path:
    """About twenty windows of real text (three documents): a command stopped among them has
    some stored and some left whatever the machine's speed."""
    docs = demo_corpus.read_text(encoding="utf-8").split("\n\n")[:3]
    path = tmp_path / "c.txt"
    path.write_text("\n\n".join(d.strip()[:900] for d in docs) + "\n", encoding="utf-8")
    return path


def _start(*args: str) -> ForkedCommand:
    """The command forked from the launcher, in a session of its own."""
    return fork_cli(*args, env=ENV)


def _effect_windows(db: Path) -> int:
    """Effect windows stored so far (0 while nothing is, or the file is held for a moment)."""
    import duckdb

    try:
        with duckdb.connect(str(db), read_only=True) as conn:
            row = conn.execute("SELECT coalesce(sum(effect_windows), 0) FROM run_chance").fetchone()
    except duckdb.Error:
        return 0
    return int(row[0]) if row else 0


def _stop_once(proc: ForkedCommand, ready, sig: int, what: str, timeout: float = 240.0) -> tuple[int, str]:
    """Send ``sig`` once ``ready()`` holds; the exit code and stderr. Fails if the command ended first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"{what}: ended before it could be stopped: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"{what}: not ready after {timeout} s"
        time.sleep(0.05)
    os.killpg(proc.pid, sig)
    _out, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _stop_in_steps(
    proc: ForkedCommand, db: Path, at: int, sig: int, what: str, timeout: float = 240.0, step_s: float = 0.02
):
    """Send ``sig`` once ``at`` effect windows are stored: the exit code and stderr. Fails if the
    command ended first. ``step_s``: how long the command runs between two looks; on a quick machine
    a window takes a few hundredths of a second, and a longer step let the command run past the windows
    asked for (once, to the last window: the Ctrl-C then found nothing left to stop).

    A run this small stores all the time (its storing thread holds the file while the model goes
    on), so a read of the file succeeds seldom, on an idle machine often only after the last
    window. The command runs in steps instead, stopped between them (SIGSTOP, as Ctrl-Z stops it),
    and while it is stopped its file and write-ahead log are copied, as a crash at that moment
    would leave them, and the copy read: the windows stored by then, exactly."""
    deadline = time.monotonic() + timeout
    copy = db.with_name("stopped-copy.duckdb")
    files = ((db, copy), (db.with_name(db.name + ".wal"), copy.with_name(copy.name + ".wal")))
    read: tuple | None = None  # the files as last read (unchanged while the command starts up)
    try:
        while True:
            time.sleep(step_s)
            os.killpg(proc.pid, signal.SIGSTOP)
            _wait_stopped(proc.pid)
            assert proc.poll() is None, f"{what}: ended before it could be stopped: {proc.communicate()[1][-2000:]}"
            now = tuple(_signature(source) for source, _ in files)
            if now != read:
                read = now
                for source, target in files:
                    target.unlink(missing_ok=True)
                    if source.exists():
                        shutil.copyfile(source, target)
                if copy.exists() and _effect_windows(copy) >= at:
                    break
            assert time.monotonic() < deadline, f"{what}: not ready after {timeout} s"
            os.killpg(proc.pid, signal.SIGCONT)
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # not left stopped
        raise
    os.killpg(proc.pid, sig)
    os.killpg(proc.pid, signal.SIGCONT)  # a stopped process acts on SIGINT once it runs again
    _out, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _signature(path: Path) -> tuple[int, int] | None:
    """A file's size and modification time (None: no file), to tell whether it changed."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


def _wait_stopped(pid: int) -> None:
    """Until the process is stopped or has ended (a signal is delivered a moment after it is sent)."""
    for _ in range(400):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state in "TtZX":
            return
        time.sleep(0.005)


def _effects(db: Path) -> dict:
    """Every stored effect of the database's run (compacted as it ended: per replicate group), its
    heads' effect sums and its chance rows' effect windows and objective, and what they are
    measured against. (The run's other sums, added in another order by a resumed run, may differ
    in their last bit: tests/test_effect_runs.py compares those to 1e-6.)"""
    from headatlas.service.storage.db import transaction

    with transaction(db, read_only=True) as conn:
        heads = conn.execute(
            text(f"SELECT rep, layer, head, {', '.join(EFFECT_COLUMNS)} FROM head_stats ORDER BY rep, layer, head")
        ).all()
        chance = conn.execute(text("SELECT rep, effect_windows, objective FROM run_chance ORDER BY rep")).all()
        against = conn.execute(text("SELECT * EXCLUDE (run_id) FROM run_effects ORDER BY ALL")).all()
        effect_windows = conn.execute(text("SELECT sum(effect_windows) FROM run_chance")).scalar()
        status = conn.execute(text("SELECT status FROM runs")).scalars().all()
    return {
        "heads": [tuple(r) for r in heads],
        "chance": [tuple(r) for r in chance],
        "against": [tuple(r) for r in against],
        "effect_windows": effect_windows,
        "status": status,
    }


def test_effects_stopped_by_kill_9_then_by_ctrl_c_and_resumed_equal_a_run_never_stopped(corpus, tmp_path, monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    whole, stopped = tmp_path / "whole.duckdb", tmp_path / "stopped.duckdb"
    done = invoke_cli("analyze", str(corpus), *ANALYZE, "--db", str(whole))
    assert done.returncode == 0, done.stderr
    want = _effects(whole)
    windows = want["effect_windows"]
    assert windows >= 8, want["chance"]  # every window an effect window
    assert want["against"] and want["heads"]

    command = ["analyze", str(corpus), *ANALYZE, "--db", str(stopped)]
    code, _err = _stop_in_steps(_start(*command), stopped, 2, signal.SIGKILL, "kill -9")
    assert code == -signal.SIGKILL
    after_kill = _effect_windows(stopped)
    assert 2 <= after_kill < windows, after_kill

    # the second command resumes (a window more than the first stored), then Ctrl-C: it stops at its
    # next batch at the latest, so windows are left for the third
    code, err = _stop_in_steps(_start(*command), stopped, after_kill + 1, signal.SIGINT, "Ctrl-C")
    assert code == 130 and "interrupted; re-run the same command to resume" in err, err
    assert "Traceback" not in err, err
    after_ctrl_c = _effect_windows(stopped)
    assert after_ctrl_c < windows, (
        f"Ctrl-C came after the last window ({after_kill} stored at the kill, {windows} in all)"
    )

    resumed = invoke_cli(*command)
    assert resumed.returncode == 0, resumed.stderr
    got = _effects(stopped)
    assert got["status"] == ["done"]
    assert got == want  # every effect, to the bit, window by window


def _curves(db: Path) -> tuple[list, list]:
    """The database's stored prunes (less their id, time and duration) and their curves."""
    from headatlas.service.storage.db import transaction

    with transaction(db, read_only=True) as conn:
        prunes = conn.execute(text("SELECT * EXCLUDE (prune_id, created_at, seconds) FROM prunes ORDER BY ALL")).all()
        curves = conn.execute(text("SELECT * EXCLUDE (prune_id) FROM prune_curves ORDER BY ALL")).all()
    return [tuple(r) for r in prunes], [tuple(r) for r in curves]


def test_a_prune_stopped_by_kill_9_or_ctrl_c_leaves_nothing_and_run_again_stores_the_same_curves(
    corpus, tmp_path, monkeypatch
):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    db = tmp_path / "run.duckdb"
    # four effect windows set the effect order; the run's other windows are the evaluation windows
    done = invoke_cli("analyze", str(corpus), *ANALYZE, "--effect-windows", "4", "--db", str(db))
    assert done.returncode == 0, done.stderr
    never_stopped = tmp_path / "never.duckdb"
    shutil.copy(db, never_stopped)
    pruned = invoke_cli("prune", *PRUNE, "--db", str(never_stopped))
    assert pruned.returncode == 0, pruned.stderr
    want = _curves(never_stopped)
    assert len(want[0]) == 1 and len(want[1]) >= 8, want

    command = ["prune", *PRUNE, "--db", str(db)]
    for sig, expected in ((signal.SIGKILL, -signal.SIGKILL), (signal.SIGINT, 130)):
        proc = fork_cli(*command, env=ENV)
        said: list[str] = []

        def measuring(proc=proc, said=said) -> bool:  # a curve's first step is being measured
            line = proc.stderr.readline()
            said.append(line)
            return ": step 1/" in line

        code, err = _stop_once(proc, measuring, sig, signal.Signals(sig).name)
        assert code == expected, "".join(said) + err
        if sig == signal.SIGINT:
            assert "interrupted; re-run the same command to resume" in err and "Traceback" not in err, err
        assert _curves(db) == ([], [])  # nothing half-stored: the curves are stored whole, at the end

    again = invoke_cli(*command)
    assert again.returncode == 0, again.stderr
    assert _curves(db) == want  # the same curves, to the bit
