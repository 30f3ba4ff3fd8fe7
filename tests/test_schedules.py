"""Recurring analyses on the session's real Redis, writer and worker. When schedules fire is
checked on a clock of the test's own: beats run in this process (``Beat(clock=…)``, one
``tick()`` at a time), claim fires in the real database and submit real runs, so that no test
waits for a schedule's seconds to pass. Runs come at their scheduled times, `only_new` analyses
only added documents, edit / pause / resume / remove reach a running beat, two beats create no
duplicate run, missed fires run once, and `query trend` equals `query heads` / `query layers`.
One real `headatlas beat` process fires on the real clock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from datetime import datetime, timedelta

import pytest
from conftest import invoke_cli
from queue_support import isolated_read, make_corpus

pytestmark = pytest.mark.integration

ANALYSIS = ["--model", "random:tiny", "--seq-len", "32", "--batch-size", "4"]


class Clock:
    """UTC now (naive) that moves only when told to."""

    def __init__(self, start: datetime):
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def to(self, t: datetime) -> datetime:
        assert t >= self.now, "a clock does not go back"
        self.now = t
        return t

    def advance(self, seconds: float) -> datetime:
        return self.to(self.now + timedelta(seconds=seconds))


def _settings(cluster):
    from headatlas.service.config import Settings

    return Settings(broker_url=cluster.env["HEADATLAS_BROKER_URL"], db=cluster.db)


def _beat(cluster, clock):
    from headatlas.workers.beat import Beat

    return Beat(_settings(cluster), clock=clock)


def _tick(*beats) -> None:
    """Each beat ticks once, at its clock's time, having read the schedules as they are now (a
    tick that found the file busy is tried again); then the fires it started finish."""
    for beat in beats:
        deadline = time.monotonic() + 60
        beat.read_stamp = None
        while True:
            beat.tick()
            if beat.read_stamp is not None:
                break
            assert time.monotonic() < deadline, "the schedules could not be read for 60 s"
            time.sleep(0.05)
    for beat in beats:
        for thread in list(beat.in_hand.values()):
            thread.join(120)
            assert not thread.is_alive(), "a fire still in hand after 120 s"


def _add(cluster, name: str, corpus, *, every: int, only_new: bool, at: datetime):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.schedules import Cadence
    from headatlas.service.storage import schedule_store

    params = build_params(seq_len=32)
    return schedule_store.add(
        cluster.db,
        name=name,
        corpus=str(corpus),
        model="random:tiny",
        dtype=params.dtype,
        batch_size=4,
        params=params.to_dict(),
        cadence=Cadence(None, every),
        only_new=only_new,
        at=at,
    )


def _cli(cluster, *args) -> str:
    result = invoke_cli(*args, env=cluster.env)
    assert result.returncode == 0, result.stderr + cluster.logs()
    return result.stdout


def _read(cluster, sql: str, **params) -> list[tuple]:
    return isolated_read(("sql", cluster.db, sql, params))  # the cluster's processes write the file meanwhile


def _fires(cluster, name: str) -> list[tuple]:
    return _read(
        cluster,
        "SELECT f.fire_time, f.claimed_at, f.status, f.run_key, f.run_name, f.documents, f.kind "
        "FROM schedule_fires f JOIN schedules s USING (schedule_id) WHERE s.name = :n "
        "ORDER BY fire_time",
        n=name,
    )


def _claimed_with_documents(cluster, name: str) -> list[tuple]:
    """The schedule's fires claimed and not yet submitted that hold documents (only_new)."""
    return _read(
        cluster,
        "SELECT f.fire_time FROM schedule_fires f JOIN schedules s USING (schedule_id) "
        "WHERE s.name = :n AND f.status = 'claimed' AND EXISTS (SELECT 1 FROM schedule_fire_documents d "
        "WHERE d.schedule_id = f.schedule_id AND d.fire_time = f.fire_time)",
        n=name,
    )


def _wait(what, predicate, timeout: float, cluster):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            fires = _read(
                cluster,
                "SELECT s.name, f.fire_time, f.claimed_at, f.status, f.error FROM schedule_fires f "
                "JOIN schedules s USING (schedule_id) ORDER BY f.claimed_at",
            )
            for proc in list(cluster.procs.values()):  # each writes its threads' stacks to its log
                os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)
            beats = sorted(cluster.folder.glob("*beat*.log"))  # the beat processes' logs, by their names
            raise AssertionError(
                f"{what} not reached after {timeout} s; fires: {fires}; "
                + "".join(f"{b.name} (whole):\n{b.read_text(errors='replace')[-30000:]}\n" for b in beats)
                + f"logs:\n{cluster.logs()}"
            )
        time.sleep(0.3)


@pytest.fixture(autouse=True)
def _no_schedule_left(request):
    """The schedules a test added to the shared cluster's database are removed after it: left,
    they fired in a later test's beat process on the real clock, every few seconds, each with a
    corpus pytest had removed by then (seen beside a beat test that timed out)."""
    cluster = request.getfixturevalue("queue_cluster") if "queue_cluster" in request.fixturenames else None
    yield
    if cluster is None:
        return
    from headatlas.service.storage import schedule_store

    for (name,) in _read(cluster, "SELECT name FROM schedules"):
        schedule_store.remove(cluster.db, name)


def _doc_ids(cluster, run_name: str) -> set[str]:
    return {
        r[0]
        for r in _read(
            cluster,
            "SELECT DISTINCT w.doc_id FROM run_windows rw JOIN windows w USING (window_id) "
            "JOIN runs r USING (run_id) WHERE r.name = :n",
            n=run_name,
        )
    }


def _parts(folder, demo_corpus, n: int) -> list:
    """n small corpora of different paragraphs of the shipped excerpt, each paragraph tagged with the
    test's folder: a run is identified by its corpus's content, and the tests of the shared cluster
    must not find each other's runs finished already."""
    paragraphs = [p.strip() for p in demo_corpus.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    parts = []
    for k in range(n):
        path = folder / f"part{k}.txt"
        tagged = [f"{folder.name} {p}" for p in paragraphs[2 * k : 2 * k + 2]]
        path.write_text("\n\n".join(tagged) + "\n", encoding="utf-8")
        parts.append(path)
    return parts


def _start(cluster) -> Clock:
    from headatlas.service.storage.store import now

    # an hour back: a fire at the clock's times never shares its second with a fire at the real
    # time (`schedule run-now`), which the database refuses as fired this very second already
    return Clock(now().replace(microsecond=0) - timedelta(hours=1))


def test_only_new_fires_at_its_times_once_and_trend_matches_queries(queue_cluster, demo_corpus, tmp_path):
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import layer_queries, trend_queries
    from headatlas.service.storage import schedule_store
    from headatlas.service.storage.store import Store

    cluster, clock = queue_cluster, _start(queue_cluster)
    folder = tmp_path / "growing"
    folder.mkdir()
    parts = _parts(tmp_path, demo_corpus, 3)
    shutil.copy(parts[0], folder / "a.txt")
    sched = _add(cluster, "grow", folder, every=3, only_new=True, at=clock())
    beats = [_beat(cluster, clock), _beat(cluster, clock)]  # two, by mistake: no duplicate run
    assert sched.anchor == clock() and sched.next_fire == clock() + timedelta(seconds=3)

    runs = []
    for k, part in enumerate(parts):
        if k:  # a document lands whole: written aside, renamed into the corpus folder
            shutil.copy(part, tmp_path / "incoming.txt")
            (tmp_path / "incoming.txt").rename(folder / f"{'abc'[k]}.txt")
        slot = sched.anchor + timedelta(seconds=3 * (k + 1))
        clock.to(slot - timedelta(milliseconds=1))
        _tick(*beats)
        assert len(_fires(cluster, "grow")) == k, "fired before its time"
        clock.to(slot + timedelta(milliseconds=250))  # the first tick after the slot
        _tick(*beats)
        fires = _fires(cluster, "grow")
        assert len(fires) == k + 1, fires
        fire_time, claimed_at, status, _key, run_name, documents, kind = fires[k]
        assert (fire_time, kind, status) == (slot, "scheduled", "submitted")
        assert claimed_at == clock(), "claimed at the tick that found it due"
        expected = {d.doc_id for d in iter_documents(str(part))}
        assert documents == len(expected)
        runs.append((run_name, expected))
    for run_name, expected in runs:
        cluster.wait_status(run_name, timeout=90)
        assert _doc_ids(cluster, run_name) == expected  # only the documents added since the previous fire

    # paused: the next slots pass without a fire
    schedule_store.set_enabled(cluster.db, "grow", False, at=clock())
    clock.advance(7)
    _tick(*beats)
    fires = _fires(cluster, "grow")
    assert [f[4] for f in fires] == [r for r, _ in runs]
    # two beats, each seeing every fire: one run per fire, every run from one fire
    names = [r[0] for r in _read(cluster, "SELECT name FROM runs WHERE name LIKE 'grow-%' ORDER BY name")]
    assert names == sorted(f[4] for f in fires) and len(set(names)) == len(names)

    # trend equals the per-run values of `query heads` (and of the layers query behind `query layers`)
    trend = json.loads(
        _cli(
            cluster,
            "query",
            "trend",
            "--schedule",
            "grow",
            "--metric",
            "within_sentence",
            "--layer",
            "1",
            "--head",
            "2",
            "--format",
            "json",
        )
    )
    assert [t["run"] for t in trend] == [r for r, _ in runs]
    with Store(cluster.db).read() as conn:
        _cols, layer_trend = trend_queries.trend(conn, sched.schedule_id, metric="mean_distance", layer=0)
        _cols, mean_trend = trend_queries.trend(conn, sched.schedule_id, metric="noise_share")
        with pytest.raises(ParameterError, match=r"--layer 99: the schedule's runs have layers 0\.\.1"):
            trend_queries.trend(conn, sched.schedule_id, metric="mean_distance", layer=99)
        with pytest.raises(ParameterError, match=r"--head 4: the schedule's runs have heads 0\.\.3"):
            trend_queries.trend(conn, sched.schedule_id, metric="within_sentence", layer=1, head=4)
        for k, (_run_name, _) in enumerate(runs):
            columns, layers = layer_queries.layers(conn, layer_trend[k][1])
            distance, noise = columns.index("mean_distance"), columns.index("noise_share")
            assert layer_trend[k][-1] == pytest.approx(layers[0][distance])
            assert mean_trend[k][-1] == pytest.approx(sum(row[noise] for row in layers) / len(layers))
    for k, (run_name, _) in enumerate(runs):
        heads = json.loads(_cli(cluster, "query", "heads", "--run", run_name, "--layer", "1", "--format", "json"))
        assert trend[k]["within_sentence"] == pytest.approx([h for h in heads if h["head"] == 2][0]["within_sentence"])
    assert len({round(t["within_sentence"], 12) for t in trend}) == 3  # different documents, different values
    table = _cli(cluster, "query", "trend", "--schedule", "grow", "--metric", "repetition")
    assert "grow-" in table and "repetition" in table and any(ch in table for ch in "▁▂▃▄▅▆▇█")


def test_every_slot_fires_once_with_two_beats(queue_cluster, demo_corpus, tmp_path):
    """Two beats ticking every half second for 30 s of a 5 s schedule: every slot fires, at its
    first tick, once; the same corpus each time names one run, stored once."""
    cluster, clock = queue_cluster, _start(queue_cluster)
    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=2, tag="busy")
    sched = _add(cluster, "busy", corpus, every=5, only_new=False, at=clock())
    beats = [_beat(cluster, clock), _beat(cluster, clock)]
    for _ in range(60):
        clock.advance(0.5)
        _tick(*beats)
    fires = _fires(cluster, "busy")
    slots = [sched.anchor + timedelta(seconds=5 * k) for k in range(1, 7)]
    assert [f[0] for f in fires] == slots  # no slot skipped, none twice
    assert [f[1] for f in fires] == slots  # each claimed at the tick that reached it
    assert {f[2] for f in fires} == {"submitted"} and {f[6] for f in fires} == {"scheduled"}
    assert len({f[3] for f in fires}) == 1
    run = fires[0][4]
    assert cluster.wait_status(run, timeout=90) == "done"
    assert len(_read(cluster, "SELECT run_id FROM runs WHERE name LIKE 'busy-%'")) == 1


def test_edit_pause_resume_run_now_remove_reach_a_running_beat(queue_cluster, demo_corpus, tmp_path):
    from headatlas.service.storage import schedule_store

    cluster, clock = queue_cluster, _start(queue_cluster)
    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=1, tag="ctl")
    _add(cluster, "ctl", corpus, every=3600, only_new=False, at=clock())
    beat = _beat(cluster, clock)
    clock.advance(2)
    _tick(beat)
    assert _fires(cluster, "ctl") == []
    # an edit reaches the running beat: the new cadence starts from the edit
    edited = schedule_store.edit(cluster.db, "ctl", every_s=2, at=clock())
    assert edited.next_fire == clock() + timedelta(seconds=2)
    clock.advance(2)
    _tick(beat)
    first = _fires(cluster, "ctl")
    assert [(f[0], f[2]) for f in first] == [(edited.next_fire, "submitted")]
    cluster.wait_status(first[0][4], timeout=90)

    assert "paused" in _cli(cluster, "schedule", "pause", "ctl")
    assert "paused" in _cli(cluster, "schedule", "list")
    clock.advance(6)  # three slots pass while paused
    _tick(beat)
    assert len(_fires(cluster, "ctl")) == 1, "fired while paused"

    # run-now fires a paused schedule once, as a manual fire
    out = _cli(cluster, "schedule", "run-now", "ctl").strip().splitlines()[-1]
    assert out.startswith("ctl-")
    assert [f[6] for f in _fires(cluster, "ctl")].count("manual") == 1

    # resumed: the slots missed while paused are not caught up; the next one fires
    resumed = schedule_store.set_enabled(cluster.db, "ctl", True, at=clock())
    assert clock() < resumed.next_fire <= clock() + timedelta(seconds=2)
    _tick(beat)
    assert len(_fires(cluster, "ctl")) == 2
    clock.to(resumed.next_fire)
    _tick(beat)
    scheduled = [f for f in _fires(cluster, "ctl") if f[6] == "scheduled"]
    assert [f[0] for f in scheduled] == [edited.next_fire, resumed.next_fire]
    shown = _cli(cluster, "schedule", "show", "ctl", "--format", "json")
    assert first[0][4] in shown
    # nothing changed between fires: every fire names the same run, stored once
    assert len({f[3] for f in _fires(cluster, "ctl")}) == 1
    assert len(_read(cluster, "SELECT run_id FROM runs WHERE name LIKE 'ctl-%'")) == 1

    assert "removed" in _cli(cluster, "schedule", "remove", "ctl")
    assert _fires(cluster, "ctl") == []
    clock.advance(10)
    _tick(beat)
    assert _fires(cluster, "ctl") == []
    assert _read(cluster, "SELECT count(*) FROM runs WHERE name = :n", n=first[0][4]) == [(1,)]  # runs stay
    result = invoke_cli("schedule", "show", "ctl", env=cluster.env)
    assert result.returncode == 2 and "no schedule named 'ctl'" in result.stderr


def test_fires_missed_while_no_beat_ran_run_once(queue_cluster, demo_corpus, tmp_path):
    cluster, clock = queue_cluster, _start(queue_cluster)
    corpus = _parts(tmp_path, demo_corpus, 1)[0]
    sched = _add(cluster, "late", corpus, every=2, only_new=True, at=clock())
    clock.advance(7)  # three scheduled times pass with no beat running
    assert _fires(cluster, "late") == []
    beat = _beat(cluster, clock)
    _tick(beat)
    clock.advance(2)
    _tick(beat)
    fires = _fires(cluster, "late")
    # one fire for the missed ones, at the latest scheduled time that had passed, not one per slot
    assert [f[0] for f in fires] == [sched.anchor + timedelta(seconds=6), sched.anchor + timedelta(seconds=8)]
    assert fires[0][2] == "submitted" and fires[0][5] == 2  # the corpus's two documents
    assert fires[1][2] == "no_new_documents"
    cluster.wait_status(fires[0][4], timeout=90)


def test_the_beat_process_fires_on_the_real_clock(queue_cluster, demo_corpus, tmp_path):
    """`headatlas beat` itself: a 2 s schedule added through the CLI fires on its grid and its run
    is analysed."""
    cluster = queue_cluster
    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=1, tag="beatproc")
    cluster._start("beat", "beat", "--tick", "0.5", loglevel="info")  # each fire logged: shown if it times out
    try:
        _cli(cluster, "schedule", "add", "proc", "--corpus", str(corpus), "--every", "2s", *ANALYSIS)
        [(anchor,)] = _read(cluster, "SELECT anchor FROM schedules WHERE name = 'proc'")
        fire = _wait("a fire", lambda: [f for f in _fires(cluster, "proc") if f[2] == "submitted"], 90, cluster)[0]
        assert (fire[0] - anchor).total_seconds() % 2 == 0 and fire[0] > anchor
        assert fire[1] >= fire[0] and fire[6] == "scheduled"
        assert cluster.wait_status(fire[4], timeout=90) == "done"
        # `kill -USR1`: the beat and the writer write their threads' stacks to their logs, and go on
        for name, code in (("beat", "workers/beat.py"), ("writer", "workers/writer.py")):
            os.kill(cluster.procs[name].pid, signal.SIGUSR1)
            log = cluster.folder / f"{name}.log"
            _wait(f"{name}'s stacks", lambda log=log, code=code: code in log.read_text(errors="replace"), 30, cluster)
            assert cluster.procs[name].poll() is None, f"{name} ended on SIGUSR1"
    finally:
        cluster.stop_process("beat")
    _cli(cluster, "schedule", "remove", "proc")


def test_cli_errors(tmp_path):
    env = {"HEADATLAS_DB": str(tmp_path / "s.duckdb")}
    cases = [
        (["schedule", "add", "x", "--corpus", str(tmp_path / "missing.txt"), "--every", "5s"], "no such file"),
        (
            ["schedule", "add", "x", "--corpus", str(tmp_path), "--cron", "0 3 * *"],
            "'0 3 * *' is not a cron expression",
        ),
        (["schedule", "add", "x", "--corpus", str(tmp_path), "--every", "6 hours"], "is not an interval"),
        (["schedule", "add", "night\u202ely", "--corpus", str(tmp_path), "--every", "1h"], "holds U+202E"),
    ]
    (tmp_path / "c.txt").write_text("A document.\n", encoding="utf-8")
    added = invoke_cli("schedule", "add", "dup", "--corpus", str(tmp_path / "c.txt"), "--cron", "0 3 * * *", env=env)
    assert added.returncode == 0, added.stderr
    cases.append((["schedule", "add", "dup", "--corpus", str(tmp_path / "c.txt"), "--every", "5s"], "exists"))
    for args, message in cases:
        result = invoke_cli(*args, env=env)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_schedule_commands_store_what_they_say(tmp_path):
    """edit, pause and resume through the CLI, read back from the database they wrote."""
    from headatlas.service.storage import schedule_store
    from headatlas.service.storage.store import now

    db = str(tmp_path / "s.duckdb")
    env = {"HEADATLAS_DB": db}
    (tmp_path / "c.txt").write_text("A document.\n", encoding="utf-8")

    def stored():
        with schedule_store.read(db) as conn:
            return schedule_store.get(conn, "s")

    for args in (
        ["schedule", "add", "s", "--corpus", str(tmp_path / "c.txt"), "--every", "1h", *ANALYSIS],
        ["schedule", "edit", "s", "--every", "2s"],
        ["schedule", "pause", "s"],
    ):
        result = invoke_cli(*args, env=env)
        assert result.returncode == 0, result.stderr
    edited = stored()
    assert (edited.every_s, edited.cron, edited.enabled) == (2, None, False)
    assert edited.next_fire == edited.anchor + timedelta(seconds=2)  # the new cadence starts at the edit
    assert "paused" in invoke_cli("schedule", "list", env=env).stdout
    before = now()
    resumed = invoke_cli("schedule", "resume", "s", env=env)
    assert resumed.returncode == 0, resumed.stderr
    after = stored()
    assert after.enabled and f"next fire {after.next_fire}" in resumed.stdout
    assert before < after.next_fire <= now() + timedelta(seconds=2)  # from now on: nothing missed caught up


def test_a_fire_left_by_a_killed_beat_is_submitted_by_the_next(queue_cluster, demo_corpus, tmp_path):
    """A beat killed (SIGKILL) between its claim and its submission: Redis refuses writes for a
    few seconds, so the beat claims a fire in the database and then waits in its submission, where
    it is killed. The next beat takes the fire over once its lease has run out: the documents it
    held are analysed, once, and no fire or run is left in hand."""
    import redis

    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.storage.store import now
    from headatlas.workers.lease import holder

    cluster = queue_cluster
    folder = tmp_path / "growing"
    folder.mkdir()
    parts = _parts(tmp_path, demo_corpus, 2)
    shutil.copy(parts[0], folder / "a.txt")
    expected = {d.doc_id for d in iter_documents(str(parts[1]))}
    client = redis.Redis.from_url(cluster.env["HEADATLAS_BROKER_URL"])
    cluster._start("killed-beat", "beat", "--tick", "0.3")
    try:
        _add(cluster, "crash", folder, every=2, only_new=True, at=now())
        _wait("a first fire", lambda: [f for f in _fires(cluster, "crash") if f[2] == "submitted"], 90, cluster)
        # the writer and workers keep their leases (LEASE_S) through the pause (ended once the beat
        # is killed): Redis expires no key while writes are paused
        client.execute_command("CLIENT", "PAUSE", 40_000, "WRITE")  # reads (the beat's ping) still answered
        try:
            shutil.copy(parts[1], tmp_path / "incoming.txt")
            (tmp_path / "incoming.txt").rename(folder / "b.txt")
            # a fire that found nothing new is "claimed" too, for an instant, before it is recorded as
            # such: the fire waited for is the one that holds the new documents
            _wait("the fire claimed", lambda: _claimed_with_documents(cluster, "crash"), 30, cluster)
            time.sleep(0.3)  # in its submission, waiting for Redis
            cluster.kill("killed-beat")
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
    finally:
        cluster.stop_process("killed-beat")
    left = _fires(cluster, "crash")[-1]
    assert left[2] == "claimed" and left[4] is None  # claimed, never submitted
    _wait("the writer's lease", lambda: holder(client)[0] is not None, 30, cluster)

    clock = Clock(now().replace(microsecond=0) + timedelta(seconds=120))  # past the dead beat's lease
    beat = _beat(cluster, clock)
    _tick(beat)
    clock.advance(2)
    _tick(beat)
    fires = [f for f in _fires(cluster, "crash") if f[0] >= left[0]]  # (fires before it found nothing new)
    assert [(f[2], f[5]) for f in fires] == [("submitted", len(expected)), ("no_new_documents", 0)], fires
    run = fires[0][4]
    assert cluster.wait_status(run, timeout=90) == "done"
    assert _doc_ids(cluster, run) == expected  # the documents the dead beat held, in one run
    # two runs in all, by the fires that made them (a run is identified by its corpus's content: one
    # whose documents another test of the shared cluster analysed first carries that test's name)
    runs = {f[4] for f in _fires(cluster, "crash") if f[4] is not None}
    assert len(runs) == 2, runs
    for other in runs:
        assert cluster.wait_status(other, timeout=90) == "done"
    _cli(cluster, "schedule", "remove", "crash")
