"""Top examples per head (service/measures/examples.py, migration 0021): the reservoir's known
answers on tiny arrays (the top k by hand, ties, merging in any order and grouping), the stored
examples of a tiny random model against a naive pass over the same windows, the same examples
whatever the batches, and the command line, the Python API and SQL over them."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest
import torch

from headatlas.service.measures.examples import KINDS, NONE, Reservoir
from tests.conftest import invoke_cli
from tests.figure_checks import corpus_of

# --- the reservoir on hand-made candidates ---------------------------------------------------------


def _reservoir(k: int, ids: list[str], scores, *, kind: int = 0, pos=None) -> Reservoir:
    """A reservoir of windows ``ids`` with one head and one layer: ``scores`` [window] for kind
    ``kind`` (the other kinds have no candidate), positions ``pos`` [window] (default: the window's
    index)."""
    n = len(ids)
    score = np.full((len(KINDS), n, 1, 1), -np.inf)
    score[kind, :, 0, 0] = scores
    pos_i = np.zeros_like(score, dtype=np.int64)
    pos_i[kind, :, 0, 0] = np.arange(n) if pos is None else pos
    return Reservoir.of_windows(k, ids, score, score * 2, pos_i, pos_i + 1)


def _same(a: Reservoir, b: Reservoir) -> bool:
    """Every array of the two reservoirs equal (NaN values equal)."""
    return all(
        x.tolist() == y.tolist() if x.dtype == object else np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
        for x, y in zip(a._arrays(), b._arrays())
    )


def _kept(r: Reservoir, kind: int = 0) -> list[tuple[str, float]]:
    return [(str(w), float(s)) for w, s in zip(r.window[kind, 0, 0], r.score[kind, 0, 0]) if np.isfinite(s)]


def test_the_top_k_by_hand():
    r = _reservoir(3, ["w0", "w1", "w2", "w3", "w4", "w5"], [3, 1, 4, 1, 5, 9])
    assert _kept(r) == [("w5", 9), ("w4", 5), ("w2", 4)]
    assert r.value[0, 0, 0].tolist() == [18, 10, 8]  # each example's value travels with it
    assert r.pos_i[0, 0, 0].tolist() == [5, 4, 2] and r.pos_j[0, 0, 0].tolist() == [6, 5, 3]
    # the other kinds had no candidate: empty slots
    assert not np.isfinite(r.score[1:]).any() and (r.window[1:] == "").all() and (r.pos_i[1:] == NONE).all()


def test_ties_go_to_the_smaller_window_id_and_fewer_candidates_leave_empty_slots():
    r = _reservoir(2, ["c", "a", "b"], [2.0, 2.0, 2.0])
    assert _kept(r) == [("a", 2.0), ("b", 2.0)]
    few = _reservoir(5, ["b", "a"], [1.0, 1.0])
    assert _kept(few) == [("a", 1.0), ("b", 1.0)]
    assert few.window[0, 0, 0].tolist() == ["a", "b", "", "", ""] and few.pos_i[0, 0, 0, 2:].tolist() == [NONE] * 3
    # a NaN score is no candidate
    assert _kept(_reservoir(3, ["x", "y"], [np.nan, 0.5])) == [("y", 0.5)]
    examples = list(_reservoir(2, ["c", "a", "b"], [2.0, 3.0, 1.0]).examples())
    assert [(e.kind, e.rank, e.window_id, e.score) for e in examples] == [
        ("anchor", 1, "a", 3.0),
        ("anchor", 2, "c", 2.0),
    ]


def test_merging_in_any_order_and_any_grouping_gives_the_top_k_of_all():
    rng = np.random.default_rng(0)
    n, k = 12, 4
    ids = [f"{rng.integers(1 << 30):08x}" for _ in range(n)]
    shape = (len(KINDS), n, 2, 3)
    score = rng.integers(0, 4, shape).astype(float)  # few values: many ties
    score[rng.random(shape) < 0.2] = -np.inf  # windows without a candidate
    pos_i = rng.integers(0, 16, shape)
    pos_j = pos_i + rng.integers(1, 5, shape)
    whole = Reservoir.of_windows(k, ids, score, -score, pos_i, pos_j)

    def part(windows) -> Reservoir:
        w = list(windows)
        return Reservoir.of_windows(k, [ids[i] for i in w], score[:, w], -score[:, w], pos_i[:, w], pos_j[:, w])

    parts = [part(range(0, 5)), part(range(5, 7)), part(range(7, 12))]
    for order in itertools.permutations(parts):
        left = order[0].merge(order[1]).merge(order[2])
        right = order[0].merge(order[1].merge(order[2]))
        assert _same(left, whole) and _same(right, whole)
    # one window at a time, in reverse
    single = part([n - 1])
    for i in reversed(range(n - 1)):
        single = single.merge(part([i]))
    assert _same(single, whole)
    # by hand: each cell's k best by (score desc, window id, pos_i, pos_j)
    for c, layer, head in itertools.product(range(len(KINDS)), range(2), range(3)):
        cands = sorted(
            (-score[c, w, layer, head], ids[w], pos_i[c, w, layer, head], pos_j[c, w, layer, head])
            for w in range(n)
            if np.isfinite(score[c, w, layer, head])
        )[:k]
        assert [(-s, w) for s, w, _, _ in cands] == [
            (float(s), str(w))
            for s, w in zip(whole.score[c, layer, head], whole.window[c, layer, head])
            if np.isfinite(s)
        ]


def test_a_reservoir_travels_as_numbers_and_comes_back_whole():
    r = _reservoir(3, ["w0", "w1", "w2", "w3"], [0.5, 2.5, -1.0, 2.5])
    back = Reservoir.of_payload(r.payload(["w0", "w1", "w2", "w3"]), ["w0", "w1", "w2", "w3"])
    assert _same(back, r)


def test_the_strongest_attention_by_hand_whole_or_a_window_at_a_time(monkeypatch):
    from types import SimpleNamespace

    from headatlas.service.measures import examples

    attn = torch.tensor(
        [
            # [CLS] a b [SEP], k_i = 4: A_12 = A_21 = 0.6 tie at 2.4, the smaller i wins; [CLS] and [SEP] left out
            [[0.9, 0.05, 0.05, 0.0], [0.1, 0.2, 0.6, 0.1], [0.05, 0.6, 0.3, 0.05], [0.0, 0.0, 0.0, 1.0]],
            # causal, k_i = i + 1: A_21·3 = 2.1 beats A_31·4 = 1.2, and the diagonal never counts
            [[1.0, 0.0, 0.0, 0.0], [0.1, 0.9, 0.0, 0.0], [0.2, 0.7, 0.1, 0.0], [0.1, 0.3, 0.3, 0.3]],
            # no two tokens of the pair universe: no candidate
            [[0.25] * 4] * 4,
        ]
    )[:, None]  # [window, head, pos, key]
    feats = SimpleNamespace(
        in_pairs=torch.tensor([[False, True, True, False], [False, True, True, True], [False, True, False, False]]),
        visible=torch.tensor([[4] * 4, [1, 2, 3, 4], [4] * 4]),
    )
    whole = examples.attention_candidates(attn, feats)
    monkeypatch.setattr(examples, "CHUNK_ELEMENTS", 16)  # one window at a time
    for got in (whole, examples.attention_candidates(attn, feats)):
        assert got.score[:, 0].tolist() == pytest.approx([2.4, 2.1, float("-inf")])
        assert got.value[:2, 0].tolist() == pytest.approx([0.6, 0.7])
        assert got.pos_i[:2, 0].tolist() == [1, 2] and got.pos_j[:2, 0].tolist() == [2, 1]


# --- stored examples of a tiny random model ----------------------------------------------------------

SEQ_LEN = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, demo_corpus):
    return corpus_of(demo_corpus, tmp_path_factory.mktemp("examples"), slice(0, 1), "one")


def _analysed(tiny_model, corpus, db, batch_size, **options):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    return analyze_corpus(
        str(corpus),
        store=Store(db),
        model=tiny_model,
        params=build_params(seq_len=SEQ_LEN, max_windows=9, **options),
        corpus=survey_corpus(str(corpus)),
        batch_size=batch_size,
    )


@pytest.fixture(scope="module")
def stored(tmp_path_factory, tiny_model, corpus):
    """The corpus's first 9 windows analysed in batches of 2, and again in one batch of 9, each
    into a database of its own (examples = 3 per head and kind)."""
    folder = tmp_path_factory.mktemp("examples-db")
    runs = {}
    for size in (2, 9):
        db = folder / f"b{size}.duckdb"
        runs[size] = (db, _analysed(tiny_model, corpus, db, size, examples=3))
    return runs


def _rows(db, run_id):
    from sqlalchemy import text

    from headatlas.service.storage.store import Store

    with Store(db).checked_read() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                text(
                    "SELECT layer, head, kind, rank, score, value, window_id, pos_i, pos_j, token_i, token_j "
                    "FROM examples WHERE run_id = :r ORDER BY layer, head, kind, rank"
                ),
                {"r": run_id},
            )
        ]


def test_the_same_examples_whatever_the_batches(stored):
    (db2, run2), (db9, run9) = stored[2], stored[9]
    rows2, rows9 = _rows(db2, run2.run_id), _rows(db9, run9.run_id)
    assert len(rows2) == 2 * 4 * 3 * 3  # layers × heads × kinds × k: 9 windows give every cell its 3
    assert [r[:4] + r[6:] for r in rows2] == [r[:4] + r[6:] for r in rows9]
    for a, b in zip(rows2, rows9):  # a batch of 9 pads its windows alike: float32 to the last bits
        assert a[4] == pytest.approx(b[4], rel=1e-5, abs=1e-7) and a[5] == pytest.approx(b[5], rel=1e-5, abs=1e-7)


def test_a_finished_run_keeps_k_examples_per_head_and_kind_and_their_windows_alone(stored):
    from sqlalchemy import text

    from headatlas.service.storage.store import Store

    db, run = stored[2]
    with Store(db).checked_read() as conn:
        kept = conn.execute(text("SELECT count(*), min(batch_id), max(batch_id) FROM head_examples")).one()
        windows = conn.execute(text("SELECT window_id, tokens FROM example_windows")).all()
        used = {r[0] for r in conn.execute(text("SELECT DISTINCT window_id FROM head_examples"))}
    assert tuple(kept) == (2 * 4 * 3 * 3, -1, -1)  # compacted: the best 3 of every cell, nothing else
    assert {w for w, _ in windows} == used and len(windows) == len(used)
    assert all(len(json.loads(t)) <= SEQ_LEN for _, t in windows)


def _naive(model, corpus) -> dict[tuple[int, int, str], list[tuple]]:
    """Each (layer, head, kind)'s candidates by a plain loop over the windows, from Hugging Face's
    own attention probabilities and hidden states (float64): (score, value, window id, pos_i,
    pos_j), best first."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import iter_batches
    from headatlas.service.engine.windows import TokenClasses

    params = build_params(seq_len=SEQ_LEN, max_windows=9)
    tokens = TokenClasses.for_model(model)
    batch = next(iter_batches(str(corpus), model, params, tokens, batch_size=9))[0]
    hf = model.model
    with torch.no_grad():
        out = hf(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            output_attentions=True,
            output_hidden_states=True,
        )
    d = model.d_head
    found: dict[tuple[int, int, str], list[tuple]] = {}
    for w, window_id in enumerate(batch.window_ids):
        n = int(batch.attention_mask[w].sum())
        ids = batch.input_ids[w, :n].tolist()
        members = [i for i in range(n) if ids[i] not in tokens.special_ids]
        pairs = [(i, j) for a, i in enumerate(members) for j in members[a + 1 :]]
        size = params.select.count(len(pairs))
        for layer in range(model.n_layers):
            hidden = out.hidden_states[layer][w, :n].double()
            value = hf.encoder.layer[layer].attention.self.value
            v_all = (hidden @ value.weight.detach().double().T + value.bias.detach().double()).numpy()
            for h in range(model.n_heads):
                attn = out.attentions[layer][w, h, :n, :n].double().numpy()
                z = attn @ v_all[:, h * d : (h + 1) * d]
                sim = z @ z.T
                high = sorted(pairs, key=lambda p: (-sim[p], p[0], p[1]))[:size]
                counts: dict[int, int] = {}
                for i, j in high:
                    counts[ids[i]] = counts.get(ids[i], 0) + 1
                    counts[ids[j]] = counts.get(ids[j], 0) + 1
                if counts:
                    anchor = min(counts, key=lambda t: (-counts[t], ids.index(t)))
                    found.setdefault((layer, h, "anchor"), []).append(
                        (counts[anchor], counts[anchor] / (2 * len(high)), window_id, ids.index(anchor), None)
                    )
                    i, j = high[0]
                    found.setdefault((layer, h, "pair"), []).append((sim[i, j], sim[i, j], window_id, i, j))
                i, j = max(
                    ((i, j) for i in members for j in members if i != j), key=lambda p: (attn[p] * n, -p[0], -p[1])
                )
                found.setdefault((layer, h, "attention"), []).append((attn[i, j] * n, attn[i, j], window_id, i, j))
    return {
        cell: sorted(cands, key=lambda c: (-c[0], c[2], c[3], -1 if c[4] is None else c[4]))
        for cell, cands in found.items()
    }


def test_the_stored_examples_are_a_naive_pass_over_the_windows(stored, tiny_model, corpus):
    db, run = stored[2]
    rows = _rows(db, run.run_id)
    every = _naive(tiny_model, corpus)
    want = {cell: cands[:3] for cell, cands in every.items()}
    got: dict[tuple[int, int, str], list[tuple]] = {}
    for layer, head, kind, _rank, score, value, window_id, pos_i, pos_j, _ti, _tj in rows:
        got.setdefault((layer, head, kind), []).append((score, value, window_id, pos_i, pos_j))
    assert set(got) == set(want)
    separated = 0
    for cell, expected in want.items():
        mine = got[cell]
        assert [m[0] for m in mine] == pytest.approx([x[0] for x in expected], rel=1e-4, abs=1e-6), cell
        assert [m[1] for m in mine] == pytest.approx([x[1] for x in expected], rel=1e-4, abs=1e-6), cell
        if cell[2] == "anchor":  # whole counts: the same windows and positions, ties by window id
            assert [m[2:] for m in mine] == [x[2:] for x in expected], cell
            continue
        # the same windows and tokens where float32 cannot swap two candidates: scores apart
        scores = [x[0] for x in every[cell][: len(expected) + 1]]
        if all(abs(a - b) > 1e-4 * abs(a) for a, b in itertools.pairwise(scores)):
            assert [m[2:] for m in mine] == [x[2:] for x in expected], cell
            separated += 1
    assert separated >= 8  # most cells are told apart by their scores


def test_the_examples_of_the_command_line_the_python_api_and_sql_agree(stored):
    import headatlas

    db, run = stored[2]
    done = invoke_cli(
        "query", "examples", "--run", str(run.run_id), "--layer", "1", "--head", "2", "--kind", "pair",
        "--limit", "2", "--format", "json", "--db", str(db),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert [(r["layer"], r["head"], r["kind"], r["rank"]) for r in listed] == [(1, 2, "pair", 1), (1, 2, "pair", 2)]
    stored_rows = [r for r in _rows(db, run.run_id) if r[:3] == (1, 2, "pair")][:2]
    assert [(r["window_id"], r["pos_i"], r["pos_j"], r["token_i"], r["token_j"]) for r in listed] == [
        (r[6], r[7], r[8], r[9], r[10]) for r in stored_rows
    ]
    for r in listed:  # the two tokens marked in the text around them
        assert f"[{r['token_i'].removeprefix('##')}]" in r["context"]
        assert f"[{r['token_j'].removeprefix('##')}]" in r["context"]
    table = headatlas.connect(db).run(run.run_id).examples(layer=1, head=2, kind="pair", limit=2)
    assert table.arrow.to_pylist() == listed
    # the table: one line per example, with its context
    done = invoke_cli("query", "examples", "--layer", "0", "--head", "1", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert len(re.findall(r"^0\s+1\s+anchor\s+[123]\s", done.stdout, flags=re.M)) == 3 and "[" in done.stdout
    # SQL: the view and its tables, named in `sql --help`
    done = invoke_cli(
        "sql",
        "SELECT kind, count(*) AS n FROM examples GROUP BY kind ORDER BY kind",
        "--format",
        "json",
        "--db",
        str(db),
    )
    assert json.loads(done.stdout) == [{"kind": k, "n": 2 * 4 * 3} for k in sorted(KINDS)]
    help_text = invoke_cli("sql", "--help").stdout
    assert all(name in help_text for name in ("examples", "head_examples", "example_windows"))


def test_bad_input_and_a_run_without_examples_are_one_line_naming_the_fix(stored, tiny_model, corpus, tmp_path):
    import headatlas

    db, run = stored[2]
    done = invoke_cli("query", "examples", "--kind", "heads", "--db", str(db))
    assert (
        done.returncode == 2 and done.stderr.strip() == "error: --kind 'heads': choose one of anchor, pair, attention"
    )
    bare = tmp_path / "bare.duckdb"
    none = _analysed(tiny_model, corpus, bare, 9, examples=0)
    done = invoke_cli("query", "examples", "--db", str(bare))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"run {none.run_id} kept no top examples" in done.stderr and "--examples 5" in done.stderr
    with pytest.raises(ValueError, match="examples=5"):
        headatlas.connect(bare).run(none.run_id).examples()
    # the rest of that run reads as before
    assert invoke_cli("query", "heads", "--db", str(bare)).returncode == 0


def test_the_head_page_shows_each_example_with_its_tokens_highlighted_and_escaped(stored, tiny_model, corpus, tmp_path):
    import html

    from web_support import Client

    from headatlas.service.web.app import WebApp

    db, run = stored[2]
    client = Client(WebApp(str(db)))
    page = client.get(f"/runs/{run.run_id}/heads/1/2")
    assert page.status == 200
    shown = _rows(db, run.run_id)
    for kind in KINDS:
        items = re.findall(
            rf'<li class="top-example" data-kind="{kind}" data-rank="(\d)" data-window="(\w+)">(.*?)</li>', page.text
        )
        want = [r for r in shown if r[:3] == (1, 2, kind)]
        assert [(int(rank), w) for rank, w, _ in items] == [(r[3], r[6]) for r in want]
        for (_, _, body), r in zip(items, want):
            marks = re.findall(r'<mark class="ex-([ij])" title="[^"]*position (\d+)">(.*?)</mark>', body)
            expected = [("i", str(r[7]), r[9])] + ([("j", str(r[8]), r[10])] if r[8] is not None else [])
            # in the window's order, each token as text: a WordPiece continuation without its ##
            assert sorted(marks, key=lambda m: int(m[1])) == sorted(
                [(c, p, html.escape(t.removeprefix("##"), quote=True)) for c, p, t in expected], key=lambda m: int(m[1])
            )
    data = client.get(f"/runs/{run.run_id}/heads/1/2.json").json()["examples"]
    assert [(x["kind"], x["rank"], x["window_id"]) for x in data] == [
        (r[2], r[3], r[6])
        for r in sorted((r for r in shown if r[:2] == (1, 2)), key=lambda r: (KINDS.index(r[2]), r[3]))
    ]
    # a token that reads as markup is text on the page
    from headatlas.service.web.examples import section

    naughty = {
        **data[0],
        "tokens": ["[CLS]", "<script>", "x", "[SEP]"],
        "pos_i": 1,
        "pos_j": None,
        "token_i": "<script>",
    }
    assert "&lt;script&gt;</mark>" in section([naughty]) and "<script>" not in section([naughty])
    # a run that kept none says so, and how to keep them
    bare = tmp_path / "bare.duckdb"
    none = _analysed(tiny_model, corpus, bare, 9, examples=0)
    page = Client(WebApp(str(bare))).get(f"/runs/{none.run_id}/heads/0/0")
    assert page.status == 200 and 'id="no-examples"' in page.text and "--examples 5" in page.text
