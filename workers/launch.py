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
# Each pool process holds a model of its own; more than this is a typo, not a machine.
MAX_CONCURRENCY = 256


def gpu_count() -> int:
    """GPUs visible here. NVML-based, so CUDA is not initialised in this process (a CUDA
    context does not survive a fork)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_concurrency(concurrency: int | None) -> None:
    if concurrency is not None and not 1 <= concurrency <= MAX_CONCURRENCY:
        from headatlas.service.errors import ParameterError

        raise ParameterError(f"--concurrency {concurrency} is out of range: use 1 to {MAX_CONCURRENCY} processes")


def run_worker(settings: Settings, *, queues: str, concurrency: int | None, loglevel: str = "info") -> None:
    """Analysis workers. On GPUs: one process per GPU with the solo pool (each loads the model
    once, on its own device). On CPU: one process (solo), or a prefork pool of ``concurrency``
    children sharing the cores."""
    from headatlas.workers.policy import read_timings

    check_concurrency(concurrency)
    read_timings()  # a bad HEADATLAS_TIMING_<NAME> or HEADATLAS_LEASE_S refused here, in one line
    device = settings.device
    gpus = gpu_count() if device in ("auto", "cuda") else (1 if device.startswith("cuda") else 0)
    if gpus > 1 and device in ("auto", "cuda") and not concurrency:
        _per_gpu(settings, gpus, queues, loglevel)
        return
    settings = replace(settings, device="cuda" if gpus and device == "auto" else device)
    n = 1 if gpus else max(1, concurrency or 1)
    # the solo pool runs one task at a time in this process: said so (Celery's banner would print
    # its default concurrency, the number of cores, beside "(solo)")
    pool = ["--pool", "solo", "--concurrency", "1"] if n == 1 else ["--pool", "prefork", "--concurrency", str(n)]
    from headatlas.workers.app import app, configure

    configure(app, settings, torch_threads=max(1, (os.cpu_count() or 1) // n) if n > 1 else None)
    if n > 1:
        import_model_stack()

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


def import_model_stack() -> None:
    """Import torch, transformers and the analysis code in a prefork pool's parent, before it
    forks: each child then starts with them already imported (shared, copy-on-write) instead of
    importing them itself (about 7 s of CPU per child, and per child that replaces a lost one).
    Only modules: no model is built and no thread or CUDA context is started before the fork."""
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    # what loading any model imports lazily (transformers' _LazyModule), else once in every child:
    # AutoConfig, AutoTokenizer and the auto model classes (about 0.3 s of CPU each time)
    import transformers.models.auto.modeling_auto  # noqa: F401
    import transformers.models.auto.tokenization_auto  # noqa: F401

    import headatlas.service.engine.analysis  # noqa: F401
    import headatlas.service.engine.model  # noqa: F401


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


class _WithoutPandas:
    """A meta-path finder that answers ``import pandas`` as if pandas were not installed."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r} (not used by this process)", name=name)
        return None


def without_pandas() -> None:
    """Keep pandas out of the writer's process, as if it were not installed: the writer stores
    numpy payloads and never uses it. DuckDB imports pandas, when it is installed, at a
    connection's first query with parameters (to check whether a parameter is a DataFrame):
    1.5-2.2 s of every writer's start, for nothing. A finder that raises ModuleNotFoundError, not
    a None in ``sys.modules`` (pyarrow reads that entry directly and fails on it). Not for a
    process that loads models: transformers asks ``importlib.util.find_spec`` whether pandas is
    installed, and this finder would answer with an error, not with None."""
    if "pandas" not in sys.modules and not any(isinstance(f, _WithoutPandas) for f in sys.meta_path):
        sys.meta_path.insert(0, _WithoutPandas())


def stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` writes every thread's stack to this process's stderr (its log), for a
    writer or beat that seems stuck: where each thread waits, without stopping it. (A Celery
    worker does the same on SIGUSR1 by itself.)"""
    import faulthandler

    if not hasattr(signal, "SIGUSR1"):  # not on Windows
        return
    try:
        stderr = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # run in-process (a test's CliRunner): no stderr to write to
        return
    faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)


def run_writer(settings: Settings) -> None:
    """The single database writer, in this process, until SIGTERM or Ctrl-C."""
    import logging

    without_pandas()
    stacks_on_sigusr1()

    from headatlas.service.storage.backends import label
    from headatlas.workers.writer import Writer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    writer = Writer(settings)
    logging.getLogger("headatlas.writer").info("storing into %s, from %s", label(settings.db), settings.broker_url)
    writer.run()
