"""The CUDA path, on a machine with a GPU (`make gpu-check`); skipped elsewhere, saying why.

- statistics computed on the GPU equal the CPU's: identical pair counts, float sums within
  1e-4 relative (different summation orders), per-head within-sentence counts within 2 % of
  the head's pairs (a near-tie may rank differently);
- a bfloat16 forward under autocast agrees with float32 within the tolerances of
  tests/test_precision.py;
- a real CUDA out-of-memory error (the process limited to a small share of the GPU) is
  recovered by halving, with the same pair counts as fixed batches of 32;
- ``--batch-size auto`` picks a size from free GPU memory that runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from precision_checks import assert_half_agrees

from headatlas.service.engine.analysis import OomSplitter, analyze_batch
from headatlas.service.engine.corpus import iter_documents
from headatlas.service.engine.windows import TokenClasses, collate, document_windows
from headatlas.service.params import AnalysisParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: `make gpu-check` on a GPU machine"),
]

INT_KEYS = ("high_pairs", "same_sentence_high", "same_token_high", "attended_high")


@pytest.fixture(scope="module")
def gpu_model():
    from headatlas.service.engine.model import load_model

    return load_model("default", device="cuda")


@pytest.fixture(scope="module")
def windows(real_model, demo_corpus):
    params = AnalysisParams()
    tokens = TokenClasses.from_tokenizer(real_model.tokenizer)
    out = []
    for doc in iter_documents(str(demo_corpus)):
        out += document_windows(doc, real_model.tokenizer, tokens, real_model.tokenizer_key, params)
    return tokens, out


def test_statistics_on_the_gpu_equal_the_cpu(real_model, gpu_model, windows):
    tokens, wins = windows
    params = AnalysisParams()
    batch = collate(wins[:16], tokens.pad_id)
    cpu = analyze_batch(real_model, batch, params, tokens)
    gpu = analyze_batch(gpu_model, batch, params, tokens)
    assert_same_statistics(gpu, cpu)
    assert gpu.chance == cpu.chance
    np.testing.assert_array_equal(gpu.pair_hist, cpu.pair_hist)
    high = cpu.heads["high_pairs"]
    assert np.abs(gpu.dist_hist - cpu.dist_hist).sum() <= 0.02 * high.sum()


def assert_same_statistics(gpu, cpu) -> None:
    """Identical pair counts; the other counts (which rank a near-tie may flip) within 2 % of the
    head's high pairs; float sums within 1e-4 relative (other summation orders)."""
    np.testing.assert_array_equal(gpu.heads["high_pairs"], cpu.heads["high_pairs"])
    high = np.maximum(cpu.heads["high_pairs"], 1)
    for key, value in cpu.heads.items():
        if key == "high_pairs":
            continue
        if np.issubdtype(value.dtype, np.integer):
            assert (np.abs(gpu.heads[key] - value) / high).max() <= 0.02, key
        else:
            np.testing.assert_allclose(gpu.heads[key], value, rtol=1e-4, atol=1e-3, err_msg=key)


def test_bfloat16_autocast_on_the_gpu_agrees_with_float32(gpu_model, windows):
    import copy

    tokens, wins = windows
    params = AnalysisParams()
    batch = collate(wins[:16], tokens.pad_id)
    full = analyze_batch(gpu_model, batch, params, tokens)
    half_model = copy.copy(gpu_model)
    half_model.dtype = torch.bfloat16
    half = analyze_batch(half_model, batch, params, tokens)
    assert_half_agrees(full, half)


def test_a_real_out_of_memory_error_is_recovered_by_halving(gpu_model, windows):
    tokens, wins = windows
    params = AnalysisParams()
    big = collate((wins * (1 + 512 // len(wins)))[:512], tokens.pad_id)
    small = [collate(big.windows[i : i + 32], tokens.pad_id) for i in range(0, 512, 32)]
    expected = [analyze_batch(gpu_model, b, params, tokens) for b in small]
    torch.cuda.empty_cache()
    _free, total = torch.cuda.mem_get_info()
    # room for the model and about a hundred windows (a layer's attention maps and scratch for
    # 512 windows take about 3 GB), not for 512 at once
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (1 << 30)) / total)
    try:
        splitter = OomSplitter()
        parts = splitter.analyze(gpu_model, big, params, tokens, [], pad_id=tokens.pad_id)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert splitter.max_windows is not None and splitter.max_windows < 512, "never ran out of memory"
    assert sum(len(p.window_ids) for p in parts) == 512
    whole = {key: sum(e.heads[key] for e in expected) for key in INT_KEYS}
    split = {key: sum(p.heads[key] for p in parts) for key in INT_KEYS}
    np.testing.assert_array_equal(split["high_pairs"], whole["high_pairs"])
    for key in INT_KEYS[1:]:  # other batch shapes: a near-tie may rank differently
        assert (np.abs(split[key] - whole[key]) / whole["high_pairs"]).max() <= 0.02, key


def test_auto_batch_size_fits(gpu_model, windows):
    from headatlas.service.engine.model import auto_batch_size

    tokens, wins = windows
    size = auto_batch_size(gpu_model, 128)
    assert size >= 32
    batch = collate((wins * (1 + size // len(wins)))[:size], tokens.pad_id)
    result = OomSplitter().analyze(gpu_model, batch, AnalysisParams(), tokens, [], pad_id=tokens.pad_id)
    assert sum(len(r.window_ids) for r in result) == size


@pytest.mark.parametrize("spec", ["random:smollm2", "random:gpt2-small"])
def test_decoder_statistics_on_the_gpu_equal_the_cpu(spec, demo_corpus):
    """The decoder path (causal gate, SPEC §8 sums, grouped-query attention in the SmolLM2 shape)
    gives the CPU's statistics on the GPU: the same seeded weights, the same windows."""
    from headatlas.service.engine.model import load_model

    cpu_model, gpu_model = load_model(spec, device="cpu"), load_model(spec, device="cuda")
    params = AnalysisParams()
    tokens = TokenClasses.for_model(cpu_model)
    wins = []
    for doc in iter_documents(str(demo_corpus)):
        wins += document_windows(doc, cpu_model.tokenizer, tokens, cpu_model.tokenizer_key, params)
        if len(wins) >= 16:
            break
    batch = collate(wins[:16], tokens.pad_id)
    assert_same_statistics(
        analyze_batch(gpu_model, batch, params, tokens), analyze_batch(cpu_model, batch, params, tokens)
    )
