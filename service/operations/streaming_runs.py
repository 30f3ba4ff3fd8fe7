"""Streaming effects of a finished run's KV heads (SPEC §10): ``headatlas effects RUN --streaming``.

Each KV head of a causal model, restricted to ``sink`` S sinks and ``recent`` W recent keys
(``service.measures.streaming``), on ``windows`` windows of the run, chosen by the rule of its
ablation effects (``run_plan.effect_targets``: spread over its replicate groups, or its first for a
run stored before that rule; each checked to be a window the run holds), on the run's objective.
The sums are kept per replicate group (SPEC §5d) and stored in ``streaming_effects``, one set per
(S, W): measured again, a restriction's rows are replaced. The table gives each KV head's mean
effect and attention mass beyond sinks + W with the delete-one-group jackknife interval every other
statistic has, and the atlas predictor tested against the effect (SPEC §10): Spearman's ρ between
the KV heads' attention mass beyond sinks + W and their streaming effect, its interval the same
jackknife (ρ recomputed without each replicate group); and the same for the long-range share of
high-similarity pairs (distance ≥ W, from the run's distance histograms over all its windows,
taken as fixed as §9 takes noise_share).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from headatlas.service.errors import Param, ParameterError
from headatlas.service.operations.events import Estimate, Sink, WindowsMeasured, ignore
from headatlas.service.storage.store import Run, Store
from headatlas.service.storage.streaming_rows import SUMS, StreamingSums
from headatlas.service.wording import counted

COLUMNS = ("layer", "kv_head", "effect", "effect_lo", "effect_hi", "beyond", "beyond_lo", "beyond_hi", "long_range")


@dataclass(frozen=True)
class StreamingRequest:
    """What ``effects RUN --streaming`` asks for: the run, S, W, how many of its windows, and
    where and how many at a time they run."""

    run: str | int | None
    sink: int
    recent: int
    windows: int = 16
    device: str = "auto"
    batch_size: int = 1

    def __post_init__(self) -> None:
        from headatlas.service.measures.streaming import check_window

        check_window(self.sink, self.recent)
        if self.windows < 1:
            raise ParameterError(Param("windows", self.windows), ": must be at least 1")
        if self.batch_size < 1:
            raise ParameterError(Param("batch_size", self.batch_size), ": must be at least 1")


@dataclass
class StreamingTable:
    """A run's streaming effects of one restriction: one row per (layer, KV head), ``COLUMNS``."""

    run: Run
    sink: int
    recent: int
    objective: str
    windows: int
    groups: int
    scheme: str
    longest: int
    intact_mean: float
    rho: tuple[float, float, float] = (math.nan, math.nan, math.nan)  # ρ(beyond, effect) and its interval
    rho_long: tuple[float, float, float] = (math.nan, math.nan, math.nan)  # ρ(long_range, effect)
    measured: int = 0
    seconds: float = 0.0
    columns: list[str] = field(default_factory=lambda: list(COLUMNS))
    rows: list[tuple] = field(default_factory=list)

    def note(self) -> str:
        from headatlas.service.reports.intervals import MIN_GROUPS, scheme_words

        rough = f", fewer than {MIN_GROUPS}: their widths are rough" if self.groups < MIN_GROUPS else ""

        def said(rho: float, lo: float, hi: float) -> str:
            return f"{rho:+.3f}" + (f" [{lo:+.3f}, {hi:+.3f}]" if math.isfinite(lo) else " (no interval)")

        return (
            f"effect = O(KV head streaming) − O(intact), O = {self.objective} (intact mean {self.intact_mean:.4g}), "
            f"streaming: the first {self.sink} tokens and the {self.recent} most recent keys (S = {self.sink}, "
            f"W = {self.recent}), every query head of the KV head; beyond: its attention mass beyond them in the intact "
            f"model; over {counted(self.windows, 'window')} of up to {self.longest} tokens; 95% intervals: jackknife "
            f"over {self.groups} replicate groups {scheme_words(self.scheme)}{rough}; the predictors, Spearman's ρ "
            f"with the effect over the {len(self.rows)} KV heads: beyond {said(*self.rho)}, long_range (its share of "
            f"high-similarity pairs at a distance ≥ W in the run's analysis, taken as fixed) {said(*self.rho_long)}"
        )


def measure_streaming(store: Store, request: StreamingRequest, events: Sink = ignore, *, model=None) -> StreamingTable:
    """Measure and store the streaming effects ``request`` asks for (module docstring); ``model``:
    the run's model loaded already."""
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.results import window_group
    from headatlas.service.engine.run_plan import effect_targets
    from headatlas.service.engine.windows import TokenClasses, collate
    from headatlas.service.measures import streaming as st
    from headatlas.service.measures.objectives import objective_for
    from headatlas.service.operations.added_effects import check_addable, check_windows_of_run
    from headatlas.service.operations.runs import find_run
    from headatlas.service.params import AnalysisParams
    from headatlas.service.reports.stored import refresh
    from headatlas.service.storage.streaming_rows import long_range_share, store_streaming

    began = time.perf_counter()
    with store.checked_read() as conn:
        run = find_run(conn, request.run, events)
    check_addable(run)
    params = AnalysisParams.from_dict(run.params)
    loaded = model or load_model(run.model, device=request.device, dtype=params.dtype)
    if not loaded.causal:
        raise ParameterError(
            Param("streaming", True),
            f": run {run.run_id} ({run.name}) is of {loaded.name}, an encoder (it attends both ways); the streaming "
            "restriction keeps a decoder's sinks and recent keys",
        )
    objective = objective_for(loaded, params.objective)
    tokens = TokenClasses.for_model(loaded)
    chosen = [
        w for _p, w in effect_targets(run.corpus, loaded, replace(params, effect_windows=request.windows), tokens)
    ]
    check_windows_of_run(store, run, chosen)
    passes = loaded.n_kv_heads * (loaded.n_layers + 1) / 2
    events(
        Estimate(
            (
                f"streaming S = {request.sink}, W = {request.recent} on {counted(len(chosen), 'window')}: "
                f"about {passes:.0f} forward passes' worth per window (each KV head restarts from its layer's input)",
            )
        )
    )
    groups = np.array(
        [window_group(params.replicates, window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in chosen]
    )
    reps = np.unique(groups)
    slot = {int(r): g for g, r in enumerate(reps.tolist())}
    shape = (len(reps), loaded.n_layers, loaded.n_kv_heads)
    sums = {name: np.zeros(shape) for name in SUMS}
    longest = 0
    for start in range(0, len(chosen), request.batch_size):
        part = collate(chosen[start : start + request.batch_size], tokens.pad_id)
        got = st.streaming_effects(
            loaded,
            part.input_ids,
            part.attention_mask,
            sink=request.sink,
            recent=request.recent,
            window_ids=part.window_ids,
            objective=objective,
        )
        for row in range(len(part.windows)):
            intact = float(got.intact[row])
            if not math.isfinite(intact) or not np.isfinite(got.effect[row].numpy()).all():
                continue  # a window whose objective is undefined (one token) adds nothing
            g = slot[int(groups[start + row])]
            n = int(got.lengths[row])
            sums["windows"][g] += 1
            sums["tokens"][g] += n
            sums["effect_sum"][g] += got.effect[row].numpy()
            sums["beyond_sum"][g] += got.beyond[row].numpy()
            sums["objective_sum"][g] += intact
            longest = max(longest, n)
        events(WindowsMeasured(min(start + request.batch_size, len(chosen)), len(chosen)))
    measured = StreamingSums(request.sink, request.recent, objective.name, longest, reps, sums)
    store.atomically(lambda conn: store_streaming(conn, run.run_id, measured))
    refresh(store, run.run_id)  # the head tables' results show the streaming effects: stored again
    with store.checked_read() as conn:
        long_range = long_range_share(conn, run.run_id, request.recent, loaded.n_kv_heads)
    table = streaming_table(run, measured, long_range)
    table.measured, table.seconds = int(sums["windows"][:, 0, 0].sum()), time.perf_counter() - began
    return table


def stored_streaming(store: Store, ref: str | int | None, sink: int, recent: int) -> StreamingTable | None:
    """The run's stored streaming effects of (``sink``, ``recent``), or None where it holds none."""
    from headatlas.service.operations.runs import find_run
    from headatlas.service.storage.streaming_rows import long_range_share, streaming_sums

    with store.checked_read() as conn:
        run = find_run(conn, ref, any_status=True)
        sums = streaming_sums(conn, run.run_id, sink, recent)
        if sums is None:
            return None
        long_range = long_range_share(conn, run.run_id, recent, sums.sums["windows"].shape[2])
    return streaming_table(run, sums, long_range)


def group_jackknife(total: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean ``Σ total / Σ counts`` over the groups (first axis) and its §5d interval, the
    delete-one-group jackknife with the t quantile: NaN bounds with fewer than two groups."""
    from headatlas.service.reports.intervals import t95

    n = counts.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total.sum(axis=0) / n
        present = counts.reshape(len(counts), -1).any(axis=1)
        r = int(present.sum())
        if r < 2:
            nan = np.full_like(mean, math.nan)
            return mean, nan, nan
        drops = np.stack([(total.sum(axis=0) - total[g]) / (n - counts[g]) for g in np.flatnonzero(present)])
    half = t95(r - 1) * np.sqrt((r - 1) / r * ((drops - drops.mean(axis=0)) ** 2).sum(axis=0))
    return mean, mean - half, mean + half


def predictor_rho(sums: StreamingSums, fixed: np.ndarray | None = None) -> tuple[float, float, float]:
    """Spearman's ρ between the KV heads' mean attention mass beyond sinks + W (or ``fixed``
    ``[layer, kv_head]``, a predictor the windows do not change) and their mean streaming effect,
    with its §5d interval: the jackknife over ρ without each replicate group."""
    from headatlas.service.operations.prune_curves import spearman
    from headatlas.service.reports.intervals import jackknife_halfwidth

    counts, effect, beyond = sums.sums["windows"], sums.sums["effect_sum"], sums.sums["beyond_sum"]

    def rho(keep: np.ndarray) -> float:
        n = counts[keep].sum(axis=0)
        x = (beyond[keep].sum(axis=0) / n if fixed is None else fixed).reshape(-1)
        y = (effect[keep].sum(axis=0) / n).reshape(-1)
        ok = np.isfinite(x) & np.isfinite(y)
        return spearman(x[ok], y[ok])

    every = counts[:, 0, 0] > 0
    full = rho(every)
    present = np.flatnonzero(every)
    drops = [rho(every & (np.arange(len(every)) != g)) for g in present] if len(present) > 1 else []
    half = jackknife_halfwidth(drops)
    return (full, math.nan, math.nan) if half is None else (full, max(-1.0, full - half), min(1.0, full + half))


def streaming_table(run: Run, sums: StreamingSums, long_range: np.ndarray | None = None) -> StreamingTable:
    """The rows of ``COLUMNS`` from a restriction's group sums, and ``long_range`` ``[layer,
    kv_head]`` (``streaming_rows.long_range_share``; None: NaN)."""
    from headatlas.service.reports.intervals import scheme_of

    counts = sums.sums["windows"]
    effect = group_jackknife(sums.sums["effect_sum"], counts)
    mass, lo, hi = group_jackknife(sums.sums["beyond_sum"], counts)
    beyond = (mass, np.clip(lo, 0.0, 1.0), np.clip(hi, 0.0, 1.0))  # a share of a row's attention
    _g, n_layers, n_kv = counts.shape
    if long_range is None or long_range.shape != (n_layers, n_kv):
        long_range = np.full((n_layers, n_kv), math.nan)
    rows = [
        (layer, kv, *(float(c[layer, kv]) for c in (*effect, *beyond, long_range)))
        for layer in range(n_layers)
        for kv in range(n_kv)
    ]
    windows = int(counts[:, 0, 0].sum())
    return StreamingTable(
        run=run,
        sink=sums.sink,
        recent=sums.recent,
        objective=sums.objective,
        windows=windows,
        groups=int((counts[:, 0, 0] > 0).sum()),
        scheme=scheme_of(run.params),
        longest=sums.longest,
        intact_mean=float(sums.sums["objective_sum"][:, 0, 0].sum() / windows) if windows else math.nan,
        rho=predictor_rho(sums) if windows else (math.nan, math.nan, math.nan),
        rho_long=predictor_rho(sums, long_range) if windows and np.isfinite(long_range).any() else (math.nan,) * 3,
        rows=rows,
    )
