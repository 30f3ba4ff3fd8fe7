"""One model's training checkpoints analysed as one request (``analyze --checkpoints``).

``--checkpoints`` names the checkpoints: a folder holding checkpoint folders (each a model folder
with config.json: ``step-1000``, ``checkpoint-1000``, ``step1000`` …), a glob of such folders, or a
hub name with revisions, ``EleutherAI/pythia-70m@step1000,step2000`` (downloaded where there is
internet). Each checkpoint's step is read from its ``trainer_state.json`` (``global_step``), else
from its folder's or revision's name.

Every checkpoint is analysed as any run is (``operations.analysis.analyze``: the same corpus,
parameters, ``--probe`` and ``--effects``), on the same windows — refused up front when two
checkpoints' tokenizers differ, which would cut other windows — and recorded in the series with
its step as it finishes. Analysing the series again resumes it: finished checkpoints are found
without loading their weights, one interrupted mid-way continues where it stopped.
"""

from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from headatlas.service.errors import ModelError, Param, ParameterError
from headatlas.service.operations.analysis import Analysed, analyze
from headatlas.service.operations.events import Notice, Sink, ignore
from headatlas.service.operations.requests import AnalysisRequest

_STEP_NAME = re.compile(r"(?:step|checkpoint|ckpt|iter)[-_]?(\d+)$", re.IGNORECASE)
_HUB = re.compile(r"^(?P<repo>[^@\s]+)@(?P<revisions>[^@\s]+)$")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint: its training ``step``, and ``model`` as ``--model`` takes it (a folder, or a
    hub name whose ``revision`` is fetched first)."""

    step: int
    model: str
    revision: str | None = None

    @property
    def label(self) -> str:
        return self.model if self.revision is None else f"{self.model}@{self.revision}"


@dataclass(frozen=True)
class SeriesAnalysed:
    """What a series analysis stored: the series' name and each checkpoint's analysis, by step."""

    name: str
    steps: tuple[tuple[Checkpoint, Analysed], ...]


def step_of(folder: Path) -> int | None:
    """A checkpoint folder's training step: ``trainer_state.json``'s ``global_step``, else the
    number its name ends with after ``step``/``checkpoint``; None when neither says."""
    state = folder / "trainer_state.json"
    if state.is_file():
        try:
            step = json.loads(state.read_text(encoding="utf-8")).get("global_step")
        except (OSError, ValueError, AttributeError):
            step = None
        if isinstance(step, int) and step >= 0:
            return step
    found = _STEP_NAME.search(folder.name)
    return None if found is None else int(found.group(1))


def checkpoints_of(spec: str) -> list[Checkpoint]:
    """The checkpoints ``spec`` names, in step order (module docstring); refused with the fix when
    it names none, a folder without a step, or two checkpoints of one step."""
    hub = _HUB.match(spec)
    if hub is not None and not Path(spec).expanduser().exists():
        found = []
        for revision in hub.group("revisions").split(","):
            named = _STEP_NAME.search(revision)
            if named is None:
                raise ParameterError(
                    Param("checkpoints", spec),
                    f": revision {revision!r} names no step; pass revisions such as step1000 (NAME@step1000,step2000)",
                )
            found.append(Checkpoint(int(named.group(1)), hub.group("repo"), revision))
        return _ordered(spec, found)
    path = Path(spec).expanduser()
    if path.is_dir():
        folders = sorted(p for p in path.iterdir() if p.is_dir() and (p / "config.json").is_file())
    else:
        folders = sorted(Path(p) for p in glob.glob(str(path)) if (Path(p) / "config.json").is_file())
    if not folders:
        raise ParameterError(
            Param("checkpoints", spec),
            ": names no checkpoint folders; pass a folder holding one model folder (config.json, weights, "
            "tokenizer) per checkpoint, a glob of such folders, or NAME@step1000,step2000",
        )
    found = []
    for folder in folders:
        step = step_of(folder)
        if step is None:
            raise ParameterError(
                Param("checkpoints", spec),
                f": {str(folder)!r} says no training step; name it step-N or checkpoint-N, or give it a "
                "trainer_state.json with global_step",
            )
        found.append(Checkpoint(step, str(folder.resolve())))
    return _ordered(spec, found)


def _ordered(spec: str, found: list[Checkpoint]) -> list[Checkpoint]:
    found.sort(key=lambda c: c.step)
    for a, b in zip(found, found[1:], strict=False):
        if a.step == b.step:
            raise ParameterError(
                Param("checkpoints", spec), f": {a.label!r} and {b.label!r} are both step {a.step}; pass one of them"
            )
    return found


def fetched(checkpoint: Checkpoint) -> Checkpoint:
    """A hub checkpoint downloaded (its revision's files, into the Hugging Face cache) and named
    by its local folder; a folder as it is."""
    if checkpoint.revision is None:
        return checkpoint
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(checkpoint.model, revision=checkpoint.revision)
    except Exception as exc:  # offline, no such repo or revision: the hub's own words, first line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelError(
            Param("checkpoints", checkpoint.label),
            f": cannot fetch ({first[:200]}); where there is no internet pass local checkpoint folders",
        ) from None
    return replace(checkpoint, model=folder)


def check_tokenizers(checkpoints: list[Checkpoint]) -> None:
    """Refuse a series whose checkpoints' tokenizers differ (they would cut other windows from
    the corpus), naming the first two that differ and the fix. Reads tokenizers and configs, no
    weights."""
    from headatlas.service.engine.model import load_model_info

    first, key = checkpoints[0], load_model_info(checkpoints[0].model).tokenizer_key
    for other in checkpoints[1:]:
        if load_model_info(other.model).tokenizer_key != key:
            raise ParameterError(
                Param("checkpoints", other.label),
                f": its tokenizer differs from that of {first.label!r} (step {first.step}), so the checkpoints "
                "would not read the same windows; pass checkpoints of one model, or copy one tokenizer's files "
                "into every checkpoint folder",
            )


def series_name(spec: str, name: str | None) -> str:
    """The series' name: ``--name``, else the checkpoints' folder (or hub name)."""
    if name is not None:
        return name
    hub = _HUB.match(spec)
    if hub is not None and not Path(spec).expanduser().exists():
        return hub.group("repo").rsplit("/", 1)[-1]
    path = Path(spec).expanduser()
    return (path if path.is_dir() else path.parent).resolve().name or "series"


def refuse_model(model: object, checkpoints: str) -> None:
    """A model named beside the checkpoints: refused, since each checkpoint is the model."""
    raise ParameterError(Param("model", str(model)), " and ", Param("checkpoints", checkpoints), ": pass one of them")


def run_name(series: str, step: int) -> str:
    """A checkpoint's run: ``<series>-step<N>``."""
    return f"{series}-step{step}"


def analyze_series(request: AnalysisRequest, checkpoints: str, events: Sink = ignore) -> SeriesAnalysed:
    """Analyse ``request``'s corpus with every checkpoint ``checkpoints`` names (its ``model`` is
    not read), store each run and record it in the series ``request.name`` (module docstring)."""
    from headatlas.service.storage.series_rows import add_step, ensure_series

    found = [fetched(c) for c in checkpoints_of(checkpoints)]
    check_tokenizers(found)
    name = series_name(checkpoints, request.name)
    done = []
    for index, checkpoint in enumerate(found):
        events(Notice((f"checkpoint {index + 1}/{len(found)}: step {checkpoint.step} ({checkpoint.label})",)))
        analysed = analyze(replace(request, model=checkpoint.model, name=run_name(name, checkpoint.step)), events)

        def record(conn, step=checkpoint.step, where=checkpoint.label, run_id=analysed.run.run_id):
            add_step(conn, ensure_series(conn, name, checkpoints), step, where, run_id)

        analysed.store.atomically(record)
        done.append((checkpoint, analysed))
    return SeriesAnalysed(name, tuple(done))
