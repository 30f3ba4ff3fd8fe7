"""New database files from a process's copy of a migrated one (service/storage/new_file.py): the
same schema as the migrations make, an id of their own, never over a file already there."""

from __future__ import annotations

import re

import duckdb
import pytest

from headatlas.service.storage import db, new_file
from headatlas.service.storage.backends.file import FileBackend

SCHEMA = {
    "columns": "SELECT table_name, column_name, data_type, column_default, is_nullable, column_index "
    "FROM duckdb_columns() WHERE NOT internal ORDER BY ALL",
    "views": "SELECT view_name, sql FROM duckdb_views() WHERE NOT internal ORDER BY ALL",
    "constraints": "SELECT table_name, constraint_type, constraint_text FROM duckdb_constraints() ORDER BY ALL",
    "indexes": "SELECT index_name, table_name, sql FROM duckdb_indexes() ORDER BY ALL",
    "sequences": "SELECT sequence_name, start_value, increment_by FROM duckdb_sequences() ORDER BY ALL",
    "revision": "SELECT version_num FROM alembic_version",
    "info": "SELECT key FROM database_info ORDER BY key",
}


def _schema(path) -> dict[str, list[tuple]]:
    with duckdb.connect(str(path), read_only=True) as conn:
        found = {name: conn.execute(sql).fetchall() for name, sql in SCHEMA.items()}
    # DuckDB keeps an EXCLUDE list as a set: written back in another order, the same view
    found["views"] = [(name, _EXCLUDE.sub(_sorted_list, sql)) for name, sql in found["views"]]
    return found


_EXCLUDE = re.compile(r"EXCLUDE \(([^)]*)\)")


def _sorted_list(match: re.Match) -> str:
    return "EXCLUDE (" + ", ".join(sorted(item.strip() for item in match.group(1).split(","))) + ")"


def _database_id(path) -> str:
    with duckdb.connect(str(path), read_only=True) as conn:
        return conn.execute("SELECT value FROM database_info WHERE key = 'database_id'").fetchone()[0]


@pytest.fixture()
def fresh(monkeypatch):
    """This test's own count of new files and copy, whatever the suite made before."""
    monkeypatch.setattr(new_file, "_MADE", {})
    monkeypatch.setattr(new_file, "_BYTES", {})


def test_from_the_second_new_file_on_a_copy_has_the_migrated_schema_and_an_id_of_its_own(tmp_path, fresh):
    migrated: list[str] = []

    def migrate(backend):
        migrated.append(str(backend.path))
        db.upgrade(backend)

    head = db.head_revision()
    paths = [tmp_path / f"{i}.duckdb" for i in range(4)]
    for path in paths:
        new_file.create(FileBackend(path), head, migrate)
    # the first by the migrations; at the second, the copy is made in a folder of its own (and the
    # second file from it); the third and fourth from the copy alone
    assert migrated[0] == str(paths[0]) and len(migrated) == 2 and str(tmp_path) not in migrated[1]
    assert head in new_file._BYTES
    schemas = [_schema(p) for p in paths]
    assert all(s == schemas[0] for s in schemas[1:])  # column for column, view for view
    assert schemas[0]["revision"] == [(head,)] and len(schemas[0]["columns"]) > 100
    ids = {_database_id(p) for p in paths}
    assert len(ids) == len(paths)  # no two share an id
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # nothing staged left
    db.ensure_schema(str(paths[3]))  # what every command does first: the copy passes as current


def test_a_copy_is_never_linked_over_a_file_already_there(tmp_path, fresh):
    head = db.head_revision()
    for i in range(2):
        new_file.create(FileBackend(tmp_path / f"{i}.duckdb"), head, db.upgrade)
    taken = tmp_path / "taken.duckdb"
    taken.write_bytes(b"another process's file")
    assert new_file._place(taken, new_file._BYTES[head]) is False
    assert taken.read_bytes() == b"another process's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.duckdb", "1.duckdb", "taken.duckdb"]


def test_ensure_schema_makes_new_files_that_store_a_run(tmp_path, fresh):
    """Through the store, as analyses create their files: the copies are databases a run is stored in."""
    from headatlas.service.storage.store import Store

    for i in range(3):
        store = Store(str(tmp_path / f"s{i}.duckdb"))
        run, created = _store_a_run(store, f"r{i}")
        assert created and run.run_id == 1 and store.get_run(1).name == f"r{i}"
    assert new_file._BYTES


def _store_a_run(store, name: str):
    """``store``'s schema made (or checked), then a run named ``name`` opened in it."""
    from headatlas.service.params import AnalysisParams

    store.ensure_schema()
    return store.find_or_create_run(
        run_key=f"key-{name}",
        name=name,
        corpus="c",
        corpus_fingerprint="f",
        model={"spec": "m", "name": "m", "layers": 2, "heads": 4, "d_head": 8},
        params=AnalysisParams().to_dict(),
        engine="embedded",
        device="cpu",
    )


def _storage_version(path) -> str:
    with duckdb.connect(":memory:") as conn:
        conn.execute(f"ATTACH '{path}' AS f (READ_ONLY)")
        return conn.execute(
            "SELECT tags['storage_version'] FROM duckdb_databases() WHERE database_name = 'f'"
        ).fetchone()[0]


def test_new_files_are_made_in_headatlas_storage_format_and_older_files_keep_theirs(tmp_path, fresh):
    """New files, by the migrations and from the copy alike, are in ``STORAGE_VERSION``'s format (its
    metadata packed: about half the bytes, each open cheaper); a file made in DuckDB's default
    format stays in it, read and written as before."""
    from headatlas.service.storage.duckdb_settings import STORAGE_VERSION
    from headatlas.service.storage.store import Store

    made = [tmp_path / f"{i}.duckdb" for i in range(3)]
    for path in made:
        Store(str(path)).ensure_schema()
    assert {_storage_version(p) for p in made} == {f"{STORAGE_VERSION}+"}
    old = tmp_path / "old.duckdb"
    with duckdb.connect(":memory:") as conn:  # DuckDB's default format: what headatlas made before
        default = conn.execute("SELECT current_setting('storage_compatibility_version')").fetchone()[0]
        assert default != STORAGE_VERSION
        conn.execute(f"ATTACH '{made[0]}' AS src (READ_ONLY)")
        conn.execute(f"ATTACH '{old}' AS dst")
        conn.execute("COPY FROM DATABASE src TO dst")
    before = _storage_version(old)  # DuckDB 1.0 reads it
    assert before != f"{STORAGE_VERSION}+"
    assert old.stat().st_size > 1.5 * made[0].stat().st_size  # each column's metadata of its own
    assert _schema(old) == _schema(made[0])  # the same database in the other format
    store = Store(str(old))
    run, created = _store_a_run(store, "old")
    assert created and store.get_run(run.run_id).name == "old"
    assert _storage_version(old) == before  # written, and still in its own format
