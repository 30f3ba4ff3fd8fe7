"""A head: every metric with its chance and interval, its roles and their tests, its anchors, its
distances against chance, its effect where measured, and an example window of the corpus.

The JSON document: ``run``; ``layer`` and ``head``; ``metrics`` (its row of ``query heads --layer L
--ci``), ``roles`` (its rows of ``query roles --stability``), ``distances`` (``query distances
--layer L --head H --ci``), ``top_anchors`` (its ten most frequent anchors, each with the share of
windows it anchors), ``examples`` (its top examples: ``query examples --layer L --head H``, each with the
text around it). The example window is computed on demand (``example``).
"""

from __future__ import annotations

from headatlas.service.metrics import METRICS
from headatlas.service.reports import distance_queries, queries, query_support, role_rules, role_tests, roles
from headatlas.service.reports.columns import PROBE_COLUMNS
from headatlas.service.reports.intervals import interval_note, scheme_of
from headatlas.service.reports.report import split_anchors
from headatlas.service.storage.store import Run
from headatlas.service.web import charts
from headatlas.service.web.context import Ctx, NotFound, run_path
from headatlas.service.web.documents import records, with_scheme
from headatlas.service.web.examples import head_examples
from headatlas.service.web.examples import records as example_records
from headatlas.service.web.examples import section as examples_section
from headatlas.service.web.html import e, interval, num, table
from headatlas.service.web.own_text import head_section
from headatlas.service.web.run_page import heads_of, run_roles
from headatlas.service.web.views import View

N_ANCHORS = 10
EFFECT_PREFIXES = ("effect_", "importance")  # SPEC §9's columns, where the run measured them


def check_head(run: Run, layer: int, head: int) -> None:
    """The head of the address exists in the run (``operations.runs.check_layer_head``): a path
    naming none is an address of nothing (404), not a bad parameter."""
    from headatlas.service.errors import ParameterError
    from headatlas.service.operations.runs import check_layer_head

    try:
        check_layer_head(run, layer, head)
    except ParameterError:
        raise NotFound(
            f"run {run.run_id} ({run.name}) has no layer {layer}, head {head}: its layers are 0..{run.n_layers - 1} "
            f"and its heads 0..{run.n_heads - 1} (0-based)"
        ) from None


def head_view(ctx: Ctx, ref: str, layer: int, head: int) -> View:
    run = ctx.run(ref)
    check_head(run, layer, head)
    r = run.run_id
    # the run's rows, read once for all its heads (and the run page), the head's picked out
    columns, rows = heads_of(ctx, run)
    mine = [row for row in rows if (row[0], row[1]) == (layer, head)]
    role_cols, role_rows = run_roles(ctx, run)
    my_roles = [row for row in role_rows if (row[0], row[1]) == (layer, head)]
    dist = ctx.run_query(
        run, ("distances", layer, head), lambda c: distance_queries.distances(c, r, layer=layer, head=head, ci=True)
    )
    named = ctx.run_query(run, ("anchors", N_ANCHORS), lambda c: queries.heads(c, r, anchors=N_ANCHORS))
    anchor_text = next((row[named[0].index("top_anchors")] for row in named[1] if row[:2] == (layer, head)), None)
    anchors = split_anchors(anchor_text) if anchor_text else []
    scheme = [scheme_of(run.params)]
    top = head_examples(ctx, run, layer, head)

    def data() -> dict:
        return {
            "run": ctx.run_row(run),
            "layer": layer,
            "head": head,
            "metrics": records(columns, mine),
            "roles": records(*with_scheme(role_cols, my_roles, scheme)),
            "distances": records(*dist),
            "top_anchors": anchors,
            "examples": example_records(top),
        }

    metrics = dict(zip(columns, mine[0])) if mine else {}

    def body() -> str:
        return "".join(
            [
                _nav(ctx, run, layer, head),
                _roles(role_cols, my_roles),
                _anchors(anchors),
                examples_section(top),
                _example(ctx, run, layer, head),
                head_section(ctx, run, layer, head),
                _distances(dist),
                _metrics(metrics, run),
                _effects(metrics),
            ]
        )

    crumbs = [(f"run {r}", ctx.url(run_path(run)) + "#atlas"), (f"layer {layer}, head {head}", ctx.request.path)]
    return View(f"Run {r} ({run.name}): layer {layer}, head {head}", data, body, crumbs=crumbs)


def _nav(ctx: Ctx, run: Run, layer: int, head: int) -> str:
    order = [(l, h) for l in range(run.n_layers) for h in range(run.n_heads)]
    k = order.index((layer, head))
    links = []
    if k > 0:
        links.append(
            f'<a href="{e(ctx.url(run_path(run, "heads", *order[k - 1])))}">← layer {order[k - 1][0]}, head {order[k - 1][1]}</a>'
        )
    links.append(f'<a href="{e(ctx.url(run_path(run)))}#atlas">the atlas</a>')
    if k + 1 < len(order):
        links.append(
            f'<a href="{e(ctx.url(run_path(run, "heads", *order[k + 1])))}">layer {order[k + 1][0]}, head {order[k + 1][1]} →</a>'
        )
    return f'<p class="pager">{" · ".join(links)}</p>'


def _roles(columns: list[str], rows: list[tuple]) -> str:
    ri = columns.index("role")
    if not rows or all(r[ri] == role_rules.NONE for r in rows):
        return (
            '<h2 id="roles">Roles</h2><p>None established: no role\'s test rejects after Holm–Bonferroni (SPEC §7).</p>'
        )
    shown = [
        c
        for c in columns
        if c not in ("layer", "head", "family")
        and not (c.startswith("probe") and all(r[columns.index(c)] is None for r in rows))
    ]
    return (
        f'<h2 id="roles">Roles</h2>{table(columns, rows, shown=shown, text_columns=("role", "metric", "test", "rule"))}'
        f'<p class="muted">{e(role_tests.ROLES_NOTE)}. {e(roles.STABILITY_NOTE)}</p>'
    )


def _metrics(metrics: dict, run: Run) -> str:
    if not metrics:
        return "<p>No statistics stored for this head yet.</p>"
    rows = []
    for m in METRICS:
        cols = [c for c in m.columns if c.name in metrics]
        for k, c in enumerate(cols):
            value, lo, hi = metrics[c.name], metrics.get(f"{c.name}_lo"), metrics.get(f"{c.name}_hi")
            ci = f'<span class="ci">{interval(lo, hi)}</span>' if lo is not None else ""
            lead = (
                f'<th rowspan="{len(cols)}" class="text">{e(m.name)}<br><span class="muted">SPEC {e(m.spec)}'
                + (f"; against {e(m.against)}" if m.against else "")
                + "</span></th>"
                if k == 0
                else ""
            )
            rows.append(
                f'<tr data-metric="{e(c.name)}">{lead}<td class="text"><code>{e(c.name)}</code></td>'
                f'<td>{num(value)}{ci}</td><td class="text">{e(c.definition)}</td></tr>'
            )
    probes = [(p, metrics.get(p)) for p in PROBE_COLUMNS if metrics.get(p) is not None]
    for k, (p, v) in enumerate(probes):
        lead = (
            f'<th rowspan="{len(probes)}" class="text">probe<br><span class="muted">SPEC §8</span></th>'
            if k == 0
            else ""
        )
        rows.append(
            f'<tr data-metric="{e(p)}">{lead}<td class="text"><code>{e(p)}</code></td><td>{num(v)}</td><td class="text">on repeated random tokens, one probe per run: no interval</td></tr>'
        )
    note = interval_note([scheme_of(run.params)])
    return (
        '<h2 id="metrics">Metrics</h2><div class="table-wrap"><table class="data metrics" id="metrics-table"><thead><tr>'
        '<th class="text">metric</th><th class="text">column</th><th>value [95% interval]</th><th class="text">definition</th>'
        f'</tr></thead><tbody>{"".join(rows)}</tbody></table></div><p class="muted">{e(note)} {e(query_support.LIFT_NOTE)}</p>'
    )


def _effects(metrics: dict) -> str:
    found = [(c, v) for c, v in metrics.items() if c.startswith(EFFECT_PREFIXES) and not c.endswith(("_lo", "_hi"))]
    measured = [(c, v) for c, v in found if v is not None]
    if not measured:
        return (
            '<h2 id="effect">Effect</h2><p class="muted">Not measured for this run: what the model loses without the '
            "head is measured by <code>headatlas effects</code> (SPEC §9).</p>"
        )
    rows = "".join(
        f"<tr><td class=text><code>{e(c)}</code></td><td>{num(v)}"
        f'<span class="ci">{interval(metrics.get(c + "_lo"), metrics.get(c + "_hi"))}</span></td></tr>'
        for c, v in measured
    )
    return (
        f'<h2 id="effect">Effect</h2><table class="data"><tbody>{rows}</tbody></table>'
        '<p class="muted">O(ablated) − O(intact), the model\'s own objective, with its 95% interval (SPEC §9).</p>'
        + _streaming(metrics)
    )


def _streaming(metrics: dict) -> str:
    """What ``effect_streaming`` restricted (S, W) and the attention mass beyond them (SPEC §10)."""
    if metrics.get("effect_streaming") is None:
        return ""
    beyond = metrics.get("streaming_beyond")
    return (
        f'<p class="muted" id="streaming">effect_streaming: O with this head\'s KV head streaming − O(intact), '
        f"keeping S = {num(metrics.get('streaming_sink'))} sinks and W = {num(metrics.get('streaming_recent'))} "
        f"recent keys, for every query head of its KV head (SPEC §10); its attention mass beyond them "
        f"{num(beyond)} {interval(metrics.get('streaming_beyond_lo'), metrics.get('streaming_beyond_hi'))}.</p>"
    )


def _anchors(anchors: list[str]) -> str:
    if not anchors:
        return ""
    chips = "".join(f'<span class="chip anchor">{e(a)}</span>' for a in anchors)
    return (
        f'<h2 id="anchors">Anchors</h2><p>{chips}</p><p class="muted">The anchor of a window is the token that appears '
        "most often in the head's high-similarity pairs; each with the share of windows it anchors.</p>"
    )


def _distances(dist: query_support.Rows) -> str:
    columns, rows = dist
    if not rows:
        return ""
    at = {c: i for i, c in enumerate(columns)}
    last = max((r[0] for r in rows if (r[at["high_pairs"]] or 0) > 0), default=rows[-1][0])
    rows = [r for r in rows if r[0] <= last]
    tips = [
        f"d = {r[0]}: share {num(r[at['share']])} {interval(r[at.get('share_lo', 0)], r[at.get('share_hi', 0)]) if 'share_lo' in at else ''}; "
        f"chance {num(r[at['chance_share']])}; lift {num(r[at['lift']])}"
        + (f" {interval(r[at['lift_lo']], r[at['lift_hi']])}" if "lift_lo" in at else "")
        for r in rows
    ]
    chart = charts.bar_chart(
        [r[0] for r in rows],
        [r[at["share"]] for r in rows],
        [r[at["chance_share"]] for r in rows],
        tips,
        x_label="token distance j − i",
        y_label="share of pairs",
        bar_name="this head's similar pairs",
        mark_name="chance: all pairs",
    )
    return (
        f'<h2 id="distances">Distances against chance</h2><figure>{chart}<figcaption>Share of the head\'s '
        "high-similarity pairs at each distance (bars) against the share of all pairs of the windows at that "
        "distance (line); hover a distance for its share, interval and lift.</figcaption></figure>"
    )


def _example(ctx: Ctx, run: Run, layer: int, head: int) -> str:
    window = ctx.number("window", minimum=0) or 0
    src = ctx.url(run_path(run, "heads", layer, head, "example.json"), window=window)
    windows = ctx.run_row(run)["windows"]
    pager = []
    if window > 0:
        pager.append(f'<a href="{e(ctx.here(window=window - 1))}#example">← window {window - 1}</a>')
    if window + 1 < windows:
        pager.append(f'<a href="{e(ctx.here(window=window + 1))}#example">window {window + 1} →</a>')
    return (
        f'<h2 id="example-window">Example window {window} of {windows:,}</h2><p class="pager">{" · ".join(pager)}</p>'
        f'<div id="example" class="example" data-src="{e(src)}"><p class="computing">computing the window with '
        f"{e(run.model_name)} …</p></div>"
        '<p class="muted">Left: the context similarity matrix C = z zᵀ (C<sub>ii</sub> = 0) of this head on the window, '
        "its high-similarity pairs H outlined; right: its attention map (rows: queries). Computed on demand with "
        "the run's model and parameters, on the window as the run analysed it; hover a cell for its tokens.</p>"
    )
