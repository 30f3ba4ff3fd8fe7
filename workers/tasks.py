"""The analysis task. Thin: it takes a run key and a small payload, calls library code, and is
idempotent, so that late acknowledgement and redelivery are harmless.

Workers never open the database: the compact ``BatchResult`` bytes go on to the ingest queue,
which the writer (workers/writer.py) alone consumes.
"""

from __future__ import annotations

import base64
import logging
import os
import signal
import socket
import threading
from contextlib import contextmanager

from celery import signals
from celery.exceptions import Reject, SoftTimeLimitExceeded

from headatlas.workers.app import app
from headatlas.workers.messages import BatchFailed, ProbeScores

log = logging.getLogger("headatlas.worker")


def _settings():
    """The worker's settings, as its launcher configured the app (read at use, not at import)."""
    return app.conf.headatlas


_state: dict = {}  # per process: ledger, loaded models


def _ledger(database_id: str):
    from headatlas.workers.ledger import Ledger, connect

    if "redis" not in _state:
        _state["redis"] = connect(_settings().broker_url, check=False)
    return Ledger(_state["redis"], database_id)


def _model(spec: str, dtype: str, weights_key: str | None = None):
    """The model, loaded on first use in this process (never at import, never before a fork),
    and again when the batch names other weights (a checkpoint replaced in the same folder)."""
    from headatlas.service.engine.model import load_model

    models = _state.setdefault("models", {})
    cached = models.get((spec, dtype))
    if cached is None or (weights_key and cached.weights_key != weights_key):
        models.pop((spec, dtype), None)
        cached = None  # the old weights are freed before the new ones are loaded
        models[(spec, dtype)] = load_model(spec, device=_settings().device, dtype=dtype)
    return models[(spec, dtype)]


# --- analysis ------------------------------------------------------------------------------------
@app.task(name="headatlas.analyze_batch", bind=True, max_retries=None)
def analyze_batch(self, run_key: str, batch_id: int, batch: dict) -> None:
    """Analyse one batch. ``batch``: database_id (the database it is for), model, dtype, params,
    tokenizer_key, windows ([window_id, doc_id, index, token ids] + [sentence ids] under
    --sentences segmenter), documents (rows)."""
    with _requeue_on_broker_loss():
        _analyze_batch(self, run_key, batch_id, batch)


def _analyze_batch(self, run_key: str, batch_id: int, batch: dict) -> None:
    from headatlas.workers.heartbeat import BatchHeartbeat
    from headatlas.workers.policy import SILENT_S, gives_up, out_of_attempts, retry_countdown, time_limit_s

    if "database_id" not in batch:
        log.warning(
            "batch %s of run %s names no database (queued by an older headatlas): dropped; submit the corpus again",
            batch_id,
            run_key,
        )
        return
    ledger = _ledger(batch["database_id"])
    if ledger.is_finished(run_key, batch_id):
        ledger.undeliver(run_key, batch_id, self.request.id or "")
        ledger.settle(run_key)  # its delivery made the run active again: not when the run has ended
        return  # delivered again after it was stored
    if ledger.deleted(run_key):
        ledger.undeliver(run_key, batch_id, self.request.id or "")
        return  # its run was deleted (`runs delete`) while it was queued
    worker = f"{socket.gethostname()}:{os.getpid()}"  # this process, not a parent
    attempt = ledger.start(run_key, batch_id, worker, self.request.id or "", SILENT_S)
    if out_of_attempts(attempt, _settings().max_attempts):
        error = (
            ledger.last_error(run_key, batch_id) or "the worker was lost (killed, or out of memory) while analysing it"
        )
        _give_up(ledger, run_key, batch_id, attempt - 1, error)
        return
    try:
        with BatchHeartbeat(ledger, run_key, batch_id, worker):
            # once per process (and per checkpoint), outside the batch's time limit
            model = _model(batch["model"], batch["dtype"], batch.get("weights_key"))
            with _deadline(time_limit_s(_settings())):
                payload = _analyse(model, batch, run_key=run_key)
    except Exception as exc:  # noqa: BLE001 - every failure counts against the poison guard
        error = _describe(exc)
        ledger.errored(run_key, batch_id, error)
        if gives_up(attempt, _settings().max_attempts):
            _give_up(ledger, run_key, batch_id, attempt, error)
            return
        raise self.retry(countdown=retry_countdown(attempt), exc=None)  # noqa: B904 - Celery's retry idiom
    ledger.analysed(run_key, batch_id, payload)


@contextmanager
def _requeue_on_broker_loss():
    """Redis went away mid-task: put the message back instead of letting Celery acknowledge a
    failed task (which would drop the batch). If Redis is still away the message stays
    unacknowledged and comes back after the visibility timeout."""
    import kombu.exceptions
    import redis

    from headatlas.workers.broker_errors import refusal

    try:
        yield
    except redis.exceptions.ResponseError as exc:
        refused = refusal(_settings().broker_url, exc, kept="the batch goes back to the queue")
        if refused is None:
            raise
        log.error("%s", refused)  # not a lost broker: a restart would not help
        raise Reject(str(refused), requeue=True) from exc
    except (
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        kombu.exceptions.OperationalError,
        ConnectionError,
    ) as exc:
        _await_broker()
        raise Reject(f"broker unreachable ({exc}); requeued", requeue=True) from exc


def _await_broker() -> None:
    """Wait (every RECONNECT_EVERY_S, at most the visibility timeout) until Redis answers again,
    so that Celery's reject reaches it: a reject that fails on a broker still away is only logged,
    and the solo consumer, whose connection died under the task, was left polling nothing: the
    worker took no message again though Redis was back (a restart met by a batch's last write).
    A broker away longer than that: the reject fails as before."""
    import time

    import redis

    from headatlas.workers.policy import BROKER_CONNECT_TIMEOUT_S, RECONNECT_EVERY_S, visibility_timeout_s

    client = redis.Redis.from_url(
        _settings().broker_url,
        socket_connect_timeout=BROKER_CONNECT_TIMEOUT_S,
        socket_timeout=BROKER_CONNECT_TIMEOUT_S,
    )
    # after it the message comes back anyway; the worker could take no other meanwhile
    deadline = time.monotonic() + visibility_timeout_s(_settings())
    try:
        while True:
            try:
                client.ping()
                return
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                if time.monotonic() >= deadline:
                    return
                time.sleep(RECONNECT_EVERY_S)
    finally:
        client.close()


def _check_files(model, batch: dict) -> None:
    """The worker's model files are the submitter's: the same tokenizer and weights."""
    from headatlas.service.errors import ModelError

    if model.tokenizer_key != batch["tokenizer_key"]:
        raise ModelError(
            f"--model {batch['model']}: this worker's tokenizer ({model.tokenizer_key}) differs from the "
            f"submitter's ({batch['tokenizer_key']}); give every machine the same model files"
        )
    if batch.get("weights_key", model.weights_key) != model.weights_key:
        raise ModelError(
            f"--model {batch['model']}: this worker's weight files ({model.weights_key}) differ from the "
            f"submitter's ({batch['weights_key']}); give every machine the same model files"
        )


def _analyse(model, batch: dict, *, run_key: str = "") -> str:
    from headatlas.service.engine.analysis import analyze_batch as analyse
    from headatlas.service.engine.measure_contract import Take, batch_windows, requested
    from headatlas.service.engine.windows import TokenClasses, Window, collate
    from headatlas.service.errors import ParameterError
    from headatlas.service.params import AnalysisParams

    _check_files(model, batch)
    params = AnalysisParams.from_dict(batch["params"])
    key = ("tokens", model.tokenizer_key, model.family)
    tokens = _state.get(key)
    if tokens is None:  # once per tokenizer: it scans the whole vocabulary (tenths of a second)
        tokens = _state[key] = TokenClasses.for_model(model)
    if "added_effects" in batch:  # one window's effects for a finished run (`effects RUN --queue`)
        return _added_effects(model, batch, tokens, run_key=run_key)
    windows = [Window.from_message(row) for row in batch["windows"]]
    # a measure that takes the run's first N windows (--attribution-windows) takes those of them
    # in this batch, by the one rule the embedded runner follows (SPEC §6, §9); one that spreads
    # its windows over the replicate groups (--effects) those the submitter named in the message
    chosen = requested(params)
    first = int(batch.get("first_window", 0))
    positional = {m.name: first for m in chosen if m.quota(params) is not None and not m.spreads(params)}
    counts: dict[str, Take] = dict(batch_windows(chosen, params, positional, len(windows)))
    for measure in chosen:
        if measure.quota(params) is not None and measure.spreads(params):
            takes = batch.get("takes") or {}
            if measure.name not in takes:
                raise ParameterError(
                    f"run {run_key}: batch message names no windows for {measure.name}, which spreads its windows "
                    "over the replicate groups; submit the run again"
                )
            counts[measure.name] = tuple(int(i) for i in takes[measure.name])
    means = None
    if counts.get("effects") and params.needs_means:
        means = _reference_means(run_key, model, batch, tokens)
    result = analyse(
        model,
        collate(windows, tokens.pad_id),
        params,
        tokens,
        documents=batch["documents"],
        windows=counts,
        attribution_chunk=_settings().attribution_chunk,
        effect_means=means,
    )
    return base64.b64encode(result.to_bytes()).decode("ascii")


def _added_effects(model, batch: dict, tokens, *, run_key: str) -> str:
    """One window's effects added to a finished run: the batch result the embedded `effects RUN`
    stores for it (``effect_batch.window_effects``), against the reference means every worker of
    the measurement shares. ``batch["added_effects"]["present"]``: the sums the run's rows hold,
    as the submitter read them (a worker never opens the database)."""
    from headatlas.service.engine.windows import Window
    from headatlas.service.measures.effect_batch import window_effects
    from headatlas.service.params import AnalysisParams

    params = AnalysisParams.from_dict(batch["params"])
    means = _reference_means(run_key, model, batch, tokens) if params.needs_means else None
    heads, runs = batch["added_effects"]["present"]
    (window,) = (Window.from_message(row) for row in batch["windows"])
    result = window_effects(model, window, params, means=means, present=(list(heads), list(runs)), pad_id=tokens.pad_id)
    return base64.b64encode(result.to_bytes()).decode("ascii")


def _reference_means(run_key: str, model, batch: dict, tokens):
    """The run's reference means of mean ablation (SPEC §9), the same bytes in every worker: the
    submitter put the reference windows in the run's description; the first worker to need the
    means computes them and publishes them in the broker (``Ledger.shared``: the first to store
    wins), and every worker, this one included, uses the published copy, kept in this process
    for the rest of the run. Workers therefore never open the database, and never disagree even
    where their devices or thread counts would round differently."""
    from headatlas.service.engine.reference_means import ReferenceMeans
    from headatlas.service.engine.windows import Window
    from headatlas.service.errors import ParameterError
    from headatlas.service.measures.effect_batch import reference_means

    cache = _state.setdefault("reference_means", {})
    key = (run_key, batch["database_id"], model.weights_key)
    if key not in cache:
        ledger = _ledger(batch["database_id"])

        def compute() -> bytes:
            messages = (ledger.run_meta(run_key) or {}).get("effect_reference")
            if not messages:
                raise ParameterError(
                    f"run {run_key}: its description names no reference windows for --effects mean; submit it again"
                )
            windows = [Window.from_message(m) for m in messages]
            return reference_means(model, windows, tokens.pad_id).to_bytes()

        cache[key] = ReferenceMeans.from_bytes(ledger.shared(run_key, "effect_means", compute))
    return cache[key]


# --- the synthetic probe (SPEC §8) -----------------------------------------------------------------
@app.task(name="headatlas.probe_run")
def probe_run(run_key: str, probe: dict) -> None:
    """The probe of a queued run, once per submission that asks for it. ``probe``: database_id,
    model, dtype, tokenizer_key, weights_key, length, sequences, seed. The scores go to the
    writer as one ``probe`` message; storing them again is harmless (one probe per run)."""
    with _requeue_on_broker_loss():
        model = _model(probe["model"], probe["dtype"], probe.get("weights_key"))
        _ledger(probe["database_id"]).send(probe_message(model, run_key, probe))


def probe_message(model, run_key: str, probe: dict) -> ProbeScores:
    """The writer's message of the probe: its parameters and its scores (name -> ``[layer][head]``)."""
    from headatlas.service.engine.measure_contract import probe_scores
    from headatlas.service.engine.probe import ProbeSpec

    _check_files(model, probe)
    spec = ProbeSpec(length=int(probe["length"]), sequences=int(probe["sequences"]), seed=int(probe["seed"]))
    scores = probe_scores(model, spec)
    return ProbeScores(
        database_id=probe["database_id"],
        run_key=run_key,
        length=spec.length,
        sequences=spec.sequences,
        seed=spec.seed,
        scores={name: values.tolist() for name, values in scores.items()},
    )


def _give_up(ledger, run_key: str, batch_id: int, attempts: int, error: str) -> None:
    ledger.errored(run_key, batch_id, error)
    ledger.send(BatchFailed(ledger.database_id, run_key, batch_id, attempts, error))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SoftTimeLimitExceeded):
        return f"took longer than HEADATLAS_TASK_TIME_LIMIT_S={_settings().task_time_limit_s:g} s; use smaller batches or raise the limit"
    return f"{type(exc).__name__}: {exc}"[:1000]


@contextmanager
def _deadline(seconds: float):
    """Raise SoftTimeLimitExceeded after ``seconds`` in the main thread: the batch's time limit,
    the same in a prefork child and in a single-process worker (one per GPU), around the
    analysis only (Celery's soft limit would count the model's build as well)."""
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


@signals.task_received.connect
def _claim_delivery(request=None, **_kwargs) -> None:
    """A batch reached this process (the consumer, before any pool child starts it): record the
    delivery, which this process's beacon keeps claimed until the batch starts. A process killed
    before starting it (a prefetched message, a retry waiting for its countdown, pool children
    busy or still starting) then has it requeued by the writer's sweep within seconds instead of
    the broker's visibility timeout (twice the task time limit)."""
    if request is None or request.name != analyze_batch.name:
        return
    try:
        run_key, batch_id, batch = request.args[:3]
        database_id = batch["database_id"]
    except (TypeError, ValueError, KeyError):
        return  # a malformed or older message: the task itself says so
    import redis

    from headatlas.workers.ledger import Ledger, connect

    try:
        if "consumer_redis" not in _state:  # the consumer's own client, never a pool child's
            _state["consumer_redis"] = connect(_settings().broker_url, check=False)
        Ledger(_state["consumer_redis"], database_id).deliver(run_key, int(batch_id), _process_name(), request.id)
    except redis.RedisError as exc:  # the broker is away: the visibility timeout still covers it
        log.warning("batch %s: could not record its delivery (%s)", batch_id, exc)


def _process_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _forget_unstarted() -> None:
    """Stopping: the broker connection gave back the batches this process held and never started;
    their deliveries are no longer this process's."""
    from celery.worker import state

    from headatlas.workers.ledger import Ledger

    client = _state.get("consumer_redis")
    if client is None:
        return
    for request in list(state.reserved_requests - state.active_requests):
        try:
            run_key, batch_id, batch = request.args[:3]
            Ledger(client, batch["database_id"]).undeliver(run_key, int(batch_id), request.id)
        except Exception:  # noqa: BLE001 - best effort: the sweep handles what is left
            log.debug("forgetting the delivery of %s", request.id, exc_info=True)


@signals.worker_ready.connect
def _start_beacon(sender=None, **_kwargs) -> None:
    """This worker consumes the analysis queue: say so in Redis while its consumer runs."""
    import time

    from celery import bootsteps

    from headatlas.workers.heartbeat import WorkerBeacon
    from headatlas.workers.ledger import connect

    consumer = sender

    def consuming() -> bool:
        blueprint = getattr(consumer, "blueprint", None)
        return blueprint is None or blueprint.state == bootsteps.RUN

    name = _process_name()  # the name deliveries to this process are claimed under
    info = {"device": _settings().device, "started": time.time()}
    _state["beacon"] = WorkerBeacon(connect(_settings().broker_url, check=False), name, info, consuming).start()


@signals.worker_shutdown.connect
def _stop_beacon(**_kwargs) -> None:
    _forget_unstarted()
    beacon = _state.pop("beacon", None)
    if beacon is not None:
        beacon.stop()


@signals.worker_process_init.connect
def _share_cores(**_kwargs) -> None:
    """Prefork children split the cores instead of each using all of them, and import
    transformers as they start (seconds on a slow machine): a child that replaces a lost one
    would otherwise pay it inside its first batch's time limit."""
    threads = app.conf.headatlas_torch_threads
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    import transformers  # noqa: F401

    import headatlas.service.engine.analysis  # noqa: F401 - imported by the analysis, inside its limit
