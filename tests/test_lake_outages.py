"""A lake writer rides out its lake's faults (real Redis, `headatlas writer` and `headatlas
worker`, this machine's PostgreSQL): its catalogue sessions ended by the server mid-ingest
(``pg_terminate_backend``, as a PostgreSQL restart or ``idle_session_timeout`` does), no
PostgreSQL listening when it starts, its data path full (a 20 MB tmpfs filled) and read-only (the
tmpfs remounted). Each time it pauses, says what it waits for in its log and to `headatlas
status`, and goes on when the fault clears, without a restart: the run ends done with every window
counted once. The recovery times printed are the figures of docs/reliability.md."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import invoke_cli
from queue_support import Cluster, RedisServer, assert_counted_once, make_corpus, wait_for

pytestmark = pytest.mark.integration

ARGS = ["--model", "random:tiny", "--seq-len", "32", "--batch-size", "4"]


@pytest.fixture()
def cluster(lake, tmp_path):
    folder = tmp_path / "queue"
    server = RedisServer(folder / "redis").start()
    cluster = Cluster(server.url, folder)
    cluster.db = lake.url
    cluster.env.update(lake.env)
    try:
        yield cluster
    finally:
        cluster.stop()
        server.stop()


def _submit(cluster: Cluster, corpus: Path) -> str:
    """`headatlas submit` (in this process): the run's id once the writer has opened it."""
    from headatlas.workers.lease import holder

    wait_for(lambda: getattr(holder(cluster.redis)[0], "database_id", None), cluster, "the writer to be ready")
    return cluster.submit(corpus, *ARGS, "--writer-wait", "60")


def _log(cluster: Cluster) -> str:
    path = cluster.folder / "writer.log"
    return " ".join(path.read_text(errors="replace").split()) if path.exists() else ""


def _finish(cluster: Cluster, run: str) -> int:
    assert cluster.wait_status(run, timeout=90) == "done", cluster.logs()
    return int(run)


def _resumed_after(cluster: Cluster) -> float:
    """The pause the writer reports as it goes on (first failure to its first success)."""
    found = re.findall(r"is back after ([0-9.]+) s", _log(cluster))
    assert found, cluster.logs()
    return float(found[-1])


def _assert_rode_it_out(cluster: Cluster, run_id: int, lake) -> None:
    assert_counted_once(lake.url, run_id)
    writer = cluster.procs["writer"]
    assert writer.poll() is None, cluster.logs()  # never restarted: the same process goes on
    assert "Traceback" not in _log(cluster), cluster.logs()


def test_catalogue_sessions_ended_by_the_server_mid_ingest(cluster, lake, demo_corpus, tmp_path):
    import lake_support

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=1, copies=2, tag="lakepgterm")
    cluster.start_writer()
    run = _submit(cluster, corpus)  # the writer opened the run; no worker yet: nothing is stored
    # every session the writer holds on the catalogue, ended by the server
    ended = lake_support._psql(
        f"SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = '{lake.name}' "
        "AND pid <> pg_backend_pid()"
    )
    assert ended.returncode == 0 and int(ended.stdout) > 0, ended.stderr
    cluster.start_worker()  # its batches meet the dead sessions
    run_id = _finish(cluster, run)
    log = _log(cluster)
    assert "paused: lost the connection to the lake's catalogue" in log, cluster.logs()
    # the cause as libpq words it, which depends on where the ended session was met
    causes = (
        "server closed the connection unexpectedly",
        "terminating connection",
        "no connection to the server",
        "could not receive data from server",
        "connection already closed",
        "connection to server",
        'Failed to execute query "ROLLBACK"',  # the ended session met first by the rollback (lake_fault)
    )
    assert any(cause in log for cause in causes), cluster.logs()
    _assert_rode_it_out(cluster, run_id, lake)
    print(f"\ncatalogue sessions ended: the writer went on {_resumed_after(cluster):.1f} s after its first failure")


class Forwarder:
    """A TCP port that forwards to PostgreSQL once ``start`` is called (nothing listens before):
    a catalogue server that is down, then up."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.listener: socket.socket | None = None
        self.sockets: list[socket.socket] = []

    def start(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port))
        self.listener.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                client, _addr = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        for s in [*self.sockets, *([self.listener] if self.listener else [])]:
            s.close()


def test_no_postgresql_listening_when_the_writer_starts(cluster, lake, demo_corpus, tmp_path):
    forwarder = Forwarder(("127.0.0.1", 5432))
    # the writer reaches the catalogue through a port where nothing listens yet
    cluster.env["HEADATLAS_DB"] = cluster.db = f"{lake.url} host=127.0.0.1 port={forwarder.port}"
    try:
        cluster.start_writer()
        wait_for(lambda: "paused: lost the connection to the lake's catalogue" in _log(cluster), cluster, "pause")
        assert "Connection refused" in _log(cluster)
        from headatlas.workers.status import writer_pauses

        wait_for(lambda: writer_pauses(cluster.redis), cluster, "the pause said to status")
        status = invoke_cli("status", env=cluster.env)  # the catalogue is down for status too: it says why
        assert status.returncode != 0
        said = " ".join(status.stderr.split())
        assert "waiting for the lake's catalogue (Connection refused)" in said, said
        assert "lost the connection to the lake's catalogue" in said and "Traceback" not in said
        forwarder.start()
        took = _time_to_go_on(cluster)
        assert not writer_pauses(cluster.redis)
        cluster.start_worker()
        corpus = make_corpus(tmp_path, demo_corpus, paragraphs=1, tag="lakepgdown")
        run_id = _finish(cluster, _submit(cluster, corpus))
        _assert_rode_it_out(cluster, run_id, lake)
    finally:
        cluster.stop()  # before the forwarder: the writer's sessions end with it
        forwarder.stop()
    print(f"\nno PostgreSQL at the writer's start: it went on {took:.1f} s after one listened")


@pytest.fixture()
def small_data_path(lake, tmp_path, cluster, monkeypatch):
    """The lake's data path on a 20 MB tmpfs of its own (the lake's files copied there)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {made.stderr.decode().strip()}")
    try:
        data = mount / "lake-data"
        shutil.copytree(lake.data_path, data)
        cluster.env["HEADATLAS_DATA_PATH"] = str(data)
        monkeypatch.setenv("HEADATLAS_DATA_PATH", str(data))  # this process's reads too
        yield mount
    finally:
        cluster.stop()
        subprocess.run(["mount", "-o", "remount,rw", str(mount)], capture_output=True)
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(mount: Path) -> None:
    """Fill the tmpfs to its last block."""
    with open(mount / "filler", "wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\0" * 4096)
        except OSError:
            pass


def _status_warnings(cluster: Cluster) -> str:
    """`headatlas status` of the latest run: its warnings."""
    import json

    status = invoke_cli("status", "--format", "json", env=cluster.env)
    assert status.returncode == 0, status.stderr
    return " ".join(json.loads(status.stdout)["warnings"])


def test_a_full_data_path(cluster, lake, small_data_path, demo_corpus, tmp_path, monkeypatch):
    from headatlas.service.storage.backends import lake as lake_mod
    from headatlas.service.storage.backends import lake_compaction

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=1, copies=2, tag="lakefull")
    cluster.start_writer()
    run = _submit(cluster, corpus)  # the writer opened the run; no worker yet: nothing is stored
    _fill(small_data_path)
    cluster.start_worker()
    wait_for(lambda: "paused: the lake's data path" in _log(cluster), cluster, "pause")
    assert "No space left on device" in _log(cluster)
    said = _status_warnings(cluster)
    assert "waiting for the lake's data path" in said and "No space left on device" in said, said
    (small_data_path / "filler").unlink()
    took = _time_to_go_on(cluster)
    run_id = _finish(cluster, run)
    _assert_rode_it_out(cluster, run_id, lake)
    # the writer stores the run's results a moment after it says the run is done: files it is
    # writing then are not in the catalogue yet, and a removal of files of any age (below) would
    # count them as orphans (seen once under the whole suite: 4 more files than the log's count)
    wait_for(lambda: _results_stored(lake, small_data_path / "lake-data", run_id), cluster, "the run's results")
    # the failed writes' files: counted (log, status), and removed by `db compact`
    left = re.search(r"(\d+) uncatalogued data file\(s\) in the data path", _log(cluster))
    backend = lake_mod.LakeBackend(lake.url, data_path=small_data_path / "lake-data")
    orphans = backend.orphan_files()
    assert left is not None and int(left.group(1)) == len(orphans) > 0, cluster.logs()
    assert f"{len(orphans)} uncatalogued data file(s)" in _status_warnings(cluster)
    monkeypatch.setattr(lake_compaction, "ORPHAN_AGE_S", 0.0)
    assert backend.maintain()["orphans_removed"] == len(orphans)
    assert backend.orphan_files() == []
    assert_counted_once(lake.url, run_id)
    lake_mod.release(backend)
    print(f"\ndata path full: the writer went on {took:.1f} s after room was made ({len(orphans)} orphan file(s))")


def _results_stored(lake, data_path: Path, run_id: int) -> bool:
    from headatlas.service.storage import run_results
    from headatlas.service.storage.store import Store

    with Store(lake.url, data_path=data_path).checked_read() as conn:
        return run_results.is_fresh(conn, run_id)


def test_a_read_only_data_path(cluster, lake, small_data_path, demo_corpus, tmp_path):
    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=1, copies=2, tag="lakero")
    cluster.start_writer()
    run = _submit(cluster, corpus)  # the writer opened the run; no worker yet: nothing is stored
    remounted = subprocess.run(["mount", "-o", "remount,ro", str(small_data_path)], capture_output=True, text=True)
    assert remounted.returncode == 0, remounted.stderr
    cluster.start_worker()
    wait_for(lambda: "paused: the lake's data path" in _log(cluster), cluster, "pause")
    assert "Read-only file system" in _log(cluster)
    said = _status_warnings(cluster)
    assert "waiting for the lake's data path" in said and "Read-only file system" in said, said
    subprocess.run(["mount", "-o", "remount,rw", str(small_data_path)], check=True)
    took = _time_to_go_on(cluster)
    run_id = _finish(cluster, run)
    _assert_rode_it_out(cluster, run_id, lake)
    print(f"\ndata path read-only: the writer went on {took:.1f} s after the remount read-write")


def _time_to_go_on(cluster: Cluster) -> float:
    """Seconds from now (the fault just cleared) until the writer says it goes on."""
    cleared = time.monotonic()
    wait_for(lambda: "is back after" in _log(cluster), cluster, "the writer going on")
    return time.monotonic() - cleared


class StallingForwarder(Forwarder):
    """A ``Forwarder`` that, while stalled, accepts connections and never answers them (nor
    forwards a byte): a hung catalogue server, or a proxy that accepts and stalls."""

    stalled = False
    held: list[socket.socket]

    def _accept(self) -> None:
        assert self.listener is not None
        self.held = []
        while True:
            try:
                client, _addr = self.listener.accept()
            except OSError:
                return
            if self.stalled:
                self.held.append(client)  # accepted, then silence: no byte ever comes back
                continue
            server = socket.create_connection(self.target)
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def resume(self) -> None:
        self.stalled = False
        for s in self.held:
            s.close()
        self.held.clear()

    def stop(self) -> None:
        super().stop()
        for s in getattr(self, "held", []):
            s.close()


def test_a_catalogue_that_accepts_and_never_answers(cluster, lake, demo_corpus, tmp_path):
    """The catalogue's port accepts and then stays silent, at the writer's start and again
    mid-run (its sessions ended, every new one stalled in the startup handshake): each attach
    fails after libpq's connect_timeout (lake_catalogue.CATALOGUE_BOUNDS, 10 s) and the writer pauses,
    saying so, instead of waiting for ever; it goes on when the port answers again."""
    import lake_support

    from headatlas.service.storage.backends.lake_catalogue import CATALOGUE_BOUNDS

    bound = float(CATALOGUE_BOUNDS["connect_timeout"])
    forwarder = StallingForwarder(("127.0.0.1", 5432))
    forwarder.stalled = True
    forwarder.start()
    cluster.env["HEADATLAS_DB"] = cluster.db = f"{lake.url} host=127.0.0.1 port={forwarder.port}"
    paused = "paused: lost the connection to the lake's catalogue of"
    try:
        # 1. its first attach meets the silent port
        started = time.monotonic()
        cluster.start_writer()
        wait_for(lambda: "(timeout expired)" in _log(cluster), cluster, "the pause", timeout=bound + 30)
        first = time.monotonic() - started
        assert paused in _log(cluster), cluster.logs()
        forwarder.resume()
        took = _time_to_go_on(cluster)
        # 2. mid-run: the port stalls, the writer's sessions are ended, and every reconnect stalls
        corpus = make_corpus(tmp_path, demo_corpus, paragraphs=1, copies=2, tag="lakehang")
        run = _submit(cluster, corpus)  # the writer opened the run; no worker yet: nothing is stored
        said = _log(cluster).count("timeout expired")
        forwarder.stalled = True
        ended = lake_support._psql(
            f"SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = '{lake.name}' "
            "AND pid <> pg_backend_pid()"
        )
        assert ended.returncode == 0 and int(ended.stdout) > 0, ended.stderr
        stalled = time.monotonic()
        cluster.start_worker()  # its batches meet the dead sessions, then the silent port
        wait_for(lambda: _log(cluster).count("timeout expired") > said, cluster, "the pause", timeout=bound + 45)
        second = time.monotonic() - stalled
        forwarder.resume()
        run_id = _finish(cluster, run)
        _assert_rode_it_out(cluster, run_id, lake)
    finally:
        cluster.stop()  # before the forwarder: the writer's sessions end with it
        forwarder.stop()
    print(
        f"\na catalogue that accepts and never answers: the writer paused {first:.1f} s after its start, "
        f"{second:.1f} s after the mid-run stall, and went on {took:.1f} s after the port answered"
    )
