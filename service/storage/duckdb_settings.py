"""The DuckDB settings headatlas opens connections with: every connection's (no extension
downloads, the shipped extensions findable) and the `sql` sandbox's (confined to its database).
A leaf of the storage package."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

# DuckDB settings every connection opened by headatlas gets: extensions come from the installed
# wheels only (duckdb-ext-ducklake, duckdb-ext-postgres), never from the network
NO_DOWNLOADS: dict[str, Any] = {"autoinstall_known_extensions": False, "autoload_known_extensions": False}

# DuckDB checks an extension's signature at every LOAD, in every new instance: a SHA-256 of the
# whole binary, about 50 MB each for the wheels' ducklake and postgres_scanner, 0.25 s of CPU per
# load on a 2-core machine (`python benchmarks/extension_load.py`), paid by each instance that
# attaches a lake, copies its catalogue for the sandbox or lists DuckDB's names for the inspection.
# The binaries come from the installed wheels only (``extension_directory``, downloads off), as
# trusted as DuckDB's own library beside them, and headatlas's own instances run its statements
# alone: they load them unchecked. Where a reader's SQL runs (the sandbox, ``READONLY_CONFIG``)
# the check stays, beside external access off (no LOAD there at all).
OWN_EXTENSIONS: dict[str, Any] = {"allow_unsigned_extensions": True}
SIGNED_EXTENSIONS: dict[str, Any] = {"allow_unsigned_extensions": False}  # a startup option: not SET later

# The storage format of the database files headatlas creates (a file keeps the format it was made
# with; DuckDB reads and writes both). DuckDB's default is still the one DuckDB 1.0 reads, which
# gives every column of every table metadata of its own: a new headatlas file (39 tables, 390
# columns, no rows) is 2.6 MB of it, all read at each open and written again at each checkpoint.
# Since 1.2 the format packs it (1.3 MB): a read transaction, which opens the file (file_instances),
# 16.8 -> 10.7 ms of CPU, a write 16.7 -> 12.7 (`python benchmarks/transaction_cpu.py`); storing
# batches unchanged within noise (`python benchmarks/pipeline.py --parts storing --formats`); docs/benchmarks.md.
# Files made so are read by DuckDB 1.2 or later only (headatlas needs 1.4); older files keep theirs.
STORAGE_VERSION = "v1.2.0"


def duckdb_config(**settings: Any) -> dict[str, Any]:
    """The DuckDB settings of every connection headatlas opens, plus ``settings``: no extension
    downloads, the shipped extensions findable (``LOAD ducklake`` on any connection) and loaded
    without their signature check (``OWN_EXTENSIONS``; the sandbox passes ``SIGNED_EXTENSIONS``), and
    the threads HEADATLAS_DUCKDB_THREADS asks for (unless ``settings`` name them)."""
    folder = extension_directory()
    threads = configured_threads()
    memory = capped_memory()
    return {
        **NO_DOWNLOADS,
        **OWN_EXTENSIONS,
        "storage_compatibility_version": STORAGE_VERSION,
        **({"extension_directory": folder} if folder else {}),
        **({"threads": threads} if threads else {}),
        **({"memory_limit": memory} if memory else {}),
        **settings,
    }


# The share of the process's address-space cap (RLIMIT_AS, as `prlimit --as` or `ulimit -v` sets it)
# DuckDB may take: its default, 80 % of the machine's memory, knows nothing of the cap, and a large
# GROUP BY (compacting the 43 million cells of a 4,096-token window's averaged similarity matrices)
# then fails to allocate instead of spilling to disk. The model and its tensors share the same cap,
# and what they hold when a connection opens is taken first: DuckDB gets at most
# ``CAPPED_ROOM_SHARE`` of the address space still free then (its allocator reserves more address
# space than it fills; a 4,096-token window of SmolLM2 leaves about 1.5 GiB of a 6 GiB cap free
# when it is stored, less than a quarter of the cap)
CAPPED_MEMORY_SHARE = 0.25
CAPPED_ROOM_SHARE = 0.4
# the least it gets: what it frees stays reserved by its allocator, so that the room seen when a
# later connection opens (compacting, after storing) undercounts what it can use; with 64 MiB,
# storing a 4,096-token window failed to pin its blocks (which statement was not traced)
CAPPED_MEMORY_FLOOR = 512 << 20


def address_space() -> tuple[int, int] | None:
    """This process's address-space cap (``RLIMIT_AS``, soft) and what it maps now (its virtual
    size, what the cap counts), in bytes; None where it has no cap."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # not Linux: the cap alone
        used = 0
    return soft, used


def capped_memory() -> str | None:
    """DuckDB's ``memory_limit`` under an address-space cap: ``CAPPED_MEMORY_SHARE`` of it, and
    no more than ``CAPPED_ROOM_SHARE`` of what is still free of it (at least ``CAPPED_MEMORY_FLOOR``); None where
    the process has none."""
    space = address_space()
    if space is None:
        return None
    cap, used = space
    limit = min(int(cap * CAPPED_MEMORY_SHARE), int(max(0, cap - used) * CAPPED_ROOM_SHARE))
    return f"{max(CAPPED_MEMORY_FLOOR, limit) >> 20}MiB"


# HEADATLAS_DUCKDB_THREADS, declared here (a leaf of the storage package) and among the settings
# (service/config.py) with these bounds and words: reading it here does not go through Settings,
# which would make config and storage import each other
THREADS_VARIABLE = "HEADATLAS_DUCKDB_THREADS"
THREADS_MAX = 1024
THREADS_ALLOWED = f"an integer from 0 to {THREADS_MAX} (0: DuckDB's own, one per core)"


def configured_threads() -> int:
    """HEADATLAS_DUCKDB_THREADS (0: unset, DuckDB's own choice), or a ParameterError naming the
    variable and the values it takes, worded as every setting's refusal is."""
    from headatlas.service.errors import ParameterError

    raw = os.environ.get(THREADS_VARIABLE, "")
    if not raw.strip():
        return 0
    try:
        threads = int(raw)
    except ValueError:
        threads = -1
    if not 0 <= threads <= THREADS_MAX:
        raise ParameterError(f"{THREADS_VARIABLE}={raw!r}: expected {THREADS_ALLOWED}")
    return threads


@functools.cache
def extension_directory() -> str | None:
    """The folder of the DuckDB extension binaries shipped on PyPI (``duckdb_ext/extensions``),
    or None when the wheels are not installed. Found once per process: ``duckdb_ext`` is a
    namespace package, whose lookup walks every folder of ``sys.path`` (0.16 ms, at every
    transaction's open before)."""
    spec = importlib.util.find_spec("duckdb_ext")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "extensions")
        if os.path.isdir(path):
            return path
    return None


# Settings that confine a connection to the database file it opened, and check the signature of
# the extension a lake's sandbox loads. lock_configuration comes last in spirit: once set, SET/RESET
# of any option fails for the connection's life.
READONLY_CONFIG: dict[str, str | bool] = {
    "enable_external_access": False,
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    **SIGNED_EXTENSIONS,
    "lock_configuration": True,
}
