"""Mixing measures on decoders (SPEC §6, §8): GPT-2 and Llama (grouped-query attention) random
models. Gradients against finite differences, norm-based against the per-head product written out
by hand from the weights, ALTI's pre-norm decomposition against the block's own output, and every
measure through mixing_sums with causal (lower-triangular) rows."""

from __future__ import annotations

import copy

import pytest
import torch

from headatlas.service.engine.adapters import FAMILIES
from headatlas.service.engine.model import LoadedModel, load_model
from headatlas.service.engine.windows import TokenClasses, collate
from headatlas.service.measures.attribution import gradient_norms, trace, unit_outputs
from headatlas.service.measures.mixing import REGISTRY, TraceContext, alti_layer, mixing_sums, norm_based

DECODERS = ("random:gpt2", "random:llama")
IDS = [101, 4937, 2938, 1012, 4937]  # [CLS] standing in for BOS (random decoders borrow its tokenizer)


_LOADED: dict[str, LoadedModel] = {}


def loaded(spec: str) -> LoadedModel:
    """Each random decoder loaded once for the module (seeded: the same weights every time)."""
    if spec not in _LOADED:
        _LOADED[spec] = load_model(spec, device="cpu")
    return _LOADED[spec]


@pytest.fixture(scope="module", params=DECODERS)
def decoder(request) -> LoadedModel:
    return loaded(request.param)


@pytest.fixture(scope="module")
def decoder64(decoder) -> LoadedModel:
    model = copy.deepcopy(decoder)
    model.model.double()
    return model


def _padded_batch(model: LoadedModel):
    """Two windows, the second padded on the right."""
    from headatlas.service.engine.windows import Window

    tokens = TokenClasses.for_model(model)
    windows = [
        Window(window_id=f"w{k}", doc_id="d", index=k, input_ids=tuple(ids))
        for k, ids in enumerate((IDS + [2006, 1996, 13523], IDS[:4]))
    ]
    return tokens, collate(windows, tokens.pad_id)


def test_the_families_say_where_they_normalise():
    assert [FAMILIES[f].pre_norm for f in ("bert", "distilbert", "gpt2", "llama")] == [False, False, True, True]


def test_gradients_match_finite_differences_on_a_decoder(decoder64):
    model = decoder64
    ids = torch.tensor([IDS[:4]])
    mask = torch.ones_like(ids)
    g = gradient_norms(model, ids, mask, chunk_size=7)  # [batch, layer, unit, pos, key]
    plain = trace(model, ids, mask)
    e0 = plain.embeddings.clone()
    # e is what block 0 reads: GPT-2's token plus position embeddings, Llama's token embeddings
    torch.testing.assert_close(e0, plain.resid_pre[0], rtol=0, atol=0)
    n, d = e0.shape[1], e0.shape[2]
    eps = 1e-3  # Llama's RMSNorm computes in float32 even in a float64 model: a smaller step drowns in its rounding
    # every ±eps perturbation of every (token, coordinate) as one batch: one forward pass
    steps = torch.zeros(2, n, d, n, d, dtype=torch.float64)
    for j in range(n):
        for k in range(d):
            steps[0, j, k, j, k], steps[1, j, k, j, k] = eps, -eps
    e = e0 + steps.view(2 * n * d, n, d)
    tr = trace(model, ids.expand(2 * n * d, n), mask.expand(2 * n * d, n), embeddings=e)
    outs = torch.stack(
        [unit_outputs(tr, l, model.n_heads) for l in range(model.n_layers)], 1
    )  # [row, layer, unit, pos]
    outs = outs.view(2, n, d, *outs.shape[1:])
    jac = ((outs[0] - outs[1]) / (2 * eps)).permute(2, 3, 4, 0, 1)  # [layer, unit, pos, key, d_model]
    fd = jac.norm(dim=-1)  # [layer, unit, pos, key]; pre-norm blocks: the layer rows are not ~0
    rel = (g[0] - fd).abs().max() / fd.abs().max()
    assert rel <= 1e-3
    assert fd.abs().max() > 1e-3  # the comparison is not between zeros
    # causal: no output depends on a later token
    assert torch.triu(g[0], diagonal=1).abs().max() == 0


def _attention_input(model: LoadedModel, ids: torch.Tensor, layer: int):
    tr = trace(model, ids, torch.ones_like(ids))
    return tr, tr.attn_in[layer], tr.probs[layer]


def test_norm_based_is_the_per_head_product_written_out_on_gqa_llama():
    model = loaded("random:llama")
    assert model.n_kv_heads == 2 and model.n_heads == 4  # grouped-query: heads 0,1 -> kv 0; 2,3 -> kv 1
    ids = torch.tensor([IDS])
    layer = 1
    _tr, x, attn = _attention_input(model, ids, layer)
    block = model.blocks[layer]
    heads, lay = norm_based(block, x, attn, adapter=model.adapter)
    w_v, w_o = block.self_attn.v_proj.weight, block.self_attn.o_proj.weight  # [kv·d, d_model], [d_model, H·d]
    d = model.d_head
    n = ids.shape[1]
    expected_heads = torch.zeros(model.n_heads, n, n)
    expected_layer = torch.zeros(n, n)
    with torch.no_grad():
        for i in range(n):
            for j in range(n):
                total = torch.zeros(model.d_model)
                for h in range(model.n_heads):
                    g = h // 2
                    v = x[0, j] @ w_v[g * d : (g + 1) * d].T  # Llama's v_proj has no bias
                    f = v @ w_o[:, h * d : (h + 1) * d].T
                    expected_heads[h, i, j] = (attn[0, h, i, j] * f).norm()
                    total += attn[0, h, i, j] * f
                expected_layer[i, j] = total.norm()
    torch.testing.assert_close(heads[0], expected_heads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lay[0], expected_layer, rtol=1e-5, atol=1e-6)
    assert expected_heads.abs().max() > 1e-3
    assert torch.triu(expected_layer, diagonal=1).abs().max() == 0  # causal


def test_norm_based_reads_gpt2_fused_and_transposed_weights():
    model = loaded("random:gpt2")
    ids = torch.tensor([IDS])
    _tr, x, attn = _attention_input(model, ids, 0)
    block = model.blocks[0]
    heads, _lay = norm_based(block, x, attn, adapter=model.adapter)
    c_attn, c_proj = block.attn.c_attn, block.attn.c_proj  # Conv1D: weight [in, out]
    d, width = model.d_head, model.d_model
    h, i, j = 3, 4, 2
    with torch.no_grad():
        cols = slice(2 * width + h * d, 2 * width + (h + 1) * d)  # the value third, head h
        v = x[0, j] @ c_attn.weight[:, cols] + c_attn.bias[cols]
        f = v @ c_proj.weight[h * d : (h + 1) * d]
    torch.testing.assert_close(heads[0, h, i, j], (attn[0, h, i, j] * f).norm(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("spec", DECODERS)
def test_pre_norm_alti_decomposes_the_block_output_exactly(spec):
    """Σ_j T_i(x_j) + b_O is the block's residual after attention, x_i + Attn(LN(x))_i; ALTI's
    rows equal the contributions computed one token pair at a time."""
    model = loaded(spec)
    adapter = model.adapter
    ids = torch.tensor([IDS])
    layer = 1
    tr, x_norm, attn = _attention_input(model, ids, layer)
    block, x = model.blocks[layer], tr.resid_pre[layer]
    outputs = []
    handle = adapter.attention(block).register_forward_hook(lambda _m, _a, out: outputs.append(out[0]))
    try:
        trace(model, ids, torch.ones_like(ids))
    finally:
        handle.remove()
    mid = x + outputs[0]  # [batch, pos, d_model]
    from headatlas.service.measures.mixing import value_vectors

    with torch.no_grad():
        f = value_vectors(block, x_norm, model.n_heads, adapter=adapter)  # [batch, head, pos, d_model]
        n = ids.shape[1]
        bias = adapter.output_projection(block).bias
        b_o = bias if bias is not None else torch.zeros(model.d_model)
        expected = torch.zeros(n, n)
        for i in range(n):
            t = [(attn[0, :, i, j, None] * f[0, :, j]).sum(0) + (x[0, j] if i == j else 0) for j in range(n)]
            y = torch.stack(t).sum(0) + b_o
            torch.testing.assert_close(y, mid[0, i], rtol=1e-5, atol=1e-5)
            for j in range(n):
                expected[i, j] = max(0.0, float(y.abs().sum() - (y - t[j]).abs().sum()))
            expected[i] /= expected[i].sum()
        c = alti_layer(block, x, attn, torch.ones(1, n, dtype=torch.bool), adapter=adapter)
        # without the captured attention input, the block's own pre-norm gives the same rows
        again = alti_layer(block, x, attn, torch.ones(1, n, dtype=torch.bool))
    torch.testing.assert_close(c[0], expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(again, c)
    assert torch.triu(c[0], diagonal=1).abs().max() == 0


def test_every_measure_runs_on_a_decoder_with_causal_rows(decoder):
    from headatlas.service.engine.features import window_features

    tokens, batch = _padded_batch(decoder)
    ctx = TraceContext(decoder, batch.input_ids, batch.attention_mask, chunk_size=64)
    valid = batch.attention_mask.bool()
    for name, method in REGISTRY.items():
        with torch.enable_grad() if method.needs_grad else torch.no_grad():
            head_rows, layer_rows = method.rows(ctx)
        for rows in [*(head_rows or []), *(r[:, None] for r in layer_rows)]:  # [batch, unit, pos, key]
            assert rows.shape[-2:] == batch.input_ids.shape[-1:] * 2
            assert torch.triu(rows, diagonal=1).abs().max() <= 1e-6, name  # no mass on later tokens
            sums = rows.sum(-1)[valid[:, None].expand_as(rows.sum(-1))]
            torch.testing.assert_close(sums, torch.ones_like(sums), msg=name)
    feats = window_features(batch.input_ids, batch.attention_mask, tokens, include_special=False)
    sums = mixing_sums(
        decoder,
        batch.input_ids,
        batch.attention_mask,
        feats,
        methods=("rollout", "norm", "alti"),
        attribution=True,
        seq_len=16,
        chunk_size=64,
    )
    assert set(sums) == set(REGISTRY)
    rows = int(batch.attention_mask.sum())
    for name, s in sums.items():
        mass = s["dist"].sum(-1)  # [layer, slot]: one unit of mass per valid row, in every slot
        assert abs(mass - rows).max() < 1e-4, name
