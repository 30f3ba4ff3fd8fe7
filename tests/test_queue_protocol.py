"""The ingest queue's protocol (workers/messages.py) and the queue's fault policy
(workers/policy.py): every message type survives its trip through the queue, a message that is
none of them is refused with why, the writer parks it (never drops it) and `status` counts it;
each timing is declared once, and the rules give the known answers."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from headatlas.workers import messages, policy
from headatlas.workers.messages import (
    BatchAnalysed,
    BatchFailed,
    OpenRun,
    ProbeScores,
    ReopenFailed,
    SeriesStep,
    Undecodable,
    decode,
    encode,
)

DB = "d" * 36
EVERY_KIND = [
    OpenRun(DB, "run-a"),
    BatchAnalysed(DB, "run-a", 3, "AAEC"),
    BatchFailed(DB, "run-a", 4, 3, "ValueError: no"),
    ReopenFailed(DB, "run-a"),
    ProbeScores(DB, "run-a", 16, 4, 7, {"induction_score": [[0.5, 0.25]]}),
    SeriesStep(DB, "run-a", "toy", "ckpt/", 1000, "ckpt/step-1000"),
]


def test_every_kind_has_a_type_and_comes_back_as_it_was_sent():
    assert {type(m) for m in EVERY_KIND} == set(messages.TYPES.values())
    for message in EVERY_KIND:
        assert decode(encode(message)) == message
        assert decode(encode(message).encode()) == message  # as Redis hands it back: bytes


def test_a_message_of_the_form_before_versions_reads_as_version_1():
    """Messages queued by the version before this one carry no "v"; they are still stored."""
    old = json.dumps({"kind": "ingest", "database_id": DB, "run_key": "k", "batch_id": 1, "payload": "AA"})
    assert decode(old) == BatchAnalysed(DB, "k", 1, "AA")
    body = json.loads(encode(OpenRun(DB, "k")))
    assert body == {"kind": "open_run", "v": 1, "database_id": DB, "run_key": "k"}


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"\xff\xfe not text", "not JSON"),
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({"kind": "compact", "database_id": DB, "run_key": "k"}), "unknown kind 'compact'"),
        (json.dumps({"database_id": DB, "run_key": "k"}), "unknown kind None"),
        (json.dumps({"kind": "open_run", "v": 2, "database_id": DB, "run_key": "k"}), "version 2"),
        (json.dumps({"kind": "open_run", "v": "1", "database_id": DB, "run_key": "k"}), "version '1'"),
        (json.dumps({"kind": "open_run", "run_key": "k"}), "without database_id"),
        (json.dumps({"kind": "failed", "database_id": DB, "run_key": "k", "batch_id": 1, "error": "x"}), "attempts"),
        (
            json.dumps({"kind": "ingest", "database_id": DB, "run_key": "k", "batch_id": "1", "payload": "A"}),
            "batch_id is str, not int",
        ),
        (
            json.dumps({"kind": "ingest", "database_id": DB, "run_key": "k", "batch_id": True, "payload": "A"}),
            "batch_id is bool",
        ),
        (
            json.dumps(
                {
                    "kind": "probe",
                    "database_id": DB,
                    "run_key": "k",
                    "length": 1,
                    "sequences": 1,
                    "seed": 1,
                    "scores": [],
                }
            ),
            "scores is list",
        ),
    ],
    ids=lambda value: str(value)[:30],
)
def test_what_is_no_message_is_refused_with_why(raw, why):
    with pytest.raises(Undecodable, match=why.replace("(", r"\(")) as refused:
        decode(raw)
    assert refused.value.raw == raw


def test_send_to_writer_builds_the_typed_message_and_refuses_an_unknown_kind():
    assert messages.of_kind("reopen", database_id=DB, run_key="k") == ReopenFailed(DB, "k")
    with pytest.raises(ValueError, match="unknown kind 'reopened'"):
        messages.of_kind("reopened", database_id=DB, run_key="k")


@pytest.mark.integration
def test_the_writer_parks_what_it_cannot_read_stores_the_rest_and_status_counts_it(redis_url, tmp_path):
    """An unknown kind and bytes that are not JSON, between two messages it reads: the writer
    takes all four in one step, parks the two (with why) and creates the runs the other two open;
    nothing is left taken, and `status` counts the parked ones and says where they are."""
    import redis

    from headatlas.service.config import Settings
    from headatlas.service.storage.store import Store
    from headatlas.workers.ledger import INGEST, PROCESSING
    from headatlas.workers.status import run_status
    from headatlas.workers.writer import Writer

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, db=str(tmp_path / "parked.duckdb"))
    writer = Writer(settings)
    ledger = writer.ledger
    model = {"spec": "hand", "name": "hand", "layers": 1, "heads": 2, "d_head": 8}
    for key in ("first", "second"):
        meta = {
            "run_key": key,
            "name": key,
            "corpus": "hand",
            "corpus_fingerprint": key,
            "model": model,
            "params": {"seq_len": 8, "short_range": 4},
            "device": None,
            "batch_size": 4,
            "batches": None,
            "windows": None,
        }
        ledger.put_run(key, meta)
    unknown = json.dumps({"kind": "compact", "v": 1, "database_id": writer.database_id, "run_key": "first"})
    ledger.send(OpenRun(writer.database_id, "first"))
    ledger.r.rpush(INGEST, unknown)
    ledger.r.rpush(INGEST, b"\x00\x01 not a message")
    ledger.send(OpenRun(writer.database_id, "second"))

    assert writer.step() == 4
    assert ledger.r.llen(INGEST) == 0 and ledger.r.llen(PROCESSING) == 0
    parked = [json.loads(m) for m in ledger.r.lrange(messages.PARKED, 0, -1)]
    assert [p["raw"] for p in parked] == [unknown, "\x00\x01 not a message"]
    assert "unknown kind 'compact'" in parked[0]["reason"] and "not JSON" in parked[1]["reason"]
    store = Store(settings.db)
    assert {store.get_run(k).name for k in ("first", "second")} == {"first", "second"}

    report = run_status(store, "second", ledger.r)
    assert report.parked == 2 and report.record()["parked"] == 2
    assert ("messages parked (unreadable, all runs)", "2") in report.rows()
    assert any(messages.PARKED in w and "2 message(s)" in w for w in report.warnings)
    writer.lease.release()


# --- the fault policy -------------------------------------------------------------------------------
def test_each_timing_is_declared_once_with_its_meaning_and_read_under_its_name():
    names = [t.name for t in policy.TIMINGS]
    assert len(names) == len(set(names))
    here = policy.environment()
    for timing in policy.TIMINGS:
        assert timing.meaning.strip() and timing.applied_by.strip(), timing.name
        value = getattr(policy, timing.name)
        got = value(here) if callable(value) else value
        assert got == timing.value(here), timing.name
        assert (timing.of is None) == (not timing.formula), timing.name


def test_a_timing_set_in_the_environment_is_applied_and_a_bad_one_refused_naming_it():
    from headatlas.service.config import Settings
    from headatlas.service.errors import ParameterError

    here = Settings()
    assert policy.applied(policy.PAUSE_MAX, here, {}) == 5.0
    assert policy.applied(policy.PAUSE_MAX, here, {"HEADATLAS_TIMING_PAUSE_MAX_S": "0.25"}) == 0.25
    assert policy.applied(policy.SILENCE, here, {"HEADATLAS_TIMING_SILENT_S": "3"}) == 3.0
    assert policy.applied(policy.SILENCE, Settings(lease_s=4.0), {}) == 4.0
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(ParameterError, match=f"HEADATLAS_TIMING_PAUSE_MAX_S='{bad}': expected seconds"):
            policy.applied(policy.PAUSE_MAX, here, {"HEADATLAS_TIMING_PAUSE_MAX_S": bad})


def test_a_bound_set_in_the_environment_is_applied_and_a_bad_one_refused_naming_it():
    from headatlas.service.errors import ParameterError

    assert policy.bound(policy.GROUP_MESSAGES_BOUND, {}) == 512
    assert policy.bound(policy.GROUP_BYTES_BOUND, {}) == 48 * 2**20
    assert policy.bound(policy.GROUP_MESSAGES_BOUND, {"HEADATLAS_BOUND_GROUP_MESSAGES": "32"}) == 32
    assert policy.GROUP_BYTES_BOUND.shown() == "48 MiB" and policy.GROUP_MESSAGES_BOUND.shown() == "512 messages"
    for bad in ("0", "-3", "2.5", "many"):
        with pytest.raises(ParameterError, match=f"HEADATLAS_BOUND_GROUP_BYTES='{bad}': expected a whole number"):
            policy.bound(policy.GROUP_BYTES_BOUND, {"HEADATLAS_BOUND_GROUP_BYTES": bad})


def test_timings_that_follow_settings_follow_them():
    from headatlas.service.config import Settings

    settings = Settings(lease_s=4.0, task_time_limit_s=100.0)
    assert policy.SILENCE.value(settings) == 4.0 and policy.HEARTBEAT.value(settings) == 0.8
    assert policy.time_limit_s(settings) == 100.0
    assert policy.hard_limit_s(settings) == 150.0 and policy.visibility_timeout_s(settings) == 200.0
    assert policy.HEARTBEAT.shown() == "HEADATLAS_LEASE_S / 5 (2 s by default)"


def test_the_rules_give_their_known_answers():
    assert [policy.retry_countdown(a) for a in (1, 2, 3, 4, 5, 9)] == [2, 4, 8, 16, 30, 30]
    assert not policy.gives_up(2, 3) and policy.gives_up(3, 3)
    assert not policy.out_of_attempts(3, 3) and policy.out_of_attempts(4, 3)
    assert [policy.next_pause(d) for d in (0.5, 1.0, 2.0, 4.0, 5.0)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    # stranded batches: first seen, still stranded before the wait, then due; anything stored resets it
    seen, due = policy.stranded_long_enough(None, {1, 2}, 5, now=100.0, wait_s=5.0)
    assert seen == (100.0, 5, {1, 2}) and not due
    assert policy.stranded_long_enough(seen, {1, 2}, 5, now=104.0, wait_s=5.0) == (seen, False)
    assert policy.stranded_long_enough(seen, {1, 2}, 5, now=105.0, wait_s=5.0) == (None, True)
    assert policy.stranded_long_enough(seen, {1, 2}, 6, now=105.0, wait_s=5.0) == ((105.0, 6, {1, 2}), False)
    assert policy.stranded_long_enough(seen, set(), 5, now=105.0, wait_s=5.0) == (None, False)


def test_the_message_types_fields_are_what_decode_checks():
    for cls in messages.TYPES.values():
        assert [f.name for f in fields(cls)][:2] == ["database_id", "run_key"]
        assert all(str(f.type) in messages._CHECKS for f in fields(cls))
