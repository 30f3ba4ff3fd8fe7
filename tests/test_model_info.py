"""Submitting needs no weights: the tokenizer, the config's shape and the weight files'
identity give the same run key as the loaded model, and a replaced checkpoint a new one."""

from __future__ import annotations

import gc
import shutil

import numpy as np
import torch

from headatlas.service.engine.model import default_model_dir, load_model_info
from headatlas.service.engine.run_plan import run_key
from headatlas.service.params import AnalysisParams


def _modules() -> int:
    return sum(issubclass(type(o), torch.nn.Module) for o in gc.get_objects())


def test_submit_and_analyze_key_the_same_run_without_loading_weights(real_model, tiny_model):
    params = AnalysisParams(seq_len=64)
    before = _modules()
    info = load_model_info("default")
    assert _modules() == before  # no module, so no weights, was built
    assert info.describe() == real_model.describe()
    assert run_key("corpus-fp", info, params) == run_key("corpus-fp", real_model, params)
    tiny = load_model_info("random:tiny")
    assert tiny.describe() == tiny_model.describe()
    assert run_key("corpus-fp", tiny, params) == run_key("corpus-fp", tiny_model, params)


def test_a_checkpoint_replaced_in_the_same_folder_is_another_model(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(default_model_dir(), folder)
    first = load_model_info(str(folder)).weights_key
    assert load_model_info(str(folder)).weights_key == first  # stable
    weights = folder / "model.safetensors"
    data = np.frombuffer(weights.read_bytes(), dtype=np.uint8).copy()
    header = 8 + int.from_bytes(data[:8].tobytes(), "little")
    data[header:] ^= 1  # fine-tuned: the same names, shapes and size, other values
    weights.write_bytes(data.tobytes())
    assert load_model_info(str(folder)).weights_key != first


def test_a_distilbert_folder_is_checked_through_its_own_config_keys(tmp_path):
    """DistilBERT's config.json names its sizes n_layers, n_heads, dim and hidden_dim: the model
    check reads them through the family's adapter, and a config that lost one is refused naming
    the field and the family it is (not "use a model of a supported family", which it is)."""
    import json

    import pytest

    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.model_check import check_model_spec
    from headatlas.service.errors import ModelError

    folder = tmp_path / "distil"
    model = load_model("random:distilbert", device="cpu")
    model.model.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    shape = check_model_spec(str(folder), seq_len=64)
    assert shape is not None
    assert (shape.layers, shape.hidden, shape.intermediate, shape.positions) == (2, 32, 128, 512)
    info = load_model_info(str(folder))
    assert (info.family, info.n_layers, info.n_heads, info.d_head) == ("distilbert", 2, 4, 8)
    with pytest.raises(ModelError, match="has 512 positions; pass --seq-len 512 or less"):
        check_model_spec(str(folder), seq_len=600)

    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["n_heads"] = "four"
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelError, match=r"has n_heads = 'four', not a positive whole number"):
        check_model_spec(str(folder), seq_len=64)
    del config["n_heads"]
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelError) as err:
        check_model_spec(str(folder), seq_len=64)
    message = str(err.value)
    assert "\n" not in message and "lacks 'n_heads', which a DistilBERT config (model_type 'distilbert')" in message
    assert "supported famil" not in message


def test_long_windows_are_taken_up_to_the_models_context_and_refused_beyond():
    import pytest

    from headatlas.service.engine.model_check import check_model_spec
    from headatlas.service.errors import ModelError, ParameterError
    from headatlas.service.params import MAX_SEQ_LEN

    # SmolLM2's shape has its context, 8,192 positions (rotary: no weights depend on it)
    assert AnalysisParams(seq_len=8192).seq_len == 8192
    shape = check_model_spec("random:smollm2", seq_len=8192)
    assert shape is not None and shape.positions == 8192
    with pytest.raises(
        ModelError, match="--seq-len 8193: model random:smollm2 has 8192 positions; pass --seq-len 8192"
    ):
        check_model_spec("random:smollm2", seq_len=8193)
    # the other random shapes keep BERT's 512
    with pytest.raises(ModelError, match="has 512 positions"):
        check_model_spec("random:llama", seq_len=513)
    with pytest.raises(ParameterError, match=f"must be between 4 and {MAX_SEQ_LEN}"):
        AnalysisParams(seq_len=MAX_SEQ_LEN + 1)
