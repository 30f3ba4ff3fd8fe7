"""The background producer and sink keep order, bound memory and pass errors on."""

from __future__ import annotations

import threading
import time

import pytest

from headatlas.service.engine.prefetch import BackgroundSink, Prefetcher


def test_prefetcher_keeps_order_and_stays_bounded():
    produced = []

    def source():
        for i in range(20):
            produced.append(i)
            yield i

    seen = []
    for item in Prefetcher(source(), depth=2):
        time.sleep(0.002)
        # the producer is never more than depth + 1 items ahead of the consumer
        assert len(produced) - len(seen) <= 4
        seen.append(item)
    assert seen == list(range(20))


def test_prefetcher_reraises_the_producer_error():
    def source():
        yield 1
        raise ValueError("bad line 7")

    with pytest.raises(ValueError, match="bad line 7"):
        list(Prefetcher(source()))


def test_prefetcher_stops_its_thread_when_the_consumer_leaves_early():
    before = threading.active_count()
    for item in Prefetcher(iter(range(1000)), depth=1):
        if item == 3:
            break
    deadline = time.time() + 2
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_sink_consumes_in_order_and_reports_errors():
    got = []
    sink = BackgroundSink(got.append)
    for i in range(10):
        sink.submit(i)
    sink.close()
    assert got == list(range(10))

    def fail(item):
        raise RuntimeError(f"disk full at {item}")

    sink = BackgroundSink(fail)
    sink.submit(1)
    with pytest.raises(RuntimeError, match="disk full at 1"):
        sink.close()
