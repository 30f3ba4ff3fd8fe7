"""Causal effects added to a finished run through the queue (SPEC §9): `headatlas effects RUN
--queue` has real workers measure the run's windows and the writer store them, equal to what the
embedded `effects RUN` stores (values and intervals), resuming with only the windows not stored;
what cannot be added is refused in one line before anything is queued."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import text

from headatlas.service.metrics import EFFECT_COLUMNS
from headatlas.service.storage.store import Store

MODEL = ["--model", "random:tiny", "--seq-len", "32", "--sentences", "punct", "--replicates", "window"]
KINDS = ["--effects", "zero,mean"]


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _effects(db: str, run_id: int) -> list[dict]:
    """The run's effects with their intervals, as `effects RUN` and run.effects() read them."""
    import headatlas

    return headatlas.connect(db).run(run_id).effects(ci=True).to_pylist()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, demo_corpus):
    path = tmp_path_factory.mktemp("queued_effects") / "corpus.txt"
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:3]
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.mark.integration
def test_effects_queued_for_a_run_equal_the_embedded_ones_and_resume(queue_cluster, corpus, tmp_path, cli):
    ref = queue_cluster.submit(corpus, *MODEL, "--batch-size", "4", "--wait")
    assert queue_cluster.wait_status(ref) == "done"
    run = Store(queue_cluster.db).get_run(ref)
    env = queue_cluster.env

    # in two submissions: 2 windows, then 4 (the first 2 neither measured nor queued again)
    first = cli("effects", ref, *KINDS, "--windows", "2", "--queue", "--wait", "--format", "csv", env=env)
    assert first.returncode == 0, first.stderr + queue_cluster.logs()
    assert "effects on 2 windows, 2 not stored yet, one a batch: queued 2, 0 queued already" in " ".join(
        first.stderr.split()
    )
    more = cli("effects", ref, *KINDS, "--windows", "4", "--queue", "--wait", "--format", "csv", env=env)
    assert more.returncode == 0, more.stderr + queue_cluster.logs()
    said = " ".join(more.stderr.split())
    assert (
        "effects on 4 windows, 2 not stored yet, one a batch: queued 2, 0 queued already" in said
        and "effect_mean" in more.stdout.splitlines()[0]
    )
    again = cli("effects", ref, *KINDS, "--windows", "4", "--queue", env=env)
    assert again.returncode == 0 and "nothing queued" in again.stderr and again.stdout.strip() == str(run.run_id)

    # the embedded `effects RUN` on the same run analysed in this process
    db = str(tmp_path / "embedded.duckdb")
    assert cli("analyze", str(corpus), *MODEL, "--batch-size", "4", "--db", db, "-q").returncode == 0
    embedded = cli("effects", "1", *KINDS, "--windows", "4", "--db", db, "--format", "csv")
    assert embedded.returncode == 0, embedded.stderr
    queued, local = _effects(queue_cluster.db, run.run_id), _effects(db, 1)
    assert len(queued) == len(local) > 0 and queued[0].keys() == local[0].keys()
    assert all(r["effect_mean_lo"] is not None for r in queued)  # intervals, on the same replicate groups
    for a, b in zip(queued, local):
        assert all(_close(a[k], b[k]) for k in a), (a, b)
    with Store(queue_cluster.db).read() as conn:
        stored = Store(queue_cluster.db).get_run(run.run_id)
        assert stored.params["effects"] == ["zero", "mean"] and stored.params["effect_windows"] == 4
        batches = conn.execute(
            text("SELECT count(*) FROM batches WHERE run_id = :r AND batch_id >= 1073741824"), {"r": run.run_id}
        ).scalar()
        assert batches == 4  # one a window, each stored once
        assert conn.execute(text("SELECT count(*) FROM run_effects WHERE run_id = :r"), {"r": run.run_id}).scalar() == 1
        metrics = conn.execute(
            text("SELECT * FROM head_metrics WHERE run_id = :r ORDER BY layer, head"), {"r": run.run_id}
        ).mappings()
        rows = [dict(r) for r in metrics]
    with Store(db).read() as conn:
        want = [
            dict(r)
            for r in conn.execute(text("SELECT * FROM head_metrics WHERE run_id = 1 ORDER BY layer, head")).mappings()
        ]
    for now, there in zip(rows, want):
        assert all(_close(now[c], there[c]) for c in EFFECT_COLUMNS), (now["layer"], now["head"])


def test_what_cannot_be_queued_is_refused_in_one_line_and_queues_nothing(corpus, tmp_path, cli, redis_url):
    import redis

    db = str(tmp_path / "refused.duckdb")
    assert cli("analyze", str(corpus), *MODEL, "--db", db, "-q").returncode == 0
    assert cli("effects", "1", "--effects", "zero", "--windows", "2", "--db", db).returncode == 0
    queue = ["--queue", "--db", db, "--broker", redis_url]

    def refused(*args: str) -> str:
        done = cli("effects", *args, *queue)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        return " ".join(done.stderr.split())

    assert "holds effects zero on" in refused("1", "--effects", "zero,mean", "--windows", "2")
    said = refused("nothing-here")
    assert "no such corpus" in said and "no run of that" in said
    assert "give a run, not a corpus" in refused(str(corpus))
    with Store(db).write() as conn:  # a run not finished (an analysis stopped part way)
        conn.execute(text("UPDATE runs SET status = 'interrupted' WHERE run_id = 1"))
    assert "is interrupted: effects are added to a finished run" in refused("1", "--effects", "zero")
    waits = cli("effects", "1", "--wait", "--db", db)
    assert waits.returncode != 0 and "add --queue" in waits.stderr
    with Store(db).read() as conn:  # nothing stored by the refusals
        assert conn.execute(text("SELECT count(*) FROM run_effects")).scalar() == 1
        assert conn.execute(text("SELECT count(*) FROM batches WHERE batch_id >= 1073741824")).scalar() == 2
    assert not redis.Redis.from_url(redis_url).keys("headatlas:*")  # nothing queued
