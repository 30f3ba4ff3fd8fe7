"""Figures a reader can read: nothing cut at an edge, every axis labelled, plain tick labels on
log scales, round colour-bar ticks, no noisy tail, role words that fit their cells, a head table that
fits the page. Drawn from a small real run of a tiny random model (fast) and from hand-built rows;
the checks are tests/figure_checks.py's."""

from __future__ import annotations

import numpy as np
import pytest

from tests.figure_checks import (
    analyse,
    check_axis_labels,
    check_plain_ticks,
    check_right_axes_labelled,
    check_round_ticks,
    check_text_inside,
    corpus_of,
    html_table_widths,
)

PAGE_PX = 1400 - 2 * 24  # the report's body: max-width 1400px, padding 1.5rem a side


@pytest.fixture(scope="module")
def stored(tmp_path_factory, tiny_model, demo_corpus):
    folder = tmp_path_factory.mktemp("readable")
    db = folder / "results.duckdb"
    run = analyse(corpus_of(demo_corpus, folder, slice(0, 3), "three"), db, tiny_model, name="three")
    assert run.status == "done"
    return db, run


@pytest.fixture()
def conn(stored):
    from headatlas.service.storage.store import Store

    with Store(stored[0]).checked_read() as connection:
        yield connection


def test_inspect_of_a_short_text_keeps_its_titles_and_labels_its_axes(tiny_model):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.reports import matrix_plots
    from headatlas.service.reports.inspection import inspect_text

    insp = inspect_text(tiny_model, "The cat sat on the mat. It was happy.", build_params())
    assert len(insp.tokens) < 20  # short: the narrowest panels
    fig = matrix_plots.figure_head(insp, 1, 2)
    check_text_inside(fig)
    csm_ax, attn_ax = fig.axes[:2]  # then their colour bars
    for ax in (csm_ax, attn_ax):
        check_axis_labels(ax)
    assert "context similarity" in csm_ax.get_title() and "attention" in attn_ax.get_title()


def test_boundaries_by_distance_reads_plainly_and_stops_before_the_noise(conn, stored):
    from headatlas.service.reports import distance_queries, plots

    run = stored[1]
    fig = plots.run_figure("boundaries", conn, run, by_distance=True)
    share_ax, lift_ax = fig.axes
    check_text_inside(fig)
    for ax in (share_ax, lift_ax):
        check_axis_labels(ax)
        assert ax.get_xscale() == "log"
        ticks = check_plain_ticks(ax.xaxis)
        assert ticks[:3] == [1, 2, 5]
    assert lift_ax.get_yscale() == "linear"
    check_plain_ticks(lift_ax.yaxis)
    columns, rows = distance_queries.sentence_by_distance(conn, run.run_id)
    at = {(r[columns.index("layer")], r[columns.index("distance")]): r for r in rows}
    cut = 0
    for ax, kind in ((share_ax, "share"), (lift_ax, "lift")):
        for line in ax.get_lines():
            if not line.get_label().startswith("layer "):
                continue
            layer = int(line.get_label().split()[1])
            for d, y in zip(*line.get_data()):
                if not np.isfinite(y):
                    continue
                r = at[(layer, int(d))]
                pairs = r[columns.index("high_pairs")]
                assert pairs >= plots.MIN_DISTANCE_PAIRS, (layer, d, pairs)
                if kind == "lift":
                    expected = pairs * r[columns.index("within_sentence_chance")]
                    assert expected >= plots.MIN_EXPECTED_PAIRS, (layer, d, expected)
        drawn = sum(int(np.isfinite(line.get_data()[1]).sum()) for line in ax.get_lines()[1:])
        cut += sum(r[columns.index("within_sentence")] is not None for r in rows) - drawn
    assert cut > 0  # the run has a thin tail, and it is not drawn


def test_heads_colour_bar_ticks_are_round_on_both_sides_of_chance():
    from headatlas.service.reports import plots

    values = np.array([[1.11, 1.02, 0.918, 3.44], [2.5, 0.981, 1.64, 2.05], [1.8, 1.21, 0.945, 3.14]])
    rows = [(l, h, float(v)) for (l, h), v in np.ndenumerate(values)]
    fig = plots.figure_heads(
        ["layer", "head", "within_sentence_lift"], rows, "within_sentence_lift", n_layers=3, n_heads=4, title="hand"
    )
    bar = fig.axes[1]
    ticks = [t for t in bar.get_yticks() if values.min() <= t <= values.max()]
    check_round_ticks(ticks)
    assert 1.0 in ticks and min(ticks) < 1 and len([t for t in ticks if t > 1]) >= 3
    check_plain_ticks(bar.yaxis)
    check_right_axes_labelled(fig)
    check_text_inside(fig)


def test_layers_label_every_axis_on_the_right(conn, stored):
    from headatlas.service.reports import plots

    fig = plots.run_figure("layers", conn, stored[1])
    twins = [ax for ax in fig.axes if ax.yaxis.get_label_position() == "right"]
    assert twins  # the anchor-distinctness share has its own axis …
    check_right_axes_labelled(fig)  # … and says what it is
    check_text_inside(fig)


@pytest.mark.parametrize("shape", [(12, 12), (30, 9), (24, 16)])
def test_atlas_names_roles_in_words_that_fit_their_cells(shape):
    """Every role's word (and a second line counting the head's other roles) lies inside its cell,
    in the narrowest cells an atlas draws, coloured by the evidence with unsure cells faded."""
    from headatlas.service.reports import atlas_plots, role_rules, role_tests, roles

    n_layers, n_heads = shape
    columns = [*role_tests.COLUMNS, *roles.STABILITY_COLUMNS]
    at = {c: i for i, c in enumerate(columns)}
    rows = []
    for l in range(n_layers):
        for h in range(n_heads):
            r = [None] * len(columns)
            role = atlas_plots.ATLAS_ROLES[(l + h) % len(atlas_plots.ATLAS_ROLES)]
            r[:4] = [l, h, role, True]
            r[at["value"]], r[at["value_lo"]], r[at["threshold"]] = 1.0 + l + h, 1.0 + l, 1.0
            r[at["stable"]] = bool(h % 2)
            rows.append(tuple(r))
            if role != role_rules.NONE and role != "local":
                rows.append((l, h, "local", False, *r[4:]))
    shade = atlas_plots.evidence_shade(columns, rows, n_layers, n_heads)
    assert shade is not None
    earned = [(r[0], r[1]) for r in rows if r[3] and r[2] != role_rules.NONE]
    assert [shade.values[k] for k in earned] == [1.0 + l + h for l, h in earned]
    fig, _ = atlas_plots.figure_atlas(
        columns, rows, n_layers=n_layers, n_heads=n_heads, title=DECODER_TITLE, shade=shade
    )
    check_text_inside(fig)
    grid = next(ax for ax in fig.axes if ax.get_title())
    renderer = fig.canvas.get_renderer()
    box = grid.get_window_extent(renderer)
    cell_w, cell_h = box.width / n_heads, box.height / n_layers
    words = [t for t in grid.texts if t.get_text()]
    assert {t.get_text().split("\n")[0] for t in words} == {
        w for r, w in atlas_plots.ROLE_WORDS.items() if r != role_rules.NONE
    }
    for text in words:
        ext = text.get_window_extent(renderer)
        assert ext.width <= cell_w - 2 and ext.height <= cell_h - 2, (text.get_text(), ext, cell_w, cell_h)
    assert not [p for p in grid.patches if p.get_hatch()]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[-1].startswith("faded, italic: unsure")
    # the log colour bar names round ratios, not only its decades (a run's often stay under 10×)
    bar = next(ax for ax in fig.axes if ax is not grid)
    assert [t.get_text() for t in bar.get_yticklabels()][:4] == ["1×", "2×", "5×", "10×"]


def test_atlas_of_a_run_with_effects_is_coloured_by_its_effect(tmp_path, tiny_model, demo_corpus):
    """Zero ablation measured (SPEC §9): the atlas's default colour is effect_zero, about 0 (its colour
    bar symmetric), each cell the head's own effect, and the legend says what the colour is."""
    from headatlas.service.reports import atlas_plots, queries
    from headatlas.service.storage.store import Store

    corpus = corpus_of(demo_corpus, tmp_path, slice(0, 1), "one")
    db = tmp_path / "fx.duckdb"
    run = analyse(corpus, db, tiny_model, name="fx", seq_len=32, effects="zero", effect_windows=2, replicates="window")
    with Store(db).checked_read() as conn:
        fig, _ = atlas_plots.run_atlas(conn, run)
        columns, rows = queries.heads(conn, run.run_id)
    grid = next(ax for ax in fig.axes if ax.get_title())
    assert grid.get_title().startswith("effect_zero per head")
    assert fig.legends[0].get_title().get_text().endswith("colour: effect_zero")
    drawn = np.ma.filled(grid.images[0].get_array().astype(float), np.nan)
    at = {c: i for i, c in enumerate(columns)}
    for r in rows:
        assert drawn[r[at["layer"]], r[at["head"]]] == pytest.approx(r[at["effect_zero"]])
    low, high = grid.images[0].get_clim()
    assert low == -high and high == pytest.approx(np.nanmax(np.abs(drawn)))
    check_text_inside(fig)


def test_report_head_table_fits_the_page_and_every_column_stays_reachable(conn, stored):
    from headatlas.service.reports import report

    page = report.build_report(conn, stored[1])
    heads = page[page.index("<h2>Heads</h2>") : page.index("<h2>Top anchor tokens per head</h2>")]
    widths = html_table_widths(heads)
    assert len(widths) == 1 and widths[0] <= PAGE_PX, [round(w) for w in widths]
    # the full head table is there, folded: wider than the page, as the head table used to be
    folded = html_table_widths(heads, skip_folded=False)
    assert len(folded) == 2 and folded[1] > 3 * PAGE_PX
    assert "<details>" in page and "within_<wbr>sentence_<wbr>lift_<wbr>dm" in page


@pytest.mark.parametrize("metric", ["within_sentence_lift_dm", "repetition_words_lift_dm", "induction_lift"])
def test_every_lift_is_drawn_on_a_diverging_map_centred_on_chance(metric):
    """The rule lives in the metric's declaration (metrics.chance_centre): `_lift_dm` and the
    attention lifts are centred on 1 as `_lift` is, with "1 = chance" on the colour bar."""
    from matplotlib import colors

    from headatlas.service import metrics
    from headatlas.service.reports import plots

    assert metrics.chance_centre(metric) == 1.0
    values = np.array([[0.8, 1.4, 2.6], [1.1, 0.95, 3.2]])
    rows = [(l, h, float(v)) for (l, h), v in np.ndenumerate(values)]
    fig = plots.figure_heads(["layer", "head", metric], rows, metric, n_layers=2, n_heads=3, title="hand")
    image = fig.axes[0].images[0]
    assert isinstance(image.norm, colors.TwoSlopeNorm) and image.norm.vcenter == 1.0
    assert image.cmap.name.startswith("RdBu_r")
    assert fig.axes[1].get_ylabel() == f"{metric} (1 = chance)"
    check_text_inside(fig)
    # all above chance: still the diverging map, with chance (1) at its white middle
    rows = [(l, h, float(v) + 1.5) for (l, h), v in np.ndenumerate(values)]
    fig = plots.figure_heads(["layer", "head", metric], rows, metric, n_layers=2, n_heads=3, title="hand")
    norm = fig.axes[0].images[0].norm
    assert norm.vmin + norm.vmax == pytest.approx(2.0)


def test_shares_and_means_are_not_centred_on_chance():
    from headatlas.service import metrics
    from headatlas.service.reports import plots

    for column in ("within_sentence", "within_sentence_chance_dm", "mean_distance", "attn_to_first"):
        assert metrics.chance_centre(column) is None, column
    values = np.array([[0.2, 0.4], [0.6, 0.8]])
    rows = [(l, h, float(v)) for (l, h), v in np.ndenumerate(values)]
    fig = plots.figure_heads(
        ["layer", "head", "within_sentence"], rows, "within_sentence", n_layers=2, n_heads=2, title="t"
    )
    assert fig.axes[0].images[0].cmap.name.startswith("viridis")
    assert "chance" not in fig.axes[1].get_ylabel()


# --- decoders: 30 layers (SmolLM2's depth), BOS not [CLS] ------------------------------------------
DECODER_TITLE = (
    "run 12 (fiction-heldout) · HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised) · "
    "30 layers × 9 heads (0-based)"
)


def test_layers_of_a_30_layer_decoder_keep_their_ticks_apart_and_speak_of_bos():
    from headatlas.service.reports import plots
    from tests.figure_checks import check_ticks_apart, decoder_layer_rows

    columns, rows = decoder_layer_rows(30)
    fig = plots.figure_layers(columns, rows, title=DECODER_TITLE)
    check_text_inside(fig)
    for ax in fig.axes[4:8]:
        labels = check_ticks_apart(ax.xaxis)
        assert labels[0] == "0" and labels[-1] == "29" and 5 <= len(labels) <= 9, labels
    attention = next(ax for ax in fig.axes if ax.get_title() == "attention / uniform attention")
    legend = [t.get_text() for t in attention.get_legend().get_texts()]
    assert legend == ["BOS (first token)", ". ,"], legend
    # an encoder's few layers: every layer labelled, [CLS] and [SEP] as before
    from headatlas.service.reports import layer_queries

    enc_columns = [*layer_queries.LAYER_COLUMNS, "anchor_distinct_share"]
    enc_rows = [(layer, *([1.2] * (len(enc_columns) - 1))) for layer in range(6)]
    fig = plots.figure_layers(enc_columns, enc_rows, title="encoder")
    assert check_ticks_apart(fig.axes[4].xaxis) == [str(i) for i in range(6)]
    attention = next(ax for ax in fig.axes if ax.get_title() == "attention / uniform attention")
    assert [t.get_text() for t in attention.get_legend().get_texts()] == ["[CLS]", "[SEP]", ". ,"]


def test_distances_of_31_layers_get_a_colour_bar_not_31_legend_entries():
    from headatlas.service.reports import plots

    rng = np.random.default_rng(1)
    d = np.arange(1, 60)
    columns = ["distance", "share", "chance_share", "lift"]
    per_layer = {}
    for layer in range(31):
        share = rng.dirichlet(np.ones(len(d)))
        chance = np.full(len(d), 1 / len(d))
        per_layer[layer] = (columns, [(int(a), float(b), float(c), float(b / c)) for a, b, c in zip(d, share, chance)])
    fig = plots.figure_distances(per_layer, title=DECODER_TITLE)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["chance (all pairs)"], legend
    bars = [ax for ax in fig.axes if ax.get_ylabel() == "layer (line colour)"]
    assert len(bars) == 1
    check_text_inside(fig)
    check_right_axes_labelled(fig)
    # a few layers keep their legend entries
    few = plots.figure_distances({k: per_layer[k] for k in range(6)}, title="six")
    assert len(few.axes[0].get_legend().get_texts()) == 7 and len(few.axes) == 2


def test_atlas_and_heads_of_smollm2s_shape_keep_a_long_title_inside():
    from headatlas.service.reports import atlas_plots, plots, role_rules, role_tests

    columns = list(role_tests.COLUMNS)
    filler = [None] * (len(columns) - 4)
    rows = [
        (l, h, "first-token sink" if l > 2 else role_rules.NONE, True, *filler) for l in range(30) for h in range(9)
    ]
    fig, _ = atlas_plots.figure_atlas(
        columns, rows, n_layers=30, n_heads=9, title=DECODER_TITLE, offered=role_rules.offered_roles(True)
    )
    check_text_inside(fig)
    values = np.random.default_rng(2).uniform(0.5, 3, size=(30, 9))
    hrows = [(l, h, float(v)) for (l, h), v in np.ndenumerate(values)]
    fig = plots.figure_heads(
        ["layer", "head", "within_sentence_lift_dm"],
        hrows,
        "within_sentence_lift_dm",
        n_layers=30,
        n_heads=9,
        title=DECODER_TITLE,
    )
    check_text_inside(fig)


def test_query_heads_shows_a_byte_level_runs_anchors_as_text(conn, stored, monkeypatch):
    """The path a byte-level run's rows take (its anchors read as text), on this run's rows: each
    anchor list mapped item by item, the columns and the heads as they were."""
    from headatlas.service.reports import queries

    assert not queries.byte_level_run(conn, stored[1].run_id)  # WordPiece: no Ġ, no Ċ
    plain = queries.heads(conn, stored[1].run_id, anchors=3, ci=True)
    assert {"attn_to_cls_lift", "attn_to_sep_lift", "attn_to_next"} <= set(plain[0])  # an encoder keeps them
    monkeypatch.setattr(queries, "byte_level_run", lambda _conn, _run: True)
    shown = queries.heads(conn, stored[1].run_id, anchors=3, ci=True)
    assert shown[0] == plain[0]
    ai = plain[0].index("top_anchors")
    assert [r[:2] for r in shown[1]] == [r[:2] for r in plain[1]]  # the same heads, in order
    assert [r[ai] for r in shown[1]] == [queries.anchors_as_text(r[ai]) for r in plain[1]]
    assert any(r[ai] for r in shown[1])
