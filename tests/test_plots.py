"""`headatlas plot …`: every figure drawn from a real small run (MiniLM weights), checked as files."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.figure_checks import analyse, check_png, check_svg, corpus_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stored(tmp_path_factory, real_model, demo_corpus):
    folder = tmp_path_factory.mktemp("plots")
    db = folder / "results.duckdb"
    run = analyse(corpus_of(demo_corpus, folder, slice(0, 2), "small"), db, real_model)
    assert run.status == "done"
    return db, run


@pytest.fixture()
def conn(stored):
    from headatlas.service.storage.store import Store

    with Store(stored[0]).checked_read() as connection:
        yield connection


@pytest.mark.parametrize("kind", ["distances", "boundaries", "heads", "layers"])
def test_every_run_figure_renders_as_png_and_svg(kind, conn, stored, tmp_path):
    from headatlas.service.reports import plots

    fig = plots.run_figure(kind, conn, stored[1])
    width, height = plots.RUN_FIGSIZE[kind]
    check_png(plots.save(fig, tmp_path / f"{kind}.png"), (round(width * plots.DPI), round(height * plots.DPI)))
    if kind == "boundaries":  # --dpi scales the pixels, not the layout
        check_png(plots.save(fig, tmp_path / f"{kind}-60.png", dpi=60), (round(width * 60), round(height * 60)))
    check_svg(plots.save(fig, tmp_path / f"{kind}.svg"), (width, height))


def test_heads_heatmap_puts_each_value_at_its_layer_and_head(conn, stored):
    from headatlas.service.reports import plots, queries

    run = stored[1]
    for metric in ("repetition_lift", "mean_distance", "attn_to_punct"):
        columns, rows = queries.heads(conn, run.run_id)
        fig = plots.run_figure("heads", conn, run, metric=metric)
        drawn = np.ma.filled(fig.axes[0].images[0].get_array().astype(float), np.nan)
        assert drawn.shape == (run.n_layers, run.n_heads)
        li, hi, mi = columns.index("layer"), columns.index("head"), columns.index(metric)
        for row in rows:
            expected = row[mi]
            if expected is None or (isinstance(expected, float) and math.isnan(expected)):
                assert math.isnan(drawn[row[li], row[hi]])
            else:
                assert drawn[row[li], row[hi]] == pytest.approx(expected)


def test_distance_lines_are_the_query_rows(conn, stored):
    from headatlas.service.reports import distance_queries, plots

    run = stored[1]
    fig = plots.run_figure("distances", conn, run)
    share_ax = fig.axes[0]
    lines = {line.get_label(): line for line in share_ax.get_lines()}
    for layer in (0, run.n_layers - 1):
        columns, rows = distance_queries.distances(conn, run.run_id, layer=layer)
        x, y = lines[f"layer {layer}"].get_data()
        assert list(x) == [r[columns.index("distance")] for r in rows]
        assert np.allclose(y, [r[columns.index("share")] for r in rows], equal_nan=True)
    chance = lines["chance (all pairs)"].get_ydata()
    assert chance.sum() == pytest.approx(1.0)


def test_unknown_metric_and_format_are_refused(conn, stored, tmp_path):
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import plots

    with pytest.raises(ParameterError, match="--metric 'top_anchors': not a metric here; `headatlas metrics` lists"):
        plots.run_figure("heads", conn, stored[1], metric="top_anchors")
    fig = plots.run_figure("boundaries", conn, stored[1])
    with pytest.raises(ParameterError, match=r"must end in \.png or \.svg"):
        plots.save(fig, tmp_path / "b.jpg")
    assert not (tmp_path / "b.jpg").exists()


def test_plot_command_writes_the_file_and_refuses_bad_options(cli, stored, tmp_path):
    db, run = stored
    out = tmp_path / "fig" / "heads.svg"
    done = cli("plot", "heads", "--run", run.name, "--metric", "repetition_lift", "--out", str(out), "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    check_svg(out, (11, 6.5))
    bad = cli("plot", "heads", "--metric", "nonsense", "--out", str(tmp_path / "x.png"), "--db", str(db))
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error: --metric 'nonsense': not a metric here;")
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "x.png").exists()


def test_distances_split_draws_signal_and_noise_as_stored(conn, stored, tmp_path):
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import distance_queries, plots

    run = stored[1]
    fig = plots.run_figure("distances", conn, run, split="attended")
    width, height = plots.RUN_FIGSIZE["distances"]
    check_png(plots.save(fig, tmp_path / "split.png"), (round(width * plots.DPI), round(height * plots.DPI)))
    check_svg(plots.save(fig, tmp_path / "split.svg"), (width, height))
    for ax, column in zip(fig.axes[:2], ("attended_share", "noise_share")):
        lines = {line.get_label(): line for line in ax.get_lines()}
        for layer in range(run.n_layers):
            columns, rows = distance_queries.distances(conn, run.run_id, layer=layer, split=True)
            x, y = lines[f"layer {layer}"].get_data()
            assert list(x) == [r[columns.index("distance")] for r in rows]
            assert np.allclose(
                y,
                [np.nan if r[columns.index(column)] is None else r[columns.index(column)] for r in rows],
                equal_nan=True,
            )
            assert sum(r[columns.index(column)] or 0 for r in rows) == pytest.approx(1.0)
    with pytest.raises(ParameterError, match="--split 'noise': the only split is 'attended'"):
        plots.run_figure("distances", conn, run, split="noise")


def test_atlas_title_and_legend_name_what_is_coloured(conn, stored):
    """A run without effects is coloured by default by its primary roles' evidence (value over
    threshold, each head's cell its own ratio), the legend saying so in words; ``role`` colours by
    the role; a metric: the title and legend say so, and the legend's role entries carry no role
    colour (the cells no longer have it)."""
    from headatlas.service.reports import atlas_plots, roles

    _, run = stored
    default = atlas_plots.run_atlas(conn, run)[0]
    grid = next(ax for ax in default.axes if ax.get_title())
    assert grid.get_title() == "primary role's value / its threshold per head"
    assert default.legends[0].get_title().get_text().endswith("colour: primary role's value / its threshold")
    columns, rows = roles.roles(conn, run.run_id, stability=True)
    at = {c: i for i, c in enumerate(columns)}
    drawn = np.ma.filled(grid.images[0].get_array().astype(float), np.nan)
    earned = [r for r in rows if r[at["primary"]] and r[at["role"]] != "none established"]
    assert earned  # the run has roles to colour
    for r in earned:
        want = max(1.0, r[at["value"]] / r[at["threshold"]])
        assert drawn[r[at["layer"]], r[at["head"]]] == pytest.approx(want)
    words = {t.get_text().split("\n")[0] for t in grid.texts}
    assert words <= set(atlas_plots.ROLE_WORDS.values()) and all(len(w) > 2 for w in words)
    by_role = atlas_plots.run_atlas(conn, run, colour="role")[0]
    assert by_role.axes[0].get_title().startswith("primary role per head")
    assert by_role.legends[0].get_title().get_text() == "role (heads holding it)"
    fig = atlas_plots.run_atlas(conn, run, colour="within_sentence_lift_dm")[0]
    grid = next(ax for ax in fig.axes if ax.get_title())
    assert grid.get_title().startswith("within_sentence_lift_dm per head") and "primary role" not in grid.get_title()
    legend = fig.legends[0]
    assert "colour: within_sentence_lift_dm" in legend.get_title().get_text()
    assert all(patch.get_facecolor()[3] == 0 for patch in legend.get_patches() if "stable" not in patch.get_label())
