"""Acceptance: what the hooks capture equals Hugging Face's own outputs."""

from __future__ import annotations

import pytest
import torch

from headatlas.service.engine.analysis import forward
from headatlas.service.engine.corpus import iter_documents
from headatlas.service.engine.hooks import act_name, capture_attention
from headatlas.service.engine.windows import TokenClasses, collate, document_windows
from headatlas.service.params import AnalysisParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_batch(real_model, demo_corpus):
    tokens = TokenClasses.from_tokenizer(real_model.tokenizer)
    doc = next(iter_documents(str(demo_corpus)))
    windows = document_windows(doc, real_model.tokenizer, tokens, real_model.tokenizer_key, AnalysisParams())
    return collate(windows[:2] + windows[-1:], tokens.pad_id)


def test_captured_attention_equals_output_attentions(real_model, real_batch):
    acts = forward(real_model, real_batch)
    with torch.no_grad():
        out = real_model.model(
            input_ids=real_batch.input_ids, attention_mask=real_batch.attention_mask, output_attentions=True
        )
    for layer in range(real_model.n_layers):
        captured = acts[act_name("pattern", layer)]
        assert captured.shape == out.attentions[layer].shape
        assert torch.equal(captured, out.attentions[layer]), f"layer {layer}"


def test_captured_head_outputs_equal_attention_times_values(real_model, real_batch):
    """z = A·V recomputed in float64 from the layer's own weights and input hidden states."""
    acts = forward(real_model, real_batch)
    with torch.no_grad():
        out = real_model.model(
            input_ids=real_batch.input_ids,
            attention_mask=real_batch.attention_mask,
            output_attentions=True,
            output_hidden_states=True,
        )
    d, heads = real_model.d_head, real_model.n_heads
    worst = 0.0
    for layer, block in enumerate(real_model.model.encoder.layer):
        worst = max(worst, _layer_error(block, layer, out, acts, heads, d))
    print(f"max abs error of captured head outputs vs A·V (float64): {worst:.2e}")
    assert worst <= 1e-4


@torch.no_grad()
def _layer_error(block, layer, out, acts, heads, d) -> float:
    value = block.attention.self.value
    hidden = out.hidden_states[layer].double()
    v = (hidden @ value.weight.double().T + value.bias.double()).view(*hidden.shape[:2], heads, d).transpose(1, 2)
    expected = out.attentions[layer].double() @ v  # [batch, head, pos, d_head]
    captured = acts[act_name("z", layer)].double().view(*hidden.shape[:2], heads, d).transpose(1, 2)
    return float((captured - expected).abs().max())


def test_streaming_capture_sees_what_output_attentions_returns(real_model, real_batch):
    """The analysis path (a per-layer callback, nothing kept) sees the same attention and head
    outputs as the stored capture and Hugging Face's output_attentions; the output is unchanged."""
    seen = {}

    def on_layer(layer, context, probs):
        seen[layer] = (context.clone(), probs.clone())

    ids, mask = real_batch.input_ids, real_batch.attention_mask
    with torch.inference_mode():
        with capture_attention(real_model.model, on_layer=on_layer) as kept:
            streamed = real_model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = real_model.model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert kept == {}
    acts = forward(real_model, real_batch)
    assert torch.equal(streamed, out.last_hidden_state)
    assert sorted(seen) == list(range(real_model.n_layers))
    for layer, (context, probs) in seen.items():
        assert torch.equal(probs, out.attentions[layer]), f"layer {layer}"
        assert torch.equal(context, acts[act_name("z", layer)]), f"layer {layer}"


def test_hooks_are_removed_after_capture(tiny_model):
    block = tiny_model.model.encoder.layer[0].attention.self
    before = len(block._forward_hooks)  # transformers may keep hooks of its own there
    with capture_attention(tiny_model.model):
        assert len(block._forward_hooks) == before + 2  # blocks.0.attn.z and blocks.0.attn.pattern, both here
    assert len(block._forward_hooks) == before
    with pytest.raises(RuntimeError):
        with capture_attention(tiny_model.model):
            raise RuntimeError("boom")
    assert len(block._forward_hooks) == before


def test_act_names_are_canonical():
    assert act_name("z", 3) == "blocks.3.attn.z"
    assert act_name("pattern", 0) == "blocks.0.attn.pattern"
    with pytest.raises(ValueError):
        act_name("q", 0)


@pytest.fixture(scope="module")
def distilbert():
    from headatlas.service.engine.model import load_model

    return load_model("random:distilbert", device="cpu")


def test_distilbert_capture_equals_output_attentions_and_attention_times_values(distilbert, demo_corpus):
    """DistilBERT through its adapter: the captured attention is Hugging Face's output_attentions,
    and the captured head outputs are A·V recomputed in float64 from each layer's own v_lin
    weights and input hidden states (padded windows included)."""
    tokens = TokenClasses.for_model(distilbert)
    doc = next(iter_documents(str(demo_corpus)))
    windows = document_windows(doc, distilbert.tokenizer, tokens, distilbert.tokenizer_key, AnalysisParams(seq_len=48))
    batch = collate(windows[:2] + windows[-1:], tokens.pad_id)
    assert batch.attention_mask[-1].sum() < batch.attention_mask[0].sum()  # a padded window
    acts = forward(distilbert, batch)
    with torch.no_grad():
        out = distilbert.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            output_attentions=True,
            output_hidden_states=True,
        )
    heads, d = distilbert.n_heads, distilbert.d_head
    valid = batch.attention_mask.bool()
    for layer, block in enumerate(distilbert.model.transformer.layer):
        assert torch.equal(acts[act_name("pattern", layer)], out.attentions[layer]), f"layer {layer}"
        with torch.no_grad():
            value = block.attention.v_lin
            hidden = out.hidden_states[layer].double()
            v = hidden @ value.weight.double().T + value.bias.double()
            v = v.view(*hidden.shape[:2], heads, d).transpose(1, 2)
            expected = out.attentions[layer].double() @ v  # [batch, head, pos, d_head]
            captured = acts[act_name("z", layer)].double().view(*hidden.shape[:2], heads, d).transpose(1, 2)
            error = (captured - expected).abs().amax(dim=(1, 3))[valid]  # padded query rows are not compared
        assert float(error.max()) <= 1e-5, f"layer {layer}"
