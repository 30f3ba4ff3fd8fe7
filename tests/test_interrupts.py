"""A Ctrl-C that Python drops still stops the command (service/interrupts.py).

The interpreter raises a Ctrl-C's KeyboardInterrupt in whatever the main thread runs; inside a
destructor it prints "Exception ignored in ..." and drops it. `analyze` on a 50 MB corpus once
went on for minutes after Ctrl-C that way (the signal landed as syntok's import freed compiled
regexes). Here the signal is raised inside a destructor on purpose."""

from __future__ import annotations

import signal
import sys
import threading

import pytest

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signal handlers are set on the main thread"
)


class _PressedWhileFreed:
    """Raises SIGINT in this process as it is freed: the interrupt lands inside ``__del__``."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


def _drop_a_ctrl_c() -> None:
    _PressedWhileFreed()  # freed at once: its destructor's KeyboardInterrupt is dropped


def test_python_drops_an_interrupt_raised_in_a_destructor(monkeypatch):
    """The premise: no KeyboardInterrupt comes out, only a report (on stderr, by default)."""
    reported: list[type] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_type))
    _drop_a_ctrl_c()
    assert reported == [KeyboardInterrupt]


def test_a_dropped_interrupt_is_raised_again_once_and_not_reported(monkeypatch):
    from headatlas.service.interrupts import sigint_seen, stop_if_pressed

    reported: list[type] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_type))

    stop_if_pressed()  # nothing pressed, nothing watched: goes on
    with sigint_seen() as pressed:
        stop_if_pressed()  # nothing pressed yet
        _drop_a_ctrl_c()
        assert pressed()
        with pytest.raises(KeyboardInterrupt):
            stop_if_pressed()
        stop_if_pressed()  # said once: the same press does not stop the clean-up that follows
        _drop_a_ctrl_c()
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            stop_if_pressed()  # an interrupt being handled is not raised over
    assert reported == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back


def test_a_press_dropped_before_an_inner_watch_began_is_raised_within_it(monkeypatch):
    """The command's watch (cli/app.py) notes a press dropped as plugins load; the analysis's own
    watch begins after it: the next batch still stops."""
    from headatlas.service.interrupts import sigint_seen, stop_if_pressed

    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    with sigint_seen():
        _drop_a_ctrl_c()
        with sigint_seen() as inner:
            assert not inner()
            with pytest.raises(KeyboardInterrupt):
                stop_if_pressed()
            stop_if_pressed()  # said once


def test_analyze_stops_at_the_next_batch_after_a_dropped_ctrl_c(tmp_path, small_corpus, tiny_model):
    """The press lands in a destructor as the second batch's progress is shown: the run ends
    interrupted with the two batches it finished stored, not with the whole corpus."""
    from headatlas.service.operations.analysis import analyze
    from headatlas.service.operations.events import Progress
    from headatlas.service.operations.requests import AnalysisRequest
    from headatlas.service.statuses import RunStatus
    from headatlas.service.storage.store import Store

    db = tmp_path / "runs.duckdb"
    request = AnalysisRequest.build(small_corpus, db=db, model=tiny_model, batch_size=1, seq_len=32)
    shown: list[int] = []

    def events(event: object) -> None:
        if isinstance(event, Progress):
            shown.append(event.windows)
            if len(shown) == 2:
                _drop_a_ctrl_c()

    with pytest.raises(KeyboardInterrupt):
        analyze(request, events)
    assert len(shown) == 2
    (run,) = Store(db).list_runs()
    assert (run["status"], run["windows"]) == (RunStatus.INTERRUPTED, 2)
