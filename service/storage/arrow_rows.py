"""Rows for bulk insert: numpy columns gathered per table, turned into Arrow tables (one helper
for every ingest path, registered on the raw DuckDB connection and inserted with INSERT … SELECT)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


class TableRows:
    """Columns of several tables, appended in parts: ``add("t", a=[…], b=[…])``."""

    def __init__(self) -> None:
        self._cols: dict[str, dict[str, list[np.ndarray]]] = {}

    def add(self, table: str, **columns) -> None:
        target = self._cols.setdefault(table, {})
        for key, value in columns.items():
            target.setdefault(key, []).append(np.asarray(value).ravel())

    def tables(self) -> dict[str, pa.Table]:
        return {table: pa.table({k: _concat(v) for k, v in cols.items()}) for table, cols in self._cols.items()}


def _concat(parts: list[np.ndarray]) -> pa.Array:
    arr = np.concatenate(parts) if parts else np.array([])
    if arr.dtype == object:
        return pa.array(arr.tolist(), type=pa.string()) if len(arr) else pa.array([], type=pa.string())
    return pa.array(arr)
