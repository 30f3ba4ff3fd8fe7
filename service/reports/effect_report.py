"""The report's section on causal effects (SPEC §9): which heads the model needs, what each role's
heads cost, and the newest stored pruning curves with the seed paper's claim. Empty for a run
without effects or prunes."""

from __future__ import annotations

import html
import math

from headatlas.service.wording import counted


def _e(value) -> str:
    return html.escape(str(value))


def effects_section(conn, run, *, table, img) -> str:
    """``table(columns, rows)`` and ``img(png, alt)``: the report's own renderers."""
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import effect_queries, plots, role_effects, roles
    from headatlas.service.reports.prune_plot import figure_prune
    from headatlas.service.storage.effect_rows import effect_groups, effect_note, load_prune, run_effects

    parts = []
    found = run_effects(conn, run.run_id)
    if found:
        try:
            columns, rows = effect_queries.effects(conn, run.run_id, ci=True)
        except ParameterError:
            columns, rows = [], []
        if columns:
            sort = next(c for c in ("effect_mean", "effect_zero", "importance", "effect_atp") if c in columns)
            at = columns.index(sort)
            top = sorted(rows, key=lambda r: -(r[at] if r[at] is not None else -math.inf))[:10]
            names, role_rows = roles.roles(conn, run.run_id)
            per_role = role_effects.by_role(conn, run.run_id, names, role_rows) or []
            unit = found[0]["unit"]
            lines = "".join(
                "<li>"
                + _e(role_effects.describe(f"{role} ({counted(n, 'head')})", v, lo, hi, unit))
                + (_e(f"; {gap_text}") if (gap_text := role_effects.against_none(g, glo, ghi)) else "")
                + "</li>"
                for role, n, v, lo, hi, g, glo, ghi in per_role
            )
            parts.append(
                f"""<h2>Which heads the model needs (SPEC §9)</h2>
<p>{_e(effect_note(conn, run.run_id) or "")}. The ten heads whose {_e(sort)} is largest{", with 95% intervals" if len(effect_groups(conn, run.run_id)) >= 2 else ""}:</p>
<div class="scroll">{table(columns, top)}</div>
<p>Mean effect of each role's heads (primary role), with the difference from the heads without a role:</p>
<ul>{lines}</ul>"""
            )
    prune = load_prune(conn, run.run_id)
    if prune is not None:
        fig = figure_prune(prune, title=f"pruning curves: run {run.run_id} ({run.name})")
        parts.append(
            f"""<h3>Pruning curves (prune {prune.meta["prune_id"]})</h3>
<p>Heads removed cumulatively by mean ablation; O = {_e(prune.meta["objective"])} ({_e(prune.meta["unit"])}) on
{prune.meta["evaluation_windows"]} evaluation windows; orders from {_e(prune.meta["selection"])}.
The seed paper's claim: {_e(prune.meta["claim"])}.</p>
<figure>{img(plots.png_bytes(fig), "pruning curves")}<figcaption>The objective's increase over the intact model
against the share of heads removed, per order, with 95% intervals (bands); random orders in grey.</figcaption></figure>"""
        )
    return "".join(parts)
