"""`submit --probe` through a real Redis, `headatlas writer` and `headatlas worker`: one probe
task, its scores stored by the writer, equal to the embedded probe's; a finished run given
another probe gets just the probe."""

from __future__ import annotations

import time

import pytest
from queue_support import make_corpus

from headatlas.service.engine.probe import SCORES, ProbeSpec, run_probe

pytestmark = pytest.mark.integration

ARGS = ["--model", "random:tiny", "--seq-len", "32", "--batch-size", "4"]


def probe_rows(db: str, run: str, timeout: float = 120.0, length: int | None = None) -> list[tuple]:
    """The run's probe rows once the writer has stored them (of probe ``length`` if given)."""
    from headatlas.service.storage.store import Store

    deadline = time.monotonic() + timeout
    while True:
        store = Store(db)
        run_id = store.get_run(run).run_id
        with store.read() as conn:
            rows = conn.exec_driver_sql(
                f"SELECT layer, head, length, sequences, seed, {', '.join(SCORES)} FROM probe_scores "
                f"WHERE run_id = {run_id} ORDER BY layer, head"
            ).all()
        if rows and (length is None or rows[0][2] == length):
            return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"no probe of length {length} stored for run {run} after {timeout} s")
        time.sleep(0.3)


def test_submit_probe_stores_the_embedded_probe_once(queue_cluster, tiny_model, demo_corpus, tmp_path):
    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=2, tag="probe")
    cluster = queue_cluster
    ref = cluster.submit(corpus, *ARGS, "--probe", "--probe-length", "10", "--probe-sequences", "4", "--wait")
    assert cluster.wait_status(ref) == "done"
    rows = probe_rows(cluster.db, ref)
    expected = run_probe(tiny_model, ProbeSpec(length=10, sequences=4))
    assert len(rows) == tiny_model.n_layers * tiny_model.n_heads
    for layer, head, length, sequences, seed, *scores in rows:
        assert (length, sequences, seed) == (10, 4, 0)
        for name, value in zip(SCORES, scores, strict=True):
            assert value == pytest.approx(float(expected[name][layer, head]), rel=1e-6)

    # the finished run with another probe: nothing analysed again, the probe replaced
    again = cluster.submit(corpus, *ARGS, "--probe", "--probe-length", "12", "--probe-sequences", "4")
    assert again == ref
    rows = probe_rows(cluster.db, ref, length=12)
    assert len(rows) == tiny_model.n_layers * tiny_model.n_heads
