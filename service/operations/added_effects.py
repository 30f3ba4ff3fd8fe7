"""Causal effects added to a finished run (SPEC §9): ``headatlas effects RUN``, ``run.add_effects()``,
and ``analyze --effects`` on a corpus whose run without effects is stored.

The effects are those ``analyze --effects`` stores, on the same windows (``--windows`` of the run,
chosen by its rule, ``run_plan.effect_targets``: spread over its replicate groups, or its first for
a run stored before that rule; read again from its corpus, each checked to be a window the run
holds), the same reference set (its first ``--reference`` windows) and the same objective, summed
per replicate group as every other statistic. Each window is stored as a batch of its own that
holds its effect sums and zero for every other sum the run holds (so no other statistic changes),
under a batch id derived from the window's position in the run (``EFFECT_BATCH_BASE`` + position):
storing one twice is a no-op, more windows asked for later keep the ids of those stored, and an
interrupted measurement, run again, measures exactly the windows not yet stored.

A run holds one set of effects: more windows may be added with the kinds, objective and reference
it has; other kinds are refused, with what the run holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from headatlas.service.errors import Param, ParameterError, Part
from headatlas.service.operations.events import Estimate, Event, Sink, WindowsMeasured, ignore
from headatlas.service.operations.requests import AddEffectsRequest
from headatlas.service.operations.runs import find_run
from headatlas.service.params import EFFECT_FIELDS, AnalysisParams
from headatlas.service.statuses import BatchStatus, RunStatus, sql
from headatlas.service.storage.added_effect_rows import ANALYSED
from headatlas.service.storage.store import Run, Store
from headatlas.service.wording import counted

if TYPE_CHECKING:
    from headatlas.service.engine.windows import Window

# the batch ids of added effect windows: far above any analysis's (which count up from 0), one per
# window position
EFFECT_BATCH_BASE = 1 << 30


@dataclass(frozen=True)
class AddedEffects:
    """What ``add_effects`` did: the run (as stored after), the windows measured now, the effect
    windows it holds in all, and the seconds taken."""

    run: Run
    measured: int
    windows: int
    seconds: float


def add(store: Store, request: AddEffectsRequest, events: Sink = ignore, *, model=None) -> AddedEffects:
    """The effects ``request`` asks for, measured and stored in its run; ``events`` hears the run's
    note (once it is known not to be refused), the cost before it starts (``Estimate``) and every
    window measured (``WindowsMeasured``)."""
    held: list[Event] = []
    with store.checked_read() as conn:
        run = find_run(conn, request.run, held.append)
    for event in held:
        events(event)
    return add_effects(
        store,
        run,
        kinds=request.kinds,
        windows=request.windows,
        reference=request.reference,
        objective=request.objective,
        device=request.device,
        model=model,
        notice=lambda parts: events(Estimate(tuple(parts))),
        progress=lambda done, total: events(WindowsMeasured(done, total)),
    )


def effect_params(
    run: Run,
    *,
    kinds: tuple[str, ...],
    windows: int,
    reference: int | None,
    objective: str,
    spread: str | None = None,
) -> AnalysisParams:
    """The run's parameters with these effects, refused where the run holds others. ``spread``:
    which windows a run without effects gets them on (``--effect-spread``; None: the default); a
    run with effects keeps its own."""
    from headatlas.service.params import AUTO_OBJECTIVE

    params = AnalysisParams.from_dict(run.params)
    if params.effects:
        held = f"run {run.run_id} ({run.name}) holds effects {','.join(params.effects)}"
        if tuple(params.effects) != tuple(kinds):
            raise ParameterError(
                Param("effects", ",".join(kinds)),
                f": {held} on {counted(params.effect_windows, 'window')}; a run holds one set of effects: "
                "ask for the same kinds (more windows are added to them), or analyse the corpus into a new run "
                "with another name",
            )
        if objective not in (AUTO_OBJECTIVE, params.objective):
            raise ParameterError(Param("objective", objective), f": {held} measured on {params.objective}")
        if reference is not None and ("mean" in kinds or "atp" in kinds) and reference != params.effect_reference:
            raise ParameterError(
                Param("reference", reference),
                f": {held}, mean ablation against the run's first {params.effect_reference} windows; "
                "leave the reference out, or give that number",
            )
        windows = max(windows, params.effect_windows)
        reference, objective = params.effect_reference, params.objective
    elif spread is not None:
        params = replace(params, effect_spread=spread)
    return replace(
        params,
        effects=tuple(kinds),
        effect_windows=windows,
        effect_reference=reference if reference is not None else params.effect_reference,
        objective=objective,
    )


def add_effects(
    store: Store,
    run: Run,
    *,
    kinds: tuple[str, ...],
    windows: int,
    reference: int | None = None,
    objective: str = "auto",
    device: str = "auto",
    model=None,
    notice: Callable[[tuple[Part, ...]], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    spread: str | None = None,
) -> AddedEffects:
    """Measure the effects ``kinds`` on ``windows`` windows of run ``run`` (its rule's: ``spread``
    for a run without effects, ``effect_params``) and store them in it; windows already stored
    are not measured again. ``model``: a loaded model to use instead of
    the run's (it must be the run's); ``notice``: told the cost before it starts; ``progress``:
    (windows done, windows to do) after each window."""
    from headatlas.service.engine.effect_spread import groups_held
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.measures.effect_batch import check_effects, estimate, reference_means, window_effects
    from headatlas.service.reports.stored import refresh
    from headatlas.service.storage.added_effect_rows import record_added_effects

    check_addable(run)
    params = effect_params(run, kinds=kinds, windows=windows, reference=reference, objective=objective, spread=spread)
    began = time.perf_counter()
    loaded = model or load_model(run.model, device=device, dtype=params.dtype)
    check_effects(loaded, params)
    tokens = TokenClasses.for_model(loaded)
    chosen = effect_windows(store, run, loaded, params, tokens)
    todo = chosen.todo
    references = reference_windows(run, loaded, params, tokens) if todo and params.needs_means else []
    if todo and notice is not None:
        cost = estimate(loaded, params, [w for _, w in todo], len(todo), tokens.pad_id, reference=len(references))
        said = f"{cost.describe()}; {groups_held(params.replicates, chosen.targets)}"
        notice((f"{said}. Ctrl-C stops it, keeping every finished window (the same command resumes)",))
    means = reference_means(loaded, references, tokens.pad_id) if todo and params.needs_means else None
    # recorded first: what the run's effects are and how many windows they are meant to cover
    fields = effect_fields(params)
    store.atomically(lambda conn: record_added_effects(conn, run.run_id, fields, chosen.analysed))
    for k, (position, window) in enumerate(todo):
        result = window_effects(loaded, window, params, means=means, present=chosen.present, pad_id=tokens.pad_id)
        store.ingest(run.run_id, [(EFFECT_BATCH_BASE + position, result)])
        if progress is not None:
            progress(k + 1, len(todo))
    if todo:
        store.compact(run.run_id)
    # the run's row changed even where nothing was measured (the windows its effects cover, recorded
    # above): its results are stored again for it, or every later read would compute them
    refresh(store, run.run_id)
    with store.checked_read() as conn:
        from headatlas.service.storage.effect_rows import effect_windows as stored_windows

        total = stored_windows(conn, run.run_id)
    return AddedEffects(store.get_run(run.run_id), len(todo), total, time.perf_counter() - began)


def check_addable(run: Run) -> None:
    """Refuse a run effects cannot be added to: one not finished, or a random-weights control."""
    if run.status != RunStatus.DONE:
        raise ParameterError(
            f"run {run.run_id} ({run.name}) is {run.status}: effects are added to a finished run; "
            "finish it first (run its analysis again to resume it)"
        )
    if "control_of" in run.params:
        raise ParameterError(
            f"run {run.run_id} ({run.name}) is a random-weights control: add effects to the run it controls"
        )


def effect_fields(params: AnalysisParams) -> dict:
    """The run's stored parameters that say what its effects are (``EFFECT_FIELDS``)."""
    return {k: v for k, v in params.to_dict().items() if k in EFFECT_FIELDS}


@dataclass(frozen=True)
class EffectWindows:
    """The windows whose effects a run is to hold. ``targets``: every one of them, in the run's
    order; ``todo``: (position, window) of those not stored yet, position the window's in the run
    (``run_plan.effect_targets``), each stored as batch ``EFFECT_BATCH_BASE`` + position;
    ``analysed``: how many of them its analysis measured (the rule's first that many);
    ``present``: the sums (per head, per run) its rows hold (``window_effects`` gives them zeros);
    ``added``: the positions of those its analysis did not measure, stored or not: the batches
    ``EFFECT_BATCH_BASE`` + position the run is to hold (not a range: spread windows' positions
    have gaps)."""

    targets: list[Window]
    todo: list[tuple[int, Window]]
    analysed: int
    present: tuple[list[str], list[str]]
    added: list[int] = field(default_factory=list)


def effect_windows(store: Store, run: Run, model, params: AnalysisParams, tokens) -> EffectWindows:
    """Which windows get effects, and which of them are still to measure: the one rule, whether
    they are measured in this process or by the workers. ``model``: the run's (loaded, or its
    tokenizer alone: ``load_model_info``)."""
    from sqlalchemy import text

    from headatlas.service.engine.run_plan import effect_targets
    from headatlas.service.storage.added_effect_rows import present_sums

    # the windows whose effects its analysis measured (analyze --effects), if any: the run's rule's
    # first that many (nested in the rule's windows for more: a group's cap only grows with N)
    analysed = _analysed_windows(run)
    chosen = effect_targets(run.corpus, model, params, tokens)
    targets = [w for _position, w in chosen]
    measured = (
        {w.window_id for _p, w in effect_targets(run.corpus, model, params, tokens, analysed)} if analysed else set()
    )
    check_windows_of_run(store, run, targets)
    with store.checked_read() as conn:
        done = {
            int(b) - EFFECT_BATCH_BASE
            for (b,) in conn.execute(
                text(
                    "SELECT batch_id FROM batches WHERE run_id = :r AND batch_id >= :base "
                    f"AND status = {sql(BatchStatus.DONE)}"
                ),
                {"r": run.run_id, "base": EFFECT_BATCH_BASE},
            )
        }
        present = present_sums(conn, run.run_id)
    todo = [(p, w) for p, w in chosen if p not in done and w.window_id not in measured]
    added = [p for p, w in chosen if w.window_id not in measured]
    return EffectWindows(targets, todo, analysed, present, added)


def reference_windows(run: Run, model, params: AnalysisParams, tokens) -> list[Window]:
    """The reference set of mean ablation and attribution patching: the run's first
    ``effect_reference`` windows, whoever computes the means from them."""
    from headatlas.service.engine.run_plan import first_windows

    return first_windows(run.corpus, model, params, tokens, params.effect_reference)


def _analysed_windows(run: Run) -> int:
    """How many of the run's effect windows have effects from its analysis (``analyze --effects``,
    which measured its ``effect_windows`` windows, all of them, before it was done): those are not
    measured again. Runs that got their effects here record it; 0 for a run analysed
    without effects."""
    if ANALYSED in run.params:
        return int(run.params[ANALYSED])
    return int(run.params.get("effect_windows") or 0) if run.params.get("effects") else 0


def check_windows_of_run(store: Store, run: Run, windows) -> None:
    """Refuse to measure windows the run did not analyse (its corpus changed since): every one of
    ``windows`` must be among the run's stored windows."""
    held = store.done_window_ids(run.run_id)
    strangers = [w.window_id for w in windows if w.window_id not in held]
    if strangers:
        raise ParameterError(
            f"run {run.run_id} ({run.name}): its corpus {run.corpus} no longer gives the windows it analysed "
            f"({counted(len(strangers), 'window')} of the {len(windows)} to measure are not the run's): "
            "restore the corpus as it was, or analyse it into a new run"
        )
