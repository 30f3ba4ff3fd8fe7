"""`plot csm`, `plot boundaries --by-distance`, `plot mixing`, `plot discrepancy` and the report's
mixing section: drawn from a real small run (random:tiny weights, real text), checked as files and
against the stored numbers."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from sqlalchemy import text

from tests.figure_checks import check_png, check_svg, corpus_of


@pytest.fixture(scope="module")
def stored(tmp_path_factory, tiny_model, demo_corpus):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    folder = tmp_path_factory.mktemp("csm-plots")
    db = folder / "results.duckdb"
    corpus = corpus_of(demo_corpus, folder, slice(0, 2), "small")
    # one attribution window: its backward passes are most of the fixture's time (22 of 27 s of CPU
    # with three), and the figures are checked against the stored rows, whatever window count made them
    run = analyze_corpus(
        str(corpus),
        store=Store(db),
        model=tiny_model,
        corpus=survey_corpus(str(corpus)),
        params=build_params(attribution=True, mixing=["norm", "rollout"], attribution_windows=1),
        batch_size=8,
        name="mixed",
    )
    plain_corpus = corpus_of(demo_corpus, folder, slice(2, 3), "plain")
    plain = analyze_corpus(
        str(plain_corpus),
        store=Store(db),
        model=tiny_model,
        params=build_params(),
        corpus=survey_corpus(str(plain_corpus)),
        batch_size=8,
        name="plain",
    )
    assert run.status == plain.status == "done"
    return db, run, plain


@pytest.fixture()
def conn(stored):
    from headatlas.service.storage.store import Store

    with Store(stored[0]).checked_read() as connection:
        yield connection


def _stored_grid(conn, run_id, layer, head, kind, value):
    """The view's cells, mirrored by hand: what the figure must show."""
    grid = np.full((16, 16), np.nan)
    for i, j, v in conn.execute(
        text(
            f"SELECT bin_i, bin_j, {value} FROM csm_means WHERE run_id = :r AND layer = :l AND head = :h AND kind = :k"
        ),
        {"r": run_id, "l": layer, "h": head, "k": kind},
    ):
        grid[i, j] = grid[j, i] = v
    return grid


def _drawn(ax) -> np.ndarray:
    return np.ma.filled(ax.images[0].get_array().astype(float), np.nan)


def test_csm_of_one_head_shows_the_stored_means_and_shares(conn, stored, tmp_path):
    from headatlas.service.reports import csm_plots, plots

    run = stored[1]
    fig = csm_plots.run_csm(conn, run, layer=1, head=2)
    width, height = csm_plots.HEAD_FIGSIZE
    check_png(plots.save(fig, tmp_path / "csm.png"), (round(width * plots.DPI), round(height * plots.DPI)))
    check_svg(plots.save(fig, tmp_path / "csm.svg"), (width, height))
    for ax, (kind, value) in zip(fig.axes[:3], (("all", "mean"), ("attended", "pair_share"), ("noise", "pair_share"))):
        expected = _stored_grid(conn, run.run_id, 1, 2, kind, value)
        np.testing.assert_allclose(_drawn(ax), expected, equal_nan=True, err_msg=kind)
        assert ax.images[0].get_extent() == [0, 128, 128, 0]  # axes in token positions
    all_pairs = _stored_grid(conn, run.run_id, 1, 2, "all", "mean")
    assert np.isfinite(all_pairs).sum() > 100  # most cells of 128-token windows hold pairs
    assert np.isfinite(all_pairs[0, 0])  # positions 1..7: 21 pairs in every window


def test_csm_grid_of_a_layer_draws_every_head(conn, stored, tmp_path):
    from headatlas.service.reports import csm_plots, plots

    run = stored[1]
    for kind, value in (("all", "mean"), ("noise", "pair_share")):
        fig = csm_plots.run_csm(conn, run, layer=0, kind=kind)
        check_png(plots.save(fig, tmp_path / f"grid-{kind}.png"))
        panels = [ax for ax in fig.axes if ax.get_visible() and ax.images]
        assert len(panels) == run.n_heads
        for head, ax in enumerate(panels):
            assert ax.get_title() == f"head {head}"
            np.testing.assert_allclose(_drawn(ax), _stored_grid(conn, run.run_id, 0, head, kind, value), equal_nan=True)


def test_csm_refuses_a_layer_or_kind_it_does_not_have(conn, stored):
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import csm_plots

    with pytest.raises(ParameterError, match=r"--layer 7: run \d+ has layers 0\.\.1 \(0-based\)"):
        csm_plots.run_csm(conn, stored[1], layer=7)
    with pytest.raises(ParameterError, match="--kind 'signal': choose one of all, attended, noise"):
        csm_plots.run_csm(conn, stored[1], layer=0, kind="signal")


def test_boundaries_by_distance_draws_the_stored_shares_against_chance(conn, stored, tmp_path):
    from headatlas.service.reports import distance_queries, plots

    run = stored[1]
    fig = plots.run_figure("boundaries", conn, run, by_distance=True)
    check_png(plots.save(fig, tmp_path / "bd.png"))
    share_ax, lift_ax = fig.axes[:2]
    lines = {line.get_label(): line for line in share_ax.get_lines()}
    columns, rows = distance_queries.sentence_by_distance(conn, run.run_id)
    # the numbers from the raw tables: H's within-sentence pairs by distance over H by distance;
    # chance = all pairs at that distance sharing a sentence over all pairs at that distance
    raw = {
        (l, d): (s / c, c)
        for l, d, s, c in conn.execute(
            text(
                "SELECT layer, distance, sum(same_sentence), sum(count) FROM dist_hist WHERE run_id = :r GROUP BY ALL"
            ),
            {"r": run.run_id},
        )
    }
    chance = dict(
        conn.execute(
            text("SELECT distance, sum(same_sentence) / sum(count) FROM pair_hist WHERE run_id = :r GROUP BY distance"),
            {"r": run.run_id},
        ).all()
    )
    for layer in range(run.n_layers):  # drawn where the layer has enough pairs at the distance
        x, y = lines[f"layer {layer}"].get_data()
        assert list(x) == sorted(d for l, d in raw if l == layer and raw[l, d][1] >= plots.MIN_DISTANCE_PAIRS)
        np.testing.assert_allclose(y, [raw[layer, d][0] for d in x])
    assert len(raw) > sum(len(line.get_xdata()) for line in share_ax.get_lines()[1:])  # a thin tail was cut
    x, y = lines["chance: all pairs at that distance"].get_data()
    np.testing.assert_allclose(y, [chance[d] for d in x])
    # the per-distance counts add up to the head totals counted apart (head_stats)
    by_layer = dict(
        conn.execute(
            text("SELECT layer, sum(same_sentence) FROM dist_hist WHERE run_id = :r GROUP BY layer"), {"r": run.run_id}
        ).all()
    )
    totals = dict(
        conn.execute(
            text("SELECT layer, sum(same_sentence_high) FROM head_stats WHERE run_id = :r GROUP BY layer"),
            {"r": run.run_id},
        ).all()
    )
    assert by_layer == totals and sum(totals.values()) > 0
    lift_lines = {line.get_label(): line for line in lift_ax.get_lines()}
    li, pi, ci = (columns.index(c) for c in ("within_sentence_lift", "high_pairs", "within_sentence_chance"))
    kept = [r for r in rows if r[0] == 0 and r[pi] >= plots.MIN_DISTANCE_PAIRS]
    np.testing.assert_allclose(
        lift_lines["layer 0"].get_ydata(),
        [r[li] if r[li] and r[pi] * r[ci] >= plots.MIN_EXPECTED_PAIRS else np.nan for r in kept],
        equal_nan=True,
    )


def test_mixing_lines_are_the_query_rows(conn, stored, tmp_path):
    from headatlas.service.reports import mixing_plots, mixing_queries, plots

    run = stored[1]
    fig = mixing_plots.run_mixing(conn, run)
    width, height = mixing_plots.MIXING_FIGSIZE
    check_png(plots.save(fig, tmp_path / "mixing.png"), (round(width * plots.DPI), round(height * plots.DPI)))
    check_svg(plots.save(fig, tmp_path / "mixing.svg"), (width, height))
    columns, rows = mixing_queries.mixing(conn, run.run_id)
    assert columns[2:] == ["attention", "attribution", "rollout", "norm"]
    for ax, (measure, _) in zip(fig.axes, mixing_plots.MIXING_PANELS):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == set(columns[2:])
        mine = [r for r in rows if r[1] == measure]
        for k, method in enumerate(columns[2:]):
            x, y = lines[method].get_data()
            assert list(x) == [r[0] for r in mine]
            np.testing.assert_allclose(y, [r[2 + k] for r in mine])


def test_discrepancy_heat_map_and_layer_lines_are_the_query_rows(conn, stored, tmp_path):
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import mixing_plots, mixing_queries, plots

    run = stored[1]
    for method in ("attribution", "norm"):
        fig, _ = mixing_plots.run_discrepancy(conn, run, method=method)
        check_png(plots.save(fig, tmp_path / f"d-{method}.png"))
        _, rows = mixing_queries.discrepancy(conn, run.run_id, method=method)
        drawn = _drawn(fig.axes[0])
        assert drawn.shape == (run.n_layers, run.n_heads) and len(rows) == run.n_layers * run.n_heads
        for r in rows:
            assert drawn[r[1], r[2]] == pytest.approx(r[3]) and 0 < r[3] < 1
        lcols, lrows = mixing_queries.discrepancy_layers(conn, run.run_id, method=method)
        lines = {line.get_label(): line for line in fig.axes[1].get_lines()}
        np.testing.assert_allclose(
            lines["mean over heads"].get_ydata(), [r[lcols.index("mean_head_jsd")] for r in lrows]
        )
    with pytest.raises(ParameterError, match="--method alti: run .* has only attention, attribution, rollout, norm"):
        mixing_plots.run_discrepancy(conn, run, method="alti")
    with pytest.raises(ParameterError, match="has no mixing measures: analyse with --attribution"):
        mixing_plots.run_mixing(conn, stored[2])


def test_report_has_a_mixing_section_only_for_runs_with_mixing(conn, stored, tmp_path):
    from headatlas.service.reports import report
    from headatlas.service.reports.report import build_report
    from tests.test_report import Elements

    def parse(run):
        parsed = Elements()
        parsed.feed(build_report(conn, run))
        return parsed, " ".join(parsed.text)

    parsed, body = parse(stored[1])
    alts = [a["alt"] for t, a in parsed.tags if t == "img"]
    assert "mixing per layer" in alts and "discrepancy attribution" in alts and "discrepancy norm" in alts
    assert "Mixing: attention against attribution, rollout, norm" in body
    assert body.index("Figures") < body.index("Mixing: attention against") < body.index("Top anchor tokens")
    for png, alt in [(a["src"], a["alt"]) for t, a in parsed.tags if t == "img" and "discrepancy" in a["alt"]]:
        path = tmp_path / f"{alt}.png"
        path.write_bytes(base64.b64decode(png.split(",", 1)[1]))
        check_png(path)
    # a run without mixing measures gets no section (the rest of its page: tests/test_report.py)
    assert report.mixing_methods(conn, stored[2]) == []
    assert report._mixing_section(conn, stored[2]) == ""


def test_plot_commands_write_files_and_refuse_bad_options(cli, stored, tmp_path):
    db, run, _ = stored
    out = tmp_path / "csm.png"
    done = cli("plot", "csm", "--run", run.name, "--layer", "1", "--head", "0", "--out", str(out), "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    check_png(out)
    bad = cli(
        "plot",
        "csm",
        "--run",
        run.name,
        "--layer",
        "1",
        "--head",
        "9",
        "--out",
        str(tmp_path / "x.png"),
        "--db",
        str(db),
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error: --head 9: run") and "heads 0..3" in bad.stderr
    assert not (tmp_path / "x.png").exists()
