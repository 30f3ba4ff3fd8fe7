"""The runs table: a run's row, finding or creating one, its status, and finding a run by
reference (id, name or alias; by default the latest finished one). Every function works in the
caller's transaction (``Store`` opens them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import RunNotFound, StoreError
from headatlas.service.statuses import UNFINISHED, BatchStatus, RunStatus, sql
from headatlas.service.storage import db, run_labels

RUN_COLUMNS = (
    "run_id, run_key, name, corpus, corpus_fingerprint, model, model_name, n_layers, n_heads, d_head, "
    "params, seq_len, short_range, engine, device, status, created_at, started_at, finished_at, "
    "compute_s, wall_s, error"
)

# DuckLake's virtual column snapshot_id: the snapshot that wrote the row
LAST_SNAPSHOT = (
    "greatest(r.snapshot_id, (SELECT max(b.snapshot_id) FROM batches b WHERE b.run_id = r.run_id), "
    "(SELECT max(p.snapshot_id) FROM probe_scores p WHERE p.run_id = r.run_id))"
)

# compute_s of a run on a lake: the sum over its stored batches (a per-batch update of the run's
# row would make every two writers of one run conflict)
LAKE_COMPUTE_S = (
    "(SELECT coalesce(sum(b.compute_s), 0) FROM batches b WHERE b.run_id = {t}.run_id "
    f"AND b.status = {sql(BatchStatus.DONE)})"
)

# database_info key, on a lake: the largest run id ever given (a file's sequence keeps its own)
LAST_RUN_ID = "last_run_id"

now = db.now


def run_columns(conn: Connection) -> str:
    """RUN_COLUMNS for ``SELECT … FROM runs``: on a lake, compute_s is the sum over the run's
    stored batches (``LAKE_COMPUTE_S``), which ingest does not add to the run's row."""
    if db.has_keys(conn):
        return RUN_COLUMNS
    summed = LAKE_COMPUTE_S.format(t="runs")
    return RUN_COLUMNS.replace("compute_s,", f"greatest(compute_s, {summed}) AS compute_s,")


def compute_s_sql(conn: Connection, alias: str = "r") -> str:
    """The SQL of a run's compute seconds, for ``FROM runs <alias>``: the row's on a file; on a
    lake at least the sum over its stored batches (``LAKE_COMPUTE_S``)."""
    if db.has_keys(conn):
        return f"{alias}.compute_s"
    return f"greatest({alias}.compute_s, {LAKE_COMPUTE_S.format(t=alias)})"


@dataclass(frozen=True)
class Run:
    run_id: int
    run_key: str
    name: str
    corpus: str
    corpus_fingerprint: str
    model: str
    model_name: str
    n_layers: int
    n_heads: int
    d_head: int
    params: dict
    seq_len: int
    short_range: int
    engine: str
    device: str | None
    status: RunStatus
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    compute_s: float
    wall_s: float
    error: str | None

    @classmethod
    def from_row(cls, row) -> Run:
        data = dict(row._mapping)
        if isinstance(data["params"], str):
            data["params"] = json.loads(data["params"])
        data["status"] = RunStatus(data["status"])
        return cls(**data)


def find_or_create(conn: Connection, values: dict, *, alias: str | None = None) -> tuple[Run, bool]:
    """The run with key ``values["run_key"]``, or a new one from ``values`` (run_key, name,
    corpus, fp, model, model_name, n_layers, n_heads, d_head, params (JSON), seq_len,
    short_range, engine, device, created_at). Returns (run, created). ``alias``: see
    ``Store.find_or_create_run``."""
    keys = db.has_keys(conn)
    if not keys:
        db.serialize(conn)  # two writers opening one run (or two runs named alike) take turns
    row = conn.execute(
        text(f"SELECT {run_columns(conn)} FROM runs WHERE run_key = :k"), {"k": values["run_key"]}
    ).first()
    if row is not None:
        run = Run.from_row(row)
        if alias is not None and alias != run.name:
            owner = run_labels.owner_of(conn, alias)
            if owner is not None and owner != run.run_id:
                raise StoreError(
                    f"run name {alias!r} is taken by run {owner}, and run {run.run_id} ({run.name}) already "
                    "holds this corpus, model and parameters: pass another --name, or leave it out"
                )
            run_labels.add_alias(conn, run.run_id, alias)
        return run, False
    name = values["name"]
    if run_labels.owner_of(conn, name) is not None:
        raise StoreError(
            f"run name {name!r} is taken by a run with other corpus, model or parameters: pass another --name"
        )
    columns = (
        "run_key, name, corpus, corpus_fingerprint, model, model_name, n_layers, n_heads, d_head, params, "
        "seq_len, short_range, engine, device, status, created_at"
    )
    given = (
        ":run_key, :name, :corpus, :fp, :model, :model_name, :n_layers, :n_heads, :d_head, :params, "
        f":seq_len, :short_range, :engine, :device, {sql(RunStatus.CREATED)}, :created_at"
    )
    if keys:
        row = conn.execute(
            text(f"INSERT INTO runs ({columns}) VALUES ({given}) RETURNING {RUN_COLUMNS}"), values
        ).first()
    else:  # no sequence on a lake: the next id, taken under serialize (above)
        run_id = _next_lake_run_id(conn)
        conn.execute(
            text(f"INSERT INTO runs (run_id, {columns}, compute_s, wall_s) VALUES (:run_id, {given}, 0, 0)"),
            {**values, "run_id": run_id},
        )
        row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs WHERE run_id = :r"), {"r": run_id}).first()
    return Run.from_row(row), True


def _next_lake_run_id(conn: Connection) -> int:
    """The next run id on a lake, past every id ever given (``LAST_RUN_ID``, which `runs delete`
    does not lower) and every id stored (a run copied in by `db copy`), as a file's sequence
    does: a deleted run's id never reaches a new run, so a reference to it (a script's `--run 7`,
    a link) finds nothing rather than another run. Under ``db.serialize``, in the caller's
    transaction."""
    given = conn.execute(text("SELECT value FROM database_info WHERE key = :k"), {"k": LAST_RUN_ID}).scalar()
    stored = conn.execute(text("SELECT coalesce(max(run_id), 0) FROM runs")).scalar_one()
    run_id = max(int(given or 0), int(stored)) + 1
    if given is None:
        conn.execute(text("INSERT INTO database_info VALUES (:k, :v)"), {"k": LAST_RUN_ID, "v": str(run_id)})
    else:
        conn.execute(text("UPDATE database_info SET value = :v WHERE key = :k"), {"k": LAST_RUN_ID, "v": str(run_id)})
    return run_id


def set_status(
    conn: Connection,
    run_id: int,
    status: RunStatus,
    *,
    error: str | None = None,
    started: bool = False,
    finished: bool = False,
    add_wall_s: float = 0.0,
) -> None:
    sets = ["status = :status", "error = :error", "wall_s = wall_s + :wall"]
    if started:
        sets.append("started_at = coalesce(started_at, :ts)")
    if finished:
        sets.append("finished_at = :ts")
    conn.execute(
        text(f"UPDATE runs SET {', '.join(sets)} WHERE run_id = :run_id"),
        {"status": RunStatus(status).value, "error": error, "ts": now(), "run_id": run_id, "wall": add_wall_s},
    )


def listed(conn: Connection, *, tags: tuple[str, ...] = ()) -> list[dict]:
    """Every run (with ``tags``: those that have all of them), with its ``aliases`` and ``tags``
    (lists); on a lake with the last snapshot that changed it (``snapshot``)."""
    keys = db.has_keys(conn)
    compute = compute_s_sql(conn)
    # a lake: the last snapshot that changed the run (its row, its ledger, its probe): what
    # `--at` reads to see the run as it is now
    snapshot = "" if keys else f", {LAST_SNAPSHOT} AS snapshot"
    rows = (
        conn.execute(
            text(
                "SELECT r.run_id, r.name, r.status, r.model_name AS model, r.corpus, "
                f"coalesce(c.windows, 0) AS windows, {compute} AS compute_s, r.wall_s, r.created_at, "
                f"r.finished_at{snapshot} FROM runs r LEFT JOIN chance_totals c USING (run_id) ORDER BY r.run_id"
            )
        )
        .mappings()
        .all()
    )
    labels = run_labels.labels(conn)
    out = []
    for row in rows:
        aliases, tagged = labels.get(row["run_id"], ([], []))
        if all(t in tagged for t in tags):
            out.append({**row, "aliases": aliases, "tags": tagged})
    return out


def resolve_run(conn: Connection, ref: str | int | None, *, any_status: bool = False) -> Run:
    """A run by id, name or alias; ``ref`` None: the default run (``pick_run``), or with
    ``any_status`` the latest run whatever its status (what ``headatlas status`` watches)."""
    if ref is None and any_status:
        row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs ORDER BY run_id DESC LIMIT 1")).first()
        if row is None:
            raise RunNotFound("no runs yet: run `headatlas analyze CORPUS` first")
        return Run.from_row(row)
    return pick_run(conn, ref)[0]


def pick_run(conn: Connection, ref: str | int | None) -> tuple[Run, str | None]:
    """The run ``ref`` names (id, name or alias), or by default the latest finished run that is
    not a random-weights control; with a note to show when the run is not finished, or when a
    later run is still in progress and was passed over (None otherwise)."""
    if ref is None:
        return _default_run(conn)
    ref_s = str(ref)
    if ref_s.isdigit():
        row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs WHERE run_id = :r"), {"r": int(ref_s)}).first()
    else:
        row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs WHERE name = :r"), {"r": ref_s}).first()
        if row is None and (aliased := run_labels.run_by_alias(conn, ref_s)) is not None:
            row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs WHERE run_id = :r"), {"r": aliased}).first()
    if row is None:
        raise RunNotFound(f"no run {ref_s!r}: see `headatlas runs` for ids and names")
    run = Run.from_row(row)
    return run, None if run.status == RunStatus.DONE else _unfinished(conn, run)


def _default_run(conn: Connection) -> tuple[Run, str | None]:
    # controls (analyze --control) are stored after their run: the latest run would be a control
    rows = conn.execute(
        text(
            f"SELECT {run_columns(conn)} FROM runs ORDER BY json_extract(params, '$.control_of') IS NOT NULL, run_id DESC"
        )
    ).all()
    if not rows:
        raise RunNotFound("no runs yet: run `headatlas analyze CORPUS` first")
    runs = [Run.from_row(r) for r in rows]
    latest = runs[0]
    if latest.status == RunStatus.DONE:
        return latest, None
    done = next((r for r in runs if r.status == RunStatus.DONE and _is_control(r) == _is_control(latest)), None)
    if done is None:
        return latest, _unfinished(conn, latest)
    return done, (
        f"run {latest.run_id} ({latest.name}) is {latest.status}; showing the latest finished run, "
        f"{done.run_id} ({done.name}): pass --run {latest.run_id} for the other's results so far"
    )


def _is_control(run: Run) -> bool:
    return "control_of" in run.params


def _unfinished(conn: Connection, run: Run) -> str:
    windows = conn.execute(text("SELECT count(*) FROM run_windows WHERE run_id = :r"), {"r": run.run_id}).scalar()
    if run.status in UNFINISHED:
        state = "in progress"
    else:
        state = f"{run.status}, not finished (re-run its command to resume)"
    return f"run {run.run_id} ({run.name}) is {state}: results so far, from {windows:,} windows"


def run_is_there(conn: Connection, run_id: int, run_key: str, *, hold: bool = False) -> bool:
    """Whether run ``run_id`` is still in the database under ``run_key``: `runs delete` may have
    deleted it while a writer stores it (its id is never given again: ``_next_lake_run_id``). ``hold``, on a
    lake, in the transaction that reserves the run's batches: the run's row is rewritten too, so
    that this transaction and a concurrent delete of the run conflict; the delete, tried again,
    sees the reservations and deletes them, and a store of them then conflicts with it in turn:
    no batch is stored into a run deleted meanwhile."""
    args = {"r": run_id, "k": run_key}
    if hold and not db.has_keys(conn):
        conn.execute(text("UPDATE runs SET status = status WHERE run_id = :r AND run_key = :k"), args)
    return bool(conn.execute(text("SELECT count(*) FROM runs WHERE run_id = :r AND run_key = :k"), args).scalar())
