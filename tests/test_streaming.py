"""Streaming heads (SPEC §10): known answers on random decoders (GPT-2, Llama with grouped-query
attention) and parity with an independent masked-attention forward pass on the real SmolLM2.

The reference pass shares nothing with the measure's path: the whole model runs from its input
(no restart from a recorded layer input, no stacked copies, no hook point), its attention computed
by an attention function of this test's own, registered in transformers' attention interface,
which builds the causal mask from positions and hides the streaming head's keys itself; the loss
is the cross-entropy of the tied LM head computed here."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import random_batch

from headatlas.service.errors import ParameterError
from headatlas.service.measures import streaming as st

FAMILIES = ["random:gpt2", "random:llama"]


@pytest.fixture(scope="module", params=FAMILIES)
def decoder(request):
    from headatlas.service.engine.model import load_model

    return load_model(request.param, device="cpu")


def test_the_restriction_by_hand() -> None:
    # 6 positions, 1 sink, 2 recent: row 4 sees 0 (sink), 3 and 4 (recent)
    allowed = st.streaming_allowed(6, 1, 2)
    assert allowed[4].tolist() == [True, False, False, True, True, False]
    assert allowed[1].tolist() == [True, True, False, False, False, False]
    assert st.hidden_keys(6, 1, 2)[4].tolist() == [False, True, True, False, False, False]
    assert not st.hidden_keys(6, 2, 4).any()  # n ≤ S + W: nothing hidden
    assert not st.hidden_keys(6, 0, 6).any()  # W ≥ n
    # grouped-query: 4 query heads on 2 KV heads; copy 1 restricts heads 2 and 3 only
    blocked = st.hidden_keys(4, 0, 1)
    mask = torch.zeros(2, 1, 4, 4)
    out = st.restricted_mask(mask, blocked, copies=2, n_heads=4, n_kv=2)
    assert out.shape == (2, 4, 4, 4)
    hidden = out == torch.finfo(out.dtype).min
    assert not hidden[0, 2:].any() and not hidden[1, :2].any()
    assert torch.equal(hidden[0, 0], blocked) and torch.equal(hidden[1, 3], blocked)
    for bad in ({"sink": -1, "recent": 4}, {"sink": 0, "recent": 0}):
        with pytest.raises(ParameterError):
            st.check_window(**bad)


def test_a_window_the_restriction_leaves_whole_has_effect_zero_exactly(decoder) -> None:
    ids, mask = random_batch()
    for sink, recent in ((0, 12), (1, 40), (4, 8)):  # W ≥ n, W > n, n ≤ S + W
        got = st.streaming_effects(decoder, ids, mask, sink=sink, recent=recent)
        assert torch.equal(got.effect, torch.zeros_like(got.effect))
        assert torch.equal(got.beyond, torch.zeros_like(got.beyond))
    got = st.streaming_effects(decoder, ids, mask, sink=1, recent=3)
    assert got.effect.abs().max() > 1e-4  # a random model's heads reach past 3 keys
    assert (got.beyond > 0).all()
    # the padded window (8 tokens) with S + W = 8 is left whole, the others are not
    got = st.streaming_effects(decoder, ids, mask, sink=2, recent=6)
    assert torch.equal(got.effect[-1], torch.zeros_like(got.effect[-1]))
    assert got.effect[:2].abs().max() > 0


def test_the_intact_objective_is_the_models(decoder) -> None:
    ids, mask = random_batch()
    got = st.streaming_effects(decoder, ids, mask, sink=1, recent=3)
    torch.testing.assert_close(got.intact, st.intact_objective(decoder, ids, mask).double(), rtol=1e-6, atol=1e-6)


def _self_attending(model, layer: int, kv_head: int, scale: float = 500.0):
    """``model`` (random Llama) with KV head ``kv_head`` of ``layer`` made to attend to each token
    itself alone: its queries and keys a constant vector (zero weights, a bias of ``scale``), so
    that after the rotary embedding a score depends on i − j only and is largest, by ``scale`` ×
    a gap of at least 0.4, at i = j; every other key's weight underflows to 0."""
    edited = dataclasses.replace(model, model=copy.deepcopy(model.model))
    attn = edited.adapter.attention(edited.blocks[layer])
    d, group = attn.head_dim, model.n_heads // model.n_kv_heads
    with torch.no_grad():
        for name, heads in (("q_proj", range(kv_head * group, (kv_head + 1) * group)), ("k_proj", [kv_head])):
            old = getattr(attn, name)
            new = torch.nn.Linear(old.in_features, old.out_features, bias=True)
            new.weight.copy_(old.weight)
            new.bias.zero_()
            for h in heads:
                new.weight[h * d : (h + 1) * d] = 0.0
                new.bias[h * d : (h + 1) * d] = scale**0.5
            setattr(attn, name, new)
    return edited


def test_a_head_whose_attention_lies_within_the_window_has_effect_zero_to_rounding() -> None:
    from headatlas.service.engine.model import load_model

    model = _self_attending(load_model("random:llama", device="cpu"), layer=0, kv_head=1)
    ids, mask = random_batch()
    got = st.streaming_effects(model, ids, mask, sink=0, recent=1)  # each token sees itself alone
    assert got.beyond[:, 0, 1].abs().max() < 1e-30  # the head's attention: on itself
    assert got.effect[:, 0, 1].abs().max() < 1e-5
    assert got.effect[:, 0, 0].abs().max() > 1e-3  # its neighbour, random, reaches further


@pytest.fixture(scope="module")
def smollm2_window(smollm2, demo_corpus):
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.windows import TokenClasses, collate, document_windows
    from headatlas.service.params import AnalysisParams

    tokens = TokenClasses.for_model(smollm2)
    doc = next(iter_documents(str(demo_corpus)))
    window = document_windows(doc, smollm2.tokenizer, tokens, smollm2.tokenizer_key, AnalysisParams(seq_len=48))[0]
    return collate([window], tokens.pad_id)


REFERENCE = "headatlas_test_streaming"


def _reference_attention(layer: int, kv_head: int, sink: int, recent: int):
    """An eager attention of this test's own: the causal mask from positions, and KV head
    ``kv_head`` of ``layer`` hidden from the keys outside ``sink`` + ``recent``."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **_kwargs):
        heads, n_pos = query.shape[1], query.shape[2]
        group = heads // key.shape[1]
        keys = key.repeat_interleave(group, dim=1).double()
        values = value.repeat_interleave(group, dim=1).double()
        scores = query.double() @ keys.transpose(2, 3) * scaling  # [batch, head, pos, key]
        i = torch.arange(n_pos)[:, None]
        j = torch.arange(n_pos)[None, :]
        seen = (j <= i).expand(heads, n_pos, n_pos).clone()
        if module.layer_idx == layer:
            for h in range(kv_head * group, (kv_head + 1) * group):
                seen[h] &= (j < sink) | (i - j < recent)
        scores = scores.masked_fill(~seen, float("-inf"))
        probs = scores.softmax(-1)
        return (probs @ values).transpose(1, 2).to(query.dtype).contiguous(), probs.to(query.dtype)

    return attention


def _reference_loss(model, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy of the whole window, from the tied LM head."""
    with torch.no_grad():
        final = model.model(input_ids=ids, use_cache=False).last_hidden_state[0].double()
    logits = final @ model.model.get_input_embeddings().weight.detach().double().T
    return float(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]))


def test_streaming_effects_equal_a_masked_attention_forward_pass_on_smollm2(smollm2, smollm2_window) -> None:
    from transformers import AttentionInterface

    ids, mask = smollm2_window.input_ids, smollm2_window.attention_mask
    assert ids.shape[1] >= 48 and int(mask.sum()) == ids.shape[1]
    sink, recent = 4, 8
    layers = [2]  # one layer's three KV heads, each a group of three query heads
    got = st.streaming_effects(smollm2, ids, mask, sink=sink, recent=recent, layers=layers)
    config = smollm2.model.config
    before = config._attn_implementation
    try:
        AttentionInterface.register(REFERENCE, _reference_attention(-1, 0, sink, recent))
        config._attn_implementation = REFERENCE
        intact = _reference_loss(smollm2, ids)
        assert got.intact[0].item() == pytest.approx(intact, abs=1e-4)
        for layer in layers:
            for kv_head in range(smollm2.n_kv_heads):
                AttentionInterface.register(REFERENCE, _reference_attention(layer, kv_head, sink, recent))
                want = _reference_loss(smollm2, ids) - intact
                assert got.effect[0, layer, kv_head].item() == pytest.approx(want, abs=2e-5), (layer, kv_head)
    finally:
        config._attn_implementation = before
    assert got.effect[0, layers].abs().max() > 1e-3  # the restriction changes something to compare
    assert got.effect[0, 0].isnan().all()  # layers not asked


@pytest.fixture(scope="module")
def decoder_run(tmp_path_factory, demo_corpus):
    """A decoder run (random:gpt2, next-token loss) of three documents, grouped by window so that
    a few windows fall in several replicate groups: (database, corpus)."""
    from conftest import invoke_cli

    folder = tmp_path_factory.mktemp("streaming")
    corpus = folder / "corpus.txt"
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:3]
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    db = str(folder / "st.duckdb")
    args = ["--seq-len", "32", "--sentences", "punct", "--replicates", "window"]
    done = invoke_cli("analyze", str(corpus), "--model", "random:gpt2", *args, "--db", db, "--name", "st")
    assert done.returncode == 0, done.stderr
    return db, corpus


def test_streaming_effects_stored_in_a_run_are_those_of_its_windows(decoder_run, cli) -> None:
    import json

    import numpy as np

    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.results import window_group
    from headatlas.service.engine.run_plan import effect_targets
    from headatlas.service.engine.windows import TokenClasses, collate
    from headatlas.service.operations.streaming_runs import group_jackknife, stored_streaming
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.store import Store

    db, corpus = decoder_run
    done = cli(
        "effects", "st", "--streaming", "--sink", "1", "--recent", "4", "--windows", "5", "--db", db, "--format", "json"
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    model = load_model("random:gpt2", device="cpu")
    assert len(rows) == model.n_layers * model.n_kv_heads
    assert "S = 1, W = 4" in done.stderr and "5 windows" in done.stderr and "long_range (its share" in done.stderr
    # the same windows, measured here in one batch
    run = Store(db).get_run("st")
    params = dataclasses.replace(AnalysisParams.from_dict(run.params), effect_windows=5)
    tokens = TokenClasses.for_model(model)
    windows = [w for _p, w in effect_targets(str(corpus), model, params, tokens)]
    batch = collate(windows, tokens.pad_id)
    want = st.streaming_effects(model, batch.input_ids, batch.attention_mask, sink=1, recent=4)
    groups = np.array([window_group("window", window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in windows])
    reps = np.unique(groups)
    onehot = (groups[None, :] == reps[:, None]).astype(float)  # [group, window]
    counts = np.broadcast_to(onehot.sum(1)[:, None, None], (len(reps), *want.effect.shape[1:]))
    mean, lo, hi = group_jackknife(np.einsum("gw,wlk->glk", onehot, want.effect.numpy()), counts)
    assert len(reps) >= 2 and np.isfinite(lo).all()
    for row in rows:
        layer, kv = row["layer"], row["kv_head"]
        assert row["effect"] == pytest.approx(float(mean[layer, kv]), rel=1e-6, abs=1e-9)
        assert (row["effect_lo"], row["effect_hi"]) == pytest.approx((lo[layer, kv], hi[layer, kv]), rel=1e-6, abs=1e-9)
        assert row["beyond"] == pytest.approx(float(want.beyond[:, layer, kv].mean()), rel=1e-6)
    # long_range: the share of the head's high-similarity pairs at a distance ≥ W, from the raw histograms
    import duckdb

    with duckdb.connect(db, read_only=True) as conn:
        hist = conn.execute(
            "SELECT layer, head, distance, count FROM dist_hist WHERE run_id = ?", [run.run_id]
        ).fetchall()
    far, total = np.zeros((model.n_layers, model.n_heads)), np.zeros((model.n_layers, model.n_heads))
    for layer, head, distance, count in hist:
        total[layer, head] += count
        far[layer, head] += count if distance >= 4 else 0
    assert total.all() and (far > 0).any() and (far < total).any()
    for row in rows:
        assert row["long_range"] == pytest.approx(
            far[row["layer"], row["kv_head"]] / total[row["layer"], row["kv_head"]]
        )
    # stored by (S, W), read back the same; measured again, replaced rather than added to
    table = stored_streaming(Store(db), "st", 1, 4)
    assert table is not None and table.windows == 5 and [r[2] for r in table.rows] == [r["effect"] for r in rows]
    again = cli("effects", "st", "--streaming", "--sink", "1", "--recent", "4", "--windows", "2", "--db", db)
    assert again.returncode == 0, again.stderr
    assert stored_streaming(Store(db), "st", 1, 4).windows == 2
    assert stored_streaming(Store(db), "st", 1, 5) is None
    shown = cli(
        "effects", "st", "--streaming", "--sink", "1", "--recent", "4", "--show", "--db", db, "--format", "json"
    )
    assert shown.returncode == 0 and "(stored)" in shown.stderr, shown.stderr
    assert [r["effect"] for r in json.loads(shown.stdout)] == [
        r[2] for r in stored_streaming(Store(db), "st", 1, 4).rows
    ]
    # the Python API reads the same rows back, and refuses in its own terms what is not stored
    import headatlas

    shown = headatlas.connect(db).run("st").streaming(sink=1, recent=4, show=True)
    assert shown.arrow.column("effect").to_pylist() == [r[2] for r in stored_streaming(Store(db), "st", 1, 4).rows]
    assert "Spearman" in shown.notes[0]
    with pytest.raises(ParameterError, match=r"show=True: run \d+ holds no streaming effects of sink 1 and recent 5"):
        headatlas.connect(db).run("st").streaming(sink=1, recent=5, show=True)


def test_streaming_refusals_say_why(decoder_run, cli, tiny_model) -> None:
    db, corpus = decoder_run
    for args, said in (
        ([str(corpus)], "is a corpus"),
        (["st", "--queue"], "leave out --queue"),
        (["st", "--effects", "mean"], "leave out --effects"),
        (["st", "--recent", "0"], "--recent"),
        (["st", "--recent", "7", "--show"], "holds no streaming effects of --sink 4 --recent 7"),
    ):
        done = cli("effects", *args, "--streaming", "--db", db)
        assert done.returncode != 0 and said in done.stderr, done.stderr
    with pytest.raises(ParameterError, match="attends both ways"):
        st.streaming_effects(tiny_model, *random_batch(), sink=1, recent=2)


def test_the_predictors_rank_correlation_and_its_interval_by_hand() -> None:
    import numpy as np

    from headatlas.service.measures.atp_check import spearman
    from headatlas.service.operations.streaming_runs import predictor_rho
    from headatlas.service.storage.streaming_rows import SUMS, StreamingSums

    def sums(effect: np.ndarray, beyond: np.ndarray) -> StreamingSums:
        shape = effect.shape  # [group, layer, kv_head], one window a group
        values = {name: np.zeros(shape) for name in SUMS}
        values.update(windows=np.ones(shape), effect_sum=effect, beyond_sum=beyond)
        return StreamingSums(1, 4, "next_token_loss", 8, np.arange(shape[0]), values)

    g = np.random.default_rng(0)
    beyond = g.random((4, 2, 3))
    # the effect rises with the mass in every group: ρ = 1 with or without any group
    assert predictor_rho(sums(2.0 * beyond + 1.0, beyond)) == pytest.approx((1.0, 1.0, 1.0))
    assert predictor_rho(sums(-beyond, beyond))[0] == pytest.approx(-1.0)
    effect = g.random((4, 2, 3))
    rho, lo, hi = predictor_rho(sums(effect, beyond))
    assert rho == pytest.approx(spearman(beyond.mean(0).ravel(), effect.mean(0).ravel()))
    drops = [
        spearman(np.delete(beyond, k, 0).mean(0).ravel(), np.delete(effect, k, 0).mean(0).ravel()) for k in range(4)
    ]
    half = 3.182 * np.sqrt(3 / 4 * ((np.array(drops) - np.mean(drops)) ** 2).sum())  # t_{3, 0.975}
    assert (lo, hi) == pytest.approx((max(-1.0, rho - half), min(1.0, rho + half)), abs=1e-3)  # ρ's range


class _PosMaps(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements of any tensor an operation returned whose last two axes are (pos, pos):
    a whole map (or mask) of query rows × keys."""

    def __init__(self, n_pos: int) -> None:
        super().__init__()
        self.n_pos, self.numel = n_pos, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (self.n_pos, self.n_pos):
                self.numel = max(self.numel, t.numel())
        return out


def test_long_windows_stream_in_row_blocks_with_the_same_effects_and_no_mask_per_head(monkeypatch) -> None:
    from headatlas.service.engine import row_attention as ra
    from headatlas.service.engine.model import load_model

    model = load_model("random:llama", device="cpu")  # 4 query heads on 2 KV heads
    n_pos = 40
    ids, mask = random_batch(n_pos=n_pos)  # the last window padded
    copies, batch = model.n_kv_heads, ids.shape[0]
    for sink, recent in ((1, 3), (0, 5), (4, 8)):
        monkeypatch.setattr(ra, "ATTENTION_ROW_ELEMENTS", 1 << 30)  # eager: a window's maps fit
        with _PosMaps(n_pos) as eager_maps:
            eager = st.streaming_effects(model, ids, mask, sink=sink, recent=recent)
        monkeypatch.setattr(ra, "ATTENTION_ROW_ELEMENTS", copies * batch * model.n_heads * n_pos * 6)  # 6 rows
        assert ra.uses_row_attention(model, model.n_heads, n_pos)
        with _PosMaps(n_pos) as row_maps:
            rows = st.streaming_effects(model, ids, mask, sink=sink, recent=recent)
        assert eager.effect.abs().max() > 1e-4  # something to compare
        torch.testing.assert_close(rows.effect, eager.effect, rtol=0, atol=1e-5)
        torch.testing.assert_close(rows.beyond, eager.beyond, rtol=0, atol=1e-6)
        torch.testing.assert_close(rows.intact, eager.intact, rtol=0, atol=1e-5)
        # eager: the restricted mask of every head of every copy; rows: at most the padding's mask,
        # one per window and copy, never one per head
        assert eager_maps.numel >= copies * batch * model.n_heads * n_pos * n_pos
        assert row_maps.numel <= copies * batch * n_pos * n_pos, row_maps.numel
