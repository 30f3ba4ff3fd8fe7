"""What a reader of Michel et al. 2019 ("Are Sixteen Heads Really Better than One?") asks of a run's
stored effects (SPEC §9), answered without hand computation: importance normalised within its layer,
how many heads individually matter, how many heads can go before the objective rises by X, every
layer reduced to its most important head, and each head's effects beside what it does. Known
answers on hand-made values, then end to end on a small random decoder."""

from __future__ import annotations

import json
import math
import shutil

import pytest

ARGS = ["--seq-len", "32", "--sentences", "punct"]


# --- known answers --------------------------------------------------------------------------------


def test_layer_normalisation_divides_by_the_layers_l2_norm() -> None:
    from headatlas.service.reports.effect_queries import layer_normalised

    got = layer_normalised(
        {(0, 0): 3.0, (0, 1): 4.0, (1, 0): -1.0, (1, 1): 1.0, (2, 0): 0.0, (2, 1): 0.0, (3, 0): 2.0, (3, 1): None}
    )
    assert got[(0, 0)] == pytest.approx(0.6) and got[(0, 1)] == pytest.approx(0.8)
    assert got[(1, 0)] == pytest.approx(-1 / math.sqrt(2)) and got[(1, 1)] == pytest.approx(1 / math.sqrt(2))
    assert got[(2, 0)] is None and got[(2, 1)] is None  # a layer whose every value is 0 has no norm
    assert got[(3, 0)] is None and got[(3, 1)] is None  # a head without a value leaves its layer's norm unknown


# --- end to end on a small random decoder ----------------------------------------------------------


@pytest.fixture(scope="module")
def michel_run(tmp_path_factory, demo_corpus):
    """A decoder run (next-token loss) with every kind of effect on its first 5 windows and the
    synthetic probe: (database, corpus)."""
    from conftest import invoke_cli

    folder = tmp_path_factory.mktemp("michel")
    corpus = folder / "corpus.txt"
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:3]
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    db = str(folder / "m.duckdb")
    extra = ["--effects", "zero,mean,gradient", "--effect-windows", "5", "--replicates", "window"]
    extra += ["--probe", "--probe-sequences", "4", "--probe-length", "8"]
    done = invoke_cli("analyze", str(corpus), "--model", "random:gpt2", *ARGS, "--db", db, "--name", "m", *extra)
    assert done.returncode == 0, done.stderr
    return db, corpus


def _effects(db: str):
    import headatlas

    table = headatlas.connect(db).run("m").effects()
    return table, table.to_pylist()


def test_effects_carry_each_effect_normalised_within_its_layer(michel_run) -> None:
    """importance_layer (and effect_mean_layer, effect_zero_layer) is the head's value over the ℓ2
    norm of its layer's values: each layer's squares sum to 1, the values equal the division done
    here, and each has an interval holding it."""
    db, _corpus = michel_run
    _table, rows = _effects(db)
    assert len(rows) == 8
    for column in ("importance", "effect_mean", "effect_zero"):
        for layer in (0, 1):
            heads = [r for r in rows if r["layer"] == layer]
            norm = math.sqrt(sum(r[column] ** 2 for r in heads))
            for r in heads:
                assert r[f"{column}_layer"] == pytest.approx(r[column] / norm, rel=1e-9)
                assert r[f"{column}_layer_lo"] <= r[f"{column}_layer"] <= r[f"{column}_layer_hi"]
            assert sum(r[f"{column}_layer"] ** 2 for r in heads) == pytest.approx(1.0)
    assert all(0 <= r["importance_layer"] <= 1 for r in rows)
    import headatlas

    top = headatlas.connect(db).run("m").effects(sort="importance_layer").to_pylist()
    assert [r["importance_layer"] for r in top] == sorted((r["importance_layer"] for r in rows), reverse=True)


def test_effects_count_the_heads_whose_interval_lies_above_zero(michel_run) -> None:
    db, _corpus = michel_run
    table, rows = _effects(db)
    note = next(n for n in table.notes if "with 95% confidence" in n)
    for column in ("effect_mean", "effect_zero"):
        above = sum(1 for r in rows if r[f"{column}_lo"] > 0)
        below = sum(1 for r in rows if r[f"{column}_hi"] < 0)
        assert (
            f"{column}: {above} of 8 heads above 0 with 95% confidence (lower bound > 0), "
            f"{below} below 0 (upper bound < 0): {above + below} matter individually (the interval excludes 0)"
        ) in note
    above = sum(1 for r in rows if r["importance_lo"] > 0)
    assert f"importance: {above} of 8 heads above 0" in note and "≥ 0 by construction" in note
    assert "1 − cos" not in note  # a loss: an effect can be below 0


def test_a_drift_objective_says_above_zero_is_no_finding(tmp_path, small_corpus, cli) -> None:
    """Under embedding drift (1 − cos) every effect is ≥ 0 by construction: the count says so."""
    import headatlas

    db = str(tmp_path / "d.duckdb")
    extra = ["--effects", "zero,mean", "--effect-windows", "4", "--replicates", "window", "--name", "d"]
    done = cli("analyze", str(small_corpus), "--model", "random:tiny", *ARGS, "--db", db, *extra)
    assert done.returncode == 0, done.stderr
    table = headatlas.connect(db).run("d").effects()
    note = next(n for n in table.notes if "with 95% confidence" in n)
    assert "embedding_drift: 1 − cos ≥ 0 for any change" in note and "not a finding" in note


def test_effects_sit_beside_role_noise_share_and_probe_scores(michel_run) -> None:
    from sqlalchemy import text

    from headatlas.service.reports import roles
    from headatlas.service.storage.store import Store

    db, _corpus = michel_run
    _table, rows = _effects(db)
    store = Store(db)
    run = store.get_run("m")
    with store.read() as conn:
        names, role_rows = roles.roles(conn, run.run_id)
        probe = {
            (r[0], r[1]): r[2:]
            for r in conn.execute(
                text(
                    "SELECT layer, head, induction_score, duplicate_score, prev_token_score FROM probe_scores "
                    "WHERE run_id = :r"
                ),
                {"r": run.run_id},
            )
        }
        noise = dict(
            ((r[0], r[1]), r[2])
            for r in conn.execute(
                text("SELECT layer, head, noise_share FROM head_metrics WHERE run_id = :r"), {"r": run.run_id}
            )
        )
    primary = {(r[0], r[1]): r[2] for r in role_rows if r[names.index("primary")]}
    assert len(probe) == 8
    for r in rows:
        at = (r["layer"], r["head"])
        assert r["role"] == primary[at]
        assert r["noise_share"] == pytest.approx(noise[at])
        assert (r["induction_score"], r["duplicate_score"], r["prev_token_score"]) == pytest.approx(probe[at])


def test_effects_run_table_fits_100_columns_and_csv_json_hold_every_column(michel_run, cli, tmp_path) -> None:
    db, _corpus = michel_run
    copy = str(tmp_path / "copy.duckdb")  # `effects RUN` stores into the run it shows
    shutil.copy(db, copy)
    done = cli(
        "effects", "m", "--db", copy, "--windows", "5", "--effects", "zero,mean,gradient", env={"COLUMNS": "100"}
    )
    assert done.returncode == 0, done.stderr
    table_lines = [line for line in done.stdout.splitlines() if line.strip()]
    header = next(line for line in table_lines if line.startswith("layer"))
    assert "importance_layer" in header and "effect_mean_layer" in header and "role" in header
    assert max(len(line) for line in table_lines) <= 100
    assert "heads above 0 with 95% confidence" in " ".join(done.stderr.split())
    listed = json.loads(
        cli(
            "effects", "m", "--db", copy, "--windows", "5", "--effects", "zero,mean,gradient", "--format", "json"
        ).stdout
    )
    keys = listed[0].keys()
    assert {"importance_layer", "importance_layer_lo", "effect_mean_layer", "role", "noise_share"} <= keys
    assert {"induction_score", "prev_token_score"} <= keys
    picked = cli(
        "effects",
        "m",
        "--db",
        copy,
        "--windows",
        "5",
        "--effects",
        "zero,mean,gradient",
        "--columns",
        "layer,head,noise_share,role",
    )
    assert picked.returncode == 0, picked.stderr
    assert "noise_share" in picked.stdout


# --- prune --until and one_per_layer ----------------------------------------------------------------

CURVE = ["order", "step", "heads_removed", "fraction", "objective", "objective_lo", "objective_hi"]
CURVE += ["increase", "increase_lo", "increase_hi"]


def _curve(order: str, increases, highs, removed):
    rows = [
        (order, step, n, n / 8, 3.0 + up, None, None, up, up - (hi - up), hi)
        for step, (n, up, hi) in enumerate(zip((0, 2, 4, 6, 8), increases, highs))
    ]
    return rows, removed


def test_until_takes_the_last_step_before_the_upper_bound_first_exceeds_x() -> None:
    """Steps remove 0, 2, 4, 6, 8 heads; increases 0, .01, .03, .02, .2 with upper bounds 0, .02,
    .04, .06, .3: until 0.05 stops at 4 heads (6 heads' bound .06 exceeds it, though its point
    estimate does not); 10% of the rise with every head removed (0.02) at 2 heads; without
    intervals the point estimate decides."""
    from headatlas.service.operations.prune_michel import until

    removed = ["", "1.0 0.3", "0.1 1.2", "0.0 0.2", "1.1 1.3"]
    rows, _ = _curve("effect", (0, 0.01, 0.03, 0.02, 0.2), (0, 0.02, 0.04, 0.06, 0.3), removed)
    other, _ = _curve("noise", (0, 0, 0, 0, 0.2), (0, 0, 0, 0, 0.3), removed)
    got = until(CURVE, other + rows, removed + removed, limit=0.05, unit="nats", order="effect")
    assert (got.step, got.heads_removed, got.total) == (2, 4, 8)
    assert got.heads == ["0.1", "0.3", "1.0", "1.2"] and got.bound == "upper bound"
    assert got.next_step is not None and got.next_step[0] == 6
    assert "the effect order removes 4 of 8 heads" in got.text() and "removed: 0.1 0.3 1.0 1.2" in got.text()
    share = until(CURVE, rows, removed, limit="10%", unit="nats", order="effect")
    assert share.limit == pytest.approx(0.02) and share.heads_removed == 2
    assert "(10% of the rise with every head removed)" in share.text()
    everything = until(CURVE, rows, removed, limit=1.0, unit="nats", order="effect")
    assert everything.heads_removed == 8 and everything.next_step is None
    assert until(CURVE, rows, removed, limit=0, unit="nats", order="effect").heads_removed == 0
    bare = [(*r[:8], float("nan"), float("nan")) for r in rows]  # no intervals: the point estimate
    point = until(CURVE, bare, removed, limit=0.025, unit="nats", order="effect")
    assert point.heads_removed == 2 and point.bound.startswith("point estimate")


def test_until_reads_the_effect_curve_else_importance_else_the_order_named() -> None:
    from headatlas.service.errors import ParameterError
    from headatlas.service.operations.prune_michel import chosen_order, parse_until

    assert chosen_order(["effect", "importance", "noise"], None) == "effect"
    assert chosen_order(["importance", "noise", "one_per_layer"], None) == "importance"
    assert chosen_order(["effect", "noise"], ["noise", "effect"]) == "noise"
    assert chosen_order(["effect", "random:0", "random:1"], ["random"]) == "random:0"
    with pytest.raises(ParameterError, match="effect or importance"):
        chosen_order(["noise", "random:0"], None)
    assert parse_until("10%") == (pytest.approx(0.1), True) and parse_until("0.05") == (0.05, False)
    for bad in ("ten", "-0.1", "nan"):
        with pytest.raises(ParameterError, match="--until"):
            parse_until(bad)


def test_one_per_layer_keeps_each_layers_largest_head() -> None:
    import numpy as np

    from headatlas.service.operations.prune_michel import one_per_layer

    effect = np.array([[0.1, 0.5, 0.5, -1.0], [2.0, 0.0, 0.0, 0.0]])
    assert one_per_layer(effect, None) == ([(0, 1), (1, 0)], "mean-ablation effect")  # ties: the lower head
    assert one_per_layer(None, -effect) == ([(0, 3), (1, 1)], "gradient importance")
    assert one_per_layer(None, None) is None


def test_prune_measures_one_head_per_layer_and_answers_until(michel_run, cli, tmp_path) -> None:
    """The one_per_layer row removes every head but each layer's of largest stored effect_mean, in
    one step, with its increase's interval; --until reads the stored effect curve as the rule
    says, and the API gives the same line."""
    import headatlas

    db, _corpus = michel_run
    copy = str(tmp_path / "copy.duckdb")
    shutil.copy(db, copy)
    args = ["m", "--db", copy, "--windows", "4", "--step", "25%", "--seeds", "1", "--format", "json"]
    done = cli("prune", *args, "--until", "0.001", "--out", str(tmp_path / "c.png"))
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    mine = [r for r in rows if r["order"] == "one_per_layer"]
    assert [r["heads_removed"] for r in mine] == [0, 6]
    assert mine[1]["increase_lo"] <= mine[1]["increase"] <= mine[1]["increase_hi"]
    effects = headatlas.connect(copy).run("m").effects().to_pylist()
    kept = {
        (layer, max((r for r in effects if r["layer"] == layer), key=lambda r: (r["effect_mean"], -r["head"]))["head"])
        for layer in (0, 1)
    }
    view = headatlas.connect(copy).run("m")
    stored = view.prune(show=True)
    table = stored.to_pylist()
    assert table == rows
    said = " ".join(done.stderr.split())
    heads = " ".join(f"{layer}.{head}" for layer, head in sorted(kept))
    assert f"one_per_layer (each layer keeps only its head of largest mean-ablation effect: {heads})" in said
    # --until 0.001 by hand: the effect curve's last step before the first upper bound above 0.001
    curve = sorted((r for r in rows if r["order"] == "effect"), key=lambda r: r["step"])
    chosen = curve[0]
    for r in curve:
        if r["increase_hi"] > 0.001:
            break
        chosen = r
    assert f"the effect order removes {chosen['heads_removed']} of 8 heads" in said
    api = view.prune(show=True, until=0.001)
    line = next(n for n in api.notes if n.startswith("until "))
    assert " ".join(line.split()) in said
    refused = cli("prune", "m", "--db", copy, "--show", "--until", "lots")
    assert refused.returncode != 0 and "--until 'lots'" in refused.stderr
