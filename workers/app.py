"""The Celery application: configuration from Settings, queue routing, reliability settings.

One Celery queue, ``analysis``: one task per batch, run by ``headatlas worker`` processes (any
number, any machine). Results, run creation and failures travel on the ingest queue, a plain
Redis list consumed by the single ``headatlas writer`` (workers/writer.py), the only process that
opens the database for writing; it stores many results per transaction, which a Celery task
(acknowledged one at a time) could not.

Importing this module loads no model and opens no connection.
"""

from __future__ import annotations

from celery import Celery
from kombu import Exchange, Queue

from headatlas.service.config import Settings
from headatlas.workers.policy import (
    BROKER_CONNECT_TIMEOUT_S,
    BROKER_HEALTH_CHECK_S,
    UNACKED_RESTORE_S,
    WORKER_START_S,
    hard_limit_s,
    visibility_timeout_s,
)

ANALYSIS_QUEUE = "analysis"


def broker_options(settings: Settings) -> dict:
    """Redis transport options, from the fault policy (workers/policy.py): the visibility timeout
    (how long a delivered, unacknowledged message waits before another worker may get it), the
    unacked-restore sweep's pace (kombu's interval × throttle), the broker's timeouts."""
    return {
        "visibility_timeout": int(visibility_timeout_s(settings)),
        "unacked_restore_interval": UNACKED_RESTORE_S,
        "unacked_restore_throttle": 1,
        "socket_connect_timeout": BROKER_CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
        "health_check_interval": BROKER_HEALTH_CHECK_S,
        "retry_on_timeout": True,
    }


def send_batch(app: Celery, run_key: str, batch_id: int, payload: dict, producer=None) -> None:
    """One batch's message on the analysis queue (``payload``: as ``submit.batch_payloads`` makes it)."""
    app.send_task("headatlas.analyze_batch", args=[run_key, batch_id, payload], queue=ANALYSIS_QUEUE, producer=producer)


def make_app(settings: Settings | None = None) -> Celery:
    settings = settings or Settings.from_env()
    app = Celery("headatlas", broker=settings.broker_url, include=["headatlas.workers.tasks"])
    configure(app, settings)
    return app


def configure(app: Celery, settings: Settings, *, torch_threads: int | None = None) -> None:
    """Configure ``app`` from ``settings``, which tasks read as ``app.conf.headatlas``;
    ``torch_threads``: torch threads per prefork child (None: torch's own choice)."""
    app.conf.update(
        broker_url=settings.broker_url,
        broker_transport_options=broker_options(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,  # a lost connection is re-established, with backoff …
        broker_connection_max_retries=None,  # … for as long as it takes: a restarted Redis is waited for
        broker_channel_error_retry=True,  # a channel error while connecting is retried too
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        task_ignore_result=True,
        # A task is acknowledged after it ran, and re-queued when its process dies: a batch
        # is never lost to a crash, at the price of running twice (ingest is idempotent).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # a worker holds at most one batch per pool process; one it holds and has not started yet
        # (pool children busy or starting, a retry's countdown) is claimed by its beacon from
        # delivery on (workers/heartbeat.py), so a killed worker does not keep it either
        worker_prefetch_multiplier=1,
        # a prefork child builds its model as it starts (its parent imported torch and
        # transformers before forking): on a loaded machine that took longer than Celery's 4 s,
        # and children were killed and replaced in a loop
        worker_proc_alive_timeout=WORKER_START_S,
        # The time limit is the analysis's own, in every pool: workers/tasks.py raises it by an
        # alarm around the analysis, after the model is built (a pool child replacing a lost one
        # builds it inside its first task). Celery's soft limit would count the build too; its
        # hard limit, which kills the process, is the backstop for a batch stuck where the alarm
        # cannot interrupt it, and leaves room for the build.
        task_time_limit=hard_limit_s(settings),
        task_default_queue=ANALYSIS_QUEUE,
        task_queues=[Queue(ANALYSIS_QUEUE, Exchange(ANALYSIS_QUEUE, type="direct"), routing_key=ANALYSIS_QUEUE)],
        task_routes={"headatlas.analyze_batch": {"queue": ANALYSIS_QUEUE}},
        task_default_exchange=ANALYSIS_QUEUE,
        task_default_routing_key=ANALYSIS_QUEUE,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_enable_remote_control=False,  # no pidbox queues: fewer keys, faster start
        # a lost broker is tried again every second, not after Celery's 2, 4, 6, … s (consumer.py)
        worker_consumer="headatlas.workers.consumer:SteadyReconnectConsumer",
    )
    app.conf.headatlas = settings
    app.conf.headatlas_torch_threads = torch_threads


app = make_app()
