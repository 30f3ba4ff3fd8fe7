"""Pruning curves and the test of the seed paper's claim (SPEC §9), measured in this process.

Heads are removed cumulatively (mean ablation: each removed head's z replaced by its reference
mean, all of them in one full forward pass) in an order, and the objective is measured on
*evaluation* windows after each step. The orders are by measured effect (smallest first), by
gradient importance (smallest first; objectives that are losses only), by ``noise_share`` of a
stored run (largest first: the seed's claim, that heads whose similar pairs attention ignores can
go), and random (``seeds`` of them). The effects and importances that set the first two orders are
measured on *selection* windows, disjoint from the evaluation windows (every other window of the
spread), so that no order is read off the windows it is judged on.

When the run stores its effects (``analyze --effects``), the effect and importance orders are
read from them (``StoredOrders``: measured on the run's effect windows, which the evaluation
windows then exclude) and nothing is measured twice. A run that stores gradient importance alone
(``--effects gradient``: a model whose ablations are too dear to measure, such as a decoder whose
every ablated copy needs its own vocabulary softmax) gives the importance order and, asked for no
effect order, ρ against the importance instead (Michel et al.'s first-order estimate of the effect).

Trivial orders, which know nothing of what a head does, are the bar the claim must clear as well as
random: ``layer`` (first layer first), ``sinks`` (most attention to the window's specials first:
[CLS] and [SEP] for an encoder, the first token for a decoder, from the stored run), ``output_norm``
(smallest mean norm of the head's output ``z W_O^h`` first) and ``output_variance`` (smallest
variance of that output over positions first), both measured on the reference windows in one
forward pass. The noise-ordered curve is compared with the best of them (the smallest area against
random) as with random: the area between the two curves, with the jackknife's interval.

Beside an encoder's embedding drift, which is 0 with nothing removed and rises by construction,
each step also measures what the embeddings are for (``measures.retrieval``): every sentence of the
evaluation windows, embedded alone with the same heads removed, retrieves its successor by cosine
among the sentences that follow another in their window (top-1 and MRR, each with its interval).

``one_per_layer`` is Michel et al. 2019's experiment, not a cumulative order: every layer keeps only
its most important head (largest effect, else importance) and every other head is removed at once,
one step (``prune_michel``).

The claim is tested two ways, each with a 95% interval: the **area** between the noise-ordered
curve and the mean of the random ones (trapezoids over the fraction removed; negative: pruning by
noise costs less than at random), whose standard error joins the jackknife over the evaluation
windows' replicate groups (§5d) and the spread of the area between the random seeds (the random
orders are themselves a sample: ``s²/S`` of the seeds' areas), with Welch–Satterthwaite degrees of
freedom; and **Spearman's ρ** between ``noise_share`` and the mean-ablation effect across heads (the
effects' groups dropped one at a time; the run's ``noise_share`` is taken as fixed).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from headatlas.service.engine.hooks import hooks
from headatlas.service.engine.model import LoadedModel
from headatlas.service.engine.results import window_group
from headatlas.service.engine.windows import TokenClasses, Window, collate
from headatlas.service.errors import Param, ParameterError
from headatlas.service.measures import effects as fx
from headatlas.service.measures import retrieval as rt
from headatlas.service.measures.objectives import Objective, wide
from headatlas.service.operations import prune_michel as michel
from headatlas.service.operations.effect_runs import jackknife, spread_windows
from headatlas.service.params import AnalysisParams
from headatlas.service.reports.intervals import jackknife_halfwidth
from headatlas.service.wording import counted

ORDERS = (
    "effect",
    "importance",
    "one_per_layer",
    "noise",
    "random",
    "layer",
    "sinks",
    "output_norm",
    "output_variance",
)
TRIVIAL_ORDERS = ("layer", "sinks", "output_norm", "output_variance")  # blind to what a head does
# neighbour retrieval beside an embedding objective, each with its interval (None for other objectives)
RETRIEVAL_COLUMNS = ("top1", "top1_lo", "top1_hi", "mrr", "mrr_lo", "mrr_hi")
Head = tuple[int, int]


@contextmanager
def removed(model: LoadedModel, heads: Sequence[Head], means: torch.Tensor) -> Iterator[None]:
    """Inside: every head of ``heads`` has its z replaced by its mean (``means [layer, head, d_head]``)."""
    d = model.d_head
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)

    def hook_for(layer: int, chosen: list[int]):
        keep = torch.ones(model.n_heads, 1, device=model.device)
        fill = torch.zeros(model.n_heads, d, device=model.device)
        for head in chosen:
            keep[head] = 0.0
            fill[head] = means[layer, head].to(model.device, torch.float32)

        def fn(z: torch.Tensor) -> torch.Tensor:
            z4 = z.reshape(*z.shape[:2], model.n_heads, d)
            return (z4 * keep.to(z.dtype) + fill.to(z.dtype)).reshape(z.shape)

        return fn

    edits = {f"blocks.{layer}.attn.z": hook_for(layer, chosen) for layer, chosen in by_layer.items()}
    with hooks(model.model, edits, model.adapter):
        yield


def objective_with(
    model: LoadedModel,
    batches: list,
    heads: Sequence[Head],
    means: torch.Tensor,
    intact: list[torch.Tensor],
    objective: Objective,
) -> np.ndarray:
    """The objective per evaluation window ``[window]`` with ``heads`` removed (``batches``:
    ``prepared`` batches)."""
    with removed(model, heads, means):
        return objective_under(model, batches, intact, objective, lambda _ids: nullcontext())


def objective_under(
    model: LoadedModel,
    batches: list,
    intact: list[torch.Tensor],
    objective: Objective,
    edit: Callable[[torch.Tensor], AbstractContextManager],
) -> np.ndarray:
    """The objective per evaluation window ``[window]`` with each batch run inside ``edit(its
    model_ids)`` (``batches``: ``prepared`` batches; ``intact``: each batch's intact final hidden
    states, the drift objectives' reference): pruning's removed heads, a streaming policy's KV heads."""
    out = []
    with torch.no_grad():
        for (model_ids, targets, mask), reference in zip(batches, intact, strict=True):
            with edit(model_ids):
                final = wide(fx._run_model(model, model_ids, mask))
            out.append(objective.per_window(final, targets, mask, reference).double().cpu())
    return torch.cat(out).numpy()


def prepared(
    model: LoadedModel, batches: list, objective: Objective
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each batch as the objective runs it: ``(model_ids, targets, attention_mask)`` on the
    model's device (a masked-LM objective masks its windows' positions, fixed by their ids)."""
    out = []
    for b in batches:
        mask = b.attention_mask.to(model.device)
        model_ids, targets = objective.prepare(b.input_ids.to(model.device), mask, b.window_ids)
        out.append((model_ids, targets, mask))
    return out


@dataclass
class StoredOrders:
    """The effect and importance orders read from a run's stored effects (``analyze --effects``):
    ``effect`` ``[layer, head]`` (mean ablation), ``importance`` or None, ``effect_drops`` the effect
    without each replicate group (for ρ's interval), ``windows`` the ids of the windows they were
    measured on (kept out of the evaluation windows)."""

    effect: np.ndarray | None
    importance: np.ndarray | None
    effect_drops: list[np.ndarray]
    windows: set[str]
    source: str
    importance_drops: list[np.ndarray] = field(default_factory=list)


@dataclass
class Curve:
    order: str  # effect, importance, noise, random:SEED
    steps: list[int]  # heads removed after each step (0 first)
    values: np.ndarray  # [step, window]: the objective on each evaluation window
    order_heads: list[Head] = field(default_factory=list)  # the order itself, first removed first
    # [step, query]: neighbour retrieval's top-1 hit and reciprocal rank (embedding objectives only)
    hits: np.ndarray | None = None
    reciprocal: np.ndarray | None = None


@dataclass(frozen=True)
class Retrieval:
    """Neighbour retrieval beside an embedding objective (``measures.retrieval``): how many queries
    and candidates, chance top-1 and MRR, and each query's replicate group (its window's)."""

    queries: int
    candidates: int
    chance_top1: float
    chance_mrr: float
    groups: np.ndarray  # [query]


def retrieval_applies(objective: Objective, model: LoadedModel) -> bool:
    """Whether a pruning curve measures neighbour retrieval beside its objective: an encoder's
    embedding drift (a sentence-embedding model's pooled output is what it is used for; a decoder's
    mean-pooled hidden states are no embedding it was trained to give)."""
    return objective.name == "embedding_drift" and not model.causal


@dataclass
class PruneResult:
    model: str
    objective: str
    unit: str
    selection_windows: int
    evaluation_windows: int
    groups: int
    scheme: str
    total_heads: int
    curves: list[Curve] = field(default_factory=list)
    area: tuple[float, float, float] | None = None  # noise − random: (value, lo, hi)
    # noise − the best trivial order (the one lowest against random): (order, value, lo, hi)
    trivial: tuple[str, float, float, float] | None = None
    rho: tuple[float, float, float] | None = None  # Spearman ρ(noise_share, effect_mean)
    rho_against: str = "mean-ablation effect"  # or "gradient importance" (a run storing only that)
    group_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))
    selection: str = ""  # where the effect and importance orders came from
    reference_windows: int = 0
    seed_areas: list[float] = field(default_factory=list)  # noise − each random seed, every window
    one_per_layer: tuple[list[Head], str] | None = None  # the head each layer keeps, and what chose it
    retrieval: Retrieval | None = None  # the downstream measure's task, where the objective has one

    def removed(self) -> list[str]:
        """Per row of ``rows()``: the heads removed at that step, ``layer.head`` space-separated."""
        out = []
        for curve in self.curves:
            previous = 0
            for n in curve.steps:
                out.append(" ".join(f"{layer}.{head}" for layer, head in curve.order_heads[previous:n]))
                previous = n
        return out

    def rows(self) -> tuple[list[str], list[tuple]]:
        """One row per order and step: the objective with its interval, its increase over the
        intact model (paired, window by window) with its interval, and neighbour retrieval's top-1
        and MRR with theirs (None where the objective has no downstream measure)."""
        columns = ["order", "step", "heads_removed", "fraction", "objective", "objective_lo", "objective_hi"]
        columns += ["increase", "increase_lo", "increase_hi", *RETRIEVAL_COLUMNS]
        rows = []
        for curve in self.curves:
            mean, lo, hi, _r = jackknife(curve.values.T, self.group_ids)
            up, up_lo, up_hi, _r = jackknife((curve.values - curve.values[0]).T, self.group_ids)
            for step, n in enumerate(curve.steps):
                cells = (mean[step], lo[step], hi[step], up[step], up_lo[step], up_hi[step])
                found: tuple = (None,) * len(RETRIEVAL_COLUMNS)
                if self.retrieval is not None and curve.hits is not None and curve.reciprocal is not None:
                    groups = self.retrieval.groups
                    found = (
                        *rt.with_interval(curve.hits[step], groups),
                        *rt.with_interval(curve.reciprocal[step], groups),
                    )
                rows.append((curve.order, step, n, n / self.total_heads, *(float(c) for c in cells), *found))
        return columns, rows

    def claim(self) -> str:
        """The seed's claim as SPEC §9 tests it, in words with the figures (an interval that the
        replicate groups cannot give is said so, never printed as NaN)."""
        parts = []
        if self.area is not None:
            value, lo, hi = self.area
            parts.append(
                f"area between the noise-ordered curve and random ones {value:+.4g} {self.unit}·fraction"
                f"{self._bounds(lo, hi, '.4g')} (negative: pruning by noise costs less): {self._verdict(lo, hi)}"
            )
        if self.trivial is not None:
            order, value, lo, hi = self.trivial
            parts.append(
                f"against the best trivial order ({order}) {value:+.4g} {self.unit}·fraction"
                f"{self._bounds(lo, hi, '.4g')}: {self._verdict(lo, hi)}"
            )
        curve = next((c for c in self.curves if c.order == michel.ONE_PER_LAYER), None)
        if curve is not None and self.one_per_layer is not None:
            up, up_lo, up_hi, _r = jackknife((curve.values - curve.values[0]).T, self.group_ids)
            rise = (float(up[-1]), float(up_lo[-1]), float(up_hi[-1]))
            parts.append(michel.one_per_layer_text(*self.one_per_layer, rise, self.unit))
        if self.rho is not None and math.isnan(self.rho[0]):
            parts.append(
                f"Spearman ρ(noise_share, {self.rho_against}) undefined: one of them does not vary across heads"
            )
        elif self.rho is not None:
            value, lo, hi = self.rho
            parts.append(
                f"Spearman ρ(noise_share, {self.rho_against}) = {value:+.3f}{self._bounds(lo, hi, '.3f', among=None)}"
            )
        return "; ".join(parts)

    def _bounds(self, lo: float, hi: float, spec: str, *, among: int | None = -1) -> str:
        """``[lo, hi]``, or why there is none: too few of the evaluation windows' groups (``among``
        -1), or of another set's (ρ's are the effects' groups: ``among`` None, not counted here)."""
        if math.isnan(lo) or math.isnan(hi):
            groups = self.groups if among == -1 else among
            held = "fewer than 2 replicate groups" if groups is None else counted(groups, "replicate group")
            return f" (no interval: {held}, it needs 2 or more)"
        return f" [{lo:+{spec}}, {hi:+{spec}}]"

    @staticmethod
    def _verdict(lo: float, hi: float) -> str:
        if math.isnan(lo) or math.isnan(hi):
            return "undecided (no interval)"
        return "supported" if hi < 0 else "contradicted" if lo > 0 else "undecided (the interval holds 0)"


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's ρ (average ranks for ties)."""

    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="mergesort")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v[~np.isnan(v)]):  # ties: their mean rank
            tied = v == value
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = math.sqrt((rx**2).sum() * (ry**2).sum())
    return float((rx * ry).sum() / denominator) if denominator else math.nan


def _interval(full: float, drops: list[float]) -> tuple[float, float, float]:
    half = jackknife_halfwidth(drops)
    if half is None:
        return full, math.nan, math.nan
    return full, full - half, full + half


def area_interval(full: float, drops: list[float], seed_areas: list[float]) -> tuple[float, float, float]:
    """The area's 95% interval from two sources of error: the evaluation windows (the jackknife
    over ``drops``, the area without each replicate group: standard error ``h / t_{R−1}``) and the
    random orders (``seed_areas``, the area against each seed alone: standard error ``s / √S``).
    The standard errors add in quadrature; the t quantile takes Welch–Satterthwaite's degrees of
    freedom. With one seed the seeds' spread is unknown and only the windows' error counts; with
    fewer than two groups the interval is NaN."""
    from headatlas.service.reports.intervals import t95, t_quantile

    half = jackknife_halfwidth(drops)
    if half is None:
        return full, math.nan, math.nan
    r = len(drops)
    se_windows = half / t95(r - 1)
    seeds = len(seed_areas)
    if seeds < 2:
        return full, full - half, full + half
    se_seeds = float(np.std(seed_areas, ddof=1)) / math.sqrt(seeds)
    se = math.sqrt(se_windows**2 + se_seeds**2)
    if se == 0:
        return full, full, full
    df = se**4 / (se_windows**4 / (r - 1) + se_seeds**4 / (seeds - 1))
    half = t_quantile(0.975, df) * se
    return full, full - half, full + half


def removal_counts(total: int, step: float) -> list[int]:
    """How many of ``total`` heads are removed at each evaluated step (0 first, ``total`` last)."""
    return sorted({0, *(min(total, math.ceil(k * step * total - 1e-9)) for k in range(1, math.ceil(1 / step) + 1))})


def prune_curves(
    corpus: str,
    model: LoadedModel,
    params: AnalysisParams,
    *,
    orders: Sequence[str] = ORDERS,
    noise_share: dict[Head, float] | None = None,
    step: float = 0.1,
    seeds: int = 3,
    windows: int = 16,
    reference: int = 64,
    batch_size: int = 4,
    text_field: str = "text",
    encoding: str = "utf-8",
    on_step: Callable[[str, int, int, float], None] | None = None,
    stored: StoredOrders | None = None,
    objective: Objective | None = None,
    sink_share: dict[Head, float] | None = None,
) -> PruneResult:
    """The pruning curves of ``orders`` and the test of the seed's claim (the module docstring);
    ``stored``: the run's stored effects, which set the effect and importance orders;
    ``objective``: what the curves measure (None: the one ``params`` names, else the model's own);
    ``sink_share``: each head's attention to the window's specials in a stored run (the ``sinks``
    order)."""
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.run_plan import first_windows

    for order in orders:
        if order not in ORDERS:
            raise ParameterError(Param("orders", order, quoted=True), f": use {', '.join(ORDERS)}")
    if "noise" in orders and not noise_share:
        raise ParameterError(
            Param("orders", "noise"), " needs a stored run's noise_share: pass the run (analysed with this model)"
        )
    if "sinks" in orders and not sink_share:
        raise ParameterError(
            Param("orders", "sinks"),
            " needs a stored run's attention to its specials: pass the run (analysed with this model)",
        )
    objective = objective or fx.objective_for(model, params.objective)
    if "importance" in orders and not objective.is_loss:
        raise ParameterError(
            Param("orders", "importance"),
            f": this model's objective is {objective.name}, not a loss; use effect, noise, random",
        )
    if not 0 < step <= 1:
        raise ParameterError(Param("step", step), ": a fraction of the heads in (0, 1], e.g. 10%")

    def docs():
        return iter_documents(corpus, text_field=text_field, encoding=encoding)

    use_stored = stored is not None and (
        stored.effect is not None or ("effect" not in orders and stored.importance is not None)
    )
    if use_stored and "importance" in orders and stored is not None and stored.importance is None:
        use_stored = False  # importance not stored: both orders measured here, on the same windows
    if use_stored and stored is not None:
        candidates = spread_windows(docs(), model, params, windows + len(stored.windows))
        spread = [w for w in candidates if w.window_id not in stored.windows]
        selection, evaluation = [], spread[:windows]
    else:
        spread = spread_windows(docs(), model, params, 2 * windows)
        selection, evaluation = spread[0::2], spread[1::2]
    if not evaluation:
        raise ParameterError(f"{corpus}: too few windows for a pruning curve (it needs at least 2)")
    tokens = TokenClasses.for_model(model)  # the run's window layout ([BOS] first for a decoder)
    pad = tokens.pad_id
    ref = first_windows(
        corpus,
        model,
        params,
        tokens,
        reference,
        text_field=text_field,
        encoding=encoding,
    )
    from headatlas.service.measures.effect_batch import reference_means

    # computed as an analysis computes them: the means of a run's stored effects, on the same windows
    means = reference_means(model, ref, pad).tensor()
    total = model.n_layers * model.n_heads
    every = [(layer, head) for layer in range(model.n_layers) for head in range(model.n_heads)]
    counts = removal_counts(total, step)

    # the selection windows' effects (for the effect order and ρ) and importances, or the stored ones
    ranked: dict[str, list[Head]] = {}
    effect_drops: list[np.ndarray] = []
    mean_effect: np.ndarray | None
    rho_against = "mean-ablation effect"
    if use_stored and stored is not None:
        mean_effect, importance = stored.effect, stored.importance
        effect_drops = stored.effect_drops
        selection_text = stored.source
        if mean_effect is None:  # importance alone: ρ against it
            mean_effect, effect_drops, rho_against = None, stored.importance_drops, "gradient importance"
    elif not noise_share and not {"effect", "importance", michel.ONE_PER_LAYER} & set(orders):
        # nothing reads them (no order of them, no ρ without noise_share): the selection windows
        # are left unmeasured, about half of layers × heads passes each
        mean_effect, importance = None, None
        selection_text = "no effects: no order asked needs them"
    else:
        want = ("mean", "gradient") if "importance" in orders else ("mean",)
        per_window: dict[str, list[torch.Tensor]] = {k: [] for k in want}
        for batch in _batches(selection, pad, batch_size):
            got = fx.head_effects(
                model,
                batch.input_ids,
                batch.attention_mask,
                kinds=want,
                means=means,
                window_ids=batch.window_ids,
                objective=objective,
            )
            for kind in want:
                per_window[kind].append(got.effect[kind])
        effect = torch.cat(per_window["mean"]).numpy()  # [window, layer, head]
        mean_effect = effect.mean(axis=0)
        importance = torch.cat(per_window["gradient"]).numpy().mean(axis=0) if "gradient" in per_window else None
        sel_scheme = params.resolved(len({w.doc_id for w in selection})).replicates
        sel_groups = np.array(
            [window_group(sel_scheme, window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in selection]
        )
        present = np.unique(sel_groups)
        effect_drops = [effect[sel_groups != g].mean(axis=0) for g in present] if len(present) > 1 else []
        selection_text = f"measured on {len(selection)} other windows"
    if mean_effect is not None:
        effect_of = mean_effect
        ranked["effect"] = sorted(every, key=lambda lh: (effect_of[lh], lh))
    if importance is not None:
        ranked["importance"] = sorted(every, key=lambda lh: (importance[lh], lh))
    if noise_share:
        ranked["noise"] = sorted(every, key=lambda lh: (-noise_share.get(lh, -math.inf), lh))
    ranked["layer"] = sorted(every)
    if sink_share:
        ranked["sinks"] = sorted(every, key=lambda lh: (-sink_share.get(lh, -math.inf), lh))
    if "output_norm" in orders or "output_variance" in orders:
        norm, variance = output_statistics(model, _batches(ref, pad, batch_size))
        ranked["output_norm"] = sorted(every, key=lambda lh: (norm[lh], lh))
        ranked["output_variance"] = sorted(every, key=lambda lh: (variance[lh], lh))
    kept = michel.one_per_layer(mean_effect, importance) if michel.ONE_PER_LAYER in orders else None
    if kept is not None:  # the heads each layer does not keep, removed at once; those it keeps after
        ranked[michel.ONE_PER_LAYER] = [lh for lh in every if lh not in kept[0]] + kept[0]
    for seed in range(seeds):
        shuffled = list(every)
        random.Random(seed).shuffle(shuffled)
        ranked[f"random:{seed}"] = shuffled

    batches = prepared(model, _batches(evaluation, pad, batch_size), objective)
    with torch.no_grad():
        intact = [wide(fx._run_model(model, ids, mask)) for ids, _targets, mask in batches]
    scheme = params.resolved(len({w.doc_id for w in evaluation})).replicates
    groups = np.array([window_group(scheme, window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in evaluation])
    result = PruneResult(
        model=model.name,
        objective=objective.name,
        unit=objective.unit,
        selection_windows=len(selection),
        evaluation_windows=len(evaluation),
        groups=len(np.unique(groups)),
        scheme=scheme,
        total_heads=total,
        group_ids=groups,
        selection=selection_text,
        reference_windows=len(ref),
        rho_against=rho_against,
        one_per_layer=kept,
    )
    task = rt.neighbour_task(evaluation, tokens) if retrieval_applies(objective, model) else None
    if task is not None and len(task.query):
        result.retrieval = Retrieval(len(task.query), len(task.candidates), *task.chance(), groups[task.query_windows])
    else:
        task = None  # no window of two sentences: nothing to retrieve
    names = [o for o in orders if o != "random"] + ([f"random:{s}" for s in range(seeds)] if "random" in orders else [])
    plans = {name: [0, total - model.n_layers] if name == michel.ONE_PER_LAYER else counts for name in names}
    evaluations, evaluated, began = sum(len(steps) for steps in plans.values()), 0, time.perf_counter()
    for name in names:
        heads_in_order = ranked[name]
        steps = plans[name]
        values, hits, reciprocal = [], [], []
        for index, n in enumerate(steps):
            values.append(objective_with(model, batches, heads_in_order[:n], means, intact, objective))
            if task is not None:  # the same heads removed, the evaluation windows' sentences each alone
                with removed(model, heads_in_order[:n], means):
                    found = rt.ranks(rt.embed(model, task, pad), task)
                hits.append(found[0])
                reciprocal.append(found[1])
            evaluated += 1
            if on_step is not None:  # with the seconds left at the pace so far (every evaluation one pass)
                left = (time.perf_counter() - began) / evaluated * (evaluations - evaluated)
                on_step(name, index + 1, len(steps), left)
        curve = Curve(order=name, steps=steps, values=np.stack(values), order_heads=heads_in_order)
        if task is not None:
            curve.hits, curve.reciprocal = np.stack(hits), np.stack(reciprocal)
        result.curves.append(curve)

    curves = {c.order: c for c in result.curves}
    randoms = [c.values for name, c in curves.items() if name.startswith("random:")]
    if "noise" in curves and randoms:
        fractions = np.array(counts) / total
        gap = curves["noise"].values - np.mean(randoms, axis=0)  # [step, window]

        def area(columns: np.ndarray, against: np.ndarray = gap) -> float:
            return float(np.trapezoid(against[:, columns].mean(axis=1), fractions))

        all_columns = np.ones(len(groups), dtype=bool)
        present = np.unique(groups)
        result.seed_areas = [area(all_columns, curves["noise"].values - r) for r in randoms]
        result.area = area_interval(
            area(all_columns), [area(groups != g) for g in present] if len(present) > 1 else [], result.seed_areas
        )
        trivial = [o for o in TRIVIAL_ORDERS if o in curves]
        if trivial:
            mean_random = np.mean(randoms, axis=0)
            best = min(trivial, key=lambda o: area(all_columns, curves[o].values - mean_random))
            against_best = curves["noise"].values - curves[best].values
            drops = [area(groups != g, against_best) for g in present] if len(present) > 1 else []
            result.trivial = (best, *_interval(area(all_columns, against_best), drops))
    if noise_share:
        noise = np.array([noise_share.get(lh, math.nan) for lh in every])
        keep = ~np.isnan(noise)

        def rho(effect_of_heads: np.ndarray) -> float:
            return spearman(noise[keep], effect_of_heads.reshape(-1)[keep])

        against = mean_effect if mean_effect is not None else importance
        if against is not None:
            result.rho = _interval(rho(against), [rho(d) for d in effect_drops])
    return result


def output_statistics(model: LoadedModel, batches: list) -> tuple[np.ndarray, np.ndarray]:
    """Each head's output ``o = z W_O^h`` (no bias) over the valid positions of ``batches``: its
    mean norm and its variance (the mean squared distance of ``o`` from its mean), ``[layer, head]``
    each, from one forward pass per batch (the ``blocks.L.attn.z`` hook points)."""
    from headatlas.service.engine.pair_selection import head_vectors

    layers, heads = model.n_layers, model.n_heads
    blocks = model.blocks
    norm = torch.zeros(layers, heads, dtype=torch.float64)
    square = torch.zeros(layers, heads, dtype=torch.float64)
    total: dict[int, torch.Tensor] = {}  # layer -> [head, d_model]: the sum of o
    count = 0
    mask: torch.Tensor | None = None

    def take(layer: int):
        def fn(z: torch.Tensor) -> None:
            assert mask is not None
            w_o = model.adapter.output_weight(blocks[layer])
            o = head_vectors(z.float(), heads, w_o.float())  # [batch, head, pos, d_model]
            valid = mask[:, None, :, None].to(o.dtype)
            o = (o * valid).double()
            norm[layer] += o.norm(dim=-1).sum(dim=(0, 2)).cpu()
            square[layer] += (o**2).sum(dim=(0, 2, 3)).cpu()
            total[layer] = total.get(layer, 0) + o.sum(dim=(0, 2)).cpu()

        return fn

    points = {f"blocks.{layer}.attn.z": take(layer) for layer in range(layers)}
    with torch.no_grad(), hooks(model.model, points, model.adapter):
        for batch in batches:
            mask = batch.attention_mask.to(model.device) > 0
            count += int(mask.sum())
            fx._run_model(model, batch.input_ids.to(model.device), batch.attention_mask.to(model.device))
    n = max(count, 1)
    mean_sq_of_mean = torch.stack([(total[layer] / n).pow(2).sum(dim=-1) for layer in range(layers)])
    return (norm / n).numpy(), (square / n - mean_sq_of_mean).numpy()


def _batches(windows: list[Window], pad: int, size: int) -> list:
    return [collate(windows[i : i + size], pad) for i in range(0, len(windows), size)]
