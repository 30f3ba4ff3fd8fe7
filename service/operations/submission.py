"""Analyses for the workers: a corpus queued now (``headatlas submit``), or on a cadence (``headatlas
schedule add``). Both are planned here the same way before anything is queued or stored: the
corpus read here, the model checked against this machine's total memory (every worker loads it),
the batches cut before any worker is known. The queue itself (which batches are stored, queued or
lost, and sending them) is the submitter's, workers/submit.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from headatlas.service.errors import CorpusError, ParameterError
from headatlas.service.operations.events import NameKept, Notice, Sink, ignore
from headatlas.service.operations.requests import QueuedAnalysis

if TYPE_CHECKING:
    from headatlas.service.config import Settings
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
) -> Submission:
    """Queue every batch of ``request``'s corpus not yet stored nor queued (``only``: just these
    batch ids, a re-submission), after its checks. ``events`` hears what the submitter says as it
    plans, and a name asked that the run does not take (the queue never writes the database: an
    existing run keeps its name)."""
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
        log=lambda said: events(Notice((said,))),
    )
    if only is None and request.name is not None and sub.name != request.name:
        events(NameKept(sub.name, request.name))
    return sub


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
