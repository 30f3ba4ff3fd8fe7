"""Starting worker and writer processes (what `headatlas worker` / `headatlas writer` run).

The settings are passed in: the Celery app is configured with them before the pool forks, so
prefork children inherit them; a per-GPU process gets the overridden ones (broker, device) as
its own options.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import replace

from headatlas.service.config import Settings

WORKER_FLAGS = ["--without-gossip", "--without-mingle", "--without-heartbeat"]


def gpu_count() -> int:
    """GPUs visible here. NVML-based, so CUDA is not initialised in this process (a CUDA
    context does not survive a fork)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_worker(settings: Settings, *, queues: str, concurrency: int | None, loglevel: str = "info") -> None:
    """Analysis workers. On GPUs: one process per GPU with the solo pool (each loads the model
    once, on its own device). On CPU: one process (solo), or a prefork pool of ``concurrency``
    children sharing the cores."""
    device = settings.device
    gpus = gpu_count() if device in ("auto", "cuda") else (1 if device.startswith("cuda") else 0)
    if gpus > 1 and device in ("auto", "cuda") and not concurrency:
        _per_gpu(settings, gpus, queues, loglevel)
        return
    settings = replace(settings, device="cuda" if gpus and device == "auto" else device)
    n = 1 if gpus else max(1, concurrency or 1)
    pool = ["--pool", "solo"] if n == 1 else ["--pool", "prefork", "--concurrency", str(n)]
    from headatlas.workers.app import app, configure

    configure(app, settings, torch_threads=max(1, (os.cpu_count() or 1) // n) if n > 1 else None)

    app.worker_main(
        [
            "worker",
            "-Q",
            queues,
            *pool,
            "-n",
            f"analysis-{os.getpid()}@{socket.gethostname()}",
            "-l",
            loglevel,
            *WORKER_FLAGS,
        ]
    )


def _per_gpu(settings: Settings, gpus: int, queues: str, loglevel: str) -> None:
    """One child per GPU; this process only waits and passes on stop signals."""
    children = []
    for index in range(gpus):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(index))
        children.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "headatlas.cli.main",
                    "worker",
                    "--queues",
                    queues,
                    "--concurrency",
                    "1",
                    "--device",
                    "cuda:0",
                    "--broker",
                    settings.broker_url,
                    "--loglevel",
                    loglevel,
                ],
                env=env,
            )
        )

    def forward(signum, _frame):
        for child in children:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    codes = [child.wait() for child in children]
    if any(codes):
        sys.exit(max(codes))


def run_writer(settings: Settings) -> None:
    """The single database writer, in this process, until SIGTERM or Ctrl-C."""
    import logging

    from headatlas.service.storage.backends import label
    from headatlas.workers.writer import Writer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    writer = Writer(settings)
    logging.getLogger("headatlas.writer").info("storing into %s, from %s", label(settings.db), settings.broker_url)
    writer.run()
