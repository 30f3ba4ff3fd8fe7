"""Analyses for the workers: a corpus queued now (``headatlas submit``), or on a cadence (``headatlas
schedule add``). Both are planned here the same way before anything is queued or stored: the
corpus read here, the model checked against this machine's total memory (every worker loads it),
the batches cut before any worker is known. The queue itself (which batches are stored, queued or
lost, and sending them) is the submitter's, workers/submit.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from headatlas.service.errors import CorpusError, ParameterError
from headatlas.service.operations.events import NameKept, Notice, Sink, ignore
from headatlas.service.operations.requests import QueuedAnalysis

if TYPE_CHECKING:
    from headatlas.service.config import Settings
    from headatlas.service.operations.checkpoint_series import Checkpoint
    from headatlas.service.schedules import Cadence
    from headatlas.service.storage.schedule_store import Schedule
    from headatlas.workers.submit import Submission


def check_queued(request: QueuedAnalysis) -> None:
    """What a queued analysis needs before anything is queued: a model that fits a machine like
    this one (a worker elsewhere loads it) with the parameters asked."""
    from headatlas.service.engine.model_check import check_model_spec

    check_model_spec(request.model, seq_len=request.params.seq_len, memory="total")


def submit(
    request: QueuedAnalysis,
    settings: Settings,
    *,
    writer_wait_s: float,
    events: Sink = ignore,
    only: set[int] | None = None,
    series: dict | None = None,
) -> Submission:
    """Queue every batch of ``request``'s corpus not yet stored nor queued (``only``: just these
    batch ids, a re-submission), after its checks. ``events`` hears what the submitter says as it
    plans, and a name asked that the run does not take (the queue never writes the database: an
    existing run keeps its name). ``series``: the training series the run is a checkpoint of, which
    the writer records as it opens the run (``submit_series``)."""
    from headatlas.workers.submit import submit as queue

    if request.corpus.is_stdin:
        raise CorpusError("submit reads a file, folder or glob, not stdin: save the text to a file first")
    if only is None:
        check_queued(request)
    sub = queue(
        request.corpus.spec,
        settings=settings,
        model=request.model,
        dtype=request.params.dtype,
        params=request.params,
        batch_size=request.batch_size,
        name=request.name,
        text_field=request.corpus.text_field,
        encoding=request.corpus.encoding,
        writer_wait_s=writer_wait_s,
        probe=request.probe,
        only=only,
        series=series,
        log=lambda said: events(Notice((said,))),
    )
    if only is None and request.name is not None and sub.name != request.name:
        events(NameKept(sub.name, request.name))
    return sub


@dataclass(frozen=True)
class QueuedCheckpoint:
    """One checkpoint of a series queued: its ``request`` (the checkpoint's model and run name),
    the ``series`` the writer records it in, and what its submission queued."""

    checkpoint: Checkpoint
    request: QueuedAnalysis
    series: dict
    submission: Submission

    def again(self, settings: Settings, *, writer_wait_s: float, only: set[int] | None = None) -> Submission:
        """The same checkpoint submitted again (``only``: just these batch ids), in its series."""
        return submit(self.request, settings, writer_wait_s=writer_wait_s, only=only, series=self.series)


def submit_series(
    request: QueuedAnalysis,
    checkpoints: str,
    settings: Settings,
    *,
    writer_wait_s: float,
    events: Sink = ignore,
) -> list[QueuedCheckpoint]:
    """Queue ``request``'s corpus once per checkpoint ``checkpoints`` names (its ``model`` is not
    read), each as a run ``<series>-step<N>`` on the same windows, after the checks of ``analyze
    --checkpoints`` (steps, one tokenizer; service/operations/checkpoint_series.py). The series
    ``request.name`` (default: the checkpoints' folder) is recorded by the writer as it opens each
    run; submitting again queues only what is missing (a finished checkpoint nothing: the writer
    records its run in the series named, ``SeriesStep``)."""
    from headatlas.service.operations.checkpoint_series import (
        check_tokenizers,
        checkpoints_of,
        fetched,
        run_name,
        series_name,
    )

    found = [fetched(c) for c in checkpoints_of(checkpoints)]
    check_tokenizers(found)
    name = series_name(checkpoints, request.name)
    done = []
    for index, checkpoint in enumerate(found):
        events(Notice((f"checkpoint {index + 1}/{len(found)}: step {checkpoint.step} ({checkpoint.label})",)))
        series = {"name": name, "checkpoints": checkpoints, "step": checkpoint.step, "checkpoint": checkpoint.label}
        asked = replace(request, model=checkpoint.model, name=run_name(name, checkpoint.step))
        sub = submit(asked, settings, writer_wait_s=writer_wait_s, events=events, series=series)
        done.append(QueuedCheckpoint(checkpoint, asked, series, sub))
    return done


@dataclass(frozen=True)
class ScheduleRequest:
    """A recurring analysis (``headatlas schedule add``): ``analysis`` fired on a cron expression
    (``cron``) or an interval (``every``: ``45s``, ``6h``) in ``timezone``; ``only_new``: each fire
    analyses only documents no earlier fire sent."""

    name: str
    analysis: QueuedAnalysis
    cron: str | None = None
    every: str | None = None
    timezone: str = "UTC"
    only_new: bool = False

    def cadence(self) -> Cadence:
        from headatlas.service.schedules import Cadence, parse_every

        return Cadence(self.cron, parse_every(self.every) if self.every is not None else None, self.timezone)


def schedule_name(name: str) -> str:
    """A schedule name starts the names of its runs: it is checked as they are."""
    from headatlas.service.storage.run_labels import check_label

    if not name.strip():
        raise ParameterError("schedule name is empty: pass a name, e.g. `headatlas schedule add nightly --corpus …`")
    return check_label(name, what="schedule name")


def schedule_corpus(spec: str) -> str:
    """The corpus of a schedule: it exists and holds a document now (a clear error when the
    schedule is made, not at its first fire), kept as an absolute path, so that beat finds it
    whatever its working directory."""
    from headatlas.service.engine.corpus import iter_documents

    next(iter(iter_documents(spec)))  # reads up to the first document; an empty corpus raises
    path = Path(spec)
    if path.exists():
        return str(path.resolve())
    return str(path if path.is_absolute() else Path.cwd() / path)  # a glob: anchored here


def add_schedule(request: ScheduleRequest, db: str) -> Schedule:
    """Store a schedule after the checks of a queued analysis (its workers load the model at
    each fire) and of its name and corpus."""
    from headatlas.service.storage import schedule_store

    schedule_name(request.name)
    cadence = request.cadence()
    analysis = request.analysis
    check_queued(analysis)
    return schedule_store.add(
        db,
        name=request.name,
        corpus=schedule_corpus(analysis.corpus.spec),
        model=analysis.model,
        dtype=analysis.params.dtype,
        batch_size=analysis.batch_size,
        params=analysis.params.to_dict(),
        cadence=cadence,
        only_new=request.only_new,
    )
