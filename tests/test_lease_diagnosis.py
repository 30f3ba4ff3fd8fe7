"""Why a writer's lease vanished (workers/lease.py ``why_vanished``), against a real Redis: a refresh
counts from when it was sent. A writer stopped (SIGSTOP, a host starved of CPU) with a refresh in
flight reads its answer only when it runs again; counted from then, the lease that expired during
the stop seemed to vanish while the writer was not silent, and the log blamed Redis for losing its
data (test_lake_reliability's stalled writer, once, at load 7)."""

from __future__ import annotations

import time


def test_a_refresh_answered_after_a_stall_counts_from_when_it_was_sent(redis_url, tmp_path, monkeypatch):
    import redis

    from headatlas.workers import lease as leases

    monkeypatch.setattr(leases, "SILENT_S", 1.0)
    client = redis.Redis.from_url(redis_url)
    held = leases.WriterLease(client, tmp_path / "atlas.duckdb", redis_url)
    held.acquire()

    real_eval = client.eval

    def stalled(*args):
        answer = real_eval(*args)  # Redis renews the lease now ...
        time.sleep(1.5)  # ... and the writer, stopped, reads the answer past the lease's life
        return answer

    monkeypatch.setattr(client, "eval", stalled)
    assert held.refresh()  # it was ours when Redis answered
    monkeypatch.setattr(client, "eval", real_eval)
    assert client.get(leases.LEASE) is None  # expired while the writer was stopped
    assert not held.refresh()
    why = held.why_vanished()
    assert "stopped or starved of CPU" in why and "lost its data" not in why, why
    client.close()
