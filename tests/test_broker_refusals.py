"""A Redis that is there but refuses is said as such, with its fix: at maxmemory (OOM command not
allowed) and asked for a database number beyond its ``databases``. Before, the first was a
traceback (status, submit) or "broker unreachable; requeued" (the worker's task), the second
"cannot reach the broker" (submit) or a warning and exit 0 (status).

A private redis-server of four databases: the suite's own is shared and must not be filled.
"""

from __future__ import annotations

import pytest
import redis
from queue_support import RedisServer
from typer.testing import CliRunner

from headatlas.cli.main import app

pytestmark = pytest.mark.integration


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def one_error_line(result) -> str:
    """The command's one error line (submit says what it read first: the corpus and model)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.stderr, result.exception)
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in result.output, result.stderr
    return errors[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("refusing-redis"), persist=False, databases=4).start()
    yield server
    server.stop(kill=True)


@pytest.fixture()
def full(server):
    """The server past its maxmemory of 1 MiB, emptied afterwards. Filled beyond the limit before
    it is set, well beyond: filled only up to it, a freed buffer can bring it back under for a write."""
    client = redis.Redis(port=server.port)
    for i in range(0, 2000, 100):
        client.mset({f"fill:{j}": "x" * 1000 for j in range(i, i + 100)})
    client.config_set("maxmemory", "1mb")
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("one-more", "x")
    yield server.url
    client.config_set("maxmemory", "0")
    client.flushall()
    client.close()


@pytest.fixture(scope="module")
def queued_db(tmp_path_factory):
    """A database whose latest run is a queued one, planned as the writer plans it (its live
    counts come from Redis)."""
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.queue_store import open_run
    from headatlas.service.storage.store import Store

    root = tmp_path_factory.mktemp("refusals-db")
    corpus = root / "small.txt"
    corpus.write_text("The cat sat on the mat. It was warm.\n", encoding="utf-8")
    db = root / "q.duckdb"
    done = invoke("analyze", str(corpus), "--db", str(db), "--model", "random:tiny", "--quiet")
    assert done.exit_code == 0, done.output
    model = {"spec": "random:tiny", "name": "random BERT 2x4x32 (seed 0)", "layers": 2, "heads": 4, "d_head": 8}
    meta = {
        "run_key": "k" * 24,
        "name": "queued",
        "corpus": str(corpus),
        "corpus_fingerprint": "f" * 64,
        "model": model,
        "params": AnalysisParams(seq_len=128).to_dict(),
        "batch_size": 32,
        "batches": 3,
        "windows": 70,
    }
    open_run(Store(str(db)), meta)
    return corpus, db


def test_status_at_maxmemory_says_out_of_memory(full, queued_db):
    _corpus, db = queued_db
    line = one_error_line(invoke("status", "--db", str(db), "--broker", full))
    assert "out of memory" in line and "maxmemory" in line and "lost" not in line, line


def test_submit_at_maxmemory_says_out_of_memory(full, queued_db, tmp_path):
    corpus, db = queued_db
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text(encoding="utf-8") + "Another sentence.\n", encoding="utf-8")
    result = invoke(
        "submit", str(other), "--model", "random:tiny", "--db", str(db), "--broker", full, "--writer-wait", "0"
    )
    line = one_error_line(result)
    assert "out of memory" in line and "raise its maxmemory" in line and "lost" not in line, line


def test_a_task_at_maxmemory_is_requeued_saying_out_of_memory(full, monkeypatch):
    """The worker's task: Redis refusing its ledger's writes is not "broker unreachable"."""
    from celery.exceptions import Reject

    from headatlas.service.config import Settings
    from headatlas.workers import tasks

    monkeypatch.setattr(tasks, "_settings", lambda: Settings(broker_url=full))
    client = redis.Redis.from_url(full)
    with pytest.raises(Reject) as refused:
        with tasks._requeue_on_broker_loss():
            client.set("one-more", "x" * 1000)
    client.close()
    assert refused.value.requeue and "out of memory" in str(refused.value.reason), refused.value.reason
    assert "unreachable" not in str(refused.value.reason)


@pytest.mark.parametrize("command", ["status", "submit"])
def test_a_database_number_beyond_the_servers_is_said(command, server, queued_db):
    corpus, db = queued_db
    url = server.db_url(99)
    args = ["submit", str(corpus), "--model", "random:tiny"] if command == "submit" else ["status"]
    line = one_error_line(invoke(*args, "--db", str(db), "--broker", url))
    assert "database 99, out of range" in line and "it has 4: 0 to 3" in line, line
