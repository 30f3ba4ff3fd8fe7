"""Starting worker and writer processes (what `headatlas worker` / `headatlas writer` run).

Settings reach the Celery app through HEADATLAS_* variables, set here before ``workers.app`` is
imported, so that every process (prefork children, per-GPU processes) reads the same values.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

WORKER_FLAGS = ["--without-gossip", "--without-mingle", "--without-heartbeat"]


def gpu_count() -> int:
    """GPUs visible here. NVML-based, so CUDA is not initialised in this process (a CUDA
    context does not survive a fork)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_worker(*, queues: str, concurrency: int | None, device: str, loglevel: str = "info") -> None:
    """Analysis workers. On GPUs: one process per GPU with the solo pool (each loads the model
    once, on its own device). On CPU: one process (solo), or a prefork pool of ``concurrency``
    children sharing the cores."""
    gpus = gpu_count() if device in ("auto", "cuda") else (1 if device.startswith("cuda") else 0)
    if gpus > 1 and device in ("auto", "cuda") and not concurrency:
        _per_gpu(gpus, queues, loglevel)
        return
    os.environ["HEADATLAS_DEVICE"] = "cuda" if gpus and device == "auto" else device
    n = 1 if gpus else max(1, concurrency or 1)
    pool = ["--pool", "solo"] if n == 1 else ["--pool", "prefork", "--concurrency", str(n)]
    if n > 1:
        os.environ["HEADATLAS_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    from headatlas.workers.app import app

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


def _per_gpu(gpus: int, queues: str, loglevel: str) -> None:
    """One child per GPU; this process only waits and passes on stop signals."""
    children = []
    for index in range(gpus):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(index), HEADATLAS_DEVICE="cuda:0")
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


def run_writer() -> None:
    """The single database writer, in this process, until SIGTERM or Ctrl-C."""
    import logging

    from headatlas.service.config import Settings
    from headatlas.workers.writer import Writer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings.from_env()
    writer = Writer(settings)
    logging.getLogger("headatlas.writer").info("storing into %s, from %s", settings.db, settings.broker_url)
    writer.run()
