"""One self-contained HTML page about a run: parameters, figures, the head table, anchors.

Images are embedded as base64 PNG data URIs and the style is inline: the file opens anywhere,
offline, and can be mailed as it is. Numbers come from ``service.reports.queries`` (the same as
``headatlas query …``); figures from ``service.reports.plots``.
"""

from __future__ import annotations

import base64
import html
import math
from datetime import datetime, timezone
from pathlib import Path

from headatlas.service.metrics import chance_centre
from headatlas.service.reports import mixing_queries, queries, query_support
from headatlas.service.reports.columns import head_table
from headatlas.service.wording import seconds

HEAD_METRICS = (
    "within_sentence_lift_dm",
    "repetition_words_lift_dm",
    "mean_distance",
    "noise_share",
    "attn_to_punct_lift",
    "anchor_frequency_share",
)
HEAD_TABLE_SKIP = ("top_anchors", "interval_by")  # anchors: their own section; the scheme: the note
N_ANCHORS = 5

PARAM_HELP = {
    "replicates": "replicate groups of the 95% intervals (document, block:B; none recorded: by window, SPEC §5d)",
    "seq_len": "tokens per window, its specials included ([CLS] and [SEP]; a decoder's BOS)",
    "windowing": "chunks: cover each document; first: one window per document",
    "sentences": "how sentence ids are assigned (segmenter: a sentence-boundary library; punct: . ! ? end a sentence)",
    "select": "the high-similarity set H: top:Q share of pairs, ratio:R of the maximum, topk:K",
    "gate": "a pair is attended when A_ij ≥ gate / k_i or A_ji ≥ gate / k_j (k_i: keys row i sees; n for an encoder)",
    "include_special": "whether the specials ([CLS]/[SEP]; a decoder's BOS) form pairs",
    "vectors": "pre_wo: head output before the output projection; post_wo: after",
    "short_range": "largest distance counted in short_range_share",
    "dtype": "model precision (statistics are computed in float32)",
    "control_of": "this run is a random-weights control (same config and tokenizer) of the run with this key",
    "control_seed": "the seed of this control's random weights (runs stored before several controls: 0)",
}

STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2rem auto; max-width: 1400px;
       padding: 0 1.5rem; color: #222; background: #fff; }
.ci { color: #777; font-size: .75rem; white-space: nowrap; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; } h2 { margin-top: 2.2rem; border-bottom: 1px solid #ddd; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; font-size: .82rem; max-width: 100%; }
th, td { border: 1px solid #ddd; padding: .25rem .45rem; text-align: right; vertical-align: top; }
th { background: #f3f3f3; position: sticky; top: 0; } td.text, th.text { text-align: left; }
/* text wraps between words: "anywhere" let a squeezed column break a role mid-word ("establis hed");
   break-word breaks only a word longer than its column can be, and the table scrolls instead */
td.text { overflow-wrap: break-word; }
/* names (a role, a metric) stay whole: not even broken after a hyphen */
td.name { white-space: nowrap; }
/* tables grow with the page (no box of their own to scroll in); only a table wider than the page,
   the folded one of every column, scrolls sideways */
.scroll { overflow-x: auto; }
details > summary { cursor: pointer; color: #444; margin: .6rem 0; }
@media print { .scroll { overflow: visible; } details { display: none; } table { font-size: .7rem; } }
figure { margin: 1rem 0 2rem; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: .9rem; }
.kv td:first-child { text-align: left; font-weight: 600; } .kv td { text-align: left; }
/* the anchor grid: its columns share the page's width, and a long token wraps in its cell */
table.anchors { table-layout: fixed; width: 100%; font-size: .75rem; }
.anchors td { text-align: left; vertical-align: top; overflow-wrap: anywhere; }
.anchors th:first-child { width: 3.2rem; }
footer { margin-top: 3rem; color: #777; font-size: .85rem; }
"""


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def _num(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return _e(value)


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{data}">'


def _table(columns, rows, *, text_columns=(), name_columns=()) -> str:
    """An HTML table; a column ``x`` with ``x_lo``/``x_hi`` beside it shows its 95% interval
    under the value, in the same cell. ``name_columns``: text columns of names, never wrapped."""
    index = {c: i for i, c in enumerate(columns)}
    shown = [c for c in columns if not (c.endswith(("_lo", "_hi")) and c[:-3] in index)]
    head = "".join(
        f'<th class="text">{_breakable(c)}</th>' if c in text_columns else f"<th>{_breakable(c)}</th>" for c in shown
    )
    body = []
    for row in rows:
        cells = []
        for c in shown:
            v = row[index[c]]
            if c in text_columns:
                cells.append(f'<td class="text{" name" if c in name_columns else ""}">{_e(v)}</td>')
                continue
            lo, hi = index.get(f"{c}_lo"), index.get(f"{c}_hi")
            interval = (
                f'<br><span class="ci">[{_num(row[lo])}, {_num(row[hi])}]</span>'
                if lo is not None and row[lo] is not None
                else ""
            )
            cells.append(f"<td>{_num(v)}{interval}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _breakable(name: str) -> str:
    """A column name that may wrap after its underscores (``within_sentence_lift_dm`` is one word
    to a browser: its column was as wide as the name)."""
    return "_<wbr>".join(_e(part) for part in str(name).split("_"))


def build_report(conn, run, *, snapshot: int | None = None) -> str:
    """The report page of ``run`` (a store ``Run``) as an HTML string; ``snapshot``: the lake's
    snapshot it was read at (named on the page, so that `--at` reproduces it)."""
    from headatlas.service.reports import plots
    from headatlas.service.reports.intervals import groups_held, interval_note, scheme_of

    summary = queries.run_summary(conn, run.run_id)
    head_cols, head_rows = queries.heads(conn, run.run_id, anchors=N_ANCHORS, ci=True)
    # the footnote under every interval names the run's replicate scheme (SPEC §5d)
    scheme_html = _e(interval_note([scheme_of(run.params)], [groups_held(conn, run.run_id)]).removeprefix("[a, b]: "))
    warning = query_support.interval_warning(conn, run.run_id)  # too few replicate groups (SPEC §5d)
    scheme_html += f" <strong>Warning: {_e(warning)}.</strong>" if warning else ""
    figures = [
        (
            "layers",
            "Layer progression: distances, sentence structure, repetition, noise and attention targets per layer.",
            plots.run_figure("layers", conn, run),
        ),
        (
            "distances",
            "Token distance of the high-similarity pairs per layer against the chance profile of all "
            "pairs (log scales).",
            plots.run_figure("distances", conn, run),
        ),
        (
            "boundaries",
            "Share of high-similarity pairs within one sentence per layer, against two chances: all "
            "pairs of the windows, and pairs at the same distances as the layer's high-similarity "
            "pairs (short-range pairs share a sentence anyway); attention to separators against "
            "uniform attention. Error bars: 95% intervals.",
            plots.run_figure("boundaries", conn, run),
        ),
    ]
    for metric in HEAD_METRICS:
        figures.append(
            (
                f"heads: {metric}",
                f"{metric} per head (layer × head)."
                + (" Diverging colours centred on 1 = chance (white)." if chance_centre(metric) is not None else ""),
                plots.run_figure("heads", conn, run, metric=metric),
            )
        )
    figure_html = "".join(
        f"<figure>{_img(plots.png_bytes(fig), name)}<figcaption>{_e(caption)}</figcaption></figure>"
        for name, caption, fig in figures
    )
    atlas_html = _atlas_section(conn, run) + probe_section(conn, run)
    floor_html = _floor_section(conn, run)
    mixing_html = _mixing_section(conn, run)
    from headatlas.service.reports.effect_report import effects_section

    effects_html = effects_section(conn, run, table=_table, img=_img)

    facts = [
        ("run", f"{run.run_id} ({run.name})"),
        ("status", run.status),
        ("model", f"{run.model_name} [{run.model}]"),
        ("shape", f"{run.n_layers} layers × {run.n_heads} heads, head size {run.d_head}"),
        ("corpus", run.corpus),
        ("corpus fingerprint", run.corpus_fingerprint),
        ("windows", f"{summary.get('windows', 0):,}"),
        ("engine", f"{run.engine} on {run.device or '?'}"),
        ("created", run.created_at),
        ("finished", run.finished_at),
        ("compute", f"{seconds(run.compute_s)} s"),
        ("wall time", f"{run.wall_s:.1f} s"),
    ]
    if snapshot is not None:
        facts.append(
            ("snapshot", f"{snapshot} (the lake's state read; `headatlas report --at {snapshot}` reads it again)")
        )
    if run.error:
        facts.append(("error", run.error))
    facts_html = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in facts)
    params_html = "".join(
        f"<tr><td>{_e(k)}</td><td>{_e(v)}</td><td>{_e(PARAM_HELP.get(k, ''))}</td></tr>" for k, v in run.params.items()
    )

    keep = [i for i, c in enumerate(head_cols) if c not in HEAD_TABLE_SKIP]
    n_every = sum(not head_cols[i].endswith(("_lo", "_hi")) for i in keep)
    every_html = _table([head_cols[i] for i in keep], [tuple(r[i] for i in keep) for r in head_rows])
    # the head table on the page: the measures a reader ranks heads by (as the web page's), each with
    # its interval below (the 40-odd columns of `query heads` ran off the page; they follow, folded)
    shown = head_table(among=head_cols, rows=head_rows)
    main = [i for i, c in enumerate(head_cols) if c in shown or c.removesuffix("_lo").removesuffix("_hi") in shown]
    table_html = _table([head_cols[i] for i in main], [tuple(r[i] for i in main) for r in head_rows])
    anchors_html = _anchor_grid(head_cols, head_rows, run.n_layers, run.n_heads)
    generated = datetime.now(timezone.utc).isoformat(timespec="seconds")
    title = f"headatlas · run {run.run_id} ({run.name})"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>
<body>
<h1>{_e(title)}</h1>
<p class="sub">{_e(run.model_name)} · {summary.get("windows", 0):,} windows · layers and heads are counted from 0
(the papers count from 1: their “layer 11, head 8” is layer 10, head 7 here).</p>
{atlas_html}
<h2>Run</h2><table class="kv"><tbody>{facts_html}</tbody></table>
<h2>Parameters</h2><table class="kv"><thead><tr><th class="text">parameter</th><th class="text">value</th>
<th class="text">meaning</th></tr></thead><tbody>{params_html}</tbody></table>
{floor_html}
{effects_html}
<h2>Figures</h2>{figure_html}
{mixing_html}
<h2>Heads</h2>
<p>One row per head. Shares are of the high-similarity pairs H. What each ratio is measured against:
<em>_lift</em> = share / <em>_chance</em>, the same share over all pairs of the windows (it ignores distance,
so a head that keeps to short range looks sentence-bound); <em>_lift_dm</em> = share / <em>_chance_dm</em>, the
share expected of pairs at the head's own distances — structure beyond locality; <em>repetition_words</em>
counts repeats of word tokens only (no <code>,</code>–<code>,</code>); <em>attn_to_*_lift</em> = attention /
what uniform attention would give; <em>anchor_frequency_share</em> = share of windows whose anchor is simply the
window's most frequent token; <em>noise_share</em> = similar pairs the head does not attend.
Under each value: its {scheme_html} Read a lift as established only when its interval excludes 1; the choice
of <code>select</code> and <code>gate</code> is this tool's default, not the paper's.</p>
<div class="scroll">{table_html}</div>
<details><summary>Every column of <code>headatlas query heads</code> ({n_every}; wide: scroll sideways)</summary>
<div class="scroll">{every_html}</div></details>
<h2>Top anchor tokens per head</h2>
<p>The anchor of a window is the token that appears most often in the head's high-similarity pairs; each cell
lists the {N_ANCHORS} most frequent anchors with the share of windows they anchor.</p>
<div class="scroll">{anchors_html}</div>
<footer>Generated by headatlas on {_e(generated)} from {_e(Path(run.corpus).name)}.</footer>
</body></html>
"""


def _atlas_section(conn, run) -> str:
    """The head atlas (SPEC §7): the role grid, heads per role with their stability, and each
    role's evidence."""
    from headatlas.service.reports import atlas_plots, attention_kind, plots, role_rules, role_tests, role_views, roles

    columns, rows = roles.roles(conn, run.run_id, stability=True)
    causal = attention_kind.causal_run(conn, run.run_id)
    offered = role_rules.offered_roles(causal)
    fig, _ = atlas_plots.run_atlas(conn, run)  # as `plot atlas` draws it: coloured by the strongest evidence held
    counts, stable = role_views.role_counts(columns, rows, offered), role_views.stable_counts(columns, rows) or {}
    # the rules this run was tested with (a role's threshold may differ for causal runs)
    rules = {r.role: r.rule for r in role_rules.rules_for(causal)}
    count_html = _table(
        ["role", "heads", "stable", "rule"],
        [(r, n, stable.get(r), rules.get(r, "")) for r, n in counts.items()],
        text_columns=("role", "rule"),
        name_columns=("role",),
    )
    evidence_html = _table(
        columns, rows, text_columns=("role", "metric", "test", "rule"), name_columns=("role", "metric")
    )
    family = role_views.family_size(columns, rows)
    tested = (
        f"Holm–Bonferroni over the run's {family} (head, role) tests"
        if family
        else "no correction: this run has no replicate groups, so each value was tested against its threshold"
    )
    from headatlas.service.reports.intervals import groups_held, interval_note, scheme_of

    note = interval_note([scheme_of(run.params)], [groups_held(conn, run.run_id)]).replace("[a, b]", "Intervals")
    return f"""<h2>Head atlas</h2>
<figure>{_img(plots.png_bytes(fig), "head atlas")}<figcaption>Each cell names its head's primary role (the most specific
role it holds; +n: the other roles it holds), coloured by the strongest evidence the run holds: what removing the head
costs (effect_mean, else effect_zero) where effects were measured, else the primary role's value over its threshold.
A role is earned when its one-sided test (H0: metric ≤ threshold, t from the
jackknife's standard error, R − 1 degrees of freedom) rejects at α = {role_tests.ALPHA:g} after {_e(tested)} (SPEC §7).
Faded cells, words in italic: unsure, a role that does not hold on both halves of the replicate groups (alternate
groups in id order) or whose interval reaches its threshold, an effect whose interval includes 0.
Lifts marked _dm are against distance-matched chance, attn_*_lift against uniform attention.</figcaption></figure>
<h3>Heads per role</h3>{count_html}
<h3>Roles and their evidence</h3><p>One row per (head, role): the metric, its value and 95% interval, the threshold,
p and the Holm-adjusted p (family: the number of tests), and whether it holds on each half (half_a: the 1st, 3rd, … groups in id order,
half_b: the 2nd, 4th, …; stable: both). {_e(note)}</p>
<div class="scroll">{evidence_html}</div>"""


PROBE_TOP = 10  # heads listed per score in the probe section


def probe_section(conn, run) -> str:
    """The synthetic probe (SPEC §8p), for a run that has one: the heads with the highest score of
    each kind, with all three scores, and where the induction role (SPEC §7) reads it."""
    from sqlalchemy import text

    from headatlas.service.reports import attention_kind, role_rules

    probe = conn.execute(
        text(
            "SELECT layer, head, induction_score, duplicate_score, prev_token_score, length, sequences, seed "
            "FROM probe_scores WHERE run_id = :r"
        ),
        {"r": run.run_id},
    ).all()
    if not probe:
        return ""
    length, sequences, seed = probe[0][5:8]
    columns = ["layer", "head", "induction_score", "duplicate_score", "prev_token_score"]
    parts = []
    for k, score in enumerate(columns[2:], start=2):
        top = sorted(probe, key=lambda r: (-r[k], r[0], r[1]))[:PROBE_TOP]
        parts.append(f"<h3>Top {len(top)} heads by {_e(score)}</h3>" + _table(columns, [tuple(r[:5]) for r in top]))
    causal = attention_kind.causal_run(conn, run.run_id)
    # uniform attention's score: 1/k_i averaged over the second copy's rows (SPEC §8p; a first token at 0)
    rows = range(1 + length, 1 + 2 * length)
    uniform = sum(1 / (i + 1) for i in rows) / length if causal else 1 / (2 * length + 2)
    reads = (
        f"The induction role needs induction_lift on the corpus and induction_score ≥ {role_rules.INDUCTION_PROBE_MIN:g} "
        "here (duplicate-token likewise with duplicate_score); see the atlas above for the heads that earned them."
        if causal
        else "An encoder is offered no induction role: its attention sees the whole window, so these scores "
        "describe the heads, they earn nothing."
    )
    return f"""<h2>Induction probe</h2>
<p>Every head scored on {sequences} sequences of {length} random ordinary tokens repeated once (seed {seed}; SPEC §8p):
<em>induction_score</em> = mean attention from a token of the second copy to the token after its earlier copy,
<em>duplicate_score</em> = to the earlier copy itself, <em>prev_token_score</em> = to the token before. An exact
head of each kind scores 1; uniform attention {uniform:.3g} (1/k over the second copy's rows). One probe per
run: no interval. {_e(reads)}</p>
{"".join(parts)}"""


def _floor_section(conn, run) -> str:
    """Against the run's random-weights control, when it was analysed with --control."""
    from headatlas.service.reports import atlas_plots, compare, plots

    control = compare.control_of(conn, run)
    if control is None:
        return ""
    fig = atlas_plots.run_compare(conn, run, control)
    columns, rows = compare.compare(conn, run, control)
    from headatlas.service.reports.intervals import groups_held, interval_note, scheme_of

    scheme_note = interval_note(
        [scheme_of(run.params), scheme_of(control.params)],
        [groups_held(conn, run.run_id), groups_held(conn, control.run_id)],
    ).replace("[a, b]", "Intervals")
    keep = [c for c in columns if c not in ("head", "depth_a", "depth_b", "interval", "interval_by")]
    idx = [columns.index(c) for c in keep]
    table_html = _table(keep, [tuple(r[i] for i in idx) for r in rows], text_columns=("metric", "verdict"))
    return f"""<h2>Against the random-weights control (the floor)</h2>
<p>Run {_e(control.run_id)} ({_e(control.name)}): the same windows through {_e(control.model_name)}. Whatever a
randomly initialised model of the same shape also shows is architecture and tokens, not training: the floor every
claim should beat. difference = this run − control; verdict <em>beyond</em> = the difference's 95% interval (paired
jackknife over the shared replicate groups) excludes 0. {_e(scheme_note)}</p>
<figure>{_img(plots.png_bytes(fig), "compare with control")}<figcaption>Layer profiles of this run and its control
with 95% intervals; last panel: per-head difference of the first metric.</figcaption></figure>
<div class="scroll">{table_html}</div>"""


def mixing_methods(conn, run) -> list[str]:
    """The mixing methods the run holds, in display order (empty: no mixing measures)."""
    from sqlalchemy import text

    stored = {
        r[0]
        for r in conn.execute(text("SELECT DISTINCT method FROM mixing_stats WHERE run_id = :r"), {"r": run.run_id})
    }
    return [m for m in mixing_queries.METHOD_ORDER if m in stored]


def _mixing_section(conn, run) -> str:
    """Mixing measures (SPEC §6), only for runs that hold them: where each layer's outputs draw
    from per method, and how far each method is from the heads' attention."""
    from headatlas.service.reports import mixing_plots, plots

    methods = mixing_methods(conn, run)
    others = [m for m in methods if m != "attention"]
    if not others:
        return ""
    mixing_fig = mixing_plots.run_mixing(conn, run)
    parts = [
        f"""<h2>Mixing: attention against {_e(", ".join(others))}</h2>
<p>What each output token is made of, measured {len(methods)} ways on the run's first windows (SPEC §6): attention
weights, and {_e(", ".join(others))}. Shares are means over rows (one row per output token); they are proportions of
the row's mass, not lifts.</p>
<figure>{_img(plots.png_bytes(mixing_fig), "mixing per layer")}<figcaption>Per layer (layer-level rows): mass to the
token itself, its neighbours, [CLS]/[SEP] and . ,; one line per method.</figcaption></figure>"""
    ]
    for method in others:
        fig, _ = mixing_plots.run_discrepancy(conn, run, method=method)
        columns, rows = mixing_queries.discrepancy_layers(conn, run.run_id, method=method)
        parts.append(f"""<h3>Attention against {_e(method)}</h3>
<figure>{_img(plots.png_bytes(fig), f"discrepancy {method}")}<figcaption>Jensen–Shannon divergence (bits: 0 = the
same distribution, 1 = disjoint) between each head's attention rows and its {_e(method)} rows, per head and per
layer.</figcaption></figure>
<div class="scroll">{_table(columns, rows)}</div>""")
    return "".join(parts)


def _anchor_grid(columns, rows, n_layers: int, n_heads: int) -> str:
    layer_i, head_i, anchors_i = columns.index("layer"), columns.index("head"), columns.index("top_anchors")
    cells = {(r[layer_i], r[head_i]): r[anchors_i] for r in rows}
    head = "<th>layer</th>" + "".join(f"<th>head {h}</th>" for h in range(n_heads))
    body = []
    for layer in range(n_layers):
        tds = "".join(
            "<td>" + "<br>".join(_e(a) for a in split_anchors(cells.get((layer, h)))) + "</td>" for h in range(n_heads)
        )
        body.append(f"<tr><th>{layer}</th>{tds}</tr>")
    return f'<table class="anchors"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def split_anchors(text: str | None) -> list[str]:
    """``"the 30%, , 12%"`` → ``["the 30%", ", 12%"]``: every item ends in ``%`` and a word
    piece holds no space, so ``"%, "`` only ever separates items (the token may be a comma)."""
    if not text:
        return ["–"]
    parts = text.split("%, ")
    return [p + "%" for p in parts[:-1]] + [parts[-1]]


def write_report(conn, run, out: str | Path, *, snapshot: int | None = None) -> Path:
    """Write the report to ``out``; a folder gets ``report.html`` in it (as ``cp FILE DIR`` does)."""
    from headatlas.service.errors import ParameterError

    path = Path(out)
    if path.is_dir():
        path = path / "report.html"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(build_report(conn, run, snapshot=snapshot), encoding="utf-8")
    except OSError as exc:
        raise ParameterError(f"--out {out}: cannot write {path} ({exc.strerror}); pass a writable file path") from None
    return path
