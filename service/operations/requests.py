"""What a front end asks the library to do, typed: an analysis in this process, or one for the queue.

A request is built from option values as a user typed them (the CLI's flags, the Python API's
keywords: the same names, declared once in service/analysis_options.py) and validated as it is
built, so that a bad value is refused before a corpus is read or a model loaded. Adding an option
to the analysis is one more field here and one more declaration there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from headatlas.service.analysis_options import DEFAULTS, PARAM_NAMES, RUN_NAMES, build_params, parse_batch_size
from headatlas.service.config import Settings
from headatlas.service.errors import Param, ParameterError

if TYPE_CHECKING:
    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.engine.probe import ProbeSpec
    from headatlas.service.params import AnalysisParams

STDIN = "-"


@dataclass(frozen=True)
class CorpusSource:
    """Where a corpus is read from: a .txt/.jsonl/.csv file, a folder or a glob (``spec``), or
    standard input (``-``), with the field and encoding its files are read with."""

    spec: str
    text_field: str = DEFAULTS["text_field"]
    encoding: str = DEFAULTS["encoding"]

    @property
    def is_stdin(self) -> bool:
        return self.spec == STDIN


def probe_of(values: dict[str, Any]) -> ProbeSpec | None:
    """The synthetic probe (SPEC §8) the option values ask for, or None without ``probe``."""
    if not values.get("probe", DEFAULTS["probe"]):
        return None
    from headatlas.service.engine.probe import ProbeSpec

    return ProbeSpec(
        length=values.get("probe_length", DEFAULTS["probe_length"]),
        sequences=values.get("probe_sequences", DEFAULTS["probe_sequences"]),
    )


def _split(values: dict[str, Any], allowed: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """(analysis parameters, run options) of option values; an unknown name is refused with the
    names there are."""
    unknown = sorted(set(values) - set(PARAM_NAMES) - set(RUN_NAMES) - set(allowed))
    if unknown:
        known = ", ".join((*PARAM_NAMES, *RUN_NAMES, *allowed))
        raise ParameterError(f"unknown option {unknown[0]!r}; the analysis options are {known}")
    params = {name: v for name, v in values.items() if name in PARAM_NAMES}
    return params, {name: v for name, v in values.items() if name not in PARAM_NAMES}


@dataclass(frozen=True)
class AnalysisRequest:
    """An analysis of a corpus in this process (``headatlas analyze``, ``headatlas.analyze``).

    ``model``: a spec as ``--model`` takes it, or a loaded model (its device is then its own).
    ``control``: also analyse the same windows with that many randomly initialised models of the
    same config (seeds 0..N-1). ``probe``: also score every head on repeated random tokens.
    ``name``: the run's name (a run with the same corpus, model and parameters keeps its own and
    gets this one as an alias). ``db``, ``data_path``: where the run is stored.
    """

    corpus: CorpusSource
    params: AnalysisParams
    db: str | Path
    model: str | LoadedModel = DEFAULTS["model"]
    device: str = DEFAULTS["device"]
    batch_size: int | Literal["auto"] = "auto"
    probe: ProbeSpec | None = None
    name: str | None = None
    control: int = 0
    attribution_chunk: int = Settings.default("attribution_chunk")
    data_path: str | Path | None = None

    @classmethod
    def build(
        cls,
        corpus: str | Path,
        *,
        db: str | Path | None = None,
        name: str | None = None,
        control: int = 0,
        attribution_chunk: int | None = None,
        data_path: str | Path | None = None,
        **options: Any,
    ) -> AnalysisRequest:
        """A validated request from option values as typed: ``options`` are the declared
        analysis options by name (``seq_len``, ``select``, ``model``, ``batch_size``, …); one not
        given takes its declared default, one not declared is refused."""
        from headatlas.service.storage.run_labels import check_name

        values, run = _split(options)
        if control < 0:
            raise ParameterError(Param("control", control), ": pass a count of 0 or more")
        chunk = Settings.default("attribution_chunk") if attribution_chunk is None else attribution_chunk
        if chunk < 1:
            raise ParameterError(Param("attribution_chunk", chunk), ": pass 1 or more gradient rows per call")
        return cls(
            corpus=CorpusSource(
                str(corpus),
                text_field=run.get("text_field", DEFAULTS["text_field"]),
                encoding=run.get("encoding", DEFAULTS["encoding"]),
            ),
            params=build_params(**values),
            db=db if db is not None else Settings.from_env().db,
            model=run.get("model", DEFAULTS["model"]),
            device=run.get("device", DEFAULTS["device"]),
            batch_size=parse_batch_size(run.get("batch_size", DEFAULTS["batch_size"])),
            probe=probe_of(run),
            name=None if name is None else check_name(name),
            control=control,
            attribution_chunk=chunk,
            data_path=data_path,
        )


@dataclass(frozen=True)
class QueuedAnalysis:
    """An analysis for the workers (``headatlas submit``, and a schedule's fires): the corpus is
    read here, the model loaded by every worker, so it is checked against this machine's total
    memory, and batches are cut before any worker is known (``--batch-size auto`` is 32)."""

    corpus: CorpusSource
    params: AnalysisParams
    model: str = DEFAULTS["model"]
    batch_size: int = 32
    probe: ProbeSpec | None = None
    name: str | None = None

    @classmethod
    def build(cls, corpus: str | Path, *, name: str | None = None, **options: Any) -> QueuedAnalysis:
        """A validated request from option values as typed (as ``AnalysisRequest.build``)."""
        values, run = _split(options)
        return cls(
            corpus=CorpusSource(
                str(corpus),
                text_field=run.get("text_field", DEFAULTS["text_field"]),
                encoding=run.get("encoding", DEFAULTS["encoding"]),
            ),
            params=build_params(**values),
            model=run.get("model", DEFAULTS["model"]),
            batch_size=parse_batch_size(run.get("batch_size", DEFAULTS["batch_size"]), queued=True),
            probe=probe_of(run),
            name=name,
        )
