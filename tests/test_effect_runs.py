"""Causal effects inside an analysis (SPEC §9): stored as additive sums per replicate group, equal
to the per-window effects computed on their own, the same through the queue and on a lake; the
masked-LM objective against Hugging Face's own loss; stored pruning curves; the claim's
statistics by hand; old databases upgraded."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from headatlas.service.measures import effects as fx

ARGS = ["--seq-len", "32", "--sentences", "punct"]


def test_effect_options_keep_the_run_key_of_runs_without_them() -> None:
    from headatlas.service.analysis_options import build_params
    from headatlas.service.errors import ParameterError

    plain = build_params()
    assert "effects" not in plain.to_dict() and "effect_windows" not in plain.to_dict()
    assert build_params(effects="", effect_windows=9).key() == plain.key()  # unused: no other run
    chosen = build_params(effects="gradient, zero,mean,zero")
    assert chosen.effects == ("zero", "mean", "gradient") and chosen.key() != plain.key()
    assert build_params(effects=["mean"], effect_reference=7).to_dict()["effect_reference"] == 7
    assert "effect_reference" not in build_params(effects="zero").to_dict()  # no mean ablation, no reference set
    with pytest.raises(ParameterError, match="--effects 'pruned'"):
        build_params(effects="zero,pruned")


@pytest.fixture(scope="module")
def effect_run(tmp_path_factory, demo_corpus):
    """A decoder run (next-token loss) with every kind of effect on 5 windows (spread over its
    replicate groups), the mean ablation's reference set its first 4 windows: (database, corpus)."""
    from conftest import invoke_cli

    folder = tmp_path_factory.mktemp("effects")
    corpus = folder / "corpus.txt"
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:3]
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    db = str(folder / "fx.duckdb")
    extra = ["--effects", "zero,mean,gradient", "--effect-windows", "5", "--effect-reference", "4"]
    # groups by window: the 5 effect windows (of one document) fall in several groups, so each has an interval
    extra += ["--replicates", "window"]
    done = invoke_cli("analyze", str(corpus), "--model", "random:gpt2", *ARGS, "--db", db, "--name", "fx", *extra)
    assert done.returncode == 0, done.stderr
    assert "effects (zero, mean, gradient): 5 windows" in done.stderr  # the estimate, said first
    return db, corpus


@pytest.fixture(scope="module")
def measured_effects(effect_run):
    """The per-window effects of the run's 5 effect windows, computed here in one batch with means
    from its first 4 windows (other batches, other code than the run's): (windows, effects, positions)."""
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.run_plan import effect_targets, first_windows
    from headatlas.service.engine.windows import TokenClasses, collate
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.store import Store

    db, corpus = effect_run
    run = Store(db).get_run("fx")
    model = load_model("random:gpt2", device="cpu")
    params = AnalysisParams.from_dict(run.params)
    tokens = TokenClasses.for_model(model)
    windows = [w for _position, w in effect_targets(str(corpus), model, params, tokens)]
    assert len(windows) == 5
    reference = first_windows(str(corpus), model, params, tokens, 4)
    ref = collate(reference, tokens.pad_id)  # one batch: not how the run batched them
    means, positions = fx.reference_means(model, [(ref.input_ids, ref.attention_mask)])
    batch = collate(windows, tokens.pad_id)
    want = fx.head_effects(
        model, batch.input_ids, batch.attention_mask, kinds=fx.KINDS, means=means, window_ids=batch.window_ids
    )
    return windows, want, positions


def test_stored_effects_are_the_mean_of_each_windows_effect(effect_run, measured_effects) -> None:
    """The stored sums, read through the views, equal the per-window effects computed here on the
    run's 5 effect windows with means from its first 4 (other batches, other code)."""
    from headatlas.service.reports import queries
    from headatlas.service.storage.effect_rows import effect_windows, run_effects
    from headatlas.service.storage.store import Store

    db, _corpus = effect_run
    store = Store(db)
    run = store.get_run("fx")
    _windows, want, positions = measured_effects
    with store.read() as conn:
        columns, rows = queries.heads(conn, run.run_id, ci=True)
        recorded = run_effects(conn, run.run_id)
        measured = effect_windows(conn, run.run_id)
    assert measured == 5
    assert len(recorded) == 1 and recorded[0]["objective"] == "next_token_loss" and recorded[0]["unit"] == "nats"
    assert recorded[0]["reference_windows"] == 4 and recorded[0]["reference_positions"] == positions
    assert recorded[0]["kinds"] == "zero,mean,gradient"
    for row in rows:
        head = dict(zip(columns, row))
        at = (head["layer"], head["head"])
        for column, values in (
            ("effect_zero", want.effect["zero"]),
            ("effect_mean", want.effect["mean"]),
            ("importance", want.effect["gradient"]),
            ("drift_zero", want.drift["zero"]),
            ("drift_mean", want.drift["mean"]),
        ):
            assert head[column] == pytest.approx(float(values[:, at[0], at[1]].mean()), rel=1e-4, abs=1e-7), column
            assert head[f"{column}_lo"] is not None  # every effect has its interval
    assert all(dict(zip(columns, r))["importance"] >= 0 for r in rows)


def test_effect_intervals_rest_on_the_groups_that_hold_effect_windows(effect_run, measured_effects) -> None:
    """The run's 5 effect windows fill fewer replicate groups than its windows do: every effect's
    interval (query heads, run.effects(), a role's, compare, the ρ of prune) is the jackknife over
    the groups holding effect windows, computed here by hand from the per-window effects; the
    note under the effects names that count."""
    from sqlalchemy import text

    from headatlas.service.engine.results import window_group
    from headatlas.service.operations.prune_runs import stored_effects
    from headatlas.service.reports import compare, effect_queries, queries, role_effects
    from headatlas.service.reports.intervals import t95
    from headatlas.service.storage.effect_rows import effect_note
    from headatlas.service.storage.store import Store

    db, _corpus = effect_run
    store = Store(db)
    run = store.get_run("fx")
    windows, want, _positions = measured_effects
    groups = np.array([window_group("window", window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in windows])
    present = np.unique(groups)
    effect = want.effect["mean"].numpy()  # [window, layer, head]
    r = len(present)
    drops = np.stack([effect[groups != g].mean(axis=0) for g in present])
    half = t95(r - 1) * np.sqrt((r - 1) / r * ((drops - drops.mean(axis=0)) ** 2).sum(axis=0))
    with store.read() as conn:
        run_groups = conn.execute(text("SELECT count(*) FROM run_reps WHERE run_id = :r"), {"r": run.run_id}).scalar()
        assert 2 <= r < run_groups  # the case in question: fewer groups hold effect windows
        columns, rows = queries.heads(conn, run.run_id, ci=True)
        fx_columns, fx_rows = effect_queries.effects(conn, run.run_id, ci=True)
        names, role_rows = role_effects.with_effects(conn, run.run_id, ["layer", "head"], [(0, 1), (1, 2)])
        compared = compare.compare(conn, run, run, metrics=["effect_mean"], heads=True)
        _effect, _importance, effect_drops, importance_drops = stored_effects(conn, run.run_id)
        note = effect_note(conn, run.run_id)
    for table_columns, table_rows in ((columns, rows), (fx_columns, fx_rows)):
        for row in table_rows:
            head = dict(zip(table_columns, row))
            at = head["layer"], head["head"]
            assert head["effect_mean_hi"] - head["effect_mean"] == pytest.approx(half[at], rel=1e-3, abs=1e-9), at
    for layer, head, _value, lo, hi in role_rows:
        assert (hi - lo) / 2 == pytest.approx(half[layer, head], rel=1e-3, abs=1e-9)
    c = compared[0]
    for row in compared[1]:
        cell = dict(zip(c, row))
        at = cell["layer_a"], cell["head"]
        assert cell["value_a_hi"] - cell["value_a"] == pytest.approx(half[at], rel=1e-3, abs=1e-9)
    assert len(effect_drops) == len(importance_drops) == r  # ρ's jackknife drops these groups alone
    assert f"the {r} replicate groups that hold these windows" in note


def test_query_heads_roles_metrics_and_the_api_show_the_effects(effect_run, cli) -> None:
    import headatlas

    db, _corpus = effect_run
    done = cli("query", "heads", "--db", db, "--ci", "--columns", "effect_mean,effect_zero,importance,drift_mean")
    assert done.returncode == 0, done.stderr
    assert "effect_mean" in done.stdout and "[" in done.stdout  # the interval folded into its cell
    assert "O = next_token_loss (nats)" in done.stdout  # what the effects are measured against
    default = cli("query", "heads", "--db", db)
    assert "effect_mean" in default.stdout  # the run's main effect joins the default columns
    rows = json.loads(cli("query", "heads", "--db", db, "--ci", "--format", "json").stdout)
    assert {"effect_mean_lo", "importance_hi", "drift_zero"} <= rows[0].keys()
    roles = cli("query", "roles", "--db", db)
    assert roles.returncode == 0, roles.stderr
    assert "removal costs" in roles.stdout and "effect" in roles.stdout
    metrics = cli("metrics", "--format", "json")
    listed = {r["column"]: r for r in json.loads(metrics.stdout)}
    assert listed["effect_mean"]["spec"] == "§9" and "O(ablated) − O(intact)" in listed["effect_mean"]["against"]
    sort = cli("query", "heads", "--db", db, "--sort", "effect_zero", "--top", "1", "--format", "json")
    top = json.loads(sort.stdout)[0]["effect_zero"]
    assert top == max(r["effect_zero"] for r in rows)
    table = headatlas.connect(db).run("fx").effects()
    assert table.num_rows == 8 and "next_token_loss" in table.notes[0]
    compared = cli("compare", "fx", "fx", "--db", db, "--metric", "effect_mean", "--format", "json")
    assert compared.returncode == 0, compared.stderr
    assert {r["difference"] for r in json.loads(compared.stdout)} == {0.0}


def test_the_effects_a_run_holds_are_counted_in_its_stored_heads_as_in_its_views(effect_run) -> None:
    """Which effects the run holds (every reader of its effects and roles asks): from the stored
    heads while they are current, the same counts as the view's; tampered stored heads (each value
    of a column NULL) are what is counted, so the stored ones are read."""
    from sqlalchemy import text

    from headatlas.service.reports import stored
    from headatlas.service.reports.effect_queries import HEAD_EFFECTS, held_values
    from headatlas.service.storage.store import Store

    db, _corpus = effect_run
    with Store(db).read() as conn:
        run = Store(db).get_run("fx").run_id
        got = held_values(conn, run, HEAD_EFFECTS)
        with stored.computed():
            assert got == held_values(conn, run, HEAD_EFFECTS)
        assert got["effect_mean"] == 8 and got["importance"] == 8  # 2 layers x 4 heads, each measured
        names, rows = stored.load(conn, run, "heads")
    column = names.index("effect_mean")
    nulled = [[None if i == column else v for i, v in enumerate(r)] for r in rows]
    with Store(db).write() as conn:
        conn.execute(
            text("UPDATE run_results SET rows = :rows WHERE run_id = :r AND kind = 'heads'"),
            {"rows": json.dumps(nulled), "r": run},
        )
    try:
        with Store(db).read() as conn:
            assert held_values(conn, run, ["effect_mean"]) == {"effect_mean": 0}
    finally:
        with Store(db).write() as conn:
            conn.execute(
                text("UPDATE run_results SET rows = :rows WHERE run_id = :r AND kind = 'heads'"),
                {"rows": json.dumps([list(r) for r in rows]), "r": run},
            )


def test_the_count_of_heads_that_matter_is_the_same_from_the_effects_a_command_has_read(effect_run) -> None:
    """`effects RUN` reads the run's effects once for its table and its note of the heads above 0."""
    from headatlas.service.reports.effect_queries import effects, significance_note
    from headatlas.service.storage.store import Store

    db, _corpus = effect_run
    with Store(db).read() as conn:
        run = Store(db).get_run("fx").run_id
        note = significance_note(conn, run)
        assert note is not None and "heads above 0 with 95% confidence" in note
        assert significance_note(conn, run, effects(conn, run, ci=True)) == note


def test_effects_asked_again_for_the_windows_a_run_holds_leave_its_stored_results_current(effect_run, cli, tmp_path):
    """`effects RUN` for the windows the run's analysis measured measures nothing, yet records them
    in the run's row: its results are stored again (else every later read computes them)."""
    import shutil

    from headatlas.service.storage import run_results
    from headatlas.service.storage.store import Store

    db = str(tmp_path / "copy.duckdb")
    shutil.copy(effect_run[0], db)
    done = cli("effects", "fx", "--effects", "zero,mean,gradient", "--windows", "5", "--format", "json", "--db", db)
    assert done.returncode == 0, done.stderr
    assert "0 windows measured now" in done.stderr
    with Store(db).read() as conn:
        assert run_results.is_fresh(conn, Store(db).get_run("fx").run_id)


def test_prune_stores_its_curves_from_the_runs_stored_effects(effect_run, cli, tmp_path) -> None:
    db, _corpus = effect_run
    args = ["fx", "--db", db, "--windows", "4", "--step", "50%", "--seeds", "2", "--format", "json"]
    done = cli("prune", *args, "--out", str(tmp_path / "curves.png"))
    assert done.returncode == 0, done.stderr
    assert "orders from the run's stored effects (5 windows)" in done.stderr
    assert "the run's first 4 windows" in done.stderr  # the run's own reference set
    rows = json.loads(done.stdout)
    trivial = {"layer", "sinks", "output_norm", "output_variance"}
    michel = {"one_per_layer"}  # every layer reduced to its most important head
    assert {r["order"] for r in rows} == {"effect", "importance", "noise", "random:0", "random:1", *trivial, *michel}
    shown = cli("prune", "fx", "--db", db, "--show", "--format", "json")
    assert json.loads(shown.stdout) == rows  # stored, read back without measuring
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    report = cli("report", "fx", "--db", db, "--out", str(tmp_path / "r.html"))
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "Which heads the model needs" in page and "Pruning curves" in page
    atlas = cli("plot", "atlas", "--db", db, "--colour", "effect_mean", "--out", str(tmp_path / "a.png"))
    assert atlas.returncode == 0, atlas.stderr


def test_gradient_importance_of_a_drift_is_refused_before_the_run(tmp_path, small_corpus, cli) -> None:
    db = str(tmp_path / "r.duckdb")
    done = cli("analyze", str(small_corpus), "--model", "random:tiny", *ARGS, "--db", db, "--effects", "gradient")
    assert done.returncode == 2 and "not a loss" in done.stderr
    assert not (tmp_path / "r.duckdb").exists() or "runs" not in cli("runs", "--db", db).stdout


@pytest.mark.integration
def test_a_queued_run_stores_the_effects_the_embedded_run_stores(queue_cluster, tiny_model, demo_corpus, tmp_path):
    """One queued run: effect windows across two batches, mean ablation's means computed by a
    worker from the reference windows in the run's description."""
    from queue_support import assert_same_statistics, make_corpus, stored

    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.effect_rows import run_effects
    from headatlas.service.storage.store import Store

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=2, tag="effects")
    extra = ["--effects", "zero,mean", "--effect-windows", "6", "--effect-reference", "5"]
    ref = queue_cluster.submit(corpus, "--model", "random:tiny", *ARGS, "--batch-size", "4", *extra, "--wait")
    assert queue_cluster.wait_status(ref) == "done"
    queued_store = Store(queue_cluster.db)
    run_id = queued_store.get_run(ref).run_id
    params = build_params(seq_len=32, sentences="punct", effects="zero,mean", effect_windows=6, effect_reference=5)
    embedded = Store(tmp_path / "embedded.duckdb")
    run = analyze_corpus(
        str(corpus), store=embedded, model=tiny_model, params=params, corpus=survey_corpus(str(corpus)), batch_size=4
    )
    assert queued_store.get_run(run_id).run_key == run.run_key
    queued_sums, embedded_sums = stored(queue_cluster.db, run_id), stored(str(tmp_path / "embedded.duckdb"), run.run_id)
    assert_same_statistics(queued_sums, embedded_sums, 1e-5)  # the effect sums among them
    assert sum(row[-2] for row in queued_sums["run_chance"] if row[-2]) == 6  # effect_windows, in two batches
    with queued_store.read() as conn:
        queued = run_effects(conn, run_id)
    with embedded.read() as conn:
        local = run_effects(conn, run.run_id)
    # the means a worker computed and published for every worker of the run
    assert list(queue_cluster.redis.scan_iter(f"headatlas:*:effect_means:{run.run_key}"))
    assert len(queued) == 1 and queued[0]["reference_windows"] == local[0]["reference_windows"] == 5
    assert queued[0]["reference_fingerprint"] == local[0]["reference_fingerprint"]


@pytest.fixture(scope="module")
def bos_free_decoder(tmp_path_factory, demo_corpus):
    """A decoder whose tokenizer adds no BOS (random:gpt2's weights, the default model's tokenizer,
    saved as a model folder a worker can load), so that a window can be one token, and a corpus
    whose first document is one token: (model folder, corpus)."""
    from transformers import AutoTokenizer

    from headatlas.service.engine.model import default_model_dir, load_model

    folder = tmp_path_factory.mktemp("bos-free")
    load_model("random:gpt2", device="cpu").model.save_pretrained(folder / "model")
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(folder / "model")
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:2]
    corpus = folder / "one-token-first.txt"
    corpus.write_text("\n\n".join(["Hello", *docs]) + "\n", encoding="utf-8")
    return str(folder / "model"), corpus


# the rule of runs stored before effect windows were spread over the groups: the first N by position
ONE_TOKEN_PARAMS = {
    "seq_len": 16,
    "sentences": "punct",
    "effects": "zero,mean",
    "effect_windows": 3,
    "effect_spread": "first",
}


def _analyse_one_token_first(model, corpus, db, **kwargs):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    params = build_params(**ONE_TOKEN_PARAMS, effect_reference=2)
    return analyze_corpus(
        str(corpus), store=Store(db), model=model, params=params, corpus=survey_corpus(str(corpus)), **kwargs
    )


def test_an_interrupted_effect_run_resumed_ends_as_one_run_not_interrupted(bos_free_decoder, tmp_path) -> None:
    """--effect-windows N --effect-spread first (the rule of runs stored before, whose parameters
    have no effect_spread): the run's first N windows, counted by position, a one-token window of a
    decoder (no next token: no objective) among them. A run stopped after two windows (the
    one-token window and one measured) and resumed stores the effects of the run never stopped:
    the resumed run counts the one-token window as the queue does (windows 1-3, not 1-4)."""
    from queue_support import assert_same_statistics, stored

    from headatlas.service.engine.model import load_model
    from headatlas.service.storage.effect_rows import effect_note, effect_windows
    from headatlas.service.storage.store import Store

    folder, corpus = bos_free_decoder
    model = load_model(folder, device="cpu")
    whole = _analyse_one_token_first(model, corpus, tmp_path / "whole.duckdb", batch_size=2)
    calls = {"n": 0}

    def stop_after_two(_windows, _consumed):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _analyse_one_token_first(
            model, corpus, tmp_path / "resumed.duckdb", batch_size=2, flush_s=0, progress=stop_after_two
        )
    resumed_store = Store(tmp_path / "resumed.duckdb")
    with resumed_store.read() as conn:
        assert effect_windows(conn, resumed_store.get_run().run_id) == 1  # the one-token window measures nothing
    resumed = _analyse_one_token_first(model, corpus, tmp_path / "resumed.duckdb", batch_size=2)
    assert resumed.status == "done" and resumed.run_key == whole.run_key
    assert "effect_spread" not in resumed.params  # recorded as runs stored before the rule were
    assert_same_statistics(
        stored(str(tmp_path / "whole.duckdb"), whole.run_id), stored(str(tmp_path / "resumed.duckdb"), resumed.run_id)
    )
    with Store(tmp_path / "whole.duckdb").read() as conn:
        assert effect_windows(conn, whole.run_id) == 2  # windows 2 and 3 of the first 3
        assert "the run's first 3 windows less 1 whose objective is undefined" in effect_note(conn, whole.run_id)


@pytest.mark.integration
def test_a_queued_run_counts_a_one_token_window_among_the_effect_windows(queue_cluster, bos_free_decoder, tmp_path):
    """The queue's effect windows are the embedded run's: the first N by position, a one-token
    decoder window among them (measured by nothing)."""
    from queue_support import assert_same_statistics, stored

    from headatlas.service.engine.model import load_model
    from headatlas.service.storage.store import Store

    folder, corpus = bos_free_decoder
    embedded = _analyse_one_token_first(load_model(folder, device="cpu"), corpus, tmp_path / "e.duckdb", batch_size=2)
    extra = ["--effects", "zero,mean", "--effect-windows", "3", "--effect-reference", "2", "--effect-spread", "first"]
    ref = queue_cluster.submit(
        corpus, "--model", folder, "--seq-len", "16", "--sentences", "punct", "--batch-size", "2", *extra, "--wait"
    )
    assert queue_cluster.wait_status(ref) == "done"
    run_id = Store(queue_cluster.db).get_run(ref).run_id
    assert Store(queue_cluster.db).get_run(run_id).run_key == embedded.run_key
    queued_sums = stored(queue_cluster.db, run_id)
    assert_same_statistics(queued_sums, stored(str(tmp_path / "e.duckdb"), embedded.run_id), 1e-5)
    assert sum(row[-2] for row in queued_sums["run_chance"] if row[-2]) == 2  # effect_windows: 2 of the first 3


def test_effects_on_a_lake_are_those_on_a_file(lake, tiny_model, small_corpus, tmp_path) -> None:
    from queue_support import assert_same_statistics, stored

    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.effect_rows import run_effects
    from headatlas.service.storage.store import Store

    params = build_params(seq_len=32, sentences="punct", effects="zero,mean", effect_windows=3, effect_reference=2)

    def analyse(store):
        return analyze_corpus(
            str(small_corpus), store=store, model=tiny_model, params=params, corpus=survey_corpus(str(small_corpus))
        )

    on_file = analyse(Store(tmp_path / "f.duckdb"))
    lake_store = Store(lake.url, data_path=lake.data_path)
    on_lake = analyse(lake_store)
    assert_same_statistics(
        stored(lake_store.backend, on_lake.run_id), stored(str(tmp_path / "f.duckdb"), on_file.run_id)
    )
    with lake_store.read() as conn:
        assert run_effects(conn, on_lake.run_id)[0]["objective"] == "embedding_drift"


def test_the_masked_lm_objective_is_hugging_faces_loss_on_the_same_masks(tmp_path) -> None:
    """A checkpoint with an MLM head (saved here) is loaded with its head; the objective masks 15%
    of each window's non-special positions, fixed by the window id, and its loss is
    BertForMaskedLM's own on those labels."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from headatlas.service.engine.model import default_model_dir, load_model
    from headatlas.service.measures.objectives import mask_positions, objective_of

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
    )
    torch.manual_seed(0)
    BertForMaskedLM(config).save_pretrained(tmp_path / "mlm")
    tokenizer.save_pretrained(tmp_path / "mlm")
    model = load_model(str(tmp_path / "mlm"), device="cpu")
    objective = objective_of(model)
    assert objective.name == "masked_lm_loss" and objective.is_loss
    text = ["the cat sat on the mat and then it slept for a while", "a short one"]
    batch = tokenizer(text, padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    model_ids, targets = objective.prepare(ids, mask, ["w-a", "w-b"])
    valid = [i for i in range(1, int(mask[0].sum()) - 1)]
    assert (targets[0] >= 0).nonzero().flatten().tolist() == mask_positions("w-a", valid)
    assert (targets[0] >= 0).sum() == max(1, round(0.15 * len(valid)))
    assert objective.prepare(ids, mask, ["w-a", "w-b"])[1].equal(targets)  # fixed by the window id
    reference = BertForMaskedLM.from_pretrained(tmp_path / "mlm").eval()
    with torch.no_grad():
        final = fx._run_model(model, model_ids, mask)
        got = objective.per_window(final, targets, mask, final)
        for row in range(2):
            labels = targets[row : row + 1]
            want = reference(input_ids=model_ids[row : row + 1], attention_mask=mask[row : row + 1], labels=labels).loss
            assert got[row].item() == pytest.approx(want.item(), rel=1e-5)
    effects = fx.head_effects(model, ids, mask, kinds=("zero", "gradient"), window_ids=["w-a", "w-b"])
    assert torch.isfinite(effects.effect["zero"]).all() and (effects.effect["gradient"] >= 0).all()
    tiny = load_model("random:tiny-mlm", device="cpu")
    assert objective_of(tiny).name == "masked_lm_loss"
    plain = load_model("random:tiny", device="cpu")
    for name, value in plain.model.state_dict().items():  # random:tiny-mlm's encoder is random:tiny's
        assert torch.equal(value, tiny.model.state_dict()[name]), name


def test_minilm_intact_drift_is_zero_and_it_has_no_mlm_head(real_model) -> None:
    from headatlas.service.measures.objectives import objective_of, output_drift

    assert real_model.mlm_head() is None and objective_of(real_model).name == "embedding_drift"
    batch = real_model.tokenizer(
        ["Heads that matter.", "Some heads do not matter at all."], padding=True, return_tensors="pt"
    )
    got = fx.head_effects(real_model, batch["input_ids"], batch["attention_mask"], kinds=("zero",), layers=[5])
    assert got.intact.abs().max().item() < 1e-12  # the intact model against itself (float64 cosine)
    with torch.no_grad():
        final = fx._run_model(real_model, batch["input_ids"], batch["attention_mask"])
    assert output_drift(final, final, batch["attention_mask"]).abs().max().item() == 0.0
    assert (got.drift["zero"][:, 5] > 0).all() and torch.isnan(got.drift["zero"][:, 0]).all()


def test_the_area_interval_adds_the_seeds_spread_by_hand() -> None:
    from headatlas.service.operations.prune_curves import area_interval
    from headatlas.service.reports.intervals import jackknife_halfwidth, t95, t_quantile

    drops = [1.0, 1.2, 0.9, 1.1]
    seeds = [0.8, 1.3, 1.0]
    value, lo, hi = area_interval(1.05, drops, seeds)
    se_w = jackknife_halfwidth(drops) / t95(3)
    se_s = float(np.std(seeds, ddof=1)) / math.sqrt(3)
    se = math.sqrt(se_w**2 + se_s**2)
    df = se**4 / (se_w**4 / 3 + se_s**4 / 2)
    assert (
        value == 1.05
        and hi - value == pytest.approx(t_quantile(0.975, df) * se)
        and value - lo == pytest.approx(hi - value)
    )
    assert hi - lo > 2 * jackknife_halfwidth(drops)  # wider than the windows' interval alone
    only_windows = area_interval(1.05, drops, [0.9])  # one seed: its spread is unknown
    assert only_windows[2] - 1.05 == pytest.approx(jackknife_halfwidth(drops))
    assert math.isnan(area_interval(1.0, [1.0], seeds)[1])  # one group: no interval


def test_each_roles_effect_and_its_difference_from_the_roleless_by_hand() -> None:
    from headatlas.service.reports.intervals import jackknife_halfwidth
    from headatlas.service.reports.role_effects import difference, set_effect

    # drop -1: the whole run; 0..2: without each group
    effects = {
        -1: {(0, 0): 1.0, (0, 1): 3.0, (1, 0): 0.5},
        0: {(0, 0): 1.2, (0, 1): 2.8, (1, 0): 0.4},
        1: {(0, 0): 0.9, (0, 1): 3.3, (1, 0): 0.6},
        2: {(0, 0): 1.0, (0, 1): 2.9, (1, 0): 0.5},
    }
    value, lo, hi = set_effect(effects, [(0, 0), (0, 1)])
    assert value == 2.0 and hi - value == pytest.approx(jackknife_halfwidth([2.0, 2.1, 1.95]))
    gap, g_lo, g_hi = difference(effects, [(0, 0), (0, 1)], [(1, 0)])
    assert gap == 1.5 and g_hi - gap == pytest.approx(jackknife_halfwidth([1.6, 1.5, 1.45]))


def test_an_old_database_is_upgraded_with_the_effect_columns_null(tmp_path, tiny_model, small_corpus) -> None:
    """Down to 0012 (no effect sums, no prune tables) and up again: the run keeps every number,
    its effects read NULL (unavailable, not zero), and the new tables exist."""
    from sqlalchemy import text
    from test_decoder_metrics import _alembic

    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage import db
    from headatlas.service.storage.store import Store

    store = Store(tmp_path / "old.duckdb")
    run = analyze_corpus(
        str(small_corpus),
        store=store,
        model=tiny_model,
        params=build_params(seq_len=32, sentences="punct"),
        corpus=survey_corpus(str(small_corpus)),
    )
    query = "SELECT * FROM head_metrics WHERE run_id = :r ORDER BY layer, head"
    with store.read() as conn:
        before = [dict(r._mapping) for r in conn.execute(text(query), {"r": run.run_id})]
    _alembic(str(tmp_path / "old.duckdb"), "downgrade", "0012_fire_leases")
    assert db.upgrade(str(tmp_path / "old.duckdb")) == ("0012_fire_leases", db.head_revision())
    with store.read() as conn:
        after = [dict(r._mapping) for r in conn.execute(text(query), {"r": run.run_id})]
        tables = {r[0] for r in conn.execute(text("SELECT table_name FROM information_schema.tables"))}
    assert {"run_effects", "prunes", "prune_curves"} <= tables
    for old, new in zip(before, after, strict=True):
        assert new["effect_mean"] is None and new["importance"] is None
        for column, value in old.items():
            assert new[column] == pytest.approx(value, nan_ok=True), column


def test_a_control_run_gets_effects_on_the_same_objective(tmp_path, small_corpus, cli) -> None:
    """`--control` analyses the same windows through random weights with the same effects; a
    parent with a masked-LM head gives its control a (random) head, so both measure one objective."""
    db = str(tmp_path / "c.duckdb")
    extra = ["--effects", "zero", "--effect-windows", "2", "--control", "--name", "mlm"]
    done = cli("analyze", str(small_corpus), "--model", "random:tiny-mlm", *ARGS, "--db", db, *extra)
    assert done.returncode == 0, done.stderr
    for run in ("mlm", "mlm-control"):
        rows = json.loads(cli("sql", "--db", db, "--run", run, "SELECT * FROM run_effects", "--format", "json").stdout)
        assert [r["objective"] for r in rows] == ["masked_lm_loss"], run
        heads = json.loads(cli("query", "heads", "--db", db, "--run", run, "--format", "json").stdout)
        assert all(h["effect_zero"] is not None for h in heads), run


def test_prune_of_a_run_with_gradient_importance_alone_orders_by_importance(effect_run, cli, tmp_path) -> None:
    """A run that stores gradient importance alone (ablations too dear) is pruned by importance,
    noise and random orders, and its ρ is taken against the importance."""
    _db, corpus = effect_run
    db = str(tmp_path / "g.duckdb")
    extra = ["--effects", "gradient", "--effect-windows", "3", "--replicates", "window"]
    done = cli("analyze", str(corpus), "--model", "random:gpt2", *ARGS, "--db", db, "--name", "g", *extra)
    assert done.returncode == 0, done.stderr
    # the Python API prunes through the same operation: its refusals in Python's words, its curves the CLI's
    import headatlas

    view = headatlas.connect(db).run("g")
    with pytest.raises(ValueError, match=r"^orders=\['bogus'\]: 'bogus' is not an order; use effect, importance"):
        view.prune(orders=["bogus"])
    with pytest.raises(
        ValueError, match=r"^run 1 \(g\) has no stored pruning curves: call prune\(\) without show=True$"
    ):
        view.prune(show=True)
    args = ["g", "--db", db, "--windows", "3", "--step", "50%", "--seeds", "2", "--format", "json"]
    pruned = cli("prune", *args, "--order", "importance,noise,random")
    assert pruned.returncode == 0, pruned.stderr
    assert {r["order"] for r in json.loads(pruned.stdout)} == {"importance", "noise", "random:0", "random:1"}
    assert "Spearman ρ(noise_share, gradient importance)" in " ".join(pruned.stderr.split())
    assert view.prune(show=True).to_pylist() == json.loads(pruned.stdout)
