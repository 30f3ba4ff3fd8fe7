"""Celery tasks. Thin: they take a run key and a small payload, call library code, and are
idempotent, so that late acknowledgement and redelivery are harmless.

``analyze_batch`` (queue ``analysis``) runs on workers, which never open the database: it sends
the compact ``BatchResult`` bytes on to the ``ingest`` queue. The ``headatlas.writer.*`` tasks
run in the writer alone.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import threading
import time
from contextlib import contextmanager

from celery import signals
from celery.exceptions import Reject, SoftTimeLimitExceeded

from workers.app import INGEST_QUEUE, app

SETTINGS = app.conf.headatlas
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"
READER_GAP_S = 0.025
_state: dict = {}  # per process: ledger, loaded models, the writer's store and run ids


def _ledger():
    from workers.ledger import Ledger, connect

    if "ledger" not in _state:
        _state["ledger"] = Ledger(connect(SETTINGS.broker_url, check=False))
    return _state["ledger"]


def _model(spec: str, dtype: str):
    """The model, loaded on first use in this process (never at import, never before a fork)."""
    from service.model import load_model

    models = _state.setdefault("models", {})
    if (spec, dtype) not in models:
        models[(spec, dtype)] = load_model(spec, device=SETTINGS.device, dtype=dtype)
    return models[(spec, dtype)]


# --- analysis ------------------------------------------------------------------------------------
@app.task(name="headatlas.analyze_batch", bind=True, max_retries=None)
def analyze_batch(self, run_key: str, batch_id: int, batch: dict) -> None:
    """Analyse one batch. ``batch``: model, dtype, params, tokenizer_key, windows
    ([window_id, doc_id, index, token ids]), documents (rows)."""
    with _requeue_on_broker_loss():
        _analyze_batch(self, run_key, batch_id, batch)


def _analyze_batch(self, run_key: str, batch_id: int, batch: dict) -> None:
    ledger = _ledger()
    if ledger.is_finished(run_key, batch_id):
        return  # delivered again after it was stored
    attempt = ledger.start(run_key, batch_id, WORKER_ID)
    if attempt > SETTINGS.max_attempts:
        error = ledger.last_error(run_key, batch_id) or "the worker was lost (killed, or out of memory) while analysing it"
        _give_up(ledger, run_key, batch_id, attempt - 1, error)
        return
    try:
        model = _model(batch["model"], batch["dtype"])  # once per process, outside the batch's time limit
        with _deadline(0.95 * SETTINGS.task_time_limit_s):
            payload = _analyse(model, batch)
    except Exception as exc:  # noqa: BLE001 - every failure counts against the poison guard
        error = _describe(exc)
        ledger.errored(run_key, batch_id, error)
        if attempt >= SETTINGS.max_attempts:
            _give_up(ledger, run_key, batch_id, attempt, error)
            return
        raise self.retry(countdown=min(2 ** attempt, 30), exc=None)
    app.send_task("headatlas.writer.ingest", args=[run_key, batch_id, payload], queue=INGEST_QUEUE)
    ledger.analysed(run_key, batch_id)


@contextmanager
def _requeue_on_broker_loss():
    """Redis went away mid-task: put the message back instead of letting Celery acknowledge a
    failed task (which would drop the batch). If Redis is still away the message stays
    unacknowledged and comes back after the visibility timeout."""
    import kombu.exceptions
    import redis

    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, kombu.exceptions.OperationalError,
            ConnectionError) as exc:
        raise Reject(f"broker unreachable ({exc}); requeued", requeue=True) from exc


def _analyse(model, batch: dict) -> str:
    from service.analysis import analyze_batch as analyse
    from service.errors import ModelError
    from service.params import AnalysisParams
    from service.windows import TokenClasses, Window, collate

    if model.tokenizer_key != batch["tokenizer_key"]:
        raise ModelError(
            f"--model {batch['model']}: this worker's tokenizer ({model.tokenizer_key}) differs from the "
            f"submitter's ({batch['tokenizer_key']}); give every machine the same model files"
        )
    params = AnalysisParams.from_dict(batch["params"])
    tokens = _state.setdefault(("tokens", model.tokenizer_key), TokenClasses.from_tokenizer(model.tokenizer))
    windows = [Window(window_id=w, doc_id=d, index=i, input_ids=tuple(ids)) for w, d, i, ids in batch["windows"]]
    result = analyse(model, collate(windows, tokens.pad_id), params, tokens, documents=batch["documents"])
    return base64.b64encode(result.to_bytes()).decode("ascii")


def _give_up(ledger, run_key: str, batch_id: int, attempts: int, error: str) -> None:
    ledger.errored(run_key, batch_id, error)
    app.send_task("headatlas.writer.batch_failed", args=[run_key, batch_id, attempts, error], queue=INGEST_QUEUE)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SoftTimeLimitExceeded):
        return f"took longer than HEADATLAS_TASK_TIME_LIMIT_S={SETTINGS.task_time_limit_s:g} s; use smaller batches or raise the limit"
    return f"{type(exc).__name__}: {exc}"[:1000]


@contextmanager
def _deadline(seconds: float):
    """Raise SoftTimeLimitExceeded after ``seconds`` in the main thread. Celery enforces time
    limits in prefork children only; the solo pool (one process per GPU) needs this."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- the writer ----------------------------------------------------------------------------------
def _store():
    from service.storage.store import Store

    if "store" not in _state:
        store = Store(SETTINGS.db)
        store.ensure_schema()
        _state["store"] = store
    return _state["store"]


def _run_id(run_key: str, *, refresh: bool = False) -> int | None:
    """The database id of the run: created from the submitter's description on first sight;
    ``refresh`` re-reads the description (the submitter has finished cutting the corpus)."""
    from service.storage.queue_store import open_run

    ids = _state.setdefault("run_ids", {})
    if run_key not in ids or refresh:
        ledger = _ledger()
        meta = ledger.run_meta(run_key)
        if meta is None:
            return None
        run, _plan = open_run(_store(), meta)
        ledger.set_run_id(run_key, run.run_id)
        ids[run_key] = run.run_id
    return ids[run_key]


@app.task(name="headatlas.writer.open_run", bind=True, max_retries=30)
def open_run(self, run_key: str) -> None:
    from service.errors import HeadatlasError

    with _requeue_on_broker_loss():
        _ledger().writer_state("opening", run=run_key)
        try:
            if _run_id(run_key, refresh=True) is None:
                # the description is written before this message; without it (a Redis that lost
                # its data) a new submission will bring both again
                raise self.retry(countdown=2)
        except HeadatlasError as exc:
            _ledger().set_run_error(run_key, str(exc))  # the submitter is waiting for it
        finally:
            _ledger().writer_state("idle")


@app.task(name="headatlas.writer.ingest", bind=True, max_retries=None)
def ingest(self, run_key: str, batch_id: int, payload: str) -> None:
    with _requeue_on_broker_loss():
        _ingest(self, run_key, batch_id, payload)


def _ingest(self, run_key: str, batch_id: int, payload: str) -> None:
    from service.analysis import BatchResult
    from service.errors import StoreError
    from service.storage.queue_store import ingest_one, mark_failed

    ledger = _ledger()
    run_id = _run_id(run_key)
    if run_id is None:
        raise self.retry(countdown=5)
    ledger.writer_state("ingesting", run=run_id, batch=batch_id)
    result = BatchResult.from_bytes(base64.b64decode(payload))
    try:
        stored = ingest_one(_store(), run_id, batch_id, result)
    except StoreError as exc:
        if "busy" in str(exc):
            raise self.retry(countdown=2)  # a long reader held the file: try again, keep the batch
        # e.g. windows already counted by another batch: retrying cannot help
        if mark_failed(_store(), run_id, batch_id, attempts=1, error=str(exc)):
            ledger.finished(run_key, batch_id, failed=True)
        return
    finally:
        ledger.writer_state("idle")
    ledger.finished(run_key, batch_id, failed=False, windows=len(result.window_ids) if stored else 0)
    # leave the file closed for a moment: with a backlog the writer would otherwise reopen it
    # within a millisecond, and readers (status, query, sql) retrying on its lock would rarely
    # find it free
    time.sleep(READER_GAP_S)


@app.task(name="headatlas.writer.batch_failed", bind=True, max_retries=None)
def batch_failed(self, run_key: str, batch_id: int, attempts: int, error: str) -> None:
    with _requeue_on_broker_loss():
        _batch_failed(self, run_key, batch_id, attempts, error)


def _batch_failed(self, run_key: str, batch_id: int, attempts: int, error: str) -> None:
    from service.storage.queue_store import mark_failed

    run_id = _run_id(run_key)
    if run_id is None:
        raise self.retry(countdown=5)
    if mark_failed(_store(), run_id, batch_id, attempts=attempts, error=error):
        _ledger().finished(run_key, batch_id, failed=True)


@app.task(name="headatlas.writer.reopen", bind=True, max_retries=None)
def reopen(self, run_key: str) -> None:
    """Before a retry: the failed batches of the run become pending again."""
    from service.storage.queue_store import reopen_failed

    with _requeue_on_broker_loss():
        run_id = _run_id(run_key)
        if run_id is None:
            raise self.retry(countdown=5)
        reopen_failed(_store(), run_id)


@signals.worker_process_init.connect
def _share_cores(**_kwargs) -> None:
    """Prefork children split the cores instead of each using all of them."""
    threads = os.environ.get("HEADATLAS_TORCH_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
