"""A stored run's pruning curves: the one sequence behind ``headatlas prune`` and ``run.prune()``
(SPEC §9).

The run is found (a note when it is not finished), refused where a prune of it would measure
nothing sound (not analysed yet, still running), and its curves measured in this process and
stored with it (``service.operations.prune_runs``); or, with ``show``, its newest stored curves read
back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from headatlas.service.errors import ParameterError, Phrase
from headatlas.service.operations.events import Estimate, Event, PruneStarted, PruneStep, Sink, ignore
from headatlas.service.operations.requests import PruneRequest
from headatlas.service.operations.runs import find_run

if TYPE_CHECKING:
    from headatlas.service.storage.effect_rows import StoredPrune
    from headatlas.service.storage.store import Run, Store


@dataclass(frozen=True)
class Pruned:
    """The run and its curves (``saved``: as stored); ``measured``: False where they were read back."""

    run: Run
    saved: StoredPrune
    measured: bool


def prune(store: Store, request: PruneRequest, events: Sink = ignore) -> Pruned:
    """The pruning curves ``request`` asks for; ``events`` hears the run's note (once it is known not
    to be refused), the run pruned, the plan (``Estimate``) and every step of every curve."""
    from headatlas.service.operations.prune_runs import check_request, prune_run
    from headatlas.service.storage.effect_rows import load_prune

    held: list[Event] = []  # the run's note, said once it is known not to be refused
    with store.checked_read() as conn:
        run = find_run(conn, request.run, held.append)
        saved = load_prune(conn, run.run_id) if request.show else None
    if not request.show:
        check_request(run, orders=request.orders, seeds=request.seeds)
    for event in held:
        events(event)
    if request.show:
        if saved is None:
            raise ParameterError(
                f"run {run.run_id} ({run.name}) has no stored pruning curves: ",
                Phrase("run `prune` without --show", "call prune() without show=True"),
                parameter="show",
                value=True,
            )
        return Pruned(run, saved, measured=False)
    events(PruneStarted(run))
    _result, saved = prune_run(
        store,
        run,
        orders=None if request.orders is None else list(request.orders),
        step=request.step,
        seeds=request.seeds,
        windows=request.windows,
        reference=request.reference,
        device=request.device,
        on_step=lambda order, done, total, left: events(PruneStep(order, done, total, left)),
        on_plan=lambda said: events(Estimate((said,))),
    )
    return Pruned(run, saved, measured=True)
