"""Run one unit of untrusted work (a user's SQL) in a child process whose memory and time are bounded.

DuckDB's ``memory_limit`` bounds its buffer manager only: a scalar value built outside it
(``len(range(0, 400000000))`` builds a 3.2 GB list, ``repeat('x', 4000000000))`` a 4 GB string)
grows the process past it, and a query that never checks for interruption (the same two) runs on
past ``interrupt()``. So the work runs in a forked child:

- its address space is capped (``RLIMIT_AS``) at what it had when forked plus the memory limit plus
  a margin (``MARGIN_BYTES`` and ``THREAD_MARGIN_BYTES`` per DuckDB thread, for stacks and allocator
  arenas): an allocation past that fails inside the child (DuckDB: "Out of Memory Error … bad
  allocation"; Python: MemoryError), and a child that dies of it takes nothing else with it;
- the parent kills it (SIGKILL) ``KILL_GRACE_S`` after the time limit, when the child's own
  interruption has not ended the query by then.

The child is made by ``fork``: it starts in milliseconds with everything imported, and touches only
objects it creates itself (a fresh DuckDB connection). Where there is no ``fork`` or no enforced
``RLIMIT_AS`` (not Linux), the work runs in the calling process with DuckDB's own limits only, and
``confinement()`` says so.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MARGIN_BYTES = 256 * 2**20  # the interpreter's and DuckDB's own allocations beside the query's
THREAD_MARGIN_BYTES = 16 * 2**20  # a thread's stack and allocator arena, per DuckDB thread
KILL_GRACE_S = 1.0  # after the time limit, before the child is killed
_STARTED = b"S"


class ChildFailed(Exception):
    """The child ended without an answer: killed at its deadline (``timed_out``) or died (out of
    memory, a crash)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def confinement() -> str | None:
    """Why work cannot be confined in a child process here, or None when it can."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return f"{sys.platform} has no enforced address-space limit for a forked child"
    return None


def address_space_now() -> int:
    """This process's virtual size in bytes (what ``RLIMIT_AS`` counts)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def run_confined(
    work: Callable[[Callable[[], None]], T],
    *,
    memory_bytes: int | None,
    threads: int,
    timeout_s: float,
    setup_s: float,
) -> T:
    """``work(started)`` in a child process; its return value (or the exception it raised) here.

    ``work`` calls ``started()`` when its time limit begins (after connecting and waiting out
    locks, which ``setup_s`` bounds). The child's growth is capped at ``memory_bytes`` plus the
    margins (None: uncapped); it is killed ``timeout_s + KILL_GRACE_S`` after ``started()``. The
    value and any exception must pickle. Raises ChildFailed when no answer came back.
    """
    if confinement() is not None:
        return work(lambda: None)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _child(work, write_end, memory_bytes, threads)
    os.close(write_end)
    try:
        return _await(pid, read_end, timeout_s=timeout_s, setup_s=setup_s)
    finally:
        os.close(read_end)
        _reap(pid)


def _child(work: Callable[[Callable[[], None]], T], out: int, memory_bytes: int | None, threads: int) -> None:
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the parent handles Ctrl-C and kills the child
        if memory_bytes is not None:
            import resource

            cap = address_space_now() + memory_bytes + MARGIN_BYTES + THREAD_MARGIN_BYTES * max(1, threads)
            resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))

        def started() -> None:
            os.write(out, _STARTED)

        try:
            answer: tuple[str, object] = ("value", work(started))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            answer = ("error", exc)
        try:
            data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - a value or error that does not pickle
            data = pickle.dumps(("error", RuntimeError(f"the answer could not be returned ({exc})")))
        view = memoryview(data)
        while view:
            view = view[os.write(out, view) :]
    except MemoryError:
        code = 3
    except BaseException:  # noqa: BLE001 - the parent reports a child that ended without an answer
        code = 4
    finally:
        os._exit(code)  # no atexit handlers, no flushing of the parent's buffers


def _await(pid: int, fd: int, *, timeout_s: float, setup_s: float) -> T:  # type: ignore[type-var]
    chunks: list[bytes] = []
    started_at: float | None = None
    setup_deadline = time.monotonic() + setup_s
    while True:
        now = time.monotonic()
        if started_at is None:
            left = setup_deadline - now
            if left <= 0:
                raise ChildFailed(f"the query did not start within {setup_s:g} s", timed_out=True)
        else:
            left = started_at + timeout_s + KILL_GRACE_S - now
            if left <= 0:
                raise ChildFailed(f"query stopped after {timeout_s:g} s (time limit)", timed_out=True)
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        data = os.read(fd, 1 << 20)
        if not data:
            break
        if started_at is None and not chunks and data[:1] == _STARTED:
            started_at = time.monotonic()
            data = data[1:]
        chunks.append(data)
    payload = b"".join(chunks)
    if not payload:
        raise ChildFailed(_death(pid))
    kind, value = pickle.loads(payload)  # noqa: S301 - our own child's answer, over our own pipe
    if kind == "error":
        raise value
    return value


def _death(pid: int) -> str:
    """What ended a child that sent no answer."""
    try:
        _pid, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "the query's process ended without an answer"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGKILL:
            return "the query's process was killed (out of memory?)"
        return f"the query's process died ({signal.Signals(sig).name}), most likely out of memory"
    code = os.WEXITSTATUS(status)
    if code == 3:
        return "the query ran out of memory"
    return f"the query's process ended without an answer (exit code {code})"


def _reap(pid: int) -> None:
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except (ChildProcessError, ProcessLookupError):
        pass
