"""The objective of SPEC §9 is chosen once, by one function (``objectives.choose``), from the
model's adapter and config and the request: submit's config check, the loaded model, the run's
record, prune and the reports all give one answer. A DistilBertForMaskedLM checkpoint (its head is
``vocab_transform``/``vocab_projector``, not BERT's ``cls``) is measured by its masked-LM loss,
Hugging Face's own; a plugin's objective (tests/plugins, entry point ``headatlas.objectives``) is
measured when a request names it and never otherwise; a name that does not apply is refused
before any run exists."""

from __future__ import annotations

import json

import pytest
import torch

ARGS = ["--seq-len", "32", "--sentences", "punct"]


@pytest.fixture(scope="module")
def distilbert_mlm(tmp_path_factory):
    """A random DistilBertForMaskedLM (2 layers, 2 heads, width 32) saved with the default
    model's tokenizer: a checkpoint whose weights hold the masked-LM head."""
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertForMaskedLM

    from headatlas.service.engine.model import default_model_dir

    folder = tmp_path_factory.mktemp("distilbert") / "mlm"
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    config = DistilBertConfig(vocab_size=tokenizer.vocab_size, n_layers=2, n_heads=2, dim=32, hidden_dim=64)
    torch.manual_seed(0)
    DistilBertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_distilbert_masked_lm_checkpoint_has_one_objective_everywhere(distilbert_mlm, small_corpus, cli, tmp_path):
    """Config alone (submit), the loaded model (workers, analyze), the run's record, prune and the
    effects' note all say masked_lm_loss; its value is DistilBertForMaskedLM's own loss."""
    from transformers import DistilBertForMaskedLM

    import headatlas
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.model import load_model
    from headatlas.service.measures import effects as fx
    from headatlas.service.measures.effect_batch import check_effects_spec
    from headatlas.service.measures.objectives import definition_for, definition_for_spec, objective_for

    spec = str(distilbert_mlm)
    assert definition_for_spec(spec).name == "masked_lm_loss"  # from config.json, no weights read
    check_effects_spec(spec, build_params(effects="zero,gradient"))  # a loss: gradient importance allowed
    model = load_model(spec, device="cpu")
    assert definition_for(model).name == "masked_lm_loss"
    objective = objective_for(model)
    assert (objective.name, objective.unit, objective.is_loss) == ("masked_lm_loss", "nats", True)
    assert objective_for(model) is objective  # built once per model

    batch = model.tokenizer(
        ["the cat sat on the mat and then it slept for a while", "a short one"], padding=True, return_tensors="pt"
    )
    ids, mask = batch["input_ids"], batch["attention_mask"]
    model_ids, targets = objective.prepare(ids, mask, ["w-a", "w-b"])
    reference = DistilBertForMaskedLM.from_pretrained(distilbert_mlm).eval()
    with torch.no_grad():
        final = fx._run_model(model, model_ids, mask)
        got = objective.per_window(final, targets, mask, final)
        for row in range(2):
            want = reference(
                input_ids=model_ids[row : row + 1], attention_mask=mask[row : row + 1], labels=targets[row : row + 1]
            ).loss
            assert got[row].item() == pytest.approx(want.item(), rel=1e-5)

    db = str(tmp_path / "d.duckdb")
    extra = ["--effects", "zero,mean,gradient", "--effect-windows", "3", "--effect-reference", "2", "--name", "d"]
    done = cli("analyze", str(small_corpus), "--model", spec, *ARGS, "--db", db, *extra)
    assert done.returncode == 0, done.stderr
    recorded = json.loads(cli("sql", "--db", db, "--run", "d", "SELECT * FROM run_effects", "--format", "json").stdout)
    assert [(r["objective"], r["unit"]) for r in recorded] == [("masked_lm_loss", "nats")]
    assert "masked_lm_loss (nats)" in headatlas.connect(db).run("d").effects().notes[0]
    pruned = cli("prune", "d", "--db", db, "--windows", "4", "--step", "50%", "--seeds", "1", "--format", "json")
    assert pruned.returncode == 0, pruned.stderr
    assert {r["order"] for r in json.loads(pruned.stdout)} >= {"effect", "importance"}  # importance: a loss
    stored = json.loads(cli("sql", "--db", db, "--run", "d", "SELECT objective FROM prunes", "--format", "json").stdout)
    assert stored == [{"objective": "masked_lm_loss"}]


def test_a_masked_lm_config_whose_weights_lack_the_head_is_refused_not_measured_otherwise(tmp_path) -> None:
    """The config decides (masked_lm_loss); the loaded model only builds it, and a head the
    weights do not hold is a one-line refusal naming the objective to ask for instead."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from headatlas.service.engine.model import default_model_dir, load_model
    from headatlas.service.errors import ModelError
    from headatlas.service.measures.objectives import definition_for_spec, objective_for

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    config = BertConfig(vocab_size=tokenizer.vocab_size, num_hidden_layers=1, num_attention_heads=2, hidden_size=16)
    BertModel(config).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**saved, "architectures": ["BertForMaskedLM"]}))
    spec = str(tmp_path / "m")
    assert definition_for_spec(spec).name == "masked_lm_loss"
    model = load_model(spec, device="cpu")
    with pytest.raises(ModelError, match="weights hold no masked-LM head.*--objective embedding_drift"):
        objective_for(model)
    assert objective_for(model, "embedding_drift").name == "embedding_drift"


def test_a_plugin_objective_is_measured_when_named_and_reported_with_its_unit(small_corpus, cli, tmp_path) -> None:
    """``--objective final_norm`` (the test plugin's) is what the run's effects measure: recorded
    with its unit, in the run's parameters, and its intact value the mean over the effect windows
    of (1/n) Σ‖h_i‖ computed here; the automatic choice never takes a plugin's."""
    from headatlas_test_plugins.objective import mean_norm

    import headatlas
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.model import load_model, model_config
    from headatlas.service.engine.run_plan import effect_targets
    from headatlas.service.engine.windows import TokenClasses, collate
    from headatlas.service.measures import effects as fx
    from headatlas.service.measures.objectives import choose, objectives
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.store import Store

    assert objectives()["final_norm"].origin.startswith("plugin final_norm (headatlas-test-plugins")
    assert choose(*model_config("random:tiny")).name == "embedding_drift"  # installed, never chosen unasked
    db = str(tmp_path / "p.duckdb")
    extra = ["--effects", "zero", "--effect-windows", "2", "--objective", "final_norm", "--name", "fn"]
    done = cli("analyze", str(small_corpus), "--model", "random:tiny", *ARGS, "--db", db, *extra)
    assert done.returncode == 0, done.stderr
    recorded = json.loads(cli("sql", "--db", db, "--run", "fn", "SELECT * FROM run_effects", "--format", "json").stdout)
    assert [(r["objective"], r["unit"]) for r in recorded] == [("final_norm", "norm")]
    assert "O = final_norm (norm)" in headatlas.connect(db).run("fn").effects().notes[0]
    run = Store(db).get_run("fn")
    assert run.params["objective"] == "final_norm"
    totals = json.loads(
        cli(
            "sql",
            "--db",
            db,
            "--run",
            "fn",
            "SELECT sum(objective) AS o, sum(effect_windows) AS n FROM run_chance",
            "--format",
            "json",
        ).stdout
    )[0]
    model = load_model("random:tiny", device="cpu")
    windows = [  # the run's 2 effect windows
        w
        for _p, w in effect_targets(
            str(small_corpus), model, AnalysisParams.from_dict(run.params), TokenClasses.for_model(model)
        )
    ]
    batch = collate(windows, TokenClasses.for_model(model).pad_id)
    with torch.no_grad():
        want = mean_norm(fx._run_model(model, batch.input_ids, batch.attention_mask).double(), batch.attention_mask)
    assert totals["n"] == 2 and totals["o"] / totals["n"] == pytest.approx(want.mean().item(), rel=1e-5)
    heads = json.loads(cli("query", "heads", "--db", db, "--run", "fn", "--format", "json").stdout)
    assert all(h["effect_zero"] is not None for h in heads)
    auto, named = build_params(effects="zero"), build_params(effects="zero", objective="final_norm")
    assert "objective" not in auto.to_dict() and auto.key() != named.key()  # auto: the key effect runs had


def test_an_objective_that_is_unknown_or_does_not_apply_is_refused_before_the_run(tmp_path, small_corpus, cli):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.errors import ParameterError, PluginError
    from headatlas.service.measures.effect_batch import check_effects_spec
    from headatlas.service.measures.objectives import ObjectiveDefinition, register

    with pytest.raises(
        ParameterError, match="does not apply to random:gpt2.*it takes next_token_loss, embedding_drift"
    ):
        check_effects_spec("random:gpt2", build_params(effects="zero", objective="final_norm"))  # encoders only
    with pytest.raises(ParameterError, match="does not apply"):
        check_effects_spec("random:tiny", build_params(effects="zero", objective="masked_lm_loss"))  # no head
    with pytest.raises(ParameterError, match="not an objective; choose auto or one of next_token_loss"):
        check_effects_spec("random:tiny", build_params(effects="zero", objective="perplexity"))
    with pytest.raises(ParameterError, match="--objective final_norm names what the effects are measured on"):
        build_params(objective="final_norm")  # nothing measures it
    with pytest.raises(PluginError, match="'embedding_drift' is headatlas's already"):
        register(ObjectiveDefinition("embedding_drift", "1", False, "a second drift", lambda _a, _c: True, print))
    db = str(tmp_path / "r.duckdb")
    refused = cli(
        "analyze", str(small_corpus), "--model", "random:gpt2", *ARGS, "--db", db, "--effects", "zero",
        "--objective", "final_norm",
    )  # fmt: skip
    assert refused.returncode == 2 and "does not apply" in refused.stderr
    assert not (tmp_path / "r.duckdb").exists() or "runs" not in cli("runs", "--db", db).stdout


def test_architecture_md_shows_the_plugin_objective_whole() -> None:
    """The worked example of docs/architecture.md ("Objectives") is the module the tests run."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "architecture.md").read_text(encoding="utf-8")
    source = (root / "tests" / "plugins" / "headatlas_test_plugins" / "objective.py").read_text(encoding="utf-8")
    assert f"```python\n{source}```" in doc
