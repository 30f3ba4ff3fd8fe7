"""Submitting a corpus: validate it, cut it into batches, queue the batches, name the run.

The submitter never writes the database: a writer may hold it at any moment, and DuckDB admits
one writing process. The run is described in Redis and created by the writer (on its first
message on the ingest queue); batch messages carry the run key and the database's id, so they
can be queued before the run has an id, and never reach another database. A batch is skipped
only when the database has stored it (read from here when the file is reachable, else as its
writer last reported it) or when it is in flight for this database.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from headatlas.service.config import Settings
from headatlas.service.errors import BrokerError, CorpusError, StoreError
from headatlas.service.params import AnalysisParams
from headatlas.service.statuses import BatchStatus, RunStatus, sql
from headatlas.service.storage.backends import open_backend
from headatlas.service.wording import counted
from headatlas.workers.ledger import Ledger, connect
from headatlas.workers.messages import OpenRun, SeriesStep
from headatlas.workers.policy import WRITER_POLL_S

if TYPE_CHECKING:
    from headatlas.service.engine.probe import ProbeSpec

SEND_CHUNK = 200


@dataclass
class Submission:
    run_key: str
    name: str
    batch_size: int
    batches: int
    windows: int
    queued: int  # batches queued by this submission
    skipped: int  # batches already stored or already in the queue
    database_id: str = ""
    run_id: int | None = None  # None when no writer created the run within the wait
    status: RunStatus | None = None
    probe_queued: bool = False  # the synthetic probe was queued (SPEC §8)
    epoch: str = ""  # the broker's epoch when it was queued (workers/lease.py: broker_epoch)


def _refusals_said(queue: Callable[..., Submission]) -> Callable[..., Submission]:
    """A Redis at maxmemory refuses the ledger's writes before anything is sent, too: its fix,
    not a traceback."""

    @functools.wraps(queue)
    def said(spec: str, *, settings: Settings, **kwargs) -> Submission:
        from headatlas.workers.broker_errors import refusals_said

        with refusals_said(settings.broker_url, kept=_KEPT):
            return queue(spec, settings=settings, **kwargs)

    return said


_KEPT = "what was queued is kept and nothing is queued twice: submit again once it has room"


@_refusals_said
def submit(
    spec: str,
    *,
    settings: Settings,
    model: str,
    dtype: str,
    params: AnalysisParams,
    batch_size: int,
    name: str | None = None,
    text_field: str = "text",
    encoding: str = "utf-8",
    writer_wait_s: float = 20.0,
    only: set[int] | None = None,
    expect_key: str | None = None,
    probe: ProbeSpec | None = None,
    series: dict | None = None,
    log: Callable[[str], None] = lambda _msg: None,
) -> Submission:
    """Queue every batch of the corpus not yet stored nor queued (``only``: just these ids);
    ``probe``: also queue the synthetic probe (one task) unless the database holds it; ``series``:
    the training series the run is a checkpoint of (name, checkpoints, step, checkpoint), which
    the writer records as it opens the run (outside the run's key)."""
    from headatlas.service.engine.measure_contract import requested
    from headatlas.service.engine.model import load_model_info
    from headatlas.service.engine.run_plan import run_key, short_name, survey_corpus
    from headatlas.workers.app import ANALYSIS_QUEUE, make_app, send_batch
    from headatlas.workers.lease import broker_epoch, target_database

    summary = survey_corpus(spec, text_field=text_field, encoding=encoding)
    # each measure asked for checks what it can from the model's spec (gradient importance of an
    # objective that is not a loss refused); a measure no installed plugin adds is refused here
    for measure in requested(params):
        measure.check_spec(model, params)
    client = connect(settings.broker_url)  # fail before any work when Redis is away
    epoch = broker_epoch(client)
    ledger = Ledger(client, target_database(client, settings.db, settings.broker_url, writer_wait_s))
    log(f"corpus: {counted(summary.documents, 'document')}, {summary.chars:,} characters; model {model} …")
    loaded = load_model_info(model)  # the tokenizer, config and weights' identity: no weights loaded
    # the replicate scheme the corpus allows (SPEC §5d): it travels in every batch's params, and each
    # window carries its document id and index, so a worker computes the embedded engine's groups
    params = params.resolved(summary.distinct)
    key, fingerprint = run_key(summary.fingerprint, loaded, params), summary.fingerprint
    # a one-file corpus stored under the earlier, name-hashing rule keeps its key (runner.stored_run_key)
    legacy_key = run_key(summary.legacy_fingerprint, loaded, params) if summary.legacy_fingerprint else None
    if expect_key is not None and expect_key not in (key, legacy_key):
        raise CorpusError(
            f"{spec} changed since the run was submitted: its batches cannot be re-made; submit it as a new run"
        )
    readable = open_backend(settings.db).exists()
    stored_run, plan, stored_done = _stored_state(settings.db, key)
    if stored_run is None and legacy_key is not None and legacy_key != key:
        legacy_state = _stored_state(settings.db, legacy_key)
        if legacy_state[0] is not None:
            key, fingerprint = legacy_key, str(summary.legacy_fingerprint)
            stored_run, plan, stored_done = legacy_state
    if stored_run is not None and stored_run.engine != "queue" and stored_run.status != RunStatus.DONE:
        raise StoreError(
            f"run {stored_run.run_id} ({stored_run.name}) has the same corpus, model and parameters and was started "
            "by `headatlas analyze`: resume it with the same analyze command"
        )
    run_name = stored_run.name if stored_run else (name or f"{short_name(spec)}-{key[:6]}")
    queue_probe = functools.partial(
        _queue_probe, settings, ledger, key, probe, model=model, dtype=dtype, loaded=loaded, readable=readable
    )
    if stored_run is not None and stored_run.status == RunStatus.DONE and only is None:
        if series is not None:  # finished before, maybe in no series or another: the writer records it in this one
            ledger.send(
                SeriesStep(
                    ledger.database_id,
                    key,
                    series["name"],
                    series["checkpoints"],
                    int(series["step"]),
                    series["checkpoint"],
                )
            )
        return Submission(
            key,
            run_name,
            plan.batch_size if plan else batch_size,
            plan.batches if plan else 0,
            plan.windows if plan else 0,
            0,
            0,
            ledger.database_id,
            stored_run.run_id,
            RunStatus.DONE,
            queue_probe(),
        )
    size = plan.batch_size if plan else ledger.claim_batch_size(key, batch_size)
    if size != batch_size:
        log(
            f"run {run_name} was first submitted with --batch-size {size}: keeping it, so batch ids name the same windows"
        )
    meta = {
        "run_key": key,
        "name": run_name,
        "corpus": str(Path(spec).resolve()) if Path(spec).exists() else spec,
        "corpus_fingerprint": fingerprint,
        "model": loaded.describe(),
        "params": params.to_dict(),
        "device": None,
        "batch_size": size,
        "batches": None,
        "windows": None,
    }
    if series is not None:
        meta["series"] = series
    if params.needs_means:
        # the reference windows of mean ablation and attribution patching (SPEC §9): the workers compute the means from them
        meta["effect_reference"] = _reference_windows(spec, loaded, params, text_field=text_field, encoding=encoding)
    ledger.put_run(key, meta)  # before any message: the writer creates the run from it
    if readable:
        ledger.reconcile_done(key, stored_done)  # the database is the truth; Redis a copy of it
    else:
        stored_done = ledger.done(key)  # as the database's own writer reported it after committing
    # a batch whose message is gone (stranded) is queued again: in flight, but nothing carries it
    skip = stored_done | (set() if only is not None else ledger.in_flight(key) - ledger.stranded(key, ANALYSIS_QUEUE))
    app = make_app(settings)
    ledger.send(OpenRun(ledger.database_id, key))
    batches = windows = queued = 0
    chunk: dict[int, dict] = {}

    def send(producer) -> None:
        # a copy of each message first (the writer queues a batch whose message Redis lost again
        # from it; a batch stored meanwhile drops its copy), then the messages, then the ledger
        ledger.keep_copies(key, {b: json.dumps(p) for b, p in chunk.items()})
        for batch_id, payload in chunk.items():
            send_batch(app, key, batch_id, payload, producer)
        ledger.mark_queued(key, list(chunk))  # after sending: a crash here re-sends, never loses
        chunk.clear()

    from headatlas.service.engine.preparation import preparation_processes

    with _broker_errors(settings.broker_url), app.producer_or_acquire() as producer:
        for batch_id, n_windows, payload in batch_payloads(
            spec,
            loaded,
            params,
            model=model,
            dtype=dtype,
            batch_size=size,
            database_id=ledger.database_id,
            text_field=text_field,
            encoding=encoding,
            wanted=lambda b: b not in skip and (only is None or b in only),
            # no model here: every core tokenises and windows (HEADATLAS_PREPARE_PROCESSES)
            workers=preparation_processes(settings.prepare_processes, model_threads=None),
        ):
            batches += 1
            windows += n_windows
            if payload is None:
                continue
            chunk[batch_id] = payload
            queued += 1
            if len(chunk) >= SEND_CHUNK:
                send(producer)
        send(producer)
    meta.update(batches=batches, windows=windows)
    ledger.put_run(key, meta)
    ledger.send(OpenRun(ledger.database_id, key))  # the plan is complete
    result = Submission(
        key, run_name, size, batches, windows, queued, batches - queued, ledger.database_id, epoch=epoch
    )
    result.probe_queued = queue_probe()
    result.run_id = wait_for_run_id(ledger, key, writer_wait_s)
    return result


def _reference_windows(spec: str, loaded, params: AnalysisParams, *, text_field: str, encoding: str) -> list:
    """The run's first ``effect_reference`` windows, as batch messages carry windows."""
    from headatlas.service.engine.run_plan import first_windows
    from headatlas.service.engine.windows import TokenClasses

    tokens = TokenClasses.for_model(loaded)
    chosen = first_windows(
        spec, loaded, params, tokens, params.effect_reference, text_field=text_field, encoding=encoding
    )
    return [w.to_message() for w in chosen]


def _spread_windows(
    spec: str, loaded, params: AnalysisParams, *, text_field: str, encoding: str
) -> dict[str, frozenset[str]]:
    """The ids of the windows each requested measure that spreads its windows over the replicate
    groups takes (``run_plan.spread_windows``, as the embedded runner finds them), by its name."""
    from headatlas.service.engine.measure_contract import requested
    from headatlas.service.engine.run_plan import spread_windows
    from headatlas.service.engine.windows import TokenClasses

    chosen = requested(params)
    if not any(m.quota(params) is not None and m.spreads(params) for m in chosen):
        return {}
    picked = spread_windows(
        chosen, spec, loaded, params, TokenClasses.for_model(loaded), text_field=text_field, encoding=encoding
    )
    return {name: frozenset(w.window_id for w in windows) for name, windows in picked.items()}


@contextmanager
def _broker_errors(url: str):
    """Redis lost while queuing: one line, not a traceback (what was sent stays queued)."""
    import kombu.exceptions
    import redis

    from headatlas.workers.broker_errors import refusal

    try:
        yield
    except (kombu.exceptions.OperationalError, redis.RedisError) as exc:
        refused = refusal(url, exc, kept=_KEPT)
        if refused is not None:
            raise refused from None
        if not isinstance(exc, (kombu.exceptions.OperationalError, redis.ConnectionError, redis.TimeoutError)):
            raise
        raise BrokerError(
            f"lost the broker at {url} while queuing ({type(exc).__name__}): submit again when it is back; "
            "what was queued is kept and nothing is queued twice"
        ) from None


def batch_payloads(
    spec: str,
    loaded,
    params: AnalysisParams,
    *,
    model: str,
    dtype: str,
    batch_size: int,
    database_id: str,
    text_field: str = "text",
    encoding: str = "utf-8",
    wanted: Callable[[int], bool] = lambda _b: True,
    workers: int = 1,
):
    """(batch id, windows, task payload or None when not ``wanted``) for every batch of the
    corpus, in order. Batch k holds windows k·batch_size … of the corpus, as in the embedded
    engine, so both engines add up the same partial sums. ``workers``: processes that tokenise and
    window the corpus (the same batches with any number). A measure that spreads its windows over
    the replicate groups (--effects) has them found first, as the embedded runner finds them
    (``_spread_windows``), and each payload's ``takes`` names the indices of its own."""
    from headatlas.service.engine.measure_contract import requested, spread_takes
    from headatlas.service.engine.run_plan import iter_batches
    from headatlas.service.engine.windows import TokenClasses

    tokens = TokenClasses.for_model(loaded)
    common = {
        "model": model,
        "dtype": dtype,
        "params": params.to_dict(),
        "tokenizer_key": loaded.tokenizer_key,
        "weights_key": loaded.weights_key,
        "database_id": database_id,
    }
    chosen = requested(params)
    picked = _spread_windows(spec, loaded, params, text_field=text_field, encoding=encoding)
    batches = iter_batches(
        spec, loaded, params, tokens, batch_size=batch_size, text_field=text_field, encoding=encoding, workers=workers
    )
    for batch_id, (batch, docs, _consumed) in enumerate(batches):
        payload = None
        if wanted(batch_id):
            payload = dict(
                common,
                documents=docs,
                first_window=batch_id * batch_size,
                windows=[w.to_message() for w in batch.windows],
            )
            if picked:
                payload["takes"] = {
                    name: list(take) for name, take in spread_takes(chosen, params, picked, batch.windows).items()
                }
        yield batch_id, len(batch.windows), payload


def _queue_probe(
    settings: Settings,
    ledger: Ledger,
    key: str,
    probe: ProbeSpec | None,
    *,
    model: str,
    dtype: str,
    loaded,
    readable: bool,
) -> bool:
    """Queue the run's probe (after its batches) unless the database holds this very probe; a
    database this machine cannot read gets it queued, and its writer skips a probe it holds."""
    from headatlas.workers.app import ANALYSIS_QUEUE, make_app

    if probe is None:
        return False
    spec = (probe.length, probe.sequences, probe.seed)
    if readable and _stored_probe(settings.db, key) == spec:
        return False
    message = {
        "database_id": ledger.database_id,
        "model": model,
        "dtype": dtype,
        "tokenizer_key": loaded.tokenizer_key,
        "weights_key": loaded.weights_key,
        "length": probe.length,
        "sequences": probe.sequences,
        "seed": probe.seed,
    }
    make_app(settings).send_task("headatlas.probe_run", args=[key, message], queue=ANALYSIS_QUEUE)
    return True


def _stored_probe(db: str, key: str) -> tuple[int, int, int] | None:
    from headatlas.service.storage.db import has_table, transaction
    from headatlas.service.storage.queue_store import find_run_by_key
    from headatlas.service.storage.store import probe_spec

    with transaction(db, read_only=True) as conn:
        has_probes = has_table(conn, "probe_scores")
        run = find_run_by_key(conn, key) if has_probes else None
        return None if run is None else probe_spec(conn, run.run_id)


def wait_for_run_id(ledger: Ledger, key: str, wait_s: float) -> int | None:
    deadline = time.monotonic() + wait_s
    while True:
        run_id, error = ledger.run_id(key)
        if error:
            raise StoreError(error)
        if run_id is not None or time.monotonic() >= deadline:
            return run_id
        time.sleep(WRITER_POLL_S)


def _stored_state(db: str, key: str):
    """(run, plan, ids of stored batches) from the database when this machine can read it."""
    from sqlalchemy import text

    from headatlas.service.storage.db import has_table, transaction
    from headatlas.service.storage.queue_store import find_run_by_key, plan_of

    if not open_backend(db).exists():
        return None, None, set()
    with transaction(db, read_only=True) as conn:
        has_plans = has_table(conn, "queue_plans")
        run = find_run_by_key(conn, key)
        if run is None:
            return None, None, set()
        plan = plan_of(conn, run.run_id) if has_plans else None
        done = {
            r[0]
            for r in conn.execute(
                text(f"SELECT batch_id FROM batches WHERE run_id = :r AND status = {sql(BatchStatus.DONE)}"),
                {"r": run.run_id},
            )
        }
    return run, plan, done if plan is not None else set()
