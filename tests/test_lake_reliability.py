"""A lake keeps what a file keeps: a deleted run's id is never handed to a new run (a file's
sequence does not go back; a lake has no sequences and keeps a high-water mark of its run ids).
Each test's lake is a catalogue database of its own on this machine's PostgreSQL (lake_support)."""

from __future__ import annotations

import pytest

from headatlas.service.params import AnalysisParams

PARAMS = AnalysisParams(seq_len=32)


def _run(store, key: str):
    return store.find_or_create_run(
        run_key=key,
        name=f"run-{key}",
        corpus="hand",
        corpus_fingerprint=key,
        model={"spec": "random:tiny", "name": "random:tiny", "layers": 2, "heads": 2, "d_head": 8},
        params=PARAMS.to_dict(),
        engine="embedded",
        device="cpu",
    )


@pytest.mark.parametrize("kind", ["file", "lake"])
def test_a_deleted_runs_id_is_never_given_to_the_next_run(kind, request, tmp_path):
    from headatlas.service.storage.store import Store

    if kind == "lake":
        lake = request.getfixturevalue("lake")
        store = Store(lake.url, data_path=lake.data_path)
    else:
        store = Store(tmp_path / "atlas.duckdb")
    store.ensure_schema()
    first, second = _run(store, "a")[0], _run(store, "b")[0]
    assert (first.run_id, second.run_id) == (1, 2)
    store.delete_run(second.run_id)
    third = _run(store, "c")[0]
    assert third.run_id == 3  # not 2: a reference to the deleted run never reaches another
    store.delete_run(third.run_id)
    store.delete_run(first.run_id)
    assert _run(store, "d")[0].run_id == 4  # no run left at all: still past every id given
