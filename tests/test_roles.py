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


def earned(rows):
    from headatlas.service.reports import roles

    out = {}
    for r in roles.assign(rows, CONTEXT):
        d = dict(zip(roles.COLUMNS, r))
        out.setdefault((d["layer"], d["head"]), []).append(d)
    return out


def test_roles_known_answers():
    got = earned(
        [
            head(0, 0, attn_to_prev=(0.9, 0.85, 0.95), short_range_share=(0.5, 0.45, 0.55)),
            head(0, 1, attn_to_prev=(0.3, 0.15, 0.45)),  # value past 0.2, interval reaches below: not earned
            head(0, 2, repetition_words_lift_dm=(14.0, 11.0, 17.0), attn_to_cls_lift=(30.0, 25.0, 35.0)),
            head(1, 0, within_sentence_lift_dm=(1.12, 1.06, 1.18)),
            head(1, 1, within_sentence_lift_dm=(1.12, 1.04, 1.20)),  # lower bound 1.04 < 1.05
            head(1, 2, short_range_share=(0.20, 0.193, 0.21)),  # 3 × 0.064 = 0.192
            head(2, 0, attn_entropy=(4.3, 4.25, 4.35)),  # ln 125 = 4.83: spread, measurably not uniform
            head(2, 1, attn_entropy=(4.75, 4.70, 4.80)),  # upper bound past 0.97 · ln n̄ = 4.68: uniform-like
            head(2, 2, attn_to_punct_lift=1.8, attn_to_sep_lift=(12.0, 10.5, 13.5)),  # punct without interval
            head(3, 0, attn_to_next=(0.25, 0.21, 0.29)),
        ]
    )
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
    local = got[(1, 2)][0]
    assert local["threshold"] == pytest.approx(3 * 0.064) and local["bound"] == "lower bound"
    assert (local["value"], local["value_lo"], local["value_hi"]) == (0.20, 0.193, 0.21)
    assert "short_range_chance" in local["rule"]
    punct = got[(2, 2)][0]
    assert punct["bound"] == "value" and punct["value_lo"] is None  # no interval: the value was tested
    broad = got[(2, 0)][0]
    assert broad["threshold"] == pytest.approx(0.75 * math.log(125))
    none = got[(0, 1)][0]
    assert none["metric"] is None and none["threshold"] is None


def test_undefined_metrics_earn_nothing():
    row = head(0, 0, attn_to_prev=(float("nan"), None, None), repetition_words_lift_dm=(None, None, None))
    assert [d["role"] for d in earned([row])[(0, 0)]] == ["none established"]


def _hand_run(n_layers, n_heads):
    """Hand-built roles of a run: head (l, h) gets the role numbered (l + h) % 10 (with
    ``none established`` as 9) and, on even heads, ``[CLS] sink`` as a second role."""
    from headatlas.service.reports import atlas_plots, roles

    rows = []
    for l in range(n_layers):
        for h in range(n_heads):
            primary = atlas_plots.ATLAS_ROLES[(l + h) % len(atlas_plots.ATLAS_ROLES)]
            rows.append((l, h, primary, True, None, None, None, None, None, None, ""))
            if h % 2 == 0 and primary not in ("[CLS] sink", roles.NONE):
                rows.append((l, h, "[CLS] sink", False, None, None, None, None, None, None, ""))
    return list(roles.COLUMNS), rows


@pytest.mark.parametrize("shape", [(12, 12), (24, 16)])
def test_atlas_figure_shows_each_heads_primary_role_readably(shape, tmp_path):
    from headatlas.service.reports import atlas_plots, plots

    n_layers, n_heads = shape
    columns, rows = _hand_run(n_layers, n_heads)
    fig, index = atlas_plots.figure_atlas(columns, rows, n_layers=n_layers, n_heads=n_heads, title="hand-built")
    drawn = np.ma.filled(fig.axes[0].images[0].get_array().astype(float), np.nan)
    expected = np.array([[(l + h) % len(atlas_plots.ATLAS_ROLES) for h in range(n_heads)] for l in range(n_layers)])
    assert np.array_equal(drawn, expected) and np.array_equal(index, expected)
    # every cell's letters name the roles it holds
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in fig.axes[0].texts}
    assert texts[(0, 0)] == "P" + "C" and texts[(0, 1)] == "N"
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
    assert legend[0].startswith("P  previous-token (")


def test_a_run_stored_before_replicate_groups_gets_no_interval(tmp_path):
    """Such a run (built by hand as headatlas stored it then) has no intervals: compare says so
    instead of a verdict; roles test the values (known answers: none here)."""
    from headatlas.service.reports import compare, roles
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
    assert [(r[0], r[1], r[2]) for r in rows] == [(0, 0, roles.NONE), (0, 1, roles.NONE)]
