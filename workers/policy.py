"""The queue's fault policy: when a process counts as gone, how often each proves it is not, how
a failed batch is tried again, when lost and stranded batches are queued again, and how the
writer waits out a broker, a database or a lake that is away.

Every timing is declared here once, with its meaning (``TIMINGS``); the lease, the heartbeats,
the tasks, the Celery app and the writer read them from here, and the table of timings in
docs/reliability.md is generated from the declarations (``python -m headatlas.workers.policy``,
run by ``make docs``; tests/test_docs.py fails when it is stale). Two timings follow settings
(service/config.py): HEADATLAS_LEASE_S, read from this process's environment each time a module
takes a timing's constant (every process of a broker is given the same one), and
HEADATLAS_TASK_TIME_LIMIT_S, read from the settings a worker or the app is configured with. Any
timing held in a constant here may be set apart from its declaration by HEADATLAS_TIMING_<NAME> in
the environment (``applied``), read at the same moment: the test suite shortens the waits of its
fault tests so, never the declared defaults. A bad value is refused in one line by the command
that takes the constant, never as this module is imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from headatlas.service.config import Settings
from headatlas.service.errors import ParameterError


@dataclass(frozen=True)
class Timing:
    """One timing of the policy: ``name`` (its constant or function here), what it means, and
    its value: fixed ``seconds``, or ``of`` the settings (``formula`` says how, in their
    variables' names)."""

    name: str
    meaning: str
    applied_by: str  # the modules that act on it
    seconds: float | None = None
    formula: str = ""
    of: Callable[[Settings], float] | None = None

    def value(self, settings: Settings) -> float:
        if self.of is not None:
            return float(self.of(settings))
        assert self.seconds is not None  # a timing is fixed or follows the settings
        return float(self.seconds)

    def shown(self) -> str:
        """The value as the docs give it: fixed, or the formula with its default value."""
        fixed = _seconds(self.value(Settings()))
        return f"{self.formula} ({fixed} by default)" if self.of is not None else fixed


def _seconds(value: float) -> str:
    return f"{value:g} s"


# --- leases and heartbeats -------------------------------------------------------------------
SILENCE = Timing(
    "SILENT_S",
    "A writer's lease, a running batch's heartbeat and a worker's beacon count as gone when unrefreshed this "
    "long: another writer may take the ingest queue, and the writer's sweep requeues the batch (or the batches "
    "delivered to the worker and not started).",
    "lease.py, heartbeat.py, tasks.py",
    formula="HEADATLAS_LEASE_S",
    of=lambda s: s.lease_s,
)
HEARTBEAT = Timing(
    "HEARTBEAT_S",
    "How often each of those is refreshed (five times per lease), and how often the writer sweeps for lost "
    "workers, writers that are gone, stranded batches and a broker that lost its data.",
    "lease.py, heartbeat.py, writer_sweep.py",
    formula="HEADATLAS_LEASE_S / 5",
    of=lambda s: s.lease_s / 5,
)
DELIVERY_GRACE = Timing(
    "DELIVERY_GRACE_S",
    "A batch delivered to a worker and not started counts as lost with its worker's beacon only this long after "
    "its delivery (the beacon's first beat may trail the delivery).",
    "heartbeat.py, status.py",
    formula="HEADATLAS_LEASE_S / 5",
    of=lambda s: s.lease_s / 5,
)

# --- a batch: its time limit, its retries ------------------------------------------------------
TIME_LIMIT = Timing(
    "time_limit_s",
    "The longest one batch's analysis may run, after the worker has built its model: an alarm around the "
    "analysis ends it, and the attempt counts as failed.",
    "tasks.py",
    formula="HEADATLAS_TASK_TIME_LIMIT_S",
    of=lambda s: s.task_time_limit_s,
)
HARD_LIMIT = Timing(
    "hard_limit_s",
    "Celery kills a task's process that still runs this long (a batch stuck where the alarm cannot interrupt "
    "it, with room for the model's build): its batch is requeued.",
    "app.py",
    formula="1.5 × HEADATLAS_TASK_TIME_LIMIT_S",
    of=lambda s: 1.5 * s.task_time_limit_s,
)
VISIBILITY = Timing(
    "visibility_timeout_s",
    "A message delivered and not acknowledged is given to another worker after this, if no sweep requeued it "
    "before (no writer running): longer than the longest task, or a slow batch would run twice at once.",
    "app.py",
    formula="2 × HEADATLAS_TASK_TIME_LIMIT_S",
    of=lambda s: 2 * s.task_time_limit_s,
)
RETRY = Timing(
    "RETRY_MAX_S",
    "A batch whose analysis failed is tried again after 2^attempt s (2, 4, 8, 16 s …), at most this, until "
    "HEADATLAS_MAX_ATTEMPTS attempts; then it is marked failed (`headatlas retry` queues it again).",
    "tasks.py",
    seconds=30.0,
)
STRANDED = Timing(
    "STRANDED_S",
    "Batches in flight that no message carries (Redis shut down between a worker's pop of a message and its "
    "record of it) are queued again from the copies `submit` kept once they stay so this long with no batch "
    "stored meanwhile.",
    "writer.py, writer_sweep.py",
    seconds=5.0,
)
RESUBMIT_STRANDED = Timing(
    "RESUBMIT_STRANDED_S",
    "A waiting `submit --wait` submits stranded batches again once they stay so this long with no batch stored "
    "meanwhile: longer than STRANDED_S, so that it is the fallback for batches with no kept copy.",
    "cli/queue_commands.py",
    seconds=15.0,
)

# --- the broker ------------------------------------------------------------------------------------
RESTORE = Timing(
    "UNACKED_RESTORE_S",
    "How often the broker's sweep looks for unacknowledged messages past their visibility timeout (kombu's "
    "default is about 100 s).",
    "app.py",
    seconds=2.0,
)
RECONNECT = Timing(
    "RECONNECT_EVERY_S",
    "A worker tries a lost broker again this often, for as long as it takes (Celery's own pace, 2, 4, 6 … s, "
    "left workers idle for seconds after Redis was back).",
    "consumer.py",
    seconds=1.0,
)
CONNECT = Timing(
    "BROKER_CONNECT_TIMEOUT_S",
    "Connecting to Redis gives up after this (every client: workers, writer, submit, status).",
    "app.py, ledger.py",
    seconds=5.0,
)
READ = Timing(
    "BROKER_READ_TIMEOUT_S",
    "A Redis command that gets no answer fails after this (the queue's own clients), and one idle this long "
    "checks its connection first.",
    "ledger.py",
    seconds=30.0,
)
HEALTH = Timing(
    "BROKER_HEALTH_CHECK_S",
    "A worker's broker connection idle this long is checked before use: a Redis gone without closing the socket "
    "(restarted elsewhere, a dropped network) is noticed then, with TCP keepalive, not after hours.",
    "app.py",
    seconds=10.0,
)
WORKER_START = Timing(
    "WORKER_START_S",
    "A prefork child has this long to start (it imports torch and transformers as it starts): Celery's 4 s "
    "killed and replaced children in a loop on a loaded machine.",
    "app.py",
    seconds=60.0,
)

# --- the writer --------------------------------------------------------------------------------------
BROKER_RETRY = Timing(
    "BROKER_RETRY_S",
    "The writer waits this long before trying an unreachable broker again (its messages stay in Redis).",
    "writer.py",
    seconds=1.0,
)
BUSY_RETRY = Timing(
    "BUSY_RETRY_S",
    "The writer waits this long before storing again after its database file was held by another process past "
    "the lock wait (the messages it took go back to the queue).",
    "writer.py",
    seconds=1.0,
)
CONFLICT_RETRY = Timing(
    "CONFLICT_RETRY_S",
    "A lake refused the writer's commit (another writer committed the same rows first): its messages go back to "
    "the queue and are stored (or skipped) again after this.",
    "writer.py",
    seconds=0.05,
)
AWAY_POLL = Timing(
    "AWAY_POLL_S",
    "A writer whose database file is missing or replaced looks for it again this often (it never creates "
    "another one; the analysed batches wait in Redis).",
    "writer.py, writer_pause.py",
    seconds=2.0,
)
PAUSE_FIRST = Timing(
    "PAUSE_FIRST_S",
    "A writer whose lake is unavailable (its catalogue's connection lost, its data path full or read-only) "
    "tries again after this, doubling the wait each time …",
    "writer_pause.py",
    seconds=0.5,
)
PAUSE_MAX = Timing("PAUSE_MAX_S", "… up to this.", "writer_pause.py", seconds=5.0)
FLAP = Timing(
    "FLAP_S",
    "A pause that begins this soon after the last one ended goes on with that one's wait, and is said once (a "
    "data path with little room lets the probe pass and the work fail).",
    "writer_pause.py",
    seconds=30.0,
)
TAKE_WAIT = Timing(
    "TAKE_WAIT_S",
    "The writer waits this long for a message on an empty ingest queue before it looks again whether it is "
    "told to stop, or its database is away.",
    "writer.py",
    seconds=1.0,
)
WRITER_POLL = Timing(
    "WRITER_POLL_S",
    "A submission waiting for a writer (to learn which database its batches are for, then its run's id) looks "
    "again this often.",
    "lease.py, submit.py",
    seconds=0.2,
)
READER_GAP = Timing(
    "READER_GAP_S",
    "Between two transactions the writer leaves its database file closed at least this long, and as long as it "
    "held it: readers (`status`, `query`, `sql`), which retry on its lock, find it free at least every other try.",
    "writer.py",
    seconds=0.025,
)

TIMINGS: tuple[Timing, ...] = (
    SILENCE,
    HEARTBEAT,
    DELIVERY_GRACE,
    TIME_LIMIT,
    HARD_LIMIT,
    VISIBILITY,
    RETRY,
    STRANDED,
    RESUBMIT_STRANDED,
    RESTORE,
    RECONNECT,
    CONNECT,
    READ,
    HEALTH,
    WORKER_START,
    BROKER_RETRY,
    BUSY_RETRY,
    CONFLICT_RETRY,
    AWAY_POLL,
    PAUSE_FIRST,
    PAUSE_MAX,
    FLAP,
    TAKE_WAIT,
    WRITER_POLL,
    READER_GAP,
)


# --- the writer's transactions: how much it stores in one -------------------------------------------
@dataclass(frozen=True)
class Bound:
    """One bound of the policy that is not a timing: ``name`` (its constant here), what it means,
    and its ``value`` in ``unit``."""

    name: str
    meaning: str
    applied_by: str
    value: int
    unit: str

    def shown(self) -> str:
        if self.unit == "bytes" and self.value % 2**20 == 0:
            return f"{self.value // 2**20} MiB"
        return f"{self.value:,} {self.unit}"


GROUP_BYTES_BOUND = Bound(
    "GROUP_BYTES",
    "Group commit: the writer takes the messages waiting on the ingest queue for one transaction until their "
    "bytes reach this, so that with a backlog it stores big transactions (a DuckDB file costs tens of "
    "milliseconds a transaction to open, commit and checkpoint, whatever it holds); idle, it stores what waits "
    "at once. 48 MiB is about 250 batches of 32 windows of MiniLM's shape, 110 of SmolLM2's; their decoded "
    'payloads take 4–6 times their bytes while the transaction is stored (docs/benchmarks.md, "Storing").',
    "writer.py",
    48 * 2**20,
    "bytes",
)
GROUP_MESSAGES_BOUND = Bound(
    "GROUP_MESSAGES",
    "… and at most this many messages, however small (failed batches, runs to open).",
    "writer.py",
    512,
    "messages",
)
BOUNDS: tuple[Bound, ...] = (GROUP_BYTES_BOUND, GROUP_MESSAGES_BOUND)


def environment() -> Settings:
    """The settings the timings read from this process's environment (HEADATLAS_LEASE_S); a value
    the settings refuse is refused in one line (ParameterError) by the command that reads a timing."""
    return Settings.from_env({k: v for k, v in os.environ.items() if k == "HEADATLAS_LEASE_S"})


TIMING_VARIABLE = "HEADATLAS_TIMING_"


def applied(timing: Timing, settings: Settings, environ: Mapping[str, str] | None = None) -> float:
    """The value this process acts on: HEADATLAS_TIMING_<NAME> (the timing's name, e.g.
    HEADATLAS_TIMING_PAUSE_MAX_S=1) where the environment sets one, else the declared value. The
    test suite shortens the waits its fault tests sit out so; the declared values stay the
    defaults. A value that is not a number of seconds above 0 is refused in one line naming it."""
    environ = os.environ if environ is None else environ
    var = TIMING_VARIABLE + timing.name.upper()
    raw = environ.get(var)
    if raw is None:
        return timing.value(settings)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 86400:
        raise ParameterError(f"{var}={raw!r}: expected seconds, more than 0 and at most 86400 (or unset it)")
    return value


# The timings held in constants, read each time a module takes one (``from …policy import
# SILENT_S``, as the writer, a worker, `submit` or `status` starts), not as this module is imported: a
# bad HEADATLAS_TIMING_<NAME> or HEADATLAS_LEASE_S is refused in one line by the command that acts on
# it, and commands that do not (`runs`, `sql`, `query`, `--help`) are untouched by it.
SILENT_S: float
HEARTBEAT_S: float
DELIVERY_GRACE_S: float
RETRY_MAX_S: float
STRANDED_S: float
RESUBMIT_STRANDED_S: float
UNACKED_RESTORE_S: float
RECONNECT_EVERY_S: float
BROKER_CONNECT_TIMEOUT_S: float
BROKER_READ_TIMEOUT_S: float
BROKER_HEALTH_CHECK_S: float
WORKER_START_S: float
BROKER_RETRY_S: float
BUSY_RETRY_S: float
CONFLICT_RETRY_S: float
AWAY_POLL_S: float
PAUSE_FIRST_S: float
PAUSE_MAX_S: float
FLAP_S: float
TAKE_WAIT_S: float
WRITER_POLL_S: float
READER_GAP_S: float

_CONSTANTS: dict[str, Timing] = {t.name: t for t in TIMINGS if t.name.isupper()}


def read_timings() -> dict[str, float]:
    """Every timing's constant, read now: a process that acts on many of them (a worker) refuses a
    bad one as it starts, in one line, not in a child as a batch runs."""
    return {name: __getattr__(name) for name in _CONSTANTS}


def __getattr__(name: str) -> float:
    """A timing's constant (``SILENT_S`` …), read from the environment each time it is taken (some
    50 µs): a module that imports one by name holds what it read then, and a process acts on its
    environment as it is, never on one a caller had set for a while and restored."""
    timing = _CONSTANTS.get(name)
    if timing is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return applied(timing, environment())


BOUND_VARIABLE = "HEADATLAS_BOUND_"


def bound(declared: Bound, environ: Mapping[str, str] | None = None) -> int:
    """The value this process acts on: HEADATLAS_BOUND_<NAME> (e.g. HEADATLAS_BOUND_GROUP_MESSAGES=32)
    where the environment sets one, else the declared value (the test suite's queue processes
    keep the groups of 32 messages its mid-run faults were written for). A value that is not a
    whole number above 0 is refused in one line naming it."""
    environ = os.environ if environ is None else environ
    var = BOUND_VARIABLE + declared.name
    raw = environ.get(var)
    if raw is None:
        return declared.value
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ParameterError(f"{var}={raw!r}: expected a whole number of {declared.unit} above 0 (or unset it)")
    return value


def time_limit_s(settings: Settings) -> float:
    return TIME_LIMIT.value(settings)


def hard_limit_s(settings: Settings) -> float:
    return HARD_LIMIT.value(settings)


def visibility_timeout_s(settings: Settings) -> float:
    return VISIBILITY.value(settings)


# --- the rules -----------------------------------------------------------------------------------
def retry_countdown(attempt: int) -> float:
    """Seconds before a batch that failed its ``attempt``-th try (1 for the first) is tried again."""
    return min(2.0**attempt, __getattr__("RETRY_MAX_S"))


def gives_up(attempt: int, max_attempts: int) -> bool:
    """After its ``attempt``-th try failed: whether the batch is marked failed instead of tried again."""
    return attempt >= max_attempts


def out_of_attempts(attempt: int, max_attempts: int) -> bool:
    """As a worker starts the ``attempt``-th try: whether the tries before it were all used up
    (workers lost while analysing it, which never said it failed): the batch is marked failed."""
    return attempt > max_attempts


def next_pause(delay: float) -> float:
    """The paused writer's next wait after one of ``delay``: doubled, up to PAUSE_MAX_S."""
    return min(2 * delay, __getattr__("PAUSE_MAX_S"))


Stranded = tuple[float, int, set[int]]  # first seen (monotonic s), batches stored then, which batches


def stranded_long_enough(
    seen: Stranded | None, lost: set[int], done: int, now: float, wait_s: float
) -> tuple[Stranded | None, bool]:
    """Whether to queue the stranded batches ``lost`` again now (``Ledger.stranded``): once they
    have stayed stranded ``wait_s`` with no batch stored meanwhile (``done``: batches stored).
    Returns what to remember for the next look, and the answer."""
    if not lost:
        return None, False
    if seen is None or seen[1] != done or not lost <= seen[2]:
        return (now, done, lost), False
    if now - seen[0] < wait_s:
        return seen, False
    return None, True


# --- docs/reliability.md -------------------------------------------------------------------------
DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
BEGIN = "<!-- timings: generated from workers/policy.py by `make docs`; do not edit -->"
END = "<!-- end of the generated timings -->"


def timings_table() -> str:
    """The table of timings (markdown), as docs/reliability.md holds it between BEGIN and END."""
    rows = [
        "| timing | value | what it means | applied by |",
        "|---|---|---|---|",
        *(f"| `{t.name}` | {t.shown()} | {t.meaning} | {t.applied_by} |" for t in TIMINGS),
    ]
    return "\n".join(rows)


def bounds_table() -> str:
    """The table of the writer's bounds (markdown), after the timings in the generated block."""
    rows = [
        "| bound | value | what it means | applied by |",
        "|---|---|---|---|",
        *(f"| `{b.name}` | {b.shown()} | {b.meaning} | {b.applied_by} |" for b in BOUNDS),
    ]
    return "\n".join(rows)


def with_timings(doc: str) -> str:
    """``doc`` (docs/reliability.md) with its generated block replaced by the current tables."""
    start, end = doc.index(BEGIN), doc.index(END)
    return doc[: start + len(BEGIN)] + "\n" + timings_table() + "\n\n" + bounds_table() + "\n" + doc[end:]


def main(argv: list[str]) -> int:
    """Write the table into docs/reliability.md; ``--check``: exit 1 when it is stale."""
    doc = DOC.read_text(encoding="utf-8")
    current = with_timings(doc)
    if "--check" in argv:
        if current != doc:
            print(f"{DOC} is stale: run `python -m headatlas.workers.policy` (make docs)", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(current, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
