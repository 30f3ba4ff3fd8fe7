"""Long windows take attention in blocks of query rows (service/engine/row_attention.py): the same
statistics as eager attention's whole maps, and no tensor of every head's pos × pos map."""

from __future__ import annotations

import pytest
import torch

from headatlas.service.engine import pair_selection
from headatlas.service.engine import row_attention as ra
from headatlas.service.engine.analysis import analyze_batch
from headatlas.service.engine.features import window_features
from headatlas.service.engine.model import load_model
from headatlas.service.engine.results import HEAD_SUMS
from headatlas.service.engine.row_attention import AttentionRows, rows_attention_forward
from headatlas.service.engine.stats import RowSums, attention_sums, copy_sums, head_statistics
from headatlas.service.engine.windows import Batch, TokenClasses, Window, collate
from headatlas.service.params import AnalysisParams, Selection
from tests.chunk_support import CLS, PAD, TOKENS, Largest


def _eager(query, key, value, allowed, scaling):
    """transformers' eager attention (repeat_kv, additive mask of the dtype's minimum, softmax)."""
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    scores = scores + torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(probs, values).transpose(1, 2), probs


def _case(seed: int = 0, n_pos: int = 41, heads: int = 4, kv_heads: int = 2, d: int = 8):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 9, (2, n_pos), generator=gen)
    ids[:, 0] = CLS
    mask = torch.ones(2, n_pos, dtype=torch.long)
    ids[1, n_pos - 6 :], mask[1, n_pos - 6 :] = PAD, 0
    feats = window_features(ids, mask, TOKENS, causal=True)
    query = torch.randn(2, heads, n_pos, d, generator=gen)
    key = torch.randn(2, kv_heads, n_pos, d, generator=gen)
    value = torch.randn(2, kv_heads, n_pos, d, generator=gen)
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    allowed = (causal[None] & mask.bool()[:, None, :])[:, None]  # [batch, 1, pos, key]
    return feats, query, key, value, allowed


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("rows", [1, 5, 41])
@pytest.mark.parametrize("masked", [True, False])
def test_row_blocks_give_eager_attentions_output_entries_and_sums(monkeypatch, rows, masked):
    feats, query, key, value, allowed = _case()
    if not masked:  # no padding: causal alone (the mask transformers leaves out)
        feats = window_features(torch.where(feats.valid, feats.input_ids, 5), torch.ones_like(allowed[:, 0, 0]), TOKENS)
        feats.causal = True
        allowed = torch.ones_like(allowed).tril()
    n_pos = query.shape[2]
    monkeypatch.setattr(ra, "ATTENTION_ROW_ELEMENTS", 2 * 4 * n_pos * rows)
    expected_out, probs = _eager(query, key, value, allowed, 0.35)
    monkeypatch.setattr(ra, "_OBSERVER", ra.ContextVar("test_observer", default=lambda: RowSums(feats)))
    out, held = rows_attention_forward(_Module(), query, key, value, allowed if masked else None, 0.35)
    assert isinstance(held, AttentionRows) and held.shape == probs.shape
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-6)
    every = torch.arange(n_pos * n_pos).expand(2, 4, -1)
    torch.testing.assert_close(held.entries(every, piece=64).view_as(probs), probs, rtol=1e-5, atol=1e-7)
    whole = {**attention_sums(probs, feats), **copy_sums(probs, feats)}
    assert held.sums is not None and held.sums.keys() == whole.keys()
    for name, value_ in whole.items():
        torch.testing.assert_close(held.sums[name], value_, rtol=1e-5, atol=1e-6, msg=name)


def test_head_statistics_read_attention_rows_as_the_whole_map(monkeypatch):
    feats, query, key, value, allowed = _case(3)
    monkeypatch.setattr(ra, "ATTENTION_ROW_ELEMENTS", 2 * 4 * query.shape[2] * 6)
    monkeypatch.setattr(ra, "_OBSERVER", ra.ContextVar("test_observer", default=lambda: RowSums(feats)))
    _, probs = _eager(query, key, value, allowed, 0.35)
    _, held = rows_attention_forward(_Module(), query, key, value, allowed, 0.35)
    z = torch.randn(2, 4, query.shape[2], 8, generator=torch.Generator().manual_seed(9))
    kwargs = dict(select=Selection.parse("top:0.05"), gate=1.5, seq_len=query.shape[2])
    whole = head_statistics(z, probs, feats, **kwargs)
    rows = head_statistics(z, held, feats, **kwargs)
    assert whole.keys() == rows.keys()
    for name in whole:
        if whole[name].is_floating_point():
            torch.testing.assert_close(rows[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(rows[name], whole[name]), name
    assert int(whole["attended_high"].sum()) > 0  # the gate read something


def _batch(model, n_pos: int) -> Batch:
    gen = torch.Generator().manual_seed(4)
    tokens = TokenClasses.for_model(model)
    windows = []
    for b, length in enumerate((n_pos, n_pos - 9)):
        ids = torch.randint(100, 2000, (length,), generator=gen).tolist()
        ids[0] = tokens.cls_id if tokens.cls_id is not None else ids[0]
        windows.append(Window(window_id=f"w{b}", doc_id="d", index=b, input_ids=tuple(ids)))
    return collate(windows, tokens.pad_id)


@pytest.fixture(scope="module")
def llama():
    return load_model("random:llama", device="cpu")


def test_a_long_window_through_the_model_keeps_its_statistics_and_no_whole_map(llama, monkeypatch):
    n_pos = 96
    batch = _batch(llama, n_pos)
    params = AnalysisParams(seq_len=n_pos, sentences="punct")
    tokens = TokenClasses.for_model(llama)
    monkeypatch.setattr(ra, "ATTENTION_ROW_ELEMENTS", 1 << 30)  # eager: a window's maps fit
    assert not ra.uses_row_attention(llama, llama.n_heads, n_pos)
    with Largest() as eager_sizes:
        eager = analyze_batch(llama, batch, params, tokens)
    monkeypatch.setattr(ra, "ATTENTION_ROW_ELEMENTS", 2 * llama.n_heads * n_pos * 10)  # blocks of 10 rows
    monkeypatch.setattr(pair_selection, "SIM_CHUNK_ELEMENTS", 2 * llama.n_heads * n_pos * 10)  # the similarity too
    assert ra.uses_row_attention(llama, llama.n_heads, n_pos)
    with Largest() as row_sizes:
        rows = analyze_batch(llama, batch, params, tokens)
    maps = 2 * llama.n_heads * n_pos * n_pos * 4  # every head's map of the batch, float32
    assert eager_sizes.bytes >= maps
    # nothing larger than one head's map of the batch (what is left: window features, int64 per pair)
    assert row_sizes.bytes < maps // llama.n_heads, row_sizes.bytes
    for name in HEAD_SUMS:
        a, b = eager.rep_heads[name], rows.rep_heads[name]
        if a.dtype.kind == "f":
            assert a == pytest.approx(b, rel=1e-4, abs=1e-5), name
        else:
            assert (a == b).all(), name
    assert (eager.rep_dist_hist == rows.rep_dist_hist).all()
    assert (eager.rep_attended_hist == rows.rep_attended_hist).all()
