"""Causal effects added to a finished run through the queue (``headatlas effects RUN --queue``): the
same windows, reference set and checks as the embedded ``effects RUN`` (operations/added_effects.py
decides them, here and there), each window measured by a worker and stored by the writer
(workers/submit_effects.py queues them). Nothing is measured or written here: this process reads
the run and its corpus, and queues.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headatlas.service.operations.events import Event, Sink, ignore
from headatlas.service.operations.requests import AddEffectsRequest
from headatlas.service.storage.store import Store

if TYPE_CHECKING:
    from headatlas.service.config import Settings
    from headatlas.workers.submit import Submission


def submit_added_effects(
    store: Store, request: AddEffectsRequest, settings: Settings, *, writer_wait_s: float, events: Sink = ignore
) -> Submission:
    """Queue the windows of ``request``'s run whose effects are neither stored nor in flight, after
    the embedded path's checks (a run not finished, a control, other effects than the run holds,
    an objective the model cannot give: refused before anything is queued). ``events`` hears the
    run's note. The submission's ``run_key`` is the measurement's (``submit_effects.effects_key``)."""
    from headatlas.service.engine.model import load_model_info
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.measures.effect_batch import check_effects_spec
    from headatlas.service.operations.added_effects import (
        EFFECT_BATCH_BASE,
        check_addable,
        effect_fields,
        effect_params,
        effect_windows,
        reference_windows,
    )
    from headatlas.service.operations.runs import find_run
    from headatlas.workers.submit_effects import submit_effects

    held: list[Event] = []
    with store.checked_read() as conn:
        run = find_run(conn, request.run, held.append)
    for event in held:
        events(event)
    check_addable(run)
    params = effect_params(
        run, kinds=request.kinds, windows=request.windows, reference=request.reference, objective=request.objective
    )
    check_effects_spec(run.model, params)
    model = load_model_info(run.model)  # the tokenizer: the windows are cut here, no weights loaded
    tokens = TokenClasses.for_model(model)
    chosen = effect_windows(store, run, model, params, tokens)
    references = reference_windows(run, model, params, tokens) if chosen.todo and params.needs_means else []
    return submit_effects(
        run.model,
        settings=settings,
        run=run,
        params=params,
        fields=effect_fields(params),
        analysed=chosen.analysed,
        windows=len(chosen.targets),
        todo=chosen.todo,
        references=references,
        present=chosen.present,
        batch_base=EFFECT_BATCH_BASE,
        writer_wait_s=writer_wait_s,
    )
