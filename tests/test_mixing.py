"""Mixing measures (SPEC §6): gradients against finite differences and a one-output-at-a-time
loop, rollout against a hand-computed example, norm-based and ALTI against their definitions,
and the stored sums end to end through the CLI."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from headatlas.service.engine.model import model_blocks
from headatlas.service.engine.windows import TokenClasses, collate, document_windows
from headatlas.service.measures.attribution import gradient_norms, normalise_rows, trace, unit_outputs
from headatlas.service.measures.mixing import alti_layer, jsd, norm_based, rollout, value_vectors
from headatlas.service.params import AnalysisParams


@pytest.fixture(scope="module")
def tiny64(tiny_model):
    model = copy.deepcopy(tiny_model)
    model.model.double()
    return model


def _real_windows(model, demo_corpus, lengths):
    """Short real windows: the first words of the first documents of the shipped excerpt."""
    from headatlas.service.engine.corpus import iter_documents

    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    out = []
    for doc, n in zip(iter_documents(str(demo_corpus)), lengths):
        out.append(document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, AnalysisParams(seq_len=n))[0])
    return collate(out, tokens.pad_id)


@pytest.mark.parametrize("batched", [True, False], ids=["vmapped", "one-by-one"])
def test_gradients_match_finite_differences(tiny64, batched):
    ids = torch.tensor([[101, 4937, 1012, 102]])
    mask = torch.ones_like(ids)
    g = gradient_norms(tiny64, ids, mask, chunk_size=7, batched=batched)  # a chunk that does not divide the rows
    e0 = trace(tiny64, ids, mask).embeddings.clone()
    n, d = e0.shape[1], e0.shape[2]
    eps = 1e-6
    jac = torch.zeros(tiny64.n_layers, tiny64.n_heads + 1, n, n, d, dtype=torch.float64)
    for j in range(n):
        for k in range(d):
            outs = []
            for sign in (1, -1):
                e = e0.clone()
                e[0, j, k] += sign * eps
                tr = trace(tiny64, ids, mask, embeddings=e)
                outs.append(torch.stack([unit_outputs(tr, l, tiny64.n_heads)[0] for l in range(tiny64.n_layers)]))
            jac[..., j, k] = (outs[0] - outs[1]) / (2 * eps)
    fd = jac.norm(dim=-1)
    heads = slice(0, tiny64.n_heads)  # the layer rows of a fresh model are ~0 (LayerNorm γ = 1): skip
    rel = (g[0][:, heads] - fd[:, heads]).abs().max() / fd[:, heads].abs().max()
    assert rel <= 1e-3
    assert fd[:, heads].abs().max() > 1e-3  # the comparison is not between zeros


@pytest.mark.slow
def test_batched_matches_one_output_at_a_time_on_real_windows(real_model, demo_corpus):
    batch = _real_windows(real_model, demo_corpus, (8, 6))  # two windows, the second padded
    batched = gradient_norms(real_model, batch.input_ids, batch.attention_mask, chunk_size=300, batched=True)
    # the loop runs the layer rows only (one pass per layer and token keeps it quick), window by
    # window cut to its tokens; the head rows' indexing is checked against finite differences above
    loop = gradient_norms(real_model, batch.input_ids, batch.attention_mask, heads=False, hidden=True, batched=False)
    assert loop.shape == (2, real_model.n_layers, 1, 8, 8)
    for b in range(2):
        n = int(batch.attention_mask[b].sum())
        # float32: summation order differs between the vmapped and the plain backward
        torch.testing.assert_close(batched[b, :, -1, :n, :n], loop[b, :, 0, :n, :n], rtol=1e-3, atol=1e-5)
        for g in (batched, loop):
            assert g[b, ..., n:, :].abs().sum() == 0 and g[b, ..., :, n:].abs().sum() == 0
    rows = normalise_rows(batched)[0]
    torch.testing.assert_close(rows.sum(-1), torch.ones_like(rows.sum(-1)))


def test_rollout_matches_hand_computed_example():
    a1 = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    a2 = torch.tensor([[0.5, 0.5], [0.0, 1.0]])
    probs = [a1[None, None], a2[None, None]]  # [batch, head, pos, key]
    heads, layers = rollout(probs, torch.ones(1, 2, dtype=torch.bool))
    # Â1 = [[1, 0], [.25, .75]], Â2 = [[.75, .25], [0, 1]], R2 = Â2 Â1
    torch.testing.assert_close(layers[0][0], torch.tensor([[1.0, 0.0], [0.25, 0.75]]))
    torch.testing.assert_close(layers[1][0], torch.tensor([[0.8125, 0.1875], [0.25, 0.75]]))
    torch.testing.assert_close(heads[1][0, 0], layers[1][0])  # one head: head rows = layer rows


def test_rollout_heads_average_to_the_layer():
    torch.manual_seed(0)
    probs = [torch.softmax(torch.randn(2, 3, 5, 5), -1) for _ in range(3)]
    heads, layers = rollout(probs, torch.ones(2, 5, dtype=torch.bool))
    for h, lay in zip(heads, layers):
        torch.testing.assert_close(h.mean(1), lay)
        torch.testing.assert_close(lay.sum(-1), torch.ones(2, 5))


def test_jsd_known_values():
    p = torch.tensor([1.0, 0.0])
    q = torch.tensor([0.0, 1.0])
    assert float(jsd(p, q)) == pytest.approx(1.0)
    assert float(jsd(p, p)) == pytest.approx(0.0)


@pytest.mark.slow
def test_norm_and_alti_rows_are_distributions_and_alti_matches_per_token_loop(real_model, demo_corpus):
    batch = _real_windows(real_model, demo_corpus, (12,))
    tr = trace(real_model, batch.input_ids, batch.attention_mask)
    blocks = model_blocks(real_model.model)
    valid = batch.attention_mask.bool()
    n = batch.input_ids.shape[1]
    for layer in (0, real_model.n_layers - 1):
        x, attn, block = tr.resid_pre[layer], tr.probs[layer], blocks[layer]
        heads, lay = norm_based(block, x, attn)
        for m in (heads, lay):
            assert m.min() >= 0
            rows = normalise_rows(m)
            torch.testing.assert_close(rows.sum(-1), torch.ones_like(rows.sum(-1)))
        c = alti_layer(block, x, attn, valid)
        assert c.min() >= 0
        torch.testing.assert_close(c.sum(-1), torch.ones(1, n))
        # straightforward ALTI: one output token, one input token at a time
        with torch.no_grad():
            w_v, b_v = block.attention.self.value.weight, block.attention.self.value.bias
            w_o, b_o = block.attention.output.dense.weight, block.attention.output.dense.bias
            ln = block.attention.output.LayerNorm
            d_head = real_model.d_head
            expected = torch.zeros(n, n)
            for i in range(n):
                t = []
                for j in range(n):
                    vec = torch.zeros(real_model.d_model)
                    for h in range(real_model.n_heads):
                        cols = slice(h * d_head, (h + 1) * d_head)
                        v = x[0, j] @ w_v[cols].T + b_v[cols]
                        vec += attn[0, h, i, j] * (v @ w_o[:, cols].T)
                    if i == j:
                        vec += x[0, j]
                    t.append(vec)
                u = torch.stack(t).sum(0) + b_o
                sigma = torch.sqrt(u.var(unbiased=False) + ln.eps)
                y = ln(u)
                for j in range(n):
                    tj = ln.weight * (t[j] - t[j].mean()) / sigma
                    expected[i, j] = max(0.0, float(y.abs().sum() - (y - tj).abs().sum()))
                expected[i] /= expected[i].sum()
        torch.testing.assert_close(c[0], expected, rtol=1e-4, atol=1e-5)
        # and the per-head value vectors are the definition f_h(x) = (x W_V + b_V) W_O^h
        f = value_vectors(block, x, real_model.n_heads)
        cols = slice(0, d_head)
        torch.testing.assert_close(
            f[0, 0, 3], (x[0, 3] @ w_v[cols].T + b_v[cols]) @ w_o[:, cols].T, rtol=1e-4, atol=1e-5
        )


def test_default_params_keep_their_run_key():
    legacy = {
        "seq_len": 128,
        "windowing": "chunks",
        "sentences": "punct",
        "select": "top:0.02",
        "gate": 4.0,
        "include_special": False,
        "vectors": "pre_wo",
        "short_range": 4,
        "dtype": "float32",
    }
    # sentences=punct, replicates=window: the parameters every run had before the segmenter and
    # groups by document became the defaults
    assert AnalysisParams(sentences="punct", replicates="window").to_dict() == legacy
    with_mixing = AnalysisParams(sentences="punct", attribution=True, mixing=("rollout",))
    assert with_mixing.key() != AnalysisParams(sentences="punct").key()
    assert AnalysisParams.from_dict(with_mixing.to_dict()) == with_mixing


def test_batch_result_round_trip_and_default_has_no_mixing(tiny_model, small_corpus):
    from headatlas.service.engine.analysis import BatchResult, analyze_batch
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.results import mixing_by_method

    tokens = TokenClasses.from_tokenizer(tiny_model.tokenizer)
    params = AnalysisParams(seq_len=24)
    doc = next(iter_documents(str(small_corpus)))
    windows = document_windows(doc, tiny_model.tokenizer, tokens, tiny_model.tokenizer_key, params)[:3]
    batch = collate(windows, tokens.pad_id)
    plain = analyze_batch(tiny_model, batch, params, tokens)
    assert "mixing" not in plain.measures
    mixed_params = AnalysisParams(seq_len=24, attribution=True, mixing=("rollout", "norm", "alti"))
    mixed = analyze_batch(tiny_model, batch, mixed_params, tokens, mixing_windows=2)
    mixing = mixed.measures["mixing"]
    by_method = mixing_by_method(mixing)
    assert int(mixing["windows"]) == 2 and set(by_method) == {"attention", "attribution", "rollout", "norm", "alti"}
    assert int(mixing["rows"]) == int(batch.attention_mask[:2].sum())
    for key in plain.heads:  # the existing statistics do not change
        np.testing.assert_array_equal(plain.heads[key], mixed.heads[key])
    back = BatchResult.from_bytes(mixed.to_bytes())
    assert back.measures.keys() == mixed.measures.keys() and back.measures["mixing"].keys() == mixing.keys()
    for key, value in mixing.items():
        np.testing.assert_array_equal(back.measures["mixing"][key], value)
    att = by_method["attention"]
    # attention rows sum to 1: the distance histogram holds one unit of mass per row
    np.testing.assert_allclose(att["dist"].sum(-1), int(mixing["rows"]), rtol=1e-5)
    assert list(att["head"]) == [0, 1, 2, 3, -1]
    assert list(by_method["alti"]["head"]) == [-1]


@pytest.mark.slow
def test_analyze_with_attribution_then_query_through_cli(cli, tmp_path, small_corpus):
    db = str(tmp_path / "mix.duckdb")
    done = cli(
        "analyze",
        str(small_corpus),
        "--db",
        db,
        "--seq-len",
        "8",
        "--attribution",
        "--attribution-windows",
        "1",  # one window of 8 positions: 6 x 12 x 8 one-output backward passes on a CPU
        "--mixing",
        "rollout,norm",
        "--mixing",
        "alti",
        "-q",
    )
    assert done.returncode == 0, done.stderr
    out = cli("query", "mixing", "--db", db, "--format", "json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert {r["measure"] for r in rows} == {"self", "neighbours", "specials", "punctuation", "mean_distance"}
    assert len({r["layer"] for r in rows}) == 6
    for r in rows:
        for method in ("attention", "attribution", "rollout", "norm", "alti"):
            assert r[method] is not None
            if r["measure"] != "mean_distance":
                assert 0.0 <= r[method] <= 1.0 + 1e-6
    windows = cli("sql", "SELECT DISTINCT windows FROM mixing_metrics", "--db", db, "--format", "json")
    assert json.loads(windows.stdout) == [{"windows": 1}]  # the cap holds
    disc = cli("query", "discrepancy", "--db", db, "--format", "json")
    assert disc.returncode == 0, disc.stderr
    ranked = json.loads(disc.stdout)
    assert len(ranked) == 6 * 12
    jsds = [r["jsd"] for r in ranked]
    assert jsds == sorted(jsds, reverse=True) and 0 <= min(jsds) and max(jsds) <= 1
    heads = cli("query", "mixing", "--db", db, "--layer", "5", "--method", "attribution", "--format", "json")
    assert {r["head"] for r in json.loads(heads.stdout)} == {*range(12), "layer"}
    missing = cli("query", "discrepancy", "--db", db, "--method", "bogus")
    assert missing.returncode == 2 and "--method" in missing.stderr
    # a run without mixing says how to get it
    plain = cli("analyze", str(small_corpus), "--db", db, "--seq-len", "16", "--name", "plain", "-q")
    assert plain.returncode == 0, plain.stderr
    none = cli("query", "mixing", "--db", db, "--run", "plain")
    assert none.returncode == 2 and "--attribution" in none.stderr


def test_every_method_is_one_registered_class_and_every_list_agrees():
    from headatlas.service import params
    from headatlas.service.engine.results import FORWARD_MIXING, MIXING_METHODS
    from headatlas.service.measures.mixing import REGISTRY, MixingMethod
    from headatlas.service.reports import mixing_queries

    assert tuple(REGISTRY) == MIXING_METHODS == mixing_queries.METHOD_ORDER
    assert all(isinstance(m, MixingMethod) and type(m).rows is not MixingMethod.rows for m in REGISTRY.values())
    assert params.MIXING == FORWARD_MIXING and set(FORWARD_MIXING) < set(MIXING_METHODS)
