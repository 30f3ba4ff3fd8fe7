"""Causal head effects (SPEC §9): known answers on random models of every family (BERT, GPT-2,
Llama with grouped-query attention) and parity with the real MiniLM's own forward pass.

Each ablation is checked against code that does not share its path: the model with the head's
W_O columns zeroed (weights edited, no hooks), and a full forward pass with the head's z replaced
(no restart from a cached layer input, no stacking of heads)."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from conftest import random_batch

from headatlas.service.measures import effects as fx
from headatlas.service.measures.objectives import embedding_drift, next_token_loss, output_drift, pooled

FAMILIES = ["random:tiny", "random:gpt2", "random:llama"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    from headatlas.service.engine.model import load_model

    return load_model(request.param, device="cpu")


def _objective(model, ids, mask, intact_final=None) -> torch.Tensor:
    objective = fx.objective_of(model)
    with torch.no_grad():
        final = fx._run_model(model, ids, mask)
    return objective.per_window(final, ids, mask, final if intact_final is None else intact_final), final


def _with_head_replaced(model, layer: int, head: int, value: torch.Tensor):
    """The model, every layer as it is, but head (layer, head)'s z replaced by ``value`` in a
    full forward pass: a hook of this test's own."""
    d = model.d_head
    block = model.blocks[layer]

    def hook(_module, args):
        z = args[0].clone()
        z[..., head * d : (head + 1) * d] = value.to(z.dtype)
        return (z, *args[1:])

    return model.adapter.output_projection(block).register_forward_pre_hook(hook)


def test_the_objectives_by_hand() -> None:
    # a 1-window "model" of width 2 over a vocabulary of 3: logits = h @ E.T
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    final = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 2]])
    mask = torch.tensor([[1, 1, 0]])  # the third token is padding: one prediction, 0 -> 1
    logits = torch.tensor([2.0, 0.0, 2.0])
    want = -(logits[1] - torch.logsumexp(logits, 0))
    assert next_token_loss(final, ids, mask, weight).item() == pytest.approx(want.item())
    # pooled over valid tokens only; drift 0 for the same states, 1 - cos otherwise
    assert pooled(final, mask).tolist() == [[1.0, 0.5]]
    assert embedding_drift(final, final, mask).item() == pytest.approx(0.0, abs=1e-7)
    other = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [9.0, 9.0]]])  # pooled (0.5, 0.5) against (1, 0.5)
    assert embedding_drift(other, final, mask).item() == pytest.approx(1 - 0.75 / (0.5**0.5 * 1.25**0.5))
    # output drift: Σ‖h' − h‖² / Σ‖h‖² over valid positions: (1 + 0) / (4 + 1)
    assert output_drift(other, final, mask).item() == pytest.approx(1 / 5)


def test_replaying_from_any_layer_gives_the_intact_model(model) -> None:
    ids, mask = random_batch()
    with torch.no_grad():
        recording = fx._record(model, ids, mask)
        for layer in range(model.n_layers):
            for copies in (1, 3):
                start = fx._repeat(fx._hidden(recording.calls[layer]), copies, ids.shape[0])
                final = fx._replay(model, recording, layer, start, copies)
                want = recording.final.repeat(copies, 1, 1)
                torch.testing.assert_close(final, want, rtol=1e-5, atol=1e-5)


def test_zero_ablation_equals_the_model_with_the_heads_output_columns_zeroed(model) -> None:
    ids, mask = random_batch()
    got = fx.head_effects(model, ids, mask, kinds=("zero",))
    intact, intact_final = _objective(model, ids, mask)
    torch.testing.assert_close(got.intact, intact.double(), rtol=1e-6, atol=1e-6)
    d = model.d_head
    for layer, head in [(0, 0), (0, model.n_heads - 1), (model.n_layers - 1, 1)]:
        edited = dataclasses.replace(model, model=copy.deepcopy(model.model))
        with torch.no_grad():
            edited.adapter.output_weight(edited.blocks[layer])[:, head * d : (head + 1) * d] = 0.0
        values, final = _objective(edited, ids, mask, intact_final)
        effect = got.effect["zero"][:, layer, head]
        torch.testing.assert_close(effect, (values - intact).double(), rtol=1e-4, atol=2e-6)
        drift = output_drift(final, intact_final, mask).double()
        torch.testing.assert_close(got.drift["zero"][:, layer, head], drift, rtol=1e-4, atol=1e-7)
        assert effect.abs().max() > 0  # the head does something in a random model


def test_mean_ablation_equals_a_full_pass_with_z_replaced_by_its_mean(model) -> None:
    ids, mask = random_batch()
    means, positions = fx.reference_means(model, [random_batch(seed=1, windows=4)])
    assert positions == 4 * 12 - 4
    got = fx.head_effects(model, ids, mask, kinds=("mean",), means=means)
    intact, intact_final = _objective(model, ids, mask)
    for layer, head in [(0, 1), (model.n_layers - 1, model.n_heads - 1)]:
        handle = _with_head_replaced(model, layer, head, means[layer, head].float())
        try:
            values, _final = _objective(model, ids, mask, intact_final)
        finally:
            handle.remove()
        torch.testing.assert_close(got.effect["mean"][:, layer, head], (values - intact).double(), rtol=1e-4, atol=2e-6)


def test_reference_means_are_the_mean_of_z_over_valid_positions(model) -> None:
    from headatlas.service.engine.hooks import act_name, capture_attention

    ids, mask = random_batch(seed=2)
    means, positions = fx.reference_means(model, [(ids[:2], mask[:2]), (ids[2:], mask[2:])])
    with torch.no_grad(), capture_attention(model.model) as acts:
        fx._run_model(model, ids, mask)
    z = acts[act_name("z", 1)].double()  # [batch, pos, head·d_head]
    rows = z[mask.bool()]
    assert positions == rows.shape[0]
    torch.testing.assert_close(means[1].reshape(-1), rows.mean(dim=0), rtol=1e-6, atol=1e-9)


def test_a_head_whose_output_columns_are_zero_has_no_effect(model) -> None:
    ids, mask = random_batch()
    edited = dataclasses.replace(model, model=copy.deepcopy(model.model))
    d = model.d_head
    with torch.no_grad():
        edited.adapter.output_weight(edited.blocks[0])[:, 2 * d : 3 * d] = 0.0
    means, _ = fx.reference_means(edited, [random_batch(seed=1)])
    kinds = ("zero", "mean", "gradient") if fx.objective_of(edited).is_loss else ("zero", "mean")
    got = fx.head_effects(edited, ids, mask, kinds=kinds, means=means)
    for kind in kinds:
        assert got.effect[kind][:, 0, 2].abs().max() < 1e-6, kind
        assert got.effect[kind][:, 0, 1].abs().max() > 1e-6, kind  # its neighbour still matters
    assert got.drift["zero"][:, 0, 2].abs().max() < 1e-10


def test_stacked_heads_equal_one_head_at_a_time(model) -> None:
    ids, mask = random_batch()
    stacked = fx.head_effects(model, ids, mask, kinds=("zero",))
    single = fx.head_effects(model, ids, mask, kinds=("zero",), heads_per_pass=1)
    torch.testing.assert_close(stacked.effect["zero"], single.effect["zero"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stacked.drift["zero"], single.drift["zero"], rtol=1e-5, atol=1e-8)
    part = fx.head_effects(model, ids, mask, kinds=("zero",), layers=[1])
    assert part.effect["zero"][:, 0].isnan().all()
    torch.testing.assert_close(part.effect["zero"][:, 1], stacked.effect["zero"][:, 1])


def test_gradient_importance_equals_a_finite_difference_of_the_gate(model) -> None:
    if not fx.objective_of(model).is_loss:
        with pytest.raises(Exception, match="needs an objective that is a loss"):
            fx.head_effects(model, *random_batch(), kinds=("gradient",))
        return
    doubled = dataclasses.replace(model, model=copy.deepcopy(model.model).double())
    ids, mask = random_batch()
    got = fx.head_effects(doubled, ids, mask, kinds=("gradient",)).effect["gradient"]
    eps = 1e-3  # Llama's rotary tables stay float32 in a float64 model: smaller steps meet their rounding
    d = model.d_head
    for layer, head in [(0, 0), (model.n_layers - 1, model.n_heads - 1)]:
        values = []
        for scale in (1 + eps, 1 - eps):

            def hook(_module, args, scale=scale, head=head):
                z = args[0].clone()
                z[..., head * d : (head + 1) * d] *= scale
                return (z, *args[1:])

            handle = doubled.adapter.output_projection(doubled.blocks[layer]).register_forward_pre_hook(hook)
            try:
                objective = fx.objective_of(doubled)
                with torch.no_grad():
                    final = fx._run_model(doubled, ids, mask)
                values.append(objective.per_window(final, ids, mask, None))
            finally:
                handle.remove()
        finite = ((values[0] - values[1]) / (2 * eps)).abs()
        torch.testing.assert_close(got[:, layer, head], finite, rtol=2e-3, atol=1e-8)


def test_gradient_importance_alone_gives_the_intact_objective_of_its_own_pass(model) -> None:
    # without an ablation no pass records the layers' inputs: the gradient's forward pass, every gate
    # at 1, is the intact model, and its objective is the one an ablation run compares with
    if not fx.objective_of(model).is_loss:
        return
    ids, mask = random_batch()
    alone = fx.head_effects(model, ids, mask, kinds=("gradient",))
    beside = fx.head_effects(model, ids, mask, kinds=("zero", "gradient"))
    torch.testing.assert_close(alone.intact, beside.intact, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(alone.effect["gradient"], beside.effect["gradient"])
    assert set(alone.effect) == {"gradient"}


def test_effect_kinds_are_checked() -> None:
    assert fx.parse_kinds("gradient, zero") == ("zero", "gradient")
    with pytest.raises(Exception, match="'drop' is not an effect; use zero, mean, gradient"):
        fx.parse_kinds("zero,drop")


def test_minilm_zero_ablation_matches_its_own_forward_with_w_o_zeroed(real_model) -> None:
    """The real default model: embedding drift of the head with the largest effect, against the
    transformers model with that head's W_O columns zeroed."""
    tokens = real_model.tokenizer(
        ["The cat sat on the mat. It was warm.", "Paris is the capital of France."],
        padding=True,
        return_tensors="pt",
    )
    ids, mask = tokens["input_ids"], tokens["attention_mask"]
    got = fx.head_effects(real_model, ids, mask, kinds=("zero",), layers=[0, 5])
    assert got.objective.name == "embedding_drift"
    layer, head = 5, int(got.effect["zero"][:, 5].mean(dim=0).argmax())
    edited = dataclasses.replace(real_model, model=copy.deepcopy(real_model.model))
    d = real_model.d_head
    with torch.no_grad():
        edited.blocks[layer].attention.output.dense.weight[:, head * d : (head + 1) * d] = 0.0
        want = embedding_drift(
            edited.model(input_ids=ids, attention_mask=mask).last_hidden_state,
            real_model.model(input_ids=ids, attention_mask=mask).last_hidden_state,
            mask,
        )
    torch.testing.assert_close(got.effect["zero"][:, layer, head], want.double(), rtol=1e-4, atol=1e-7)
    assert want.min() > 0


def test_the_jackknife_interval_by_hand() -> None:
    import numpy as np

    from headatlas.service.operations.effect_runs import jackknife
    from headatlas.service.reports.intervals import t95

    values = np.array([[1.0], [3.0], [2.0], [6.0]])
    groups = np.array([0, 0, 1, 2])
    mean, lo, hi, r = jackknife(values, groups)
    # leave-one-group-out means: without 0 → (2+6)/2 = 4, without 1 → 10/3, without 2 → 2
    drops = np.array([4.0, 10 / 3, 2.0])
    half = t95(2) * np.sqrt(2 / 3 * ((drops - drops.mean()) ** 2).sum())
    assert r == 3 and mean[0] == 3.0
    assert lo[0] == pytest.approx(3.0 - half) and hi[0] == pytest.approx(3.0 + half)
    _m, lo1, _h, r1 = jackknife(values, np.zeros(4, dtype=int))
    assert r1 == 1 and np.isnan(lo1).all()  # one group: no interval


def test_effects_command_and_api_agree_on_real_text(tmp_path, small_corpus) -> None:
    import json

    from conftest import invoke_cli

    import headatlas

    args = ["--model", "random:gpt2", "--seq-len", "32", "--windows", "6", "--reference", "4"]
    done = invoke_cli("effects", str(small_corpus), *args, "--effects", "zero,mean,gradient", "--format", "json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert len(rows) == 2 * 4 and {r["layer"] for r in rows} == {0, 1}
    for row in rows:
        for name in ("effect_zero", "effect_mean", "importance"):
            assert row[f"{name}_lo"] <= row[name] <= row[f"{name}_hi"], row
        assert row["importance"] >= 0 and row["drift_zero"] > 0
    api = headatlas.effects(
        small_corpus, "random:gpt2", kinds="zero,mean,gradient", windows=6, reference=4, seq_len=32
    ).to_pylist()
    for a, b in zip(api, rows, strict=True):
        assert a["effect_zero"] == pytest.approx(b["effect_zero"], rel=1e-9)
        assert a["importance"] == pytest.approx(b["importance"], rel=1e-9)
    assert "next_token_loss" in headatlas.effects(small_corpus, "random:gpt2", windows=2, seq_len=32).notes[0]
    # the default model's objective is a drift: gradient importance is refused in one line, before any work
    refused = invoke_cli("effects", str(small_corpus), "--model", "random:tiny", "--effects", "gradient")
    assert refused.returncode == 2 and "not a loss" in refused.stderr


def test_spearman_by_hand() -> None:
    import numpy as np

    from headatlas.service.operations.prune_curves import spearman

    assert spearman(np.array([1.0, 2.0, 3.0]), np.array([10.0, 30.0, 20.0])) == pytest.approx(0.5)
    assert spearman(np.array([1.0, 2.0, 3.0, 4.0]), np.array([4.0, 3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    # ties take their mean rank: x ranks (0.5, 0.5, 2), y ranks (0, 1, 2); centred, Σxy = 1.5, Σx² = 1.5, Σy² = 2
    assert spearman(np.array([1.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(1.5 / (1.5 * 2) ** 0.5)


def test_prune_a_stored_run(tmp_path, small_corpus) -> None:
    """The curves' known answers: with no head removed every order gives the intact model, with all
    removed every order gives the same model; noise orders by the run's own noise_share."""
    import json

    from conftest import invoke_cli

    db = str(tmp_path / "p.duckdb")
    done = invoke_cli("analyze", str(small_corpus), "--model", "random:gpt2", "--seq-len", "32", "--db", db, "-q")
    assert done.returncode == 0, done.stderr
    args = ["--db", db, "--windows", "4", "--reference", "4", "--step", "50%", "--seeds", "2"]
    out = tmp_path / "curves.png"
    done = invoke_cli("prune", *args, "--format", "json", "--out", str(out))
    assert done.returncode == 0, done.stderr
    steps = [line.strip() for line in done.stderr.splitlines() if ": step " in line]
    # each step says how long the rest will take at the pace so far; the last has nothing left
    assert all(re.fullmatch(r"\S+: step \d+/\d+, (about \d+ (s|min \d+ s)|under 1 s) left", s) for s in steps[:-1]), (
        steps
    )
    assert re.fullmatch(r"\S+: step (\d+)/\1", steps[-1]), steps[-1]
    rows = json.loads(done.stdout)
    orders = {r["order"] for r in rows}
    trivial = {"layer", "sinks", "output_norm", "output_variance"}  # blind to what a head does
    assert orders == {"effect", "importance", "one_per_layer", "noise", "random:0", "random:1", *trivial}
    assert [r["heads_removed"] for r in rows if r["order"] == "layer"] == [0, 4, 8]
    first = {r["objective"] for r in rows if r["heads_removed"] == 0}
    last = [r["objective"] for r in rows if r["heads_removed"] == 8]
    assert len(first) == 1 and len(last) == len(orders) - 1  # one_per_layer keeps a head of each layer
    assert [r["heads_removed"] for r in rows if r["order"] == "one_per_layer"] == [0, 6]
    assert max(last) - min(last) < 1e-9 and abs(last[0] - first.pop()) > 1e-6
    assert [r["heads_removed"] for r in rows if r["order"] == "noise"] == [0, 4, 8]
    assert out.stat().st_size > 10_000
    refused = invoke_cli("prune", "--db", db, "--step", "0%")
    assert refused.returncode == 2 and "--step '0%'" in refused.stderr


def test_output_statistics_are_each_heads_output_norm_and_variance_by_hand(tiny_model) -> None:
    """The ``output_norm`` and ``output_variance`` orders' known answers: each head's output
    ``o = z W_O^h`` at the valid positions of a padded batch, recomputed here from the input of the
    attention's output projection (a hook of the test's own), its mean norm and the mean squared
    distance from its mean."""
    from headatlas.service.engine.corpus import Document
    from headatlas.service.engine.windows import TokenClasses, collate, document_windows
    from headatlas.service.operations.prune_curves import output_statistics
    from headatlas.service.params import AnalysisParams

    model = tiny_model
    adapter, heads, d = model.adapter, model.n_heads, model.d_head
    tokens, params = TokenClasses.for_model(model), AnalysisParams(seq_len=32)
    windows = [
        w
        for i, text in enumerate(["One short line. And a longer second line, with commas.", "Tiny."])
        for w in document_windows(
            Document(doc_id=str(i), source="t", index=i, line=1, text=text),
            model.tokenizer,
            tokens,
            model.tokenizer_key,
            params,
        )
    ]
    batch = collate(windows, tokens.pad_id)
    assert (batch.attention_mask == 0).any()  # a padded row: its padding must not count
    taken: dict[int, torch.Tensor] = {}
    blocks = adapter.blocks(model.model)
    handles = [
        adapter.output_projection(block).register_forward_pre_hook(
            lambda _m, args, layer=layer: taken.update({layer: args[0]})
        )
        for layer, block in enumerate(blocks)
    ]
    try:
        with torch.no_grad():
            model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        for handle in handles:
            handle.remove()
    norm, variance = output_statistics(model, [batch])
    valid = batch.attention_mask.bool()
    for layer, z in taken.items():
        w_o = adapter.output_weight(blocks[layer]).double()
        for head in range(heads):
            o = z[valid][:, head * d : (head + 1) * d].double() @ w_o[:, head * d : (head + 1) * d].T  # [n, d_model]
            assert norm[layer, head] == pytest.approx(o.norm(dim=1).mean().item(), rel=1e-5)
            spread = ((o - o.mean(dim=0)) ** 2).sum(dim=1).mean().item()
            assert variance[layer, head] == pytest.approx(spread, rel=1e-4, abs=1e-9)


def test_the_claim_against_the_best_trivial_order_and_without_intervals_in_words() -> None:
    from headatlas.service.operations.prune_curves import PruneResult

    result = PruneResult("m", "embedding_drift", "1 - cos", 0, 4, 1, "block:8", 8)
    result.area = (-0.02, float("nan"), float("nan"))
    result.trivial = ("layer", 0.01, float("nan"), float("nan"))
    said = result.claim()
    assert "nan" not in said.lower(), said
    assert "against the best trivial order (layer) +0.01 1 - cos·fraction (no interval: 1 replicate group" in said
    assert said.count("undecided (no interval)") == 2
    result.groups = 5
    result.area, result.trivial = (-0.02, -0.03, -0.01), ("output_norm", 0.01, 0.005, 0.02)
    said = result.claim()
    assert "[-0.03, -0.01] (negative: pruning by noise costs less): supported" in said
    assert "(output_norm) +0.01 1 - cos·fraction [+0.005, +0.02]: contradicted" in said
