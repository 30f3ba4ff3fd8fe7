"""Run one unit of untrusted work (a user's SQL) in a child process whose memory and time are bounded.

DuckDB's ``memory_limit`` bounds its buffer manager only: a scalar value built outside it
(``len(range(0, 400000000))`` builds a 3.2 GB list, ``repeat('x', 4000000000))`` a 4 GB string)
grows the process past it, and a query that never checks for interruption (the same two) runs on
past ``interrupt()``. So the work runs in a child process:

- its address space is capped (``RLIMIT_AS``) at what it had when it started plus the memory limit
  plus a margin (``MARGIN_BYTES`` and ``THREAD_MARGIN_BYTES`` per DuckDB thread, for stacks and
  allocator arenas): an allocation past that fails inside the child (DuckDB: "Out of Memory Error …
  bad allocation"; Python: MemoryError), and a child that dies of it takes nothing else with it;
- the parent kills it (SIGKILL) ``KILL_GRACE_S`` after the time limit, when the child's own
  interruption has not ended the query by then; and the child is killed when its parent dies.

**Where the child comes from.** A child made by ``fork`` starts in milliseconds with everything
imported, but only the forking thread lives on in it: a lock another thread held at that moment
(DuckDB's worker threads, a notebook's cached lake connection, a Python thread inside an import or
a write) stays held in the child for ever, and the child can hang on it. So the calling process is
forked only while it runs one thread (``threads_now``). Any other caller — `headatlas sql` too:
importing ``duckdb`` starts the default connection's worker threads, importing ``numpy`` its BLAS
pool — hands the work to a **clean helper** (``_Zygote``): a process started once per caller with a
fresh interpreter, which imports the sandbox's modules, stops DuckDB's default worker threads
(``single_threaded``) and so runs one thread; it forks each child. The
work and its answer travel pickled (the work carries the caller's ``sys.path``, working directory
and environment). Where there is no ``fork`` or no enforced ``RLIMIT_AS`` (not Linux), the work
runs in the calling process with DuckDB's own limits only, and ``confinement()`` says so.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

MARGIN_BYTES = 256 * 2**20  # the interpreter's and DuckDB's own allocations beside the query's
THREAD_MARGIN_BYTES = 16 * 2**20  # a thread's stack and allocator arena, per DuckDB thread
KILL_GRACE_S = 1.0  # after the time limit, before the child is killed
HELPER_START_S = 60.0  # the longest a clean helper may take to start (a fresh interpreter's imports)
_STARTED, _CHECKED = b"S", b"C"  # the child's marks: its time limit begins; its input is checked
_RUN, _REAP, _READY, _FAILED = b"R", b"W", b"K", b"E"
_HEADER = struct.Struct("!cq")  # a request's kind and its length (run) or pid (reap)
# what the helper imports before its first child, so that no child imports them again (SQLAlchemy,
# which the backends import, took 2.8 s on a loaded machine)
_PRELOAD = (
    "headatlas.service.storage.readonly",
    "headatlas.service.storage.backends.file",
    "headatlas.service.storage.backends.lake",
)
_WARM = "headatlas.service.storage.sql_check"  # whose warm() the helper calls once


class ChildFailed(Exception):
    """The child ended without an answer: killed at its deadline (``timed_out``) or died (out of
    memory, a crash), while checking its input, setting up or running (``stage``)."""

    def __init__(self, message: str, *, timed_out: bool = False, stage: str = "run") -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.stage = stage  # check (the work's input), setup or run


def confinement() -> str | None:
    """Why work cannot be confined in a child process here, or None when it can."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return f"{sys.platform} has no enforced address-space limit for a forked child"
    return None


def address_space_now() -> int:
    """This process's virtual size in bytes (what ``RLIMIT_AS`` counts)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def threads_now() -> int:
    """How many threads this process runs now, native ones (DuckDB's) included."""
    return len(os.listdir("/proc/self/task"))


def single_threaded() -> bool:
    """Stop the worker threads of DuckDB's default connection (made when ``duckdb`` is imported),
    so that a process with no other thread forks its children directly. For a process of our own
    (the clean helper, a script), never a caller's: it changes the default connection's ``threads``.
    Whether the process now runs one thread."""
    import duckdb

    duckdb.execute("SET threads = 1")
    return threads_now() == 1


def run_confined(
    work: Callable[[Marks], T],
    *,
    memory_bytes: int | None,
    threads: int,
    timeout_s: float,
    setup_s: float,
    check_s: float | None = None,
    check_bytes: int | None = None,
) -> T:
    """``work(marks)`` in a child process; its return value (or the exception it raised) here.

    ``work`` calls ``marks()`` when its time limit begins (after connecting and waiting out locks,
    which ``setup_s`` bounds). With ``check_s``, the work first checks its input, bounded on its
    own: ``check_s`` seconds and ``check_bytes`` of growth (a statement's inspection, whose cost the
    statement's author chooses), and calls ``marks.checked()`` when done; the setup's time starts
    then. The child's growth is capped at ``memory_bytes`` plus the margins (None: uncapped); it is
    killed ``timeout_s + KILL_GRACE_S`` after ``marks()``. The value and any exception must pickle,
    and so must ``work`` unless this process runs one thread (then it is forked). Raises
    ChildFailed when no answer came back (its ``stage`` says when: check, setup or run).
    """
    if confinement() is not None:
        return work(Marks())
    # the child's temporary files (a spill folder, a lake's catalogue copy) go in a folder of its
    # own, removed here once it has ended: a child killed at its limits cleans nothing up itself
    scratch = tempfile.mkdtemp(prefix="headatlas-sql-")
    try:
        limits = _Limits(memory_bytes, threads, check_bytes if check_s is not None else None, scratch)
        read_end, write_end = os.pipe()
        try:
            if threads_now() == 1:
                child: _Child = _fork(work, write_end, limits)
            else:
                child = _zygote().start(work, write_end, limits)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        try:
            return _await(child, read_end, timeout_s=timeout_s, setup_s=setup_s, check_s=check_s)
        finally:
            os.close(read_end)
            child.end()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@dataclass(frozen=True)
class _Limits:
    """What the child caps itself at: its growth (``memory``, None: uncapped), DuckDB's threads
    (their margin), and the growth its input's check may take before ``Marks.checked``."""

    memory: int | None
    threads: int
    check: int | None = None
    scratch: str | None = None  # the child's temporary folder (TMPDIR), its parent's to remove


class Marks:
    """What the work tells its parent, and what it may use: ``marks()`` when its time limit begins,
    ``marks.checked()`` when its input is checked (lifting the check's own memory bound);
    ``memory_bytes``: the growth its address space may take now (None: unbounded or not confined)."""

    def __init__(self, out: int | None = None, full: tuple[int, int] | None = None, memory: int | None = None) -> None:
        self._out = out
        self._full = full  # RLIMIT_AS (soft, hard) once checked
        self.memory_bytes = memory

    def __call__(self) -> None:
        if self._out is not None:
            os.write(self._out, _STARTED)

    def checked(self) -> None:
        if self._full is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, self._full)
            self._full = None
        if self._out is not None:
            os.write(self._out, _CHECKED)


# --- the child ---------------------------------------------------------------------------------


def _child(work: Callable[[Marks], T], out: int, limits: _Limits) -> None:
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the parent handles Ctrl-C and kills the child
        _die_with_parent()
        if limits.scratch is not None:
            tempfile.tempdir = os.environ["TMPDIR"] = limits.scratch
        marks = Marks(out)
        if limits.memory is not None:
            marks = _cap(out, limits)
        try:
            answer: tuple[str, object] = ("value", work(marks))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            answer = ("error", exc)
        pipe = _Pipe(out)
        try:
            # written to the pipe frame by frame as it is pickled: a large answer is not copied whole
            # beside its rows under the address-space cap (a 500 MB one often did not fit so)
            pickle.dump(answer, pipe, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - a value or error that does not pickle
            if pipe.written:  # part of it sent: the parent finds it unreadable and says the child failed
                raise
            pipe.write(pickle.dumps(("error", RuntimeError(f"the answer could not be returned ({exc})"))))
    except MemoryError:
        code = 3
    except BaseException:  # noqa: BLE001 - the parent reports a child that ended without an answer
        code = 4
    finally:
        os._exit(code)  # no atexit handlers, no flushing of the parent's buffers


class _Pipe:
    """The answer's pipe as a file for ``pickle.dump``: every byte written, however many writes."""

    def __init__(self, fd: int):
        self.fd, self.written = fd, 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            sent = os.write(self.fd, view)
            self.written += sent
            view = view[sent:]
        return size


def _cap(out: int, limits: _Limits) -> Marks:
    """Cap this process's address space (``RLIMIT_AS``): at its size now plus the memory and the
    margins, and until its input is checked at its size now plus ``limits.check`` and the margin;
    never above the limit it inherited (a shell's ``ulimit -v``: a hard limit cannot be raised),
    the memory then being what is left under it (``Marks.memory_bytes``)."""
    import resource

    assert limits.memory is not None
    _few_arenas()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    ceiling = min(x for x in (soft, hard, 2**62) if x != resource.RLIM_INFINITY)
    now = address_space_now()
    margin = MARGIN_BYTES + THREAD_MARGIN_BYTES * max(1, limits.threads)
    full = min(now + limits.memory + margin, ceiling)
    memory = max(0, full - now - margin)
    resource.setrlimit(resource.RLIMIT_AS, (full, hard))
    if limits.check is None:
        return Marks(out, memory=memory)
    resource.setrlimit(resource.RLIMIT_AS, (min(full, now + limits.check + MARGIN_BYTES), hard))
    return Marks(out, (full, hard), memory=memory)


def _few_arenas() -> None:
    """At most two malloc arenas for threads from now on: glibc reserves 64 MB of address space for
    each (up to 8 per core), which the address-space cap counts although nothing uses it; loading
    DuckLake made 16 of them on 2 cores (1 GB)."""
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``): a query whose caller
    is gone has no deadline left to be killed at."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(5)


# --- how the parent sees a child ------------------------------------------------------------------


_LAST = threading.local()


def last_peak_bytes() -> int | None:
    """The peak resident memory of the last child this thread's ``run_confined`` ended (its
    ``ru_maxrss``), or None: for benchmarks and tests of the memory bound."""
    return getattr(_LAST, "peak", None)


@dataclass
class _Child:
    """A started child: ``exit_code()`` waits for its end (negative: the signal that ended it);
    ``end()`` kills it if it still runs and reaps it. Either records its peak resident memory."""

    pid: int
    code: int | None = None

    def exit_code(self) -> int:
        if self.code is None:
            self.code, peak_kb = self._wait()
            _LAST.peak = peak_kb * 1024
        return self.code

    def end(self) -> None:
        if self.code is not None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)  # unreaped, its pid cannot be another process's yet
        except ProcessLookupError:
            pass
        try:
            self.exit_code()
        except OSError:
            pass  # its helper is gone: its children went with it (PR_SET_PDEATHSIG)

    def _wait(self) -> tuple[int, int]:
        """(exit code, peak resident memory in KiB), once it has ended."""
        raise NotImplementedError


@dataclass
class _Forked(_Child):
    def _wait(self) -> tuple[int, int]:
        try:
            _pid, status, usage = os.wait4(self.pid, 0)
        except ChildProcessError:
            return 0, 0
        return os.waitstatus_to_exitcode(status), usage.ru_maxrss


def _fork(work: Callable, out: int, limits: _Limits) -> _Child:
    pid = os.fork()
    if pid == 0:  # the child: never returns
        _child(work, out, limits)
    return _Forked(pid)


@dataclass
class _Helped(_Child):
    """A child of the clean helper, which reaps it and reports how it ended."""

    zygote: _Zygote | None = None

    def _wait(self) -> tuple[int, int]:
        assert self.zygote is not None
        return self.zygote.reap(self.pid)


# --- the clean helper ---------------------------------------------------------------------------


class _Zygote:
    """A single-threaded process that forks the children of a multi-threaded caller (module
    docstring). Requests over a Unix socket: run (the work pickled, the answer pipe passed as a
    file descriptor; answered with the child's pid) and reap (a pid; answered with its exit code
    and peak resident memory)."""

    def __init__(self) -> None:
        parent, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in sys.path if p)}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import _zygote_main; _zygote_main({mine.fileno()})"],
                pass_fds=(mine.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
                # a session of its own: the terminal's Ctrl-C goes to the caller alone, never to a
                # helper still starting (before it ignores SIGINT) nor to the query's process
                start_new_session=True,
            )
        finally:
            mine.close()
        self.socket = parent
        self.owner = os.getpid()
        self.lock = threading.Lock()
        self.ready = False

    def wait_ready(self) -> None:
        """Wait until the helper has imported what its children need (HELPER_START_S at most)."""
        if self.ready:
            return
        self.socket.settimeout(HELPER_START_S)
        try:
            answer = _recv_exactly(self.socket, 1)
            why = "it ended"
            if answer == _FAILED:
                why = self.socket.recv(1024).decode(errors="replace") or why
        except OSError as exc:
            answer, why = b"", str(exc) or type(exc).__name__
        self.socket.settimeout(None)
        if answer != _READY:
            self.close()
            raise ChildFailed(f"the query's helper process did not start ({why}; {sys.executable})")
        self.ready = True

    def start(self, work: Callable, out: int, limits: _Limits) -> _Child:
        payload = pickle.dumps(
            (sys.path, os.getcwd(), dict(os.environ), limits, pickle.dumps(work)),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        try:
            with self.lock:
                socket.send_fds(self.socket, [_HEADER.pack(_RUN, len(payload))], [out])
                self.socket.sendall(payload)
                (pid,) = struct.unpack("!q", _recv_exactly(self.socket, 8))
        except OSError as exc:
            raise ChildFailed(f"the query's helper process ended ({exc}); run the query again") from None
        return _Helped(pid, zygote=self)

    def reap(self, pid: int) -> tuple[int, int]:
        """(exit code, peak resident memory in KiB) of the helper's child ``pid``, once it ended."""
        with self.lock:
            self.socket.sendall(_HEADER.pack(_REAP, pid))
            code, peak = struct.unpack("!qq", _recv_exactly(self.socket, 16))
        return code, peak

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.process.poll() is None

    def close(self) -> None:
        self.socket.close()
        if self.owner == os.getpid() and self.process.returncode is None:
            if not self.ready:  # still starting, no child of its own: nothing to wait for
                self.process.kill()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def _zygote(*, wait: bool = True) -> _Zygote:
    """This process's clean helper, started on first use (again after it died, or in a forked copy
    of this process, which must not share its parent's); ``wait``: until it is ready."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is not None and not _ZYGOTE.alive():
            if _ZYGOTE.owner == os.getpid():
                _ZYGOTE.close()
            _ZYGOTE = None
        if _ZYGOTE is None:
            _ZYGOTE = _Zygote()
            atexit.register(_ZYGOTE.close)  # its socket closed, it ends; waited for, not left behind
        helper = _ZYGOTE
        if wait:
            try:
                helper.wait_ready()
            except ChildFailed:
                _ZYGOTE = None
                raise
        return helper


def prepare() -> None:
    """Start the clean helper now, without waiting for it, when this process will need one (it
    runs other threads): `headatlas sql` overlaps the helper's start with its own parsing and
    inspection."""
    if confinement() is None and threads_now() > 1:
        _zygote(wait=False)


def _zygote_main(fd: int) -> None:
    """The clean helper's loop: one thread, for ever, until its caller closes the socket. It never
    prints: a caller gone (at any moment, even before the helper is ready), a child that fails and
    Ctrl-C end it quietly; what went wrong before it was ready goes back to its caller in one line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is its caller's to handle
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os._exit(0)
    try:
        _serve(sock)
    except BaseException:  # noqa: BLE001 - its caller is gone (a broken pipe): nobody to tell
        pass
    os._exit(0)


def _serve(sock: socket.socket) -> None:
    # no PR_SET_PDEATHSIG here: it follows the caller's thread that started the helper, which may
    # end long before the caller; the helper ends when the caller's socket closes (it exits)
    try:
        import importlib

        for module in _PRELOAD:  # the children start with the sandbox imported
            importlib.import_module(module)
        importlib.import_module(_WARM).warm()  # and DuckDB's names known to the inspection
        single_threaded()  # and this process runs one thread (tests/test_sandbox_escapes.py checks it)
    except Exception as exc:  # noqa: BLE001 - told to the caller, in one line
        sock.sendall(_FAILED + f"{type(exc).__name__}: {exc}".splitlines()[0].encode()[:500])
        return
    sock.sendall(_READY)
    while True:
        header, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 1)
        if len(header) < _HEADER.size:
            return  # the caller is gone
        kind, value = _HEADER.unpack(header)
        if kind == _REAP:
            try:
                _pid, status, usage = os.wait4(value, 0)
                code, peak = os.waitstatus_to_exitcode(status), usage.ru_maxrss
            except ChildProcessError:
                code, peak = 0, 0
            sock.sendall(struct.pack("!qq", code, peak))
            continue
        payload = _recv_exactly(sock, value)
        out = fds[0]
        pid = os.fork()
        if pid == 0:
            _helped_child(sock, payload, out)  # never returns
        os.close(out)
        sock.sendall(struct.pack("!q", pid))


def _helped_child(sock: socket.socket, payload: bytes, out: int) -> None:
    """A child of the clean helper: its caller's context restored, the work run; never returns."""
    try:
        sock.close()
        path, cwd, environ, limits, work = pickle.loads(payload)  # noqa: S301 - our caller's
        sys.path[:] = path
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        try:
            job = pickle.loads(work)  # noqa: S301 - our caller's own work, over our own socket
        except BaseException as exc:  # noqa: BLE001 - an unpicklable job is an answer too
            job = _Raise(exc)
        _child(job, out, limits)
    finally:
        os._exit(4)  # _child never returns; anything that failed before it ends here, silently


@dataclass
class _Raise:
    """A job that could not be unpickled in the child: its error, as the child's answer."""

    error: BaseException

    def __call__(self, marks: Marks) -> None:
        raise RuntimeError(f"the query could not be handed to its process ({self.error})")


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        data = sock.recv(min(left, 1 << 20))
        if not data:
            raise OSError("the helper process ended")
        chunks.append(data)
        left -= len(data)
    return b"".join(chunks)


# --- the parent's wait --------------------------------------------------------------------------


def _await(child: _Child, fd: int, *, timeout_s: float, setup_s: float, check_s: float | None = None) -> T:  # type: ignore[type-var]
    chunks: list[bytes] = []
    stage = "check" if check_s is not None else "setup"
    deadline = time.monotonic() + (check_s if check_s is not None else setup_s)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChildFailed(_late(stage, timeout_s, setup_s, check_s), timed_out=True, stage=stage)
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        data = os.read(fd, 1 << 20)
        if not data:
            break
        while not chunks and data[:1] in (_CHECKED, _STARTED):  # the marks come before the answer
            if data[:1] == _CHECKED and stage == "check":
                stage, deadline = "setup", time.monotonic() + setup_s
            elif data[:1] == _STARTED and stage != "run":
                stage, deadline = "run", time.monotonic() + timeout_s + KILL_GRACE_S
            data = data[1:]
        if data:
            chunks.append(data)
    payload = b"".join(chunks)
    if not payload:
        raise ChildFailed(_death(child.exit_code()), stage=stage)
    try:
        kind, value = pickle.loads(payload)  # noqa: S301 - our own child's answer, over our own pipe
    except Exception:  # noqa: BLE001 - cut short: the child failed while sending it
        raise ChildFailed(_death(child.exit_code()), stage=stage) from None
    if kind == "error":
        raise value
    return value


def _late(stage: str, timeout_s: float, setup_s: float, check_s: float | None) -> str:
    if stage == "check":
        return f"checking it took more than {check_s:g} s"
    if stage == "setup":
        return f"the query did not start within {setup_s:g} s"
    return f"query stopped after {timeout_s:g} s (time limit)"


def _death(code: int) -> str:
    """What ended a child that sent no answer, from its exit code (negative: a signal)."""
    if code < 0:
        if -code == signal.SIGKILL:
            return "the query's process was killed (out of memory?)"
        return f"the query's process died ({signal.Signals(-code).name}), most likely out of memory"
    if code == 3:
        return "the query ran out of memory"
    return f"the query's process ended without an answer (exit code {code})"
