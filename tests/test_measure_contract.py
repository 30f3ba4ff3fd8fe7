"""The measure contract (service/engine/measure_contract.py): the built-in measures and a plugin's
register through one ``install``, a batch runs the measures a request asks for, and one rule says
which windows of a batch a measure takes, in the embedded runner and in the workers alike.

The plugin measure here sums, per head, the attention each valid query row of the run's first two
windows gives to all keys: a probability distribution's total is 1, so its known answer is the
number of valid tokens of those windows in each replicate group, at every layer and head."""

from __future__ import annotations

import base64
import dataclasses
from typing import ClassVar

import numpy as np
import pytest
import torch

from headatlas.service.analysis_options import build_params
from headatlas.service.engine import measure_contract as contract
from headatlas.service.engine.analysis import OomSplitter, analyze_batch
from headatlas.service.engine.measure_contract import ATTN_PATTERN, BatchContext, Measure, MeasureError
from headatlas.service.engine.results import BatchResult
from headatlas.service.engine.run_plan import iter_batches
from headatlas.service.engine.windows import TokenClasses
from headatlas.service.errors import ParameterError


class RowMass(Measure):
    """Σ over the valid query rows of the first ``count`` windows of Σ_k attention[q, k]."""

    name = "row_mass"
    sums: ClassVar[tuple[str, ...]] = ("mass",)
    reads = (ATTN_PATTERN,)

    def quota(self, params):
        return 2

    def on_layer(self, ctx: BatchContext, layer: int, context: torch.Tensor, attn: torch.Tensor) -> None:
        count = ctx.counts[self.name]
        mass = ctx.state.setdefault(self.name, np.zeros((ctx.n_groups, ctx.model.n_layers, ctx.model.n_heads)))
        valid = ctx.attention_mask[:count, None, :, None].to(attn.dtype)  # [window, 1, q, 1]
        per_window = (attn[:count].float() * valid).sum(dim=(2, 3)).double().cpu().numpy()  # [window, head]
        np.add.at(mass[:, layer], ctx.group[:count], per_window)

    def collect(self, ctx: BatchContext, count: int):
        return {"mass": ctx.state[self.name]}


@pytest.fixture
def row_mass():
    contract.install("test", RowMass)
    yield contract.measures()["row_mass"]
    contract.forget("row_mass")


def _batch(model, corpus, params, size=5):
    tokens = TokenClasses.for_model(model)
    batch, docs, _ = next(iter_batches(str(corpus), model, params, tokens, batch_size=size))
    return batch, docs, tokens


def _expected(batch, result, count):
    """Valid tokens of the first ``count`` windows per replicate group, at every layer and head."""
    valid = batch.attention_mask[:count].sum(1).numpy()
    groups = np.searchsorted(result.reps, _groups(batch)[:count])
    out = np.zeros(len(result.reps))
    np.add.at(out, groups, valid)
    return out


def _groups(batch):
    """Each window's replicate group under ``replicates = window``."""
    from headatlas.service.engine.results import window_group

    return [window_group("window", window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in batch.windows]


def test_the_built_in_measures_register_like_plugins_and_in_order():
    registered = contract.measures()
    assert list(registered)[:5] == ["heads", "csm", "mixing", "effects", "probe"]
    assert {contract.origin(name) for name in list(registered)[:5]} == {"built-in"}
    assert contract.DEFAULT_MEASURES[0] == "headatlas.service.measures.builtin:HeadStatistics"
    # every built-in keeps the names its sums always had
    assert "high_pairs" in registered["heads"].sums and "count" in registered["csm"].sums
    assert registered["effects"].edits == ("blocks.{L}.attn.z",)
    assert not registered["probe"].per_batch


def test_a_measure_that_breaks_the_contract_is_refused(row_mass):
    class Dotted(RowMass):
        name = "row.mass"

    class Unknown(RowMass):
        name = "unknown_point"
        reads = ("blocks.{L}.mlp.out",)

    class Undeclared(RowMass):
        name = "undeclared"
        sums = ("mass", "mass")

    for bad, words in ((Dotted, "lower-case"), (Unknown, "unknown hook point"), (Undeclared, "named twice")):
        with pytest.raises(MeasureError, match=words):
            contract.install("test", bad)
    with pytest.raises(MeasureError, match="already registered"):
        contract.install("test", RowMass)
    with pytest.raises(MeasureError, match="not a headatlas Measure"):
        contract.install("test", object)
    with pytest.raises(ParameterError, match="'nope': no measure of that name is installed"):
        contract.requested(build_params(measures=["nope"]))  # named in the parameters, as --measures does


def test_the_one_window_rule():
    params = build_params(attribution=True, attribution_windows=5, effects=("zero",), effect_windows=3)
    registered = contract.measures()
    mixing, effects, heads, probe = (registered[n] for n in ("mixing", "effects", "heads", "probe"))
    # the run's first 5 windows by position: batches of 4 from the run's start
    assert [mixing.batch_windows(params, before, 4) for before in (0, 4, 8)] == [4, 1, 0]
    assert [effects.batch_windows(params, before, 4) for before in (0, 4)] == [3, 0]
    assert heads.batch_windows(params, 8, 4) == 4 and probe.batch_windows(params, 0, 4) == 0
    chosen = contract.requested(params)
    assert [m.name for m in chosen] == ["heads", "csm", "mixing", "effects", "examples"]
    assert contract.batch_windows(chosen, params, {"mixing": 2, "effects": 2}, 4) == {"mixing": 3, "effects": 1}


def test_a_plugin_measure_runs_in_the_batch_and_its_sums_travel_by_name(tiny_model, small_corpus, row_mass):
    params = build_params(seq_len=32, replicates="window")
    batch, docs, tokens = _batch(tiny_model, small_corpus, params)
    plain = analyze_batch(tiny_model, batch, params, tokens, documents=docs)
    assert "row_mass.mass" not in plain.rep_heads  # not asked for
    asked = dataclasses.replace(params, measures=("row_mass",))
    result = analyze_batch(tiny_model, batch, asked, tokens, documents=docs)
    mass = result.rep_heads["row_mass.mass"]
    assert mass.shape == (len(result.reps), tiny_model.n_layers, tiny_model.n_heads)
    expected = _expected(batch, result, 2)
    np.testing.assert_allclose(mass, np.broadcast_to(expected[:, None, None], mass.shape), rtol=1e-5)
    assert expected.sum() == batch.attention_mask[:2].sum()  # the first two windows, no more
    # the built-in sums are those of a batch without it
    for key, value in plain.rep_heads.items():
        np.testing.assert_array_equal(result.rep_heads[key], value, err_msg=key)
    back = BatchResult.from_bytes(result.to_bytes())
    np.testing.assert_array_equal(back.rep_heads["row_mass.mass"], mass)
    # split by the OOM splitter: the parts hand the first two windows on in order
    splitter = OomSplitter()
    splitter.max_windows = 1
    parts = splitter.analyze(tiny_model, batch, asked, tokens, docs, pad_id=tokens.pad_id)
    assert [float(p.rep_heads["row_mass.mass"].sum() > 0) for p in parts] == [1.0, 1.0, 0.0, 0.0, 0.0]
    total = sum(float(p.rep_heads["row_mass.mass"].sum()) for p in parts)
    np.testing.assert_allclose(total, float(mass.sum()), rtol=1e-6)


def test_the_worker_takes_the_windows_the_rule_gives(tiny_model, small_corpus, row_mass, monkeypatch):
    """A worker's batch that starts at the run's second window: the plugin takes one window of it,
    the mixing measures (attribution_windows 3) two, as the embedded runner's rule says."""
    import headatlas.workers.tasks as tasks

    class Settings:
        attribution_chunk = 2048

    monkeypatch.setattr(tasks, "_settings", lambda: Settings)
    params = build_params(
        seq_len=32, replicates="window", mixing=("rollout",), attribution_windows=3, measures=["row_mass"]
    ).resolved(100)
    batch, docs, _ = _batch(tiny_model, small_corpus, params, size=4)
    message = {
        "database_id": "db",
        "model": "random:tiny",
        "dtype": "float32",
        "params": params.to_dict(),
        "tokenizer_key": tiny_model.tokenizer_key,
        "windows": [w.to_message() for w in batch.windows],
        "documents": docs,
        "first_window": 1,
    }
    result = BatchResult.from_bytes(base64.b64decode(tasks._analyse(tiny_model, message)))
    assert int(result.measures["mixing"]["windows"]) == 2
    mass = result.rep_heads["row_mass.mass"]
    np.testing.assert_allclose(mass[:, 0, 0], _expected(batch, result, 1), rtol=1e-5)
