"""A request, and what a page reads it through: its parameters, the database, links.

Query parameters take the names of the CLI's options where one exists (``sort``, ``asc``,
``layer``, ``top``, ``metric``, ``tag``, ``at``), and a bad value is refused by the same check as on
the command line (a ``ParameterError``: the app answers 400 with it), its message in the web's
terms (``WEB``): the parameter as it is written in the address, ``?layer=7`` where the command line
says ``--layer 7``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from headatlas.service.errors import ANALYZE, FLAGS, NO_VALUE, RUNS, Param, ParameterError, Phrase
from headatlas.service.storage.runs import listed
from headatlas.service.storage.store import Run, Store
from headatlas.service.web.documents import run_record
from headatlas.service.web.reads import Reads


class NotFound(Exception):
    """No page at this address (a 404 page says what is missing)."""


class Busy(Exception):
    """Too much of one kind of work is running: answered 503, to be tried again in ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: int = 2) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelUnavailable(Exception):
    """The run's model cannot be loaded in this server (a folder elsewhere, a hub name offline):
    answered 503 with the one line that says which model and why."""


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # decoded, as WSGI's PATH_INFO
    query: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, method: str, path: str, query_string: str = "") -> Request:
        return cls(method.upper(), path or "/", parse_qs(query_string, keep_blank_values=True))

    def arg(self, name: str) -> str | None:
        """The parameter's value (its first), None when absent or empty."""
        values = [v for v in self.query.get(name, []) if v.strip()]
        return values[0].strip() if values else None

    def args(self, name: str) -> list[str]:
        return [v.strip() for v in self.query.get(name, []) if v.strip()]


# the parameters an address of this app takes (a message naming another one names a command's option)
PARAMETERS = frozenset(
    (
        "a",
        "asc",
        "at",
        "b",
        "by",
        "color",
        "head",
        "layer",
        "lines",
        "metric",
        "q",
        "role",
        "sort",
        "tag",
        "text",
        "top",
        "wide",
        "window",
    )
)
PHRASES = {RUNS: "the runs at /runs", ANALYZE: "analyse a corpus with `headatlas analyze CORPUS`"}


class WebTerms:
    """A message as a web page says it: a parameter of the address as it is written there
    (``?layer=7``, ``?asc=1``, ``?sort=METRIC``), a command's option (how to measure what a run
    lacks) as the command line writes it, as code (`` `--effects zero` ``), and a command to run
    as a page's reader finds it (``headatlas runs``: the runs at /runs)."""

    def param(self, param: Param) -> str:
        if param.name not in PARAMETERS:
            return f"`{FLAGS.param(param)}`"
        if param.value is NO_VALUE:
            return f"?{param.name}="
        return f"?{param.name}={'1' if param.value is True else param.value}"

    def phrase(self, phrase: Phrase) -> str:
        return PHRASES.get(phrase, phrase.cli)


WEB = WebTerms()


def whole_number(value: str | None, name: str, *, minimum: int | None = None) -> int | None:
    """The parameter ``name``'s integer, or None when absent."""
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise ParameterError(Param(name, value), ": not a whole number") from None
    if minimum is not None and number < minimum:
        raise ParameterError(Param(name, number), f": pass {minimum} or more")
    return number


class Ctx:
    """One request as a page sees it: ``request``, ``reads`` (the database), ``url`` (links that
    keep the request's snapshot), ``run`` (a run by id, name or alias)."""

    def __init__(self, request: Request, store: Store, reads: Reads, *, at: int | None, examples: Any = None):
        self.request, self.store, self.reads, self.at, self.examples = request, store, reads, at, examples

    def arg(self, name: str) -> str | None:
        return self.request.arg(name)

    def number(self, name: str, *, minimum: int | None = None) -> int | None:
        return whole_number(self.request.arg(name), name, minimum=minimum)

    def flag(self, name: str) -> bool:
        """A yes/no parameter: present and not 0/false/no/off."""
        value = self.request.arg(name)
        return value is not None and value.lower() not in ("0", "false", "no", "off")

    def url(self, path: str, **params: Any) -> str:
        """``path`` with ``params`` (None left out, a list repeated), and this request's ``at``."""
        if not params and "at" not in self.request.query:  # most links: a page links every head
            return path
        pairs: list[tuple[str, str]] = []
        for name, value in params.items():
            if value is None or value is False:
                continue
            for v in value if isinstance(value, (list, tuple)) else [value]:
                pairs.append((name, "1" if v is True else str(v)))
        if self.request.arg("at") is not None and "at" not in params:
            pairs.append(("at", self.request.arg("at") or ""))
        return path + ("?" + urlencode(pairs) if pairs else "")

    def here(self, **changes: Any) -> str:
        """This page's address with some parameters changed (None removes one)."""
        params: dict[str, Any] = {k: list(v) for k, v in self.request.query.items()}
        params.update(changes)
        return self.url(self.request.path, **params)

    def run(self, ref: str) -> Run:
        """The run ``ref`` names, found as every front end finds it (``operations.runs.find_run``);
        a page shows its status itself, so its note is not said."""
        from headatlas.service.operations.runs import find_run

        return self.reads.get(("run", ref), lambda: find_run(self.reads.conn, ref))

    def runs(self, tags: tuple[str, ...] = ()) -> list[dict]:
        """``Store.list_runs``: the rows of ``headatlas runs --format json``."""
        # in the request's transaction: a second one would open the file and check its schema again
        return self.reads.get(("runs", tags), lambda: listed(self.reads.conn, tags=tags))

    def run_row(self, run: Run) -> dict:
        """The run's row of ``headatlas runs --format json``."""
        return run_record(next(r for r in self.runs() if r["run_id"] == run.run_id))

    def query(self, key: tuple, compute: Callable[[Any], Any]) -> Any:
        """``compute(conn)``, remembered under ``key`` (``Reads.get``)."""
        return self.reads.get(key, lambda: compute(self.reads.conn))

    def run_query(self, run: Run, key: tuple, compute: Callable[[Any], Any]) -> Any:
        """``compute(conn)``, which reads run ``run`` alone, remembered under ``key`` for as long as
        what the run stored does not change (``Reads.of_run``)."""
        return self.reads.of_run(run, key, lambda: compute(self.reads.conn))

    def runs_query(self, runs: tuple[Run, ...], key: tuple, compute: Callable[[Any], Any]) -> Any:
        """``run_query`` for ``compute(conn)`` that reads these runs alone (``Reads.of_runs``)."""
        return self.reads.of_runs(runs, key, lambda: compute(self.reads.conn))


def run_path(run: Run | int, *rest: str | int) -> str:
    """A run's address: by id, which renaming leaves as it is."""
    run_id = run if isinstance(run, int) else run.run_id
    # a layer's or head's number needs no quoting (a page links every head: hundreds of these)
    return "/".join([f"/runs/{run_id}", *(str(p) if type(p) is int else quote(str(p), safe="") for p in rest)])
