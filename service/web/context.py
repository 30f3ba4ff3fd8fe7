"""A request, and what a page reads it through: its parameters, the database, links.

Query parameters take the names of the CLI's options where one exists (``sort``, ``asc``,
``layer``, ``top``, ``metric``, ``tag``, ``at``), and a bad value is refused with the message that
option gives on the command line (a ``ParameterError``: the app answers 400 with it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from headatlas.service.errors import ParameterError
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


def whole_number(value: str | None, flag: str, *, minimum: int | None = None) -> int | None:
    """A parameter's integer, or None when absent; refused in the CLI's words."""
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise ParameterError(f"{flag} {value!r}: not a whole number") from None
    if minimum is not None and number < minimum:
        raise ParameterError(f"{flag} {number}: pass {minimum} or more")
    return number


def check_layer_head(run: Run, layer: int | None, head: int | None = None) -> None:
    """``--layer`` and ``--head`` within the run's shape, refused as the CLI refuses them."""
    if layer is not None and not 0 <= layer < run.n_layers:
        raise ParameterError(f"--layer {layer}: run {run.run_id} has layers 0..{run.n_layers - 1} (0-based)")
    if head is not None and not 0 <= head < run.n_heads:
        raise ParameterError(f"--head {head}: run {run.run_id} has heads 0..{run.n_heads - 1} (0-based)")


class Ctx:
    """One request as a page sees it: ``request``, ``reads`` (the database), ``url`` (links that
    keep the request's snapshot), ``run`` (a run by id, name or alias)."""

    def __init__(self, request: Request, store: Store, reads: Reads, *, at: int | None, examples: Any = None):
        self.request, self.store, self.reads, self.at, self.examples = request, store, reads, at, examples

    def arg(self, name: str) -> str | None:
        return self.request.arg(name)

    def number(self, name: str, flag: str | None = None, *, minimum: int | None = None) -> int | None:
        return whole_number(self.request.arg(name), flag or f"--{name}", minimum=minimum)

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
        from headatlas.service.storage.store import resolve_run

        return self.reads.get(("run", ref), lambda: resolve_run(self.reads.conn, ref))

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
