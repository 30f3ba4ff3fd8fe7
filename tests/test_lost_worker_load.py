"""A worker killed with SIGKILL mid-batch on a loaded machine: its batch comes back within its
lease and a sweep, not after the broker's visibility timeout, and the run ends done with every
window counted once. The test loads the CPUs itself (spinner processes, started as the worker
runs a batch and killed once the lost batch is stored again) and times each step from the kill:
the sweep declaring the batch lost, its message back on the queue, its second start, its
storing, the run's end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from queue_support import LEASE_S, assert_counted_once, kill_mid_batch, submit_lost_worker_run, wait_for

pytestmark = pytest.mark.integration

# the bound catches a batch never requeued, or requeued only by the visibility timeout (1200 s at
# the default task limit), not a slow machine: the lease (5 s in the suite) and a sweep take ~7 s
REQUEUE_BOUND_S = 60.0
RUN_BOUND_S = 300.0


class Spinners:
    """Four busy-looping processes per core from ``start()`` to ``stop()``: with the cluster's own
    processes, a load average of about 10 on two cores (the lost worker was reported at 15)."""

    def __init__(self) -> None:
        self.count = 4 * (os.cpu_count() or 1)
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs = []


@pytest.fixture()
def cpu_load() -> Iterator[Spinners]:
    """The spinners, started by the test as the worker runs its first batch and stopped once the
    killed worker's batch is stored again (or as the test ends): what is timed, from the kill to
    the lost batch stored, runs under the load; submitting the run and the rest of it, which the
    test does not time, do not (the spinners once ran the whole test, 50 s of the suite's two cores)."""
    spinners = Spinners()
    try:
        yield spinners
    finally:
        spinners.stop()


def _unacked_tag(client, task_id: str) -> bytes | None:
    """The broker's delivery tag of the unacknowledged message of task ``task_id``."""
    for tag, raw in client.hgetall("unacked").items():
        if json.loads(raw)[0].get("headers", {}).get("id") == task_id:
            return tag
    return None


def test_a_worker_killed_mid_batch_under_load_has_its_batch_requeued_within_its_lease(
    queue_cluster, demo_corpus, tmp_path, cpu_load
):
    from headatlas.workers.ledger import key

    cluster = queue_cluster
    assert cluster.env["HEADATLAS_LEASE_S"] == str(LEASE_S)
    sub = submit_lost_worker_run(cluster, tmp_path, demo_corpus, "lostunderload")
    run_id = cluster.run_id(sub)
    r = cluster.redis
    k = lambda what: key(what, sub.run_key, sub.database_id)  # noqa: E731
    wait_for(lambda: r.hlen(k("running")) > 0, cluster, "the first batch to start", timeout=240)
    cpu_load.start()
    victim, entry, killed = kill_mid_batch(cluster, k("running"))
    tag = _unacked_tag(r, entry["task"])  # None: no longer unacknowledged (already put back)
    cluster.start_worker()  # the test's own, started at once: its start (and its model's build) is loaded too

    lost: dict = {}

    def declared_lost() -> bool:
        record = r.hget(k("lost"), victim)
        if record is not None:
            lost.update(json.loads(record))
        return record is not None

    # each step, first seen this many seconds after the kill (Redis alone is polled: cheap under load)
    steps = {
        "declared lost": declared_lost,
        "message back on the queue": lambda: tag is None or not r.hexists("unacked", tag),
        "started again": lambda: int(r.hget(k("attempts"), victim) or 0) >= 2,
        "stored": lambda: r.sismember(k("done"), victim),
        "run done": lambda: r.hget(k("run"), "status") == b"done",
    }
    seen: dict[str, float] = {}
    load = 0.0  # the load average as the spinners stop
    trace: list[str] = []  # every 5 s, for a failure's message: where the run's batches are
    while len(seen) < len(steps):
        now = time.time() - killed
        for step, check in steps.items():
            if step not in seen and check():
                seen[step] = now
        if "stored" in seen and cpu_load.procs:
            # the lost batch's way back (declared lost, requeued, started again, stored) was timed
            # under load; the rest of the run needs none (it held the spinners for 40 s more, every
            # core of the suite's other workers taken from them)
            load = os.getloadavg()[0]
            cpu_load.stop()
        if len(trace) <= now / 5:
            trace.append(
                f"{now:.0f} s: queued {r.llen('analysis')}, unacknowledged {r.hlen('unacked')}, "
                f"running {sorted(map(int, r.hkeys(k('running'))))}, stored {r.scard(k('done'))}/{sub.batches}, "
                f"writer backlog {r.llen('headatlas:ingest')}"
            )
        why = f"after {now:.0f} s ({seen}); " + "; ".join(trace) + f"\n{cluster.logs()}"
        assert "message back on the queue" in seen or now < REQUEUE_BOUND_S, f"batch {victim} not requeued {why}"
        assert now < RUN_BOUND_S, f"the run did not end {why}"
        time.sleep(0.05)

    assert cluster.wait_status(sub.name, timeout=120) == "done"  # the database says so too
    db_done = time.time() - killed
    assert_counted_once(cluster.db, run_id)
    assert int(r.hget(k("attempts"), victim)) >= 2  # it was really cut short, and analysed again
    assert lost["worker"] == entry["worker"]
    print(
        f"\nkill -9 mid-batch beside {cpu_load.count} spinners (load average {load:.1f} as its batch was stored again): "
        + "; ".join(f"{step} {t:.1f} s" for step, t in seen.items())
        + f"; done in the database {db_done:.1f} s after the kill (last heartbeat {killed - entry['beat']:.1f} s before it)"
    )
