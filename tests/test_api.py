"""The Python API: a notebook's view of the same functions the CLI calls."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def analysed(tmp_path_factory, demo_corpus):
    from headatlas.service import api

    folder = tmp_path_factory.mktemp("api")
    corpus = folder / "two.txt"
    corpus.write_text("\n\n".join(demo_corpus.read_text(encoding="utf-8").split("\n\n")[:2]), encoding="utf-8")
    db = folder / "api.duckdb"
    run = api.analyze(corpus, db=db, model="random:tiny", name="nb", batch_size=8, seq_len=64)
    return db, run


def _same(mine: dict, theirs: dict) -> bool:
    """Equal, floats up to the summation order of DuckDB's parallel aggregates (last bits)."""
    return list(mine) == list(theirs) and all(
        a == pytest.approx(b, rel=1e-12) if isinstance(a, float) and isinstance(b, float) else a == b
        for a, b in zip(mine.values(), theirs.values())
    )


def _rows(table: pa.Table) -> list[dict]:
    """As JSON carries them: NaN (an undefined ratio) is null."""
    return [
        {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()} for row in table.to_pylist()
    ]


def test_analyze_then_connect_gives_the_run(analysed):
    from headatlas.service import api

    db, run = analysed
    assert run.run.status == "done" and run.name == "nb"
    atlas = api.connect(db)
    assert _rows(atlas.runs())[0]["name"] == "nb"
    assert atlas.run("nb").run_id == run.run_id == atlas.run().run_id


def test_heads_equal_the_cli_json(analysed, cli):
    from headatlas.service import api

    db, run = analysed
    heads = api.connect(db).run("nb").heads(ci=True)
    assert isinstance(heads, pa.Table) and heads.num_rows == run.run.n_layers * run.run.n_heads
    out = cli("query", "heads", "--run", "nb", "--db", str(db), "--format", "json", "--ci")
    assert out.returncode == 0, out.stderr
    cli_rows = json.loads(out.stdout)
    assert [list(r) for r in _rows(heads)] == [list(r) for r in cli_rows]  # same columns, same order
    assert all(_same(mine, theirs) for mine, theirs in zip(_rows(heads), cli_rows))


def test_layers_distances_and_sql(analysed, cli):
    from headatlas.service import api

    db, _ = analysed
    view = api.connect(db).run("nb")
    out = json.loads(cli("query", "layers", "--run", "nb", "--db", str(db), "--format", "json").stdout)
    assert len(out) == 2 and all(_same(mine, theirs) for mine, theirs in zip(_rows(view.layers()), out))
    dist = view.distances(1, 0, split=True)
    assert {"distance", "share", "chance_share", "lift", "attended_share", "noise_share"} <= set(dist.column_names)
    assert sum(dist.column("chance_share").to_pylist()) == pytest.approx(1.0)
    # one run of random:tiny (2 layers × 4 heads): one row per head
    assert api.connect(db).sql("SELECT count(*) AS n FROM head_metrics").to_pylist() == [{"n": 2 * 4}]


def test_bad_calls_say_what_to_do(analysed, tmp_path):
    from headatlas.service import api
    from headatlas.service.errors import ParameterError

    db, _ = analysed
    with pytest.raises(ParameterError, match="layers 0..1"):
        api.connect(db).run("nb").distances(5)
    with pytest.raises(ParameterError, match="no database at"):
        api.connect(tmp_path / "missing.duckdb")
    with pytest.raises(ParameterError, match="unknown option 'seqlen'"):
        api.analyze(tmp_path / "x.txt", db=tmp_path / "x.duckdb", seqlen=64)
