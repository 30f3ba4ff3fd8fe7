"""Analysing a corpus from Python: ``analyze``, the embedded engine of ``headatlas analyze``, with
its progress bar (a notebook widget where ipywidgets is installed)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headatlas.service.analysis_options import DEFAULTS
from headatlas.service.api.terms import _in_python_terms
from headatlas.service.api.views import RunView
from headatlas.service.storage.store import Store

if TYPE_CHECKING:
    from headatlas.service.engine.model import LoadedModel


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
