"""Distributed runs: `submit`, `worker`, `writer`, `status`, `retry` (registered on the main app)."""

from __future__ import annotations

import shlex
import time
from dataclasses import replace

import typer

from headatlas.cli import options
from headatlas.cli.app import cli_terms
from headatlas.cli.console import stderr, stdout
from headatlas.cli.formats import Format, render_record
from headatlas.cli.messages import note, progress_bar, runnable
from headatlas.service.analysis_options import BY_NAME
from headatlas.service.config import Settings, check_broker_url
from headatlas.service.errors import render as render_text
from headatlas.service.statuses import ENDED, RunStatus
from headatlas.service.wording import counted

DbOpt, BrokerOpt = options.Db, options.Broker


def register(app: typer.Typer) -> None:
    for command in (submit, worker, writer, status, retry):
        app.command()(command)


def _store(db: str):
    from headatlas.service.storage.store import Store

    return Store(db)


def _settings(**overrides) -> Settings:
    """The HEADATLAS_* settings with this command's options over them, handed on to what it
    starts (workers, the writer, beat) as an argument."""
    if overrides.get("broker_url") is not None:
        check_broker_url(overrides["broker_url"])
    return replace(Settings.from_env(), **{k: v for k, v in overrides.items() if v is not None})


@options.analysis_options(exclude=("device",))
def submit(
    corpus: str = typer.Argument(
        ..., help="A .txt/.jsonl/.csv file, a directory or a glob (readable by the submitter only)."
    ),
    *,
    name: str | None = options.Name,
    analysis: options.AnalysisOptions,
    wait: bool = typer.Option(False, "--wait", help="Show progress until the run ends."),
    writer_wait: float = options.WriterWait,
    db: str = DbOpt,
    broker: str = BrokerOpt,
    checkpoints: str | None = typer.Option(
        None,
        "--checkpoints",
        metavar="DIR|GLOB|NAME@REV,…",
        help="Queue every checkpoint of one model instead of --model, as `analyze --checkpoints` takes them: "
        "each a run named <name>-step<N> on the same windows, recorded in the series --name (default: the "
        "folder's name) by the writer; submitting again queues only what is missing. Read it with "
        "`query trend --series`.",
    ),
) -> None:
    """Queue a corpus for the workers and print the run id (a re-submission queues only what is missing)."""
    from headatlas.service.operations.requests import QueuedAnalysis
    from headatlas.service.operations.submission import submit as queue

    request = QueuedAnalysis.build(corpus, name=name, **analysis.values)
    settings = _settings(db=db, broker_url=broker)
    if wait:
        _stranded_s()  # refused before anything is queued
    if checkpoints is not None:
        _submit_series(request, checkpoints, settings, wait=wait, writer_wait=writer_wait)
        return
    sub = queue(request, settings, writer_wait_s=writer_wait, events=_said)
    _told(sub)
    if wait and sub.status != RunStatus.DONE:
        _wait(settings, sub, resubmit=lambda only=None: queue(request, settings, writer_wait_s=writer_wait, only=only))
    stdout.print(sub.run_id if sub.run_id is not None else sub.name)


def _submit_series(request, checkpoints: str, settings: Settings, *, wait: bool, writer_wait: float) -> None:
    """``submit --checkpoints``: every checkpoint queued (service/operations/submission.py), then
    waited for in step order with ``--wait``; one run id (or name) per checkpoint on stdout."""
    from headatlas.service.analysis_options import DEFAULTS
    from headatlas.service.operations.checkpoint_series import refuse_model
    from headatlas.service.operations.submission import submit_series

    if str(request.model) != DEFAULTS["model"]:
        refuse_model(request.model, checkpoints)
    done = submit_series(request, checkpoints, settings, writer_wait_s=writer_wait, events=_said)
    for queued in done:
        sub = queued.submission
        _told(sub)
        if wait and sub.status != RunStatus.DONE:
            _wait(
                settings,
                sub,
                resubmit=lambda only=None, queued=queued: queued.again(settings, writer_wait_s=writer_wait, only=only),
            )
    for queued in done:
        sub = queued.submission
        stdout.print(sub.run_id if sub.run_id is not None else sub.name)


def _told(sub) -> None:
    """What one submission queued, on stderr."""
    if sub.status == RunStatus.DONE:
        queued = "only its probe queued" if sub.probe_queued else "nothing queued"
        stderr.print(f"run {sub.run_id} ({sub.name}) is already complete: {queued}")
    else:
        stderr.print(
            f"run {sub.name}: {counted(sub.batches, 'batch')} of up to {counted(sub.batch_size, 'window')} "
            f"({counted(sub.windows, 'window')}); "
            f"queued {sub.queued:,}, {sub.skipped:,} already stored or queued"
        )
    if sub.probe_queued:
        stderr.print("probe: queued as one task; its scores reach `query heads` once a worker has run it")
    if sub.run_id is None:
        stderr.print(
            runnable("no writer has created the run yet: start `headatlas writer`; the batches wait in the queue")
        )


def _said(event) -> None:
    """What the submission tells as it plans: its notices on stderr, and a name the run does not take."""
    from headatlas.service.operations.events import NameKept, Notice

    if isinstance(event, Notice):
        stderr.print(render_text(event.text, cli_terms()))
    elif isinstance(event, NameKept):  # the queue does not write the database: the name is not added
        note(
            f"run {event.run_name} holds this corpus, model and parameters already and keeps its name; "
            f"`headatlas runs rename {shlex.quote(event.run_name)} {shlex.quote(event.asked)}` renames it"
        )


def _wait(settings, sub, resubmit=None, retried_by: str | None = None) -> None:
    """Progress as the database holds it: batches its writer has committed, until the database
    says the run ended and nothing of it is in flight any more. Redis away: it waits for it
    (saying so once); Redis back without its data: the missing batches are submitted again.
    ``retried_by``: what queues failed batches anew, where `headatlas retry` does not (added effects)."""
    import kombu.exceptions
    import redis

    from headatlas.service.errors import BrokerError, BrokerOutOfMemory, DatabaseNotFound
    from headatlas.workers.broker_errors import refusal
    from headatlas.workers.lease import broker_epoch
    from headatlas.workers.ledger import Ledger, connect

    ledger = Ledger(connect(settings.broker_url, check=False), sub.database_id)
    started, base, away, full, missing, live = time.monotonic(), None, False, False, False, None
    stranded: tuple[float, int, set[int]] | None = None  # first seen: when, batches done then, which
    with progress_bar("batches", "{task.fields[failed]} failed") as bar:
        task = bar.add_task("run", total=sub.batches, failed=0, rate=0.0)
        while True:
            try:
                if resubmit is not None and (
                    (sub.epoch and broker_epoch(ledger.r) != sub.epoch) or ledger.broker_lost(sub.run_key)
                ):
                    stderr.print(
                        "the broker lost this run's queued batches (Redis restarted without its data): "
                        "queuing what is not stored again"
                    )
                    again = resubmit()
                    sub.epoch, sub.run_id = again.epoch, sub.run_id or again.run_id
                    if again.status == RunStatus.DONE:  # the database holds it all: Redis has nothing left to say
                        live = None
                        break
                if away or full:
                    stderr.print("the broker is back; waiting for the run")
                    away = full = False
                if base is None:
                    base = ledger.windows_done(sub.run_key)
                live = ledger.live(sub.run_key)
                rate = (ledger.windows_done(sub.run_key) - base) / max(time.monotonic() - started, 1e-9)
                bar.update(task, completed=live.done + live.failed, failed=live.failed, rate=rate)
                if ledger.run_status(sub.run_key) in ENDED and not ledger.in_flight(sub.run_key):
                    break
                _check_writer(ledger, sub, settings)
                if resubmit is not None:
                    stranded = _requeue_stranded(ledger, sub, stranded, live.done, resubmit)
            except (redis.ResponseError, BrokerOutOfMemory) as exc:
                refused = exc if isinstance(exc, BrokerOutOfMemory) else refusal(settings.broker_url, exc)
                if not isinstance(refused, BrokerOutOfMemory):
                    raise
                if not full:  # the workers cannot store a result either: the run waits for memory
                    stderr.print(f"{refused}; waiting for it")
                    full = True
                time.sleep(1.0)
                continue
            except (redis.ConnectionError, redis.TimeoutError, kombu.exceptions.OperationalError, BrokerError) as exc:
                if not away:
                    stderr.print(
                        f"lost the broker at {settings.broker_url} ({type(exc).__name__}); waiting for it to come back"
                    )
                    away = True
                time.sleep(1.0)
                continue
            except DatabaseNotFound as exc:
                # moved away while a resubmission read it: its writer pauses until it is back; so
                # does this wait (the batches to queue again are tried once it is back)
                if not missing:
                    stderr.print(f"{exc}; waiting for it to come back, as its writer does")
                    missing = True
                stranded = None
                time.sleep(1.0)
                continue
            if missing:
                stderr.print("the database is back; waiting for the run")
                missing = False
            time.sleep(0.5)
    if sub.run_id is None:
        from headatlas.workers.submit import wait_for_run_id

        sub.run_id = wait_for_run_id(ledger, sub.run_key, 30.0)
    if live is not None and live.failed:
        stderr.print(
            runnable(
                f"{live.failed} batch(es) failed: {retried_by}"
                if retried_by
                else f"{live.failed} batch(es) failed: `headatlas status {sub.run_id}` shows why, "
                f"`headatlas retry {sub.run_id}` queues them again"
            )
        )


STRANDED_S: float | None = None  # workers/policy.py's RESUBMIT_STRANDED_S, unless set here (a test shortens it)


def _stranded_s() -> float:
    """How long batches stay stranded before `submit --wait` queues them again: read as it starts
    (a bad HEADATLAS_TIMING_RESUBMIT_STRANDED_S refused then in one line, not as the CLI imports)."""
    from headatlas.workers.policy import RESUBMIT_STRANDED_S

    return RESUBMIT_STRANDED_S if STRANDED_S is None else STRANDED_S


def _requeue_stranded(ledger, sub, seen, done: int, resubmit):
    """Batches in flight that no message carries (lost as Redis went down, ``Ledger.stranded``)
    are queued again once they stay so for STRANDED_S with nothing stored meanwhile: the run
    would otherwise never end. A batch analysed twice is stored once."""
    from headatlas.workers.policy import stranded_long_enough

    lost = ledger.stranded(sub.run_key)
    seen, now_due = stranded_long_enough(seen, lost, done, time.monotonic(), _stranded_s())
    if not now_due:
        return seen
    stderr.print(
        f"{len(lost)} queued batch(es) of run {sub.name} are in no queue and with no worker "
        "(their messages were lost as Redis went down): queuing them again"
    )
    ledger.unqueue(sub.run_key, lost)
    try:
        resubmit(only=lost)
    except Exception:
        ledger.mark_queued(sub.run_key, sorted(lost))  # still in flight, as before: found stranded again
        raise
    return None


def _check_writer(ledger, sub, settings) -> None:
    """A run whose database lost its writer to another database's would never end: say so."""
    from headatlas.service.errors import StoreError, WriterConflict
    from headatlas.workers.lease import holder

    _run_id, error = ledger.run_id(sub.run_key)
    if error:
        raise StoreError(error)
    other, _raw = holder(ledger.r)
    if other is not None and other.database_id and other.database_id != ledger.database_id:
        raise WriterConflict(
            f"the writer on {settings.broker_url} now stores into {other.describe()}, not into the database of "
            f"run {sub.name} ({ledger.database_id[:8]}): start a writer on that database, then submit again"
        )


def worker(
    queues: str = typer.Option("analysis", "--queues", "-Q", help="Queues to consume, comma-separated."),
    concurrency: int | None = typer.Option(
        None,
        "--concurrency",
        "-c",
        min=1,
        help="CPU: processes sharing the cores (default 1). GPU: ignored, one process per GPU.",
    ),
    device: str = options.declared_option(BY_NAME["device"], help="auto (every GPU, else CPU), cpu, cuda or cuda:N."),
    broker: str = BrokerOpt,
    loglevel: str = options.Loglevel,
) -> None:
    """Run analysis workers: take batches from the queue, send their statistics to the writer."""
    import re

    from headatlas.service.errors import ModelError
    from headatlas.workers.launch import check_concurrency, run_worker

    check_concurrency(concurrency)  # before anything starts
    if device is not None and not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ModelError(f"--device {device!r}: use auto, cpu, cuda or cuda:N")
    settings = _settings(broker_url=broker, device=device)
    run_worker(settings, queues=queues, concurrency=concurrency, loglevel=loglevel)


def writer(
    db: str = DbOpt,
    broker: str = BrokerOpt,
    loglevel: str = options.Loglevel,
) -> None:
    """Run the database writer: the one process that stores queued runs' results (run one per database)."""
    import logging

    from headatlas.workers.launch import run_writer

    settings = _settings(db=db, broker_url=broker)
    logging.getLogger("headatlas").setLevel(loglevel.upper())
    run_writer(settings)


def status(
    run: str | None = typer.Argument(None, help="Run id, name or alias (default: the latest run, finished or not)."),
    db: str = DbOpt,
    broker: str = BrokerOpt,
    fmt: Format = options.Fmt,
) -> None:
    """Where a run stands: batches done / running / failed / pending, windows/s, ETA."""
    from headatlas.service.errors import BrokerDatabaseOutOfRange, BrokerError, BrokerOutOfMemory
    from headatlas.workers.broker_errors import refusals_said
    from headatlas.workers.ledger import connect
    from headatlas.workers.status import run_status

    check_broker_url(broker)
    from headatlas.service.errors import StoreUnavailable
    from headatlas.service.storage.queue_store import resolve_run
    from headatlas.workers.policy import DELIVERY_GRACE_S  # noqa: F401 - the lease it follows, refused before any word of the broker

    try:
        with _store(db).checked_read() as conn:  # a damaged database or no such run: one error, no broker warning
            resolve_run(conn, run, any_status=True)
    except StoreUnavailable:
        _say_writer_pauses(broker)  # a lake's catalogue is down: what the writers wait for, then the error
        raise
    try:
        client = connect(broker)
    except (BrokerOutOfMemory, BrokerDatabaseOutOfRange):
        raise  # a Redis that is there but refuses: its fix, not the database's counts
    except BrokerError as exc:
        client = None
        stderr.print(f"{exc}; showing what the database knows")
    with refusals_said(broker):
        state = run_status(_store(db), run, client)
    # json: named fields with raw values; table and csv: the readable field/value rows
    render_record(state.record() if fmt == Format.json else dict(state.rows()), fmt)


def _say_writer_pauses(broker: str) -> None:
    import redis

    from headatlas.service.errors import BrokerError
    from headatlas.workers.ledger import connect
    from headatlas.workers.status import writer_pauses

    try:
        for line in writer_pauses(connect(broker)):
            stderr.print(f"warning: {line}", markup=False, highlight=False)
    except (BrokerError, redis.RedisError):
        pass


def retry(
    run: str = typer.Argument(..., help="Run id or name."),
    db: str = DbOpt,
    broker: str = BrokerOpt,
    writer_wait: float = options.WriterWait,
) -> None:
    """Queue the failed batches of a run again, with a fresh attempt count."""
    from headatlas.service.errors import CorpusError
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.queue_store import progress, run_and_plan
    from headatlas.workers.broker_errors import refusals_said
    from headatlas.workers.ledger import Ledger, connect
    from headatlas.workers.submit import submit as submit_corpus

    settings = _settings(db=db, broker_url=broker)
    store = _store(db)
    found, plan = run_and_plan(store, run)
    with store.checked_read() as conn:
        failed = [b for b, _a, _e in progress(conn, found.run_id, max_errors=10**9).errors]
    if not failed:
        stdout.print(f"run {found.run_id} ({found.name}): no failed batch to retry")
        return
    from headatlas.workers.lease import target_database
    from headatlas.workers.messages import ReopenFailed

    client = connect(broker)
    with refusals_said(broker, kept="nothing was queued again; retry once it has room"):
        ledger = Ledger(client, target_database(client, db, broker, writer_wait))
        ledger.reset_failed(found.run_key, failed)
        ledger.send(ReopenFailed(ledger.database_id, found.run_key))
    params = AnalysisParams.from_dict(found.params)
    try:
        sub = submit_corpus(
            found.corpus,
            settings=settings,
            model=found.model,
            dtype=params.dtype,
            params=params,
            batch_size=plan.batch_size,
            name=found.name,
            writer_wait_s=writer_wait,
            only=set(failed),
            expect_key=found.run_key,
        )
    except CorpusError as exc:
        raise CorpusError(f"{exc} (retry re-reads the corpus of run {found.run_id} from {found.corpus})") from None
    stdout.print(f"run {found.run_id} ({found.name}): {sub.queued} failed batch(es) queued again")
