"""``headatlas prune RUN`` and ``run.prune(...)``: a stored run's pruning curves, measured in this
process and stored with the run (SPEC §9; tables ``prunes`` and ``prune_curves``).

The run gives the model, the corpus, its parameters and its heads' ``noise_share``; where it
stores causal effects (``analyze --effects mean``), they set the effect order (and ``importance``
the importance order), measured on the run's effect windows, and the evaluation windows are
others. Mean ablation takes the run's own reference set when it has one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import Param, ParameterError
from headatlas.service.operations.prune_curves import (
    ORDERS,
    PruneResult,
    StoredOrders,
    prune_curves,
    removal_counts,
    retrieval_applies,
)
from headatlas.service.operations.prune_michel import ONE_PER_LAYER
from headatlas.service.params import AnalysisParams
from headatlas.service.statuses import RunStatus
from headatlas.service.storage.effect_rows import (
    CURVE_COLUMNS,
    StoredPrune,
    effect_windows,
    load_prune,
    run_effects,
    store_prune,
)
from headatlas.service.storage.store import Run, Store

# each random order is a curve of its own: a thousand of them is far past what the area's interval
# needs (the seeds' spread enters it as s²/S), and a typo of 100000000 would never end
MAX_SEEDS = 1000


def check_request(run: Run, *, orders: Sequence[str] | None, seeds: int) -> None:
    """Refuse, before a model loads, a prune that would store nothing or never end: no order
    named, seeds out of range, or a run not finished (its heads' noise_share and effects are
    still being stored)."""
    if orders is not None and not orders:
        raise ParameterError(Param("orders", ""), f": name at least one of {', '.join(ORDERS)}")
    if not 1 <= seeds <= MAX_SEEDS:
        raise ParameterError(Param("seeds", seeds), f": use 1 to {MAX_SEEDS} random orders (one curve each)")
    if run.status == RunStatus.RUNNING:
        raise ParameterError(f"run {run.run_id} ({run.name}) is still running: prune it once it is done")
    if run.status == RunStatus.CREATED:
        raise ParameterError(f"run {run.run_id} ({run.name}) is not analysed yet: prune it once it is done")


def plan(orders: Sequence[str], *, seeds: int, steps: int, windows: int, retrieval: bool = False) -> str:
    """What a prune will measure, said before it starts: curves × steps, each step one evaluation
    (``retrieval``: and the windows' sentences each alone, about as dear again)."""
    named = [o for o in orders if o not in ("random", ONE_PER_LAYER)]
    curves = len(named) + (seeds if "random" in orders else 0)
    which = [*named, *([f"{seeds} random seed{'s' if seeds != 1 else ''}"] if "random" in orders else [])]
    # one_per_layer: the intact model and every layer reduced to one head, two evaluations
    michel = ONE_PER_LAYER in orders
    return (
        f"measuring {curves} curve{'s' if curves != 1 else ''} ({', '.join(which)}) × {steps} steps"
        + (" and one_per_layer (2 evaluations)" if michel else "")
        + f": {curves * steps + 2 * michel:,} evaluations of up to {windows:,} windows"
        + (" and their sentences each alone (neighbour retrieval)" if retrieval else "")
    )


def noise_shares(conn: Connection, run_id: int) -> dict[tuple[int, int], float]:
    return {
        (int(r[0]), int(r[1])): float(r[2])
        for r in conn.execute(
            text("SELECT layer, head, noise_share FROM head_metrics WHERE run_id = :r AND noise_share IS NOT NULL"),
            {"r": run_id},
        )
    }


def sink_shares(conn: Connection, run_id: int, *, causal: bool) -> dict[tuple[int, int], float]:
    """Each head's share of attention to the window's specials in the run ([CLS] and [SEP] for an
    encoder, the first token for a decoder): the ``sinks`` order."""
    column = "attn_to_first" if causal else "coalesce(attn_to_cls, 0) + coalesce(attn_to_sep, 0)"
    return {
        (int(r[0]), int(r[1])): float(r[2])
        for r in conn.execute(
            text(f"SELECT layer, head, {column} FROM head_metrics WHERE run_id = :r AND {column} IS NOT NULL"),
            {"r": run_id},
        )
    }


def stored_effects(
    conn: Connection, run_id: int
) -> tuple[np.ndarray | None, np.ndarray | None, list[np.ndarray], list[np.ndarray]]:
    """The run's stored mean-ablation effect and importance ``[layer, head]`` (None where not
    stored), and each without every replicate group that holds effect windows (for ρ's interval;
    ``effect_rows.effect_groups``)."""
    from headatlas.service.storage.effect_rows import effect_groups

    groups = effect_groups(conn, run_id)
    rows = conn.execute(
        text(
            "SELECT layer, head, drop_rep, effect_mean, importance FROM head_metrics_reps WHERE run_id = :r "
            "ORDER BY drop_rep, layer, head"
        ),
        {"r": run_id},
    ).all()
    if not rows:
        return None, None, [], []
    n_layers = 1 + max(int(r[0]) for r in rows)
    n_heads = 1 + max(int(r[1]) for r in rows)
    by_drop: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for layer, head, drop, effect, importance in rows:
        e, i = by_drop.setdefault(
            int(drop), (np.full((n_layers, n_heads), np.nan), np.full((n_layers, n_heads), np.nan))
        )
        e[layer, head] = np.nan if effect is None else effect
        i[layer, head] = np.nan if importance is None else importance
    effect, importance = by_drop.get(-1, (None, None))
    effect = effect if effect is not None and np.isfinite(effect).all() else None
    importance = importance if importance is not None and np.isfinite(importance).all() else None
    drops = [e for d, (e, _i) in sorted(by_drop.items()) if d in groups and np.isfinite(e).all()]
    importance_drops = [i for d, (_e, i) in sorted(by_drop.items()) if d in groups and np.isfinite(i).all()]
    return (
        effect,
        importance,
        drops if effect is not None else [],
        importance_drops if importance is not None else [],
    )


def prune_run(
    store: Store,
    run: Run,
    *,
    orders: Sequence[str] | None,
    step: float,
    seeds: int,
    windows: int,
    reference: int | None,
    device: str = "auto",
    on_step: Callable[[str, int, int, float], None] | None = None,
    on_plan: Callable[[str], None] | None = None,
    model=None,
) -> tuple[PruneResult, StoredPrune]:
    """Measure the run's pruning curves and store them; returns the result and the stored prune.
    ``reference``: windows of mean ablation's reference set (None: the run's own
    ``effect_reference`` when it has effects, else 64); ``model``: a loaded model to use instead
    of loading the run's; ``orders`` None: every order the run's objective allows (importance
    needs a loss); ``on_plan``: told what will be measured (``plan``) before it starts."""
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.run_plan import effect_targets
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.measures.objectives import objective_for

    check_request(run, orders=orders, seeds=seeds)
    params = AnalysisParams.from_dict(run.params)
    with store.checked_read() as conn:
        noise = noise_shares(conn, run.run_id)
        effect, importance, drops, importance_drops = stored_effects(conn, run.run_id)
        counted = effect_windows(conn, run.run_id)
        recorded = run_effects(conn, run.run_id)
    loaded = model or load_model(run.model, device=device)
    with store.checked_read() as conn:
        sinks = sink_shares(conn, run.run_id, causal=loaded.causal)
    # the objective the run's effects were measured on, as recorded with them; a run without
    # effects: the one its parameters name (the model's own)
    objective = objective_for(loaded, recorded[0]["objective"] if recorded else params.objective)
    if orders is None:
        orders = [o for o in ORDERS if o != "importance" or objective.is_loss]
    began = time.perf_counter()
    stored = None
    if effect is not None or importance is not None:
        tokens = TokenClasses.for_model(loaded)
        measured = [w for _position, w in effect_targets(run.corpus, loaded, params, tokens)]  # its rule
        stored = StoredOrders(
            effect=effect,
            importance=importance,
            effect_drops=drops,
            importance_drops=importance_drops,
            windows={w.window_id for w in measured},
            source=f"the run's stored effects ({counted} windows)",
        )
    if reference is None:
        reference = params.effect_reference if effect is not None else 64
    if on_plan is not None and 0 < step <= 1:
        steps = len(removal_counts(loaded.n_layers * loaded.n_heads, step))
        said = plan(orders, seeds=seeds, steps=steps, windows=windows, retrieval=retrieval_applies(objective, loaded))
        on_plan(said)
    result = prune_curves(
        run.corpus,
        loaded,
        params,
        orders=orders,
        noise_share=noise,
        sink_share=sinks,
        step=step,
        seeds=seeds,
        windows=windows,
        reference=reference,
        on_step=on_step,
        stored=stored,
        objective=objective,
    )
    columns, rows = result.rows()
    assert tuple(columns) == CURVE_COLUMNS
    area = result.area or (None, None, None)
    rho = result.rho or (None, None, None)
    meta = {
        "objective": result.objective,
        "unit": result.unit,
        "orders": ",".join(orders),
        "step": step,
        "seeds": seeds,
        "evaluation_windows": result.evaluation_windows,
        "selection": result.selection,
        "reference_windows": result.reference_windows,
        "scheme": result.scheme,
        "groups": result.groups,
        "area": area[0],
        "area_lo": area[1],
        "area_hi": area[2],
        "rho": rho[0],
        "rho_lo": rho[1],
        "rho_hi": rho[2],
        "claim": result.claim(),
        "seconds": time.perf_counter() - began,
        "retrieval_queries": None,
        "retrieval_candidates": None,
        "chance_top1": None,
        "chance_mrr": None,
    }
    if result.retrieval is not None:
        meta["retrieval_queries"] = result.retrieval.queries
        meta["retrieval_candidates"] = result.retrieval.candidates
        meta["chance_top1"] = result.retrieval.chance_top1
        meta["chance_mrr"] = result.retrieval.chance_mrr
    removed = result.removed()
    prune_id = store.atomically(lambda conn: store_prune(conn, run.run_id, meta, rows, removed))
    with store.read() as conn:
        saved = load_prune(conn, run.run_id, prune_id)
    assert saved is not None
    return result, saved
