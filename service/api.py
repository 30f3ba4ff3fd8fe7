"""The Python API for notebooks: the functions behind the CLI, returning Arrow tables.

    import headatlas
    run = headatlas.analyze("corpus.txt", db="atlas.duckdb", model="default")
    run.heads(ci=True).to_pandas()          # pandas when it is installed; Arrow always
    atlas = headatlas.connect("atlas.duckdb")
    atlas.runs()
    atlas.run("corpus-1a2b3c").layers()
    one = headatlas.inspect("The cat sat on the mat.", model="smollm2")   # one text, no database
    one.attention[3, 5], one.z[3, 5], one.csm(3, 5)                        # numpy

Column names are the SPEC's, exactly as ``headatlas query … --format json`` prints them; layers
and heads are 0-based. Reads open the database read-only for the duration of one call, so a
notebook never holds the file's lock between cells.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from headatlas.service.analysis_options import DEFAULTS
from headatlas.service.errors import ParameterError
from headatlas.service.storage.store import Run, Store, resolve_run

if TYPE_CHECKING:
    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.reports.inspection import InspectedText


def table(columns: list[str], rows: list[tuple]) -> pa.Table:
    """Query rows as an Arrow table (types inferred per column; None is null)."""
    return pa.table({c: pa.array([r[i] for r in rows]) for i, c in enumerate(columns)})


def connect(db: str | Path | None = None, *, data_path: str | Path | None = None, at: int | None = None) -> Atlas:
    """A results database (default: HEADATLAS_DB, else ``headatlas.duckdb``): a file, or a lake
    (``ducklake:postgres:dbname=… host=…``; ``data_path``: this machine's mount of its files,
    default HEADATLAS_DATA_PATH or what the lake recorded). ``at``: read it as of that snapshot
    (a lake; ``runs()`` shows each run's last one), so that numbers taken later are the same."""
    from headatlas.service.config import Settings

    store = Store(db if db is not None else Settings.from_env().db, data_path=data_path, at=at)
    if not store.backend.exists():
        raise ParameterError(
            f"no database at {store.backend.label}: analyse a corpus first (headatlas.analyze or "
            "`headatlas analyze CORPUS --db PATH`)"
        )
    return Atlas(store)


@dataclass(frozen=True)
class Atlas:
    """A results database."""

    store: Store

    def runs(self) -> pa.Table:
        rows = self.store.list_runs()
        columns = list(rows[0]) if rows else ["run_id", "name", "status", "model", "corpus", "windows"]
        return table(columns, [tuple(r[c] for c in columns) for r in rows])

    def run(self, ref: str | int | None = None) -> RunView:
        """A run by id or name; the latest when ``ref`` is None."""
        return RunView(self.store, self.store.get_run(ref))

    def sql(self, statement: str, *, max_rows: int = 100_000, timeout_s: float = 30.0) -> pa.Table:
        """Read-only SQL, the same sandbox as ``headatlas sql``."""
        from headatlas.service.storage.readonly import run_readonly_sql

        result = run_readonly_sql(
            self.store.backend, statement, max_rows=max_rows, timeout_s=timeout_s, at=self.store.at
        )
        return table(result.columns, result.rows)


@dataclass(frozen=True)
class RunView:
    """One stored run: its facts (``run``) and its questions, each an Arrow table."""

    store: Store
    run: Run

    @property
    def run_id(self) -> int:
        return self.run.run_id

    @property
    def name(self) -> str:
        return self.run.name

    def _query(self, query: Callable[..., Any], **kwargs) -> pa.Table:
        with self.store.checked_read() as conn:
            resolve_run(conn, self.run.run_id)  # still there
            return table(*query(conn, self.run.run_id, **kwargs))

    def heads(
        self, *, layer: int | None = None, sort: str | None = None, top: int | None = None, ci: bool = False
    ) -> pa.Table:
        """Per head: every metric of ``headatlas query heads`` (with ``_lo``/``_hi`` when ``ci``)."""
        from headatlas.service.reports import queries

        self._check(layer)
        return self._query(queries.heads, layer=layer, sort=sort, top=top, ci=ci)

    def layers(self, *, ci: bool = False) -> pa.Table:
        from headatlas.service.reports import queries

        return self._query(queries.layers, ci=ci)

    def boundaries(self, *, ci: bool = False) -> pa.Table:
        from headatlas.service.reports import queries

        return self._query(queries.boundaries, ci=ci)

    def distances(self, layer: int, head: int | None = None, *, split: bool = False, ci: bool = False) -> pa.Table:
        """Distance profile of a head (or a layer's heads pooled) against chance."""
        from headatlas.service.reports import queries

        self._check(layer, head)
        return self._query(queries.distances, layer=layer, head=head, split=split, ci=ci)

    def mixing(self, *, layer: int | None = None, methods: list[str] | None = None) -> pa.Table:
        from headatlas.service.reports import queries

        self._check(layer)
        return self._query(queries.mixing, layer=layer, methods=methods)

    def discrepancy(self, *, method: str = "attribution", top: int | None = None) -> pa.Table:
        from headatlas.service.reports import queries

        return self._query(queries.discrepancy, method=method, top=top)

    def _check(self, layer: int | None, head: int | None = None) -> None:
        if layer is not None and not 0 <= layer < self.run.n_layers:
            raise ParameterError(
                f"layer {layer}: run {self.run.run_id} has layers 0..{self.run.n_layers - 1} (0-based)"
            )
        if head is not None and not 0 <= head < self.run.n_heads:
            raise ParameterError(f"head {head}: run {self.run.run_id} has heads 0..{self.run.n_heads - 1} (0-based)")


def analyze(
    corpus: str | Path,
    *,
    db: str | Path | None = None,
    model: str = DEFAULTS["model"],
    name: str | None = None,
    device: str = DEFAULTS["device"],
    batch_size: int | str = DEFAULTS["batch_size"],
    text_field: str = DEFAULTS["text_field"],
    encoding: str = DEFAULTS["encoding"],
    probe: bool = DEFAULTS["probe"],
    probe_length: int = DEFAULTS["probe_length"],
    probe_sequences: int = DEFAULTS["probe_sequences"],
    data_path: str | Path | None = None,
    **options: Any,
) -> RunView:
    """Analyse a corpus in this process (the embedded engine of ``headatlas analyze``) and return
    the stored run. ``options``: the analysis options by their Python names (``seq_len``,
    ``select``, ``gate``, ``sentences``, ``dtype``, …; see docs/SPEC.md). Resumes an unfinished
    run with the same corpus, model and options. ``probe``: also score every head on repeated
    random tokens (SPEC §8; ``probe_length`` = L, ``probe_sequences``), shown as
    ``induction_score``, ``duplicate_score`` and ``prev_token_score`` in ``heads()``. ``db`` may
    be a lake (``ducklake:…``, with ``data_path``)."""
    from headatlas.service.analysis_options import build_params, parse_batch_size
    from headatlas.service.config import Settings
    from headatlas.service.engine.model import auto_batch_size, load_model
    from headatlas.service.engine.probe import ProbeSpec
    from headatlas.service.engine.runner import analyze_corpus, survey_corpus

    params = build_params(**options)
    size = parse_batch_size(batch_size)
    spec = ProbeSpec(length=probe_length, sequences=probe_sequences) if probe else None
    store = Store(db if db is not None else Settings.from_env().db, data_path=data_path)
    summary = survey_corpus(str(corpus), text_field=text_field, encoding=encoding)
    loaded = load_model(model, device=device, dtype=params.dtype)
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
        probe=spec,
    )
    return RunView(store, run)


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
