"""When schedules fire: interval and cron parsing, next fire in a time zone, the missed-fire
policy, and the exactly-once claim of a fire on a real database file (no processes)."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from headatlas.service.errors import ParameterError
from headatlas.service.schedules import Cadence, check_cron, due_fire, format_every, parse_every


@pytest.mark.parametrize("text, seconds", [("45s", 45), ("30m", 1800), ("6h", 21600), ("1d", 86400), (" 2 h ", 7200)])
def test_every_parses(text, seconds):
    assert parse_every(text) == seconds
    assert parse_every(format_every(seconds)) == seconds


@pytest.mark.parametrize("text", ["6", "h", "0s", "-5m", "1.5h", "5q", ""])
def test_bad_every_is_one_clear_line(text):
    with pytest.raises(ParameterError, match=r"--every .* e\.g\. 45s, 30m, 6h"):
        parse_every(text)


@pytest.mark.parametrize("expr", ["0 3 * *", "61 3 * * *", "0 25 * * *", "every day", "0 3 * * * *"])
def test_bad_cron_names_the_expression_and_the_fix(expr):
    with pytest.raises(ParameterError) as err:
        check_cron(expr)
    message = str(err.value)
    assert expr in message and "0 3 * * *" in message and "\n" not in message


def test_exactly_one_of_cron_and_interval():
    with pytest.raises(ParameterError, match="exactly one"):
        Cadence(None, None)
    with pytest.raises(ParameterError, match="exactly one"):
        Cadence("0 3 * * *", 60)
    with pytest.raises(ParameterError, match="time zone"):
        Cadence("0 3 * * *", None, "Mars/Olympus")


def test_interval_fires_fall_on_the_anchor_grid():
    c = Cadence(None, 10, "UTC", datetime(2026, 1, 1))
    assert c.next_after(datetime(2026, 1, 1)) == datetime(2026, 1, 1, 0, 0, 10)
    assert c.next_after(datetime(2026, 1, 1, 0, 0, 10)) == datetime(2026, 1, 1, 0, 0, 20)  # strictly after
    assert c.next_after(datetime(2026, 1, 1, 0, 0, 19, 999999)) == datetime(2026, 1, 1, 0, 0, 20)
    assert c.latest_at_or_before(datetime(2026, 1, 1, 0, 0, 20)) == datetime(2026, 1, 1, 0, 0, 20)
    assert c.latest_at_or_before(datetime(2026, 1, 1, 0, 0, 29)) == datetime(2026, 1, 1, 0, 0, 20)


def test_cron_is_read_in_its_time_zone_across_daylight_saving():
    paris = Cadence("0 3 * * *", None, "Europe/Paris")
    # 03:00 in Paris is 02:00 UTC in winter (CET, +1) and 01:00 UTC in summer (CEST, +2)
    assert paris.next_after(datetime(2026, 1, 10, 12)) == datetime(2026, 1, 11, 2)
    assert paris.next_after(datetime(2026, 7, 10, 12)) == datetime(2026, 7, 11, 1)
    # the night the clocks go forward (29 March 2026, 02:00 → 03:00): 03:00 CEST = 01:00 UTC
    assert paris.next_after(datetime(2026, 3, 28, 12)) == datetime(2026, 3, 29, 1)
    utc = Cadence("*/15 * * * *", None)
    assert utc.next_after(datetime(2026, 1, 1, 10, 7)) == datetime(2026, 1, 1, 10, 15)
    assert utc.latest_at_or_before(datetime(2026, 1, 1, 10, 15)) == datetime(2026, 1, 1, 10, 15)
    assert utc.latest_at_or_before(datetime(2026, 1, 1, 10, 29, 59)) == datetime(2026, 1, 1, 10, 15)


def test_missed_fires_run_once_at_the_latest_missed_time():
    c = Cadence(None, 60, "UTC", datetime(2026, 1, 1))
    next_fire = datetime(2026, 1, 1, 0, 1)
    assert due_fire(c, next_fire, datetime(2026, 1, 1, 0, 0, 59)) is None
    assert due_fire(c, next_fire, datetime(2026, 1, 1, 0, 1, 0, 500)) == next_fire
    # beat was down for ten minutes: one fire, at the last scheduled time that has passed
    assert due_fire(c, next_fire, datetime(2026, 1, 1, 0, 11, 30)) == datetime(2026, 1, 1, 0, 11)
    # and the next one is the first scheduled time after that
    assert c.next_after(datetime(2026, 1, 1, 0, 11, 30)) == datetime(2026, 1, 1, 0, 12)


def test_a_fire_is_claimed_once(tmp_path):
    from headatlas.service.storage import schedule_store
    from headatlas.service.storage.store import Store, now

    db = str(tmp_path / "s.duckdb")
    corpus = tmp_path / "c.txt"
    corpus.write_text("One. Two.\n", encoding="utf-8")
    sched = schedule_store.add(
        db,
        name="s",
        corpus=str(corpus),
        model="random:tiny",
        dtype="float32",
        batch_size=4,
        params={"seq_len": 32},
        cadence=Cadence(None, 5),
        only_new=True,
    )
    t = sched.next_fire
    one, two = {"holder": "beat-1", "lease_s": 60}, {"holder": "beat-2", "lease_s": 60}
    got = schedule_store.claim(db, sched.schedule_id, t, kind="scheduled", doc_ids=["a", "b"], at=t, **one)
    assert got is not None and (got.fire_time, sorted(got.doc_ids), got.resumed) == (t, ["a", "b"], False)
    assert schedule_store.claim(db, sched.schedule_id, t, kind="scheduled", doc_ids=["c"], at=t, **two) is None
    later = t + timedelta(seconds=5)  # the next slot, while the first fire is still in hand: it waits
    assert schedule_store.claim(db, sched.schedule_id, later, kind="scheduled", doc_ids=["c"], at=later, **two) is None
    with Store(db).checked_read() as conn:
        assert schedule_store.seen_documents(conn, sched.schedule_id) == set()  # claimed is not sent
    # the first beat died: once its lease has run out, a second beat takes the fire over, same documents
    stale = t + timedelta(seconds=61)
    taken = schedule_store.claim(db, sched.schedule_id, stale, kind="scheduled", doc_ids=["c"], at=stale, **two)
    assert taken is not None and (taken.fire_time, sorted(taken.doc_ids), taken.resumed) == (t, ["a", "b"], True)
    schedule_store.finish_fire(db, sched.schedule_id, t, status="submitted", run_key="k", run_name="s-1", documents=2)
    assert not schedule_store.claim(db, sched.schedule_id, t - timedelta(seconds=5), kind="scheduled", **two)  # stale
    with Store(db).checked_read() as conn:
        after = schedule_store.get(conn, "s")
        assert schedule_store.seen_documents(conn, sched.schedule_id) == {"a", "b"}
        assert schedule_store.in_hand(conn, sched.schedule_id) is None
    assert after.last_fire == t and after.next_fire > max(t, now() - timedelta(seconds=1))
    schedule_store.set_enabled(db, "s", False)
    assert not schedule_store.claim(db, sched.schedule_id, after.next_fire, kind="scheduled", **one)  # paused
    assert schedule_store.claim(db, sched.schedule_id, after.next_fire, kind="manual", **one)  # run-now still fires
    with pytest.raises(ParameterError, match="exists"):
        schedule_store.add(
            db,
            name="s",
            corpus=str(corpus),
            model="m",
            dtype="float32",
            batch_size=4,
            params={},
            cadence=Cadence(None, 5),
            only_new=False,
        )
    schedule_store.remove(db, "s")
    with Store(db).checked_read() as conn:
        with pytest.raises(ParameterError, match="no schedule named 's'"):
            schedule_store.get(conn, "s")
        assert schedule_store.seen_documents(conn, sched.schedule_id) == set()


def test_schedule_add_keeps_every_analysis_option(tmp_path, cli):
    """The options a schedule takes are `analyze`'s, attribution and mixing included, and they
    reach the stored parameters that beat submits with."""
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage import schedule_store
    from headatlas.service.storage.db import transaction, upgrade

    db = tmp_path / "s.duckdb"
    upgrade(str(db))
    corpus = tmp_path / "c.txt"
    corpus.write_text("A document.\n", encoding="utf-8")
    result = cli(
        "schedule",
        "add",
        "probe",
        "--corpus",
        str(corpus),
        "--every",
        "1h",
        "--db",
        str(db),
        "--seq-len",
        "64",
        "--select",
        "topk:10",
        "--include-special",
        "--attribution",
        "--attribution-windows",
        "8",
        "--mixing",
        "rollout,alti",
        "--sentences",
        "punct",
    )
    assert result.returncode == 0, result.stderr
    with transaction(str(db), read_only=True) as conn:
        params = AnalysisParams.from_dict(schedule_store.get(conn, "probe").params)
    assert (params.seq_len, params.include_special, params.attribution, params.attribution_windows) == (
        64,
        True,
        True,
        8,
    )
    assert params.mixing == ("rollout", "alti") and params.select.kind == "topk" and params.sentences == "punct"


def test_fires_that_find_nothing_new_are_recorded_once_per_change(tmp_path):
    """An interval schedule on a quiet folder: a run of fires with no new document is one row,
    the first; a fire that submits starts a new state, and the next quiet one is recorded again.
    `schedule show` lists them newest first."""
    from headatlas.service.storage import schedule_store
    from headatlas.service.storage.store import Store

    db = str(tmp_path / "s.duckdb")
    corpus = tmp_path / "c.txt"
    corpus.write_text("One. Two.\n", encoding="utf-8")
    sched = schedule_store.add(
        db,
        name="quiet",
        corpus=str(corpus),
        model="random:tiny",
        dtype="float32",
        batch_size=4,
        params={"seq_len": 32},
        cadence=Cadence(None, 1),
        only_new=True,
    )
    outcomes = ["submitted", "no_new_documents", "no_new_documents", "no_new_documents", "submitted"]
    outcomes += ["no_new_documents", "no_new_documents"]
    times = [sched.next_fire + timedelta(seconds=i) for i in range(len(outcomes))]
    for t, outcome in zip(times, outcomes):
        assert schedule_store.claim(db, sched.schedule_id, t, kind="scheduled", holder="b", lease_s=60, at=t)
        done = {"run_key": "k", "run_name": "r", "documents": 1} if outcome == "submitted" else {"documents": 0}
        schedule_store.finish_fire(db, sched.schedule_id, t, status=outcome, **done)
    with Store(db).checked_read() as conn:
        columns, rows = schedule_store.fires(conn, sched.schedule_id)
        last = schedule_store.get(conn, "quiet").last_fire
    recorded = [(r[columns.index("fire_time")], r[columns.index("fire_status")]) for r in rows]
    kept = [0, 1, 4, 5]  # the first quiet fire after each submitted one
    assert recorded == [(times[i], outcomes[i]) for i in reversed(kept)]
    assert last == times[-1]  # the schedule still knows when it last fired
