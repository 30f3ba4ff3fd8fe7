"""The measure contract: what every measure of an analysis declares, and the registry that holds them.

A measure is a class (docs/architecture.md, "The measure contract") that says

- ``name``: how requests, payloads and the store name it;
- ``sums``: the names of the additive sums it stores (summed over batches by the store);
- ``reads`` / ``edits``: the hook points it reads or edits (``blocks.{L}.attn.pattern``,
  ``blocks.{L}.attn.z``, ``blocks.{L}.resid_pre``, ``embed``, ``unembed``; ``{L}`` is every layer);
- which windows of a batch it takes: every window, or ``quota(params)`` windows of the run: its
  first counted by position (``batch_windows``, the one rule the embedded runner and the workers
  share), or, where ``spreads(params)``, spread over the replicate groups (``run_plan.chosen_windows``:
  the runner and the submitter find them before the run, and hand each batch the indices of its
  own, ``Take``);
- its refusals of a request before anything runs (``check``; ``check_spec`` from a model's spec
  alone, before any model is loaded), and what it will cost where that can be said (``estimate``);
- its work on a batch: ``on_layer`` inside the forward pass (as each layer finishes), ``collect``
  after it.

The built-in measures (service/measures/builtin.py) are named in ``DEFAULT_MEASURES`` and loaded
like the measures other packages declare under the entry-point group ``headatlas.measures``
(service/plugins.py), through the same ``install``, as datasette loads its DEFAULT_PLUGINS: the
engine runs measures through this contract and imports none of them. A plugin measure's per-head
sums travel in ``BatchResult.rep_heads`` as ``"<measure>.<sum>"``, shape ``[group, layer, head]``;
a measure's sums of other shapes (the averaged similarity matrices', mixing's) in
``BatchResult.measures[<measure>]``, by names of its own.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from headatlas.service.errors import Part

if TYPE_CHECKING:
    import torch

    from headatlas.service.engine.features import WindowFeatures
    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.engine.probe import ProbeSpec
    from headatlas.service.engine.reference_means import ReferenceMeans
    from headatlas.service.engine.windows import Batch, TokenClasses, Window
    from headatlas.service.params import AnalysisParams
    from headatlas.service.plugins import Plugin

# The hook points a measure may declare (per layer L, then the model's own), as the adapters name them.
RESID_PRE = "blocks.{L}.resid_pre"  # the residual stream entering block L
ATTN_PATTERN = "blocks.{L}.attn.pattern"  # attention probabilities [batch, head, q, k]
ATTN_Z = "blocks.{L}.attn.z"  # per-head outputs before W_O [batch, pos, head, d_head]
EMBED = "embed"  # the embedding output
UNEMBED = "unembed"  # the LM/MLM head's input (final hidden states)
HOOK_POINTS = (RESID_PRE, ATTN_PATTERN, ATTN_Z, EMBED, UNEMBED)

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

# which of a batch's windows a measure takes: its first ``int``, or these (indices into the batch, ascending)
Take = int | tuple[int, ...]


@dataclass
class BatchContext:
    """One batch as the measures see it: the inputs (ids and mask on the model's device), the
    window features of the statistics, each window's replicate group (``group``: its index among
    ``reps``), and what the measures put in the batch's result."""

    model: LoadedModel
    batch: Batch
    params: AnalysisParams
    tokens: TokenClasses
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    feats: WindowFeatures
    sentence: torch.Tensor | None
    reps: np.ndarray  # the replicate groups present, ascending
    group: np.ndarray  # [window] index into reps
    attribution_chunk: int = 2048
    effect_means: ReferenceMeans | None = None
    counts: dict[str, int] = field(default_factory=dict)  # how many of the first windows each measure takes
    # the windows each measure takes, by index into the batch: its first counts[name], or those
    # of a measure that spreads its windows over the replicate groups (Measure.spreads)
    taken: dict[str, np.ndarray] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)  # a measure's own, by its name, for this batch
    per_layer: list[dict[str, torch.Tensor]] = field(default_factory=list)  # head statistics, per layer
    stacked: dict[str, torch.Tensor] = field(default_factory=dict)  # the same, [group|window, layer, ...]
    heads: dict[str, np.ndarray] = field(default_factory=dict)  # BatchResult.rep_heads
    run: dict[str, np.ndarray] = field(default_factory=dict)  # BatchResult.rep_chance
    measures: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # BatchResult.measures
    fields: dict[str, Any] = field(default_factory=dict)  # BatchResult's other fields

    @property
    def n_groups(self) -> int:
        return len(self.reps)


class Measure:
    """The contract (a subclass per measure; the registry holds one instance of each)."""

    name: ClassVar[str] = ""
    sums: ClassVar[tuple[str, ...]] = ()  # the additive sums it stores
    reads: ClassVar[tuple[str, ...]] = ()  # hook points read (HOOK_POINTS)
    edits: ClassVar[tuple[str, ...]] = ()  # hook points edited (ablations)
    per_batch: ClassVar[bool] = True  # False: computed once per run, on no window of the corpus (the probe)
    # a built-in's sums keep the names they had before measures had a contract; a plugin's are
    # qualified by its name ("<measure>.<sum>")
    qualified: ClassVar[bool] = True

    def requested(self, params: AnalysisParams) -> bool:
        """Whether a request with ``params`` asks for it (a plugin measure: when named)."""
        return False

    def quota(self, params: AnalysisParams) -> int | None:
        """How many of the run's windows it takes, its first by position; None: every window."""
        return None

    def spreads(self, params: AnalysisParams) -> bool:
        """Whether its ``quota`` windows are spread over the run's replicate groups
        (``run_plan.chosen_windows``) rather than its first by position: its ``collect`` then
        reads which windows of the batch it takes in ``ctx.taken[name]``, not the first ``count``."""
        return False

    def batch_windows(self, params: AnalysisParams, before: int, size: int) -> int:
        """How many of a batch's first windows it takes: ``before`` of the run's windows come
        before the batch's (the run's position of its first window), ``size`` are in it. The one
        rule, the same in the embedded runner, the OOM splitter and the workers."""
        if not self.per_batch:
            return 0
        quota = self.quota(params)
        if quota is None:
            return size
        return max(0, min(size, quota - before))

    def windows_stored(self, store: Any, run_id: int) -> int | None:
        """How many windows of a resumed run it has taken, where the store counts them; None: the
        runner counts the run's first ``quota`` windows that are not stored yet."""
        return None

    def single_first(self, model: LoadedModel, params: AnalysisParams, left: int) -> int:
        """How many of the run's next windows go one per batch in-process (so that an interrupted
        run keeps each of these slow windows)."""
        return 0

    def check(self, model: LoadedModel, params: AnalysisParams) -> None:
        """Refuse (raise ParameterError) what ``model`` cannot give, before the run is created."""

    def check_spec(self, spec: str, params: AnalysisParams) -> None:
        """``check`` from the model's spec alone (submit, schedules: no model loaded)."""

    def has_estimate(self, params: AnalysisParams) -> bool:
        """Whether ``estimate`` has something to say (the runner then finds the windows it needs)."""
        return False

    def estimate(
        self,
        model: LoadedModel,
        params: AnalysisParams,
        windows: list[Window],
        *,
        pad_id: int,
        batch_size: int = 32,
        chunk_size: int = 2048,
    ) -> tuple[Part, ...] | None:
        """What it will cost on ``windows`` (the run's next windows it takes), said before it starts,
        as message parts; None: nothing worth saying."""
        return None

    def on_layer(self, ctx: BatchContext, layer: int, context: torch.Tensor, attn: torch.Tensor) -> None:
        """Inside the forward pass, as layer ``layer`` finishes: ``context`` the per-head outputs
        before W_O (``blocks.L.attn.z``, ``[batch, pos, head·d_head]``), ``attn`` the attention
        probabilities (``blocks.L.attn.pattern``, ``[batch, head, pos, key]``; a long window's come
        as row blocks, ``row_attention.AttentionRows``). Called only for the measures that read
        them, on every window of the batch: a measure that takes fewer reads its count in
        ``ctx.counts`` and keeps what it sums in ``ctx.state[name]``."""

    def collect(self, ctx: BatchContext, count: int) -> Mapping[str, np.ndarray] | None:
        """After the forward pass, on the batch's first ``count`` windows: its per-head sums by
        name (``[group, layer, head]``, float64 or int64), or None where it wrote into ``ctx``
        itself (the built-ins). Sums of other shapes go in ``ctx.measures[name]`` by names of its
        own (``BatchResult.measures``: they travel in the payload under the measure's name)."""
        return None

    @property
    def reads_attention(self) -> bool:
        return ATTN_PATTERN in self.reads or ATTN_Z in self.reads


# --- the registry -----------------------------------------------------------------------------------
# The built-in measures, installed first and in this order by the same function as the entry points
# of headatlas.measures: a measure's collect may read what an earlier one left in the batch's context
# (the CSM reads the head statistics' pass).
DEFAULT_MEASURES = tuple(
    f"headatlas.service.measures.builtin:{name}"
    for name in ("HeadStatistics", "AveragedCsm", "Mixing", "Effects", "Probe", "HeadExamples")
)


class MeasureError(ValueError):
    """A measure that breaks the contract (a plugin's is left out and reported)."""


_lock = threading.RLock()
_registry: dict[str, Measure] = {}
_origins: dict[str, str] = {}


def check_contract(measure: Measure) -> None:
    """Refuse a measure that breaks the contract: its name, its sums and its hook points."""
    if not isinstance(measure.name, str) or not _NAME.match(measure.name):
        raise MeasureError(f"measure name {measure.name!r}: lower-case letters, digits and _ (a letter first)")
    sums = measure.sums
    if not isinstance(sums, tuple) or not all(isinstance(s, str) and _NAME.match(s) for s in sums):
        raise MeasureError(f"measure {measure.name}: sums must be a tuple of names (lower-case, no dot), not {sums!r}")
    if len(set(sums)) != len(sums):
        raise MeasureError(f"measure {measure.name}: a sum is named twice in {sums!r}")
    for point in (*measure.reads, *measure.edits):
        if point not in HOOK_POINTS:
            raise MeasureError(
                f"measure {measure.name}: unknown hook point {point!r}; choose from {', '.join(HOOK_POINTS)}"
            )


def install(origin: str, value: Any) -> Measure:
    """Register ``value`` (a Measure subclass or instance) as the measure it names; ``origin`` says
    where it comes from (``built-in`` or a plugin). Raises MeasureError to refuse it."""
    measure = value() if isinstance(value, type) else value
    if not isinstance(measure, Measure):
        raise MeasureError(f"{value!r} is not a headatlas Measure")
    check_contract(measure)
    with _lock:
        if measure.name in _registry:
            raise MeasureError(f"measure {measure.name!r} is already registered ({_origins[measure.name]})")
        _registry[measure.name] = measure
        _origins[measure.name] = origin
    return measure


def _install_plugin(plugin: Plugin, value: Any) -> None:
    install(plugin.origin, value)


def measures() -> dict[str, Measure]:
    """Every measure by name: the built-ins, then those of installed packages (entry-point group
    ``headatlas.measures``, read once per process)."""
    from headatlas.service import plugins

    with _lock:
        if not _registry:
            for path in DEFAULT_MEASURES:
                module, _, attr = path.partition(":")
                install("built-in", getattr(importlib.import_module(module), attr))
        plugins.load(plugins.MEASURES, _install_plugin)
        return dict(_registry)


def origin(name: str) -> str:
    """Where measure ``name`` comes from: ``built-in`` or ``plugin NAME (DISTRIBUTION VERSION)``."""
    measures()
    return _origins[name]


def forget(name: str) -> None:
    """Drop measure ``name`` from the registry (tests that register one)."""
    with _lock:
        _registry.pop(name, None)
        _origins.pop(name, None)


def probe_scores(model: LoadedModel, spec: ProbeSpec) -> dict[str, np.ndarray]:
    """The probe's scores by name, ``[layer, head]``, from the registered probe measure."""
    return measures()["probe"].run_once(model, spec)  # type: ignore[attr-defined]


def requested(params: AnalysisParams) -> list[Measure]:
    """The measures a request asks for, in the registry's order: those ``params`` ask for, a
    plugin's among them by name (``params.measures``: recorded with the run, in its key)."""
    known = measures()
    named = params.measures
    unknown = [n for n in named if n not in known]
    if unknown:
        from headatlas.service.errors import Param, ParameterError

        plugins = [m.name for m in known.values() if m.qualified and m.per_batch]
        raise ParameterError(
            Param("measures", unknown[0], quoted=True),
            ": no measure of that name is installed; "
            + (f"the plugins' measures are {', '.join(plugins)}" if plugins else "no plugin adds one here"),
        )
    return [m for m in known.values() if m.per_batch and (m.requested(params) or m.name in named)]


def batch_counts(
    chosen: Sequence[Measure], params: AnalysisParams, size: int, given: Mapping[str, Take] | None = None
) -> dict[str, Take]:
    """Which of a batch's ``size`` windows each chosen measure takes: as ``given`` (by name: its
    first that many, at most ``size``, or those indices), else its first by the measure's rule
    with the batch first in its run."""
    given = given or {}
    return {m.name: clip(given[m.name], size) if m.name in given else m.batch_windows(params, 0, size) for m in chosen}


def clip(take: Take, size: int, start: int = 0) -> Take:
    """``take`` within the batch's windows ``start … start + size − 1``, counted from ``start``:
    the share of one part of a batch split in parts (the OOM splitter)."""
    if isinstance(take, int):
        return max(0, min(size, take - start))
    return tuple(i - start for i in take if start <= i < start + size)


def taken_indices(take: Take) -> np.ndarray:
    """The indices into the batch of the windows ``take`` names, ascending."""
    return np.arange(take) if isinstance(take, int) else np.asarray(take, dtype=np.int64)


def spread_takes(
    chosen: Sequence[Measure], params: AnalysisParams, picked: Mapping[str, Collection[str]], windows
) -> dict[str, tuple[int, ...]]:
    """For each measure that spreads its windows, the indices of the batch's ``windows`` among
    those ``picked`` for it (window ids, ``run_plan.chosen_windows``)."""
    return {
        m.name: tuple(i for i, w in enumerate(windows) if w.window_id in picked[m.name])
        for m in chosen
        if m.name in picked
    }


def batch_windows(
    chosen: Sequence[Measure], params: AnalysisParams, before: Mapping[str, int], size: int
) -> dict[str, int]:
    """How many of a batch's ``size`` first windows each measure with a quota takes, ``before[name]``
    of the run's windows before the batch (``Measure.batch_windows``); the others take every window."""
    return {m.name: m.batch_windows(params, before[m.name], size) for m in chosen if m.name in before}


def sum_name(measure: Measure, name: str) -> str:
    """How sum ``name`` of ``measure`` travels and is stored: ``<measure>.<sum>`` for a plugin's."""
    return f"{measure.name}.{name}" if measure.qualified else name


def put_sums(ctx: BatchContext, measure: Measure, sums: Mapping[str, np.ndarray]) -> None:
    """A measure's per-head sums into the batch's head sums, checked against its declaration."""
    shape = (ctx.n_groups, ctx.model.n_layers, ctx.model.n_heads)
    for name, value in sums.items():
        if name not in measure.sums:
            raise MeasureError(f"measure {measure.name}: sum {name!r} is not among its declared sums {measure.sums!r}")
        array = np.asarray(value)
        if array.shape != shape or array.dtype not in (np.float64, np.int64):
            raise MeasureError(
                f"measure {measure.name}: sum {name!r} must be float64 or int64 of shape {shape} "
                f"[group, layer, head], not {array.dtype} {array.shape}"
            )
        ctx.heads[sum_name(measure, name)] = array
