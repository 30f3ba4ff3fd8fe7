"""Memory curves and streaming policies (SPEC §10): known answers on a random decoder (GPT-2, Llama
with grouped-query attention) and on a stored run of random:gpt2.

By hand: the memory formula; every KV head streaming together through ``streaming_heads`` is, for
one head, the streaming effect measured by its own path (restart from the layer's input, stacked
copies); with W ≥ the window's length every step of a curve is the intact model exactly and saves
0 bytes; a policy whose budget is below the first step's increase is all-full, and verified it
changes the objective by 0 exactly; the DuoAttention files read back as written."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import random_batch

from headatlas.service.measures import streaming as st


def test_the_memory_formula_by_hand() -> None:
    # 2 layers × 3 KV heads of 8 dimensions, 100 tokens in 2 bytes: 2 · 2 · 3 · 8 · 100 · 2
    assert st.kv_cache_bytes(layers=2, kv_heads=3, d_head=8, n=100, kv_bytes=2) == 19_200
    # 4 heads streaming with S = 4, W = 16 keep 20 of 100 keys: 4 · 2 · 8 · 80 · 2
    assert st.memory_saved(4, d_head=8, n=100, sink=4, recent=16, kv_bytes=2) == 10_240
    assert st.memory_saved(6, d_head=8, n=100, sink=4, recent=96, kv_bytes=2) == 0  # n ≤ S + W
    assert st.memory_saved(0, d_head=8, n=100, sink=0, recent=1, kv_bytes=4) == 0


def _with_heads(model, ids, mask):
    """``O`` per window ``[window]`` with a list of (layer, KV head) streaming at once, through the
    curve's evaluation path (``objective_under`` with ``streaming_heads``): a function of the heads,
    S and W."""
    from headatlas.service.measures.effects import _run_model
    from headatlas.service.measures.objectives import objective_of, wide
    from headatlas.service.operations.prune_curves import objective_under, prepared

    objective = objective_of(model)
    (batch,) = prepared(model, [SimpleNamespace(input_ids=ids, attention_mask=mask, window_ids=None)], objective)
    with torch.no_grad():
        intact = [wide(_run_model(model, batch[0], batch[2]))]

    def run(heads, sink, recent):
        def edit(model_ids):
            return st.streaming_heads(model, heads, sink=sink, recent=recent, n_pos=model_ids.shape[1])

        return objective_under(model, [batch], intact, objective, edit)

    return run


@pytest.mark.parametrize("family", ["random:gpt2", "random:llama"])
def test_one_head_streaming_in_a_policy_is_its_streaming_effect(family) -> None:
    from headatlas.service.engine.model import load_model

    model = load_model(family, device="cpu")
    ids, mask = random_batch()
    effects = st.streaming_effects(model, ids, mask, sink=1, recent=3)
    run = _with_heads(model, ids, mask)
    base = run([], 1, 3)
    assert np.array_equal(base, effects.intact.numpy())  # no head streams: the intact pass
    for layer, kv in ((0, 0), (model.n_layers - 1, model.n_kv_heads - 1)):
        np.testing.assert_allclose(run([(layer, kv)], 1, 3) - base, effects.effect[:, layer, kv].numpy(), atol=2e-5)
    # every KV head streaming, but W ≥ n hides nothing: the intact pass exactly
    every = [(layer, kv) for layer in range(model.n_layers) for kv in range(model.n_kv_heads)]
    assert np.array_equal(run(every, 0, 12), base)


def test_one_head_streaming_in_a_policy_is_its_streaming_effect_on_smollm2(smollm2, demo_corpus) -> None:
    """The same on the real grouped-query model (three query heads a KV head), one window of 48
    tokens, each KV head of a late layer."""
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.windows import TokenClasses, collate, document_windows
    from headatlas.service.params import AnalysisParams

    tokens = TokenClasses.for_model(smollm2)
    doc = next(iter_documents(str(demo_corpus)))
    window = document_windows(doc, smollm2.tokenizer, tokens, smollm2.tokenizer_key, AnalysisParams(seq_len=48))[0]
    batch = collate([window], tokens.pad_id)
    late = smollm2.n_layers - 3  # a late layer: its restricted passes replay three layers
    effects = st.streaming_effects(smollm2, batch.input_ids, batch.attention_mask, sink=4, recent=8, layers=[late])
    run = _with_heads(smollm2, batch.input_ids, batch.attention_mask)
    base = run([], 4, 8)
    for kv in range(smollm2.n_kv_heads):
        got = run([(late, kv)], 4, 8) - base
        np.testing.assert_allclose(got, effects.effect[:, late, kv].numpy(), atol=2e-5)
    assert effects.effect[0, late].abs().max() > 1e-3  # the restriction changes something to compare


@pytest.fixture(scope="module")
def decoder_run(tmp_path_factory, demo_corpus):
    """A run of random:gpt2 (next-token loss) on six documents, grouped by window: (database, corpus)."""
    from conftest import invoke_cli

    folder = tmp_path_factory.mktemp("memory")
    corpus = folder / "corpus.txt"
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:6]
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    db = str(folder / "mem.duckdb")
    args = ["--seq-len", "32", "--sentences", "punct", "--replicates", "window"]
    done = invoke_cli("analyze", str(corpus), "--model", "random:gpt2", *args, "--db", db, "--name", "mem")
    assert done.returncode == 0, done.stderr
    return db, corpus


def test_a_memory_curve_and_its_policy(decoder_run, cli, tmp_path) -> None:
    import headatlas
    from headatlas.service.engine.model import load_model
    from headatlas.service.operations import streaming_policy as sp
    from headatlas.service.storage.store import Store
    from headatlas.service.storage.streaming_curve_rows import load_memory_curve

    db, _corpus = decoder_run
    curve = ["prune", "mem", "--streaming", "--sink", "1", "--recent", "4", "--db", db]
    nothing = cli("policy", "mem", "--max-loss", "0.1", "--db", db)
    assert nothing.returncode == 2 and "has no memory curve" in nothing.stderr, nothing.stderr
    refused = cli(*curve)
    assert refused.returncode == 2, refused.stderr
    assert "run `headatlas effects mem --streaming --sink 1 --recent 4` first" in refused.stderr
    assert "Traceback" not in refused.stderr
    done = cli("effects", "mem", "--streaming", "--sink", "1", "--recent", "4", "--windows", "4", "--db", db)
    assert done.returncode == 0, done.stderr
    figure = tmp_path / "memory.png"
    args = ["--order", "effect,beyond,long_range,noise,layer,sinks,random", "--seeds", "2", "--step", "25%"]
    done = cli(*curve, *args, "--windows", "6", "--format", "json", "--out", str(figure))
    assert done.returncode == 0, done.stderr
    assert figure.stat().st_size > 0 and "memory saved at a loss increase of 0.05" in done.stderr
    rows = json.loads(done.stdout)
    model = load_model("random:gpt2", device="cpu")
    run = Store(db).get_run("mem")
    with Store(db).read() as conn:
        saved = load_memory_curve(conn, run.run_id)
    meta = saved.meta
    # evaluation windows: none of the windows the streaming effects (which chose the order) were measured on
    chosen, evaluated = meta["selection_windows"].split(), meta["evaluation_windows"].split()
    assert len(chosen) == 4 and len(evaluated) == 6 and not set(chosen) & set(evaluated)
    n, total = meta["seq_len"], model.n_layers * model.n_kv_heads
    assert n == 32 and meta["kv_bytes"] == 4  # float32
    assert meta["full_cache"] == 2 * model.n_layers * model.n_kv_heads * model.d_head * n * 4
    orders = {r["order"] for r in rows}
    assert orders == {"effect", "beyond", "long_range", "noise", "layer", "sinks", "random:0", "random:1"}
    for row in rows:
        by_hand = row["kv_heads_streaming"] * 2 * model.d_head * (n - 1 - 4) * 4
        assert row["memory_saved"] == by_hand and row["memory_share"] == pytest.approx(by_hand / meta["full_cache"])
        if row["step"] == 0:
            assert row["increase"] == 0.0 and row["kv_heads_streaming"] == 0
    last = [r for r in rows if r["order"] == "layer"][-1]
    assert last["kv_heads_streaming"] == total and last["increase"] != 0  # every KV head at W = 4 of 32 tokens
    # the effect order: the stored streaming effect, smallest first, one step's KV heads a row
    effect_steps = saved.steps_of("effect")
    stored = headatlas.connect(db).run("mem").streaming(sink=1, recent=4, show=True)
    effect = {(r["layer"], r["kv_head"]): r["effect"] for r in stored.arrow.to_pylist()}
    order = [h for _row, heads in effect_steps for h in heads]
    assert len(order) == total and [effect[h] for h in order] == sorted(effect.values())

    # the policy: the longest prefix whose increase stays ≤ X
    first = effect_steps[1][0][saved.columns.index("increase")]
    none = sp.choose(Store(db), "mem", first - 1.0)  # below the first step's increase: all full
    assert none.streaming == [] and (none.full == 1).all()
    shown = cli("policy", "mem", "--max-loss", str(first - 1.0), "--verify", "--windows", "3", "--db", db)
    assert shown.returncode == 0, shown.stderr
    said = json.loads(shown.stdout)
    assert said["verification"]["change"][0] == 0.0  # nothing streams: the intact model exactly
    assert not set(said["verification"]["windows"]) & (set(chosen) | set(evaluated))
    budget = max(r["increase"] for r in rows if r["order"] == "effect") + 1.0
    everything = sp.choose(Store(db), "mem", budget)
    assert sorted(everything.streaming) == sorted(order) and (everything.full == 0).all()
    increases = [row[saved.columns.index("increase")] for row, _h in effect_steps]
    middle = sorted(increases)[len(increases) // 2]
    policy = sp.choose(Store(db), "mem", middle)
    k = next((i for i in range(1, len(increases)) if increases[i] > middle), len(increases)) - 1  # step 0 always
    assert policy.streaming == [h for _row, heads in effect_steps[1 : k + 1] for h in heads]
    folder = tmp_path / "duo"
    done = cli("policy", "mem", "--max-loss", str(middle), "--format", "duo", "--out", str(folder), "--db", db)
    assert done.returncode == 0, done.stderr
    full, sink, recent = sp.read_duo(folder)
    assert (sink, recent) == (1, 4) and full.shape == (model.n_layers, model.n_kv_heads)
    assert np.array_equal(full, policy.full)
    assert (folder / "full_attention_heads.tsv").read_text().count("\n") == model.n_layers
    done = cli("policy", "mem", "--max-loss", str(middle), "--db", db)
    said = json.loads(done.stdout)
    assert said["run"]["name"] == "mem" and said["window_length"] == 32 and said["objective"] == meta["objective"]
    assert (said["sink"], said["recent"], said["order"]) == (1, 4, "effect")
    assert said["full_attention_heads"] == policy.full.tolist()
    assert len(said["evidence"]) == total and all(len(e["effect"]) == 3 for e in said["evidence"])
    # the Python API: the same curve and policy
    api = headatlas.connect(db).run("mem")
    assert api.memory_curve(show=True).arrow.column("memory_saved").to_pylist() == [r["memory_saved"] for r in rows]
    assert api.policy(middle)["full_attention_heads"] == policy.full.tolist()
    for args, want in (
        (["policy", "mem", "--max-loss", "nan"], "--max-loss"),
        (["policy", "mem", "--max-loss", "0.1", "--format", "csv"], "--format"),
        (["policy", "mem", "--max-loss", "0.1", "--order", "importance"], "holds the orders"),
        ([*curve, "--order", "importance"], "is not an order"),
        (["prune", "mem", "--max-loss", "0.1", "--db", db], "add --streaming"),
    ):
        bad = cli(*args, *([] if "--db" in args else ["--db", db]))
        assert bad.returncode == 2 and want in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_with_w_at_least_the_window_every_step_is_the_intact_model(decoder_run, cli) -> None:
    db, _corpus = decoder_run
    done = cli(
        "prune", "mem", "--streaming", "--sink", "0", "--recent", "32", "--order", "layer,noise,random",
        "--seeds", "1", "--step", "50%", "--windows", "4", "--format", "json", "--db", db,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    intact = rows[0]["objective"]
    assert len(rows) == 3 * 3
    for row in rows:
        assert row["objective"] == intact and row["increase"] == 0.0 and row["memory_saved"] == 0.0
