"""The synthetic probe (SPEC §8): scores on hand-made attention maps, the probe sequences, the
one forward function against Hugging Face, storage, and `analyze --probe` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from headatlas.service.engine.probe import (
    SCORES,
    ProbeLayout,
    ProbeSpec,
    attention_maps,
    ordinary_token_ids,
    probe_scores,
    probe_sequences,
    run_probe,
)
from headatlas.service.errors import ParameterError

L = 5


def head_map(width: int, target) -> torch.Tensor:
    """``[query, key]``: every row i puts 1 on ``target(i)`` where that is a key, else on itself."""
    a = torch.zeros(width, width)
    for i in range(width):
        j = target(i)
        a[i, j if 0 <= j < width else i] = 1.0
    return a


@pytest.mark.parametrize("start", [1, 0])
def test_exact_heads_score_one_on_their_own_score_and_zero_on_the_others(start):
    width = start + 2 * L + 1  # [first] + r + r + [last]
    heads = [
        head_map(width, lambda i: i - L + 1),  # induction: the token after the earlier copy
        head_map(width, lambda i: i - L),  # duplicate token: the earlier copy
        head_map(width, lambda i: i - 1),  # previous token
    ]
    attn = torch.stack(heads)[None, None].expand(2, 3, 3, width, width)  # [layer, batch, head, q, k]
    scores = probe_scores(attn, length=L, start=start)
    assert set(scores) == set(SCORES)
    expected = torch.eye(3, dtype=torch.float64)  # head h is exact for score h
    for s, name in enumerate(SCORES):
        assert scores[name].shape == (2, 3)
        torch.testing.assert_close(scores[name], expected[s].expand(2, 3), rtol=0, atol=0)


def test_causal_uniform_attention_scores_the_mean_of_one_over_visible_keys():
    # row i of a causal uniform head puts 1/(i+1) on every key 0..i; the second copy is i = 1+L .. 2L
    width = 1 + 2 * L
    attn = torch.tril(torch.ones(width, width, dtype=torch.float64))
    attn = attn / attn.sum(-1, keepdim=True)
    scores = probe_scores(attn[None, None, None], length=L, start=1)
    expected = np.mean([1 / (i + 1) for i in range(1 + L, 1 + 2 * L)])
    for name in SCORES:
        assert scores[name].item() == pytest.approx(expected, abs=1e-12)


def test_half_attention_averages_over_the_batch():
    width = 1 + 2 * L + 1
    exact = head_map(width, lambda i: i - 1)
    self_only = head_map(width, lambda i: i)
    attn = torch.stack([exact, self_only])[None, :, None]  # two sequences, one head
    assert probe_scores(attn, length=L)["prev_token_score"].item() == pytest.approx(0.5)


def test_scores_refuse_maps_too_short_for_the_probe():
    with pytest.raises(ValueError, match="needs 11 positions"):
        probe_scores(torch.zeros(1, 1, 1, 10, 10), length=L, start=1)


def test_probe_spec_rejects_bad_values_with_the_flag():
    with pytest.raises(ParameterError, match="--probe-length 1"):
        ProbeSpec(length=1)
    with pytest.raises(ParameterError, match="--probe-sequences 0"):
        ProbeSpec(sequences=0)


def test_ordinary_tokens_exclude_special_and_unused_slots(tiny_model):
    tok = tiny_model.tokenizer
    ids = set(ordinary_token_ids(tok, tiny_model.model.config.vocab_size).tolist())
    vocab = tok.get_vocab()
    for text in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]", "[unused0]", "[unused99]", ".", ","):
        assert vocab[text] not in ids, text
    for text in ("the", "house", "##ing", "1"):
        assert vocab[text] in ids, text
    assert max(ids) < tiny_model.model.config.vocab_size


def test_encoder_sequences_are_cls_r_r_sep_and_reproducible(tiny_model):
    tok = tiny_model.tokenizer
    layout = ProbeLayout.from_tokenizer(tok)
    assert (layout.first, layout.last, layout.start) == (tok.cls_token_id, tok.sep_token_id, 1)
    candidates = ordinary_token_ids(tok)
    spec = ProbeSpec(length=L, sequences=4, seed=0)
    seqs = probe_sequences(candidates, layout, spec)
    assert seqs.shape == (4, layout.width(L)) == (4, 2 * L + 2)
    assert (seqs[:, 0] == tok.cls_token_id).all() and (seqs[:, -1] == tok.sep_token_id).all()
    assert torch.equal(seqs[:, 1 : 1 + L], seqs[:, 1 + L : 1 + 2 * L])  # r twice
    assert torch.isin(seqs[:, 1:-1], candidates).all()
    assert torch.equal(seqs, probe_sequences(candidates, layout, spec))  # seed 0, same draws
    assert not torch.equal(seqs, probe_sequences(candidates, layout, ProbeSpec(length=L, sequences=4, seed=1)))


class DecoderTokenizer:
    cls_token_id = sep_token_id = None
    bos_token_id = 7


def test_decoder_sequences_are_bos_r_r_and_without_bos_start_at_zero():
    layout = ProbeLayout.from_tokenizer(DecoderTokenizer())
    assert (layout.first, layout.last, layout.start, layout.width(L)) == (7, None, 1, 1 + 2 * L)
    seqs = probe_sequences(torch.arange(100, 200), layout, ProbeSpec(length=L, sequences=2))
    assert (seqs[:, 0] == 7).all() and torch.equal(seqs[:, 1 : 1 + L], seqs[:, 1 + L :])
    bare = DecoderTokenizer()
    bare.bos_token_id = None
    layout = ProbeLayout.from_tokenizer(bare)
    assert (layout.start, layout.width(L)) == (0, 2 * L)
    seqs = probe_sequences(torch.arange(100, 200), layout, ProbeSpec(length=L, sequences=2))
    assert torch.equal(seqs[:, :L], seqs[:, L:])


def test_an_encoder_run_as_causal_has_no_sep(tiny_model):
    layout = ProbeLayout.from_tokenizer(tiny_model.tokenizer, causal=True)
    assert layout.last is None


def test_attention_maps_match_hugging_face_attentions(tiny_model):
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102], [101, 2178, 2028, 1012, 1010, 102]])
    maps = attention_maps(tiny_model, ids)
    assert maps.shape == (tiny_model.n_layers, 2, tiny_model.n_heads, 6, 6)
    with torch.inference_mode():
        out = tiny_model.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
    torch.testing.assert_close(maps, torch.stack(out.attentions).float())


def test_run_probe_is_the_scores_of_its_sequences_in_chunks(tiny_model):
    spec = ProbeSpec(length=L, sequences=11, seed=3)  # 11: chunks of 8 and 3 are weighted by size
    scores = run_probe(tiny_model, spec)
    layout = ProbeLayout.from_tokenizer(tiny_model.tokenizer)
    seqs = probe_sequences(ordinary_token_ids(tiny_model.tokenizer, tiny_model.model.config.vocab_size), layout, spec)
    whole = probe_scores(attention_maps(tiny_model, seqs), length=L, start=1)
    for name in SCORES:
        torch.testing.assert_close(scores[name], whole[name].cpu())
        assert scores[name].shape == (tiny_model.n_layers, tiny_model.n_heads)


def test_a_probe_longer_than_the_model_positions_is_refused(tiny_model):
    limit = tiny_model.model.config.max_position_embeddings
    with pytest.raises(ParameterError, match=f"--probe-length {limit}: .* use at most {(limit - 2) // 2}"):
        run_probe(tiny_model, ProbeSpec(length=limit, sequences=1))


# --- storage and the command line ----------------------------------------------------------------
def test_store_keeps_one_probe_per_run(tmp_path, tiny_model, small_corpus):
    from headatlas.service.storage.store import Store
    from tests.figure_checks import analyse

    db = tmp_path / "p.duckdb"
    run = analyse(small_corpus, db, tiny_model)
    store = Store(db)
    scores = {name: np.full((2, 4), k / 10) for k, name in enumerate(SCORES)}
    assert store.probe_of(run.run_id) is None
    assert store.store_probe(run.run_id, (5, 3, 0), scores) is True
    assert store.store_probe(run.run_id, (5, 3, 0), {n: v + 1 for n, v in scores.items()}) is False  # kept
    assert store.probe_of(run.run_id) == (5, 3, 0)
    with store.read() as conn:
        rows = conn.exec_driver_sql("SELECT count(*), max(duplicate_score) FROM probe_scores").all()
    assert rows == [(8, pytest.approx(0.1))]
    assert store.store_probe(run.run_id, (6, 3, 0), scores) is True  # another probe replaces it
    with store.read() as conn:
        assert conn.exec_driver_sql("SELECT count(*), min(length) FROM probe_scores").all() == [(8, 6)]


def invoke(*args: str):
    from headatlas.cli.main import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.stdout


def heads_json(db, run) -> list[dict]:
    return json.loads(invoke("query", "heads", "--db", str(db), "--run", str(run), "--format", "json"))


def test_analyze_probe_adds_the_scores_to_query_heads(tmp_path, small_corpus):
    db = tmp_path / "cli.duckdb"
    common = ("analyze", str(small_corpus), "--db", str(db), "-m", "random:tiny", "--device", "cpu", "-q")
    assert invoke(*common).split() == ["1"]
    rows = heads_json(db, 1)
    assert len(rows) == 8 and all(r[name] is None for r in rows for name in SCORES)  # no probe yet
    windows = rows[0]["windows"]

    # the same run with --probe: the finished corpus statistics stay, only the probe is computed
    assert invoke(*common, "--probe", "--probe-length", "20", "--probe-sequences", "4", "--control").split() == [
        "1",
        "2",
    ]
    for run in (1, 2):  # the control gets the probe too
        rows = heads_json(db, run)
        assert len(rows) == 8
        for row in rows:
            for name in SCORES:
                assert 0.0 <= row[name] <= 1.0, (run, row["layer"], row["head"], name)
    assert heads_json(db, 1)[0]["windows"] == windows

    # again: nothing stored twice
    invoke(*common, "--probe", "--probe-length", "20", "--probe-sequences", "4", "--control")
    out = invoke(
        "sql",
        "--db",
        str(db),
        "--format",
        "json",
        "SELECT run_id, count(*) AS n FROM probe_scores GROUP BY 1 ORDER BY 1",
    )
    assert [(r["run_id"], r["n"]) for r in json.loads(out)] == [(1, 8), (2, 8)]

    ranked = json.loads(
        invoke("query", "heads", "--db", str(db), "--run", "1", "--sort", "prev_token_score", "--format", "json")
    )
    values = [r["prev_token_score"] for r in ranked]
    assert values == sorted(values, reverse=True)
    table = invoke("query", "heads", "--db", str(db), "--run", "1", "--sort", "induction_score", "--top", "2")
    assert "induction_score" in table


# --- the real model ------------------------------------------------------------------------------
def test_minilm_previous_token_heads_attend_to_the_previous_token_on_real_text(tmp_path, real_model, small_corpus):
    """The head the probe ranks first for previous-token attention does the same on real text."""
    from headatlas.service.reports import queries
    from headatlas.service.storage.store import Store
    from tests.figure_checks import analyse

    db = tmp_path / "real.duckdb"
    run = analyse(small_corpus, db, real_model)
    scores = run_probe(real_model)
    Store(db).store_probe(run.run_id, (50, 32, 0), {n: v.numpy() for n, v in scores.items()})
    with Store(db).read() as conn:
        columns, rows = queries.heads(conn, run.run_id, sort="prev_token_score")
    top = dict(zip(columns, rows[0], strict=True))
    attn_to_prev = sorted(r[columns.index("attn_to_prev")] for r in rows)
    assert (top["layer"], top["head"]) == (0, 2)
    assert top["prev_token_score"] > 0.9
    assert top["attn_to_prev"] > 0.9 and top["attn_to_prev"] == attn_to_prev[-1]  # first on real text too


def test_python_api_analyze_with_probe(tmp_path, small_corpus):
    import headatlas

    run = headatlas.analyze(
        small_corpus, db=tmp_path / "api.duckdb", model="random:tiny", device="cpu", probe=True, probe_length=8
    )
    heads = run.heads(sort="duplicate_score").to_pylist()
    assert len(heads) == 8
    values = [h["duplicate_score"] for h in heads]
    assert values == sorted(values, reverse=True) and all(0.0 <= v <= 1.0 for v in values)
    assert run.store.probe_of(run.run_id) == (8, 32, 0)
