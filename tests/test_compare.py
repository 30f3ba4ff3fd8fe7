"""`headatlas compare`, `analyze --control`, `plot compare` and the head atlas on real stored runs
(DuckDB, no mocks): the default model and its random-weights control on the excerpt's first
document (10 windows), and two random models of different depths."""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest

from tests.figure_checks import analyse, check_png, check_svg, corpus_of

pytestmark = pytest.mark.slow
ONE_DOCUMENT = "block:1"


@pytest.fixture(scope="module")
def stored(tmp_path_factory, real_model, tiny_model, demo_corpus):
    """One database: the default model and its control on one document; random:tiny (2 layers)
    on the same one; a 4-layer random model on the second document (other windows)."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.model import control_model, load_model
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    folder = tmp_path_factory.mktemp("compare")
    db = folder / "results.duckdb"
    small = corpus_of(demo_corpus, folder, slice(0, 1), "small")
    other = corpus_of(demo_corpus, folder, slice(1, 2), "other")
    # one document says nothing of other documents (by document or block:8 it makes 1-2 groups):
    # blocks of one window spread its 10 windows over the groups, which is what these mechanics need
    real = analyse(small, db, real_model, name="small", replicates=ONE_DOCUMENT)
    control = analyze_corpus(
        str(small),
        store=Store(db),
        model=control_model(real_model),
        params=build_params(replicates=ONE_DOCUMENT),
        corpus=survey_corpus(str(small)),
        batch_size=8,
        control_of=real,
    )
    tiny = analyse(small, db, tiny_model, name="tiny", replicates=ONE_DOCUMENT)
    deep = analyse(other, db, load_model("random:4,4,32", device="cpu"), name="deep")
    return db, {"real": real, "control": control, "tiny": tiny, "deep": deep}


@pytest.fixture()
def conn(stored):
    from headatlas.service.storage.store import Store

    with Store(stored[0]).checked_read() as connection:
        yield connection


def _dicts(columns, rows):
    return [dict(zip(columns, r)) for r in rows]


def test_control_is_linked_and_sees_the_same_windows(conn, stored):
    from headatlas.service.reports import compare

    runs = stored[1]
    control = runs["control"]
    assert control.name == "small-control"
    assert control.params["control_of"] == runs["real"].run_key
    assert control.model == "control:default" and "random init of" in control.model_name
    assert (control.n_layers, control.n_heads) == (runs["real"].n_layers, runs["real"].n_heads)
    assert compare.control_of(conn, runs["real"]).run_id == control.run_id
    assert compare.control_of(conn, runs["tiny"]) is None
    assert compare.is_control(runs["real"], control) and not compare.is_control(control, runs["real"])
    assert compare.same_windows(conn, runs["real"].run_id, control.run_id)
    assert not compare.same_windows(conn, runs["real"].run_id, runs["deep"].run_id)


def test_compare_with_the_control_as_table_csv_and_json(cli, stored, conn):
    from headatlas.service.reports import layer_queries, queries

    db, runs = stored
    table = cli("compare", "small", "--db", str(db))  # B defaults to A's control
    assert table.returncode == 0, table.stderr
    assert "B is A's random-weights control" in table.stdout
    for needed in (
        "value_a",
        "value_b",
        "difference",
        "verdict",
        "beyond",
        "chance matched to the head's own distances",
        "against uniform attention",
        "95% interval",
    ):
        assert needed in table.stdout, needed

    done = cli("compare", "small", "small-control", "--format", "csv", "--db", str(db))
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert len(rows) == runs["real"].n_layers * 8  # every layer × the default metrics
    layer_cols, layer_rows = layer_queries.layers(conn, runs["real"].run_id)
    stored_a = {(r[0], c): r[layer_cols.index(c)] for r in layer_rows for c in layer_cols}
    for row in rows:
        a, b, diff = float(row["value_a"]), float(row["value_b"]), float(row["difference"])
        assert a == pytest.approx(stored_a[(int(row["layer_a"]), row["metric"])])
        assert diff == pytest.approx(a - b)
        lo, hi = float(row["difference_lo"]), float(row["difference_hi"])
        assert lo <= diff <= hi
        assert row["verdict"] == ("beyond" if lo > 0 or hi < 0 else "within")
        assert row["interval"] == "paired"
    # the trained model parks attention on [CLS] far beyond a random one of its shape
    cls = [r for r in rows if r["metric"] == "attn_to_cls_lift" and int(r["layer_a"]) in (1, 2, 3)]
    assert cls and all(r["verdict"] == "beyond" and float(r["difference"]) > 5 for r in cls)

    done = cli(
        "compare",
        "small",
        "small-control",
        "--heads",
        "--layer",
        "2",
        "-M",
        "attn_to_prev",
        "--format",
        "json",
        "--db",
        str(db),
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [d["head"] for d in data] == list(range(runs["real"].n_heads))
    assert {d["metric"] for d in data} == {"attn_to_prev"} and {d["layer_a"] for d in data} == {2}
    head_cols, head_rows = queries.heads(conn, runs["control"].run_id, layer=2)
    by_head = {r[1]: r[head_cols.index("attn_to_prev")] for r in head_rows}
    for d in data:
        assert d["value_b"] == pytest.approx(by_head[d["head"]])
        assert d["difference"] == pytest.approx(d["value_a"] - d["value_b"])


def test_a_run_compared_with_itself_differs_by_zero_and_never_beyond(conn, stored):
    from headatlas.service.reports import compare, trend_queries

    real = stored[1]["real"]
    for heads in (False, True):
        columns, rows = compare.compare(conn, real, real, metrics=list(trend_queries.LAYER_METRICS), heads=heads)
        data = _dicts(columns, rows)
        assert len(data) == len(trend_queries.LAYER_METRICS) * real.n_layers * (real.n_heads if heads else 1)
        defined = [d for d in data if d["verdict"] != "no value"]
        assert defined and all(d["difference"] == 0 for d in defined)
        assert not [d for d in data if d["verdict"] == "beyond"]


def test_paired_interval_is_the_jackknife_of_the_difference(conn, stored):
    from sqlalchemy import text

    from headatlas.service.reports import compare
    from headatlas.service.reports.intervals import jackknife_halfwidth

    runs = stored[1]
    columns, rows = compare.compare(conn, runs["real"], runs["control"], metrics=["mean_distance"], layer=1)
    (row,) = _dicts(columns, rows)
    loo = {}
    for run in (runs["real"], runs["control"]):
        loo[run.run_id] = dict(
            conn.execute(
                text(
                    "SELECT drop_rep, mean_distance FROM layer_metrics_reps WHERE run_id = :r AND layer = 1 AND drop_rep >= 0"
                ),
                {"r": run.run_id},
            ).all()
        )
    groups = sorted(loo[runs["real"].run_id])
    half = jackknife_halfwidth([loo[runs["real"].run_id][g] - loo[runs["control"].run_id][g] for g in groups])
    assert row["difference_hi"] - row["difference"] == pytest.approx(half)
    # the paired interval is narrower than treating the runs as independent would give
    h_a = row["value_a_hi"] - row["value_a"]
    h_b = row["value_b_hi"] - row["value_b"]
    assert half < math.hypot(h_a, h_b)


def test_different_depths_are_aligned_by_relative_depth(conn, stored):
    from headatlas.service.reports import compare

    assert compare.align_layers(2, 4) == [(0, 0), (1, 2)]
    assert compare.align_layers(4, 2) == [(0, 0), (2, 1)]
    assert compare.align_layers(3, 12) == [(0, 1), (1, 5), (2, 9)]
    assert compare.align_layers(5, 5) == [(l, l) for l in range(5)]
    runs = stored[1]
    columns, rows = compare.compare(conn, runs["tiny"], runs["deep"], metrics=["mean_distance"])
    data = _dicts(columns, rows)
    assert [(d["layer_a"], d["layer_b"]) for d in data] == [(0, 0), (1, 2)]
    assert [(d["depth_a"], d["depth_b"]) for d in data] == [(0.25, 0.125), (0.75, 0.625)]
    # other windows: independent samples, half-width sqrt(hA² + hB²)
    for d in data:
        assert d["interval"] == "independent"
        h = math.hypot(d["value_a_hi"] - d["value_a"], d["value_b_hi"] - d["value_b"])
        assert d["difference_hi"] - d["difference"] == pytest.approx(h)
    columns, rows = compare.compare(conn, runs["deep"], runs["tiny"], metrics=["mean_distance"])
    assert [(r[0], r[1]) for r in rows] == [(0, 0), (2, 1)]
    from headatlas.service.errors import ParameterError

    with pytest.raises(ParameterError, match="--layer 1: run A .* pairs only its layers 0, 2 with run B's 2"):
        compare.compare(conn, runs["deep"], runs["tiny"], layer=1)


def test_head_comparison_needs_one_shape_and_options_are_checked(cli, conn, stored):
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import compare

    db, runs = stored
    with pytest.raises(ParameterError, match=r"tiny is 2×4 \(layers × heads\), run deep is 4×4; .*drop --heads/--head"):
        compare.compare(conn, runs["tiny"], runs["deep"], heads=True)
    with pytest.raises(ParameterError, match="--head 1 needs --layer"):
        compare.compare(conn, runs["real"], runs["control"], head=1)
    with pytest.raises(
        ParameterError,
        match="--metric 'nonsense': not a metric here; did you mean noise_share\\? `headatlas metrics` lists",
    ):
        compare.compare(conn, runs["real"], runs["control"], metrics=["nonsense"])
    done = cli("compare", "tiny", "--db", str(db))
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: compare tiny: run 3 (tiny) has no control run; pass RUN_B, or analyse again with --control"
    )


def test_plot_compare_draws_the_stored_numbers(conn, stored, tmp_path):
    from headatlas.service.reports import atlas_plots, compare, plots

    runs = stored[1]
    metrics = ["mean_distance", "attn_to_cls_lift"]
    fig = atlas_plots.run_compare(conn, runs["real"], runs["control"], metrics=metrics)
    size = atlas_plots.compare_size(len(metrics) + 1)
    check_png(plots.save(fig, tmp_path / "compare.png"), (round(size[0] * plots.DPI), round(size[1] * plots.DPI)))
    check_svg(plots.save(fig, tmp_path / "compare.svg"), size)
    for ax, metric in zip(fig.axes, metrics):
        # errorbar containers carry the legend labels; their first line is the data line
        labelled = {c.get_label(): c.lines[0] for c in ax.containers}
        lines = [labelled["A: small"], labelled["B: small-control (control: the floor)"]]
        for line, run in zip(lines, (runs["real"], runs["control"])):
            columns, rows = compare.layer_profile(conn, run, [metric])
            assert np.allclose(line.get_ydata(), [r[columns.index(metric)] for r in rows])
            assert list(line.get_xdata()) == list(range(run.n_layers))
    heat = np.ma.filled(fig.axes[len(metrics)].images[0].get_array().astype(float), np.nan)
    columns, rows = compare.compare(conn, runs["real"], runs["control"], metrics=["mean_distance"], heads=True)
    for d in _dicts(columns, rows):
        assert heat[d["layer_a"], d["head"]] == pytest.approx(d["difference"])


def test_plot_compare_across_depths_uses_relative_depth(cli, conn, stored, tmp_path):
    from headatlas.service.reports import atlas_plots

    db, runs = stored
    fig = atlas_plots.run_compare(conn, runs["tiny"], runs["deep"], metrics=["mean_distance"])
    lines = [c.lines[0] for c in fig.axes[0].containers]
    xs = sorted({round(float(x), 4) for line in lines for x in line.get_xdata()})
    assert xs == [0.125, 0.25, 0.375, 0.625, 0.75, 0.875]
    out = tmp_path / "depths.png"
    done = cli("plot", "compare", "tiny", "deep", "-M", "mean_distance", "--out", str(out), "--db", str(db))
    assert done.returncode == 0, done.stderr
    check_png(out)
    from headatlas.service.errors import ParameterError

    with pytest.raises(ParameterError, match="differ in shape; the head heat map needs one shape"):
        atlas_plots.run_compare(conn, runs["tiny"], runs["deep"], heat_metric="mean_distance")


def test_analyze_control_from_the_command_line(cli, tmp_path, demo_corpus):
    from headatlas.service.reports import compare
    from headatlas.service.storage.store import Store, resolve_run

    corpus = tmp_path / "one.txt"  # a paragraph: the command's wiring is under test, not the numbers
    corpus.write_text(demo_corpus.read_text(encoding="utf-8")[:1200], encoding="utf-8")
    db = tmp_path / "cli.duckdb"
    done = cli("analyze", str(corpus), "--model", "random:tiny", "--control", "--name", "one", "-q", "--db", str(db))
    assert done.returncode == 0, done.stderr
    first, second = (int(x) for x in done.stdout.split())
    with Store(db).checked_read() as conn:
        run, control = resolve_run(conn, first), resolve_run(conn, second)
        assert control.name == "one-control" and control.params["control_of"] == run.run_key
        assert control.model == "control:random:tiny"
        assert compare.control_of(conn, run).run_id == second
        assert compare.same_windows(conn, first, second)


# --- the head atlas on the real runs (rules: SPEC §7; known answers: tests/test_roles.py) ------------------
def test_the_control_earns_almost_no_role_and_the_model_many(conn, stored):
    from headatlas.service.reports import role_rules, role_views, roles

    runs = stored[1]
    counts = {}
    for key in ("real", "control"):
        columns, rows = roles.roles(conn, runs[key].run_id)
        counts[key] = role_views.role_counts(columns, rows)
    heads = runs["real"].n_layers * runs["real"].n_heads
    assert counts["control"][role_rules.NONE] >= heads - 2, counts["control"]
    # 10 windows of one document fill only a few replicate groups (few df), and the role tests are
    # corrected over all 648 (head, role) of the run (SPEC §7): only the clearest roles survive here,
    # the model's positional heads first (a bare lower bound earned 56 [CLS] sinks on the excerpt)
    assert counts["real"]["previous-token"] >= 2 and counts["real"]["next-token"] >= 2
    assert counts["real"][role_rules.NONE] < counts["control"][role_rules.NONE]


def test_query_roles_gives_the_evidence_of_every_role(cli, conn, stored):
    from headatlas.service.reports import queries, role_rules, role_tests, roles
    from headatlas.service.reports.intervals import clip_interval

    db, runs = stored
    done = cli("query", "roles", "--run", "small", "--format", "json", "--db", str(db))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    real = runs["real"]
    assert {(d["layer"], d["head"]) for d in data} == {
        (l, h) for l in range(real.n_layers) for h in range(real.n_heads)
    }
    assert sum(d["primary"] for d in data) == real.n_layers * real.n_heads
    # the interval the role test reads: the jackknife's symmetric one (for a lift, not the log-scale
    # interval query heads shows), clipped as shown
    columns, rows = queries.heads(conn, real.run_id, anchors=0, ci=True, clip=False)
    stored_rows = {(r[0], r[1]): dict(zip(columns, r)) for r in rows}
    context = roles.run_context(conn, real.run_id)
    for d in data:
        if d["role"] == role_rules.NONE:
            continue
        metric = stored_rows[(d["layer"], d["head"])]
        assert d["value"] == pytest.approx(metric[d["metric"]])
        assert d["value_lo"] == pytest.approx(clip_interval(d["metric"], metric[d["metric"] + "_lo"], None)[0])
        assert d["value"] >= d["threshold"] and d["test"] == role_tests.HOLM and d["p_holm"] <= role_tests.ALPHA
        if d["role"] == "local":
            assert d["threshold"] == pytest.approx(3 * context["short_range_chance"])


def test_the_real_runs_stored_results_equal_the_computed_ones_and_the_roles_view_is_query_roles(stored, cli):
    """The real MiniLM run and its control: their results stored once (as when a run ends) equal
    number for number what the readers compute (to the last bits DuckDB's parallel sums leave
    open), and SQL's ``roles`` view holds the rows of ``query roles --stability --format json``
    (its columns, in its order)."""
    from headatlas.service.reports import stored as results
    from headatlas.service.storage import run_results
    from headatlas.service.storage.store import Store
    from tests.test_stored_results import computed, every_result, same_results

    db, runs = stored
    for key in ("real", "control"):
        results.refresh(Store(db), runs[key].run_id)
    with Store(db).checked_read() as conn:
        for key in ("real", "control"):
            run = runs[key].run_id
            assert run_results.is_fresh(conn, run), key
            same_results(every_result(conn, run), computed(conn, run), key)
    real = runs["real"].run_id
    shown = cli("query", "roles", "--run", str(real), "--stability", "--format", "json", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    view = cli("sql", "SELECT * EXCLUDE (run_id) FROM roles", "--run", str(real), "-f", "json", "--db", str(db))
    assert view.returncode == 0, view.stderr
    want, got = json.loads(shown.stdout), json.loads(view.stdout)
    assert len(got) == len(want) > real and any(d["role"] != "none established" for d in got)
    same_results(got, [{c: d[c] for c in got[0]} for d in want])


def test_atlas_of_the_stored_run_is_its_primary_roles(conn, stored, tmp_path):
    from headatlas.service.reports import atlas_plots, plots, role_views, roles

    real = stored[1]["real"]
    fig, index = atlas_plots.run_atlas(conn, real, colour="role")
    columns, rows = roles.roles(conn, real.run_id)
    grid = role_views.primary_grid(columns, rows, real.n_layers, real.n_heads)
    drawn = np.ma.filled(fig.axes[0].images[0].get_array().astype(float), np.nan)
    assert [[atlas_plots.ATLAS_ROLES[int(v)] for v in line] for line in drawn] == grid
    width, height = atlas_plots.atlas_size(real.n_layers, real.n_heads)
    check_png(plots.save(fig, tmp_path / "atlas.png"), (round(width * plots.DPI), round(height * plots.DPI)))


def test_parameter_differences_are_named_and_the_link_is_not_one(stored):
    from types import SimpleNamespace

    from headatlas.service.reports import compare

    runs = stored[1]
    assert compare.parameter_differences(runs["real"], runs["control"]) == []
    other = SimpleNamespace(params={**runs["real"].params, "select": "top:0.05"})
    assert compare.parameter_differences(runs["real"], other) == ["select: top:0.02 vs top:0.05"]
