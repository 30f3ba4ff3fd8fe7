"""What the queries of a run share (SPEC §5): fetching rows, the 95% intervals added to them, and
the columns a run's kind of attention leaves out. Returns (columns, rows).

Column names are SPEC names; layers and heads are 0-based (the papers count from 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.metrics import COLUMNS, plugin_metrics
from headatlas.service.reports.attention_kind import causal_run
from headatlas.service.reports.columns import PROBE_COLUMNS

# counts and run-level chances carry no interval of their own
NO_INTERVAL = {
    *(c.name for c in COLUMNS if not c.interval),
    "layer",
    "head",
    "windows",
    "heads",
    "top_anchors",
    "top_head",
    "heads_above_chance",
    "heads_above_chance_dm",
    "max_head_within_sentence",
    *PROBE_COLUMNS,  # one probe per run: no replicate groups
}

# What each lift is measured against, in one line (shown wherever lifts are printed).
LIFT_NOTE = (
    "lift = share / chance; *_lift: chance = all pairs of the window (ignores distance); "
    "*_lift_dm: chance matched to the head's own distances (SPEC §5b); "
    "attn_*_lift, dup_lift, induction_lift: against uniform attention over each row's visible keys. "
    ">1 = above that chance."
)

Rows = tuple[list[str], list[tuple]]
T = TypeVar("T")


def fetch_rows(conn: Connection, sql: str, params: dict) -> Rows:
    result = conn.execute(text(sql), params)
    # fetched at once: row by row, a head's distances (72,000 rows for MiniLM) took a second; and
    # as the driver's tuples (a text statement's values pass through SQLAlchemy unconverted): its
    # Row objects made into tuples again were half the cost of fetching them
    with result:
        return list(result.keys()), list(result.cursor.fetchall())


def interval_metrics(columns: list[str]) -> list[str]:
    """The columns of ``columns`` that get an interval (``--ci``): not NO_INTERVAL's, nor an
    installed plugin's declared without one."""
    plugged = {c.name for m in plugin_metrics() for c in m.columns if not c.interval}
    return [c for c in columns if c not in NO_INTERVAL and c not in plugged]


def replicate_scheme(conn: Connection, run_id: int) -> str:
    """The replicate scheme a run's intervals use, as the run recorded it (SPEC §5d): ``document``,
    ``block:B``, or ``window`` for runs stored before the scheme was recorded."""
    from headatlas.service.reports.intervals import WINDOW_SCHEME

    value = conn.execute(
        text("SELECT json_extract_string(params, '$.replicates') FROM runs WHERE run_id = :run"), {"run": run_id}
    ).scalar()
    return value or WINDOW_SCHEME


def with_intervals(
    conn: Connection,
    rows: Rows,
    *,
    view: str,
    keys: tuple[str, ...],
    run_id: int,
    where: str = "",
    params: dict | None = None,
    clip: bool = True,
    with_df: bool = False,
) -> Rows:
    """Add ``<metric>_lo``/``<metric>_hi`` (95%, delete-one-group jackknife) from ``view``'s
    leave-one-group-out rows, and ``interval_by``: the run's replicate scheme. ``clip``: bounds
    clipped to what each metric can take (``intervals.add_intervals``); False: unclipped, the
    interval the role tests read. ``with_df``: also ``<metric>_df``, the degrees of freedom of
    each interval's t quantile (the role tests' too). Lifts' intervals are on the log scale either way."""
    from headatlas.service.reports.intervals import add_intervals

    columns, values = rows
    metrics = [c for c in interval_metrics(columns) if c not in keys]
    shared = _SHARED.get()
    if shared is not None and not any(v is not None for v in (params or {}).values()):
        # the whole run's rows, read once for every reader within ``shared_reads``
        names, every = replicate_view(conn, view, keys, run_id)
        picked = [names.index(c) for c in (*keys, "drop_rep", *metrics)]
        drop = names.index("drop_rep")
        rep_rows: Sequence = [tuple(r[i] for i in picked) for r in every if r[drop] is not None and r[drop] >= 0]
    else:
        _, rep_rows = fetch_rows(
            conn,
            f"SELECT {', '.join(keys)}, drop_rep, {', '.join(metrics)} FROM {view} "
            f"WHERE run_id = :run AND drop_rep >= 0 {where} ORDER BY {', '.join(keys)}, drop_rep",
            {"run": run_id, **(params or {})},
        )
    return add_intervals(
        columns,
        values,
        rep_rows,
        keys=keys,
        metrics=metrics,
        scheme=replicate_scheme(conn, run_id),
        clip=clip,
        with_df=with_df,
        groups_of=effect_groups_of(conn, run_id, metrics),
    )


def without_intervals(rows: Rows) -> Rows:
    """``rows`` as read without ``ci``: ``with_intervals``' columns (``<metric>_lo``, ``<metric>_hi``,
    ``interval_by``) left out, as a stored result read for a reader that asked for none."""
    columns, values = rows
    added = {n for c in columns if f"{c}_lo" in columns and f"{c}_hi" in columns for n in (f"{c}_lo", f"{c}_hi")}
    added.add("interval_by")
    keep = [i for i, c in enumerate(columns) if c not in added]
    return [columns[i] for i in keep], [tuple(r[i] for i in keep) for r in values]


# Within ``shared_reads``: each replicate view's rows of a run, read once (view, run) → (columns, rows)
# (and other reads keyed by a tuple that starts with a reader's name: ``shared_cache``)
_SHARED: ContextVar[dict[tuple, Any] | None] = ContextVar("shared_replicate_rows", default=None)


def shared_cache() -> dict[tuple, Any] | None:
    """Within ``shared_reads``, the reads kept for the readers that follow (keys: tuples that
    start with the reader's name); None outside it."""
    return _SHARED.get()


def shared_value(key: tuple, compute: Callable[[], T]) -> T:
    """``compute()``, once for ``key`` within ``shared_reads`` (an immutable value: each reader
    gets the same object); computed at each call outside it."""
    shared = shared_cache()
    if shared is None:
        return compute()
    if key not in shared:
        shared[key] = compute()
    return cast(T, shared[key])


@contextmanager
def shared_reads() -> Iterator[None]:
    """Within it, every reader of a run's leave-one-group-out rows (``replicate_view``: the
    intervals of ``query heads --ci``, the role tests', ``compare``'s) reads each view once: a
    finished run's derivation (``reports.stored``) asked for head_metrics_reps three times, each
    a plan of the whole view chain (about 80 ms) for the same rows."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def one_read(wanted: bool = True) -> AbstractContextManager[None]:
    """``shared_reads`` for one reader's call (``wanted``), where none is open already: a reader
    that takes a run's values and their intervals from the same view (``queries.heads --ci``,
    ``layer_queries.layers --ci``, the role tests') plans its chain once, not twice, exactly as a
    derivation does. One call is one connection, and its statements read one snapshot."""
    return shared_reads() if wanted and _SHARED.get() is None else nullcontext()


def replicate_view(conn: Connection, view: str, keys: tuple[str, ...], run_id: int) -> Rows:
    """Every row of ``view`` (a ``*_reps`` view) for the run, ``run_id`` left out, ordered by
    ``keys`` then ``drop_rep``; read once within ``shared_reads``."""
    shared = _SHARED.get()
    if shared is not None and (view, run_id) in shared:
        return cast(Rows, shared[(view, run_id)])
    rows = fetch_rows(
        conn,
        f"SELECT * EXCLUDE (run_id) FROM {view} WHERE run_id = :run ORDER BY {', '.join(keys)}, drop_rep",
        {"run": run_id},
    )
    if shared is not None:
        shared[(view, run_id)] = rows
    return rows


def effect_groups_of(conn: Connection, run_id: int, metrics: list[str]) -> dict[str, frozenset[int]]:
    """The causal effects among ``metrics`` (SPEC §9, and the streaming effects of §10), each with
    the replicate groups that hold the windows they were measured on (the run's effect windows; the
    streaming windows of the restriction shown): their intervals rest on those groups alone."""
    from headatlas.service.metrics import EFFECT_COLUMNS, STREAMING_COLUMNS
    from headatlas.service.storage.effect_rows import effect_groups
    from headatlas.service.storage.streaming_rows import streaming_groups

    found: dict[str, frozenset[int]] = {}
    chosen = [m for m in metrics if m in EFFECT_COLUMNS]
    if chosen:
        groups = shared_value(("effect_groups", run_id), lambda: effect_groups(conn, run_id))
        found.update({m: groups for m in chosen})
    streamed = [m for m in metrics if m in STREAMING_COLUMNS]
    if streamed:
        groups = shared_value(("streaming_groups", run_id), lambda: streaming_groups(conn, run_id))
        found.update({m: groups for m in streamed})
    return found


def interval_groups(conn: Connection, run_id: int) -> tuple[int, int]:
    """(replicate groups holding windows, windows) of a run: what its intervals rest on."""
    groups, windows = conn.execute(
        text(
            "SELECT (SELECT count(*) FROM run_reps WHERE run_id = :run), "
            "(SELECT coalesce(sum(windows), 0) FROM run_chance WHERE run_id = :run)"
        ),
        {"run": run_id},
    ).one()
    return int(groups), int(windows)


def interval_warning(conn: Connection, run_id: int) -> str | None:
    """The warning to show beside a run's intervals when they rest on too few replicate groups
    (``intervals.unreliable_note``), else None."""
    from headatlas.service.reports.intervals import unreliable_note

    note = unreliable_note(*interval_groups(conn, run_id))
    return None if note is None else f"run {run_id}: {note}"


# A decoder has no [CLS] and no [SEP], and its rows never see the next token (SPEC §8): for a causal
# run the views' attn_to_cls is attn_to_first again, attn_to_sep is 0 or NULL and attn_to_next
# NULL. Its tables, figures and the report leave these out and show attn_to_first (BOS, the
# first token) instead; the SQL views keep them, with these values, for every run.
ENCODER_ONLY_COLUMNS = ("attn_to_cls", "attn_to_cls_lift", "attn_to_sep", "attn_to_sep_lift", "attn_to_next")
FIRST_TOKEN_COLUMNS = ("attn_to_first", "attn_to_first_lift")


def for_attention(conn: Connection, run_id: int, rows: Rows, *, encoder_hides: tuple[str, ...] = ()) -> Rows:
    """``rows`` without the columns the run's kind of attention has no use for: a causal run's
    ``ENCODER_ONLY_COLUMNS``, a bidirectional run's ``encoder_hides`` (with their intervals)."""
    hidden = ENCODER_ONLY_COLUMNS if causal_run(conn, run_id) else encoder_hides
    columns, data = rows
    if not hidden or not any(c in columns for c in hidden):
        return rows
    gone = {n for c in hidden for n in (c, f"{c}_lo", f"{c}_hi")}
    keep = [i for i, c in enumerate(columns) if c not in gone]
    return [columns[i] for i in keep], [tuple(r[i] for i in keep) for r in data]


def decoder_table(table: list[str], columns: list[str]) -> list[str]:
    """A table's default columns for the columns a query returned: ``attn_to_first_lift`` where a
    decoder's rows hold no ``attn_to_cls_lift``."""
    return [
        "attn_to_first_lift" if c == "attn_to_cls_lift" and c not in columns and "attn_to_first_lift" in columns else c
        for c in table
    ]
