"""The embedded run: corpus → windows → batches → analysis → store, in one process.

Streaming (memory does not grow with the corpus) and resumable: the run is identified by
corpus content, model and parameters; windows already counted are skipped on a re-run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from typing import TypeVar

from headatlas.service.config import Settings
from headatlas.service.engine.analysis import BatchResult, OomSplitter
from headatlas.service.engine.measure_contract import (
    Measure,
    batch_windows,
    probe_scores,
    requested,
    spread_takes,
)
from headatlas.service.engine.model import LoadedModel, ModelInfo
from headatlas.service.engine.prefetch import BackgroundSink, Prefetcher
from headatlas.service.engine.probe import ProbeSpec
from headatlas.service.engine.run_plan import (
    CorpusSummary,
    first_windows,
    iter_batches,
    short_name,
    spread_windows,
    stored_run_key,
    window_pool,
)
from headatlas.service.engine.windows import TokenClasses
from headatlas.service.errors import Part, StoreBusy
from headatlas.service.params import AnalysisParams
from headatlas.service.statuses import RunStatus
from headatlas.service.storage.store import Run, Store

log = logging.getLogger("headatlas.engine")
T = TypeVar("T")

ProgressFn = Callable[[int, int], None]  # (windows just analysed, corpus characters consumed)

# opens the database, writes one transaction and closes it (so that readers get in between), and the
# close checkpoints: fewer stores, less of that. At one store per batch (every 2 s on 2 cores) a run
# took 1.1-1.2x as long (benchmarks/store_interval.py); a kill -9 loses at most this much analysis,
# which the next run resumes.
FLUSH_S = Settings.default("store_every_s")
STORE_RETRY_MAX_S = 5.0  # longest pause between two tries to store while another process holds the file


def patiently(store_fn: Callable[[], T], *, what: str = "storing") -> T:
    """``store_fn()``, tried again for as long as another process (a long `sql`, another run, a
    writer) holds the database past the lock wait: a run is delayed by a reader, never failed
    by one. Says so once, then retries with backoff (1 s doubling to STORE_RETRY_MAX_S)."""
    delay, said = 1.0, False
    while True:
        try:
            return store_fn()
        except StoreBusy as exc:
            if not said:
                log.warning("%s waits: %s; the run keeps its results and tries again", what, exc)
                said = True
            time.sleep(delay)
            delay = min(2 * delay, STORE_RETRY_MAX_S)


def control_name(run_name: str, seed: int) -> str:
    """The stored name of ``run_name``'s random-weights control with ``seed``."""
    return f"{run_name}-control" if seed == 0 else f"{run_name}-control-{seed}"


def analyze_corpus(
    spec: str,
    *,
    store: Store,
    model: LoadedModel,
    params: AnalysisParams,
    corpus: CorpusSummary,
    name: str | None = None,
    batch_size: int = 32,
    text_field: str = "text",
    encoding: str = "utf-8",
    flush_s: float | None = None,
    progress: ProgressFn | None = None,
    label: str | None = None,
    attribution_chunk: int = 2048,
    control_of: Run | None = None,
    control_seed: int = 0,
    probe: ProbeSpec | None = None,
    notice: Callable[[tuple[Part, ...]], None] | None = None,
) -> Run:
    """Analyse a corpus in-process; resume the unfinished run with the same key if any.

    ``label``: how the corpus is named in the run (e.g. ``<stdin>`` for a spooled copy).
    ``flush_s``: finished batches are stored together at most this often (one transaction);
    default: ``HEADATLAS_STORE_EVERY_S`` (10 s).
    ``control_of``: this is the random-weights control of that run (``model.control_model``,
    built with ``control_seed``); the link is kept in the run's params as ``control_of`` = that
    run's key and ``control_seed``, outside the analysis parameters, so it changes no number and
    no key. Seed 0 is named ``<run>-control`` (the name a single control always had), seed k
    ``<run>-control-k``.
    ``probe``: also score every head on repeated random tokens (SPEC §8), once per run: it reads
    no corpus and changes no key, so a finished run given a probe computes just the probe.
    ``name``: the run's name when it is created; a run with the same key stored under another
    name keeps that name and gets this one as an alias (the returned run's ``name`` differs).
    ``notice``: told, before they start, what the slow parts will cost (each measure's estimate:
    ``--attribution``'s, ``--effects``' time and memory), as message parts (service/errors.py). On a
    CPU their windows go one per batch, so that an interrupted run keeps every window finished.
    """
    if flush_s is None:
        flush_s = Settings.from_env().store_every_s
    _import_lazy_dependencies()  # before the run exists: a Ctrl-C that breaks the import leaves nothing
    chosen = requested(params)
    for measure in chosen:
        measure.check(model, params)  # refused before the run is created
    patiently(store.ensure_schema)
    # the replicate scheme the corpus allows (SPEC §5d): keyed and recorded with the run
    params = params.resolved(corpus.distinct)
    with store.held():  # the run's first transactions, back to back, share one opening of the file
        key, fingerprint = patiently(lambda: _stored_key(store, corpus, model, params))
        stored_params = params.to_dict()
        asked = name  # a run already stored under another name gets the name asked for as an alias
        if control_of is not None:
            stored_params["control_of"] = control_of.run_key
            stored_params["control_seed"] = control_seed
            name = name or control_name(control_of.name, control_seed)
        run, _created = patiently(
            lambda: store.find_or_create_run(
                run_key=key,
                name=name or f"{short_name(label or spec)}-{key[:6]}",
                corpus=label or spec,
                corpus_fingerprint=fingerprint,
                model=model.describe(),
                params=stored_params,
                engine="embedded",
                device=str(model.device),
                alias=asked,
            )
        )
    if probe is not None:
        add_probe(store, run, model, probe)
    if run.status == RunStatus.DONE:
        return run

    ending = ExitStack()
    try:  # Ctrl-C from here on leaves the run marked interrupted, not created
        tokens = TokenClasses.for_model(model)
        with store.held():
            skip = patiently(lambda: store.done_window_ids(run.run_id))
            batch_id = patiently(lambda: store.next_batch_id(run.run_id))
        # a measure that takes the run's first N windows (--attribution-windows, --effect-spread
        # first) takes them by position, as in the queue: how many of them came before this resume
        before = {
            m.name: _windows_before(m, store, run, spec, model, params, tokens, skip, text_field, encoding, label)
            for m in chosen
            if m.quota(params) is not None and not m.spreads(params)
        }
        # one that spreads its N windows over the replicate groups (--effects): found before the
        # run, by the rule the submitter follows; a resumed run measures those not stored yet
        picked = spread_windows(
            chosen, spec, model, params, tokens, text_field=text_field, encoding=encoding, label=label
        )
        picked_ids = {name: frozenset(w.window_id for w in windows) for name, windows in picked.items()}
        todo = {name: [w for w in windows if w.window_id not in skip] for name, windows in picked.items()}
        left = {m.name: (m.quota(params) or 0) - n for m in chosen if (n := before.get(m.name)) is not None}
        left.update({name: len(windows) for name, windows in todo.items()})
        reference = None
        if params.needs_means and left.get("effects", 0) > 0:
            # mean ablation's reference set: the corpus's first effect_reference windows (fewer
            # where it has fewer), which the estimate below counts as they are
            reference = first_windows(
                spec,
                model,
                params,
                tokens,
                params.effect_reference,
                text_field=text_field,
                encoding=encoding,
                label=label,
            )
        single_first, alone = 0, set()
        for measure in chosen:
            count = left.get(measure.name, 0)
            if count <= 0:
                continue
            # on a CPU the slow windows go one per batch, so that an interrupted run keeps each
            singles = measure.single_first(model, params, count)
            if measure.name in todo:
                alone |= {w.window_id for w in todo[measure.name][:singles]}
            else:
                single_first = max(single_first, singles)
            if notice is not None and measure.has_estimate(params):
                upcoming = (
                    todo[measure.name]
                    if measure.name in todo
                    else first_windows(
                        spec,
                        model,
                        params,
                        tokens,
                        count,
                        skip=skip,
                        text_field=text_field,
                        encoding=encoding,
                        label=label,
                    )
                )
                counted_params = params
                if reference is not None:
                    counted_params = replace(
                        params, effect_reference=max(1, min(len(reference), params.effect_reference))
                    )
                said = measure.estimate(
                    model,
                    counted_params,
                    upcoming,
                    pad_id=tokens.pad_id,
                    batch_size=batch_size,
                    chunk_size=attribution_chunk,
                )
                if said:
                    notice(said)
        effect_means = None
        if reference is not None:
            from headatlas.service.measures.effect_batch import reference_means

            effect_means = reference_means(model, reference, tokens.pad_id)
        patiently(lambda: store.set_status(run.run_id, RunStatus.RUNNING, started=True))
    except KeyboardInterrupt:
        store.set_status(
            run.run_id, RunStatus.INTERRUPTED, error="interrupted by the user; re-run the same command to resume"
        )
        raise
    started = time.perf_counter()
    pending: list[tuple[int, BatchResult]] = []
    last_flush = time.perf_counter()
    status: RunStatus = RunStatus.DONE
    error: str | None = None
    # tokenisation runs ahead of the model, storing runs behind it (one thread each)
    # a reader holding the file only delays storing: the sink retries, and while it waits the
    # model goes on and finished batches gather in memory (stored together once it is free)
    pool = window_pool(model, tokens, params, corpus)  # forked before the run's threads start
    sink: BackgroundSink[list[tuple[int, BatchResult]]] = BackgroundSink(
        lambda items: patiently(lambda: store.ingest(run.run_id, items))
    )
    splitter = OomSplitter()
    batches = Prefetcher(
        iter_batches(
            spec,
            model,
            params,
            tokens,
            batch_size=batch_size,
            skip=skip,
            text_field=text_field,
            encoding=encoding,
            label=label,
            single_first=single_first,
            alone=alone,
            workers=pool or 1,
        )
    )
    try:
        for batch, docs, consumed in batches:
            for result in splitter.analyze(
                model,
                batch,
                params,
                tokens,
                docs,
                pad_id=tokens.pad_id,
                windows={
                    **batch_windows(chosen, params, before, len(batch.windows)),
                    **spread_takes(chosen, params, picked_ids, batch.windows),
                },
                attribution_chunk=attribution_chunk,
                effect_means=effect_means,
            ):
                before = {name: n + len(result.window_ids) for name, n in before.items()}
                pending.append((batch_id, result))
                batch_id += 1
            if time.perf_counter() - last_flush >= flush_s and sink.waiting() == 0:
                sink.submit(pending)
                pending, last_flush = [], time.perf_counter()
            if progress:
                progress(len(batch.windows), consumed)
        if pending:
            sink.submit(pending)
            pending = []
        # the last batch's payload (1.6 GB of averaged similarity sums at 4,096 tokens) is stored: let it go
        result = None  # type: ignore[assignment]
        sink.close()
        ending.enter_context(store.held())  # compacting, the status and the run read back, back to back
        patiently(lambda: store.compact(run.run_id))
    except KeyboardInterrupt:
        status, error = RunStatus.INTERRUPTED, "interrupted by the user; re-run the same command to resume"
        raise
    except BaseException as exc:
        status, error = RunStatus.FAILED, f"{type(exc).__name__}: {exc}"[:500]
        raise
    finally:
        batches.close()
        if pool is not None:
            pool.close()
        try:
            if pending and status == RunStatus.INTERRUPTED:
                sink.submit(pending)  # finished batches are kept
            sink.close()  # every submitted batch is stored before the status changes
        except BaseException:
            # interrupted or failed: the storage thread's own error (Ctrl-C can break an import it
            # was in) does not replace that; a batch it could not store is analysed on resume
            if status == RunStatus.DONE:
                raise
        try:
            patiently(
                lambda: store.set_status(
                    run.run_id,
                    status,
                    error=error,
                    finished=status == RunStatus.DONE,
                    add_wall_s=time.perf_counter() - started,
                )
            )
        finally:
            if status != RunStatus.DONE:
                ending.close()  # the run failed or was interrupted: nothing more to read
    with ending:
        return store.get_run(run.run_id)


def _import_lazy_dependencies() -> None:
    """pandas, where it is installed, imported before the run's threads start: pyarrow (building a
    batch's tables in the storage thread) and DuckDB (the main thread's queries) each import it on
    first use, and two threads importing it at once can meet each other's half-made module
    (``AttributeError: partially initialized module 'pandas'``, seen failing a run's storage)."""
    from importlib.util import find_spec

    if find_spec("pandas") is not None:
        import pandas  # noqa: F401


def _windows_before(
    measure: Measure,
    store: Store,
    run: Run,
    spec: str,
    model: LoadedModel,
    params: AnalysisParams,
    tokens: TokenClasses,
    skip: set[str],
    text_field: str,
    encoding: str,
    label: str | None,
) -> int:
    """How many of the run's first ``measure.quota`` windows ``measure`` has had: as the store counts
    them, or those of them stored (a resumed run's windows still to do come first in what is left)."""
    quota = measure.quota(params) or 0
    stored = patiently(lambda: measure.windows_stored(store, run.run_id))
    if stored is not None:
        return stored
    if not skip:
        return 0
    chosen = first_windows(spec, model, params, tokens, quota, text_field=text_field, encoding=encoding, label=label)
    return quota - sum(1 for w in chosen if w.window_id not in skip)


def add_probe(store: Store, run: Run, model: LoadedModel, probe: ProbeSpec) -> bool:
    """Compute and store the run's probe unless the same probe is stored; True when computed."""
    spec = (probe.length, probe.sequences, probe.seed)
    if store.probe_of(run.run_id) == spec:
        return False
    return store.store_probe(run.run_id, spec, probe_scores(model, probe))


def _stored_key(store, corpus: CorpusSummary, model: ModelInfo, params: AnalysisParams) -> tuple[str, str]:
    with store.checked_read() as conn:
        return stored_run_key(conn, corpus, model, params)
