"""The analysis worker's consumer: Celery's, trying a lost broker again at a steady pace.

Celery's consumer reconnects after 2, 4, 6, … s (up to 30 s between tries): a Redis away for 11 s
was reached again up to 8 s after it was back (the tries fell 2, 6, 12 and 20 s after the loss),
and every worker of the cluster idled meanwhile. This one tries every RECONNECT_EVERY_S (policy.py).
Configured by name (``worker_consumer`` in workers/app.py), so only a worker imports it.
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer

from headatlas.workers.policy import RECONNECT_EVERY_S


class SteadyReconnectConsumer(Consumer):
    def ensure_connected(self, conn: Any) -> Any:
        steady = {"interval_start": RECONNECT_EVERY_S, "interval_step": 0, "interval_max": RECONNECT_EVERY_S}
        ensure = conn.ensure_connection
        conn.ensure_connection = lambda *args, **kwargs: ensure(*args, **{**kwargs, **steady})
        return super().ensure_connected(conn)
