"""A run: its layer progression, the head atlas, the roles with their evidence and stability, and a
sortable, filterable table of its heads with their intervals.

Parameters (the CLI's names): ``metric`` (the layer progression's, one of ``query layers``'
columns), ``color`` (the atlas: by default its effect where measured, else ``evidence``, the primary
role's value over its threshold; ``role`` or any numeric column of ``query heads``), ``sort``,
``asc``, ``layer``, ``top`` (as ``query heads``), ``role`` (heads holding that role), ``wide``
(every column). The JSON document: ``run`` (its row of ``headatlas runs``), ``layers`` (``query
layers --ci``), ``heads`` (``query heads --ci`` with the same sort, layer and top; then the role
filter), ``roles`` (``query roles --stability``).
"""

from __future__ import annotations

from headatlas.service.errors import Param, ParameterError, Part
from headatlas.service.metrics import COLUMNS, METRICS
from headatlas.service.operations.runs import check_layer_head
from headatlas.service.reports import (
    attention_kind,
    compare,
    layer_queries,
    queries,
    query_support,
    role_rules,
    role_tests,
    role_views,
    roles,
)
from headatlas.service.reports.columns import PROBE_COLUMNS, head_table, sortable, unknown_metric
from headatlas.service.reports.intervals import interval_note, scheme_of
from headatlas.service.storage.store import Run
from headatlas.service.web import charts
from headatlas.service.web.context import Ctx, run_path
from headatlas.service.web.documents import records, with_scheme
from headatlas.service.web.html import (
    Html,
    colour,
    e,
    facets,
    hidden,
    ink,
    legend_bar,
    num,
    record,
    select,
    table,
    when,
)
from headatlas.service.web.views import View
from headatlas.service.wording import seconds

LAYER_METRICS = layer_queries.LAYER_COLUMNS[1:]
# SPEC §9: what removing a head costs, per head (the effect metric's columns but the run-wide objective);
# SPEC §10: what its KV head streaming costs
EFFECT_COLUMNS = (
    *(c.name for m in METRICS if m.spec == "§9" for c in m.columns if c.heads and c.name != "objective"),
    "effect_streaming",
)
# O(ablated) − O(intact): of either sign (a head whose removal helps), so shown about 0
SIGNED_EFFECTS = tuple(c for c in EFFECT_COLUMNS if c.startswith("effect_"))
DEFAULT_METRIC = "within_sentence_lift_dm"


def run_reads(ctx: Ctx, run: Run) -> dict:
    """What the run page reads, through the library (remembered per database state)."""
    r = run.run_id
    return {
        "layers": ctx.run_query(run, ("layers",), lambda c: layer_queries.layers(c, r, ci=True)),
        "roles": run_roles(ctx, run),
        "causal": ctx.run_query(run, ("causal",), lambda c: attention_kind.causal_run(c, r)),
        "controls": ctx.query(("controls", r), lambda c: compare.controls_of(c, run)),
        "warning": ctx.run_query(run, ("warning",), lambda c: query_support.interval_warning(c, r)),
        "all_heads": heads_of(ctx, run),
    }


def run_roles(ctx: Ctx, run: Run) -> query_support.Rows:
    """``query roles --stability``."""
    return ctx.run_query(run, ("roles",), lambda c: roles.roles(c, run.run_id, stability=True))


def heads_of(ctx: Ctx, run: Run, *, layer=None, sort=None, asc=False, top=None) -> query_support.Rows:
    """``query heads --ci`` with these options."""
    r = run.run_id
    return ctx.run_query(
        run,
        ("heads", layer, sort, asc, top),
        lambda c: queries.heads(c, r, layer=layer, sort=sort, top=top, ci=True, ascending=asc),
    )


def run_view(ctx: Ctx, ref: str) -> View:
    run = ctx.run(ref)
    metric = ctx.arg("metric") or DEFAULT_METRIC
    if metric not in LAYER_METRICS:
        raise unknown_metric("metric", metric, LAYER_METRICS)
    sort, asc, layer, top = ctx.arg("sort"), ctx.flag("asc"), ctx.number("layer"), ctx.number("top", minimum=1)
    check_layer_head(run, layer)
    read = run_reads(ctx, run)
    offered = role_rules.offered_roles(read["causal"])
    role = ctx.arg("role")
    if role is not None and role not in (*offered, role_rules.NONE):
        raise ParameterError(
            Param("role", role), f": not a role of run {run.run_id}; choose one of {', '.join(offered)}"
        )
    choices = atlas_colours(read)
    color = ctx.arg("color") or choices[0]
    if color in sortable() and color not in choices:  # a column of the run that it holds no value in
        raise ParameterError(Param("color", color), f": run {run.run_id} has no value of it", hint=_measure_hint(color))
    if color not in choices:
        raise unknown_metric("color", color, choices)
    head_cols, head_rows = heads_of(ctx, run, layer=layer, sort=sort, asc=asc, top=top)
    if role is not None:
        holders = _holders(read["roles"], role)
        head_rows = [h for h in head_rows if (h[0], h[1]) in holders]
    scheme = [scheme_of(run.params)]

    def data() -> dict:
        return {
            "run": ctx.run_row(run),
            "layers": records(*read["layers"]),
            "heads": records(head_cols, head_rows),
            "roles": records(*with_scheme(read["roles"][0], read["roles"][1], scheme)),
        }

    def body() -> str:
        return "".join(
            [
                _facts(ctx, run, read),
                _layer_section(ctx, read["layers"], metric),
                _atlas_section(ctx, run, read, color, offered),
                _roles_section(ctx, run, read, offered),
                _heads_section(ctx, run, (head_cols, head_rows), sort, asc, layer, role, offered),
            ]
        )

    return View(f"Run {run.run_id}: {run.name}", data, body, crumbs=[(f"run {run.run_id}", ctx.url(run_path(run)))])


def colour_columns(head_rows: query_support.Rows) -> list[str]:
    """The numeric columns the atlas can be coloured by: those the run holds a value of (effects only
    where §9 effects were measured, the probe's scores only where it ran), the effects first."""
    columns, rows = head_rows
    held = [c for c in sortable() if c in columns and any(r[columns.index(c)] is not None for r in rows)]
    return [c for c in held if c in EFFECT_COLUMNS] + [c for c in held if c not in EFFECT_COLUMNS]


def _measure_hint(column: str) -> tuple[Part, ...]:
    if column == "effect_streaming":
        return ("its streaming effects (SPEC §10) were not measured: run `headatlas effects RUN --streaming`",)
    if column in EFFECT_COLUMNS:
        return (
            "its effects (SPEC §9) were not measured: analyse it with ",
            Param("effects", "zero"),
            " (or mean, gradient)",
        )
    if column in PROBE_COLUMNS:
        return ("it has no probe: analyse it again with ", Param("probe", True))
    return ("choose a column it holds",)


def _holders(role_rows: query_support.Rows, role: str) -> set[tuple[int, int]]:
    columns, rows = role_rows
    ri = columns.index("role")
    return {(r[0], r[1]) for r in rows if r[ri] == role}


def _facts(ctx: Ctx, run: Run, read: dict) -> str:
    row = ctx.run_row(run)
    params = " · ".join(f"{k} {v}" for k, v in run.params.items() if k not in ("control_of", "control_seed"))
    links = [
        f'<a href="{e(ctx.url(run_path(run, "sql")))}">SQL over this run</a>',
        f'<a href="{e(ctx.url(run_path(run, "try")))}">your own text through its model</a>',
    ]
    links += [
        f'<a href="{e(ctx.url(f"/compare/{run.run_id}/{c.run_id}"))}">against its control, seed {compare.control_seed(c)}</a>'
        for c in read["controls"]
    ]
    facts = [
        ("status", run.status + (f" ({run.error})" if run.error else "")),
        ("model", f"{run.model_name} [{run.model}]"),
        ("shape", f"{run.n_layers} layers × {run.n_heads} heads, head size {run.d_head}"),
        ("windows", f"{row['windows']:,}"),
        ("corpus", run.corpus),
        ("parameters", params),
        ("created", when(row["created_at"])),
        ("compute", f"{seconds(row['compute_s'])} s"),
    ]
    if row["aliases"] or row["tags"]:
        facts.append(("names", ", ".join([*row["aliases"], *(f"#{t}" for t in row["tags"])])))
    if "snapshot" in row:
        facts.append(("last snapshot", row["snapshot"]))
    facts.append(("see also", Html(" · ".join(links))))
    warn = f'<p class="warning">warning: {e(read["warning"])}</p>' if read["warning"] else ""
    return record(facts) + warn


def _layer_section(ctx: Ctx, layer_rows: query_support.Rows, metric: str) -> str:
    columns, rows = layer_rows
    named = [dict(zip(columns, r)) for r in rows]
    points = [
        charts.Point(
            d["layer"],
            d.get(metric),
            d.get(f"{metric}_lo"),
            d.get(f"{metric}_hi"),
            f"layer {d['layer']}: {metric} {num(d.get(metric))}"
            + (
                f" [{num(d[metric + '_lo'])}, {num(d[metric + '_hi'])}]"
                if d.get(f"{metric}_lo") is not None
                else " (no interval)"
            ),
        )
        for d in named
    ]
    chance = (1.0, "1 = chance") if metric.endswith(("_lift", "_lift_dm")) else None
    chart = charts.line_chart(
        [charts.Series(metric, points)],
        x_label="layer (0-based)",
        y_label=metric,
        x_ticks=[p.x for p in points],
        reference=chance,
    )
    options = [(m, m) for m in LAYER_METRICS]
    form = (
        f'<form class="inline" method="get">{select("metric", options, metric, label="metric")}'
        f"{hidden(ctx.request, 'color', 'sort', 'asc', 'layer', 'top', 'role', 'wide')}<noscript><button>show</button></noscript></form>"
    )
    return (
        f'<h2 id="layers">Layer progression</h2>{form}<figure>{chart}<figcaption>{e(metric)} per layer with its 95% '
        f"interval (hover a point). {e(query_support.LIFT_NOTE)}</figcaption></figure>"
    )


def atlas_colours(read: dict) -> list[str]:
    """What the atlas can be coloured by, the default first: the run's effects (what removing the head
    costs, SPEC §9), its roles' evidence (``evidence``: the primary role's value over its threshold,
    where a head holds a role), each role's own colour (``role``), then every other numeric column."""
    from headatlas.service.reports.atlas_plots import DEFAULT_EFFECTS  # as `plot atlas` chooses

    numeric = colour_columns(read["all_heads"])
    effects = [c for c in DEFAULT_EFFECTS if c in numeric]
    evidence = ["evidence"] if _evidence(read["roles"]) else []
    return [*effects, *evidence, "role", *(c for c in numeric if c not in effects)]


def _evidence(role_rows: query_support.Rows) -> dict[tuple[int, int], tuple[float, bool]]:
    """(layer, head) → (its primary role's value over its threshold, at least 1; whether that role
    is unsure: not on both halves, or its interval reaching its threshold)."""
    from headatlas.service.reports.atlas_plots import role_uncertain

    columns, rows = role_rows
    at = {c: i for i, c in enumerate(columns)}
    found = {}
    for r in rows:
        value, threshold = r[at["value"]], r[at["threshold"]]
        if r[at["primary"]] and r[at["role"]] != role_rules.NONE and value and threshold and threshold > 0:
            found[(r[0], r[1])] = (max(1.0, value / threshold), role_uncertain(columns, r))
    return found


def _atlas_section(ctx: Ctx, run: Run, read: dict, color: str, offered: tuple[str, ...]) -> str:
    import math

    from headatlas.service.reports.atlas_plots import ROLE_COLOURS, ROLE_WORDS, role_uncertain

    columns, rows = read["roles"]
    at = {c: i for i, c in enumerate(columns)}
    held: dict[tuple[int, int], list[tuple[str, bool | None]]] = {}
    primary: dict[tuple[int, int], str] = {}
    unsure: dict[tuple[int, int], bool] = {}
    for r in rows:
        key = (r[0], r[1])
        if r[at["role"]] != role_rules.NONE:
            held.setdefault(key, []).append((r[at["role"]], r[at["stable"]] if "stable" in at else None))
        if r[at["primary"]]:
            primary[key] = r[at["role"]]
            unsure[key] = r[at["role"]] != role_rules.NONE and role_uncertain(columns, r)
    head_cols, head_rows = read["all_heads"]
    hi = {c: i for i, c in enumerate(head_cols)}
    values = {(h[0], h[1]): h for h in head_rows}
    evidence = _evidence(read["roles"]) if color == "evidence" else {}
    if color == "evidence":  # a ratio of 1 and more: on a log scale, so 2× and 20× both read
        shown = [math.log10(v) for v, _ in evidence.values()]
        low, high = 0.0, max(max(shown, default=1.0), 0.3)
    else:
        shown = [v[hi[color]] for v in head_rows if color != "role" and v[hi[color]] is not None]
        low, high = (min(shown), max(shown)) if shown else (0.0, 1.0)
    grid = []
    for layer in range(run.n_layers):
        cells = [f"<th>{layer}</th>"]
        for head in range(run.n_heads):
            key = (layer, head)
            name = primary.get(key, role_rules.NONE)
            others = len(held.get(key, [])) - (name != role_rules.NONE)
            text = ROLE_WORDS.get(name, name) + (f" +{others}" if others > 0 else "")
            tip = f"layer {layer}, head {head}: {name}"
            if held.get(key):
                tip += (
                    " ("
                    + ", ".join(role + (", not on both halves" if s is False else "") for role, s in held[key])
                    + ")"
                )
            faded = unsure.get(key, False)
            if color == "role":
                bg = ROLE_COLOURS.get(name, "#e4e4e4")
            elif color == "evidence":
                ratio, faded = evidence.get(key, (None, False))
                bg = colour(None if ratio is None else math.log10(ratio), low, high)
                if ratio is not None:
                    tip += f"; value {num(ratio)} × its threshold"
            else:
                h = values.get(key)
                v = h[hi[color]] if h is not None else None
                bg = colour(v, low, high, diverging=color in SIGNED_EFFECTS)
                tip += f"; {color} {num(v)}"
                faded = False
                if h is not None and f"{color}_lo" in hi:
                    lo_v, hi_v = h[hi[color + "_lo"]], h[hi[color + "_hi"]]
                    tip += f" [{num(lo_v)}, {num(hi_v)}]"
                    # an effect whose interval holds 0: unsure of its sign
                    faded = color in SIGNED_EFFECTS and lo_v is not None and hi_v is not None and lo_v <= 0 <= hi_v
            mark = " unsure" if faded else ""
            href, said = e(ctx.url(run_path(run, "heads", layer, head))), e(tip)
            cells.append(
                f'<td><a class="cell{mark}" href="{href}" data-layer="{layer}" data-head="{head}" '
                f'style="background:{bg};color:{ink(bg)}" data-tip="{said}" title="{said}">{e(text)}</a></td>'
            )
        grid.append(f"<tr>{''.join(cells)}</tr>")
    head_row = "<th>layer \\ head</th>" + "".join(f"<th>{h}</th>" for h in range(run.n_heads))
    if color == "role":
        legend = '<div class="legend">' + "".join(
            f'<span><i style="background:{ROLE_COLOURS.get(r, "#e4e4e4")}"></i>{e(r)}</span>'
            for r in (*offered, role_rules.NONE)
        )
        legend += "<span>faded: unsure (not on both halves, or its 95% interval reaches its threshold)</span></div>"
    elif color == "evidence":
        legend = legend_bar(low, high, "the primary role's value over its threshold, log10 (0: 1×, 1: 10×)")
        legend += '<p class="muted">Faded: unsure (not on both halves, or its 95% interval reaches its threshold).</p>'
    else:
        legend = legend_bar(low, high, color, diverging=color in SIGNED_EFFECTS)
        if color in EFFECT_COLUMNS:
            legend += (
                f'<p class="muted">{e(color)}: {e(_definition(color))} '
                f"(SPEC {'§10' if color == 'effect_streaming' else '§9'}). Faded: its 95% interval includes 0.</p>"
            )
    names = {"role": "role (its own colour)", "evidence": "evidence: primary role's value / threshold"}
    named = [(c, names.get(c, f"effect: {c}" if c in EFFECT_COLUMNS else c)) for c in atlas_colours(read)]
    form = (
        f'<form class="inline" method="get">{select("color", named, color, label="colour by")}'
        f"{hidden(ctx.request, 'metric', 'sort', 'asc', 'layer', 'top', 'role', 'wide')}<noscript><button>show</button></noscript></form>"
    )
    return (
        f'<h2 id="atlas">Head atlas</h2>{form}<div class="table-wrap"><table class="atlas" id="atlas-grid">'
        f"<thead><tr>{head_row}</tr></thead><tbody>{''.join(grid)}</tbody></table></div>{legend}"
        f'<p class="muted">Each cell names its head\'s primary role (+n: other roles it holds). '
        f"Click a head for its metrics, roles, anchors, distances and an example window. "
        f"A role is earned when its one-sided test survives Holm–Bonferroni over every (head, role) of the run "
        f"(α = {role_tests.ALPHA:g}, SPEC §7).</p>"
    )


def _definition(column: str) -> str:
    return next(c.definition for c in COLUMNS if c.name == column)


def _roles_section(ctx: Ctx, run: Run, read: dict, offered: tuple[str, ...]) -> str:
    columns, rows = read["roles"]
    counts, stable = role_views.role_counts(columns, rows, offered), role_views.stable_counts(columns, rows) or {}
    rules = {r.role: r.rule for r in role_rules.rules_for(read["causal"])}
    count_rows = [(r, n, stable.get(r), rules.get(r, "")) for r, n in counts.items()]
    count_table = table(
        ["role", "heads", "stable", "rule"],
        count_rows,
        text_columns=("role", "rule"),
        links={"role": lambda d: ctx.here(role=d["role"]) + "#heads"},
    )
    ri = columns.index("role")
    earned = [r for r in rows if r[ri] != role_rules.NONE]
    family = role_views.family_size(columns, rows)
    tested = (
        f"Holm–Bonferroni over {family} (head, role) tests, α = {role_tests.ALPHA:g}"
        if family
        else "no replicate groups: each value tested against its threshold, uncorrected"
    )
    pi = columns.index("probe_score")
    probed = any(r[pi] is not None for r in rows)
    left_out = ("rule", "family", "test") + (() if probed else ("probe_score", "probe_min"))
    shown = [c for c in columns if c not in left_out]
    evidence = facets("roles", columns, earned) + table(
        columns,
        earned,
        shown=shown,
        text_columns=("role", "metric"),
        links={"head": lambda d: ctx.url(run_path(run, "heads", d["layer"], d["head"]))},
        table_id="roles",
    )
    note = role_tests.ROLES_NOTE + ". " + roles.STABILITY_NOTE
    return (
        f'<h2 id="roles">Roles</h2><p class="muted">{e(tested)}.</p>{count_table}'
        f"<h3>Evidence ({len(earned)} roles earned)</h3>{evidence}"
        f'<p class="muted">{e(note)}. {e(interval_note([scheme_of(run.params)]))}</p>'
    )


def _heads_section(ctx, run, head_rows, sort, asc, layer, role, offered) -> str:
    columns, rows = head_rows
    wide = ctx.flag("wide")
    # the measures a reader ranks heads by (as the report's, an installed plugin's included), then anchors
    main = [*head_table(sort=sort, among=columns, rows=rows), *(["top_anchors"] if "top_anchors" in columns else [])]
    shown = [c for c in columns if c != "interval_by"] if wide else main

    def header(c: str) -> str:
        from headatlas.service.web.html import breakable

        if c in ("layer", "head"):
            return f'<a href="{e(ctx.here(sort=None, asc=None))}#heads">{breakable(c)}</a>'
        if c not in sortable():
            return breakable(c)
        mark = (" ▲" if asc else " ▼") if c == sort else ""
        href = ctx.here(sort=c, asc=(not asc) if c == sort else None)
        return f'<a class="sort" href="{e(href)}#heads">{breakable(c)}{mark}</a>'

    layer_options = [("", "all"), *((str(l), str(l)) for l in range(run.n_layers))]
    role_options = [("", "any"), *((r, r) for r in (*offered, role_rules.NONE))]
    form = (
        f'<form class="inline" method="get" id="heads-filter">{select("layer", layer_options, None if layer is None else str(layer), label="layer")}'
        f" {select('role', role_options, role, label='role')}"
        f' <label>top <input type="number" name="top" min="1" value="{e(ctx.arg("top") or "")}" size="4"></label>'
        f'{hidden(ctx.request, "metric", "color", "sort", "asc", "wide")} <button type="submit">filter</button>'
        f' <input type="search" placeholder="find in the table (anchors …)" data-filter="#heads-table">'
        f' <a href="{e(ctx.here(wide=None if wide else 1))}#heads">{"main columns" if wide else "every column"}</a></form>'
    )
    body = table(
        columns,
        rows,
        shown=shown,
        header=header,
        links={"head": lambda d: ctx.url(run_path(run, "heads", d["layer"], d["head"]))},
        table_id="heads-table",
        text_columns=("top_anchors",),
    )
    said = f"{len(rows)} heads" + (f", sorted by {sort} ({'smallest' if asc else 'largest'} first)" if sort else "")
    return (
        f'<h2 id="heads">Heads</h2>{form}<p class="muted">{e(said)}. Under each value: its 95% interval. '
        f"Click a column to sort by it (again: the other way). {e(query_support.LIFT_NOTE)}</p>{body}"
    )
