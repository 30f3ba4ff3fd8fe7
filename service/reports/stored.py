"""A finished run's results, derived once and stored (``service/storage/run_results.py``).

``derive`` computes what the readers would (``query heads --ci``, ``query roles --stability``,
``query layers --ci``, and the ``*_metrics_reps`` rows that ``compare`` pairs) with the stored
copies bypassed; ``refresh`` stores them for a finished run
whose stored results are missing or stale: when a run ends (the embedded analysis, the queue's
writer, on a file or a lake) and at ``headatlas db upgrade`` (``fill``). The readers
(``queries.heads``, ``layer_queries.layers``, ``roles.roles``) use them only while they are current.

Deriving reads in one transaction, storing writes in another, which first checks that the run's
content is still what was read (a run changed meanwhile is left to its next refresh): a large
run's seconds of derivation never hold the database's write lock.
"""

from __future__ import annotations

import logging

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import HeadatlasError, StoreUnavailable
from headatlas.service.statuses import RunStatus
from headatlas.service.storage import run_results
from headatlas.service.storage.run_results import computed, load  # noqa: F401 - the readers' names, here too
from headatlas.service.storage.store import Store

log = logging.getLogger("headatlas.results")

Rows = tuple[list[str], list[tuple]]


def derive(conn: Connection, run_id: int) -> dict[str, Rows]:
    """Every stored kind of the run, computed."""
    from headatlas.service.reports import distance_queries, layer_queries, queries, roles
    from headatlas.service.reports.query_support import shared_reads

    with computed(), shared_reads():
        return {
            "heads": queries.heads(conn, run_id, ci=True),
            "roles": roles.roles(conn, run_id, stability=True),
            "layers": layer_queries.layers(conn, run_id, ci=True),
            # each metric on the whole run and without each replicate group: what compare pairs
            "head_reps": _reps(conn, run_id, "head_metrics_reps", "layer, head"),
            "layer_reps": _reps(conn, run_id, "layer_metrics_reps", "layer"),
            # a head's page: its distances against chance, with intervals, and its ten anchors
            "distances": distance_queries.head_distances(conn, run_id),
            f"anchors:{HEAD_PAGE_ANCHORS}": _anchors(conn, run_id, HEAD_PAGE_ANCHORS),
        }


HEAD_PAGE_ANCHORS = 10


def _anchors(conn: Connection, run_id: int, n: int) -> Rows:
    from headatlas.service.reports.queries import top_anchors

    named = top_anchors(conn, run_id, n)
    return ["layer", "head", "top_anchors"], [(*k, v) for k, v in sorted(named.items())]


def _reps(conn: Connection, run_id: int, view: str, keys: str) -> Rows:
    from headatlas.service.reports.query_support import replicate_view

    names, rows = replicate_view(conn, view, tuple(k.strip() for k in keys.split(",")), run_id)
    return list(names), list(rows)


def _status(conn: Connection, run_id: int) -> str | None:
    return conn.execute(text("SELECT status FROM runs WHERE run_id = :r"), {"r": run_id}).scalar()


def refresh(store: Store, run_id: int) -> bool:
    """Derive and store the results of run ``run_id`` if it is finished and they are missing or
    stale. Returns whether it stored them. Never raises: a run whose results could not be stored
    is read as before (its readers compute them), and the reason is logged."""
    try:
        with store.read() as conn:
            if not run_results.has_tables(conn) or _status(conn, run_id) != RunStatus.DONE:
                return False
            key = run_results.fingerprint(conn, run_id)
            stored = run_results.stored_key(conn, run_id)
            if key is None or stored == (key, run_results.derivation()):
                return False
            results = derive(conn, run_id)

        def work(conn: Connection) -> bool:
            if _status(conn, run_id) != RunStatus.DONE or run_results.fingerprint(conn, run_id) != key:
                return False  # changed since it was read: its next refresh stores it
            run_results.save(conn, run_id, key, results)
            return True

        return bool(store.atomically(work))
    except HeadatlasError as exc:  # the database refused them (a lake's data path read-only …): one line
        log.warning("warning: run %s: its results were not stored: %s", run_id, _not_stored(store, exc))
        return False
    except Exception:  # noqa: BLE001 - storing results is an optimisation: the readers compute them
        log.warning("run %s: its results were not stored (they are computed when read)", run_id, exc_info=True)
        return False


def _not_stored(store: Store, exc: HeadatlasError) -> str:
    """Why a run's results were not stored, and what to do, for one line."""
    from headatlas.service.storage.backends.lake_errors import DATA_PATH

    if isinstance(exc, StoreUnavailable) and exc.waits_for == DATA_PATH:
        where = getattr(store.backend, "data_path", None) or "(the one its catalogue records)"
        return (
            f"{DATA_PATH} {where} takes no file ({exc.cause}); they are computed when read; make it writable, "
            "then run the same command again to store them"
        )
    return f"{exc}; they are computed when read; run the same command again once that is fixed to store them"


def fill(store: Store) -> list[int]:
    """``refresh`` every finished run; returns the runs whose results were stored."""
    with store.read() as conn:
        if not run_results.has_tables(conn):
            return []
        ids = [
            int(r[0])
            for r in conn.execute(
                text("SELECT run_id FROM runs WHERE status = :s ORDER BY run_id"), {"s": RunStatus.DONE.value}
            )
        ]
    return [r for r in ids if refresh(store, r)]
