"""Domain errors, structured: what went wrong (the problem), the parameter and value it concerns,
and the fix (the hint), each front end rendering the parameter its own way.

A message is a sequence of parts: text, and the terms a front end spells its own way: a
``Param`` (the CLI writes ``--seq-len 0``, the Python API ``seq_len=0``) and a ``Phrase`` (a
command to run, ``headatlas runs``, is ``headatlas.connect(db).runs()`` in Python). ``str(error)``
is the command line's spelling; ``error.render(terms)`` another front end's. The CLI prints it on
one line and exits non-zero; no traceback reaches the user. In Python they are also the built-in
exceptions a caller expects: a bad value is a ``ValueError``, an unknown run a ``LookupError``, a
missing database a ``FileNotFoundError``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class _NoValue:
    def __repr__(self) -> str:
        return "NO_VALUE"

    def __reduce__(self) -> str:
        return "NO_VALUE"  # unpickled as the one NO_VALUE (an error raised in `sql`'s child process)


NO_VALUE = _NoValue()  # a parameter named without a value: ``--layer``, ``layer=...``


@dataclass(frozen=True)
class Placeholder:
    """A value for the reader to fill in, shown as it is in every front end: ``N``, ``FOLDER``."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Param:
    """A parameter named in a message. ``value`` True: a switch (``--ci``, ``ci=True``); NO_VALUE:
    the parameter alone (``--layer``, ``layer=...``); ``quoted``: the command line shows the value
    as a literal (``--select 'top:7'``; Python always does: ``select='top:7'``)."""

    name: str
    value: object = NO_VALUE
    quoted: bool = False


@dataclass(frozen=True)
class Phrase:
    """Words each front end says its own way, such as a command to run: ``cli`` on the command
    line, ``python`` in the Python API (the same as ``cli`` when None)."""

    cli: str
    python: str | None = None


RUNS = Phrase("`headatlas runs`", "`headatlas.connect(db).runs()`")
ANALYZE = Phrase("run `headatlas analyze CORPUS`", "call `headatlas.analyze(corpus, db=...)`")

Part = str | Param | Phrase


class Terms(Protocol):
    """How a front end spells the parts of a message."""

    def param(self, param: Param) -> str: ...

    def phrase(self, phrase: Phrase) -> str: ...


class FlagTerms:
    """The command line's spelling: a parameter is its flag, ``--`` and its name with dashes, or
    the flag of ``SPELLED`` where the command line names it otherwise (a message rendered outside
    the CLI, by ``str()``: the web's answers, logs); the CLI reads its flags from its commands."""

    # parameters whose flag is not their name (tests/test_settings_and_plugins.py holds it to the CLI)
    SPELLED = {
        "fmt": "--format",
        "timeout_s": "--timeout",
        "kinds": "--effects",
        "orders": "--order",
        "methods": "--method",
    }

    def flag(self, name: str) -> str:
        return self.SPELLED.get(name) or "--" + name.replace("_", "-")

    def param(self, param: Param) -> str:
        flag = self.flag(param.name)
        if param.value is NO_VALUE or param.value is True:
            return flag
        return f"{flag} {param.value!r}" if param.quoted else f"{flag} {param.value}"

    def phrase(self, phrase: Phrase) -> str:
        return phrase.cli


FLAGS = FlagTerms()


def render(parts: Sequence[Part], terms: Terms) -> str:
    """``parts`` as one line of text in ``terms``."""
    out = []
    for part in parts:
        if isinstance(part, Param):
            out.append(terms.param(part))
        elif isinstance(part, Phrase):
            out.append(terms.phrase(part))
        else:
            out.append(str(part))
    return "".join(out)


class HeadatlasError(Exception):
    """Base of every error a user can cause and fix.

    ``HeadatlasError(*parts, hint=…)``: the problem, as text and terms; ``hint``: the fix,
    rendered after ``; ``. ``parameter`` and ``value`` are those of the first part when it is a
    ``Param`` (``ParameterError(Param("seq_len", 0), ": must be between 4 and 32768")``), or given.
    """

    exit_code = 2

    def __init__(
        self,
        *parts: Part,
        hint: str | Sequence[Part] | None = None,
        parameter: str | None = None,
        value: object = NO_VALUE,
    ) -> None:
        self.parts: tuple[Part, ...] = parts
        self.hint: tuple[Part, ...] = (hint,) if isinstance(hint, str) else tuple(hint or ())
        first = parts[0] if parts else None
        if parameter is None and isinstance(first, Param):
            parameter, value = first.name, first.value
        self.parameter, self.value = parameter, value
        super().__init__(self.render(FLAGS))

    @property
    def kind(self) -> str:
        """What went wrong, as a name: ``parameter_error``, ``run_not_found``, ``store_busy`` …"""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()

    @property
    def problem(self) -> tuple[Part, ...]:
        return self.parts

    def render(self, terms: Terms) -> str:
        """The message in a front end's terms."""
        text = render(self.parts, terms)
        return f"{text}; {render(self.hint, terms)}" if self.hint else text


class CorpusError(HeadatlasError, ValueError):
    """Unreadable or unusable corpus input (file, line and fix in the message)."""


class ModelError(HeadatlasError):
    """Model cannot be found, loaded or hooked."""


class AdapterIncomplete(ModelError):
    """A model family's adapter lacks a part of the adapter contract (or claims what another
    family serves): it is refused when registered, before any model loads or any run exists."""


class PreparationError(HeadatlasError):
    """A process that prepares windows beside the model ended (killed: out of memory, or by hand)."""


class ParameterError(HeadatlasError, ValueError):
    """An analysis parameter has an invalid value."""


class StoreError(HeadatlasError):
    """Database missing, stale schema, locked too long, or a refused query."""


class RunNotFound(StoreError, LookupError):
    """No run has the id or name asked for (or the database holds no run yet)."""


class RunDeleted(StoreError):
    """A queued run was deleted (`runs delete`) while a writer opened or stored it."""

    def __init__(self, run_id: int):
        super().__init__(f"run {run_id} was deleted from the database")
        self.run_id = run_id


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

    def __init__(self, *parts: Part, waits_for: str, cause: str = "", **fields) -> None:
        super().__init__(*parts, **fields)
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
    """An installed plugin (an entry point of ``headatlas.families``, ``headatlas.backends``,
    ``headatlas.metrics`` or ``headatlas.objectives``) cannot be loaded or breaks its extension
    point's contract."""
