"""Submitting needs no weights: the tokenizer, the config's shape and the weight files'
identity give the same run key as the loaded model, and a replaced checkpoint a new one."""

from __future__ import annotations

import gc
import shutil

import numpy as np
import torch

from headatlas.service.engine.model import default_model_dir, load_model_info
from headatlas.service.engine.runner import run_key
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
