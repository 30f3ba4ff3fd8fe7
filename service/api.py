"""The Python API for notebooks: the functions behind the CLI, returning tables.

    import headatlas
    run = headatlas.analyze("corpus.txt", db="atlas.duckdb", model="default")
    run                                     # <Run 1 'corpus-4794be' done, 52 windows>
    run.heads(ci=True).df()                 # a pandas DataFrame (pip install 'headatlas[pandas]')
    run.layers().arrow                      # the Arrow table, always there
    run.sql("SELECT layer, head, within_sentence_lift_dm FROM head_metrics ORDER BY 3 DESC LIMIT 5")
    atlas = headatlas.connect("atlas.duckdb")
    atlas.runs()
    atlas.run("corpus-4794be").layers()
    one = headatlas.inspect("The cat sat on the mat.", model="smollm2")   # one text, no database
    one.attention[3, 5], one.z[3, 5], one.csm(3, 5)                        # numpy

Column names are the SPEC's, exactly as ``headatlas query … --format json`` prints them; layers
and heads are 0-based. Reads open the database read-only for the duration of one call, so a
notebook never holds the file's lock between cells.

Errors are the library's own (``headatlas.service.errors``) and the built-in exceptions a Python
caller expects: a bad value raises ``ValueError``, an unknown run ``LookupError``, a missing
database ``FileNotFoundError``; their messages name keyword arguments (``layer=7``), not the
CLI's flags.
"""

from __future__ import annotations

import functools
import html
import inspect as _inspect
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from headatlas.service.analysis_options import BY_NAME, DEFAULTS
from headatlas.service.errors import DatabaseNotFound, HeadatlasError, ParameterError
from headatlas.service.storage.store import Run, Store, resolve_run

if TYPE_CHECKING:
    import pandas

    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.reports.inspection import InspectedText

F = TypeVar("F", bound=Callable[..., Any])


class IntervalWarning(UserWarning):
    """A run's intervals rest on too few replicate groups to be read (SPEC §5d)."""


# --- errors in Python terms ---------------------------------------------------------------------

# CLI flags whose keyword argument has another name
_ARGUMENT_OF_FLAG = {"timeout": "timeout_s", "method": "methods"}
# words that follow a flag in prose, never as its value ("pass --db in a writable folder")
_PROSE = frozenset(
    "a an and alone are as at by for from had in is it needs not now of on only or takes that the to was "
    "which with".split()
)
_FLAG = re.compile(r"--([a-z][a-z0-9-]*)(\s+(?:'[^']*'|\"[^\"]*\"|\S+?)(?=[:;,.)`]*(?:\s|$)))?")
_COMMANDS = (
    (re.compile(r"`headatlas runs`"), "`headatlas.connect(db).runs()`"),
    (re.compile(r"(?:run )?`headatlas analyze CORPUS[^`]*`"), "call `headatlas.analyze(corpus, db=...)`"),
)


@functools.cache
def _python_arguments() -> dict[str, bool]:
    """Every keyword argument of the public functions and methods: name -> whether it is a flag
    (a bool), so that ``--ci`` reads ``ci=True``."""
    out = {name: option.type is bool for name, option in BY_NAME.items()}
    callables = [analyze, connect, inspect, *(m for cls in (Atlas, RunView) for m in vars(cls).values())]
    for fn in callables:
        if callable(fn):
            for p in _inspect.signature(fn).parameters.values():
                if p.name not in ("self", "options"):
                    out.setdefault(p.name, isinstance(p.default, bool))
    return out


def python_terms(message: str) -> str:
    """A message of the library, in the terms of its Python API: ``--seq-len 0: …`` becomes
    ``seq_len=0: …``, ``--ci`` ``ci=True``, and a suggested ``headatlas runs`` / ``headatlas
    analyze`` command the call that does the same. Other commands (``headatlas db upgrade``) and
    flags that are no argument here (``pip install --no-deps``) stay as they are."""
    for pattern, call in _COMMANDS:
        message = pattern.sub(call, message)
    arguments = _python_arguments()

    def keyword(match: re.Match) -> str:
        flag, value = match.group(1), (match.group(2) or "")
        name = _ARGUMENT_OF_FLAG.get(flag, flag.replace("-", "_"))
        if name not in arguments:
            return match.group(0)
        word = value.strip()
        if not word or word in _PROSE:
            return (f"{name}=True" if arguments[name] else f"{name}=") + value
        if word[0] in "'\"" or re.fullmatch(r"-?\d+(\.\d+)?|[A-Z][A-Z0-9_]*|\{.*\}", word):
            return f"{name}={word}"
        return f"{name}={word!r}"

    return _FLAG.sub(keyword, message)


def _in_python_terms(fn: F) -> F:
    """Raise the library's errors from ``fn`` with their messages in Python terms."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HeadatlasError as exc:
            exc.args = (python_terms(str(exc)),)
            raise

    return wrapper  # type: ignore[return-value]


# --- tables ----------------------------------------------------------------------------------------


def table(columns: list[str], rows: list[tuple]) -> pa.Table:
    """Query rows as an Arrow table (types inferred per column; None is null)."""
    return pa.table({c: pa.array([r[i] for r in rows]) for i, c in enumerate(columns)})


class Table:
    """The rows of one question. ``.df()``: a pandas DataFrame; ``.arrow``: the Arrow table, which
    the object also reads as (``num_rows``, ``column_names``, ``column("x")``, ``to_pylist()``,
    ``len(t)``, ``t["x"]``; and any library that takes Arrow data: ``polars.DataFrame(t)``,
    ``pa.table(t)``). ``.notes``: what its numbers are measured against and how its intervals
    were made, as under a CLI table (also in the Arrow schema's metadata, ``headatlas.notes``)."""

    def __init__(self, arrow: pa.Table, *, what: str, notes: Sequence[str] = ()) -> None:
        self.what = what
        self.notes = tuple(n for n in notes if n)
        meta = {b"headatlas.notes": "\n".join(self.notes).encode()} if self.notes else None
        self.arrow = arrow.replace_schema_metadata(meta) if meta else arrow

    @classmethod
    def of(cls, columns: list[str], rows: list[tuple], *, what: str, notes: Sequence[str] = ()) -> Table:
        """A table of query rows (``columns``, ``rows`` as the query functions return them)."""
        return cls(table(columns, rows), what=what, notes=notes)

    def df(self) -> pandas.DataFrame:
        """The rows as a pandas DataFrame (its ``attrs["notes"]``: ``.notes``). Needs pandas:
        ``pip install 'headatlas[pandas]'``."""
        try:
            import pandas  # noqa: F401
        except ImportError:
            raise ImportError(
                "Table.df() needs pandas: pip install 'headatlas[pandas]' (or read .arrow, the Arrow table)"
            ) from None
        frame = self.arrow.to_pandas()
        frame.attrs["notes"] = list(self.notes)
        return frame

    def to_pandas(self) -> pandas.DataFrame:
        """The same as ``df()`` (pyarrow's name for it)."""
        return self.df()

    def to_pylist(self) -> list[dict]:
        """The rows as dicts, column name to value."""
        return self.arrow.to_pylist()

    def __len__(self) -> int:
        return self.arrow.num_rows

    def __getitem__(self, key):
        return self.arrow[key]

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "arrow":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.arrow, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | {n for n in dir(self.arrow) if not n.startswith("_")})

    def __arrow_c_stream__(self, requested_schema=None):
        return self.arrow.__arrow_c_stream__(requested_schema)

    def __repr__(self) -> str:
        return f"<Table {self.what}: {self.arrow.num_rows:,} rows × {self.arrow.num_columns} columns>"

    def _repr_html_(self) -> str:
        """A notebook's view: the first rows, then the notes."""
        shown = self.arrow.slice(0, 20)
        try:
            body = shown.to_pandas()._repr_html_()
        except ImportError:
            head = "".join(f"<th>{html.escape(c)}</th>" for c in shown.column_names)
            rows = "".join(
                "<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row.values()) + "</tr>"
                for row in shown.to_pylist()
            )
            body = f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
        more = f"<p>… {self.arrow.num_rows - 20:,} more rows</p>" if self.arrow.num_rows > 20 else ""
        notes = "".join(f"<p><small>{html.escape(n)}</small></p>" for n in self.notes)
        return f"<p>{html.escape(repr(self))}</p>{body}{more}{notes}"


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)


# --- the database and its runs ---------------------------------------------------------------------


@_in_python_terms
def connect(db: str | Path | None = None, *, data_path: str | Path | None = None, at: int | None = None) -> Atlas:
    """A results database (default: HEADATLAS_DB, else ``headatlas.duckdb``): a file, or a lake
    (``ducklake:postgres:dbname=… host=…``; ``data_path``: this machine's mount of its files,
    default HEADATLAS_DATA_PATH or what the lake recorded). ``at``: read it as of that snapshot
    (a lake; ``runs()`` shows each run's last one), so that numbers taken later are the same. A
    missing database raises FileNotFoundError."""
    from headatlas.service.config import Settings

    store = Store(db if db is not None else Settings.from_env().db, data_path=data_path, at=at)
    if not store.backend.exists():
        raise DatabaseNotFound(
            f"no database at {store.backend.label}: analyse a corpus into it first (headatlas.analyze(corpus, db=...))"
        )
    return Atlas(store)


@dataclass(frozen=True, repr=False)
class Atlas:
    """A results database: its runs, and read-only SQL over everything it holds."""

    store: Store

    def __repr__(self) -> str:
        return f"<Atlas {str(self.store.backend.label)!r}>"

    @_in_python_terms
    def runs(self) -> Table:
        """Every stored run: id, name, status, model, corpus, windows, times."""
        rows = self.store.list_runs()
        columns = list(rows[0]) if rows else ["run_id", "name", "status", "model", "corpus", "windows"]
        return Table.of(columns, [tuple(r[c] for c in columns) for r in rows], what="runs")

    @_in_python_terms
    def run(self, ref: str | int | None = None) -> RunView:
        """A run by id or name; the latest when ``ref`` is None. An unknown one raises
        LookupError."""
        with self.store.checked_read() as conn:
            return RunView.read(self.store, conn, ref)

    @_in_python_terms
    def sql(self, statement: str, *, max_rows: int = 100_000, timeout_s: float = 30.0) -> Table:
        """Read-only SQL over every run, the same sandbox as ``headatlas sql`` (one SELECT; at most
        ``max_rows`` rows; stopped after ``timeout_s`` seconds). ``Atlas.run(…).sql`` reads one run."""
        return _sql(self.store, statement, max_rows=max_rows, timeout_s=timeout_s, run_id=None)


def _sql(store: Store, statement: str, *, max_rows: int, timeout_s: float, run_id: int | None) -> Table:
    from headatlas.service.storage.readonly import run_readonly_sql

    result = run_readonly_sql(
        store.backend, statement, max_rows=max_rows, timeout_s=timeout_s, run_id=run_id, at=store.at
    )
    notes = [f"{max_rows:,} rows shown: the result had more (pass max_rows=…)"] if result.truncated else []
    return Table.of(result.columns, result.rows, what="sql" if run_id is None else f"sql, run {run_id}", notes=notes)


@dataclass(frozen=True, repr=False)
class RunView:
    """One stored run: its facts (``run``, as stored when this view was made) and its questions,
    each a ``Table``."""

    store: Store
    run: Run
    windows: int = 0  # windows stored when the view was made

    @classmethod
    def read(cls, store: Store, conn, ref: str | int | None) -> RunView:
        """The view of a run (by id or name; the latest when ``ref`` is None) through an open
        read connection."""
        from sqlalchemy import text

        run = resolve_run(conn, ref)
        windows = conn.execute(
            text("SELECT coalesce(sum(windows), 0) FROM run_chance WHERE run_id = :r"), {"r": run.run_id}
        ).scalar()
        return cls(store, run, int(windows or 0))

    def __repr__(self) -> str:
        return f"<Run {self.run.run_id} {self.run.name!r} {self.run.status}, {self.windows:,} windows>"

    @property
    def run_id(self) -> int:
        """The run's id (what ``headatlas … --run`` takes, as its name)."""
        return self.run.run_id

    @property
    def name(self) -> str:
        """The run's name."""
        return self.run.name

    @property
    def status(self) -> str:
        """created, running, done, interrupted or failed (when this view was made)."""
        return self.run.status

    @_in_python_terms
    def refresh(self) -> RunView:
        """The same run read again: its status and windows now."""
        with self.store.checked_read() as conn:
            return RunView.read(self.store, conn, self.run.run_id)

    def _query(self, query: Callable[..., Any], what: str, *, note: str = "", ci: bool = False, **kwargs: Any) -> Table:
        from headatlas.service.reports import queries
        from headatlas.service.reports.intervals import interval_note, scheme_of

        with self.store.checked_read() as conn:
            resolve_run(conn, self.run.run_id)  # still there
            columns, rows = (
                query(conn, self.run.run_id, ci=ci, **kwargs) if ci else query(conn, self.run.run_id, **kwargs)
            )
            warning = queries.interval_warning(conn, self.run.run_id) if ci else None
        notes = [note]
        if ci:
            notes.append(interval_note([scheme_of(self.run.params)]))
        if warning:
            notes.append(f"warning: {warning}")
            warnings.warn(warning, IntervalWarning, stacklevel=4)  # the caller's line: past the method and its wrapper
        return Table.of(columns, rows, what=f"{what}, run {self.run.run_id}", notes=notes)

    @_in_python_terms
    def heads(
        self, *, layer: int | None = None, sort: str | None = None, top: int | None = None, ci: bool = False
    ) -> Table:
        """Per head: every metric of ``headatlas query heads`` (with ``_lo``/``_hi`` when ``ci``),
        sorted by ``sort`` (descending) and cut to ``top`` rows when given."""
        from headatlas.service.reports import queries

        self._check(layer)
        return self._query(queries.heads, "heads", note=queries.LIFT_NOTE, layer=layer, sort=sort, top=top, ci=ci)

    @_in_python_terms
    def layers(self, *, ci: bool = False) -> Table:
        """Per layer: the metrics of ``headatlas query layers`` (the progression from early to final
        layers) and anchor distinctness."""
        from headatlas.service.reports import queries

        return self._query(queries.layers, "layers", note=queries.LIFT_NOTE, ci=ci)

    @_in_python_terms
    def boundaries(self, *, ci: bool = False) -> Table:
        """Per layer: within-sentence shares against their chances (plain and matched to distance)
        and attention to the sentence separators against uniform."""
        from headatlas.service.reports import queries

        return self._query(queries.boundaries, "boundaries", note=queries.LIFT_NOTE, ci=ci)

    @_in_python_terms
    def distances(self, layer: int, head: int | None = None, *, split: bool = False, ci: bool = False) -> Table:
        """Distance profile of a head (or a layer's heads pooled) against chance; ``split``: also
        the attended (signal) and not-attended (noise) pairs."""
        from headatlas.service.reports import queries

        self._check(layer, head)
        note = "lift = share of the high-similarity pairs at d / share of all pairs at d (chance)"
        return self._query(queries.distances, "distances", note=note, layer=layer, head=head, split=split, ci=ci)

    @_in_python_terms
    def mixing(self, *, layer: int | None = None, methods: list[str] | None = None) -> Table:
        """Attribution and mixing measures per layer (or ``layer``'s heads), one column set per
        method (``methods``: attention, attribution, rollout, norm, alti; default: all stored)."""
        from headatlas.service.reports import queries

        self._check(layer)
        return self._query(queries.mixing, "mixing", layer=layer, methods=methods)

    @_in_python_terms
    def discrepancy(self, *, method: str = "attribution", top: int | None = None) -> Table:
        """Per head: the Jensen–Shannon divergence between attention and ``method``'s rows,
        ranked, and the layer progression."""
        from headatlas.service.reports import queries

        return self._query(queries.discrepancy, "discrepancy", method=method, top=top)

    @_in_python_terms
    def sql(self, statement: str, *, max_rows: int = 100_000, timeout_s: float = 30.0) -> Table:
        """Read-only SQL over this run alone: every table and view (``head_metrics``,
        ``layer_metrics``, ``anchors``, ``windows``, …) holds its rows only. The sandbox of
        ``headatlas sql``: one SELECT, at most ``max_rows`` rows, stopped after ``timeout_s`` s."""
        return _sql(self.store, statement, max_rows=max_rows, timeout_s=timeout_s, run_id=self.run.run_id)

    def _check(self, layer: int | None, head: int | None = None) -> None:
        if layer is not None and not 0 <= layer < self.run.n_layers:
            raise ParameterError(
                f"layer={layer}: run {self.run.run_id} has layers 0..{self.run.n_layers - 1} (0-based)"
            )
        if head is not None and not 0 <= head < self.run.n_heads:
            raise ParameterError(f"head={head}: run {self.run.run_id} has heads 0..{self.run.n_heads - 1} (0-based)")


# --- analysing -------------------------------------------------------------------------------------


@_in_python_terms
def analyze(
    corpus: str | Path,
    *,
    db: str | Path | None = None,
    model: str | LoadedModel = DEFAULTS["model"],
    name: str | None = None,
    device: str = DEFAULTS["device"],
    batch_size: int | str = DEFAULTS["batch_size"],
    text_field: str = DEFAULTS["text_field"],
    encoding: str = DEFAULTS["encoding"],
    probe: bool = DEFAULTS["probe"],
    probe_length: int = DEFAULTS["probe_length"],
    probe_sequences: int = DEFAULTS["probe_sequences"],
    progress: bool = True,
    data_path: str | Path | None = None,
    **options: Any,
) -> RunView:
    """Analyse a corpus in this process (the embedded engine of ``headatlas analyze``) and return
    the stored run. ``options``: the analysis options by their Python names (``seq_len``,
    ``select``, ``gate``, ``sentences``, ``dtype``, …; see docs/SPEC.md). Resumes an unfinished
    run with the same corpus, model and options; a finished one is returned at once, without
    loading the model. ``probe``: also score every head on repeated random tokens (SPEC §8;
    ``probe_length`` = L, ``probe_sequences``), shown as ``induction_score``, ``duplicate_score``
    and ``prev_token_score`` in ``heads()``. ``progress``: a progress bar on stderr (a widget in a
    notebook where ipywidgets is installed). ``model``: a spec as ``--model`` takes it, or a model
    from ``headatlas.service.engine.model.load_model`` (loaded once for several corpora;
    ``device`` is then its own). ``db`` may
    be a lake (``ducklake:…``, with ``data_path``)."""
    from headatlas.service.analysis_options import build_params, parse_batch_size
    from headatlas.service.config import Settings
    from headatlas.service.engine.model import LoadedModel, auto_batch_size, load_model, resolve_device
    from headatlas.service.engine.model_check import check_loaded, check_model_spec
    from headatlas.service.engine.probe import ProbeSpec
    from headatlas.service.engine.runner import analyze_corpus, survey_corpus
    from headatlas.service.storage.db import check_headatlas_file

    params = build_params(**options)
    size = parse_batch_size(batch_size)
    spec = ProbeSpec(length=probe_length, sequences=probe_sequences) if probe else None
    settings = Settings.from_env()
    store = Store(db if db is not None else settings.db, data_path=data_path)
    given = model if isinstance(model, LoadedModel) else None
    resolve_device(device)
    check_headatlas_file(store.backend)
    if given is None:
        check_model_spec(str(model), seq_len=params.seq_len, device=device)
    summary = survey_corpus(str(corpus), text_field=text_field, encoding=encoding)
    done = _finished_run(store, summary, model, params, name=name, probe=spec)
    if done is not None:
        return done
    what = f"loading {model}" if given is None else "analysing"
    with _progress_bar(summary.chars, enabled=progress, what=what) as bar:
        loaded = given or load_model(str(model), device=device, dtype=params.dtype)
        check_loaded(loaded, params.seq_len)
        bar.start("analysing")
        run = analyze_corpus(
            str(corpus),
            store=store,
            model=loaded,
            params=params,
            corpus=summary,
            name=name,
            batch_size=size if isinstance(size, int) else auto_batch_size(loaded, params.seq_len),
            text_field=text_field,
            encoding=encoding,
            flush_s=settings.store_every_s,
            probe=spec,
            progress=bar.update,
        )
    with store.checked_read() as conn:
        return RunView.read(store, conn, run.run_id)


def _finished_run(store: Store, corpus, model: str | LoadedModel, params, *, name: str | None, probe) -> RunView | None:
    """The stored run with this corpus, model and options when it is done (runner.finished_run)."""
    from headatlas.service.engine.runner import finished_run

    run = finished_run(store, corpus.fingerprint, corpus.distinct, model, params, name=name, probe=probe)
    if run is None:
        return None
    with store.checked_read() as conn:
        return RunView.read(store, conn, run.run_id)


class _Bar:
    """A progress bar over the corpus's characters, showing windows and windows/s: tqdm's
    notebook widget where ipywidgets is installed, else its text bar on stderr (which a notebook
    shows too); nothing when disabled."""

    def __init__(self, total_chars: int, *, enabled: bool, what: str) -> None:
        self.windows, self.bar = 0, None
        if not enabled:
            return
        try:
            import ipywidgets  # noqa: F401  (tqdm's notebook widget needs it; without, its text bar)
            from tqdm.auto import tqdm
        except ImportError:
            from tqdm.std import tqdm
        self.bar = tqdm(
            total=total_chars,
            desc=what,
            file=sys.stderr,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]",
            postfix="0 windows",
            dynamic_ncols=True,
        )

    def start(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(what, refresh=False)
            self.bar.reset(total=self.bar.total)

    def update(self, windows: int, consumed: int) -> None:
        self.windows += windows
        if self.bar is not None:
            rate = self.windows / max(self.bar.format_dict["elapsed"], 1e-9)
            self.bar.set_postfix_str(f"{self.windows:,} windows, {rate:.1f} windows/s", refresh=False)
            self.bar.update(consumed - self.bar.n)

    def close(self, finished: bool) -> None:
        if self.bar is not None:
            if finished:
                self.bar.update(self.bar.total - self.bar.n)
            self.bar.close()


@contextmanager
def _progress_bar(total_chars: int, *, enabled: bool, what: str) -> Iterator[_Bar]:
    bar = _Bar(total_chars, enabled=enabled, what=what)
    finished = False
    try:
        yield bar
        finished = True
    finally:
        bar.close(finished)


@_in_python_terms
def inspect(
    text: str,
    model: str | LoadedModel = DEFAULTS["model"],
    seq_len: int = DEFAULTS["seq_len"],
    *,
    device: str = DEFAULTS["device"],
) -> InspectedText:
    """One text through a model, nothing stored: the first window's token ids and tokens,
    ``attention`` ``[layer, head, query, key]``, ``z`` ``[layer, head, pos, d_head]`` (each head's
    output before W_O) and ``csm(layer, head)`` ``[n, n]`` (``C = z zᵀ``, ``C_ii = 0``), as numpy
    arrays; ``model``, ``causal``, ``n_layers``, ``n_heads``. The window is the one ``analyze``
    would make first (``seq_len`` tokens at most, specials included); ``truncated`` says whether
    the text went on. ``model``: a spec as ``--model`` takes it (the last one loaded is kept for
    the next call) or a model from ``headatlas.service.engine.model.load_model``."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.engine.model_check import check_loaded
    from headatlas.service.reports.inspection import read_text

    params = build_params(seq_len=seq_len)
    loaded = model if isinstance(model, LoadedModel) else _inspect_model(model, device)
    check_loaded(loaded, params.seq_len)
    return read_text(loaded, text, params)


@lru_cache(maxsize=1)
def _inspect_model(spec: str, device: str) -> LoadedModel:
    """A model for ``inspect``, loaded once for consecutive calls with the same spec and device."""
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.model_check import check_model_spec

    check_model_spec(spec, seq_len=2, device=device)  # the shape and memory; seq_len is checked per call
    return load_model(spec, device=device)


@_in_python_terms
def effects(
    corpus: str | Path,
    model: str | LoadedModel = DEFAULTS["model"],
    *,
    kinds: str = "zero,mean",
    windows: int = 16,
    reference: int = 256,
    seq_len: int = DEFAULTS["seq_len"],
    batch_size: int = 4,
    device: str = DEFAULTS["device"],
) -> Table:
    """Which heads the model needs (SPEC §9), measured on ``corpus`` in this process, nothing
    stored: one row per head with ``effect_zero``/``effect_mean`` (O(ablated) − O(intact), the
    model's own objective) and ``importance`` (``kinds`` with ``gradient``), each with its 95%
    interval (``_lo``, ``_hi``), and the output drift of each ablation. ``.notes`` says what the
    effects are measured against. The same as ``headatlas effects``."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.effect_runs import measure_effects
    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.engine.model_check import check_loaded
    from headatlas.service.measures.effects import parse_kinds

    params = build_params(seq_len=seq_len)
    loaded = model if isinstance(model, LoadedModel) else _inspect_model(model, device)
    check_loaded(loaded, params.seq_len)
    result = measure_effects(
        str(corpus),
        loaded,
        params,
        kinds=parse_kinds(kinds),
        windows=windows,
        reference=reference,
        batch_size=batch_size,
    )
    return Table.of(result.columns, result.rows, what=f"head effects: {result.model}", notes=[result.note()])
