"""`headatlas.inspect`: one text's tensors in Python (SPEC §2, §8) for every family. Parity with
the model's own output_attentions, z against A @ v of each head's key-value group, the CSM's
definition, and the figures of `headatlas inspect` drawing from the same object."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import attention_inputs

from headatlas.service.engine.adapters import kv_group
from headatlas.service.engine.model import LoadedModel, load_model

TEXT = "The cat sat on the mat. The cat sat on the mat again, and the dog watched the cat."
_LOADED: dict[str, LoadedModel] = {}


def loaded(spec: str) -> LoadedModel:
    if spec not in _LOADED:
        _LOADED[spec] = load_model(spec, device="cpu")
    return _LOADED[spec]


@pytest.fixture(scope="module", params=["random:tiny", "random:gpt2", "random:llama"])
def model(request) -> LoadedModel:
    return loaded(request.param)


def own_outputs(model: LoadedModel, ids: list[int]):
    """The model's own attention (output_attentions) and the attention inputs per layer."""
    with attention_inputs(model) as inputs, torch.inference_mode():
        tensor = torch.tensor([ids])
        out = model.model(input_ids=tensor, attention_mask=torch.ones_like(tensor), output_attentions=True)
    return out.attentions, inputs


def test_attention_and_z_match_the_model_itself(model):
    import headatlas

    seen = headatlas.inspect(TEXT, model=model, seq_len=16)
    n = len(seen.token_ids)
    assert n == 16 and seen.truncated and len(seen.tokens) == n
    assert seen.tokens == model.tokenizer.convert_ids_to_tokens(seen.token_ids)
    assert (seen.model, seen.causal) == (model.name, model.causal)
    assert (seen.n_layers, seen.n_heads, seen.d_head) == (model.n_layers, model.n_heads, model.d_head)
    assert seen.attention.shape == (model.n_layers, model.n_heads, n, n) and seen.attention.dtype == np.float32
    assert seen.z.shape == (model.n_layers, model.n_heads, n, model.d_head) and seen.z.dtype == np.float32
    attentions, inputs = own_outputs(model, seen.token_ids)
    shape = model.adapter.shape(model.model.config)
    groups = torch.tensor([kv_group(h, shape) for h in range(shape.n_heads)])
    for layer, block in enumerate(model.blocks):
        np.testing.assert_array_equal(seen.attention[layer], attentions[layer][0].numpy())
        with torch.inference_mode():
            v = model.adapter.values(block, inputs[layer])  # [1, kv_head, pos, d_head]
        expected = torch.matmul(attentions[layer], v[:, groups])[0]  # [head, pos, d_head]
        np.testing.assert_allclose(seen.z[layer], expected.numpy(), rtol=1e-5, atol=1e-6)
    if model.causal:
        assert np.triu(seen.attention, k=1).max() == 0
        assert seen.tokens[0] == model.tokenizer.convert_ids_to_tokens(model.tokenizer.bos_token_id)


def test_csm_is_z_times_z_transposed_symmetric_with_zero_diagonal(model):
    import headatlas

    seen = headatlas.inspect(TEXT, model=model, seq_len=12)
    for layer, head in ((0, 0), (seen.n_layers - 1, seen.n_heads - 1)):
        c = seen.csm(layer, head)
        z = seen.z[layer, head].astype(np.float64)
        expected = z @ z.T
        np.fill_diagonal(expected, 0)
        assert c.shape == (12, 12)
        np.testing.assert_array_equal(c, c.T)
        assert (np.diagonal(c) == 0).all()
        np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_bad_layer_head_and_short_repr(model):
    import headatlas
    from headatlas.service.errors import ParameterError

    seen = headatlas.inspect("One two three.", model=model)
    assert not seen.truncated
    with pytest.raises(ParameterError, match=rf"head {model.n_heads}: the model has heads 0\.\.{model.n_heads - 1}"):
        seen.csm(0, model.n_heads)
    with pytest.raises(ParameterError, match="layer -1"):
        seen.csm(-1, 0)
    text = repr(seen)
    assert text.startswith("InspectedText(") and len(text) < 160 and "\n" not in text
    assert f"{len(seen.tokens)} tokens" in text and ("causal" if model.causal else "bidirectional") in text


def test_figures_draw_from_the_same_object(model):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.reports.inspection import inspect_text, read_text

    params = build_params(seq_len=16)
    insp = inspect_text(model, TEXT, params)
    seen = read_text(model, TEXT, params)
    np.testing.assert_array_equal(insp.attention, seen.attention)
    np.testing.assert_array_equal(insp.text.z, seen.z)
    assert insp.tokens == seen.tokens and insp.token_ids.tolist() == seen.token_ids
    for layer in range(seen.n_layers):
        for head in range(seen.n_heads):
            np.testing.assert_allclose(insp.csm[layer, head], seen.csm(layer, head), rtol=1e-5, atol=1e-5)


def test_a_spec_loads_once_and_the_seq_len_is_checked():
    import headatlas
    from headatlas.service.api import inspection as api
    from headatlas.service.errors import ModelError

    api._inspect_model.cache_clear()
    first = headatlas.inspect("The cat sat.", model="random:gpt2", device="cpu")
    headatlas.inspect("The dog sat.", model="random:gpt2", device="cpu")
    assert api._inspect_model.cache_info().hits == 1
    assert first.causal and first.n_heads == 4
    with pytest.raises(ModelError, match="seq_len=600"):  # in Python terms: the keyword argument
        headatlas.inspect("The cat sat.", model="random:gpt2", seq_len=600, device="cpu")
    api._inspect_model.cache_clear()


@pytest.mark.slow
def test_smollm2_attention_matches_the_model_itself(smollm2):
    import headatlas

    model = smollm2
    seen = headatlas.inspect(TEXT, model=model, seq_len=24)
    attentions, _inputs = own_outputs(model, seen.token_ids)
    assert seen.causal and seen.n_heads == 9
    for layer in (0, model.n_layers - 1):
        np.testing.assert_array_equal(seen.attention[layer], attentions[layer][0].numpy())
