"""The analysis worker's consumer: Celery's, trying a lost broker again at a steady pace, and
never keeping a message it failed to acknowledge (``_release_even_unacknowledged``).

Celery's consumer reconnects after 2, 4, 6, … s (up to 30 s between tries): a Redis away for 11 s
was reached again up to 8 s after it was back (the tries fell 2, 6, 12 and 20 s after the loss),
and every worker of the cluster idled meanwhile. This one tries every RECONNECT_EVERY_S (policy.py).
Configured by name (``worker_consumer`` in workers/app.py), so only a worker imports it.
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from headatlas.workers.policy import RECONNECT_EVERY_S


class SteadyReconnectConsumer(Consumer):
    def ensure_connected(self, conn: Any) -> Any:
        steady = {"interval_start": RECONNECT_EVERY_S, "interval_step": 0, "interval_max": RECONNECT_EVERY_S}
        ensure = conn.ensure_connection
        conn.ensure_connection = lambda *args, **kwargs: ensure(*args, **{**kwargs, **steady})
        return super().ensure_connected(conn)


def _release_even_unacknowledged() -> None:
    """kombu's Redis QoS forgets a delivered message only once its ack or reject reached Redis: an
    ack that met Redis away (restarting as a batch finished) is logged by Celery ("Couldn't ack")
    and the message stays counted against the prefetch limit, so a solo worker (one message at a
    time) never polled again, though Redis came back. The message is forgotten here either way;
    Redis keeps it unacknowledged, and it comes back after the visibility timeout or the
    writer's sweep for lost batches, and is stored once."""
    qos = kombu_redis.QoS
    if getattr(qos, "_headatlas_releases", False):
        return
    ack, reject = qos.ack, qos.reject

    def released_ack(self: Any, delivery_tag: Any) -> None:
        try:
            ack(self, delivery_tag)
        finally:
            virtual.QoS.ack(self, delivery_tag)  # a second release is a no-op

    def released_reject(self: Any, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            reject(self, delivery_tag, requeue=requeue)
        finally:
            virtual.QoS.ack(self, delivery_tag)

    qos.ack, qos.reject = released_ack, released_reject  # type: ignore[method-assign]
    qos._headatlas_releases = True  # type: ignore[attr-defined]


_release_even_unacknowledged()
