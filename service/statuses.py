"""The statuses a run and a batch are stored with (``runs.status``, ``batches.status``).

Each value is the string the database holds (no migration changes them): a member compares
equal to it, prints as it, and goes into SQL through ``sql`` (a literal, or a parenthesised
list), so that no query spells a status by hand.
"""

from __future__ import annotations

from enum import Enum


class StoredValue(str, Enum):
    """A status as stored: ``str(member)`` and f-strings give the stored text."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class RunStatus(StoredValue):
    CREATED = "created"  # recorded, nothing analysed yet
    RUNNING = "running"  # batches being analysed or stored
    INTERRUPTED = "interrupted"  # stopped by the user (an embedded run); the same command resumes it
    DONE = "done"  # every batch stored (and the sums compacted)
    FAILED = "failed"  # ended with batches that failed (`headatlas retry` queues them again)


class BatchStatus(StoredValue):
    DONE = "done"  # stored, with its rows
    FAILED = "failed"  # given up after its attempts (or refused by the database)
    RESERVED = "reserved"  # a lake: claimed before it is stored (docs/architecture.md, "Exactly once on a lake")


# a run that a process may still be writing to
UNFINISHED = (RunStatus.CREATED, RunStatus.RUNNING)
# a run that has ended: nothing of it is analysed or stored any more
ENDED = (RunStatus.DONE, RunStatus.FAILED)


def sql(*statuses: StoredValue) -> str:
    """The statuses as an SQL literal (one) or a parenthesised list (several, for ``IN``)."""
    literals = [f"'{status.value}'" for status in statuses]
    return literals[0] if len(literals) == 1 else f"({', '.join(literals)})"
