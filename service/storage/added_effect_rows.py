"""The rows of causal effects added to a finished run (SPEC §9, ``headatlas effects RUN``), written
inside the caller's transaction: what the run's effects are (its parameters), its rows made those
of a run with effects, the sums its rows hold, and the end of a queued measurement.

Both ways of adding effects write through here: in this process (operations/added_effects.py) and
through the queue, where the writer alone writes (workers/writer_ingest.py), and may find the run
changed since the measurement was asked.
"""

from __future__ import annotations

import json

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import StoreError
from headatlas.service.metrics import EFFECT_SUMS
from headatlas.service.statuses import RunStatus
from headatlas.service.storage.queue_store import Summary, stored_batches

# recorded in the run's stored parameters (outside the analysis parameters, as control_of is) the first
# time effects are added: how many of its first windows its analysis measured
ANALYSED = "effect_windows_analysed"

# the effect fields two measurements of one run must agree on (more windows may be added)
_SAME = ("effects", "effect_reference", "objective")


def record_added_effects(conn: Connection, run_id: int, fields: dict, analysed: int) -> dict:
    """Record the effects ``fields`` (the analysis parameters' ``EFFECT_FIELDS``) in run ``run_id``
    and make its rows those of a run with effects: the effect sums of its analysed batches zero
    where they are NULL (as an ``analyze --effects`` batch without effect windows carries them; a
    NULL left in any row would make the run's sum NULL, compact.strict_sum). ``analysed``: how many
    of its first windows its analysis measured, kept from the first time. A run that holds other
    effects by now is refused (``StoreError``), and nothing is written. Returns its parameters."""
    raw = conn.execute(text("SELECT params FROM runs WHERE run_id = :r"), {"r": run_id}).scalar()
    if raw is None:
        raise StoreError(f"no run {run_id} in the database")
    params = json.loads(raw) if isinstance(raw, str) else dict(raw)
    windows = int(fields["effect_windows"])
    if params.get("effects"):
        held = {k: params.get(k) for k in _SAME}
        if held != {k: fields.get(k) for k in _SAME}:
            raise StoreError(
                f"run {run_id} holds effects {','.join(params['effects'])} by now, not those asked "
                f"({','.join(fields['effects'])}): ask again for the effects it holds"
            )
        windows = max(windows, int(params.get("effect_windows") or 0))
    params.update(fields, effect_windows=windows)
    params.setdefault(ANALYSED, analysed)
    conn.execute(text("UPDATE runs SET params = :p WHERE run_id = :r"), {"p": json.dumps(params), "r": run_id})
    for column in (s for kind in fields["effects"] for s in EFFECT_SUMS[kind]):
        conn.execute(text(f"UPDATE head_stats SET {column} = 0 WHERE run_id = :r AND {column} IS NULL"), {"r": run_id})
    for column in ("effect_windows", "objective"):
        conn.execute(text(f"UPDATE run_chance SET {column} = 0 WHERE run_id = :r AND {column} IS NULL"), {"r": run_id})
    return params


def present_sums(conn: Connection, run_id: int) -> tuple[list[str], list[str]]:
    """The head statistics' sums (per head, per run) that run ``run_id``'s rows hold: an added
    batch gives them zeros (their columns refuse NULL, and zero adds nothing); the others (a sum
    its analysis did not compute) stay NULL."""
    from headatlas.service.engine.results import CHANCE_SUMS, HEAD_SUMS

    found: list[list[str]] = []
    for table, names in (("head_stats", HEAD_SUMS), ("run_chance", CHANCE_SUMS)):
        counts = conn.execute(
            text(f"SELECT {', '.join(f'count({n})' for n in names)} FROM {table} WHERE run_id = :r"), {"r": run_id}
        ).one()
        found.append([n for n, c in zip(names, counts) if c])
    return found[0], found[1]


def check_finished(conn: Connection, run_id: int, run_key: str) -> None:
    """Refuse (``StoreError``) a run that is not there under ``run_key`` or not done: effects are
    added to a finished run."""
    row = conn.execute(
        text("SELECT status, name FROM runs WHERE run_id = :r AND run_key = :k"), {"r": run_id, "k": run_key}
    ).first()
    if row is None:
        raise StoreError(f"run {run_id} is no longer in the database: nothing of its effects is stored")
    if row[0] != RunStatus.DONE:
        raise StoreError(f"run {run_id} ({row[1]}) is {row[0]}: effects are added to a finished run")


def queued_summary(conn: Connection, run_id: int, planned: set[int], failed: set[int]) -> Summary:
    """A queued measurement of added effects as the database holds it: done once every batch of
    ``planned`` is stored, failed once the rest have failed (``failed``: as the ledger has them;
    a failure is not written into the run, whose own batches it is not)."""
    stored = stored_batches(conn, run_id) & planned
    gave_up = (failed & planned) - stored
    if len(stored) == len(planned):
        status = RunStatus.DONE
    elif len(stored) + len(gave_up) >= len(planned):
        status = RunStatus.FAILED
    else:
        status = RunStatus.RUNNING
    return Summary(status, len(stored), len(gave_up), 0)


def finish_queued(conn: Connection, run_id: int, planned: set[int]) -> bool:
    """Compact the run once every batch of ``planned`` is stored (the views read few rows again,
    as after any run's end); True then. Compacting twice changes nothing."""
    if not planned <= stored_batches(conn, run_id):
        return False
    from headatlas.service.storage.compact import compact_run

    compact_run(conn, run_id)
    return True
