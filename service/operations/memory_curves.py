"""A stored run's memory curves (SPEC §10): ``headatlas prune RUN --streaming`` and
``run.memory_curve(...)``.

KV heads are turned to streaming (``sink`` S sinks, ``recent`` W recent keys) cumulatively in an
order, a share ``step`` of them at a time, all of a step's heads at once through the hook points
``blocks.L.attn.mask`` (``measures.streaming.streaming_heads``); after each step the objective is
measured on *evaluation* windows, against the KV memory saved per sequence (SPEC §10: each
streaming KV head keeps S + W of the n keys and values, ``2 · d_head · (n − S − W) · bytes``, of a
full cache of ``2 · L · n_kv · d_head · n · bytes``; n the longest evaluation window, bytes the
run's dtype).

Orders (``ORDERS``): ``effect``, the run's stored streaming effect of (S, W), smallest first;
``beyond``, its stored attention mass beyond sinks + W, smallest first; ``long_range``, the share of
its query heads' high-similarity pairs at a distance ≥ W (the run's distance histograms), smallest
first; ``noise``, its query heads' mean ``noise_share``, largest first (the seed's claim); random
(``seeds`` of them); and SPEC §9's trivial orders that have a meaning for a KV head's reach:
``layer`` (first layer first) and ``sinks`` (its query heads' attention to the first token, largest
first). §9's output_norm and output_variance rank what a head writes, not how far back it reads:
left out.

The effect and beyond orders need the streaming effects stored (``effects RUN --streaming``),
which were measured on the windows of the run's effect rule; the evaluation windows are others
(spread over the corpus's documents, those windows left out), and both sets of window ids are
stored with the curve. Intervals: the jackknife over the evaluation windows' replicate groups
(SPEC §5d), the increase paired window by window.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from headatlas.service.errors import Param, ParameterError
from headatlas.service.operations.events import Estimate, PruneStarted, PruneStep, Sink, ignore
from headatlas.service.wording import counted

if TYPE_CHECKING:
    from collections.abc import Sequence

    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.engine.windows import Window
    from headatlas.service.measures.objectives import Objective
    from headatlas.service.storage.store import Run, Store
    from headatlas.service.storage.streaming_curve_rows import StoredMemoryCurve

ORDERS = ("effect", "beyond", "long_range", "noise", "random", "layer", "sinks")
FROM_EFFECTS = ("effect", "beyond")  # read from the stored streaming effects of (S, W)
KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_MAX_LOSS = 0.05
KVHead = tuple[int, int]


@dataclass(frozen=True)
class MemoryCurveRequest:
    """What ``prune RUN --streaming`` asks for: the run, S, W, the orders (None: every one), the
    share of KV heads per step, random seeds, evaluation windows; ``show``: the newest stored
    curve read back, nothing measured."""

    run: str | int | None
    sink: int
    recent: int
    orders: tuple[str, ...] | None = None
    step: float = 0.1
    seeds: int = 3
    windows: int = 16
    device: str = "auto"
    show: bool = False

    @classmethod
    def build(
        cls,
        run: str | int | None,
        *,
        sink: int,
        recent: int,
        orders: str | Sequence[str] | None = None,
        step: str | float = 0.1,
        seeds: int = 3,
        windows: int = 16,
        device: str = "auto",
        show: bool = False,
    ) -> MemoryCurveRequest:
        """A validated request (``orders`` comma-separated or a sequence; ``step`` 0.1 or 10%),
        refused before any run is read."""
        from headatlas.service.measures.streaming import check_window
        from headatlas.service.operations.prune_runs import MAX_SEEDS
        from headatlas.service.operations.requests import prune_step

        check_window(sink, recent)
        chosen = None
        if orders is not None:
            names = orders.split(",") if isinstance(orders, str) else [str(o) for o in orders]
            chosen = tuple(n.strip() for n in names if n.strip())
            bad = [n for n in chosen if n not in ORDERS]
            if not chosen or bad:
                raise ParameterError(
                    Param("orders", orders, quoted=True),
                    f": {'name at least one' if not chosen else repr(bad[0]) + ' is not an order'}; use "
                    f"{', '.join(ORDERS)}",
                )
        if not 1 <= seeds <= MAX_SEEDS:
            raise ParameterError(Param("seeds", seeds), f": use 1 to {MAX_SEEDS} random orders (one curve each)")
        if windows < 1:
            raise ParameterError(Param("windows", windows), ": evaluate on at least 1 window")
        return cls(run, sink, recent, chosen, prune_step(step), seeds, windows, device, show)


@dataclass(frozen=True)
class MemoryCurved:
    """The run and its memory curve as stored; ``measured``: False where it was read back."""

    run: Run
    saved: StoredMemoryCurve
    measured: bool


def memory_curve(store: Store, request: MemoryCurveRequest, events: Sink = ignore, *, model=None) -> MemoryCurved:
    """The memory curve ``request`` asks for, measured and stored (``show``: the newest stored one);
    ``model``: the run's model loaded already."""
    from headatlas.service.operations.prune_runs import check_request
    from headatlas.service.operations.runs import find_run
    from headatlas.service.storage.streaming_curve_rows import load_memory_curve

    with store.checked_read() as conn:
        run = find_run(conn, request.run, events)
        if request.show:
            saved = load_memory_curve(conn, run.run_id)
            if saved is None:
                raise ParameterError(
                    Param("show", True),
                    f": run {run.run_id} ({run.name}) has no stored memory curve; measure one (leave out --show)",
                )
            return MemoryCurved(run, saved, measured=False)
    check_request(run, orders=request.orders, seeds=request.seeds)
    return MemoryCurved(run, _measure(store, run, request, events, model), measured=True)


def _needs_effects(run: Run, sink: int, recent: int, orders: tuple[str, ...]) -> ParameterError:
    named = [o for o in orders if o in FROM_EFFECTS]
    return ParameterError(
        f"run {run.run_id} ({run.name}) holds no streaming effects of --sink {sink} --recent {recent}, which the "
        f"{' and '.join(named)} order{'s' if len(named) > 1 else ''} read: run `headatlas effects {run.name} "
        f"--streaming --sink {sink} --recent {recent}` first (or name other orders with --order)",
        parameter="orders",
        value=",".join(orders),
    )


def _measure(store: Store, run: Run, request: MemoryCurveRequest, events: Sink, model) -> StoredMemoryCurve:
    from headatlas.service.engine.model import load_model
    from headatlas.service.measures.objectives import objective_for
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.streaming_curve_rows import load_memory_curve, store_memory_curve
    from headatlas.service.storage.streaming_rows import streaming_sums

    orders = request.orders or ORDERS
    sink, recent = request.sink, request.recent
    with store.checked_read() as conn:
        sums = streaming_sums(conn, run.run_id, sink, recent)
    if sums is None and any(o in FROM_EFFECTS for o in orders):
        raise _needs_effects(run, sink, recent, orders)
    params = AnalysisParams.from_dict(run.params)
    loaded = model or load_model(run.model, device=request.device, dtype=params.dtype)
    if not loaded.causal:
        raise ParameterError(
            Param("streaming", True),
            f": run {run.run_id} ({run.name}) is of {loaded.name}, an encoder (it attends both ways); a memory curve "
            "streams a decoder's KV heads",
        )
    began = time.perf_counter()
    events(PruneStarted(run))
    objective = objective_for(loaded, sums.objective if sums is not None else params.objective)
    selection = _selection_windows(run, loaded, params, sums) if sums is not None else []
    evaluation = held_out(run.corpus, loaded, params, request.windows, {w.window_id for w in selection})
    with store.checked_read() as conn:
        ranked = _orders(conn, run, loaded, sums, orders, request.seeds, recent)
    total = loaded.n_layers * loaded.n_kv_heads
    from headatlas.service.operations.prune_curves import removal_counts

    counts = removal_counts(total, request.step)
    names = [o for o in orders if o != "random"] + [f"random:{s}" for s in range(request.seeds) if "random" in orders]
    evaluations = len(names) * (len(counts) - 1) + 1
    events(
        Estimate(
            (
                f"measuring {counted(len(names), 'curve')} ({', '.join(names)}) × {len(counts)} steps of "
                f"{counted(total, 'KV head')} (S = {sink}, W = {recent}): {evaluations:,} evaluations of "
                f"{counted(len(evaluation), 'window')}",
            )
        )
    )
    ev = Evaluation.of(loaded, evaluation, objective, params, sink=sink, recent=recent)
    intact = ev.values([])
    done, start = 1, time.perf_counter()
    curves: dict[str, np.ndarray] = {}
    for name in names:
        values = [intact]
        for index, n in enumerate(counts[1:], start=2):
            values.append(ev.values(ranked[name][:n]))
            done += 1
            left = (time.perf_counter() - start) / done * (evaluations - done)
            events(PruneStep(name, index, len(counts), left))
        curves[name] = np.stack(values)  # [step, window]
    n = ev.longest
    kv_bytes = KV_BYTES.get(params.dtype, 4)
    shape = {"layers": loaded.n_layers, "kv_heads": loaded.n_kv_heads, "d_head": loaded.d_head}
    rows, streamed = curve_rows(
        curves, ranked, counts, ev.groups, n=n, sink=sink, recent=recent, kv_bytes=kv_bytes, **shape
    )
    from headatlas.service.measures.streaming import kv_cache_bytes

    meta = {
        "sink": sink,
        "recent": recent,
        "objective": objective.name,
        "unit": objective.unit,
        "orders": ",".join(orders),
        "step": request.step,
        "seeds": request.seeds,
        **shape,
        "seq_len": n,
        "kv_bytes": kv_bytes,
        "full_cache": float(kv_cache_bytes(n=n, kv_bytes=kv_bytes, **shape)),
        "selection": (
            f"the run's stored streaming effects of S = {sink}, W = {recent} ({counted(len(selection), 'window')})"
            if sums is not None
            else "no streaming effects: no order asked reads them"
        ),
        "selection_windows": " ".join(w.window_id for w in selection),
        "evaluation_windows": " ".join(w.window_id for w in evaluation),
        "evaluated": len(evaluation),
        "scheme": ev.scheme,
        "groups": len(np.unique(ev.groups)),
        "intact": float(np.mean(intact)),
        "seconds": time.perf_counter() - began,
    }
    curve_id = store.atomically(lambda conn: store_memory_curve(conn, run.run_id, meta, rows, streamed))
    with store.read() as conn:
        saved = load_memory_curve(conn, run.run_id, curve_id)
    assert saved is not None
    return saved


def _selection_windows(run: Run, model: LoadedModel, params, sums) -> list[Window]:
    """The windows the run's stored streaming effects were measured on: its effect rule's first as
    many as the stored rows count (``streaming_runs.measure_streaming``'s choice), checked against
    the stored windows per replicate group."""
    from headatlas.service.engine.results import window_group
    from headatlas.service.engine.run_plan import effect_targets
    from headatlas.service.engine.windows import TokenClasses

    stored = sums.sums["windows"][:, 0, 0]
    chosen = [
        w
        for _p, w in effect_targets(
            run.corpus, model, replace(params, effect_windows=int(stored.sum())), TokenClasses.for_model(model)
        )
    ]
    groups = [window_group(params.replicates, window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in chosen]
    want = {int(r): int(c) for r, c in zip(sums.reps.tolist(), stored.tolist(), strict=True) if c}
    if {int(g): groups.count(g) for g in set(groups)} != want:
        raise ParameterError(
            f"run {run.run_id} ({run.name}): the windows its streaming effects of S = {sums.sink}, W = {sums.recent} "
            "were measured on cannot be named again, so none can be kept out of the evaluation: measure them again "
            f"(`headatlas effects {run.name} --streaming --sink {sums.sink} --recent {sums.recent}`)"
        )
    return chosen


def held_out(corpus: str, model: LoadedModel, params, count: int, used: set[str]) -> list[Window]:
    """``count`` windows of the corpus spread over its documents (``effect_runs.spread_windows``),
    none of ``used``; refused where none is left."""
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.operations.effect_runs import spread_windows

    candidates = spread_windows(iter_documents(corpus), model, params, count + len(used))
    chosen = [w for w in candidates if w.window_id not in used][:count]
    if not chosen:
        raise ParameterError(
            f"{corpus}: every window is among the {counted(len(used), 'window')} used already (to choose the order, "
            "or to measure the curve): none is left to evaluate on; analyse a longer corpus or measure fewer windows"
        )
    return chosen


def _per_kv(values: dict[tuple[int, int], float], model: LoadedModel) -> np.ndarray:
    """``[layer, kv_head]``: the mean over each KV head's query heads of a per-head value (NaN where
    the run holds none)."""
    group = model.n_heads // model.n_kv_heads
    out = np.full((model.n_layers, model.n_kv_heads), math.nan)
    for layer in range(model.n_layers):
        for kv in range(model.n_kv_heads):
            got = [values[(layer, h)] for h in range(kv * group, (kv + 1) * group) if (layer, h) in values]
            if got:
                out[layer, kv] = float(np.mean(got))
    return out


def _orders(conn, run: Run, model: LoadedModel, sums, orders, seeds: int, recent: int) -> dict[str, list[KVHead]]:
    """Each order's KV heads, first streamed first (ties by position)."""
    from headatlas.service.operations.prune_runs import noise_shares, sink_shares
    from headatlas.service.storage.streaming_rows import long_range_share

    every = [(layer, kv) for layer in range(model.n_layers) for kv in range(model.n_kv_heads)]

    def by(values: np.ndarray, *, largest: bool = False) -> list[KVHead]:
        sign = -1.0 if largest else 1.0
        return sorted(every, key=lambda lk: (sign * values[lk] if np.isfinite(values[lk]) else math.inf, lk))

    ranked: dict[str, list[KVHead]] = {"layer": list(every)}
    if sums is not None:
        n = sums.sums["windows"].sum(axis=0)
        ranked["effect"] = by(sums.sums["effect_sum"].sum(axis=0) / n)
        ranked["beyond"] = by(sums.sums["beyond_sum"].sum(axis=0) / n)
    if "long_range" in orders:
        share = long_range_share(conn, run.run_id, recent, model.n_kv_heads)
        if share is None:
            raise ParameterError(
                Param("orders", "long_range"), f": run {run.run_id} ({run.name}) holds no distance histograms"
            )
        ranked["long_range"] = by(share)
    if "noise" in orders:
        ranked["noise"] = by(_per_kv(noise_shares(conn, run.run_id), model), largest=True)
    if "sinks" in orders:
        ranked["sinks"] = by(_per_kv(sink_shares(conn, run.run_id, causal=True), model), largest=True)
    for seed in range(seeds):
        shuffled = list(every)
        random.Random(seed).shuffle(shuffled)
        ranked[f"random:{seed}"] = shuffled
    return ranked


@dataclass
class Evaluation:
    """The evaluation windows prepared once: their batches as the objective runs them, the intact
    final hidden states (the drift objectives' reference), the replicate groups and the longest
    window's tokens."""

    model: LoadedModel
    batches: list
    intact: list
    objective: Objective
    sink: int
    recent: int
    groups: np.ndarray
    scheme: str
    longest: int

    @classmethod
    def of(
        cls, model: LoadedModel, windows: list[Window], objective, params, *, sink: int, recent: int, size: int = 4
    ) -> Evaluation:
        import torch

        from headatlas.service.engine.results import window_group
        from headatlas.service.engine.windows import TokenClasses, collate
        from headatlas.service.measures import effects as fx
        from headatlas.service.measures.objectives import wide
        from headatlas.service.operations.prune_curves import prepared

        pad = TokenClasses.for_model(model).pad_id
        batches = prepared(
            model, [collate(windows[i : i + size], pad) for i in range(0, len(windows), size)], objective
        )
        with torch.no_grad():
            intact = [wide(fx._run_model(model, ids, mask)) for ids, _targets, mask in batches]
        scheme = params.resolved(len({w.doc_id for w in windows})).replicates  # as prune resolves it
        groups = np.array(
            [window_group(scheme, window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in windows]
        )
        longest = max(int(mask.sum(-1).max()) for _ids, _targets, mask in batches)
        return cls(model, batches, intact, objective, sink, recent, groups, scheme, longest)

    def values(self, heads: list[KVHead]) -> np.ndarray:
        """The objective per window ``[window]`` with ``heads`` streaming at once."""
        from headatlas.service.measures.streaming import streaming_heads
        from headatlas.service.operations.prune_curves import objective_under

        def edit(ids):
            return streaming_heads(self.model, heads, sink=self.sink, recent=self.recent, n_pos=ids.shape[1])

        return objective_under(self.model, self.batches, self.intact, self.objective, edit)


def curve_rows(
    curves: dict[str, np.ndarray],
    ranked: dict[str, list[KVHead]],
    counts: list[int],
    groups: np.ndarray,
    *,
    layers: int,
    kv_heads: int,
    d_head: int,
    n: int,
    sink: int,
    recent: int,
    kv_bytes: int,
) -> tuple[list[tuple], list[str]]:
    """One row per order and step (``streaming_curve_rows.STEP_COLUMNS``) and the KV heads added at
    each: memory saved by the formula of SPEC §10, the objective and its paired increase over step
    0 with the jackknife's interval over ``groups``."""
    from headatlas.service.measures.streaming import kv_cache_bytes, memory_saved
    from headatlas.service.operations.effect_runs import jackknife

    full = kv_cache_bytes(layers=layers, kv_heads=kv_heads, d_head=d_head, n=n, kv_bytes=kv_bytes)
    total = layers * kv_heads
    rows, streamed = [], []
    for name, values in curves.items():
        mean, lo, hi, _r = jackknife(values.T, groups)
        up, up_lo, up_hi, _r = jackknife((values - values[0]).T, groups)
        previous = 0
        for step, count in enumerate(counts):
            saved = memory_saved(count, d_head=d_head, n=n, sink=sink, recent=recent, kv_bytes=kv_bytes)
            cells = (mean[step], lo[step], hi[step], up[step], up_lo[step], up_hi[step])
            rows.append((name, step, count, count / total, float(saved), saved / full, *(float(c) for c in cells)))
            streamed.append(" ".join(f"{layer}.{kv}" for layer, kv in ranked[name][previous:count]))
            previous = count
    return rows, streamed


# --- reading a curve: the longest prefix within a loss budget ----------------------------------


def check_max_loss(max_loss: float) -> float:
    """A loss budget: a finite rise of the objective, in its units (below 0: the steps must lower it)."""
    if not math.isfinite(max_loss):
        raise ParameterError(Param("max_loss", max_loss), ": a rise of the objective in its units, such as 0.05")
    return float(max_loss)


def chosen_order(saved: StoredMemoryCurve, named: str | None) -> str:
    """The order a budget is read from: ``named``, else effect, else the first the curve holds that
    is not random."""
    held = saved.orders()
    if named is not None:
        if named not in held:
            raise ParameterError(
                Param("order", named, quoted=True), f": the memory curve holds the orders {', '.join(held)}"
            )
        return named
    return "effect" if "effect" in held else next((o for o in held if not o.startswith("random:")), held[0])


def within(increases: list[float], max_loss: float) -> int:
    """How many steps (after step 0) the increase stays ≤ ``max_loss`` from the first: the index of
    the last step of the longest prefix (0: none; a NaN stops it)."""
    last = 0
    for index, value in enumerate(increases[1:], start=1):
        if not (value <= max_loss):
            break
        last = index
    return last


@dataclass(frozen=True)
class Headline:
    order: str
    max_loss: float
    unit: str
    step: tuple  # the row of the last step within the budget
    saved: float  # bytes per sequence
    share: float
    bounds: tuple[float, float] | None  # bytes saved where the increase's upper, lower bound stays ≤ X
    full: float

    def text(self) -> str:
        at = {c: i for i, c in enumerate(("order", "step", "kv", "fraction", "saved", "share"))}
        kv = int(self.step[at["kv"]])
        said = (
            f"memory saved at a loss increase of {self.max_loss:g} {self.unit} ({self.order} order): "
            f"{_bytes(self.saved)} per sequence ({self.share:.1%} of the {_bytes(self.full)} KV cache), "
            f"{counted(kv, 'KV head')} streaming"
        )
        if self.bounds is None:
            return said + " (no interval: fewer than 2 replicate groups)"
        low, high = self.bounds
        return (
            said
            + f"; interval {_bytes(low)} to {_bytes(high)} (the steps whose increase's upper / lower 95% bound stays ≤ {self.max_loss:g})"
        )


def headline(saved: StoredMemoryCurve, max_loss: float, order: str | None = None) -> Headline:
    """Memory saved at a loss increase of ``max_loss`` on the curve of ``order`` (``chosen_order``),
    with the interval the increase's bounds give where the curve has replicate groups."""
    name = chosen_order(saved, order)
    rows = [r for r, _h in saved.steps_of(name)]
    at = {c: i for i, c in enumerate(saved.columns)}
    increases = [r[at["increase"]] for r in rows]
    last = rows[within(increases, max_loss)]
    bounds = None
    if all(r[at["increase_lo"]] is not None for r in rows[1:]) and saved.meta["groups"] >= 2:
        upper = rows[within([r[at["increase_hi"]] for r in rows], max_loss)]
        lower = rows[within([r[at["increase_lo"]] for r in rows], max_loss)]
        bounds = (float(upper[at["memory_saved"]]), float(lower[at["memory_saved"]]))
    return Headline(
        order=name,
        max_loss=max_loss,
        unit=saved.meta["unit"],
        step=last,
        saved=float(last[at["memory_saved"]]),
        share=float(last[at["memory_share"]]),
        bounds=bounds,
        full=float(saved.meta["full_cache"]),
    )


def _bytes(value: float) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value:,.0f} B"


def note(saved: StoredMemoryCurve) -> str:
    """How the curve was made, in a line."""
    m = saved.meta
    return (
        f"memory curve {m['curve_id']}: KV heads streaming (S = {m['sink']}, W = {m['recent']}) cumulatively, "
        f"{m['step']:.0%} a step; O = {m['objective']} ({m['unit']}, intact {m['intact']:.4g}) on "
        f"{counted(m['evaluated'], 'evaluation window')} ({m['groups']} replicate groups, {m['scheme']}), none of "
        f"those that chose the order; orders from {m['selection']}; memory saved per sequence of n = {m['seq_len']} "
        f"tokens, {m['kv_bytes']} bytes an element (2 · d_head · (n − S − W) · bytes a KV head, of "
        f"{_bytes(m['full_cache'])})"
    )
