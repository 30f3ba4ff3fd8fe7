"""What a front end asks the library to do, typed: an analysis in this process, or one for the queue.

A request is built from option values as a user typed them (the CLI's flags, the Python API's
keywords: the same names, declared once in service/analysis_options.py) and validated as it is
built, so that a bad value is refused before a corpus is read or a model loaded. Adding an option
to the analysis is one more field here and one more declaration there.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    @classmethod
    def of(cls, spec: str | Path, run: dict[str, Any]) -> CorpusSource:
        """``spec`` read with the field and encoding the run options name (else the defaults)."""
        return cls(
            str(spec),
            text_field=run.get("text_field", DEFAULTS["text_field"]),
            encoding=run.get("encoding", DEFAULTS["encoding"]),
        )


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
            corpus=CorpusSource.of(corpus, run),
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
            corpus=CorpusSource.of(corpus, run),
            params=build_params(**values),
            model=run.get("model", DEFAULTS["model"]),
            batch_size=parse_batch_size(run.get("batch_size", DEFAULTS["batch_size"]), queued=True),
            probe=probe_of(run),
            name=name,
        )


EFFECTS_BATCH = 4  # windows per batch of ablations where none is asked (each is many forward passes)


@dataclass(frozen=True)
class EffectsRequest:
    """Which heads the model needs, measured on a corpus in this process, nothing stored
    (``headatlas effects``, ``headatlas.effects``): ``kinds`` of effect (zero and mean ablation,
    gradient importance, attribution patching) on ``windows`` windows spread over the corpus's
    documents, mean ablation's mean over its first ``reference`` windows; ``check_top`` K > 0:
    attribution patching checked against exact mean ablation (its top K). ``keep_model``: the last
    model loaded is kept for the next call (a notebook's)."""

    corpus: CorpusSource
    params: AnalysisParams
    kinds: tuple[str, ...]
    model: str | LoadedModel = DEFAULTS["model"]
    device: str = DEFAULTS["device"]
    windows: int = 16
    reference: int = 256
    batch_size: int = EFFECTS_BATCH
    keep_model: bool = False
    check_top: int = 0

    @classmethod
    def build(
        cls,
        corpus: str | Path,
        *,
        kinds: str = "zero,mean",
        windows: int = 16,
        reference: int = 256,
        keep_model: bool = False,
        check_top: int = 0,
        **options: Any,
    ) -> EffectsRequest:
        """A validated request from option values as typed (as ``AnalysisRequest.build``;
        ``batch_size`` ``auto`` is 4 windows)."""
        from headatlas.service.measures.effects import parse_kinds

        chosen = parse_kinds(kinds)
        values, run = _split(options)
        size = parse_batch_size(run.get("batch_size", EFFECTS_BATCH))
        return cls(
            corpus=CorpusSource.of(corpus, run),
            params=build_params(**values),
            kinds=chosen,
            model=run.get("model", DEFAULTS["model"]),
            device=run.get("device", DEFAULTS["device"]),
            windows=windows,
            reference=reference,
            batch_size=EFFECTS_BATCH if size == "auto" else size,
            keep_model=keep_model,
            check_top=_check_top(check_top, chosen),
        )


def _check_top(check_top: int, kinds: tuple[str, ...]) -> int:
    """``--check-top``: 0 (no check), or K heads of attribution patching (``atp`` among ``kinds``)."""
    if check_top < 0:
        raise ParameterError(Param("check_top", check_top), ": name 0 (no check) or more heads")
    if check_top and "atp" not in kinds:
        raise ParameterError(
            Param("check_top", check_top), ": checks attribution patching: add atp to ", Param("kinds", ",".join(kinds))
        )
    return check_top


@dataclass(frozen=True)
class AddEffectsRequest:
    """Causal effects measured on a stored run's own windows and stored in it (``headatlas effects
    RUN``, ``run.add_effects()``): ``kinds`` on the run's first ``windows`` windows, mean ablation
    against its first ``reference`` windows (None: the run's, else 256), on ``objective`` (``auto``:
    the model's own). ``run``: an id, name or alias (None: the default run)."""

    run: str | int | None
    kinds: tuple[str, ...] = ("zero", "mean")
    windows: int = 16
    reference: int | None = None
    objective: str = "auto"
    device: str = DEFAULTS["device"]

    @classmethod
    def build(
        cls,
        run: str | int | None = None,
        *,
        kinds: str | Sequence[str] = "zero,mean",
        windows: int = 16,
        reference: int | None = None,
        objective: str = "auto",
        device: str = DEFAULTS["device"],
    ) -> AddEffectsRequest:
        """A validated request; refused before any run is read."""
        from headatlas.service.measures.effects import parse_kinds

        chosen = parse_kinds(kinds if isinstance(kinds, str) else ",".join(kinds))
        if windows < 1:
            raise ParameterError(Param("windows", windows), ": measure at least 1 window")
        if reference is not None and reference < 1:
            raise ParameterError(Param("reference", reference), ": mean ablation needs at least 1 reference window")
        return cls(run, chosen, windows, reference, str(objective).strip() or "auto", device)


@dataclass(frozen=True)
class PruneRequest:
    """A stored run's pruning curves (``headatlas prune``, ``run.prune()``): heads removed
    cumulatively in each of ``orders`` (None: every order the run's objective allows), a share
    ``step`` of them at a time, ``seeds`` random orders, evaluated on ``windows`` windows; ``show``:
    the newest stored curves read back, nothing measured. ``run``: an id, name or alias (None: the
    default run)."""

    run: str | int | None
    orders: tuple[str, ...] | None = None
    step: float = 0.1
    seeds: int = 3
    windows: int = 16
    reference: int | None = None
    device: str = DEFAULTS["device"]
    show: bool = False

    @classmethod
    def build(
        cls,
        run: str | int | None = None,
        *,
        orders: str | Sequence[str] | None = None,
        step: str | float = 0.1,
        seeds: int = 3,
        windows: int = 16,
        reference: int | None = None,
        device: str = DEFAULTS["device"],
        show: bool = False,
    ) -> PruneRequest:
        """A validated request: ``orders`` comma-separated or a sequence of names, ``step`` a share
        (``0.1``) or a percentage (``10%``); refused before any run is read."""
        from headatlas.service.operations.prune_runs import MAX_SEEDS

        chosen = prune_orders(orders)
        if not 1 <= seeds <= MAX_SEEDS:
            raise ParameterError(Param("seeds", seeds), f": use 1 to {MAX_SEEDS} random orders (one curve each)")
        return cls(run, chosen, prune_step(step), seeds, windows, reference, device, show)


def prune_orders(orders: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """The orders named (``effect,noise`` or a sequence), each one prune knows; None: not named."""
    from headatlas.service.operations.prune_curves import ORDERS

    if orders is None:
        return None
    names = orders.split(",") if isinstance(orders, str) else [str(o) for o in orders]
    chosen = tuple(n.strip() for n in names if n.strip())
    if not chosen:  # `--order ,` stored a prune with no curve
        raise ParameterError(Param("orders", orders, quoted=True), f": name at least one of {', '.join(ORDERS)}")
    for name in chosen:
        if name not in ORDERS:
            raise ParameterError(
                Param("orders", orders, quoted=True), f": {name!r} is not an order; use {', '.join(ORDERS)}"
            )
    return chosen


def prune_step(step: str | float) -> float:
    """``10%`` or ``0.1`` → 0.1: the share of the heads removed at each step, in (0, 1]."""
    raw = step.strip() if isinstance(step, str) else step
    try:
        value = float(raw[:-1]) / 100 if isinstance(raw, str) and raw.endswith("%") else float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise ParameterError(
            Param("step", step, quoted=True), ": a share of the heads removed per step, such as 10% or 0.1"
        )
    return value


@dataclass(frozen=True)
class InspectionRequest:
    """One text through a model in this process, nothing stored (``headatlas inspect``,
    ``headatlas.inspect``): ``text`` itself, or the first document of the file ``file`` (read with
    ``text_field`` and ``encoding``); ``layer`` and ``head`` (0-based): what is looked at, checked
    against the model once it is there. ``keep_model``: as ``EffectsRequest``'s."""

    params: AnalysisParams
    text: str | None = None
    file: CorpusSource | None = None
    model: str | LoadedModel = DEFAULTS["model"]
    device: str = DEFAULTS["device"]
    layer: int | None = None
    head: int | None = None
    keep_model: bool = False

    @classmethod
    def build(
        cls,
        text: str | None = None,
        *,
        file: str | Path | None = None,
        layer: int | None = None,
        head: int | None = None,
        keep_model: bool = False,
        **options: Any,
    ) -> InspectionRequest:
        """A validated request from option values as typed (the declared analysis options by name):
        a head is named by its layer, so ``head`` alone is refused before any model loads."""
        from headatlas.service.layer_head import check_head_has_layer

        check_head_has_layer(layer, head)
        values, run = _split(options)
        source = None
        if file is not None:
            source = CorpusSource.of(file, run)
        return cls(
            params=build_params(**values),
            text=text,
            file=source,
            model=run.get("model", DEFAULTS["model"]),
            device=run.get("device", DEFAULTS["device"]),
            layer=layer,
            head=head,
            keep_model=keep_model,
        )
