"""Analysing a corpus in this process: the one sequence behind ``headatlas analyze``, ``headatlas
demo`` and ``headatlas.analyze``.

Every check that needs no model weights comes first (device, database file, model shape and
memory, then the whole corpus read and validated), so that a bad input is refused before a run
is stored or a model loaded. A run already finished is found from the model's identity alone
and returned without loading the weights. Then the model is loaded and checked against the
parameters, the corpus analysed (resuming what a killed run left), and each random-weights
control run over the same windows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from headatlas.service.engine.model import ModelInfo
from headatlas.service.engine.run_plan import CorpusSummary, stored_run_key, survey_corpus
from headatlas.service.interrupts import sigint_seen
from headatlas.service.operations.events import (
    CorpusRead,
    Estimate,
    PassEnded,
    PassStarted,
    Progress,
    RunReused,
    Sink,
    ignore,
)
from headatlas.service.operations.requests import AnalysisRequest
from headatlas.service.params import AnalysisParams
from headatlas.service.statuses import RunStatus
from headatlas.service.storage.store import Run, Store


@dataclass(frozen=True)
class Analysed:
    """What an analysis stored, and where: the run, its random-weights controls by seed, and
    whether the run was found finished (nothing analysed, no model loaded)."""

    store: Store
    run: Run
    controls: tuple[Run, ...] = ()
    found_finished: bool = False


def analyze(request: AnalysisRequest, events: Sink = ignore) -> Analysed:
    """Analyse ``request``'s corpus and store the run (and its controls); ``events`` hears what
    happens (service/operations/events.py)."""
    from headatlas.service.config import Settings
    from headatlas.service.engine.corpus import STDIN_SOURCE, remove_spool, spool_stdin
    from headatlas.service.engine.model import LoadedModel, resolve_device
    from headatlas.service.engine.model_check import check_model_spec
    from headatlas.service.storage.db import check_headatlas_file

    params, corpus = request.params, request.corpus
    given = request.model if isinstance(request.model, LoadedModel) else None
    store = Store(request.db, data_path=request.data_path)
    # every check that needs no model weights comes before the corpus is read or a model loaded
    resolve_device(request.device)
    store_every_s = Settings.from_env().store_every_s
    check_headatlas_file(store.backend)
    if given is None:
        check_model_spec(str(request.model), seq_len=params.seq_len, device=request.device)
    spooled = spool_stdin() if corpus.is_stdin else None
    spec, label = (str(spooled), STDIN_SOURCE) if spooled else (corpus.spec, None)
    try:
        # the whole corpus read and validated once: a bad line anywhere stores nothing
        summary = survey_corpus(spec, text_field=corpus.text_field, encoding=corpus.encoding, label=label)
        if request.control == 0:
            model = given if given is not None else str(request.model)
            done = finished_run(store, summary, model, params, name=request.name, probe=request.probe)
            if done is not None:  # found without loading the model's weights
                from headatlas.service.reports.stored import refresh

                refresh(store, done.run_id)  # results its first run could not store (a read-only data path)
                return Analysed(store, done, found_finished=True)
            if params.effects:  # the run without effects is stored: they are added to it
                plain = finished_run(
                    store, summary, model, _without_effects(params), name=request.name, probe=request.probe
                )
                if plain is not None:
                    return _add_effects(request, store, plain, events)
        events(CorpusRead(summary, None if given is not None else str(request.model)))
        with sigint_seen():  # a Ctrl-C whose interrupt Python drops still stops the run at its next batch
            return _analyse(request, store, spec, label, summary, store_every_s, events)
    finally:
        if spooled:
            remove_spool(spooled)


def _analyse(
    request: AnalysisRequest,
    store: Store,
    spec: str,
    label: str | None,
    summary: CorpusSummary,
    flush_s: float,
    events: Sink,
) -> Analysed:
    from headatlas.service.engine.model import LoadedModel, auto_batch_size, control_model, load_model
    from headatlas.service.engine.model_check import check_loaded
    from headatlas.service.operations.embedded_run import analyze_corpus, control_name

    params = request.params
    if isinstance(request.model, LoadedModel):
        loaded = request.model
    else:
        loaded = load_model(str(request.model), device=request.device, dtype=params.dtype)
    check_loaded(loaded, params.seq_len)
    size = request.batch_size if isinstance(request.batch_size, int) else auto_batch_size(loaded, params.seq_len)
    # the run and its controls analyse the same windows the same way
    run_on = functools.partial(
        analyze_corpus,
        spec,
        store=store,
        params=params,
        corpus=summary,
        batch_size=size,
        text_field=request.corpus.text_field,
        encoding=request.corpus.encoding,
        label=label,
        attribution_chunk=request.attribution_chunk,
        flush_s=flush_s,
        probe=request.probe,
        notice=lambda parts: events(Estimate(tuple(parts))),
        progress=lambda windows, consumed: events(Progress(windows, consumed)),
    )
    with _pass(events, PassStarted(summary.chars, max_windows=params.max_windows)):
        run = run_on(model=loaded, name=request.name)
    if request.name is not None and run.name != request.name:
        events(RunReused(run, request.name))
    controls = []
    for seed in range(request.control):
        started = PassStarted(
            summary.chars, seed, request.control, loaded.n_layers, loaded.n_heads, max_windows=params.max_windows
        )
        with _pass(events, started):
            controls.append(
                run_on(
                    model=control_model(loaded, seed=seed),
                    name=control_name(request.name, seed) if request.name is not None else None,
                    control_of=run,
                    control_seed=seed,
                )
            )
    from headatlas.service.reports.stored import refresh

    with store.held():  # reading and storing them, back to back
        for done in (run, *controls):  # a finished run's metrics, intervals and roles, derived once
            refresh(store, done.run_id)
    return Analysed(store, run, tuple(controls))


def _without_effects(params: AnalysisParams) -> AnalysisParams:
    """``params`` with every effect option at its default: the parameters of the run without effects."""
    from dataclasses import replace

    from headatlas.service.analysis_options import DEFAULTS
    from headatlas.service.params import EFFECT_FIELDS

    return replace(params, **{name: DEFAULTS[name] for name in EFFECT_FIELDS})


def _add_effects(request: AnalysisRequest, store: Store, run: Run, events: Sink) -> Analysed:
    """``analyze --effects`` on a corpus whose run without effects is stored: the effects are
    measured on that run's windows and stored in it (operations/added_effects.py), not in a new run
    that would analyse every window again."""
    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.errors import Param
    from headatlas.service.operations.added_effects import add_effects
    from headatlas.service.operations.events import Notice

    params = request.params
    events(
        Notice(
            (
                f"run {run.run_id} ({run.name}) holds this analysis without effects: ",
                Param("effects", ",".join(params.effects)),
                " adds them to it (its other results are kept; only the effect windows are measured)",
            )
        )
    )
    added = add_effects(
        store,
        run,
        kinds=params.effects,
        windows=params.effect_windows,
        reference=params.effect_reference if params.needs_means else None,
        objective=params.objective,
        device=request.device,
        model=request.model if isinstance(request.model, LoadedModel) else None,
        notice=lambda parts: events(Estimate(tuple(parts))),
        spread=params.effect_spread,
    )
    return Analysed(store, added.run)


class _pass:
    """A pass over the corpus, told to the front end as it starts and as it ends (completed, or
    stopped where it was by an error or Ctrl-C)."""

    def __init__(self, events: Sink, started: PassStarted) -> None:
        self.events, self.started = events, started

    def __enter__(self) -> None:
        self.events(self.started)

    def __exit__(self, kind, _value, _traceback) -> None:
        self.events(PassEnded(completed=kind is None))


def finished_run(
    store: Store,
    corpus: CorpusSummary,
    model: str | ModelInfo,
    params: AnalysisParams,
    *,
    name: str | None,
    probe,
) -> Run | None:
    """The stored run of this corpus (its fingerprint and distinct documents), model and
    parameters when it is done, holds the probe asked for, and ``name`` is None or its name:
    found from the model's identity alone (its tokenizer, config and a sample of its weight
    files), without loading the weights, so analysing a finished run again returns at once."""
    from headatlas.service.engine.model import load_model_info
    from headatlas.service.errors import StoreError
    from headatlas.service.storage.queue_store import find_run_by_key
    from headatlas.service.storage.store import probe_spec

    if not store.backend.exists():
        return None
    info = load_model_info(model) if isinstance(model, str) else model
    try:
        with store.checked_read() as conn:
            key, _fingerprint = stored_run_key(conn, corpus, info, params.resolved(corpus.distinct))
            run = find_run_by_key(conn, key)
            if run is None or run.status != RunStatus.DONE or (name is not None and name != run.name):
                return None  # analysed, resumed, or named by the usual path
            if probe is not None and probe_spec(conn, run.run_id) != (probe.length, probe.sequences, probe.seed):
                return None
            return run
    except StoreError:  # a schema to upgrade first: the usual path does it
        return None


def demo_request(**options) -> AnalysisRequest:
    """The demo: the shipped Wikipedia excerpt, named ``demo`` (``options``: model, device,
    batch size, database)."""
    from headatlas.service.engine.corpus import demo_corpus_path

    return AnalysisRequest.build(str(demo_corpus_path()), name="demo", **options)
