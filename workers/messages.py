"""The messages of the ingest queue: what submitters and workers tell the writer, one type per kind.

On the queue (a Redis list) a message is JSON: ``{"kind": …, "v": version, "database_id": …,
fields…}``. ``encode`` and ``decode`` are the only code that reads or writes that form. Each type
carries the version of its form (``VERSION``); a message written before versions were (no
``"v"``) has the form of version 1. A raw message that does not decode — not JSON, an unknown
kind, a field missing or of the wrong type, a version newer than this headatlas reads — raises
``Undecodable``: the writer logs it and parks it (``PARKED``, counted by `headatlas status`),
never drops it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

if TYPE_CHECKING:
    from headatlas.service.engine.results import BatchResult

PARKED = "headatlas:ingest:parked"  # messages the writer could not read: kept for a person to look at


class Undecodable(ValueError):
    """A raw message that is no message of this protocol (``reason`` says why)."""

    def __init__(self, reason: str, raw: bytes | str):
        super().__init__(reason)
        self.reason = reason
        self.raw = raw


@dataclass(frozen=True)
class OpenRun:
    """The submitter described the run in Redis (``Ledger.put_run``): the writer creates it, or
    reads its plan again (sent again once the corpus is cut)."""

    kind: ClassVar[str] = "open_run"
    VERSION: ClassVar[int] = 1
    database_id: str
    run_key: str


@dataclass(frozen=True)
class BatchAnalysed:
    """A worker analysed a batch: ``payload`` is its ``BatchResult`` bytes, base64."""

    kind: ClassVar[str] = "ingest"
    VERSION: ClassVar[int] = 1
    database_id: str
    run_key: str
    batch_id: int
    payload: str

    def result(self) -> BatchResult:
        """The batch's statistics (raises on a payload that is not one: the batch is then failed)."""
        from headatlas.service.engine.results import BatchResult

        return BatchResult.from_bytes(base64.b64decode(self.payload))


@dataclass(frozen=True)
class BatchFailed:
    """A worker gave a batch up after ``attempts`` tries; ``error``: the last one's."""

    kind: ClassVar[str] = "failed"
    VERSION: ClassVar[int] = 1
    database_id: str
    run_key: str
    batch_id: int
    attempts: int
    error: str


@dataclass(frozen=True)
class ReopenFailed:
    """`headatlas retry`: the run's failed batches count as pending again (they are queued anew)."""

    kind: ClassVar[str] = "reopen"
    VERSION: ClassVar[int] = 1
    database_id: str
    run_key: str


@dataclass(frozen=True)
class ProbeScores:
    """The run's synthetic probe (SPEC §8): its parameters and scores (name -> ``[layer][head]``)."""

    kind: ClassVar[str] = "probe"
    VERSION: ClassVar[int] = 1
    database_id: str
    run_key: str
    length: int
    sequences: int
    seed: int
    scores: dict[str, list]


@dataclass(frozen=True)
class SeriesStep:
    """A run the database holds finished, submitted as the checkpoint of ``step`` of the training
    series ``series`` (``submit --checkpoints``; ``checkpoints``: what named them): the writer
    records it in the series, since the submitter does not write the database."""

    kind: ClassVar[str] = "series_step"
    VERSION: ClassVar[int] = 1
    database_id: str
    run_key: str
    series: str
    checkpoints: str
    step: int
    checkpoint: str


Message = OpenRun | BatchAnalysed | BatchFailed | ReopenFailed | ProbeScores | SeriesStep
BatchMessage = BatchAnalysed | BatchFailed  # a batch's outcome: consecutive ones share a transaction
TYPES: dict[str, type[Message]] = {
    t.kind: t for t in (OpenRun, BatchAnalysed, BatchFailed, ReopenFailed, ProbeScores, SeriesStep)
}

_CHECKS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "dict[str, list]": (dict,)}


def encode(message: Message) -> str:
    """The message as the queue carries it."""
    body: dict[str, Any] = {"kind": message.kind, "v": message.VERSION}
    body.update((f.name, getattr(message, f.name)) for f in fields(message))
    return json.dumps(body)


def decode(raw: bytes | str) -> Message:
    """The message ``raw`` carries; ``Undecodable`` when it carries none this headatlas reads.
    Fields a later version added are ignored (a version that changes a field's meaning says so
    by its number)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Undecodable(f"not JSON ({exc})", raw) from None
    if not isinstance(body, dict):
        raise Undecodable(f"not a JSON object ({type(body).__name__})", raw)
    kind = body.get("kind")
    cls = TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise Undecodable(f"unknown kind {kind!r} (known: {', '.join(sorted(TYPES))})", raw)
    version = body.get("v", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= cls.VERSION:
        raise Undecodable(f"{kind} message of version {version!r}; this headatlas reads 1 to {cls.VERSION}", raw)
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in body:
            raise Undecodable(f"{kind} message without {f.name}", raw)
        value = body[f.name]
        wanted = _CHECKS[str(f.type)]
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise Undecodable(f"{kind} message: {f.name} is {type(value).__name__}, not {f.type}", raw)
        values[f.name] = value
    return cls(**values)


def unhandled(message: NoReturn) -> NoReturn:
    """The last branch of a dispatch over ``Message``: mypy refuses a call that a message type
    can still reach (a type without its own branch), and at run time nothing reaches it."""
    raise TypeError(f"no handler for {message!r}")


def of_kind(kind: str, **values: Any) -> Message:
    """The message of kind ``kind`` with these fields (``Ledger.send_to_writer``), checked as
    ``decode`` checks one from the queue."""
    try:
        return decode(json.dumps({"kind": kind, **values}))
    except Undecodable as exc:
        raise ValueError(exc.reason) from None
