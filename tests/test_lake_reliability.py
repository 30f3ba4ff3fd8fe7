"""A lake keeps what a file keeps: a deleted run's id is never handed to a new run (a file's
sequence does not go back; a lake has no sequences and keeps a high-water mark of its run ids).
Each test's lake is a catalogue database of its own on this machine's PostgreSQL (lake_support)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from headatlas.service.params import AnalysisParams

PARAMS = AnalysisParams(seq_len=32)


def _run(store, key: str):
    return store.find_or_create_run(
        run_key=key,
        name=f"run-{key}",
        corpus="hand",
        corpus_fingerprint=key,
        model={"spec": "random:tiny", "name": "random:tiny", "layers": 2, "heads": 2, "d_head": 8},
        params=PARAMS.to_dict(),
        engine="embedded",
        device="cpu",
    )


@pytest.mark.parametrize("kind", ["file", "lake"])
def test_a_deleted_runs_id_is_never_given_to_the_next_run(kind, request, tmp_path):
    from headatlas.service.storage.store import Store

    if kind == "lake":
        lake = request.getfixturevalue("lake")
        store = Store(lake.url, data_path=lake.data_path)
    else:
        store = Store(tmp_path / "atlas.duckdb")
    store.ensure_schema()
    first, second = _run(store, "a")[0], _run(store, "b")[0]
    assert (first.run_id, second.run_id) == (1, 2)
    store.delete_run(second.run_id)
    third = _run(store, "c")[0]
    assert third.run_id == 3  # not 2: a reference to the deleted run never reaches another
    store.delete_run(third.run_id)
    store.delete_run(first.run_id)
    assert _run(store, "d")[0].run_id == 4  # no run left at all: still past every id given


@pytest.fixture()
def remountable_data_path(lake, tmp_path, monkeypatch):
    """The lake's data path on a tmpfs of its own (the lake's files copied there), which the test
    remounts read-only (``mount -o remount,ro``: root is refused too, as chmod does not refuse
    it); skipped, saying why, where no tmpfs can be mounted."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {made.stderr.decode().strip()}")
    try:
        data = mount / "lake-data"
        shutil.copytree(lake.data_path, data)
        lake.data_path = data
        monkeypatch.setenv("HEADATLAS_DATA_PATH", str(data))
        yield mount
    finally:
        lake.release()
        subprocess.run(["mount", "-o", "remount,rw", str(mount)], capture_output=True)
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _remount(mount: Path, mode: str) -> None:
    done = subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)], capture_output=True)
    assert done.returncode == 0, done.stderr


def test_results_not_stored_on_a_read_only_data_path_say_so_in_one_line_and_a_rerun_stores_them(
    lake, remountable_data_path, small_corpus, monkeypatch, caplog
):
    """The data path turns read-only as an embedded run ends, when its results are stored: one
    line names the data path and what to do, no traceback; the run is done, its results are
    computed when read, and the same command run again once the path is writable stores them."""
    from conftest import invoke_cli

    from headatlas.service.reports import stored
    from headatlas.service.storage import run_results
    from headatlas.service.storage.store import Store

    real = stored.refresh

    def read_only_then_refresh(store, run_id):  # the fault, as the results are about to be stored
        _remount(remountable_data_path, "ro")
        return real(store, run_id)

    monkeypatch.setattr(stored, "refresh", read_only_then_refresh)
    command = ["analyze", str(small_corpus), "--model", "random:tiny", "--seq-len", "32", "--db", lake.url, "--quiet"]
    done = invoke_cli(*command)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    # what the console script prints (Python's last-resort handler: the message, and a traceback
    # when the record carries one), as this process's log capture holds it
    told = [r for r in caplog.records if r.name == "headatlas.results"]
    assert len(told) == 1 and told[0].exc_info is None, [r.getMessage() for r in told]
    said = told[0].getMessage()
    assert "\n" not in said and said.startswith("warning: run "), said
    assert f"{lake.data_path}/ takes no file (Read-only file system)" in said, said
    assert "make it writable, then run the same command again" in said, said
    store = Store(lake.url, data_path=lake.data_path)
    run_id = store.list_runs()[0]["run_id"]
    with store.checked_read() as conn:
        assert store.get_run(run_id).status == "done"
        assert run_results.load(conn, run_id, "heads") is None  # computed when read
    monkeypatch.setattr(stored, "refresh", real)
    _remount(remountable_data_path, "rw")
    again = invoke_cli(*command)
    assert again.returncode == 0 and not again.stderr.strip(), again.stderr
    with store.checked_read() as conn:
        assert all(run_results.load(conn, run_id, kind) is not None for kind in run_results.KINDS)


def _cut(forwarder) -> None:
    """The catalogue gone from under its sessions: the forwarder's port and connections shut."""
    import socket

    for s in [forwarder.listener, *forwarder.sockets]:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    forwarder.stop()


@pytest.mark.integration
def test_a_writer_stalled_while_paused_for_its_catalogue_does_not_blame_redis(lake, tmp_path, demo_corpus):
    """A writer paused mid-run for its lake's catalogue (gone from under its sessions) keeps its
    lease through the pause; stopped there (SIGSTOP, as a host starved of CPU stalls it) past the
    lease's life, it finds its lease gone as it resumes and takes it again, saying why: it was
    silent, with Redis answering. It said Redis had been away. The catalogue back, the run ends
    done."""
    from queue_support import Cluster, RedisServer, make_corpus, wait_for
    from test_lake_outages import ARGS, Forwarder, _finish, _log

    folder = tmp_path / "queue"
    server = RedisServer(folder / "redis").start()
    cluster = Cluster(server.url, folder)
    forwarder = Forwarder(("127.0.0.1", 5432))
    forwarder.start()
    cluster.env.update(lake.env)
    cluster.env["HEADATLAS_DB"] = cluster.db = f"{lake.url} host=127.0.0.1 port={forwarder.port}"
    lease_s = float(cluster.env["HEADATLAS_LEASE_S"])  # the suite's short lease (queue_support.TEST_TIMINGS)
    try:
        writer = cluster.start_writer()
        from headatlas.workers.lease import holder

        wait_for(lambda: getattr(holder(cluster.redis)[0], "database_id", None), cluster, "the writer to be ready")
        corpus = make_corpus(tmp_path, demo_corpus, paragraphs=1, copies=2, tag="stall")
        run = cluster.submit(corpus, *ARGS, "--writer-wait", "60")
        _cut(forwarder)
        cluster.start_worker()
        wait_for(lambda: "paused: lost the connection to the lake's catalogue" in _log(cluster), cluster, "pause")
        time.sleep(lease_s)  # paused a whole lease: the lease lives on
        assert "vanished" not in _log(cluster), cluster.logs()
        os.killpg(writer.pid, signal.SIGSTOP)
        try:
            time.sleep(lease_s + 2)
        finally:
            os.killpg(writer.pid, signal.SIGCONT)
        wait_for(lambda: "vanished" in _log(cluster), cluster, "the writer to find its lease gone")
        forwarder.start()
        _finish(cluster, run)
    finally:
        cluster.stop()
        forwarder.stop()
        server.stop()
    log = _log(cluster)
    assert "Redis was away" not in log and "Redis lost its data" not in log, log
    assert "with Redis answering: its process was stopped or starved of CPU" in log, log
    assert "another writer took" not in log, log
