"""Analysing a corpus from Python: ``analyze``, the embedded engine of ``headatlas analyze``, with
its progress bar (a notebook widget where ipywidgets is installed)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headatlas.service.analysis_options import DEFAULTS
from headatlas.service.api.terms import in_python_terms
from headatlas.service.api.views import RunView

if TYPE_CHECKING:
    from headatlas.service.api.tables import Table

if TYPE_CHECKING:
    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.operations.events import Event


@in_python_terms
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
    control: int = 0,
    attribution_chunk: int | None = None,
    progress: bool = True,
    data_path: str | Path | None = None,
    **options: Any,
) -> RunView:
    """Analyse a corpus in this process (the embedded engine of ``headatlas analyze``, the same
    steps) and return the stored run. ``options``: the analysis options by their Python names
    (``seq_len``, ``select``, ``gate``, ``sentences``, ``dtype``, …; see docs/SPEC.md). Resumes
    an unfinished run with the same corpus, model and options; a finished one is returned at once,
    without loading the model. ``corpus``: a file, folder or glob, or ``"-"`` for stdin.
    ``probe``: also score every head on repeated random tokens (SPEC §8; ``probe_length`` = L,
    ``probe_sequences``), shown as ``induction_score``, ``duplicate_score`` and
    ``prev_token_score`` in ``heads()``. ``control``: also analyse the same windows with that many
    randomly initialised models of the same config (seeds 0..N-1), stored as ``<name>-control``
    and ``<name>-control-K``: the floor ``compare`` and the roles measure against.
    ``attribution_chunk``: gradient rows per batched backward call (default
    HEADATLAS_ATTRIBUTION_CHUNK). ``progress``: a progress bar on stderr (a widget in a notebook
    where ipywidgets is installed), and the estimate of a slow part before it starts. ``model``:
    a spec as ``--model`` takes it, or a model from ``headatlas.service.engine.model.load_model``
    (loaded once for several corpora; ``device`` is then its own). ``db`` may be a lake
    (``ducklake:…``, with ``data_path``)."""
    from headatlas.service.operations.analysis import analyze as run_analysis
    from headatlas.service.operations.events import ignore
    from headatlas.service.operations.requests import AnalysisRequest

    request = AnalysisRequest.build(
        corpus,
        db=db,
        name=name,
        control=control,
        attribution_chunk=attribution_chunk,
        data_path=data_path,
        model=model,
        device=device,
        batch_size=batch_size,
        text_field=text_field,
        encoding=encoding,
        probe=probe,
        probe_length=probe_length,
        probe_sequences=probe_sequences,
        **options,
    )
    shown = _Shown() if progress else None
    try:
        done = run_analysis(request, shown or ignore)
    finally:
        if shown is not None:
            shown.close()
    with done.store.checked_read() as conn:
        return RunView.read(done.store, conn, done.run.run_id)


@in_python_terms
def analyze_series(
    corpus: str | Path,
    checkpoints: str | Path,
    *,
    db: str | Path | None = None,
    name: str | None = None,
    progress: bool = True,
    **options: Any,
) -> Table:
    """Analyse a corpus with every checkpoint of one model, as ``headatlas analyze CORPUS
    --checkpoints``: ``checkpoints`` a folder of checkpoint folders, a glob of them, or a hub name
    with revisions (``"EleutherAI/pythia-70m@step1000,step2000"``, where there is internet); each
    checkpoint a run ``<name>-step<N>`` on the same windows, grouped in the training series
    ``name`` (default: the folder's name); ``options`` as ``analyze`` takes them (``probe=True``,
    ``effects=[...]``, …; not ``model``). Resumes an interrupted series. Returns the series' steps
    (step, run_id, run); read it with ``connect(db).trend(name, metric)`` and ``.phases(name)``."""
    from headatlas.service.api.tables import Table
    from headatlas.service.operations.checkpoint_series import analyze_series as run_series
    from headatlas.service.operations.checkpoint_series import refuse_model
    from headatlas.service.operations.events import ignore
    from headatlas.service.operations.requests import AnalysisRequest

    if "model" in options:
        refuse_model(options["model"], str(checkpoints))
    request = AnalysisRequest.build(corpus, db=db, name=name, **options)
    shown = _Shown() if progress else None
    try:
        done = run_series(request, str(checkpoints), shown or ignore)
    finally:
        if shown is not None:
            shown.close()
    rows = [(c.step, a.run.run_id, a.run.name) for c, a in done.steps]
    return Table.of(["step", "run_id", "run"], rows, what=f"series {done.name}")


def quiet_notebook_bars() -> None:
    """Import ``tqdm.autonotebook`` (what ``tqdm.auto`` reads) once, without its ``TqdmWarning:
    IProgress not found``. In a Jupyter kernel without ipywidgets that warning comes from the first
    import of tqdm.auto, done by transformers and the hub client as the first ``analyze`` imports
    them; tqdm then falls back to its text bar, which is what the warning says and all that a
    notebook without widgets can show. Where ipywidgets is installed nothing changes."""
    if "tqdm.autonotebook" in sys.modules:
        return
    import warnings

    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
        import tqdm.autonotebook  # noqa: F401


class _Shown:
    """An analysis as a notebook shows it: a progress bar over the corpus's characters with
    windows and windows/s (tqdm's notebook widget where ipywidgets is installed, else its text bar
    on stderr, which a notebook shows too), and the estimate of a slow part above it."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.windows = 0

    def __call__(self, event: Event) -> None:
        from headatlas.service.api.terms import PYTHON
        from headatlas.service.errors import render
        from headatlas.service.operations import events

        if isinstance(event, events.CorpusRead):
            self._open(event.corpus.chars, f"loading {event.model}" if event.model is not None else "analysing")
        elif isinstance(event, events.PassStarted):
            what = "analysing" if event.control_seed is None else f"control {event.control_seed + 1}/{event.controls}"
            total = event.done(0, 0)[1]
            if self.bar is None:
                self._open(total, what)
            self.bar.set_description_str(what, refresh=False)
            self.bar.reset(total=total)
            self.started, self.windows = event, 0
        elif isinstance(event, events.Progress):
            self.windows += event.windows
            rate = self.windows / max(self.bar.format_dict["elapsed"], 1e-9)
            self.bar.set_postfix_str(f"{self.windows:,} windows, {rate:.1f} windows/s", refresh=False)
            self.bar.update(self.started.done(self.windows, event.consumed)[0] - self.bar.n)
        elif isinstance(event, events.PassEnded):
            if event.completed:
                self.bar.update(self.bar.total - self.bar.n)
        elif isinstance(event, (events.Estimate, events.Notice)):
            self.bar.write(render(event.text, PYTHON), file=sys.stderr)

    def _open(self, total_chars: int, what: str) -> None:
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

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
