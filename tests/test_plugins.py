"""Extension points used from outside headatlas (service/plugins.py): the tests' plugin package
(tests/plugins/, installed beside headatlas by `make install-test`) adds a model family, a metric
and a backend through entry points; packages written here into a temporary folder on sys.path,
with their own distribution metadata, show how a broken or contract-breaking plugin is refused:
one line naming it, headatlas unharmed, no run started."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from headatlas.service import plugins
from headatlas.service.engine.adapters import ADAPTERS, FAMILIES, families
from headatlas.service.metrics import COLUMNS, all_columns, plugin_metrics

ORIGIN = "headatlas-test-plugins 0.1.0"
INSTALLED = ["attended_share", "both_punct"]  # the test plugins' metrics (both_punct with a sum of its own)
BOTH_PUNCT = ["both_punct_share", "word_pairs_share", "both_punct_per_window"]
TEXT = "The cat sat on the mat. The dog sat on the mat too, and the cat watched the dog. It rained."


@pytest.fixture()
def temporary_plugin(tmp_path, monkeypatch):
    """``install(dist, entry_points, modules)``: a distribution in a folder put on sys.path, found by
    importlib.metadata like any installed one; every group is read again afterwards."""
    families()  # the installed plugins' families first, so that the registries put back hold them
    saved = dict(ADAPTERS), dict(FAMILIES)
    site = tmp_path / "site"
    created: list[str] = []

    def install(dist: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]) -> None:
        for name, source in modules.items():
            created.append(name)
            path = site / f"{name.replace('.', '/')}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source), encoding="utf-8")
        info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n", encoding="utf-8")
        groups = "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
            for group, entries in entry_points.items()
        )
        (info / "entry_points.txt").write_text(groups, encoding="utf-8")
        monkeypatch.syspath_prepend(str(site))
        plugins.forget()

    yield install
    for name in created:
        sys.modules.pop(name, None)
    plugins.forget()
    ADAPTERS.clear()
    ADAPTERS.update(saved[0])
    FAMILIES.clear()
    FAMILIES.update(saved[1])


def test_the_test_plugins_family_and_metric_are_listed_with_their_origin(cli):
    models = cli("models", "--format", "json")
    assert models.returncode == 0 and models.stderr == ""

    rows = json.loads(models.stdout)
    neox = [r for r in rows if r["family"] == "gpt_neox"]
    assert {r["model"] for r in neox} == {"random:neox", "PATH, hub name or FILE.gguf"}
    assert {r["origin"] for r in neox} == {f"plugin gpt_neox ({ORIGIN})"}
    assert {r["origin"] for r in rows if r["family"] != "gpt_neox"} == {"headatlas"}
    metrics = cli("metrics", "--format", "json")
    listed = {r["column"]: r for r in json.loads(metrics.stdout)}
    assert listed["attended_share"]["origin"] == f"plugin attended_share ({ORIGIN})"
    assert listed["noise_share"]["origin"] == "headatlas"
    table = cli("metrics")  # piped: the prose columns wrap at 100, so read the words in order
    assert f"attended_high / high_pairs plugin attended_share ({ORIGIN})" in " ".join(table.stdout.split())


def test_a_plugin_metric_is_a_view_column_with_its_known_answer(tmp_path, real_model):
    """attended_share = attended_high / high_pairs, which headatlas's noise_share reads as
    1 − noise_share: per head, per layer and in every replicate row of the intervals."""
    import headatlas

    assert [c.name for c in all_columns()] == [*(c.name for c in COLUMNS), "attended_share", *BOTH_PUNCT]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join([TEXT, TEXT.lower(), TEXT.upper()]) + "\n", encoding="utf-8")
    run = headatlas.analyze(corpus, db=tmp_path / "p.duckdb", model=real_model, seq_len=32, progress=False)
    atlas = headatlas.connect(tmp_path / "p.duckdb")
    for view in ("head_metrics", "layer_metrics", "head_metrics_reps"):
        rows = atlas.sql(f"SELECT attended_share, noise_share FROM {view} WHERE run_id = {run.run_id}").to_pylist()
        assert rows and all((r["attended_share"] is None) == (r["noise_share"] is None) for r in rows), view
        for r in rows:
            if r["noise_share"] is not None:
                assert r["attended_share"] == pytest.approx(1 - r["noise_share"], abs=1e-12)
        if view == "head_metrics":
            assert len(rows) == real_model.n_layers * real_model.n_heads
            assert len({r["attended_share"] for r in rows}) > 1  # the heads differ: not a constant


def test_a_broken_plugin_is_one_line_naming_it_and_headatlas_goes_on(temporary_plugin, cli):
    temporary_plugin(
        "broken-plugin",
        {"headatlas.families": {"broken": "broken_plugin:Adapter"}},
        {"broken_plugin": "import a_module_that_is_not_installed\n"},
    )
    result = cli("models", "--format", "json")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "headatlas: plugin broken (broken-plugin 0.1), headatlas.families = broken_plugin:Adapter, is not loaded: "
        "ModuleNotFoundError: No module named 'a_module_that_is_not_installed'"
    ]
    assert '"gpt_neox"' in result.stdout  # the working plugin's family is still there
    assert plugins.failures() == result.stderr.splitlines()


def test_a_plugin_family_that_lacks_a_part_is_refused_before_any_run(temporary_plugin, cli, tmp_path):
    temporary_plugin(
        "partial-plugin",
        {"headatlas.families": {"partial": "partial_plugin:PartialAdapter"}},
        {
            "partial_plugin": """
            from headatlas.service.engine.adapters import ConfigKeys, RandomShape
            from headatlas.service.engine.adapters.distilbert import DistilBertAdapter


            class PartialAdapter(DistilBertAdapter.__mro__[1]):  # ModelAdapter, without the block parts
                family, title, model_types, causal, pre_norm = "partial", "Partial", ("partial",), False, False
                config_keys = ConfigKeys()
                random_shapes = {"partial": RandomShape("partial", 1, 2, 8)}
                blocks = DistilBertAdapter.blocks
                attention = DistilBertAdapter.attention
                output_projection = DistilBertAdapter.output_projection
                output_weight = DistilBertAdapter.output_weight
                values = DistilBertAdapter.values
                random_config = DistilBertAdapter.random_config
            """
        },
    )
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT + "\n", encoding="utf-8")
    db = tmp_path / "partial.duckdb"
    result = cli("analyze", str(corpus), "--model", "random:partial", "--db", str(db), "--quiet")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("headatlas: plugin partial (partial-plugin 0.1)") and "AdapterIncomplete" in lines[0]
    assert "lacks attention_norm, embedding_output, final_norm" in lines[0]
    assert "random:partial" in lines[-1] and len(lines) == 2
    assert "partial" not in families()
    if db.exists():  # nothing was started in it
        import headatlas

        assert headatlas.connect(db).sql("SELECT count(*) AS n FROM runs").to_pylist() == [{"n": 0}]


@pytest.mark.parametrize(
    ("declaration", "why"),
    [
        (
            'Metric("m", "§0", "d", "", (Column("m", "high_pairs", "d"),), sums=(run_int("m.runs"),))',
            "metric 'm': sum 'm.runs' is per run; a plugin's sums are per head",
        ),
        (
            'Metric("m", "§0", "d", "", (Column("m", "high_pairs", "d"),), sums=(head_int("M sum"),))',
            "metric 'm': sum 'M sum' is not a sum name: '<measure>.<sum>'",
        ),
        (
            'Metric("m", "§0", "d", "", (Column("m", "high_pairs", "d"),), sums=(head_int("high_pairs"),))',
            "metric 'm': sum 'high_pairs' is a column or sum already",
        ),
        (  # a column may name an earlier column of its own, not a later one
            'Metric("m", "§0", "d", "", (Column("m", "2 * m_half", "d"), Column("m_half", \'"m.x" / 2\', "d")), '
            'sums=(head_int("m.x"),))',
            "column 'm': '2 * m_half' does not bind",
        ),
        (
            'Metric("m", "§0", "d", "", (Column("m", "no_such_sum / 2", "d"),))',
            "column 'm': 'no_such_sum / 2' does not bind",
        ),
        (
            'Metric("m", "§0", "d", "", (Column("noise_share", "1", "d"),))',
            "column 'noise_share' is a column or sum already",
        ),
        ('"not a metric"', "is not a Metric"),
    ],
)
def test_a_plugin_metric_that_would_need_storage_or_does_not_bind_is_refused(
    temporary_plugin, capsys, declaration, why
):
    temporary_plugin(
        "metric-plugin",
        {"headatlas.metrics": {"bad": "metric_plugin:BAD"}},
        {
            "metric_plugin": (
                f"from headatlas.service.metrics import Column, Metric, head_int, run_int\nBAD = {declaration}\n"
            )
        },
    )
    assert [m.name for m in plugin_metrics()] == INSTALLED  # the bad one left out, the good one kept
    [line] = capsys.readouterr().err.splitlines()
    assert (
        line.startswith("headatlas: plugin bad (metric-plugin 0.1), headatlas.metrics = metric_plugin:BAD")
        and why in line
    )


@pytest.mark.parametrize("module", ["neox", "metric", "punct", "punct_measure", "memory"])
def test_architecture_md_shows_each_plugin_module_whole(module):
    """The worked examples of docs/architecture.md are the plugin's modules as the tests run them."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "architecture.md").read_text(encoding="utf-8")
    source = (root / "tests" / "plugins" / "headatlas_test_plugins" / f"{module}.py").read_text(encoding="utf-8")
    assert f"```python\n{source}```" in doc


# --- a plugin that exits, interrupts or takes a name that is headatlas's --------------------------------
EXITING = "import sys\nsys.exit(3)\n"
INTERRUPTING = "raise KeyboardInterrupt\n"


@pytest.mark.parametrize(
    ("source", "said"), [(EXITING, "SystemExit: 3"), (INTERRUPTING, "KeyboardInterrupt")], ids=["exit", "interrupt"]
)
@pytest.mark.parametrize("command", [["metrics"], ["query", "heads"]], ids=" ".join)
def test_a_plugin_that_exits_or_interrupts_on_import_is_named_and_left_out(
    temporary_plugin, tmp_path, source, said, command
):
    """sys.exit(3) in a metric plugin ended `metrics` and `query heads` with exit 3 and no word;
    a KeyboardInterrupt it raised itself said "interrupted; re-run". Now each is one line naming
    the plugin (entry point, distribution, module), and the command goes on without it."""
    from tests.conftest import invoke_cli, run_cli

    db = tmp_path / "p.duckdb"
    if command[0] == "query":
        corpus = tmp_path / "c.txt"
        corpus.write_text(TEXT + "\n", encoding="utf-8")
        made = invoke_cli("analyze", str(corpus), "--model", "random:tiny", "--db", str(db), "--quiet")
        assert made.returncode == 0, made.stderr
        command = [*command, "--db", str(db)]
    temporary_plugin("odd-plugin", {"headatlas.metrics": {"odd": "odd_plugin:METRIC"}}, {"odd_plugin": source})
    result = run_cli(*command, env={"PYTHONPATH": str(tmp_path / "site")}, timeout=120)  # a fresh process
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and "interrupted" not in result.stderr
    assert result.stderr.splitlines() == [
        f"headatlas: plugin odd (odd-plugin 0.1), headatlas.metrics = odd_plugin:METRIC, is not loaded: {said}"
    ]


def test_db_upgrade_with_a_plugin_that_exits_creates_the_whole_database(temporary_plugin, cli, tmp_path):
    """sys.exit(3) as the views were made left a half-created database (tables, no views) and exit 3."""
    temporary_plugin("odd-plugin", {"headatlas.metrics": {"odd": "odd_plugin:METRIC"}}, {"odd_plugin": EXITING})
    db = tmp_path / "new.duckdb"
    result = cli("db", "upgrade", "--db", str(db))
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stderr.splitlines() == [
        "headatlas: plugin odd (odd-plugin 0.1), headatlas.metrics = odd_plugin:METRIC, is not loaded: SystemExit: 3"
    ]
    plugins.forget()
    assert cli("db", "current", "--db", str(db)).returncode == 0
    views = cli("sql", "SELECT count(*) AS n FROM head_metrics", "--db", str(db), "--format", "csv")
    assert views.returncode == 0 and views.stdout.split() == ["n", "0"], views.stderr  # the views are there


def test_ctrl_c_as_db_upgrade_loads_its_plugins_leaves_no_database(temporary_plugin, tmp_path):
    """A real SIGINT while a plugin loads stops the command (the user asked), before any file is made."""
    from tests.conftest import run_cli

    temporary_plugin(
        "slow-plugin",
        {"headatlas.metrics": {"slow": "slow_plugin:METRIC"}},
        {"slow_plugin": "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n"},
    )
    db = tmp_path / "new.duckdb"
    result = run_cli("db", "upgrade", "--db", str(db), env={"PYTHONPATH": str(tmp_path / "site")}, timeout=120)
    assert result.returncode == 130, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and "interrupted" in result.stderr
    assert not db.exists() and not list(tmp_path.glob("new.duckdb*")), list(tmp_path.iterdir())


def test_a_plugin_family_named_as_a_built_in_one_is_refused_naming_both(temporary_plugin, capsys):
    """A plugin family `bert` silently replaced headatlas's own adapter for every BERT model."""
    from headatlas.service.engine.adapters.bert import BertAdapter

    temporary_plugin(
        "rival-plugin",
        {"headatlas.families": {"bert": "rival_plugin:RivalBert"}},
        {
            "rival_plugin": """
            from headatlas.service.engine.adapters.bert import BertAdapter


            class RivalBert(BertAdapter):
                title = "a rival BERT"
            """
        },
    )
    assert type(families()["bert"]) is BertAdapter and type(ADAPTERS["bert"]) is BertAdapter
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("headatlas: plugin bert (rival-plugin 0.1), headatlas.families = rival_plugin:RivalBert")
    assert "model family 'bert' is headatlas's already (BertAdapter)" in line and "another family name" in line


def test_a_plugin_metric_named_as_a_built_in_one_is_refused_naming_both(temporary_plugin, capsys):
    """A plugin metric may not take a built-in metric's name (its columns may be new ones)."""
    temporary_plugin(
        "metric-plugin",
        {"headatlas.metrics": {"noise": "metric_plugin:NOISE"}},
        {
            "metric_plugin": (
                "from headatlas.service.metrics import Column, Metric\n"
                'NOISE = Metric("noise_share", "§0", "d", "", (Column("noise_again", "1 - noise_share", "d"),))\n'
            )
        },
    )
    assert [m.name for m in plugin_metrics()] == INSTALLED
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("headatlas: plugin noise (metric-plugin 0.1), headatlas.metrics = metric_plugin:NOISE")
    assert "metric 'noise_share' is headatlas's already" in line


def test_a_plugin_column_the_views_do_not_hold_yet_is_refused_until_db_upgrade(temporary_plugin, cli, tmp_path):
    """A database's views are built from the plugins installed at its last upgrade: a plugin
    installed since shows nothing in `query heads` (its column is left out) until `db upgrade`,
    and sorting by its column says so."""
    import headatlas

    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT + "\n", encoding="utf-8")
    db = tmp_path / "late.duckdb"
    run = headatlas.analyze(corpus, db=db, model="random:tiny", seq_len=32, progress=False)
    temporary_plugin(
        "late-plugin",
        {"headatlas.metrics": {"late": "late_plugin:LATE"}},
        {
            "late_plugin": (
                "from headatlas.service.metrics import Column, Metric\n"
                'LATE = Metric("late", "§5", "d", "", (Column("late_share", "1 - noise_share", "d"),))\n'
            )
        },
    )
    heads = cli("query", "heads", "--db", str(db), "--run", str(run.run_id), "--format", "json")
    assert heads.returncode == 0, heads.stderr
    assert "late_share" not in json.loads(heads.stdout)[0] and "attended_share" in json.loads(heads.stdout)[0]
    refused = cli("query", "heads", "--db", str(db), "--sort", "late_share")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "--sort late_share: an installed plugin's column that this database's views do not hold yet" in (
        refused.stderr
    )
    assert "headatlas db upgrade" in refused.stderr
    assert cli("db", "upgrade", "--db", str(db)).returncode == 0
    after = cli("query", "heads", "--db", str(db), "--sort", "late_share", "--format", "json")
    rows = json.loads(after.stdout)
    assert after.returncode == 0 and rows[0]["late_share"] == pytest.approx(1 - rows[0]["noise_share"])
