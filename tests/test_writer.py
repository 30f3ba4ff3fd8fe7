"""The writer in-process, on a real Redis and a real DuckDB file: group commit, idempotence,
recovery of messages a killed writer had taken, a refused batch marked failed."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from queue_support import make_corpus, stored

from headatlas.service.config import Settings
from headatlas.service.params import AnalysisParams

pytestmark = pytest.mark.integration

PARAMS = AnalysisParams(seq_len=32)


@pytest.fixture()
def setting(redis_url, tmp_path):
    import redis

    redis.Redis.from_url(redis_url).flushdb()  # each test's writer takes the broker's lease for its own file
    return Settings(broker_url=redis_url, db=str(tmp_path / "w.duckdb"))


def _results(corpus, model):
    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.windows import TokenClasses, Window, collate
    from headatlas.workers.submit import batch_payloads

    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    out = []
    for batch_id, _n, payload in batch_payloads(
        str(corpus), model, PARAMS, model="random:tiny", dtype="float32", batch_size=4, database_id=""
    ):
        windows = [Window.from_message(row) for row in payload["windows"]]
        result = analyze_batch(model, collate(windows, tokens.pad_id), PARAMS, tokens, documents=payload["documents"])
        out.append((batch_id, base64.b64encode(result.to_bytes()).decode()))
    return out


def _describe(ledger, key, model, corpus, results):
    ledger.put_run(
        key,
        {
            "run_key": key,
            "name": f"writer-{key}",
            "corpus": str(corpus),
            "corpus_fingerprint": key,
            "model": model.describe(),
            "params": PARAMS.to_dict(),
            "device": None,
            "batch_size": 4,
            "batches": len(results),
            "windows": None,
        },
    )


def test_a_group_in_one_step_duplicates_counted_once_and_taken_messages_recovered(
    setting, tiny_model, demo_corpus, tmp_path
):
    from headatlas.workers.ledger import INGEST, PROCESSING
    from headatlas.workers.writer import Writer

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=2, tag="grouped")
    results = _results(corpus, tiny_model)
    writer = Writer(setting)
    ledger = writer.ledger
    _describe(ledger, "k1", tiny_model, corpus, results)
    ledger.send_to_writer("open_run", run_key="k1")
    for batch_id, payload in results:
        ledger.send_to_writer("ingest", run_key="k1", batch_id=batch_id, payload=payload)
    ledger.send_to_writer("ingest", run_key="k1", batch_id=0, payload=results[0][1])  # delivered twice
    # a previous writer took the last message and died before committing it
    ledger.r.lmove(INGEST, PROCESSING, "RIGHT", "RIGHT")
    writer._recover()
    assert ledger.r.llen(PROCESSING) == 0
    assert writer.step() == len(results) + 2  # every message in one step: one transaction
    assert ledger.r.llen(INGEST) == 0 and ledger.r.llen(PROCESSING) == 0
    from headatlas.service.storage.store import Store

    run = Store(setting.db).get_run("writer-k1")
    assert run.status == "done"
    windows = len(stored(setting.db, run.run_id)["run_windows"])
    assert ledger.windows_done("k1") == windows
    assert ledger.done("k1") == {b for b, _ in results}


def test_a_refused_batch_is_marked_failed_and_the_rest_of_its_group_stored(setting, tiny_model, demo_corpus, tmp_path):
    from headatlas.service.storage.store import Store
    from headatlas.workers.writer import Writer

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=2, tag="refused")
    results = _results(corpus, tiny_model)
    writer = Writer(setting)
    ledger = writer.ledger
    _describe(ledger, "k2", tiny_model, corpus, results)
    ledger.send_to_writer("open_run", run_key="k2")
    for batch_id, payload in results:
        ledger.send_to_writer("ingest", run_key="k2", batch_id=batch_id, payload=payload)
    # batch 1's windows again under another batch id: they would be counted twice
    ledger.send_to_writer("ingest", run_key="k2", batch_id=len(results), payload=results[1][1])
    writer.step()
    run = Store(setting.db).get_run("writer-k2")
    with Store(setting.db).read() as conn:
        from headatlas.service.storage.queue_store import progress

        prog = progress(conn, run.run_id)
    assert prog.done == len(results) and prog.failed == 1
    assert "already counted" in prog.errors[0][2]
    assert run.status == "failed"


def test_the_writer_stores_real_messages_without_loading_torch(setting, tiny_model, demo_corpus, tmp_path):
    """The writer, in its own interpreter, takes real ingest messages and stores them; torch and
    transformers are never imported (the writer stays light: it only reads numpy payloads), and
    neither is pandas, kept out as `headatlas writer` keeps it out (DuckDB would import it)."""
    import subprocess
    import sys
    from pathlib import Path

    from headatlas.service.storage.db import read_database_id
    from headatlas.service.storage.store import Store
    from headatlas.workers.ledger import Ledger, connect

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=2, tag="light")
    results = _results(corpus, tiny_model)
    Store(setting.db).ensure_schema()  # the database the writer will serve, and its id
    ledger = Ledger(connect(setting.broker_url), read_database_id(setting.db))
    _describe(ledger, "k3", tiny_model, corpus, results)
    ledger.send_to_writer("open_run", run_key="k3")
    for batch_id, payload in results:
        ledger.send_to_writer("ingest", run_key="k3", batch_id=batch_id, payload=payload)
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('LOADED', sorted(m for m in ('torch', 'transformers', 'pandas') if m in sys.modules)))\n"
        "from headatlas.workers.launch import without_pandas\n"
        "without_pandas()\n"
        "from headatlas.service.config import Settings\n"
        "from headatlas.workers.writer import Writer\n"
        "print('STORED', Writer(Settings(broker_url=sys.argv[1], db=sys.argv[2])).step(timeout_s=5.0))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, setting.broker_url, setting.db],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr
    assert f"STORED {len(results) + 1}" in done.stdout, done.stdout + done.stderr
    assert "LOADED []" in done.stdout, done.stdout
    assert Store(setting.db).get_run("writer-k3").status == "done"


def test_a_batch_stored_before_submit_marks_it_queued_is_not_in_flight(redis_url):
    """submit marks a chunk of batches queued after sending it; a fast worker and writer can store
    one of them first. That batch must not stay in flight: the run would never be seen to end, and
    `submit --wait` would wait forever (seen after a Redis restart without its data)."""
    from headatlas.workers.ledger import Ledger, connect

    client = connect(redis_url)
    client.flushdb()
    ledger = Ledger(client, "d" * 36)
    ledger.finished("run", 5, failed=False, windows=4)  # the writer stored batch 5 ...
    ledger.mark_queued("run", [5, 6])  # ... before submit marked its chunk queued
    assert ledger.in_flight("run") == {6}
    ledger.finished("run", 6, failed=False, windows=4)
    assert ledger.in_flight("run") == set()


def test_a_writer_whose_database_takes_longer_to_open_than_its_lease_lives_keeps_it(setting, monkeypatch):
    """Creating the schema took 7 s on a loaded machine: with no refresh meanwhile the lease
    expired and the writer stopped, saying that another writer had taken the queue."""
    import time

    import redis

    from headatlas.service.storage.store import Store
    from headatlas.workers import lease
    from headatlas.workers.writer import Writer

    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.1)
    monkeypatch.setattr(lease, "SILENT_S", 0.5)
    slow, held_meanwhile = Store.ensure_schema, []

    def ensure_schema(self):
        time.sleep(1.5)  # three lease lifetimes
        held_meanwhile.append(lease.holder(redis.Redis.from_url(setting.broker_url))[0] is not None)
        return slow(self)

    monkeypatch.setattr(Store, "ensure_schema", ensure_schema)
    writer = Writer(setting)
    assert held_meanwhile == [True]
    held, _raw = lease.holder(writer.lease.r)
    assert held is not None and held.token == writer.lease.token and held.database_id == writer.database_id
    # without the refresh the lease is gone after the same wait (what the writer saw before)
    time.sleep(1.0)
    assert lease.holder(writer.lease.r)[0] is None


def test_the_writers_transactions_never_create_a_database_at_a_path_left_empty(tmp_path):
    """Every transaction of the writer's store goes through its guard, `atomically` too (the path
    of `open_run` and of storing a group): a file moved away between the writer's look at it and
    the transaction raises DatabaseAway, and no empty database appears at the path (seen in a
    suite run: `open_run` created one and failed on its missing tables; the writer never paused)."""
    from sqlalchemy import text

    from headatlas.service.storage.db import read_database_id
    from headatlas.service.storage.store import Store
    from headatlas.workers.writer import DatabaseAway, OwnStore

    path = tmp_path / "own.duckdb"
    Store(path).ensure_schema()
    own = OwnStore(str(path), read_database_id(str(path)))
    assert own.atomically(lambda conn: conn.execute(text("SELECT count(*) FROM runs")).scalar()) == 0
    path.rename(tmp_path / "moved.duckdb")
    with pytest.raises(DatabaseAway, match="missing"):
        own.atomically(lambda conn: conn.execute(text("SELECT count(*) FROM runs")).scalar())
    assert not path.exists()


def _move_after_the_check(monkeypatch, path: Path, moved: Path) -> None:
    """The file at ``path`` moves to ``moved`` in the instant after the guard's check passes,
    before DuckDB opens it."""
    from headatlas.service.storage import dbfile

    checked = dbfile.check_file

    def check_then_move(file, **kwargs):
        checked(file, **kwargs)
        if path.exists():
            path.rename(moved)

    monkeypatch.setattr(dbfile, "check_file", check_then_move)


def test_a_file_moved_between_the_writers_check_and_open_leaves_no_database_behind(tmp_path, monkeypatch):
    """The file goes in the instant between the guard's check and DuckDB's open, which creates a
    missing file even with ``create=False`` (seen in a suite run: the writer then logged "another
    file" and "not a headatlas database" for an empty file it had made itself, and a new writer
    would have found it): the transaction raises DatabaseAway "missing", and the empty database
    the open made is gone again."""
    from sqlalchemy import text

    from headatlas.service.storage.db import read_database_id
    from headatlas.service.storage.store import Store
    from headatlas.workers.writer import DatabaseAway, OwnStore

    path = tmp_path / "own.duckdb"
    moved = tmp_path / "moved.duckdb"
    Store(path).ensure_schema()
    own = OwnStore(str(path), read_database_id(str(path)))
    _move_after_the_check(monkeypatch, path, moved)
    with pytest.raises(DatabaseAway, match="missing"):
        own.atomically(lambda conn: conn.execute(text("SELECT count(*) FROM runs")).scalar())
    assert not path.exists() and not Path(f"{path}.wal").exists()
    assert read_database_id(str(moved)) == own.database_id  # the database itself untouched


@pytest.mark.parametrize("when", ["before", "between check and open"])
def test_a_writers_reads_on_a_file_moved_away_are_a_pause_not_an_error(tmp_path, monkeypatch, when):
    """The writer's reads (open_run of a run it opened already, a group's summary) go through the
    guard as its writes do: a file moved away makes them DatabaseAway (the writer pauses, the
    message stays), not DatabaseNotFound, which _open_run told the waiting submitter as the run's
    error (seen in CI: `submit --wait` ended with "no database at ..." while the writer waited)."""
    from sqlalchemy import text

    from headatlas.service.errors import StoreBusy
    from headatlas.service.storage.db import read_database_id
    from headatlas.service.storage.queue_store import open_run
    from headatlas.service.storage.store import Store
    from headatlas.workers.writer import DatabaseAway, OwnStore

    path, moved = tmp_path / "own.duckdb", tmp_path / "moved.duckdb"
    Store(path).ensure_schema()
    own = OwnStore(str(path), read_database_id(str(path)))
    with own.checked_read() as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 0
    if when == "before":
        path.rename(moved)
    else:
        _move_after_the_check(monkeypatch, path, moved)
    for read in (own.read, own.checked_read):
        with pytest.raises(DatabaseAway, match="missing"):
            with read():
                pass
        if when != "before":
            moved.rename(path)
    with pytest.raises(StoreBusy, match="missing"):
        open_run(own, {"run_key": "k"}, opened=1)
    assert not path.exists()


def test_group_commit_takes_what_waits_up_to_the_bytes_bound_in_order(redis_url):
    """With a backlog the writer takes messages until their bytes reach the bound (a
    transaction's worth, more than one round trip), the rest staying queued in order; idle, what
    waits, without waiting for more; a bound on messages holds however small they are."""
    import time

    import redis

    from headatlas.workers.writer import TAKE_CHUNK, take_group

    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    messages = [f"{i:04d}".encode() + b"x" * 996 for i in range(200)]  # 1,000 bytes each
    r.rpush("q", *messages)
    taken = take_group(r, "q", "p", 1.0, max_bytes=100_500, max_messages=1000)
    assert len(taken) == 101 > TAKE_CHUNK  # the first message reaching 100,500 bytes ends the group
    assert taken == messages[:101] and r.lrange("p", 0, -1) == messages[:101]
    assert r.lrange("q", 0, -1) == messages[101:]
    assert take_group(r, "q", "p2", 1.0, max_bytes=10**9, max_messages=40) == messages[101:141]
    start = time.monotonic()
    assert take_group(r, "q", "p3", 5.0, max_bytes=10**9, max_messages=1000) == messages[141:]  # what waits
    assert time.monotonic() - start < 2.0
    # nothing waits: nothing after the timeout
    assert take_group(r, "q", "p4", 0.1, max_bytes=10**9, max_messages=1000) == []


def test_a_payload_that_does_not_decode_fails_its_batch_and_the_rest_of_its_group_is_stored(
    setting, tiny_model, demo_corpus, tmp_path
):
    """The group's payloads are decoded before its transaction opens the file; one that is not a
    batch's results is left to the transaction, which fails that batch alone."""
    from headatlas.service.storage.queue_store import progress
    from headatlas.service.storage.store import Store
    from headatlas.workers.writer import Writer

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=2, tag="undecodable")
    results = _results(corpus, tiny_model)
    writer = Writer(setting)
    ledger = writer.ledger
    _describe(ledger, "k5", tiny_model, corpus, results)
    ledger.send_to_writer("open_run", run_key="k5")
    bad = base64.b64encode(b"not the bytes of a batch's results").decode()
    for batch_id, payload in results:
        ledger.send_to_writer("ingest", run_key="k5", batch_id=batch_id, payload=bad if batch_id == 1 else payload)
    writer.step()
    run = Store(setting.db).get_run("writer-k5")
    with Store(setting.db).read() as conn:
        prog = progress(conn, run.run_id)
    assert prog.done == len(results) - 1 and prog.failed == 1
    assert prog.errors[0][0] == 1 and run.status == "failed"


def _hand_meta(key: str, batches: int | None) -> dict:
    return {
        "run_key": key,
        "name": key,
        "corpus": "hand",
        "corpus_fingerprint": key,
        "model": {"spec": "hand", "name": "hand", "layers": 1, "heads": 2, "d_head": 8},
        "params": {"seq_len": 8, "short_range": 4},
        "device": None,
        "batch_size": 4,
        "batches": batches,
        "windows": None,
    }


def test_a_run_deleted_before_its_submitter_s_last_open_is_not_created_again_and_its_wait_ends(setting):
    """`runs delete` deletes the rows, then marks the run deleted in Redis; the submitter's last
    OpenRun (its plan complete) handled between the two found the run gone: the writer created it
    anew, or (the delete between its transactions) told the waiting submitter "no run N in the
    database". It is now ended as deleted, and nothing is created again."""
    from sqlalchemy import text

    from headatlas.service.storage.db import transaction
    from headatlas.service.storage.store import Store
    from headatlas.workers.ledger import deleted_message
    from headatlas.workers.messages import OpenRun
    from headatlas.workers.writer import Writer

    writer = Writer(setting)
    ledger = writer.ledger
    ledger.put_run("k", _hand_meta("k", None))
    ledger.send(OpenRun(writer.database_id, "k"))
    assert writer.step() == 1
    run_id, error = ledger.run_id("k")
    assert run_id is not None and not error

    Store(setting.db).delete_run(run_id)  # the rows, not yet the mark in Redis
    ledger.put_run("k", _hand_meta("k", 3))
    ledger.send(OpenRun(writer.database_id, "k"))
    assert writer.step() == 1
    assert ledger.deleted("k") and ledger.run_id("k")[1] == deleted_message(run_id)
    with transaction(setting.db, read_only=True) as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM queue_plans")).scalar() == 0
    writer.lease.release()


def test_the_writer_tells_redis_what_a_run_holds_after_its_transaction_not_inside_it(setting, monkeypatch):
    """A submitter's OpenRun for a run the database has: the writer reads the run's stored batches
    and summary in one transaction and tells Redis after it ends. Told inside it, a broker that
    stalled (writes paused) kept the file from every other process for as long: a beat's claim
    waited behind it and the fire it was due was late by the stall."""
    import subprocess
    import sys

    from headatlas.workers.messages import OpenRun
    from headatlas.workers.writer import Writer

    writer = Writer(setting)
    ledger = writer.ledger
    ledger.put_run("k", _hand_meta("k", None))
    ledger.send(OpenRun(writer.database_id, "k"))
    assert writer.step() == 1

    def file_free() -> bool:  # another process can open the database now
        probe = f"import duckdb; duckdb.connect({setting.db!r}, read_only=True).close()"
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60).returncode == 0

    seen: list[tuple[str, bool]] = []
    for name in ("reconcile_done", "set_run_status"):

        def told(*args, _told=getattr(ledger, name), _name=name, **kwargs):
            seen.append((_name, file_free()))
            return _told(*args, **kwargs)

        monkeypatch.setattr(ledger, name, told)
    ledger.send(OpenRun(writer.database_id, "k"))
    assert writer.step() == 1
    assert seen == [("reconcile_done", True), ("set_run_status", True)]
    writer.lease.release()


def test_open_run_refuses_a_run_deleted_between_its_read_and_its_plan(tmp_path, monkeypatch):
    from sqlalchemy import text

    from headatlas.service.errors import RunDeleted
    from headatlas.service.storage import queue_store
    from headatlas.service.storage.db import transaction, upgrade
    from headatlas.service.storage.store import Store

    db = str(tmp_path / "open.duckdb")
    upgrade(db)
    store = Store(db)
    run, _plan = queue_store.open_run(store, _hand_meta("k", None))
    with pytest.raises(RunDeleted, match=f"run {run.run_id + 1} was deleted"):
        queue_store.open_run(store, _hand_meta("k", 2), opened=run.run_id + 1)  # the key now holds another run

    atomically = store.atomically

    def deleted_first(work):  # the plan's transaction, after the read that found the run
        monkeypatch.setattr(store, "atomically", atomically)
        store.delete_run(run.run_id)
        return atomically(work)

    monkeypatch.setattr(store, "atomically", deleted_first)
    with pytest.raises(RunDeleted, match=f"run {run.run_id} was deleted"):
        queue_store.open_run(store, _hand_meta("k", 2), opened=run.run_id)
    with transaction(db, read_only=True) as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM queue_plans")).scalar() == 0
