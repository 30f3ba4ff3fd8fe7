"""Two runs side by side (``service.reports.compare``): per layer, per head, or along relative depth,
each with both values, A − B with its 95% interval, and the verdict.

``/compare/A/B?by=layer|head|depth&metric=M`` (``metric`` repeated: several; default the main
lifts and shares; ``layer``: one layer of A). The JSON document: ``a``, ``b`` (their rows of
``headatlas runs``), ``by``, ``rows`` (``headatlas compare A B [--heads] --format json``), and for
``depth`` also ``profiles`` (each run's layers with their intervals, what ``plot compare`` draws).
"""

from __future__ import annotations

from headatlas.service.errors import Param, ParameterError
from headatlas.service.reports import compare
from headatlas.service.storage.store import Run
from headatlas.service.web import charts
from headatlas.service.web.context import Ctx, run_path
from headatlas.service.web.documents import records
from headatlas.service.web.html import colour, e, hidden, ink, interval, legend_bar, num, record, select, table
from headatlas.service.web.views import View

BY = ("layer", "head", "depth")


def compare_view(ctx: Ctx, ref_a: str, ref_b: str) -> View:
    a, b = ctx.run(ref_a), ctx.run(ref_b)
    by = ctx.arg("by") or "layer"
    if by not in BY:
        raise ParameterError(Param("by", by), ": compare by layer, head or depth (relative depth)")
    metrics = compare.check_metrics(ctx.request.args("metric") or None)
    layer = ctx.number("layer")
    heads = by == "head"
    rows = ctx.runs_query(
        (a, b),
        ("compare", tuple(metrics), layer, heads),
        lambda c: compare.compare(c, a, b, metrics=metrics, layer=layer, heads=heads),
    )
    # a decoder's [CLS] columns are its first token's: said under the verdicts, as `compare` says it
    sink = ctx.runs_query(
        (a, b),
        ("first token", tuple(metrics), layer, heads),
        lambda c: compare.first_token_note(c, [a, b], rows[1]),
    )
    profiles = None
    if by == "depth":
        profiles = {name: _profile(ctx, run, metrics) for name, run in (("a", a), ("b", b))}

    def data() -> dict:
        document: dict = {"a": ctx.run_row(a), "b": ctx.run_row(b), "by": by, "rows": records(*rows)}
        if profiles is not None:
            document["profiles"] = {name: records(*p) for name, p in profiles.items()}
        return document

    def body() -> str:
        parts = [_header(ctx, a, b, by, metrics)]
        if by == "head":
            parts.append(_head_grids(ctx, a, rows, metrics))
        elif by == "depth" and profiles is not None:
            parts.append(_depth_charts(a, b, profiles, metrics))
        parts.append(_verdicts(ctx, a, b, rows, heads, sink))
        return "".join(parts)

    title = f"Compare run {a.run_id} ({a.name}) with run {b.run_id} ({b.name})"
    return View(title, data, body, crumbs=[("compare", ctx.request.path)])


def _profile(ctx: Ctx, run: Run, metrics: list[str]) -> compare.Rows:
    """``compare.layer_profile``: the run's layers with their intervals."""
    return ctx.run_query(run, ("profile", tuple(metrics)), lambda c: compare.layer_profile(c, run, metrics))


def _header(ctx: Ctx, a: Run, b: Run, by: str, metrics: list[str]) -> str:
    facts = [
        ("A", f"run {a.run_id} ({a.name}): {a.model_name}, {a.n_layers} layers × {a.n_heads} heads"),
        ("B", f"run {b.run_id} ({b.name}): {b.model_name}, {b.n_layers} layers × {b.n_heads} heads"),
    ]
    if compare.is_control(a, b):
        facts.append(
            ("B is", f"A's random-weights control (seed {compare.control_seed(b)}): the floor every claim should beat")
        )
    differ = compare.parameter_differences(a, b)
    if differ:
        facts.append(("parameters differ", "; ".join(differ)))
    if a.n_layers != b.n_layers:
        facts.append(
            (
                "depths",
                "differ: each layer of the shallower run is paired with the nearest in relative depth (l + 0.5) / L",
            )
        )
    by_options = [("layer", "layer"), ("head", "head"), ("depth", "relative depth")]
    picked = "".join(
        f'<label><input type="checkbox" name="metric" value="{e(m)}"{" checked" if m in metrics else ""}> {e(m)}</label> '
        for m in compare.METRICS
    )
    form = (
        f'<form method="get" class="inline">{select("by", by_options, by, label="by")} '
        f'<details><summary>metrics ({len(metrics)})</summary><div class="choices">{picked}</div>'
        f'<button type="submit">show</button></details>{hidden(ctx.request, "layer")}</form>'
    )
    links = f'<a href="{e(ctx.url(run_path(a)))}">run A</a> · <a href="{e(ctx.url(run_path(b)))}">run B</a> · <a href="{e(ctx.url(f"/compare/{b.run_id}/{a.run_id}", by=by))}">swap</a>'
    return record(facts) + f'<p class="pager">{links}</p>' + form


def _verdicts(ctx: Ctx, a: Run, b: Run, rows: compare.Rows, heads: bool, sink: str | None = None) -> str:
    columns, values = rows
    shown = [
        c
        for c in (
            "layer_a",
            "layer_b",
            "head",
            "depth_a",
            "depth_b",
            "metric",
            "value_a",
            "value_b",
            "difference",
            "verdict",
        )
        if heads or c != "head"
    ]
    if a.n_layers == b.n_layers:
        shown = [c for c in shown if c not in ("depth_a", "depth_b")]
    beyond = sum(1 for r in values if r[columns.index("verdict")] == "beyond")
    links = {"head": lambda d: ctx.url(run_path(a, "heads", d["layer_a"], d["head"]))} if heads else None
    return (
        f'<h2 id="verdicts">Verdicts</h2><p><strong>{beyond}</strong> of {len(values)} differences beyond their 95% '
        f"interval.</p>"
        + table(
            columns,
            values,
            shown=shown,
            text_columns=("metric", "verdict"),
            links=links,
            table_id="compare-table",
            row_class=lambda d: f"verdict-{d['verdict'].replace(' ', '-')}",
        )
        + f'<p class="muted">{e(compare.VERDICT_NOTE)}</p>'
        + (f'<p class="muted">{e(sink)}</p>' if sink else "")
    )


def _head_grids(ctx: Ctx, a: Run, rows: compare.Rows, metrics: list[str]) -> str:
    columns, values = rows
    at = {c: i for i, c in enumerate(columns)}
    parts = ['<h2 id="grids">Per head: A − B</h2>']
    for metric in metrics:
        mine = [r for r in values if r[at["metric"]] == metric]
        diffs = [r[at["difference"]] for r in mine if r[at["difference"]] is not None]
        top = max((abs(d) for d in diffs), default=1.0) or 1.0
        cells = {(r[at["layer_a"]], r[at["head"]]): r for r in mine}
        grid = []
        for layer in range(a.n_layers):
            tds = [f"<th>{layer}</th>"]
            for head in range(a.n_heads):
                r = cells.get((layer, head))
                d = r[at["difference"]] if r else None
                bg = colour(d, -top, top, diverging=True)
                verdict = r[at["verdict"]] if r else "no value"
                tip = f"layer {layer}, head {head}: A − B = {num(d)} {interval(r[at['difference_lo']], r[at['difference_hi']]) if r else ''} ({verdict})"
                mark = " beyond" if verdict == "beyond" else ""
                href, said = e(ctx.url(run_path(a, "heads", layer, head))), e(tip)
                tds.append(
                    f'<td><a class="cell{mark}" href="{href}" style="background:{bg};color:{ink(bg)}" data-tip="{said}" title="{said}">{num(d)}</a></td>'
                )
            grid.append(f"<tr>{''.join(tds)}</tr>")
        head_row = "<th>layer \\ head</th>" + "".join(f"<th>{h}</th>" for h in range(a.n_heads))
        parts.append(
            f'<h3>{e(metric)}</h3><div class="table-wrap"><table class="atlas"><thead><tr>{head_row}</tr></thead>'
            f"<tbody>{''.join(grid)}</tbody></table></div>{legend_bar(-top, top, 'A − B; outlined: beyond its interval', diverging=True)}"
        )
    return "".join(parts)


def _depth_charts(a: Run, b: Run, profiles: dict, metrics: list[str]) -> str:
    parts = [
        '<h2 id="depth">Along relative depth</h2><p class="muted">Layer l of an L-layer model sits at (l + 0.5) / L; '
        "each point with its 95% interval.</p>"
    ]
    for metric in metrics:
        series = []
        for name, run in (("a", a), ("b", b)):
            columns, rows = profiles[name]
            i, lo, hi = (columns.index(c) for c in (metric, f"{metric}_lo", f"{metric}_hi"))
            points = [
                charts.Point(
                    compare.relative_depth(r[0], run.n_layers),
                    r[i],
                    r[lo],
                    r[hi],
                    f"{name.upper()} ({run.name}) layer {r[0]}, depth {compare.relative_depth(r[0], run.n_layers):.2f}: "
                    f"{metric} {num(r[i])} {interval(r[lo], r[hi])}",
                )
                for r in rows
            ]
            series.append(charts.Series(f"{name.upper()}: {run.name}", points))
        chance = (1.0, "1 = chance") if metric.endswith(("_lift", "_lift_dm")) else None
        chart = charts.line_chart(
            series,
            x_label="relative depth (l + 0.5) / L",
            y_label=metric,
            width=620,
            height=240,
            reference=chance,
            x_range=(0.0, 1.0),
        )
        parts.append(f"<figure>{chart}</figure>")
    return parts[0] + f'<div class="charts">{"".join(parts[1:])}</div>'
