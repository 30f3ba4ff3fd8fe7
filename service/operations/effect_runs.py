"""Every head's causal effect on a corpus, measured in this process (SPEC §9): the windows, the
reference means, the per-window effects and their §5d intervals, as one table.

The windows are spread over the corpus's documents (the first window of each document, then the
second of each, …) so that the replicate groups (by document; by block of 8 windows below 10
documents) hold different text; the reference set for mean ablation (and attribution patching) is
the corpus's first ``reference`` windows, recorded with the result. ``check_top`` K checks
attribution patching against exact mean ablation on the same windows
(``service.measures.atp_check``: Spearman's ρ over the heads, the top-K recall, and the exact
effects of the K heads AtP names), mean ablation measured for it where it was not asked. Intervals are the delete-one-group jackknife of
``service/reports/intervals.py``, the same as every other statistic's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from headatlas.service.engine.model import LoadedModel
from headatlas.service.engine.results import REPLICATES, window_group
from headatlas.service.engine.windows import TokenClasses, Window, collate, iter_document_windows
from headatlas.service.errors import Param, ParameterError
from headatlas.service.measures import effects as fx
from headatlas.service.measures.atp_check import AtpCheck, compare
from headatlas.service.params import AnalysisParams
from headatlas.service.reports.intervals import MIN_GROUPS
from headatlas.service.wording import counted

DEFAULT_WINDOWS = 16
DEFAULT_REFERENCE = 256


@dataclass
class EffectTable:
    """Per-head effects with intervals. ``columns``/``rows``: one row per (layer, head);
    the rest says what each effect is measured against."""

    model: str
    objective: str
    unit: str
    kinds: tuple[str, ...]
    windows: int
    documents: int
    scheme: str
    groups: int
    reference_windows: int
    reference_positions: int
    intact_mean: float
    seconds: float
    columns: list[str] = field(default_factory=list)
    rows: list[tuple] = field(default_factory=list)
    check: AtpCheck | None = None  # AtP against exact mean ablation (``check_top``)

    def note(self) -> str:
        against = {
            "zero": "the head's output set to 0",
            "mean": f"the head's output set to its mean over {self.reference_windows} reference windows",
            "gradient": "|∂O/∂gate| at the intact model (Michel et al. 2019)",
            "atp": "attribution patching, effect_mean's first-order estimate Σ (m − z)·∂O/∂z (Kramár et al. 2024)",
        }
        kinds = "; ".join(f"{k}: {against[k]}" for k in self.kinds)
        return (
            f"effect = O(ablated) − O(intact), O = {self.objective} ({self.unit}; intact mean "
            f"{self.intact_mean:.4g}), over {counted(self.windows, 'window')} of {counted(self.documents, 'document')}; {kinds}; "
            f"95% intervals: jackknife over {self.groups} replicate groups ({self.scheme})"
            + (f", fewer than {MIN_GROUPS}: their widths are rough" if self.groups < MIN_GROUPS else "")
        )


def spread_windows(docs: Iterator, model: LoadedModel, params: AnalysisParams, count: int) -> list[Window]:
    """``count`` windows, round-robin over the documents (each document's first window, then its
    second, …), reading no more documents than ``count``."""
    tokens = TokenClasses.for_model(model)
    per_doc: list[list[Window]] = []
    for doc in docs:
        per_doc.append(list(iter_document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, params)))
        if len(per_doc) >= count:
            break
    out: list[Window] = []
    depth = 0
    while len(out) < count and any(len(w) > depth for w in per_doc):
        out += [w[depth] for w in per_doc if len(w) > depth][: count - len(out)]
        depth += 1
    return out


def jackknife(values: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Mean of ``values`` ``[window, ...]`` and its §5d interval over the windows' ``groups``:
    ``(mean, lo, hi, groups holding windows)``; NaN bounds with fewer than two groups."""
    from headatlas.service.reports.intervals import t95

    mean = values.mean(axis=0)
    present = np.unique(groups)
    r = len(present)
    if r < 2:
        nan = np.full_like(mean, math.nan)
        return mean, nan, nan, r
    total, n = values.sum(axis=0), len(values)
    drops = np.stack([(total - values[groups == g].sum(axis=0)) / (n - (groups == g).sum()) for g in present])
    half = t95(r - 1) * np.sqrt((r - 1) / r * ((drops - drops.mean(axis=0)) ** 2).sum(axis=0))
    return mean, mean - half, mean + half, r


def measure_effects(
    corpus: str,
    model: LoadedModel,
    params: AnalysisParams,
    *,
    kinds: tuple[str, ...] = ("zero", "mean"),
    windows: int = DEFAULT_WINDOWS,
    reference: int = DEFAULT_REFERENCE,
    batch_size: int = 4,
    text_field: str = "text",
    encoding: str = "utf-8",
    on_batch: Callable[[int, int], None] | None = None,
    check_top: int = 0,
) -> EffectTable:
    """Every head's effects on ``windows`` windows of ``corpus`` (the module docstring)."""
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.run_plan import first_windows

    if windows < 1:
        raise ParameterError(Param("windows", windows), ": must be at least 1")
    if reference < 1:
        raise ParameterError(Param("reference", reference), ": must be at least 1 window")
    objective = fx.objective_for(model, params.objective)
    refused = fx.loss_only(kinds)
    if refused and not objective.is_loss:
        raise ParameterError(
            Param("kinds", ",".join(refused)),
            f": this model's objective is {objective.name}, not a loss (its gradient is 0 at the intact model)",
            hint=("use ", Param("kinds", "zero,mean")),
        )
    if check_top and "atp" not in kinds:
        raise ParameterError(
            Param("check_top", check_top), ": checks attribution patching: add atp to ", Param("kinds", ",".join(kinds))
        )
    if check_top < 0 or check_top > model.n_layers * model.n_heads:
        raise ParameterError(
            Param("check_top", check_top), f": name 0 to {model.n_layers * model.n_heads} heads (the model's)"
        )
    if check_top and "mean" not in kinds:  # the check's exact effects: measured, shown beside AtP
        kinds = fx.parse_kinds(",".join((*kinds, "mean")))
    began = time.perf_counter()

    def docs():
        return iter_documents(corpus, text_field=text_field, encoding=encoding)

    chosen = spread_windows(docs(), model, params, windows)
    if not chosen:
        raise ParameterError(f"{corpus}: no windows to measure (is the corpus empty?)")
    documents = len({w.doc_id for w in chosen})
    scheme = params.resolved(documents).replicates
    pad = TokenClasses.for_model(model).pad_id
    means, positions, ref_windows = None, 0, 0
    if fx.needs_means(kinds):
        ref = first_windows(
            corpus,
            model,
            params,
            TokenClasses.for_model(model),
            reference,
            text_field=text_field,
            encoding=encoding,
        )
        ref_windows = len(ref)
        batches = (collate(ref[i : i + batch_size], pad) for i in range(0, len(ref), batch_size))
        means, positions = fx.reference_means(model, ((b.input_ids, b.attention_mask) for b in batches))

    per_kind: dict[str, list[torch.Tensor]] = {k: [] for k in kinds}
    drifts: dict[str, list[torch.Tensor]] = {k: [] for k in kinds if k in fx.ABLATIONS}
    intact: list[torch.Tensor] = []
    for start in range(0, len(chosen), batch_size):
        batch = collate(chosen[start : start + batch_size], pad)
        got = fx.head_effects(
            model,
            batch.input_ids,
            batch.attention_mask,
            kinds=kinds,
            means=means,
            window_ids=batch.window_ids,
            objective=objective,
        )
        intact.append(got.intact)
        for kind in kinds:
            per_kind[kind].append(got.effect[kind])
        for kind in drifts:
            drifts[kind].append(got.drift[kind])
        if on_batch is not None:
            on_batch(min(start + batch_size, len(chosen)), len(chosen))
    groups = np.array([window_group(scheme, window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in chosen])
    columns = ["layer", "head"]
    cells: list[np.ndarray] = []
    n_groups = 0
    for kind in kinds:
        name = "importance" if kind == "gradient" else f"effect_{kind}"
        mean, lo, hi, n_groups = jackknife(torch.cat(per_kind[kind]).numpy(), groups)
        columns += [name, f"{name}_lo", f"{name}_hi"]
        cells += [mean, lo, hi]
    check = None
    if check_top:
        ok = np.isfinite(torch.cat(intact).numpy())  # a window whose objective is undefined checks nothing
        atp, exact = (torch.cat(per_kind[k]).numpy()[ok].mean(axis=0) for k in ("atp", "mean"))
        check = compare(atp, exact, check_top)
    for kind in drifts:
        columns.append(f"drift_{kind}")
        cells.append(torch.cat(drifts[kind]).numpy().mean(axis=0))
    rows = [
        (layer, head, *(float(c[layer, head]) for c in cells))
        for layer in range(model.n_layers)
        for head in range(model.n_heads)
    ]
    return EffectTable(
        model=model.name,
        objective=objective.name,
        unit=objective.unit,
        kinds=kinds,
        windows=len(chosen),
        documents=documents,
        scheme=scheme,
        groups=min(n_groups, REPLICATES),
        reference_windows=ref_windows,
        reference_positions=positions,
        intact_mean=float(torch.cat(intact).mean()),
        seconds=time.perf_counter() - began,
        columns=columns,
        rows=rows,
        check=check,
    )
