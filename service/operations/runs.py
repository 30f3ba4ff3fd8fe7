"""Asking a stored run a question: the run found by id, name or alias (or the default one), the
options checked against its shape, the query run, and the warnings its answer carries. The CLI's
`query …` commands and the Python API's run views ask through here, so a question is checked and
answered the same way in both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from headatlas.service.errors import ANALYZE, RUNS, RunNotFound
from headatlas.service.operations.events import Notice, ResultWarning, Sink, ignore
from headatlas.service.storage.store import Run, Store


def no_run(ref: str | int | None) -> RunNotFound:
    """No run has the id or name ``ref`` (None: the database holds no run yet)."""
    if ref is None:
        return RunNotFound("no runs yet: ", ANALYZE, " first")
    return RunNotFound(f"no run {str(ref)!r}: see ", RUNS, " for ids and names")


def find_run(conn: Connection, ref: str | int | None, events: Sink = ignore, *, any_status: bool = False) -> Run:
    """The run ``ref`` names (id, name or alias), or by default the latest finished run that is
    not a random-weights control (``any_status``: the latest run, whatever its status). When the
    run is not finished, or a later run in progress was passed over, ``events`` hears a notice."""
    from headatlas.service.storage.store import pick_run, resolve_run

    try:
        if any_status:
            return resolve_run(conn, ref, any_status=True)
        run, said = pick_run(conn, ref)
    except RunNotFound:
        raise no_run(ref) from None
    if said:
        events(Notice((said,)))
    return run


def check_layer_head(run: Run, layer: int | None, head: int | None = None) -> None:
    """``layer`` and ``head`` (0-based) exist in ``run``'s model (service/layer_head.py)."""
    from headatlas.service.layer_head import check_layer_head as within

    within(layer, head, n_layers=run.n_layers, n_heads=run.n_heads, whose=f"run {run.run_id}")


def interval_warnings(conn: Connection, *runs: Run) -> list[str]:
    """Each run's warning that its intervals rest on too few replicate groups (SPEC §5d)."""
    from headatlas.service.reports.query_support import interval_warning

    return [w for w in (interval_warning(conn, r.run_id) for r in runs) if w]


@dataclass(frozen=True)
class Answer:
    """A question's rows and the run they are of; ``effects``: the causal effect columns that hold
    values (SPEC §9), and ``effects_note`` what they are measured against."""

    run: Run
    columns: list[str]
    rows: list[tuple]
    effects: tuple[str, ...] = ()
    effects_note: str | None = None
    groups: int | None = None  # replicate groups holding windows (R of the intervals), where asked with ci


def ask(
    store: Store,
    ref: str | int | None,
    query: Callable[..., tuple[list[str], list[tuple]]],
    *,
    ci: bool = False,
    events: Sink = ignore,
    **options: Any,
) -> Answer:
    """``query(conn, run_id, **options)`` of the run ``ref`` names, in one read: ``layer`` and
    ``head`` among the options are checked against the run's shape first; ``ci``: with 95%
    intervals. ``events`` hears the run's notice (not finished, or passed over) and, with ``ci``,
    the warning that the intervals rest on too few replicate groups."""
    with store.checked_read() as conn:
        run = find_run(conn, ref, events)
        check_layer_head(run, options.get("layer"), options.get("head"))
        columns, rows = query(conn, run.run_id, **options, **({"ci": True} if ci else {}))
        warnings = interval_warnings(conn, run) if ci else []
        effects = held_effects(columns, rows)
        said = effects_note(conn, run.run_id) if effects else None
        groups = groups_held(conn, run.run_id) if any(c.endswith("_lo") for c in columns) else None
    for warning in warnings:
        events(ResultWarning(warning))
    return Answer(run, columns, rows, effects, said, groups)


def groups_held(conn: Connection, run_id: int) -> int:
    from headatlas.service.reports.intervals import groups_held as held

    return held(conn, run_id)


def held_effects(columns: list[str], rows: list[tuple]) -> tuple[str, ...]:
    """The causal effect columns of a question's rows that hold a value (SPEC §9; the streaming
    effect of §10 last)."""
    from headatlas.service.metrics import EFFECT_COLUMNS

    effects = (*EFFECT_COLUMNS, "effect_streaming")
    return tuple(c for c in effects if c in columns and any(r[columns.index(c)] is not None for r in rows))


def effects_note(conn: Connection, run_id: int) -> str | None:
    """What a run's effects are measured against (its objective, unit and reference windows), and
    its streaming effects (the restriction shown)."""
    from headatlas.service.storage.effect_rows import effect_note
    from headatlas.service.storage.streaming_rows import streaming_note

    said = [n for n in (effect_note(conn, run_id), streaming_note(conn, run_id)) if n]
    return "\n".join(said) or None
