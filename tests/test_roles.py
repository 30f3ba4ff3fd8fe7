"""Head roles (SPEC §7) on hand-built metric rows: known answers, and the atlas figure at the
sizes researchers use (12 × 12, 24 × 16). The same rules on real runs: tests/test_compare.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.figure_checks import check_png, check_svg

CONTEXT = {"short_range_chance": 0.064, "uniform_entropy": math.log(125)}


def head(layer, h, **metrics):
    """A head's row: ``metric=(value, lo, hi)`` or ``metric=value`` (no interval); every other
    metric sits at chance with a tight interval."""
    row = {"layer": layer, "head": h}
    chance = {
        "attn_to_prev": 0.008,
        "attn_to_next": 0.008,
        "repetition_words_lift_dm": 1.0,
        "within_sentence_lift_dm": 1.0,
        "attn_to_punct_lift": 1.0,
        "short_range_share": 0.064,
        "attn_to_cls_lift": 1.0,
        "attn_to_sep_lift": 1.0,
        "attn_entropy": math.log(125),
    }
    for name, value in {**{k: (v, v * 0.98, v * 1.02) for k, v in chance.items()}, **metrics}.items():
        if isinstance(value, tuple):
            row[name], row[f"{name}_lo"], row[f"{name}_hi"] = value
        else:
            row[name], row[f"{name}_lo"], row[f"{name}_hi"] = value, None, None
    return row


GROUPS = 16  # replicate groups behind the hand-made intervals: t with 15 df


def iv(value, se):
    """A metric cell whose 95% interval has jackknife standard error ``se`` (whatever the
    interval's quantile is: it is read back from service.reports.intervals)."""
    from headatlas.service.reports import role_tests

    half = role_tests.interval_quantile(GROUPS) * se
    return value, value - half, value + half


def earned(rows, groups=GROUPS):
    from headatlas.service.reports import role_tests

    out = {}
    for r in role_tests.assign(rows, CONTEXT, groups=groups):
        d = dict(zip(role_tests.COLUMNS, r))
        out.setdefault((d["layer"], d["head"]), []).append(d)
    return out


def hand_heads():
    """(head, its metrics as (value, se)); t = (value − threshold) / se, 15 df."""
    from headatlas.service.reports.role_rules import REPETITION_MIN, SENTENCE_MIN

    return [
        ((0, 0), {"attn_to_prev": (0.9, 0.01), "short_range_share": (0.5, 0.01)}),  # t = 70 and 31
        ((0, 1), {"attn_to_prev": (0.3, 0.075)}),  # t = 1.33: p = 0.10 before any correction
        ((0, 2), {"repetition_words_lift_dm": (REPETITION_MIN + 4, 0.5), "attn_to_cls_lift": (30.0, 2.0)}),  # 8, 10
        ((1, 0), {"within_sentence_lift_dm": (SENTENCE_MIN + 0.07, 0.01)}),  # t = 7
        # t = 2.602 = t_{15, 0.99}: p = 0.01, and the lower end of its 95% interval (0.033 past the threshold
        # with t_{15, 0.975}, 0.042 with 1.96) clears it, so a bare interval test would earn it; Holm over 90
        # tests does not
        ((1, 1), {"within_sentence_lift_dm": (SENTENCE_MIN + 0.07, 0.07 / 2.602)}),
        ((1, 2), {"short_range_share": (0.25, 0.005)}),  # 3 × 0.064 = 0.192: t = 11.6
        ((2, 0), {"attn_entropy": (4.3, 0.02)}),  # ln 125 = 4.83: t = 34 over 0.75 · ln n̄, 19 under 0.97 · ln n̄
        ((2, 1), {"attn_entropy": (4.75, 0.02)}),  # past 0.97 · ln n̄ = 4.68: uniform-like
        ((2, 2), {"attn_to_punct_lift": (1.8, 0.05), "attn_to_sep_lift": (12.0, 0.4)}),  # t = 6 and 5
        ((3, 0), {"attn_to_next": (0.25, 0.005)}),  # t = 10
    ]


def hand_rows():
    return [head(l, h, **{m: iv(*cell) for m, cell in metrics.items()}) for (l, h), metrics in hand_heads()]


def test_roles_known_answers():
    """Updated with the rule (SPEC §7, second turn): a role is a one-sided t test corrected by
    Holm over the run's family, no longer a bare lower bound; intervals are built from se."""
    from headatlas.service.reports import role_tests, significance

    got = earned(hand_rows())
    roles_of = {k: [d["role"] for d in v] for k, v in got.items()}
    assert roles_of == {
        (0, 0): ["previous-token", "local"],
        (0, 1): ["none established"],
        (0, 2): ["repetition", "[CLS] sink"],
        (1, 0): ["sentence-bound"],
        (1, 1): ["none established"],
        (1, 2): ["local"],
        (2, 0): ["broad"],
        (2, 1): ["none established"],
        (2, 2): ["punctuation", "[SEP] sink"],
        (3, 0): ["next-token"],
    }
    # the primary role is the first held; exactly one per head
    assert all(sum(d["primary"] for d in v) == 1 and v[0]["primary"] for v in got.values())
    # 10 heads × 9 roles, every threshold defined: one family of 90 tests, named on every row
    assert {d["family"] for v in got.values() for d in v} == {90}
    local = got[(1, 2)][0]
    assert local["threshold"] == pytest.approx(3 * 0.064) and local["test"] == role_tests.HOLM
    assert local["value"] == 0.25 and local["value_lo"] < 0.25 < local["value_hi"]
    assert local["p"] == pytest.approx(significance.t_sf((0.25 - 3 * 0.064) / 0.005, 15), rel=1e-9)
    assert local["p"] <= local["p_holm"] <= 90 * local["p"] and local["p_holm"] <= role_tests.ALPHA
    assert "short_range_chance" in local["rule"]
    sep = got[(2, 2)][1]
    assert sep["role"] == "[SEP] sink" and sep["p"] == pytest.approx(significance.t_sf(5.0, 15), rel=1e-9)
    broad = got[(2, 0)][0]
    assert broad["threshold"] == pytest.approx(0.75 * math.log(125))
    # the larger p of its two one-sided tests: t = 19.1 under the ceiling
    assert broad["p"] == pytest.approx(significance.t_sf((0.97 * math.log(125) - 4.3) / 0.02, 15), rel=1e-9)
    none = got[(0, 1)][0]
    assert none["metric"] is None and none["threshold"] is None and none["family"] == 90


def test_a_role_that_clears_its_interval_but_not_the_correction_is_not_earned():
    """Head (1, 1) alone: a family of its 9 tests, the other 8 at chance (p near 1), so its own
    p = 0.01 ranks first and Holm multiplies it by 9: 0.09 > 0.05, earned only at α = 0.1."""
    from headatlas.service.reports import role_rules, role_tests

    alone = [r for r in hand_rows() if (r["layer"], r["head"]) == (1, 1)]
    assert [r[2] for r in role_tests.assign(alone, CONTEXT, groups=GROUPS)] == [role_rules.NONE]
    tests = [dict(zip(role_tests.COLUMNS, r)) for r in role_tests.assign(alone, CONTEXT, groups=GROUPS, alpha=0.1)]
    assert [t["role"] for t in tests] == ["sentence-bound"]
    assert tests[0]["p"] == pytest.approx(0.01, abs=2e-5) and tests[0]["family"] == 9
    assert tests[0]["p_holm"] == pytest.approx(9 * tests[0]["p"], rel=1e-12)


def test_runs_without_intervals_test_the_value_and_say_so():
    from headatlas.service.reports import role_tests

    got = earned(hand_rows(), groups=None)
    # (0, 1): value 0.3 ≥ 0.2 with no interval to test: earned by value
    d = got[(0, 1)][0]
    assert d["role"] == "previous-token" and d["test"] == role_tests.VALUE_TEST
    assert d["p"] is None and d["p_holm"] is None and d["family"] is None
    # in a run with groups, a head whose interval is undefined cannot be tested
    row = head(0, 0, attn_to_punct_lift=1.8)
    assert [d["role"] for d in earned([row])[(0, 0)]] == ["none established"]
    assert [d["role"] for d in earned([row], groups=None)[(0, 0)]] == ["punctuation"]


def test_undefined_metrics_earn_nothing():
    row = head(0, 0, attn_to_prev=(float("nan"), None, None), repetition_words_lift_dm=(None, None, None))
    assert [d["role"] for d in earned([row])[(0, 0)]] == ["none established"]


def _hand_run(n_layers, n_heads):
    """Hand-built roles of a run: head (l, h) gets the role numbered (l + h) % 10 (with
    ``none established`` as 9) and, on even heads, ``[CLS] sink`` as a second role."""
    from headatlas.service.reports import atlas_plots, role_rules, role_tests

    rows = []
    for l in range(n_layers):
        for h in range(n_heads):
            primary = atlas_plots.ATLAS_ROLES[(l + h) % len(atlas_plots.ATLAS_ROLES)]
            rows.append((l, h, primary, True, *[None] * (len(role_tests.COLUMNS) - 4)))
            if h % 2 == 0 and primary not in ("[CLS] sink", role_rules.NONE):
                rows.append((l, h, "[CLS] sink", False, *[None] * (len(role_tests.COLUMNS) - 4)))
    return list(role_tests.COLUMNS), rows


@pytest.mark.parametrize("shape", [(12, 12), (24, 16)])
def test_atlas_figure_shows_each_heads_primary_role_readably(shape, tmp_path):
    from headatlas.service.reports import atlas_plots, plots

    n_layers, n_heads = shape
    columns, rows = _hand_run(n_layers, n_heads)
    fig, index = atlas_plots.figure_atlas(columns, rows, n_layers=n_layers, n_heads=n_heads, title="hand-built")
    drawn = np.ma.filled(fig.axes[0].images[0].get_array().astype(float), np.nan)
    expected = np.array([[(l + h) % len(atlas_plots.ATLAS_ROLES) for h in range(n_heads)] for l in range(n_layers)])
    assert np.array_equal(drawn, expected) and np.array_equal(index, expected)
    # every cell names its primary role in a word, and counts the others it holds
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in fig.axes[0].texts}
    assert texts[(0, 0)] == "prev-token\n+1" and texts[(0, 1)] == "next-token"
    width, height = atlas_plots.atlas_size(n_layers, n_heads)
    rgb = check_png(plots.save(fig, tmp_path / "atlas.png"), (round(width * plots.DPI), round(height * plots.DPI)))
    check_svg(plots.save(fig, tmp_path / "atlas.svg"), (width, height))
    # readable: a cell is at least 30 × 25 pixels at the default resolution
    ax_box = fig.axes[0].get_window_extent()
    assert ax_box.width / n_heads >= 30 and ax_box.height / n_layers >= 25
    # each role's colour is on the canvas
    from matplotlib import colors

    for role in atlas_plots.ATLAS_ROLES:
        target = np.array(colors.to_rgb(atlas_plots.ROLE_COLOURS[role])) * 255
        assert (np.abs(rgb - target).max(axis=2) < 3).sum() > 200, role
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[0].startswith("previous-token (")


def test_a_run_stored_before_replicate_groups_gets_no_interval(tmp_path):
    """Such a run (built by hand as headatlas stored it then) has no intervals: compare says so
    instead of a verdict; roles test the values (known answers: none here)."""
    from headatlas.service.reports import compare, role_rules, roles
    from headatlas.service.storage import db
    from headatlas.service.storage.store import Store, resolve_run
    from tests.test_baselines import database_at_0005, insert_old_run

    path = tmp_path / "old.duckdb"
    database_at_0005(path)
    run_id = insert_old_run(path)
    db.upgrade(path)
    with Store(path).checked_read() as conn:
        run = resolve_run(conn, run_id)
        columns, rows = compare.compare(
            conn, run, run, metrics=["mean_distance", "attn_to_cls_lift", "repetition_words_lift_dm"], heads=True
        )
        verdicts = {(r[columns.index("head")], r[columns.index("metric")]): r[columns.index("verdict")] for r in rows}
        assert verdicts[(0, "mean_distance")] == "no interval"
        assert verdicts[(0, "attn_to_cls_lift")] == "no interval"
        assert verdicts[(0, "repetition_words_lift_dm")] == "no value"  # needs a sum the old run lacks
        columns, rows = roles.roles(conn, run_id)
    # by hand (no interval, so the values are tested): [CLS] gets (3.0 + 1.5) / 3 = 1.5× and
    # (6.0 + 3.0) / 3 = 3× uniform attention (< 10); all similar pairs are within 4 tokens, but so
    # are 148 of the 150 pairs of these 8-token windows (3 × chance > 1); entropy 15/36 and 18/36
    # nats against ln 12: no role for either head
    assert [(r[0], r[1], r[2]) for r in rows] == [(0, 0, role_rules.NONE), (0, 1, role_rules.NONE)]


# --- the t distribution and Holm–Bonferroni (service.reports.significance) ----------------------------
def test_t_cdf_known_answers():
    from headatlas.service.reports.significance import t_cdf, t_quantile, t_sf

    assert t_cdf(2.131, 15) == pytest.approx(0.975, abs=5e-5)  # the table's t_{15, 0.975} = 2.131
    assert t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)  # Cauchy: 1/2 + atan(1)/π
    assert t_cdf(-3.0, 1) == pytest.approx(0.5 + math.atan(-3.0) / math.pi, abs=1e-12)
    for t in (-4.0, -0.3, 0.0, 0.7, 2.5, 30.0):  # 2 df: 1/2 + t / (2 sqrt(2 + t²))
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    assert t_cdf(1.959963984540054, 1e8) == pytest.approx(0.975, abs=1e-6)  # the normal in the limit
    assert t_cdf(2.0, 7) + t_cdf(-2.0, 7) == pytest.approx(1.0, abs=1e-14)
    assert t_sf(2.602, 15) == pytest.approx(0.01, abs=2e-5)  # t_{15, 0.99} = 2.602
    assert t_quantile(0.975, 15) == pytest.approx(2.1314, abs=1e-4)
    assert t_quantile(0.975, 7) == pytest.approx(2.3646, abs=1e-4)
    assert t_quantile(0.95, 1) == pytest.approx(math.tan(math.pi * 0.45), rel=1e-9)
    assert t_quantile(0.025, 3) == pytest.approx(-3.1824, abs=1e-4)


def test_incomplete_beta_known_answers():
    from headatlas.service.reports.significance import incomplete_beta

    for x in (0.0, 0.1, 0.5, 0.93, 1.0):
        assert incomplete_beta(1, 1, x) == pytest.approx(x, abs=1e-14)
        assert incomplete_beta(3.5, 1, x) == pytest.approx(x**3.5, abs=1e-13)
    assert incomplete_beta(7.5, 7.5, 0.5) == pytest.approx(0.5, abs=1e-13)  # symmetric
    assert incomplete_beta(2, 3, 0.4) == pytest.approx(0.5248, abs=1e-12)  # Σ_{j=2}^{4} C(4,j) .4^j .6^(4−j)


def test_holm_known_answers():
    from headatlas.service.reports.significance import holm

    # sorted: 0.005 (×4 = 0.02), 0.01 (×3 = 0.03), 0.03 (×2 = 0.06), 0.04 (×1, kept monotone: 0.06)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    # capped at 1; ties keep one value; an empty family is empty
    assert holm([0.5, 0.5, 0.9]) == pytest.approx([1.0, 1.0, 1.0])
    assert holm([0.001, 0.001]) == pytest.approx([0.002, 0.002])
    assert holm([]) == []


def test_the_standard_error_is_read_back_from_the_interval():
    """se = half-width / q holds for whatever quantile service.reports.intervals uses: it equals
    the jackknife's sqrt((R − 1)/R · Σ (θ_(g) − θ̄)²) computed here by hand."""
    from headatlas.service.reports import role_tests
    from headatlas.service.reports.intervals import jackknife_halfwidth

    rng = np.random.default_rng(3)
    for r in (2, 5, 16):
        loo = rng.normal(1.0, 0.2, r)
        se = math.sqrt((r - 1) / r * float(((loo - loo.mean()) ** 2).sum()))
        assert jackknife_halfwidth(list(loo)) / role_tests.interval_quantile(r) == pytest.approx(se, rel=1e-12)
    assert role_tests.interval_quantile(1) is None


def test_atlas_fades_roles_that_are_unsure_without_hiding_them():
    """A primary role not held on both halves, or whose interval reaches its threshold, is drawn
    faded (white laid over its colour) with its word in italic: no hatching over the cell."""
    from matplotlib.patches import Rectangle

    from headatlas.service.reports import atlas_plots, role_rules, role_tests, roles

    columns = [*role_tests.COLUMNS, *roles.STABILITY_COLUMNS]
    filler = [None] * (len(role_tests.COLUMNS) - 4)
    at = {c: i for i, c in enumerate(columns)}

    def row(l, h, role, primary, stable, lo=None):
        r = [l, h, role, primary, *filler, stable, stable, stable]
        r[at["value"]], r[at["value_lo"]], r[at["threshold"]] = (None, None, None) if lo is None else (3.0, lo, 1.0)
        return tuple(r)

    rows = [
        row(0, 0, "previous-token", True, True),
        row(0, 0, "local", False, False),  # unsure, not primary: the cell stays as it is
        row(0, 1, "[CLS] sink", True, False),  # unstable primary: faded
        row(1, 0, role_rules.NONE, True, None),
        row(1, 1, "broad", True, True, lo=0.9),  # stable, but its interval reaches its threshold: faded
    ]
    fig, _ = atlas_plots.figure_atlas(columns, rows, n_layers=2, n_heads=2, title="hand-built")
    cells = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    assert not [p for p in cells if p.get_hatch()]
    assert sorted((p.get_x(), p.get_y()) for p in cells if p.get_alpha() == atlas_plots.FADE) == [
        (0.5, -0.5),
        (0.5, 0.5),
    ]
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t for t in fig.axes[0].texts}
    assert {k: t.get_text() for k, t in texts.items()} == {
        (0, 0): "prev-token\n+1",
        (0, 1): "CLS sink",
        (1, 1): "broad",
    }
    assert [k for k, t in texts.items() if t.get_fontstyle() == "italic"] == [(0, 1), (1, 1)]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[0] == "previous-token (1, 1 stable)" and legend[-1].startswith("faded, italic: unsure")


def test_a_lift_is_tested_on_the_interval_query_heads_shows():
    """A lift's test reads the interval `query heads --ci` shows (SPEC §5d): on the log scale, with
    the interval's own degrees of freedom. 16 leave-one-group-out attn_to_punct_lift values, one
    group standing apart (a document dense in '.'/','): lift_df falls below 15, and p =
    P(T_df > (ln θ − ln 1.5) / se(ln θ)), not the linear test with 15 df."""
    from headatlas.service.reports import role_rules, role_tests
    from headatlas.service.reports.intervals import add_intervals, jackknife_halfwidth, lift_df, t95
    from headatlas.service.reports.significance import t_sf

    loo = [2.0 * math.exp(0.01 * k) for k in range(-7, 8)] + [1.75]
    value = 1.98
    cols, ivs = add_intervals(
        ["layer", "head", "attn_to_punct_lift"],
        [(0, 0, value)],
        [(0, 0, g, v) for g, v in enumerate(loo)],
        keys=["layer", "head"],
        metrics=["attn_to_punct_lift"],
        clip=False,
        with_df=True,
    )
    shown = dict(zip(cols, ivs[0]))
    logs = [math.log(v) for v in loo]
    df = lift_df(logs)
    assert shown["attn_to_punct_lift_df"] == df and 1 <= df < 15
    se = math.sqrt(15 / 16 * sum((x - sum(logs) / 16) ** 2 for x in logs))
    assert shown["attn_to_punct_lift_lo"] == pytest.approx(value * math.exp(-t95(df) * se), rel=1e-12)
    row = head(0, 0)
    row.update({k: v for k, v in shown.items() if k.startswith("attn_to_punct_lift")})
    tests = [dict(zip(role_tests.COLUMNS, r)) for r in role_tests.assign([row], CONTEXT, groups=GROUPS, alpha=1.0)]
    punct = next(t for t in tests if t["metric"] == "attn_to_punct_lift")
    assert punct["p"] == pytest.approx(t_sf((math.log(value) - math.log(role_rules.PUNCT_MIN)) / se, df), rel=1e-9)
    assert (punct["value_lo"], punct["value_hi"]) == (shown["attn_to_punct_lift_lo"], shown["attn_to_punct_lift_hi"])
    linear_se = jackknife_halfwidth(loo) / t95(15)
    # the test before (the symmetric linear interval, 15 df) gave another p: 0.125 against 0.099
    assert punct["p"] != pytest.approx(t_sf((value - role_rules.PUNCT_MIN) / linear_se, 15), rel=0.05)
