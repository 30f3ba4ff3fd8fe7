"""Queuing causal effects for a finished run (``headatlas effects RUN --queue``): one batch message
per window still to measure, for the workers, as ``submit`` queues a corpus's batches.

A batch is the analysis task's own message with ``added_effects`` in it: the worker measures that
one window's effects (``effect_batch.window_effects``, the function the embedded ``effects RUN``
calls) and sends the result to the writer like any batch; it never opens the database. The
measurement has a key of its own in Redis (the run's key, ``:effects:`` and a digest of the
effects asked), under which its batches are queued, tracked and waited for; its description names
the run the writer stores them into, what the run's effects are, and the batches it is to hold.
Each window's batch id is the embedded one's (``EFFECT_BATCH_BASE`` + position), so a window is
stored once whichever way it was measured, and a second submission queues only the windows neither
stored nor in flight.
"""

from __future__ import annotations

import hashlib
import json

from headatlas.service.config import Settings
from headatlas.service.params import AnalysisParams
from headatlas.service.statuses import RunStatus
from headatlas.service.storage.store import Run
from headatlas.workers.ledger import Ledger, connect
from headatlas.workers.messages import OpenRun
from headatlas.workers.submit import SEND_CHUNK, Submission, _broker_errors, _refusals_said, wait_for_run_id


def effects_key(run: Run, fields: dict) -> str:
    """The measurement's key in Redis: the run's and the effects asked (kinds, reference,
    objective; not the windows, which a later submission may raise), so that two submissions
    asking for other effects never share reference means or a description."""
    asked = {k: fields.get(k) for k in ("effects", "effect_reference", "objective")}
    digest = hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()[:12]
    return f"{run.run_key}:effects:{digest}"


@_refusals_said
def submit_effects(
    spec: str,
    *,
    settings: Settings,
    run: Run,
    params: AnalysisParams,
    fields: dict,
    analysed: int,
    windows: int,
    todo: list[tuple[int, object]],
    references: list,
    present: tuple[list[str], list[str]],
    batch_base: int,
    writer_wait_s: float = 20.0,
) -> Submission:
    """Queue the windows ``todo`` ((position in the run, window) not stored) of run ``run``
    (``spec``: its model) for the workers, but those in flight already. ``windows``: how many its
    effects are to cover, ``analysed`` of them measured by its analysis. ``fields``: the effect
    fields the writer records in the run; ``references``: the reference windows of mean ablation;
    ``present``: the sums the run's rows hold. The submission's batches are those of ``todo``: the
    measurement is done once they are all stored (a later submission names those still missing)."""
    from headatlas.service.engine.model import load_model_info
    from headatlas.workers.app import ANALYSIS_QUEUE, make_app, send_batch
    from headatlas.workers.lease import broker_epoch, target_database

    key = effects_key(run, fields)
    missing = {batch_base + p for p, _w in todo}
    client = connect(settings.broker_url)  # fail before any work when Redis is away
    epoch = broker_epoch(client)
    ledger = Ledger(client, target_database(client, settings.db, settings.broker_url, writer_wait_s))
    if not missing:
        return Submission(key, run.name, 1, 0, windows, 0, 0, ledger.database_id, run.run_id, RunStatus.DONE)
    loaded = load_model_info(spec)  # the tokenizer and the weights' identity, for the workers' check
    meta = {
        "run_key": key,
        "name": run.name,
        "effects_of": run.run_key,  # the run the writer stores the batches into
        "run_id": run.run_id,
        "effect_fields": fields,
        "analysed": analysed,
        "batch_ids": sorted(missing),
        "batch_size": 1,
        "batches": len(missing),
        "windows": windows,
    }
    if params.needs_means:  # the workers compute the means from them, as for a queued run
        meta["effect_reference"] = [w.to_message() for w in references]
    ledger.put_run(key, meta)  # before any message: the writer opens the measurement from it
    # what an earlier submission ended with (done, or refused) is not this one's
    ledger.r.hdel(ledger.key("run", key), "status", "error")
    ledger.reconcile_done(key, set())  # none of them is stored: the database is the truth
    skip = ledger.in_flight(key) - ledger.stranded(key, ANALYSIS_QUEUE)
    common = {
        "model": spec,
        "dtype": params.dtype,
        "params": params.to_dict(),
        "tokenizer_key": loaded.tokenizer_key,
        "weights_key": loaded.weights_key,
        "database_id": ledger.database_id,
        "documents": [],
        "added_effects": {"present": [list(present[0]), list(present[1])]},
    }
    app = make_app(settings)
    ledger.send(OpenRun(ledger.database_id, key))
    queued = 0
    chunk: dict[int, dict] = {}

    def send(producer) -> None:
        ledger.keep_copies(key, {b: json.dumps(p) for b, p in chunk.items()})
        for batch_id, payload in chunk.items():
            send_batch(app, key, batch_id, payload, producer)
        ledger.mark_queued(key, list(chunk))
        chunk.clear()

    with _broker_errors(settings.broker_url), app.producer_or_acquire() as producer:
        for position, window in todo:
            batch_id = batch_base + position
            if batch_id in skip:
                continue
            chunk[batch_id] = dict(common, first_window=position, windows=[window.to_message()])  # type: ignore[attr-defined]
            queued += 1
            if len(chunk) >= SEND_CHUNK:
                send(producer)
        send(producer)
    result = Submission(
        key, run.name, 1, len(missing), windows, queued, len(missing) - queued, ledger.database_id, epoch=epoch
    )
    result.run_id = wait_for_run_id(ledger, key, writer_wait_s)
    return result
