"""Rows of the mixing tables (migration 0002_mixing) from the mixing measure's sums
(``BatchResult.measures["mixing"]``), as Arrow tables.

Kept apart from store.py so the ingest there only registers and inserts them, in the batch's
own transaction.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from headatlas.service.engine.results import MIX_SUMS, mixing_by_method
from headatlas.service.storage.arrow_rows import TableRows

MIXING_TABLES = ("mixing_stats", "mixing_dist")


def mixing_tables(run_id: int, items: list) -> dict[str, pa.Table]:
    """``items``: [(batch_id, BatchResult)]. Empty when no batch carries mixing sums."""
    rows = TableRows()

    for batch_id, res in items:
        mixing = res.measures.get("mixing")
        if mixing is None:
            continue
        windows, valid_rows = int(mixing["windows"]), int(mixing["rows"])
        for method, sums in sorted(mixing_by_method(mixing).items()):
            heads = sums["head"]
            n_layers = sums["to_self"].shape[0]
            layer, slot = np.meshgrid(np.arange(n_layers), np.arange(len(heads)), indexing="ij")
            n = layer.size
            rows.add(
                "mixing_stats",
                run_id=np.full(n, run_id),
                batch_id=np.full(n, batch_id),
                method=np.full(n, method, dtype=object),
                layer=layer,
                head=heads[slot],
                windows=np.full(n, windows),
                rows=np.full(n, valid_rows),
                **{k: sums[k] for k in MIX_SUMS},
            )
            li, si, di = np.nonzero(sums["dist"])
            rows.add(
                "mixing_dist",
                run_id=np.full(li.size, run_id),
                batch_id=np.full(li.size, batch_id),
                method=np.full(li.size, method, dtype=object),
                layer=li,
                head=heads[si],
                distance=di,
                mass=sums["dist"][li, si, di],
            )
    return rows.tables()
