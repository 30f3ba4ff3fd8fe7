"""Attribution patching (``--effects atp``, SPEC §9): the first-order estimate of each head's
mean-ablation effect, checked against finite differences of a scaled ablation in a hook of this
test's own (no code shared with the gate of ``head_effects``), against exact mean ablation on a
random decoder, stored in a run like every other effect, and refused for a drift."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from conftest import random_batch

from headatlas.service.measures import effects as fx
from headatlas.service.measures.atp_check import atp_check, compare, spearman

DECODERS = ["random:gpt2", "random:llama"]  # tied LM heads: next-token loss


@pytest.fixture(scope="module", params=DECODERS)
def doubled(request):
    """A random decoder in float64, so that finite differences meet no rounding before their own."""
    from headatlas.service.engine.model import load_model

    model = load_model(request.param, device="cpu")
    return dataclasses.replace(model, model=copy.deepcopy(model.model).double())


def _moved(model, ids, mask, layer: int, head: int, target: torch.Tensor, step: float) -> torch.Tensor:
    """O(w) with head (layer, head)'s z moved a fraction ``step`` toward ``target`` at every position,
    ``z + step · (target − z)``, in a full forward pass (a hook on W_O's input of this test's own)."""
    d = model.d_head

    def hook(_module, args):
        z = args[0].clone()
        part = z[..., head * d : (head + 1) * d]
        z[..., head * d : (head + 1) * d] = part + step * (target.to(z.dtype) - part)
        return (z, *args[1:])

    handle = model.adapter.output_projection(model.blocks[layer]).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            final = fx._run_model(model, ids, mask)
        return fx.objective_of(model).per_window(final, ids, mask, None)
    finally:
        handle.remove()


def test_atp_is_the_derivative_of_mean_ablation_scaled_toward_zero(doubled) -> None:
    """AtP = lim_{ε→0} (O(z + ε(m − z)) − O(z)) / ε: the central difference agrees to its own
    O(ε²), and the one-sided difference's error shrinks in proportion to ε (first order exactly);
    at ε = 1 the move is mean ablation itself, which head_effects' mean effect equals."""
    model = doubled
    ids, mask = random_batch()
    means, _ = fx.reference_means(model, [random_batch(seed=1, windows=4)])
    got = fx.head_effects(model, ids, mask, kinds=("mean", "atp"), means=means)
    atp = got.effect["atp"]
    intact = got.intact
    for layer, head in [(0, 0), (model.n_layers - 1, model.n_heads - 1), (0, model.n_heads - 1)]:
        m = means[layer, head]
        eps = 1e-3  # Llama's rotary tables stay float32 in a float64 model: smaller steps meet their rounding
        central = (_moved(model, ids, mask, layer, head, m, eps) - _moved(model, ids, mask, layer, head, m, -eps)) / (
            2 * eps
        )
        torch.testing.assert_close(atp[:, layer, head], central.double(), rtol=2e-3, atol=1e-8)
        errors = []
        for step in (1e-1, 1e-2):
            one_sided = (_moved(model, ids, mask, layer, head, m, step).double() - intact) / step
            errors.append((one_sided - atp[:, layer, head]).abs().max().item())
        assert errors[1] < errors[0] / 4  # first order: ten times smaller steps, about ten times smaller errors
        full = _moved(model, ids, mask, layer, head, m, 1.0).double() - intact
        torch.testing.assert_close(got.effect["mean"][:, layer, head], full, rtol=1e-6, atol=1e-9)
        assert atp[:, layer, head].abs().max() > 0  # the head does something in a random model


def test_atp_ranks_heads_as_exact_mean_ablation_does_on_a_random_decoder() -> None:
    """On random:gpt2 (8 heads) over windows of random tokens: AtP's ranking against exact mean
    ablation (the same windows and means): ρ well above chance, AtP's top 3 mostly the exact top 3,
    and the check's exact effects are head_effects' mean effects."""
    from headatlas.service.engine.model import load_model

    model = load_model("random:gpt2", device="cpu")
    ids, mask = random_batch(seed=3, windows=10, n_pos=16)
    means, _ = fx.reference_means(model, [random_batch(seed=4, windows=8, n_pos=16)])
    check = atp_check(model, ids, mask, 3, means=means)
    assert check.heads == model.n_layers * model.n_heads
    assert check.spearman > 0.8
    assert check.recall >= 2 / 3
    exact = fx.head_effects(model, ids, mask, kinds=("mean",), means=means).effect["mean"].mean(dim=0)
    for layer, head, _atp, value in check.top:
        assert value == pytest.approx(float(exact[layer, head]), rel=1e-6, abs=1e-12)
    assert "Spearman ρ" in check.describe("nats") and "top-3 recall" in check.describe("nats")


def test_the_check_by_hand() -> None:
    exact = np.array([[3.0, -5.0, 0.1], [1.0, 0.0, -2.0]])
    atp = np.array([[2.0, -4.0, 0.2], [-3.0, 0.1, -1.0]])  # names (0,1), (1,0), (0,0): misses (1,2)
    check = compare(atp, exact, 3)
    assert [(layer, head) for layer, head, _a, _e in check.top] == [(0, 1), (1, 0), (0, 0)]
    assert check.recall == pytest.approx(2 / 3)  # exact top 3 by |effect|: (0,1), (0,0), (1,2)
    assert [e for *_, e in check.top] == [-5.0, 1.0, 3.0]
    # ρ by hand: ranks of exact 4,0,2,3,1,... computed from the formula with distinct ranks
    x, y = atp.ravel(), exact.ravel()
    rx, ry = x.argsort().argsort().astype(float), y.argsort().argsort().astype(float)
    d = rx - ry
    assert check.spearman == pytest.approx(1 - 6 * (d**2).sum() / (6 * (36 - 1)))
    assert spearman(np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 2.0, 2.0, 3.0])) == pytest.approx(1.0)
    assert np.isnan(spearman(np.ones(4), np.arange(4.0)))
    with pytest.raises(Exception, match="name 1 to 6 heads"):
        compare(atp, exact, 7)


def test_atp_beside_other_kinds_is_atp_alone(doubled) -> None:
    """AtP and gradient importance share one backward pass: each is what it is alone, and AtP alone
    gives the intact objective of its own pass."""
    ids, mask = random_batch()
    means, _ = fx.reference_means(doubled, [random_batch(seed=1, windows=4)])
    alone = fx.head_effects(doubled, ids, mask, kinds=("atp",), means=means)
    grad = fx.head_effects(doubled, ids, mask, kinds=("gradient",))
    every = fx.head_effects(doubled, ids, mask, kinds=fx.KINDS, means=means)
    torch.testing.assert_close(every.effect["atp"], alone.effect["atp"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(every.effect["gradient"], grad.effect["gradient"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(alone.intact, every.intact, rtol=1e-9, atol=1e-12)
    assert set(alone.effect) == {"atp"}


def test_atp_is_refused_for_a_drift_and_without_means(tiny_model) -> None:
    from headatlas.service.analysis_options import build_params
    from headatlas.service.errors import ParameterError
    from headatlas.service.measures.effect_batch import check_effects

    assert fx.parse_kinds("atp, zero") == ("zero", "atp")
    ids, mask = random_batch()
    means, _ = fx.reference_means(tiny_model, [(ids, mask)])
    with pytest.raises(ParameterError, match="attribution patching needs an objective that is a loss"):
        fx.head_effects(tiny_model, ids, mask, kinds=("atp",), means=means)
    with pytest.raises(ParameterError, match="--effects atp: .*not a loss"):
        check_effects(tiny_model, build_params(effects="atp"))
    with pytest.raises(ParameterError, match="needs the reference means"):
        fx.head_effects(tiny_model, ids, mask, kinds=("atp",))
    # AtP needs the reference set: its size enters the run's parameters as mean ablation's does
    assert build_params(effects="atp", effect_reference=7).to_dict()["effect_reference"] == 7
    assert build_params(effects="atp").needs_means and not build_params(effects="zero,gradient").needs_means


def test_a_run_stores_atp_as_the_mean_of_each_windows_estimate(tmp_path, demo_corpus, cli) -> None:
    """`analyze --effects atp`: effect_atp read through the views is the mean of the per-window AtP
    computed here (one batch, means from the run's first 4 windows), with its interval; the note
    says what it estimates; `effects RUN --effects atp` adds the same to a run without effects;
    `effects CORPUS --check-top` reports the check; a drift is refused."""
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.run_plan import effect_targets, first_windows
    from headatlas.service.engine.windows import TokenClasses, collate
    from headatlas.service.params import AnalysisParams
    from headatlas.service.reports import queries
    from headatlas.service.storage.effect_rows import effect_note
    from headatlas.service.storage.store import Store

    corpus = tmp_path / "corpus.txt"
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:3]
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    db = str(tmp_path / "atp.duckdb")
    args = ["--seq-len", "32", "--sentences", "punct", "--db", db, "--replicates", "window"]
    extra = ["--effects", "atp", "--effect-windows", "5", "--effect-reference", "4"]
    done = cli("analyze", str(corpus), "--model", "random:gpt2", *args, "--name", "atp", *extra)
    assert done.returncode == 0, done.stderr
    store = Store(db)
    run = store.get_run("atp")
    model = load_model("random:gpt2", device="cpu")
    params = AnalysisParams.from_dict(run.params)
    tokens = TokenClasses.for_model(model)
    ref = collate(first_windows(str(corpus), model, params, tokens, 4), tokens.pad_id)
    means, _ = fx.reference_means(model, [(ref.input_ids, ref.attention_mask)])
    batch = collate([w for _p, w in effect_targets(str(corpus), model, params, tokens)], tokens.pad_id)  # its 5
    want = fx.head_effects(model, batch.input_ids, batch.attention_mask, kinds=("atp",), means=means).effect["atp"]
    with store.read() as conn:
        columns, rows = queries.heads(conn, run.run_id, ci=True)
        note = effect_note(conn, run.run_id)
    assert "effect_atp: attribution patching" in note
    for row in rows:
        head = dict(zip(columns, row))
        expected = float(want[:, head["layer"], head["head"]].mean())
        assert head["effect_atp"] == pytest.approx(expected, rel=1e-4, abs=1e-8)
        assert head["effect_atp_lo"] is not None and head["effect_atp_lo"] <= head["effect_atp"]
        assert head["effect_mean"] is None  # not measured: unavailable, not zero

    # the same effects added afterwards to a run analysed without them (`headatlas effects RUN`)
    plain = cli("analyze", str(corpus), "--model", "random:gpt2", *args, "--name", "plain")
    assert plain.returncode == 0, plain.stderr
    added = cli("effects", "plain", "--db", db, "--effects", "atp", "--windows", "5", "--reference", "4", "-f", "csv")
    assert added.returncode == 0, added.stderr
    lines = [line.split(",") for line in added.stdout.strip().splitlines()]
    at = {name: i for i, name in enumerate(lines[0])}
    assert len(lines) == 1 + model.n_layers * model.n_heads
    for row in lines[1:]:
        expected = float(want[:, int(row[at["layer"]]), int(row[at["head"]])].mean())
        assert float(row[at["effect_atp"]]) == pytest.approx(expected, rel=1e-4, abs=1e-8)

    checked = cli(
        "effects", str(corpus), "--model", "random:gpt2", "--seq-len", "32", "--windows", "4", "--reference", "4",
        "--effects", "atp", "--check-top", "3", "--format", "csv",
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    header = checked.stdout.splitlines()[0].split(",")
    assert "effect_atp" in header and "effect_mean" in header  # the check's exact effects, shown beside AtP
    assert "check: AtP against exact mean ablation over 8 heads: Spearman ρ =" in checked.stderr
    refused = cli("effects", str(corpus), "--model", "random:gpt2", "--seq-len", "32", "--check-top", "3")
    assert refused.returncode == 2 and "add atp" in refused.stderr
    drift = cli("analyze", str(corpus), "--model", "random:tiny", *args, "--effects", "atp")
    assert drift.returncode == 2 and "not a loss" in drift.stderr


def test_an_old_database_is_upgraded_with_effect_atp_null(tmp_path, tiny_model, small_corpus) -> None:
    """Down to 0016 (no effect_atp) and up again: every number kept, effect_atp NULL (unavailable)."""
    from sqlalchemy import text
    from test_decoder_metrics import _alembic

    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage import db
    from headatlas.service.storage.store import Store

    store = Store(tmp_path / "old.duckdb")
    run = analyze_corpus(
        str(small_corpus),
        store=store,
        model=tiny_model,
        params=build_params(seq_len=32, sentences="punct", effects="zero", effect_windows=2),
        corpus=survey_corpus(str(small_corpus)),
    )
    query = "SELECT * FROM head_metrics WHERE run_id = :r ORDER BY layer, head"
    with store.read() as conn:
        before = [dict(r._mapping) for r in conn.execute(text(query), {"r": run.run_id})]
    _alembic(str(tmp_path / "old.duckdb"), "downgrade", "0016_named_head_sums")
    with store.read() as conn:
        columns = {r[0] for r in conn.execute(text("SELECT column_name FROM information_schema.columns"))}
    assert "effect_atp" not in columns
    assert db.upgrade(str(tmp_path / "old.duckdb")) == ("0016_named_head_sums", db.head_revision())
    with store.read() as conn:
        after = [dict(r._mapping) for r in conn.execute(text(query), {"r": run.run_id})]
    for old, new in zip(before, after, strict=True):
        assert new["effect_atp"] is None and new["effect_zero"] is not None
        for column, value in old.items():
            assert new[column] == pytest.approx(value, nan_ok=True), column
