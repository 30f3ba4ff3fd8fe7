"""Overlap CPU work with the forward pass: a bounded background producer and a background sink.

Tokenisation and collation run one or two batches ahead of the model; storing results runs
behind it. Both use one daemon thread and a bounded queue, so memory stays flat, and both
re-raise the thread's exception in the caller.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_DONE = object()


class Prefetcher(Generic[T]):
    """Iterate ``source`` in a background thread, at most ``depth`` items ahead."""

    def __init__(self, source: Iterable[T], *, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iter(source),), daemon=True, name="prefetch")
        self._thread.start()

    def _run(self, items: Iterator[T]) -> None:
        try:
            for item in items:
                while not self._stop.is_set():
                    try:
                        self._queue.put((True, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put((True, _DONE))
        except BaseException as exc:  # handed to the consumer
            self._queue.put((False, exc))

    def __iter__(self) -> Iterator[T]:
        try:
            while True:
                ok, item = self._queue.get()
                if not ok:
                    raise item
                if item is _DONE:
                    return
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)


class BackgroundSink(Generic[T]):
    """Call ``consume(item)`` for each submitted item in one background thread, in order.

    ``submit`` blocks when ``depth`` items are waiting; ``close`` waits for the rest and
    re-raises the first error.
    """

    def __init__(self, consume: Callable[[T], object], *, depth: int = 2):
        self._consume = consume
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="sink")
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if self._error is None:
                try:
                    self._consume(item)
                except BaseException as exc:
                    self._error = exc

    def submit(self, item: T) -> None:
        self.raise_error()
        self._queue.put(item)

    def waiting(self) -> int:
        """Items submitted and not yet taken by the consumer."""
        return self._queue.qsize()

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._queue.put(_DONE)
        self._thread.join()
        self.raise_error()
