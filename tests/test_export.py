"""`headatlas export`: a run's tables as Parquet/CSV files that read back as the same rows."""

from __future__ import annotations

import hashlib
import json

import duckdb
import pytest

from tests.figure_checks import analyse, corpus_of

TABLES = (
    "runs",
    "batches",
    "run_windows",
    "windows",
    "documents",
    "head_stats",
    "named_head_sums",
    "run_chance",
    "dist_hist",
    "pair_hist",
    "anchors",
    "anchor_tokens",
    "anchor_layers",
    "mixing_stats",
    "mixing_dist",
    "csm_bins",
    "probe_scores",
    "run_effects",
    "prunes",
    "prune_curves",
    "streaming_effects",
    "streaming_curves",
    "streaming_curve_steps",
    "head_examples",
    "example_windows",
)


@pytest.fixture(scope="module")
def stored(tmp_path_factory, tiny_model, demo_corpus):
    """Two runs over different documents in one database: the export must keep them apart."""
    folder = tmp_path_factory.mktemp("export")
    db = folder / "results.duckdb"
    first = analyse(corpus_of(demo_corpus, folder, slice(0, 2), "first"), db, tiny_model, name="first")
    other = analyse(corpus_of(demo_corpus, folder, slice(2, 3), "other"), db, tiny_model, name="other")
    add_probe(db, first, tiny_model, seed=0)
    add_probe(db, other, tiny_model, seed=1)
    return db, first, other


def add_probe(db, run, model, *, seed: int) -> None:
    from headatlas.service.engine.probe import ProbeSpec, run_probe
    from headatlas.service.storage.store import Store

    scores = run_probe(model, ProbeSpec(length=5, sequences=2, seed=seed))
    Store(db).store_probe(run.run_id, (5, 2, seed), {name: v.numpy() for name, v in scores.items()})


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def db_rows(db, sql: str) -> list[tuple]:
    connection = duckdb.connect(str(db), read_only=True)
    try:
        return connection.execute(sql).fetchall()
    finally:
        connection.close()


def test_parquet_files_read_back_as_the_stored_rows(stored, tmp_path):
    from headatlas.service.reports.export import export_run, table_query

    db, first, other = stored
    before = digest(db)
    run, exported = export_run(db, "first", "parquet", tmp_path / "out")
    assert run.run_id == first.run_id
    assert [t.table for t in exported] == list(TABLES)
    assert digest(db) == before  # only read
    reader = duckdb.connect()
    for t in exported:
        assert t.path == tmp_path / "out" / f"{t.table}.parquet"
        expected = db_rows(db, table_query(t.table, first.run_id))
        got = reader.execute(f"SELECT * FROM read_parquet('{t.path}') ORDER BY ALL").fetchall()
        assert got == expected, t.table
        assert t.rows == len(expected), t.table
        # mixing only with --mixing, effects and prunes only with --effects and `prune`, sums by name
        # only from a plugin's measure, streaming effects only from `effects RUN --streaming`
        assert t.rows > 0 or t.table.startswith(("mixing_", "run_effects", "prune", "named_head_sums", "streaming_")), (
            t.table
        )
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["run_id"] == first.run_id and manifest["format"] == "parquet"
    assert manifest["tables"]["head_stats"] == {"file": "head_stats.parquet", "rows": exported[5].rows}


def test_export_keeps_only_the_runs_rows(stored, tmp_path):
    from headatlas.service.reports.export import export_run

    db, first, other = stored
    export_run(db, first.run_id, "parquet", tmp_path)
    reader = duckdb.connect()

    def read(table, sql="SELECT *"):
        return reader.execute(f"{sql} FROM read_parquet('{tmp_path / table}.parquet')").fetchall()

    for table in (
        "runs",
        "batches",
        "run_windows",
        "head_stats",
        "run_chance",
        "dist_hist",
        "pair_hist",
        "anchors",
        "probe_scores",
    ):
        assert read(table, "SELECT DISTINCT run_id") == [(first.run_id,)], table
    # shared tables: the run's own windows and documents, not the other run's
    first_docs = db_rows(
        db,
        f"SELECT DISTINCT w.doc_id FROM windows w JOIN run_windows r USING (window_id) "
        f"WHERE r.run_id = {first.run_id} ORDER BY 1",
    )
    assert sorted(read("documents", "SELECT doc_id")) == first_docs and len(first_docs) == 2
    all_windows = db_rows(db, "SELECT count(*) FROM windows")[0][0]
    assert len(read("windows")) == len(read("run_windows")) < all_windows
    # the per-head totals recomputed from the files equal the database view
    from_files = reader.execute(
        f"SELECT layer, head, sum(high_pairs), sum(same_sentence_high) FROM read_parquet('{tmp_path}/head_stats.parquet') "
        "GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    from_view = db_rows(
        db,
        f"SELECT layer, head, high_pairs, same_sentence_high FROM head_totals "
        f"WHERE run_id = {first.run_id} ORDER BY ALL",
    )
    assert from_files == from_view


def test_csv_export_command(cli, stored, tmp_path):
    db, first, other = stored
    out = tmp_path / "csv"
    done = cli("export", "other", "--format", "csv", "--out", str(out), "--db", str(db))
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["run_id"] == other.run_id and set(manifest["tables"]) == set(TABLES)
    reader = duckdb.connect()
    for table, entry in manifest["tables"].items():
        path = out / entry["file"]
        assert path.suffix == ".csv"
        count = reader.execute(f"SELECT count(*) FROM read_csv('{path}', header = true)").fetchone()[0]
        assert count == entry["rows"], table
    stored_sum = db_rows(db, f"SELECT sum(count) FROM dist_hist WHERE run_id = {other.run_id}")[0][0]
    assert reader.execute(f"SELECT sum(count) FROM read_csv('{out}/dist_hist.csv')").fetchone()[0] == stored_sum


def test_bad_destination_and_unknown_run_are_refused(stored, tmp_path):
    from headatlas.service.errors import ParameterError, StoreError
    from headatlas.service.reports.export import export_run

    db = stored[0]
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(ParameterError, match="exists and is not a folder"):
        export_run(db, None, "parquet", blocker)
    with pytest.raises(ParameterError, match="--format 'xlsx': choose one of parquet, csv"):
        export_run(db, None, "xlsx", tmp_path / "x")
    with pytest.raises(StoreError, match="no run 'nope'"):
        export_run(db, "nope", "parquet", tmp_path / "y")
    assert not (tmp_path / "y").exists()
