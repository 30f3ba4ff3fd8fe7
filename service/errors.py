"""Domain errors. Each carries a message that names what went wrong, where, and the fix.

The CLI prints ``str(error)`` on one line and exits non-zero; no traceback reaches the user.
In Python they are also the built-in exceptions a caller expects: a bad value is a
``ValueError``, an unknown run a ``LookupError``, a missing database a ``FileNotFoundError``
(``headatlas.service.api`` rewrites their CLI flags as keyword arguments).
"""


class HeadatlasError(Exception):
    """Base of every error a user can cause and fix."""

    exit_code = 2


class CorpusError(HeadatlasError, ValueError):
    """Unreadable or unusable corpus input (file, line and fix in the message)."""


class ModelError(HeadatlasError):
    """Model cannot be found, loaded or hooked."""


class AdapterIncomplete(ModelError):
    """A model family's adapter lacks a part of the adapter contract (or claims what another
    family serves): it is refused when registered, before any model loads or any run exists."""


class ParameterError(HeadatlasError, ValueError):
    """An analysis parameter has an invalid value."""


class StoreError(HeadatlasError):
    """Database missing, stale schema, locked too long, or a refused query."""


class RunNotFound(StoreError, LookupError):
    """No run has the id or name asked for (or the database holds no run yet)."""


class StoreBusy(StoreError):
    """Another process held the database file's lock for longer than the wait allowed."""


class DatabaseLocked(StoreBusy):
    """Another process holds the database file (or a lake's catalogue file): DuckDB lets one
    process open a file for writing and refuses every other one meanwhile. Nothing was written;
    waited out with backoff (``readonly.retry_on_lock``), and tried again."""


class StoreConflict(StoreBusy):
    """A lake refused a commit: a concurrent transaction changed the same rows (try the unit of
    work again; it then sees what the other one committed)."""


class StoreUnavailable(StoreBusy):
    """A lake cannot be reached or written now: its catalogue's connection was lost (PostgreSQL
    restarted, down, or the session ended by the server), or its data path is full or read-only.
    Nothing of the unit of work was committed; it is tried again when the fault clears.
    ``waits_for`` names what it waits for ("the lake's catalogue", "the lake's data path")."""

    def __init__(self, message: str, *, waits_for: str, cause: str = ""):
        super().__init__(message)
        self.waits_for = waits_for
        self.cause = cause  # the driver's own words, first line


class DatabaseFileError(StoreError):
    """The database file is missing, not a (headatlas) DuckDB database, damaged, or not writable."""


class DatabaseNotFound(DatabaseFileError, FileNotFoundError):
    """No database file where one was named."""


class BrokerError(HeadatlasError):
    """The message broker cannot be reached, or refuses what is asked of it."""


class BrokerOutOfMemory(BrokerError):
    """Redis is at its maxmemory and refuses writes (raise maxmemory or free memory in it)."""


class BrokerDatabaseOutOfRange(BrokerError):
    """The broker URL names a logical database the Redis server does not have."""


class WriterConflict(HeadatlasError):
    """The ingest queue is held by another live writer, or belongs to another database."""


class PluginError(HeadatlasError):
    """An installed plugin (an entry point of ``headatlas.families``, ``headatlas.backends`` or
    ``headatlas.metrics``) cannot be loaded or breaks its extension point's contract."""
