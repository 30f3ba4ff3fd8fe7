"""Storing a long window stays bounded (docs/benchmarks.md, "Long windows"): a stream of record
batches goes in one batch per statement and each is let go once inserted; compaction folds the
averaged similarity matrices one layer at a time into the same sums; DuckDB's memory limit under
an address-space cap is a share of the cap and of the room left in it, and Arrow then allocates
from the system (its default allocator reserves a GiB of address space up front)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import weakref

import numpy as np
import pyarrow as pa
from sqlalchemy import text

from headatlas.service.storage import compact, duckdb_settings
from headatlas.service.storage.batch_rows import CSM_SCHEMA
from headatlas.service.storage.ingest import insert_stream
from headatlas.service.storage.store import Store

KINDS = pa.array(["all", "attended", "noise"])


def _cells(g: np.random.Generator, batch_id: int, layer: int, n: int) -> pa.RecordBatch:
    """``n`` csm_bins rows of one layer: kind, head and cell drawn, sums and pairs random."""
    kind = g.integers(0, 3, n).astype(np.int32)
    return pa.record_batch(
        [
            np.full(n, 1, np.int64),
            np.full(n, batch_id, np.int64),
            np.full(n, layer, np.int64),
            g.integers(0, 2, n),
            pa.DictionaryArray.from_arrays(pa.array(kind), KINDS),
            g.integers(0, 4, n),
            g.integers(0, 4, n),
            g.random(n),
            g.integers(1, 9, n),
        ],
        schema=CSM_SCHEMA,
    )


def _rows(store: Store, sql: str) -> list[tuple]:
    with store.read() as conn:
        return [tuple(r) for r in conn.execute(text(sql))]


def test_a_stream_is_inserted_a_batch_at_a_time_and_each_batch_let_go(tmp_path):
    # one INSERT reading the whole stream kept every record batch it had read until it ended (the
    # 43 million cells of a 4,096-token window, some 3 GB); a batch at a time, none is kept
    g = np.random.default_rng(0)
    store = Store(tmp_path / "s.duckdb")
    store.ensure_schema()
    batches = [_cells(g, 0, layer, 50) for layer in range(6)]
    alive: list[weakref.ref] = []
    most = 0

    def stream():
        nonlocal most
        for batch in batches:
            most = max(most, sum(r() is not None for r in alive))
            column = np.array(batch.column("sim_sum"))  # a fresh buffer, owned by this batch alone
            alive.append(weakref.ref(column))
            yield batch.set_column(7, "sim_sum", pa.array(column))

    reader = pa.RecordBatchReader.from_batches(CSM_SCHEMA, stream())
    inserted = store.atomically(lambda conn: insert_stream(conn, "csm_bins", reader))
    assert inserted == 300
    assert most <= 1, f"{most} record batches already inserted were still held"
    want = pa.Table.from_batches(batches)
    got = _rows(store, "SELECT layer, head, kind, bin_i, bin_j, sim_sum, pairs FROM csm_bins ORDER BY rowid")
    assert got == list(
        zip(*(want.column(c).to_pylist() for c in ("layer", "head", "kind", "bin_i", "bin_j", "sim_sum", "pairs")))
    )


def test_compaction_a_layer_at_a_time_gives_the_sums_of_the_whole(tmp_path, monkeypatch):
    g = np.random.default_rng(1)
    stores = []
    for by_layer in (True, False):
        if not by_layer:
            monkeypatch.setattr(compact, "COMPACTED_BY", {})
        store = Store(tmp_path / f"c{by_layer}.duckdb")
        store.ensure_schema()
        g = np.random.default_rng(1)
        for batch_id in range(3):  # three batches of three layers: cells repeat across batches
            reader = pa.RecordBatchReader.from_batches(
                CSM_SCHEMA, [_cells(g, batch_id, layer, 40) for layer in range(3)]
            )
            store.atomically(lambda conn, r=reader: insert_stream(conn, "csm_bins", r))
        report = store.compact(1)
        stores.append((store, report["csm_bins"]))
    (layered, by_layer_report), (whole, whole_report) = stores
    assert by_layer_report == whole_report and by_layer_report[0] == 360 and by_layer_report[1] < 360
    query = (
        "SELECT batch_id, layer, head, kind, bin_i, bin_j, sim_sum, pairs FROM csm_bins "
        "ORDER BY layer, head, kind, bin_i, bin_j"
    )
    assert _rows(layered, query) == _rows(whole, query)
    assert {r[0] for r in _rows(layered, query)} == {compact.COMPACTED}


def test_duckdb_memory_limit_is_a_share_of_the_cap_and_of_the_room_left_in_it(monkeypatch):
    gib = 1 << 30
    space = (6 * gib, 1 * gib)  # a 6 GiB cap, 1 GiB of it mapped: a quarter of the cap
    monkeypatch.setattr(duckdb_settings, "address_space", lambda: space)
    assert duckdb_settings.duckdb_config()["memory_limit"] == "1536MiB"
    space = (6 * gib, int(4.5 * gib))  # the model and a long window's payload hold 4.5 GiB: 40 % of the rest
    assert duckdb_settings.duckdb_config()["memory_limit"] == f"{int(1.5 * gib * 0.4) >> 20}MiB"
    space = (6 * gib, 7 * gib)  # over the cap already (a reservation counted): the floor
    assert duckdb_settings.duckdb_config()["memory_limit"] == f"{duckdb_settings.CAPPED_MEMORY_FLOOR >> 20}MiB"
    space = None  # no cap: DuckDB's own default
    assert "memory_limit" not in duckdb_settings.duckdb_config()


def test_the_address_space_is_read_from_the_cap_and_the_virtual_size(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert duckdb_settings.address_space() is None
    monkeypatch.setattr(resource, "getrlimit", lambda which: (6 << 30, resource.RLIM_INFINITY))
    cap, used = duckdb_settings.address_space()
    assert cap == 6 << 30 and 0 < used < 1 << 40


def test_arrow_allocates_from_the_system_under_a_cap_only():
    # Arrow reads its allocator once, as it loads: importing headatlas first sets it under a cap
    code = (
        "import resource, sys; cap = int(sys.argv[1]); "
        "cap and resource.setrlimit(resource.RLIMIT_AS, (cap, cap)); "
        "import headatlas, pyarrow; print(pyarrow.default_memory_pool().backend_name)"
    )
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    said = [
        subprocess.run(
            [sys.executable, "-c", code, str(cap)], capture_output=True, text=True, env=env, check=True
        ).stdout.strip()
        for cap in (0, 16 << 30)
    ]
    assert said[1] == "system"  # without a cap: Arrow's own default (mimalloc in its wheels), untouched
