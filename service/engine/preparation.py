"""Preparing windows in worker processes: a corpus's documents tokenised, segmented into sentences
and cut into windows by a pool of processes, their windows handed back in corpus order.

One process prepares about 1,500 windows/s with the sentence segmenter (syntok, pure Python,
takes three quarters of it) and about 5,000 under ``--sentences punct``; a GPU analyses tens of
thousands a second. The pool splits the corpus by documents (a task holds whole documents, about
``TASK_CHARS`` characters of them), keeps at most ``AHEAD`` tasks per process in flight (memory
stays flat), and yields each document's windows in the order the corpus holds them: the same
windows, with the same ids, as one process makes (tests/test_preparation.py). The caller collates
them into batches (a few microseconds a window). A document longer than ``INLINE_CHARS`` is
windowed in the calling process, slice by slice, as without a pool (its windows would otherwise
travel whole).

The processes are forked from the caller (they share its tokenizer without pickling it), ignore
Ctrl-C (the caller stops them) and never touch torch or a GPU.
"""

from __future__ import annotations

import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from headatlas.service.engine.windows import TokenClasses, Window, iter_document_windows
from headatlas.service.errors import PreparationError
from headatlas.service.params import AnalysisParams

if TYPE_CHECKING:
    from multiprocessing.pool import AsyncResult

    from headatlas.service.engine.corpus import Document

TASK_CHARS = 1 << 16  # characters of documents per task (a task holds at least one document)
AHEAD = 4  # tasks in flight per process
INLINE_CHARS = 1 << 22  # a longer document is windowed in the calling process, streaming
WAIT_S = 1.0  # how often a caller waiting for windows checks that the processes are still there
CLOSE_GRACE_S = 5.0  # how long a process has to answer SIGTERM on close before it is killed

# what a forked process prepares with (set by _start in the child)
_WORK: tuple | None = None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def preparation_processes(requested: int, *, model_threads: int | None) -> int:
    """How many processes prepare windows. ``requested`` ≥ 1: that many (1: the calling process,
    as before there were pools; always 1 where processes cannot be forked); 0: automatic, the cores left beside the model, where at least two
    are left, else 1. ``model_threads``: the cores the model's process keeps busy (its torch threads
    on a CPU; about 2 beside a GPU: the thread feeding it and the one storing); None where there is
    no model (``submit``): every core."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():  # the pool forks (Windows has no fork)
        return 1
    if requested >= 1:
        return requested
    left = usable_cores() - (model_threads or 0)
    return left if left >= 2 else 1


class WindowPool:
    """Processes that turn documents into windows (``windows``); a context manager, or ``close``."""

    def __init__(
        self,
        processes: int,
        tokenizer,
        tokens: TokenClasses,
        tokenizer_key: str,
        params: AnalysisParams,
        *,
        task_chars: int = TASK_CHARS,
        inline_chars: int = INLINE_CHARS,
    ):
        import multiprocessing

        self.processes = processes
        self.task_chars = task_chars
        self.inline_chars = inline_chars
        self._work = (tokenizer, tokens, tokenizer_key, params)
        self._pool = multiprocessing.get_context("fork").Pool(processes, initializer=_start, initargs=self._work)
        self._started = list(getattr(self._pool, "_pool", ()))  # the processes (a pool never ends one itself)

    def windows(self, docs: Iterable[tuple[Document, int]]) -> Iterator[tuple[Document, int, Iterable[Window]]]:
        """``(document, n, its windows)`` for each ``(document, n)`` of ``docs``, in order; ``n``
        is the caller's (e.g. the corpus characters read up to the document)."""
        pending: deque[tuple[list[tuple[Document, int]], AsyncResult]] = deque()
        chunk: list[tuple[Document, int]] = []
        size = 0

        def send() -> None:
            nonlocal chunk, size
            if chunk:
                pending.append((chunk, self._pool.apply_async(_prepare, ([d for d, _ in chunk],))))
                chunk, size = [], 0

        def take() -> Iterator[tuple[Document, int, Iterable[Window]]]:
            sent, result = pending.popleft()
            while not result.ready():  # a process killed with its task in hand never answers
                result.wait(WAIT_S)
                self._check_processes()
            ok, out = result.get()
            if not ok:
                raise out
            for (doc, n), windows in zip(sent, out):
                yield doc, n, windows

        for doc, n in docs:
            if len(doc.text) > self.inline_chars:
                send()
                while pending:
                    yield from take()
                tokenizer, tokens, key, params = self._work
                yield doc, n, iter_document_windows(doc, tokenizer, tokens, key, params)
                continue
            chunk.append((doc, n))
            size += len(doc.text)
            if size >= self.task_chars:
                send()
                if len(pending) >= AHEAD * self.processes:
                    yield from take()
        send()
        while pending:
            yield from take()

    def _check_processes(self) -> None:
        """Raise if one of the pool's processes has ended (the pool replaces it, but a task it
        held is lost, and the caller waited for its windows forever)."""
        for process in self._started:
            if process.exitcode is not None:
                how = f"signal {-process.exitcode}" if process.exitcode < 0 else f"exit code {process.exitcode}"
                why = " (SIGKILL: out of memory?)" if process.exitcode == -9 else ""
                raise PreparationError(
                    f"a process preparing windows ended ({how}{why})",
                    hint="re-run the same command to resume (HEADATLAS_PREPARE_PROCESSES=1 prepares them in the run's own process)",
                )

    def close(self) -> None:
        """Stop the processes: SIGTERM, and SIGKILL for any still there after ``CLOSE_GRACE_S``.
        A process forked while another thread of the caller held a lock (the beat fires schedules
        in threads, each submission with a pool of its own) can stick in its fork before it sets
        its signals, where the caller's SIGTERM handler (the beat's) keeps it alive: the pool's
        terminate() then joined it forever, and the beat's fire never finished. A process killed
        while it waited for a task keeps the task queue's lock, which terminate() waited for: it is
        released here. The processes hold nothing to keep."""
        import threading

        workers = list(getattr(self._pool, "_pool", ()))
        # a process that ended on its own (killed) may have held the task queue's lock, which the
        # pool's terminate() takes: it would wait for it for ever
        lost = any(process.exitcode is not None for process in self._started)
        stopping = threading.Thread(target=self._pool.terminate, name="window-pool-stop", daemon=True)
        stopping.start()
        stopping.join(0.5 if lost else CLOSE_GRACE_S)
        if stopping.is_alive():
            for worker in workers:
                if worker.is_alive():
                    worker.kill()
            while stopping.is_alive():
                stopping.join(0.5)
                self._free_task_lock()
        self._pool.join()

    def _free_task_lock(self) -> None:
        """Release the task queue's lock that a process killed while waiting for a task held (every
        process is gone by now; a lock already free says so, and is left)."""
        lock = getattr(getattr(self._pool, "_inqueue", None), "_rlock", None)
        if lock is not None:
            try:
                lock.release()
            except ValueError:  # not held
                pass

    def __enter__(self) -> WindowPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _start(tokenizer, tokens: TokenClasses, tokenizer_key: str, params: AnalysisParams) -> None:
    global _WORK
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's: it stops the pool
    # the pool stops its processes with SIGTERM: a handler the caller set (the beat's, which only
    # notes that it should stop) is not theirs; inherited, it kept a process alive and the
    # caller's close() waited for it forever
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # the Rust tokenizer's own threads do not survive a fork; say so to it (no warning per process)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORK = (tokenizer, tokens, tokenizer_key, params)


def _prepare(docs: list[Document]) -> tuple[bool, object]:
    """(True, [windows of each document]) or (False, the error) — an error that pickles."""
    assert _WORK is not None  # set by _start
    tokenizer, tokens, key, params = _WORK
    try:
        return True, [list(iter_document_windows(doc, tokenizer, tokens, key, params)) for doc in docs]
    except Exception as exc:  # handed to the caller, which raises it
        import pickle

        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return False, exc
