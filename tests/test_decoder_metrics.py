"""SPEC §8 sums: causal visibility, the attention gate, uniform baselines per row, duplicate-token
and induction attention. Known answers on hand-made windows (worked out in the comments), a
naive-loop reference on random inputs, and the same numbers through the database views."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sqlalchemy import text

from headatlas.service.engine.chance import chance_statistics
from headatlas.service.engine.features import window_features
from headatlas.service.engine.stats import head_statistics
from headatlas.service.engine.windows import TokenClasses
from headatlas.service.params import Selection
from headatlas.service.storage.store import Store
from tests.test_baselines import build_result, ids_in_distinct_groups, new_run, one_row

BOS, SEP, PAD, DOT, A, B, C = 1, 2, 0, 9, 5, 6, 7
CLS = BOS  # position 0 is [CLS] in an encoder and BOS in a decoder: one id serves both here
TOKENS = TokenClasses(
    cls_id=CLS,
    sep_id=SEP,
    pad_id=PAD,
    special_ids=frozenset({BOS, SEP, PAD}),
    sentence_end_ids=frozenset({DOT}),
    punct_ids=frozenset({DOT}),
)

# A decoder window: BOS a b a b . (positions 0..5, n = 6)
#   D(i), earlier copies:           D(3) = {1} (a), D(4) = {2} (b); every other row none
#   I(i), after earlier copies:     I(3) = {2} (b after the first a), I(4) = {3} (a after the first b)
DECODER = [BOS, A, B, A, B, DOT]
# Causal attention, rows sum to 1 over keys ≤ i
CAUSAL_ATTN = torch.tensor(
    [
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
        [0.2, 0.6, 0.2, 0.0, 0.0, 0.0],
        [0.1, 0.6, 0.2, 0.1, 0.0, 0.0],  # dup 0.6 (key 1), induction 0.2 (key 2)
        [0.1, 0.1, 0.3, 0.4, 0.1, 0.0],  # dup 0.3 (key 2), induction 0.4 (key 3)
        [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
    ],
    dtype=torch.float64,
)

# An encoder window: [CLS] a b a a [SEP]
#   D(3) = {1}, D(4) = {1, 3}; I(3) = {2} (k = 1), I(4) = {2} (k = 1; k = 3 is not < 4 − 1)
ENCODER = [CLS, A, B, A, A, SEP]
ENCODER_ATTN = torch.tensor(
    [
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1 / 6] * 6,
        [0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        [0.0, 0.4, 0.5, 0.1, 0.0, 0.0],  # dup 0.4, induction 0.5
        [0.1, 0.2, 0.3, 0.15, 0.25, 0.0],  # dup 0.2 + 0.15, induction 0.3
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    ],
    dtype=torch.float64,
)


def _features(windows, *, causal, **kw):
    ids = torch.tensor(windows)
    return window_features(ids, (ids != PAD).long(), TOKENS, causal=causal, **kw)


def _heads(windows, attn, *, causal, select="topk:10", gate=2.0, z=None):
    feats = _features(windows, causal=causal)
    batch, n_pos = feats.valid.shape
    if z is None:
        z = torch.randn(batch, 1, n_pos, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return head_statistics(z, attn, feats, select=Selection.parse(select), gate=gate, seq_len=n_pos)


def _uniform(windows, *, causal) -> torch.Tensor:
    """Uniform attention over each row's visible keys: ``[batch, 1, pos, key]``."""
    feats = _features(windows, causal=causal)
    n_pos = feats.valid.shape[1]
    keys = feats.valid[:, None, :].expand(-1, n_pos, -1).clone()
    if causal:
        keys &= torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    a = keys.double()
    return (a / a.sum(2, keepdim=True).clamp(min=1))[:, None]


# --- known answers ---------------------------------------------------------------------------------


def test_visible_keys():
    assert _features([DECODER], causal=True).visible.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert _features([DECODER], causal=False).visible.tolist() == [[6] * 6]
    padded = _features([[BOS, A, B, PAD]], causal=True)
    assert padded.visible[0, :3].tolist() == [1, 2, 3]


def test_copy_sets_by_hand():
    feats = _features([DECODER, ENCODER], causal=False)
    dup, induction = feats.copies[..., 0], feats.copies[..., 1]
    # (row, key) pairs of each set
    assert dup[0].nonzero().tolist() == [[3, 1], [4, 2]]
    assert induction[0].nonzero().tolist() == [[3, 2], [4, 3]]
    assert dup[1].nonzero().tolist() == [[3, 1], [4, 1], [4, 3]]
    assert induction[1].nonzero().tolist() == [[3, 2], [4, 2]]


def test_decoder_window_causal_sums():
    chance = chance_statistics(_features([DECODER], causal=True), seq_len=6)
    # k_i = 1..6: Σ 1/k_i = 1 + 1/2 + 1/3 + 1/4 + 1/5 + 1/6 = 49/20 (position 0 is visible to all)
    assert float(chance["uniform_first"]) == pytest.approx(49 / 20)
    assert float(chance["uniform_cls"]) == pytest.approx(49 / 20)  # [CLS]/BOS is position 0
    assert float(chance["uniform_sep"]) == 0.0  # no separator in a decoder window
    assert float(chance["uniform_punct"]) == pytest.approx(1 / 6)  # the "." only row 5 sees
    assert int(chance["next_rows"]) == 0  # causal: no row sees its next token
    # D and I: rows 3 and 4, one key each, k = 4 and 5 → 1/4 + 1/5
    assert int(chance["dup_rows"]) == 2 and int(chance["induction_rows"]) == 2
    assert float(chance["attn_dup_chance"]) == pytest.approx(0.45)
    assert float(chance["attn_induction_chance"]) == pytest.approx(0.45)

    out = _heads([DECODER], CAUSAL_ATTN[None, None], causal=True)
    assert float(out["attn_dup"][0]) == pytest.approx(0.6 + 0.3)
    assert float(out["attn_induction"][0]) == pytest.approx(0.2 + 0.4)
    assert float(out["attn_to_first"][0]) == pytest.approx(1 + 0.5 + 0.2 + 0.1 + 0.1 + 0.5)
    assert float(out["attn_to_cls"][0]) == pytest.approx(2.4)
    assert float(out["attn_to_punct"][0]) == pytest.approx(0.1)
    assert float(out["attn_to_next"][0]) == 0.0


def test_decoder_window_bidirectional_uniform_sums_are_the_plain_counts():
    chance = chance_statistics(_features([DECODER], causal=False), seq_len=6)
    # k_i = n = 6 for every row: a key seen by all 6 rows weighs 6 · 1/6 = 1, exactly
    assert float(chance["uniform_first"]) == 1.0
    assert float(chance["uniform_cls"]) == 1.0
    assert float(chance["uniform_punct"]) == float(chance["punct_tokens"]) == 1.0
    assert int(chance["next_rows"]) == 5
    assert float(chance["attn_dup_chance"]) == pytest.approx(2 / 6)
    assert float(chance["attn_induction_chance"]) == pytest.approx(2 / 6)


def test_encoder_window_several_copies():
    chance = chance_statistics(_features([ENCODER], causal=False), seq_len=6)
    assert int(chance["dup_rows"]) == 2 and int(chance["induction_rows"]) == 2
    assert float(chance["attn_dup_chance"]) == pytest.approx((1 + 2) / 6)  # |D(3)| = 1, |D(4)| = 2
    assert float(chance["attn_induction_chance"]) == pytest.approx((1 + 1) / 6)
    assert float(chance["uniform_sep"]) == 1.0 and float(chance["uniform_cls"]) == 1.0
    out = _heads([ENCODER], ENCODER_ATTN[None, None], causal=False)
    assert float(out["attn_dup"][0]) == pytest.approx(0.4 + 0.2 + 0.15)
    assert float(out["attn_induction"][0]) == pytest.approx(0.5 + 0.3)


def test_causal_gate_scales_each_row_by_its_visible_keys():
    # topk:10 = every pair of positions 1..5. Causal (A_ij = 0 for i < j): attended when
    # A_ji · k_j ≥ 2: (1,3) 0.6·4 = 2.4 yes; (3,4) 0.4·5 = 2.0 yes; (1,2) 0.6·3 = 1.8 no;
    # (2,4) 0.3·5 = 1.5 no; the rest ≤ 0.8 → 2
    causal = _heads([DECODER], CAUSAL_ATTN[None, None], causal=True)
    assert int(causal["high_pairs"][0]) == 10
    assert int(causal["attended_high"][0]) == 2
    # the same map read as bidirectional (gate / n = 1/3): (1,2) 0.6, (1,3) 0.6, (3,4) 0.4 → 3
    assert int(_heads([DECODER], CAUSAL_ATTN[None, None], causal=False)["attended_high"][0]) == 3


@pytest.mark.parametrize("causal", [True, False])
def test_uniform_attention_has_lift_one(causal):
    windows = [DECODER, ENCODER, [BOS, A, A, A, B, A, B, PAD]]
    windows = [(w + [PAD] * 8)[:8] for w in windows]
    attn = _uniform(windows, causal=causal)
    out = _heads(windows, attn, causal=causal)
    chance = chance_statistics(_features(windows, causal=causal), seq_len=8)
    for observed, expected in [
        ("attn_to_first", "uniform_first"),
        ("attn_to_cls", "uniform_cls"),
        ("attn_to_sep", "uniform_sep"),
        ("attn_to_punct", "uniform_punct"),
        ("attn_dup", "attn_dup_chance"),
        ("attn_induction", "attn_induction_chance"),
    ]:
        assert float(out[observed][0]) == pytest.approx(float(chance[expected]), rel=1e-12), observed


# --- a naive loop on random inputs -----------------------------------------------------------------


def naive(ids: list[int], attn: np.ndarray, *, causal: bool, gate: float) -> dict[str, float]:
    """SPEC §8 written out row by row: ids of one window (pads stripped), attn ``[n, n]``."""
    n = len(ids)
    special = [t in TOKENS.special_ids for t in ids]
    k = [i + 1 if causal else n for i in range(n)]
    visible = [[j for j in range(n) if j <= i or not causal] for i in range(n)]
    out = dict.fromkeys(
        [
            "attn_to_first",
            "attn_dup",
            "attn_induction",
            "uniform_first",
            "uniform_cls",
            "uniform_sep",
            "uniform_punct",
            "attn_dup_chance",
            "attn_induction_chance",
            "dup_rows",
            "induction_rows",
            "next_rows",
            "attended",
        ],
        0.0,
    )
    for i in range(n):
        out["attn_to_first"] += attn[i, 0]
        for key, test in [
            ("uniform_first", lambda j: j == 0),
            ("uniform_cls", lambda j: ids[j] == TOKENS.cls_id),
            ("uniform_sep", lambda j: ids[j] == TOKENS.sep_id),
            ("uniform_punct", lambda j: ids[j] in TOKENS.punct_ids),
        ]:
            out[key] += sum(1 for j in visible[i] if test(j)) / k[i]
        out["next_rows"] += i + 1 in visible[i]
        if special[i]:
            continue
        dup = [j for j in range(i) if ids[j] == ids[i] and not special[j]]
        induction = [j + 1 for j in range(i - 1) if ids[j] == ids[i] and not special[j]]
        for name, keys in (("dup", dup), ("induction", induction)):
            if keys:
                out[f"{name}_rows"] += 1
                out[f"attn_{name}"] += sum(attn[i, j] for j in keys)
                out[f"attn_{name}_chance"] += len(keys) / k[i]
    words = [i for i in range(n) if not special[i]]
    for a, i in enumerate(words):
        for j in words[a + 1 :]:
            out["attended"] += attn[i, j] * k[i] >= gate or attn[j, i] * k[j] >= gate
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_vectorised_sums_equal_a_naive_loop(causal):
    rng = np.random.default_rng(8 + causal)
    n_pos, batch, heads = 12, 6, 3
    windows = []
    for _ in range(batch):
        m = int(rng.integers(2, n_pos - 1))
        body = rng.choice([A, B, C, DOT, SEP], size=m, p=[0.35, 0.25, 0.2, 0.15, 0.05]).tolist()
        windows.append(([BOS, *body] + [PAD] * n_pos)[:n_pos])
    ids = torch.tensor(windows)
    valid = ids != PAD
    logits = torch.tensor(rng.normal(scale=2.0, size=(batch, heads, n_pos, n_pos)))
    mask = valid[:, None, None, :].expand(-1, heads, n_pos, -1)
    if causal:
        mask = mask & torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    attn = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    gate = 1.5
    feats = _features(windows, causal=causal)
    chance = chance_statistics(feats, seq_len=n_pos)
    z = torch.tensor(rng.normal(size=(batch, heads, n_pos, 4)))
    out = head_statistics(z, attn, feats, select=Selection.parse("topk:1000"), gate=gate, seq_len=n_pos)
    expected = [
        [naive(w[: int(valid[b].sum())], attn[b, h].numpy(), causal=causal, gate=gate) for h in range(heads)]
        for b, w in enumerate(windows)
    ]
    for name in ("attn_to_first", "attn_dup", "attn_induction"):
        want = [sum(expected[b][h][name] for b in range(batch)) for h in range(heads)]
        np.testing.assert_allclose(out[name].numpy(), want, rtol=1e-12, err_msg=name)
    want = [sum(expected[b][h]["attended"] for b in range(batch)) for h in range(heads)]
    assert out["attended_high"].tolist() == want
    for name in (
        "uniform_first",
        "uniform_cls",
        "uniform_sep",
        "uniform_punct",
        "attn_dup_chance",
        "attn_induction_chance",
        "dup_rows",
        "induction_rows",
        "next_rows",
    ):
        want = sum(expected[b][0][name] for b in range(batch))
        assert float(chance[name]) == pytest.approx(want, rel=1e-12), name
    assert sum(expected[b][0]["dup_rows"] for b in range(batch)) > 0  # the sums are exercised
    assert sum(expected[b][0]["induction_rows"] for b in range(batch)) > 0


# --- through the database --------------------------------------------------------------------------


@pytest.fixture()
def store(tmp_path) -> Store:
    s = Store(tmp_path / "decoder.duckdb")
    s.ensure_schema()
    return s


def _ingest(store: Store, name: str, window: list[int], attn: torch.Tensor, *, causal: bool) -> int:
    run = new_run(store, name, seq_len=6)
    z = torch.randn(1, 1, 1, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    res = build_result(
        ids_in_distinct_groups(1, prefix=name),
        [window],
        z,
        attn[None, None, None],
        select="topk:10",
        seq_len=6,
        tokens=TOKENS,
        causal=causal,
    )
    store.ingest(run, [(0, res)])
    return run


def test_views_of_a_causal_run(store):
    run = _ingest(store, "decoder", DECODER, CAUSAL_ATTN, causal=True)
    with store.read() as conn:
        for view in ("head_metrics", "layer_metrics"):  # one head: the layer is the head
            m = one_row(conn, f"SELECT * FROM {view} WHERE run_id = :r", r=run)
            assert m["attn_dup"] == pytest.approx(0.9 / 2)  # per row that has a copy
            assert m["attn_dup_chance"] == pytest.approx(0.45 / 2)
            assert m["dup_lift"] == pytest.approx(0.9 / 0.45)
            assert m["attn_induction"] == pytest.approx(0.6 / 2)
            assert m["induction_lift"] == pytest.approx(0.6 / 0.45)
            assert m["attn_to_first"] == pytest.approx(2.4 / 6)
            assert m["attn_to_first_lift"] == pytest.approx(2.4 / 2.45)
            assert m["attn_to_cls_lift"] == pytest.approx(2.4 / 2.45)  # not 2.4 / windows
            assert m["attn_to_punct_lift"] == pytest.approx(0.1 / (1 / 6))
            assert m["attn_to_sep_lift"] is None  # no separator to attend to
            assert m["attn_to_next"] is None  # causal: does not exist
            assert m["noise_share"] == pytest.approx(1 - 2 / 10)


def test_views_of_a_bidirectional_run(store):
    run = _ingest(store, "encoder", ENCODER, ENCODER_ATTN, causal=False)
    with store.read() as conn:
        m = one_row(conn, "SELECT * FROM head_metrics WHERE run_id = :r", r=run)
        chance = one_row(conn, "SELECT * FROM chance_totals WHERE run_id = :r", r=run)
    assert m["dup_lift"] == pytest.approx(0.75 / 0.5)
    assert m["induction_lift"] == pytest.approx(0.8 / (1 / 3))
    # rows 1 and 4 give 1/6 and 0.1 to key 0 beside rows 0 (1.0): 1.2667 over one window
    assert m["attn_to_first_lift"] == pytest.approx(1 + 1 / 6 + 0.1)
    assert m["attn_to_cls_lift"] == m["attn_to_first_lift"]
    # the next token: only row 1 (1/6) puts weight on it, over 6 rows
    assert m["attn_to_next"] == pytest.approx((1 / 6) / 6)
    assert chance["uniform_cls"] == chance["windows"] == 1  # exactly the old expectation
    assert chance["next_rows"] == 5


def test_metric_views_list_every_declared_column(store):
    from headatlas.service.metrics import COLUMNS, SUMS

    with store.read() as conn:

        def columns(table):
            return {
                r[0]: r[1]
                for r in conn.execute(
                    text("SELECT column_name, data_type FROM information_schema.columns WHERE table_name = :t"),
                    {"t": table},
                )
            }

        head, layer = columns("head_metrics"), columns("layer_metrics")
        tables = {s.scope.table: columns(s.scope.table) for s in SUMS}
    for c in COLUMNS:
        assert c.name in head and c.name in layer, c.name
    for s in SUMS:  # every declared sum has its column, of its type
        assert tables[s.scope.table].get(s.name) == s.sql_type, s.name


def test_headatlas_metrics_lists_each_column_with_its_spec_section():
    from headatlas.service.metrics import all_columns, reference

    columns, rows = reference()
    assert [r[0] for r in rows] == [c.name for c in all_columns()]
    by_name = {r[0]: dict(zip(columns, r)) for r in rows}
    assert by_name["dup_lift"]["spec"] == "§8" and by_name["within_sentence_lift_dm"]["spec"] == "§5, §5b"
    assert all(r[2].startswith("§") and r[3] for r in rows)


def _alembic(path, action: str, target: str) -> None:
    from alembic import command

    from headatlas.service.storage import db

    engine = db.make_engine(path)
    try:
        with engine.connect() as conn:
            config = db._alembic_config()
            config.attributes["connection"] = conn
            getattr(command, action)(config, target)
            conn.commit()
    finally:
        engine.dispose()


def test_downgrade_and_upgrade_keep_the_old_numbers(store):
    """Down to 0008 the views are 0006's again (no §8 columns); up again they are derived from the
    declarations, and the run, whose §8 sums the downgrade dropped, keeps every older number."""
    from headatlas.service.storage import db

    run = _ingest(store, "encoder", ENCODER, ENCODER_ATTN, causal=False)
    query = "SELECT * FROM head_metrics WHERE run_id = :r"
    with store.read() as conn:
        before = one_row(conn, query, r=run)
    _alembic(store.path, "downgrade", "0008_replicates")
    with store.read() as conn:
        down = one_row(conn, query, r=run)
    assert "dup_lift" not in down and "attn_to_first" not in down
    for column, value in down.items():
        assert value == pytest.approx(before[column], nan_ok=True), column
    assert db.upgrade(store.path) == ("0008_replicates", db.head_revision())
    with store.read() as conn:
        up = one_row(conn, query, r=run)
    assert up["dup_lift"] is None and up["attn_to_first_lift"] is None  # the sums are gone
    for column, value in down.items():
        assert up[column] == pytest.approx(value, nan_ok=True), column  # cls/sep/punct lifts fall back


def test_query_sort_compare_and_plot_accept_the_new_columns(store):
    from headatlas.service.reports import compare, layer_queries, queries
    from headatlas.service.reports.plots import figure_heads

    causal = _ingest(store, "decoder", DECODER, CAUSAL_ATTN, causal=True)
    with store.read() as conn:
        cols, rows = queries.heads(conn, causal, sort="dup_lift", ci=True)
        lcols, lrows = layer_queries.layers(conn, causal, ci=True)
        run = store.get_run(causal)
        ccols, crows = compare.compare(conn, run, run, metrics=["dup_lift", "induction_lift", "attn_to_first_lift"])
    head = dict(zip(cols, rows[0]))
    assert head["dup_lift"] == pytest.approx(2.0) and "dup_lift_lo" in head  # one group: no interval
    assert (
        head["induction_lift"] == pytest.approx(0.6 / 0.45) and "attn_to_next" not in head
    )  # a decoder shows attn_to_first
    layer = dict(zip(lcols, lrows[0]))
    assert layer["induction_lift"] == pytest.approx(0.6 / 0.45) and "attn_to_next" not in layer
    assert [dict(zip(ccols, r))["difference"] for r in crows] == [0.0, 0.0, 0.0]
    fig = figure_heads(cols, rows, "induction_lift", n_layers=1, n_heads=1, title="t")
    assert fig is not None


def test_a_payload_of_an_earlier_version_is_read_and_stored_without_the_new_sums(store):
    """Before 0009 a payload held the run sums as one int64 stack and no §8 sums: it is read, and
    its run shows the new columns as unavailable while the older ones keep their values."""
    import io

    from headatlas.service.engine.results import PACKED_CHANCE, BatchResult

    run = new_run(store, "legacy", seq_len=6)
    z = torch.randn(1, 1, 1, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    res = build_result(
        ["legacy-0"], [ENCODER], z, ENCODER_ATTN[None, None, None], select="topk:10", seq_len=6, tokens=TOKENS
    )
    with np.load(io.BytesIO(res.to_bytes())) as data:
        arrays = {k: data[k] for k in data.files if not k.startswith("chance.")}
    arrays["chance"] = np.stack([res.rep_chance[k] for k in PACKED_CHANCE]).astype(np.int64)
    for name in ("attn_to_first", "attn_dup", "attn_induction"):
        del arrays[f"heads.{name}"]
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    old = BatchResult.from_bytes(buf.getvalue())
    assert set(old.rep_chance) == set(PACKED_CHANCE) and old.chance["windows"] == 1
    store.ingest(run, [(0, old)])
    with store.read() as conn:
        m = one_row(conn, "SELECT * FROM head_metrics WHERE run_id = :r", r=run)
    assert m["dup_lift"] is None and m["attn_to_first"] is None and m["induction_lift"] is None
    assert m["attn_to_cls_lift"] == pytest.approx(1 + 1 / 6 + 0.1)  # against windows: the same number
    assert m["attn_to_next"] == pytest.approx((1 / 6) / 6)
