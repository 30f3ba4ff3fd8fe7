"""Windows prepared by worker processes are the windows one process prepares: same batches, ids,
tokens, sentence ids, document rows and progress, and a run stores the same statistics."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from headatlas.service.engine.preparation import WindowPool, preparation_processes, usable_cores
from headatlas.service.engine.run_plan import iter_batches, survey_corpus
from headatlas.service.engine.windows import TokenClasses
from headatlas.service.operations.embedded_run import analyze_corpus
from headatlas.service.params import AnalysisParams
from headatlas.service.storage.store import Store


def corpus_with_repeats(folder: Path, demo: Path, documents: int | None = None) -> Path:
    """The shipped excerpt's documents (the first ``documents``), a short one, then the first
    again (analysed once)."""
    docs = [d.strip() for d in demo.read_text(encoding="utf-8").split("\n\n") if d.strip()][:documents]
    path = folder / "repeats.txt"
    path.write_text("\n\n".join([*docs, "A short one. It ends here.", docs[0]]) + "\n", encoding="utf-8")
    return path


def batches(corpus: Path, model, params: AnalysisParams, workers, **kwargs) -> list:
    tokens = TokenClasses.for_model(model)
    return list(iter_batches(str(corpus), model, params, tokens, batch_size=8, workers=workers, **kwargs))


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b) > 3
    for (batch_a, docs_a, read_a), (batch_b, docs_b, read_b) in zip(a, b):
        assert batch_a.windows == batch_b.windows  # ids, document, index, tokens, sentence ids
        assert torch.equal(batch_a.input_ids, batch_b.input_ids)
        assert torch.equal(batch_a.attention_mask, batch_b.attention_mask)
        assert (batch_a.sentence is None) == (batch_b.sentence is None)
        if batch_a.sentence is not None:
            assert torch.equal(batch_a.sentence, batch_b.sentence)
        assert docs_a == docs_b
        assert read_a == read_b


@pytest.mark.parametrize("sentences", ["segmenter", "punct"])
def test_pool_makes_the_same_batches(tiny_model, demo_corpus, tmp_path, sentences):
    """Tasks of a few documents (small ``task_chars``), the longest document windowed in the
    calling process (small ``inline_chars``), a repeated document, skipped windows and single
    first windows: all as one process makes them."""
    corpus = corpus_with_repeats(tmp_path, demo_corpus)
    params = AnalysisParams(sentences=sentences, seq_len=64)
    alone = batches(corpus, tiny_model, params, 1)
    assert any(b.sentence is not None for b, _, _ in alone) == (sentences == "segmenter")
    tokens = TokenClasses.for_model(tiny_model)
    longest = max(len(d) for d in demo_corpus.read_text(encoding="utf-8").split("\n\n"))
    with WindowPool(
        2, tiny_model.tokenizer, tokens, tiny_model.tokenizer_key, params, task_chars=3_000, inline_chars=longest - 1
    ) as pool:
        assert_same_batches(alone, batches(corpus, tiny_model, params, pool))
        skip = {w.window_id for b, _, _ in alone[1:3] for w in b.windows[::2]}
        assert_same_batches(
            batches(corpus, tiny_model, params, 1, skip=skip, single_first=5),
            batches(corpus, tiny_model, params, pool, skip=skip, single_first=5),
        )
    assert_same_batches(alone, batches(corpus, tiny_model, params, 3))  # a pool of its own


def test_an_error_in_a_process_is_raised_by_the_caller(tiny_model, small_corpus):
    """A document the tokenizer refuses fails the run in the caller, naming the problem."""

    class Refusing:
        def __call__(self, *args, **kwargs):
            raise ValueError("this tokenizer refuses every text")

    tokens = TokenClasses.for_model(tiny_model)
    params = AnalysisParams()
    with WindowPool(2, Refusing(), tokens, tiny_model.tokenizer_key, params) as pool:
        with pytest.raises(ValueError, match="refuses every text"):
            list(iter_batches(str(small_corpus), tiny_model, params, tokens, batch_size=8, workers=pool))


def test_a_pools_processes_end_on_sigterm_whatever_handler_their_caller_set(tiny_model, small_corpus):
    """The beat's SIGTERM handler only notes that it should stop: inherited by the pool's processes,
    it kept one alive through the pool's terminate, and a fire waited in close() forever (seen in
    CI, the beat's thread stacks in its log). The processes take SIGTERM's default."""
    import signal
    import threading

    tokens = TokenClasses.for_model(tiny_model)
    params = AnalysisParams()
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # as the beat's: notes it, goes on
    pool = WindowPool(2, tiny_model.tokenizer, tokens, tiny_model.tokenizer_key, params)
    try:
        assert list(iter_batches(str(small_corpus), tiny_model, params, tokens, batch_size=8, workers=pool))
        # what each process does on the SIGTERM its pool's terminate sends (the caller's handler,
        # a local function, would not even come back: it does not pickle)
        seen = {pool._pool.apply_async(signal.getsignal, (signal.SIGTERM,)).get(timeout=30) for _ in range(8)}
        assert seen == {signal.SIG_DFL}
    finally:
        signal.signal(signal.SIGTERM, previous)
        closing = threading.Thread(target=pool.close, daemon=True)
        closing.start()
        closing.join(30)
        stuck = closing.is_alive()
        if stuck:  # what the beat met: killed here, so that the suite goes on
            for process in pool._pool._pool:
                process.kill()
            closing.join(30)
    assert not stuck, "the pool's close() waited 30 s for processes that outlived its SIGTERM"


def test_processes_by_default_are_the_cores_left_beside_the_model():
    cores = usable_cores()
    assert preparation_processes(3, model_threads=cores) == 3  # asked for: given
    assert preparation_processes(0, model_threads=None) == (cores if cores >= 2 else 1)  # submit: every core
    assert preparation_processes(0, model_threads=cores) == 1  # none left: the run's own process
    assert preparation_processes(0, model_threads=cores - 2) == (2 if cores >= 2 else 1)


def test_a_run_prepared_by_processes_stores_the_same_statistics(tiny_model, demo_corpus, tmp_path, monkeypatch):
    from queue_support import assert_same_statistics, stored

    corpus = corpus_with_repeats(tmp_path, demo_corpus, documents=2)
    params = AnalysisParams(seq_len=32)
    runs = {}
    for processes in ("1", "2"):
        monkeypatch.setenv("HEADATLAS_PREPARE_PROCESSES", processes)
        db = tmp_path / f"p{processes}.duckdb"
        run = analyze_corpus(
            str(corpus),
            store=Store(db),
            model=tiny_model,
            params=params,
            corpus=survey_corpus(str(corpus)),
            batch_size=8,
        )
        assert run.status == "done"
        runs[processes] = stored(str(db), run.run_id)
    assert len(runs["1"]["run_windows"]) > 20
    assert_same_statistics(runs["1"], runs["2"], rel=0)


def _stuck_deaf_to_sigterm() -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


def test_close_kills_a_process_that_never_answers_sigterm(tiny_model, monkeypatch):
    """A process forked while another thread of the caller held a lock can stick before it sets its
    signals, the caller's SIGTERM handler still its own (seen in CI: the beat's fire waited in
    close() after the first fix above). Such a process, here one that ignores SIGTERM, is killed
    once the grace has passed, and close() returns."""
    import signal
    import threading

    from headatlas.service.engine import preparation

    monkeypatch.setattr(preparation, "CLOSE_GRACE_S", 0.5)
    tokens = TokenClasses.for_model(tiny_model)
    pool = WindowPool(1, tiny_model.tokenizer, tokens, tiny_model.tokenizer_key, AnalysisParams())
    (process,) = pool._pool._pool
    pool._pool.apply_async(_stuck_deaf_to_sigterm)  # it no longer answers SIGTERM, nor the queue
    time.sleep(1.0)  # in the task
    closing = threading.Thread(target=pool.close, daemon=True)
    closing.start()
    closing.join(60)
    stuck = closing.is_alive()
    if stuck:
        process.kill()
        closing.join(30)
    assert not stuck, "close() waited for a process that ignores SIGTERM"
    assert not process.is_alive() and process.exitcode == -signal.SIGKILL


def test_a_process_killed_with_its_task_fails_the_run_instead_of_waiting_for_ever(tiny_model, demo_corpus, tmp_path):
    """The out-of-memory killer (or anyone) ends a process waiting for a task: the pool starts
    another one, but the caller waited for the lost task's windows for ever, and the pool's
    terminate() for the task queue's lock that the process held. The run now fails within about a
    second, naming the signal, and close() returns."""
    import os
    import signal
    import threading

    from headatlas.service.errors import PreparationError

    tokens = TokenClasses.for_model(tiny_model)
    params = AnalysisParams(seq_len=64)
    corpus = corpus_with_repeats(tmp_path, demo_corpus)
    pool = WindowPool(2, tiny_model.tokenizer, tokens, tiny_model.tokenizer_key, params, task_chars=3_000)
    try:
        os.kill(pool._started[0].pid, signal.SIGKILL)
        pool._started[0].join(10)
        started = time.monotonic()
        with pytest.raises(PreparationError, match=r"a process preparing windows ended \(signal 9 \(SIGKILL.*resume"):
            batches(corpus, tiny_model, params, pool)
        assert time.monotonic() - started < 30
    finally:
        closing = threading.Thread(target=pool.close, daemon=True)
        closing.start()
        closing.join(30)
        stuck = closing.is_alive()
        if stuck:  # killed here, so that the suite goes on
            for process in pool._pool._pool:
                process.kill()
    assert not stuck, "the pool's close() waited 30 s for the lock a killed process held"
