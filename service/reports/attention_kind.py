"""Which kind of attention a run has (SPEC §8): causal (a decoder) or bidirectional. Read by the
role tests (``roles``: the roles a run is offered) and the tables (``query_support.for_attention``: the
columns a run's attention has a use for), a module of its own so neither imports the other.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection


def causal_run(conn: Connection, run_id: int) -> bool:
    """Whether the run's attention is causal (a decoder): its query rows never see their next
    token (``run_chance.next_rows`` sums to 0 over rows that exist). Runs stored before
    ``next_rows`` existed (NULL) were all bidirectional."""
    row = conn.execute(
        text("SELECT sum(next_rows), sum(attn_rows) FROM run_chance WHERE run_id = :run"), {"run": run_id}
    ).first()
    return row is not None and row[0] is not None and row[0] == 0 and (row[1] or 0) > 0
