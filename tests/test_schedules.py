"""Recurring analyses with real processes: Redis, `headatlas writer`, `headatlas worker` and two
`headatlas beat` processes on schedules of a few seconds. Runs come on time, `only_new`
analyses only added documents, pause / resume / remove / edit are picked up without a restart,
the two beats create no duplicate run, and `query trend` equals `query heads` / `query layers`."""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime, timedelta

import pytest
from conftest import run_cli
from queue_support import make_corpus, running_cluster
from sqlalchemy import text

pytestmark = pytest.mark.integration

ANALYSIS = ["--model", "random:tiny", "--seq-len", "32", "--batch-size", "4"]


@pytest.fixture(scope="module")
def cluster():
    from headatlas.service.storage.db import upgrade

    # the schema first, so that every process finds it current
    with running_cluster("headatlas-schedule-", prepare=lambda c: upgrade(c.db)) as c:
        c._start("beat1", "beat", "--tick", "0.5")
        c._start("beat2", "beat", "--tick", "0.5")  # by mistake: must create no duplicate run
        yield c


def _cli(cluster, *args) -> str:
    result = run_cli(*args, env=cluster.env, timeout=120)
    assert result.returncode == 0, result.stderr + cluster.logs()
    return result.stdout


def _read(cluster, sql: str, **params) -> list[tuple]:
    from headatlas.service.storage.store import Store

    with Store(cluster.db).read() as conn:
        return [tuple(r) for r in conn.execute(text(sql), params)]


def _fires(cluster, name: str) -> list[tuple]:
    return _read(
        cluster,
        "SELECT f.fire_time, f.claimed_at, f.status, f.run_key, f.run_name, f.documents, f.kind "
        "FROM schedule_fires f JOIN schedules s USING (schedule_id) WHERE s.name = :n "
        "ORDER BY fire_time",
        n=name,
    )


def _wait(what, predicate, timeout: float, cluster):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached after {timeout} s; logs:\n{cluster.logs()}")
        time.sleep(0.5)


def _submitted(cluster, name: str) -> list[tuple]:
    return [f for f in _fires(cluster, name) if f[2] == "submitted"]


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
    """n small corpora of different paragraphs of the shipped excerpt."""
    paragraphs = [p.strip() for p in demo_corpus.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    parts = []
    for k in range(n):
        path = folder / f"part{k}.txt"
        path.write_text("\n\n".join(paragraphs[2 * k : 2 * k + 2]) + "\n", encoding="utf-8")
        parts.append(path)
    return parts


def test_only_new_runs_on_time_without_duplicates_and_trend_matches_queries(cluster, demo_corpus, tmp_path):
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import queries
    from headatlas.service.storage.store import Store

    folder = tmp_path / "growing"
    folder.mkdir()
    parts = _parts(tmp_path, demo_corpus, 3)
    shutil.copy(parts[0], folder / "a.txt")
    _cli(cluster, "schedule", "add", "grow", "--corpus", str(folder), "--every", "3s", "--only-new", *ANALYSIS)

    runs = []
    for k, part in enumerate(parts):
        if k:  # a document lands whole: written aside, renamed into the corpus folder
            shutil.copy(part, tmp_path / "incoming.txt")
            (tmp_path / "incoming.txt").rename(folder / f"{'abc'[k]}.txt")
        fires = _wait(f"run {k + 1}", lambda: len(s := _submitted(cluster, "grow")) > k and s, 60, cluster)  # noqa: B023
        fire_time, claimed_at, _status, _key, run_name, documents, kind = fires[k]
        assert kind == "scheduled" and fire_time.microsecond == 0
        assert timedelta(0) <= claimed_at - fire_time < timedelta(seconds=5), "fired late"
        expected = {d.doc_id for d in iter_documents(str(part))}
        assert documents == len(expected)
        runs.append((run_name, expected))
    for run_name, expected in runs:
        cluster.wait_status(run_name, timeout=90)
        assert _doc_ids(cluster, run_name) == expected  # only the documents added since the previous fire

    # the schedule keeps firing every 3 s: pause it and let the fire in hand (if any) finish
    _cli(cluster, "schedule", "pause", "grow")

    def settled():
        fires = _fires(cluster, "grow")
        return all(f[2] != "claimed" for f in fires) and fires

    fires = _wait("no fire in hand", settled, 30, cluster)
    submitted = [f for f in fires if f[2] == "submitted"]
    assert {f[2] for f in fires} <= {"submitted", "no_new_documents"}
    assert [f[4] for f in submitted[:3]] == [r for r, _ in runs]
    # two beat processes, each seeing every fire: one run per fire, every run from one fire
    names = [r[0] for r in _read(cluster, "SELECT name FROM runs WHERE name LIKE 'grow-%' ORDER BY name")]
    assert names == sorted(f[4] for f in submitted) and len(set(names)) == len(names)
    times = [f[0] for f in fires]
    assert all((b - a).total_seconds() % 3 == 0 and b > a for a, b in zip(times, times[1:]))

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
    assert [t["run"] for t in trend][:3] == [r for r, _ in runs]
    sched_id = _read(cluster, "SELECT schedule_id FROM schedules WHERE name = 'grow'")[0][0]
    with Store(cluster.db).read() as conn:
        _cols, layer_trend = queries.trend(conn, sched_id, metric="mean_distance", layer=0)
        _cols, mean_trend = queries.trend(conn, sched_id, metric="noise_share")
        with pytest.raises(ParameterError, match=r"--layer 99: the schedule's runs have layers 0\.\.1"):
            queries.trend(conn, sched_id, metric="mean_distance", layer=99)
        with pytest.raises(ParameterError, match=r"--head 4: the schedule's runs have heads 0\.\.3"):
            queries.trend(conn, sched_id, metric="within_sentence", layer=1, head=4)
        for k, (_run_name, _) in enumerate(runs):
            columns, layers = queries.layers(conn, layer_trend[k][1])
            distance, noise = columns.index("mean_distance"), columns.index("noise_share")
            assert layer_trend[k][-1] == pytest.approx(layers[0][distance])
            assert mean_trend[k][-1] == pytest.approx(sum(row[noise] for row in layers) / len(layers))
    for k, (run_name, _) in enumerate(runs):
        heads = json.loads(_cli(cluster, "query", "heads", "--run", run_name, "--layer", "1", "--format", "json"))
        assert trend[k]["within_sentence"] == pytest.approx([h for h in heads if h["head"] == 2][0]["within_sentence"])
    assert len({round(t["within_sentence"], 12) for t in trend[:3]}) == 3  # different documents, different values
    table = _cli(cluster, "query", "trend", "--schedule", "grow", "--metric", "repetition")
    assert "grow-" in table and "repetition" in table and any(ch in table for ch in "▁▂▃▄▅▆▇█")


def test_edit_pause_resume_run_now_remove(cluster, demo_corpus, tmp_path):
    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=1, tag="ctl")
    _cli(cluster, "schedule", "add", "ctl", "--corpus", str(corpus), "--every", "1h", *ANALYSIS)
    time.sleep(2)
    assert _fires(cluster, "ctl") == []
    # an edit reaches the running beats without a restart
    _cli(cluster, "schedule", "edit", "ctl", "--every", "2s")
    first = _wait("a fire after the edit", lambda: _submitted(cluster, "ctl"), 30, cluster)[0]
    cluster.wait_status(first[4], timeout=90)

    _cli(cluster, "schedule", "pause", "ctl")
    paused_at = datetime.utcnow()
    listed = _cli(cluster, "schedule", "list")
    assert "paused" in listed
    time.sleep(3)
    assert not [f for f in _fires(cluster, "ctl") if f[1] > paused_at + timedelta(seconds=1)], "fired while paused"

    # run-now fires a paused schedule once, as a manual fire
    out = _cli(cluster, "schedule", "run-now", "ctl").strip().splitlines()[-1]
    assert out.startswith("ctl-")
    assert [f[6] for f in _fires(cluster, "ctl")].count("manual") == 1

    _cli(cluster, "schedule", "resume", "ctl")
    resumed_at = datetime.utcnow()
    _wait(
        "a fire after resume",
        lambda: [f for f in _fires(cluster, "ctl") if f[1] > resumed_at and f[6] == "scheduled"],
        30,
        cluster,
    )
    shown = _cli(cluster, "schedule", "show", "ctl", "--format", "json")
    assert first[4] in shown
    # nothing changed between fires: every fire names the same run, stored once
    assert len({f[3] for f in _submitted(cluster, "ctl")}) == 1
    assert len(_read(cluster, "SELECT run_id FROM runs WHERE name LIKE 'ctl-%'")) == 1

    _cli(cluster, "schedule", "remove", "ctl")
    removed_at = time.monotonic()
    assert _fires(cluster, "ctl") == []
    time.sleep(3)
    assert _fires(cluster, "ctl") == [] and time.monotonic() - removed_at >= 3
    assert _read(cluster, "SELECT count(*) FROM runs WHERE name = :n", n=first[4]) == [(1,)]  # runs stay
    result = run_cli("schedule", "show", "ctl", env=cluster.env)
    assert result.returncode == 2 and "no schedule named 'ctl'" in result.stderr


def test_cli_errors(cluster, tmp_path):
    cases = [
        (["schedule", "add", "x", "--corpus", str(tmp_path / "missing.txt"), "--every", "5s"], "no such file"),
        (
            ["schedule", "add", "x", "--corpus", str(tmp_path), "--cron", "0 3 * *"],
            "'0 3 * *' is not a cron expression",
        ),
        (["schedule", "add", "x", "--corpus", str(tmp_path), "--every", "6 hours"], "is not an interval"),
    ]
    (tmp_path / "c.txt").write_text("A document.\n", encoding="utf-8")
    _cli(cluster, "schedule", "add", "dup", "--corpus", str(tmp_path / "c.txt"), "--cron", "0 3 * * *")
    cases.append((["schedule", "add", "dup", "--corpus", str(tmp_path / "c.txt"), "--every", "5s"], "exists"))
    for args, message in cases:
        result = run_cli(*args, env=cluster.env)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    _cli(cluster, "schedule", "remove", "dup")


def test_fires_missed_while_beat_was_down_run_once(cluster, demo_corpus, tmp_path):
    cluster.kill("beat1")
    cluster.kill("beat2")
    corpus = _parts(tmp_path, demo_corpus, 1)[0]
    _cli(cluster, "schedule", "add", "late", "--corpus", str(corpus), "--every", "2s", "--only-new", *ANALYSIS)
    time.sleep(7)  # three or four scheduled times pass with no beat running
    assert _fires(cluster, "late") == []
    restart_at = datetime.utcnow()
    cluster._start("beat1", "beat", "--tick", "0.5")
    _wait("a fire after restart", lambda: _submitted(cluster, "late"), 60, cluster)
    later = _wait(
        "the next regular fire",
        lambda: len(f := _fires(cluster, "late")) > 1 and f[1][2] != "claimed" and f,
        30,
        cluster,
    )
    # one fire for the missed ones, at the latest scheduled time that had passed, not one per tick
    assert later[0][0] >= restart_at - timedelta(seconds=2), later
    assert later[0][2] == "submitted" and later[0][5] == 2  # the corpus's two documents
    assert later[1][0] - later[0][0] >= timedelta(seconds=2) and later[1][2] == "no_new_documents"
    _cli(cluster, "schedule", "remove", "late")


def test_a_5s_schedule_fires_on_time_and_once_on_a_busy_machine(cluster, demo_corpus, tmp_path):
    """Two beats, a 5 s schedule, a CPU spinning beside the writer and worker: for 30 s every
    5 s slot fires, each within 2 s of its time, each once."""
    import subprocess
    import sys

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=2, tag="busy")
    _cli(cluster, "schedule", "add", "busy", "--corpus", str(corpus), "--every", "5s", *ANALYSIS)
    first = _wait("a first fire (the beats are up)", lambda: _submitted(cluster, "busy"), 60, cluster)[0]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(30)
        _cli(cluster, "schedule", "pause", "busy")
    finally:
        spinner.kill()
        spinner.wait()

    def settled():
        fires = _fires(cluster, "busy")
        return all(f[2] != "claimed" for f in fires) and fires

    fires = [f for f in _wait("no fire in hand", settled, 30, cluster) if f[0] > first[0]]
    times = [f[0] for f in fires]
    shown = [(f"{f[0]:%H:%M:%S}", f"{(f[1] - f[0]).total_seconds():.2f}") for f in fires]
    assert len(fires) >= 5, shown  # 30 s of a 5 s schedule
    assert times[0] - first[0] == timedelta(seconds=5), shown
    assert all(b - a == timedelta(seconds=5) for a, b in zip(times, times[1:])), shown  # no slot skipped
    late = [(f[1] - f[0]).total_seconds() for f in fires]
    assert max(late) < 2.0, shown
    assert {f[2] for f in fires} == {"submitted"} and {f[6] for f in fires} == {"scheduled"}
    # the same corpus each time: every fire names one run, stored once
    assert len({f[3] for f in [first, *fires]}) == 1
    assert len(_read(cluster, "SELECT run_id FROM runs WHERE name LIKE 'busy-%'")) == 1
    print(
        f"\n5 s schedule under load: {len(fires)} fires, {max(late):.2f} s late at most, "
        f"mean {sum(late) / len(late):.2f} s"
    )
    _cli(cluster, "schedule", "remove", "busy")
