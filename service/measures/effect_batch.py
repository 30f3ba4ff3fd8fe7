"""The causal effects of one analysed batch (SPEC §9), as additive sums, and the reference means
of mean ablation and attribution patching.

An analysis with ``--effects`` measures every head's effect on ``effect_windows`` windows of the
run, spread over its replicate groups (``engine/effect_spread.py``; runs stored before: its
first), with ``service.measures.effects.head_effects``, and sums them per replicate
group (SPEC §5d), beside the batch's other statistics: the per-head sums of ``EFFECT_SUMS`` and the
per-run ``effect_windows`` (windows measured) and ``objective`` (the intact model's objective
summed), so that every effect's mean has its jackknife interval like any other metric. A batch of
an effect run without effect windows carries zeros (its run's sums stay whole); a window whose
objective is undefined (a decoder window of one token, a masked-LM window with nothing to mask)
is left out of every effect sum and of the count.

The reference means are each head's z averaged over the valid positions of the run's first
``effect_reference`` windows, in batches of ``REFERENCE_BATCH`` windows in order, accumulated in
float64 — the same computation wherever it runs. They are identified by the fingerprint of their
bytes and recorded with the run (``run_effects``), with the fingerprint of the reference windows'
ids. Queued workers share one copy (``workers.tasks``: the first worker to need them publishes
them in the broker, every worker uses the published bytes).

Pure computation: imports neither Celery, Typer nor SQLAlchemy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from headatlas.service.engine.model import LoadedModel
from headatlas.service.engine.reference_means import ReferenceMeans, windows_fingerprint
from headatlas.service.engine.windows import Batch, Window, collate
from headatlas.service.errors import Param, ParameterError
from headatlas.service.metrics import EFFECT_SUMS
from headatlas.service.params import AnalysisParams
from headatlas.service.wording import counted

if TYPE_CHECKING:
    from headatlas.service.engine.results import BatchResult

REFERENCE_BATCH = 8  # windows per forward pass of the reference means (fixed: the same sums everywhere)
EFFECT_CHUNK = 8  # effect windows ablated together: the stacked pass holds heads × windows copies


def reference_means(model: LoadedModel, windows: list[Window], pad_id: int) -> ReferenceMeans:
    """Every head's mean z over ``windows`` (the run's first ``effect_reference`` windows)."""
    from headatlas.service.measures.effects import reference_means as mean_z

    if not windows:
        raise ParameterError(Param("effects", "mean"), ": the corpus gives no reference window")
    batches = (collate(windows[i : i + REFERENCE_BATCH], pad_id) for i in range(0, len(windows), REFERENCE_BATCH))
    means, positions = mean_z(model, ((b.input_ids, b.attention_mask) for b in batches))
    return ReferenceMeans(means.numpy(), len(windows), positions, windows_fingerprint([w.window_id for w in windows]))


def _refuse_gradient(params: AnalysisParams, model: str | Param, name: str, is_loss: bool) -> None:
    from headatlas.service.measures.effects import loss_only

    refused = loss_only(params.effects)
    if refused and not is_loss:
        raise ParameterError(
            Param("effects", ",".join(refused)),
            ": ",
            model,
            f"'s objective is {name}, not a loss (its gradient is 0 at the intact model)",
            hint=("use ", Param("effects", "zero,mean")),
        )


def check_effects(model: LoadedModel, params: AnalysisParams) -> None:
    """Refuse, before anything runs, effects this model cannot give: an objective that is not
    registered or does not apply to it (``params.objective``), gradient importance or attribution
    patching of one that is not a loss."""
    from headatlas.service.measures.objectives import definition_for

    chosen = definition_for(model, params.objective)
    _refuse_gradient(params, model.name, chosen.name, chosen.is_loss)


def check_effects_spec(spec: str, params: AnalysisParams) -> None:
    """``check_effects`` from the model's config alone (``submit``, ``schedule add``): the same
    choice (``objectives.choose``) the workers make from the loaded model's config."""
    from headatlas.service.measures.objectives import definition_for_spec

    chosen = definition_for_spec(spec, params.objective)
    _refuse_gradient(params, Param("model", spec), chosen.name, chosen.is_loss)


def effect_sums(
    model: LoadedModel,
    batch: Batch,
    params: AnalysisParams,
    *,
    count: int,
    group: np.ndarray,
    n_groups: int,
    means: ReferenceMeans | None,
    pad_id: int,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """The effect sums of the batch's first ``count`` windows per replicate group (``group``:
    each window's index among the batch's ``n_groups`` groups): ``(head sums [group, layer,
    head], run sums [group], what they are measured against)``."""
    from headatlas.service.measures import effects as fx

    kinds = params.effects
    if fx.needs_means(kinds) and count and means is None:
        raise ParameterError(Param("effects", ",".join(kinds)), ": the batch was given no reference means")
    objective = fx.objective_for(model, params.objective)
    shape = (n_groups, model.n_layers, model.n_heads)
    heads = {s: np.zeros(shape) for kind in kinds for s in EFFECT_SUMS[kind]}
    measured = np.zeros(n_groups, dtype=np.int64)
    intact = np.zeros(n_groups)
    windows = batch.windows[:count]
    for start in range(0, len(windows), EFFECT_CHUNK):
        part = collate(windows[start : start + EFFECT_CHUNK], pad_id)
        got = fx.head_effects(
            model,
            part.input_ids,
            part.attention_mask,
            kinds=kinds,
            means=means.tensor() if means is not None and fx.needs_means(kinds) else None,
            window_ids=part.window_ids,
            objective=objective,
        )
        rows = group[start : start + len(part.windows)]
        values = {kind: got.effect[kind].numpy() for kind in kinds}
        drifts = {kind: got.drift[kind].numpy() for kind in got.drift}
        ok = np.isfinite(got.intact.numpy())
        for v in (*values.values(), *drifts.values()):
            ok &= np.isfinite(v).all(axis=(1, 2))
        for kind in kinds:
            names = EFFECT_SUMS[kind]
            np.add.at(heads[names[0]], rows[ok], values[kind][ok])
            if len(names) > 1:
                np.add.at(heads[names[1]], rows[ok], drifts[kind][ok])
        np.add.at(measured, rows[ok], 1)
        np.add.at(intact, rows[ok], got.intact.numpy()[ok])
    meta = {
        "objective": objective.name,
        "unit": objective.unit,
        "kinds": list(kinds),
        "windows": int(measured.sum()),
        "reference_windows": means.windows if means is not None else 0,
        "reference_positions": means.positions if means is not None else 0,
        "reference_fingerprint": means.windows_fingerprint if means is not None else "",
        "means_fingerprint": means.fingerprint if means is not None else "",
    }
    return heads, {"effect_windows": measured, "objective": intact}, meta


def window_effects(
    model: LoadedModel,
    window: Window,
    params: AnalysisParams,
    *,
    means: ReferenceMeans | None,
    present: tuple[list[str], list[str]],
    pad_id: int,
) -> BatchResult:
    """One window's effects added to a finished run (``headatlas effects RUN``, in this process or
    through the queue: both call this), as a batch result of no window of its own: the window's
    effect sums under its replicate group, and zero for every other sum the run holds
    (``present``: the per-head and per-run sums its rows hold), so that no other statistic of the
    run changes. The sums the run's rows lack stay absent (NULL where they are stored)."""
    import time

    from headatlas.service.engine.results import PAIR_HISTS, BatchResult, sum_dtype, window_group

    started = time.perf_counter()
    group = window_group(params.replicates, window_id=window.window_id, doc_id=window.doc_id, index=window.index)
    heads, run_sums, meta = effect_sums(
        model,
        collate([window], pad_id),
        params,
        count=1,
        group=np.zeros(1, dtype=np.int64),
        n_groups=1,
        means=means,
        pad_id=pad_id,
    )
    shape = (1, model.n_layers, model.n_heads)
    empty = np.zeros((0, model.n_layers, model.n_heads), dtype=np.int64)
    head_sums, chance_sums = present
    zeros = {k: np.zeros(shape, dtype=sum_dtype(k)) for k in head_sums}
    run_zeros = {k: np.zeros(1, dtype=sum_dtype(k)) for k in chance_sums}
    return BatchResult(
        window_ids=[],
        reps=np.array([group], dtype=np.int64),
        rep_heads={**zeros, **{k: np.asarray(v, dtype=np.float64).reshape(shape) for k, v in heads.items()}},
        rep_dist_hist=np.zeros((*shape, 1), dtype=np.int64),
        rep_attended_hist=np.zeros((*shape, 1), dtype=np.float64),
        rep_chance={**run_zeros, **{k: np.asarray(v).reshape(1) for k, v in run_sums.items()}},
        rep_pair_hist={k: np.zeros((1, 1)) for k in PAIR_HISTS},
        anchor_token=empty - 1,
        anchor_count=empty,
        high_count=empty,
        anchor_frequent=empty.astype(bool),
        compute_s=time.perf_counter() - started,
        effects=meta,
    )


@dataclass(frozen=True)
class EffectCost:
    """What ``--effects`` will cost: ``seconds`` for ``windows`` windows (``per_window`` each),
    the reference means' share of it, and ``memory_bytes`` above the loaded model at the peak."""

    windows: int
    longest: int
    kinds: tuple[str, ...]
    per_window: float
    reference_s: float
    memory_bytes: int
    reference_windows: int
    timing_s: float

    @property
    def seconds(self) -> float:
        return self.per_window * self.windows + self.reference_s

    def describe(self) -> str:
        from headatlas.service.measures.attribution import about, duration, size

        reference = (
            f", the reference means ({counted(self.reference_windows, 'window')}) {duration(self.reference_s)} of it"
            if self.reference_windows
            else ""
        )
        return (
            f"effects ({', '.join(self.kinds)}): {counted(self.windows, 'window')} of up to {self.longest} tokens: "
            f"{about(self.seconds)}{reference}, and {size(self.memory_bytes)} above the model (timed on one "
            f"window in {self.timing_s:.1f} s; memory from the model's shape)"
        )


def estimate(
    model: LoadedModel,
    params: AnalysisParams,
    windows: list[Window],
    count: int,
    pad_id: int,
    *,
    reference: int | None = None,
) -> EffectCost:
    """Time the effects of the longest of ``windows`` and scale to ``count`` windows.

    An ablation of a head of layer l replays layers l … L−1 and the objective, so a layer's stacked
    pass costs ``a + b·(L − l)``: timed at the first and the last layer (one window, zero
    ablation), the L layers sum to ``L·a + b·L(L+1)/2`` per ablation kind; gradient importance is
    timed as it is (one forward and one backward pass). The reference means cost ``reference``
    windows (the corpus's first ``effect_reference``, fewer where it has fewer) of the pass that
    computes them, timed on a batch of the longest window as they are computed (``REFERENCE_BATCH``
    windows a pass). Attribution patching is timed as it is, as gradient importance (one forward
    and one backward pass; with gradient importance, their shared pass once). The model runs once
    before anything is timed: a model's first pass in a
    process pays for allocations the later ones reuse, and was timed as if every pass did."""
    import time

    from headatlas.service.measures import effects as fx

    began = time.perf_counter()
    longest = max(windows, key=lambda w: len(w.input_ids))
    one = collate([longest], pad_id)
    n_layers = model.n_layers

    objective = fx.objective_for(model, params.objective)
    with torch.no_grad():  # the warm-up, untimed
        fx._run_model(model, one.input_ids.to(model.device), one.attention_mask.to(model.device))

    def timed(**kwargs) -> float:
        start = time.perf_counter()
        fx.head_effects(
            model, one.input_ids, one.attention_mask, window_ids=one.window_ids, objective=objective, **kwargs
        )
        return time.perf_counter() - start

    ablations = [k for k in params.effects if k in fx.ABLATIONS]
    per_window = 0.0
    if ablations:
        first = timed(kinds=("zero",), layers=[0])
        last = timed(kinds=("zero",), layers=[n_layers - 1]) if n_layers > 1 else first
        b = max(0.0, (first - last) / max(1, n_layers - 1))
        a = max(0.0, last - b)
        per_window += len(ablations) * (n_layers * a + b * n_layers * (n_layers + 1) / 2)
    gradients = fx.loss_only(params.effects)
    if gradients:  # one backward pass for both; the means' values do not change its cost
        zeros = torch.zeros(n_layers, model.n_heads, model.d_head, dtype=torch.float64)
        per_window += timed(kinds=gradients, means=zeros)
    reference_s = 0.0
    references = params.effect_reference if reference is None else min(reference, params.effect_reference)
    if fx.needs_means(params.effects) and references:
        k = min(REFERENCE_BATCH, references)
        batch = collate([longest] * k, pad_id)
        start = time.perf_counter()
        fx.reference_means(model, [(batch.input_ids, batch.attention_mask)])
        reference_s = (time.perf_counter() - start) * references / k
    n_pos = len(longest.input_ids)
    chunk = min(EFFECT_CHUNK, count)
    floats = model.n_heads * chunk * n_pos * model.d_model * 16  # the stacked copies' activations
    floats += n_layers * chunk * n_pos * model.d_model  # every block's recorded input
    floats += 3 * (1 << 25)  # a chunk of logits, its softmax and its gradient
    return EffectCost(
        windows=count,
        longest=n_pos,
        kinds=params.effects,
        per_window=per_window,
        reference_s=reference_s,
        memory_bytes=4 * floats,
        reference_windows=references if fx.needs_means(params.effects) else 0,
        timing_s=time.perf_counter() - began,
    )
