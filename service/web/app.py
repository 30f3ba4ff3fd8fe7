"""The web app: a WSGI application over one results database, read-only.

Routes (each page's data as JSON at the same address plus ``.json``)::

    /runs                                    the runs (?tag=T)
    /progress.json                           progress of the unfinished runs
    /runs/RUN                                a run: layers, atlas, roles, heads
    /runs/RUN/heads/L/H                      a head
    /runs/RUN/heads/L/H/example.json         a head on an example window (computed on demand)
    /runs/RUN/try?text=…&layer=L&head=H      a text of one's own through the run's model (own_text)
    /runs/RUN/sql?q=…  (.json, .csv)         read-only SQL over the run
    /compare/A/B?by=layer|head|depth         two runs compared
    /static/app.js, /static/style.css        the page's script and style, from this package

RUN is an id, a name or an alias (links use ids, which renaming keeps). ``?at=SNAPSHOT`` reads a
lake as of that snapshot on any page (the server's ``--at`` otherwise). Only GET and HEAD are
answered. An address that names nothing gets a 404 page, a bad parameter a 400 page with the
message of the check the CLI makes, in the web's terms (``?layer=7``: context.WEB), a database held by a writer past the wait a 503, and so does a SQL
statement while ``sql_page.SQL_AT_ONCE`` others run, and a run whose model cannot be loaded here (a
text or an example window asked for).

Another site's page can make the browser send a GET here (a link, an image, a form), though not read
the answer: where that would run work (a SQL statement, an example window, a text) it is refused with 403,
and so is any request another site's page makes but a plain navigation (``_foreign``); a request
from this app's own pages, an address typed or bookmarked, or a client that says nothing of where it
comes from (curl, scripts) is answered.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from headatlas.service.errors import HeadatlasError, ModelError, RunNotFound, StoreBusy
from headatlas.service.storage.store import Store
from headatlas.service.web import documents
from headatlas.service.web.context import WEB, Busy, Ctx, ModelUnavailable, NotFound, Request, whole_number
from headatlas.service.web.html import e, layout, message_page
from headatlas.service.web.reads import Memo, Reads
from headatlas.service.web.views import View

STATIC = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
# no script, style or image from elsewhere: the pages work offline, and injected markup could not run
SECURITY_HEADERS = [
    (
        "Content-Security-Policy",
        "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; script-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
]
REASONS = {
    200: "OK",
    302: "Found",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
# the addresses that run work when asked (a query, a model on a window), not only read what is stored
WORK = re.compile(
    r"/runs/[^/]+/(?:sql(?:\.json|\.csv)?|heads/\d{1,6}/\d{1,6}(?:/example\.json|\.json)?|try(?:\.json)?)"
)


class Response:
    def __init__(self, status: int, body: bytes, content_type: str, headers: Iterable[tuple[str, str]] = ()):
        self.status, self.body, self.content_type, self.headers = status, body, content_type, list(headers)


def _html(status: int, text: str) -> Response:
    return Response(status, text.encode("utf-8"), "text/html; charset=utf-8")


class WebApp:
    """The app over database ``db`` (a path or ``ducklake:…``), as of snapshot ``at`` (a lake);
    ``device``: where example windows are computed."""

    def __init__(self, db: str, *, at: int | None = None, device: str = "cpu") -> None:
        from headatlas.service.web.example import Examples

        self.db, self.at = db, at
        self.memo = Memo()
        self.examples = Examples(device=device)
        folder = resources.files("headatlas.service.web") / "static"
        self.static = {name: (folder / name).read_bytes() for name in STATIC}
        self.routes: list[tuple[re.Pattern[str], Callable[..., Response]]] = [
            (re.compile(p), h)
            for p, h in (
                (r"/", self._home),
                (r"/runs(?P<json>\.json)?", self._runs),
                (r"/progress\.json", self._progress),
                (r"/compare", self._compare_form),
                (r"/compare/(?P<a>[^/]+)/(?P<b>[^/]+?)(?P<json>\.json)?", self._compare),
                (r"/runs/(?P<run>[^/]+?)(?P<json>\.json)?", self._run),
                (r"/runs/(?P<run>[^/]+)/sql(?P<ext>\.json|\.csv)?", self._sql),
                (r"/runs/(?P<run>[^/]+)/try(?P<json>\.json)?", self._try),
                (r"/runs/(?P<run>[^/]+)/heads/(?P<layer>\d{1,6})/(?P<head>\d{1,6})(?P<json>\.json)?", self._head),
                (r"/runs/(?P<run>[^/]+)/heads/(?P<layer>\d{1,6})/(?P<head>\d{1,6})/example\.json", self._example),
                (r"/static/(?P<name>[^/]+)", self._static),
            )
        ]

    def warm(self, runs: int = 4) -> threading.Thread:
        """Read the pages of the latest ``runs`` finished runs in a background thread, so that their
        first visit does not wait for their queries (a second or two each on a large run)."""

        def work() -> None:
            listed = self.respond(Request.of("GET", "/runs.json"))
            if listed.status != 200:
                return  # the runs page says why when it is opened
            finished = [r["run_id"] for r in json.loads(listed.body) if r["status"] == "done"]
            for run_id in reversed(finished[-runs:]):
                self.respond(Request.of("GET", f"/runs/{run_id}.json"))

        thread = threading.Thread(target=work, name="headatlas-web-warm", daemon=True)
        thread.start()
        return thread

    # --- WSGI -----------------------------------------------------------------------------------
    def __call__(self, environ: dict, start_response: Callable) -> list[bytes]:
        request = Request.of(environ.get("REQUEST_METHOD", "GET"), _sent_path(environ), environ.get("QUERY_STRING", ""))
        foreign = _foreign(environ, request)
        response = self.respond(request) if foreign is None else self._foreign_refused(request, foreign)
        headers = [
            ("Content-Type", response.content_type),
            ("Content-Length", str(len(response.body))),
            (
                "Cache-Control",
                "no-store"
                if response.content_type.startswith(("text/html", "application/json", "text/csv"))
                else "max-age=60",
            ),
            *SECURITY_HEADERS,
            *response.headers,
        ]
        start_response(f"{response.status} {REASONS.get(response.status, '')}", headers)
        return [b"" if request.method == "HEAD" else response.body]

    def respond(self, request: Request) -> Response:
        """The response to ``request``: a page, a document, or the page saying why not."""
        wants_data = request.path.endswith((".json", ".csv"))
        if request.method not in ("GET", "HEAD"):
            return self._error(
                405, "Read-only", f"{request.method}: this app only reads (GET)", wants_data, [("Allow", "GET, HEAD")]
            )
        for pattern, handler in self.routes:
            match = pattern.fullmatch(request.path)
            if match is None:
                continue
            # the path as sent: a name's %2F is one segment's text, undone only within the segment
            parts = {k: v if v is None else unquote(v) for k, v in match.groupdict().items()}
            try:
                return handler(request, **parts)
            except NotFound as missing:
                return self._error(404, "Not found", str(missing), wants_data)
            except RunNotFound as missing:
                return self._error(404, "Not found", missing.render(WEB), wants_data)
            except StoreBusy as busy:
                return self._error(503, "Busy", busy.render(WEB), wants_data)
            except Busy as busy:
                return self._error(503, "Busy", str(busy), wants_data, [("Retry-After", str(busy.retry_after_s))])
            except ModelUnavailable as unavailable:
                return self._error(503, "Model unavailable", str(unavailable), wants_data)
            except ModelError as failed:
                return self._error(500, "Model unavailable", failed.render(WEB), wants_data)
            except HeadatlasError as bad:
                return self._error(400, "Bad request", bad.render(WEB), wants_data)
        return self._error(404, "Not found", f"no page at {unquote(request.path)}: the runs are at /runs", wants_data)

    def _foreign_refused(self, request: Request, why: str) -> Response:
        """403: a request another site's page made (``_foreign``); the page links the same address,
        which a click on it opens as this app's own request."""
        runs = "runs a query or a model" if WORK.fullmatch(request.path) else "is not a page another site may load"
        message = (
            f"refused: {unquote(request.path)} {runs}, and this request came from another site's page ({why}); "
            "open it from this app (the link below, or its own pages and forms)"
        )
        response = self._error(403, "Refused", message, request.path.endswith((".json", ".csv")))
        if response.content_type.startswith("text/html"):
            tail = _query(request)
            here = quote(request.path, safe="/%") + (f"?{tail}" if tail else "")
            link = f'<p><a id="open-here" href="{e(here)}">open {e(unquote(request.path))} from here</a></p></main>'
            response.body = response.body.replace(b"</main>", link.encode(), 1)
        return response

    def _error(self, status: int, title: str, message: str, data: bool, headers=()) -> Response:
        if data:
            return Response(
                status, documents.json_bytes({"error": message, "status": status}), "application/json", headers
            )
        response = _html(status, message_page(title, message))
        response.headers += list(headers)
        return response

    # --- pages ------------------------------------------------------------------------------------
    def _page(self, request: Request, build: Callable[[Ctx], View], *, as_data: str | None) -> Response:
        at = whole_number(request.arg("at"), "at", minimum=0)
        store = Store(self.db, at=self.at if at is None else at)
        with Reads(store, self.memo) as reads:
            ctx = Ctx(request, store, reads, at=store.at, examples=self.examples)
            view = build(ctx)
            if as_data == ".csv":
                if view.table is None:
                    return Response(view.status, documents.json_bytes(view.document()), "application/json")
                return Response(
                    view.status,
                    documents.csv_bytes(*view.table),
                    "text/csv; charset=utf-8",
                    [("Content-Disposition", f'attachment; filename="{_file_name(request.path)}.csv"')],
                )
            if as_data:
                return Response(view.status, documents.json_bytes(view.document()), "application/json")
            page = layout(
                view.title,
                view.body(),
                home=ctx.url("/runs"),
                database=store.backend.label,
                at=store.at,
                crumbs=view.crumbs,
            )
            return _html(view.status, page)

    def _home(self, request: Request) -> Response:
        return Response(
            302, b"", "text/plain", [("Location", "/runs" + (f"?{_query(request)}" if request.query else ""))]
        )

    def _runs(self, request: Request, json: str | None) -> Response:
        from headatlas.service.web.runs_page import runs_view

        return self._page(request, runs_view, as_data=json)

    def _progress(self, request: Request) -> Response:
        from headatlas.service.web.runs_page import progress_view

        return self._page(request, progress_view, as_data=".json")

    def _run(self, request: Request, run: str, json: str | None) -> Response:
        from headatlas.service.web.run_page import run_view

        return self._page(request, lambda ctx: run_view(ctx, run), as_data=json)

    def _head(self, request: Request, run: str, layer: str, head: str, json: str | None) -> Response:
        from headatlas.service.web.head_page import head_view

        return self._page(request, lambda ctx: head_view(ctx, run, int(layer), int(head)), as_data=json)

    def _example(self, request: Request, run: str, layer: str, head: str) -> Response:
        from headatlas.service.web.example import head_example
        from headatlas.service.web.head_page import check_head

        def build(ctx: Ctx) -> View:
            found = ctx.run(run)
            check_head(found, int(layer), int(head))
            k = ctx.number("window", minimum=0) or 0
            document = head_example(self.examples, ctx.reads, found, k, int(layer), int(head))
            return View("example", document, lambda: "")

        return self._page(request, build, as_data=".json")

    def _try(self, request: Request, run: str, json: str | None) -> Response:
        from headatlas.service.web.own_text import try_view

        return self._page(request, lambda ctx: try_view(ctx, run), as_data=json)

    def _sql(self, request: Request, run: str, ext: str | None) -> Response:
        from headatlas.service.web.sql_page import sql_view

        return self._page(request, lambda ctx: sql_view(ctx, run, wants_data=ext is not None), as_data=ext)

    def _compare_form(self, request: Request) -> Response:
        a, b = request.arg("a"), request.arg("b")
        if a is None or b is None:
            raise NotFound("compare two runs at /compare/A/B (ids, names or aliases), or pick them on /runs")
        rest = {k: v for k, v in request.query.items() if k not in ("a", "b")}
        tail = _query(Request(request.method, request.path, rest))
        location = f"/compare/{quote(a, safe='')}/{quote(b, safe='')}" + (f"?{tail}" if tail else "")
        return Response(302, b"", "text/plain", [("Location", location)])

    def _compare(self, request: Request, a: str, b: str, json: str | None) -> Response:
        from headatlas.service.web.compare_page import compare_view

        return self._page(request, lambda ctx: compare_view(ctx, a, b), as_data=json)

    def _static(self, request: Request, name: str) -> Response:
        # only the files this package ships, by name: no path reaches anything else
        if name not in self.static:
            raise NotFound(f"no file {name} here")
        return Response(200, self.static[name], STATIC[name])


def _sent_path(environ: dict) -> str:
    """The request's path, percent-encoded as sent, each segment in one spelling: from the server's
    ``REQUEST_URI`` (or ``RAW_URI``) where it gives one, else from PATH_INFO (where a %2F is already a
    slash, so that a name holding one cannot be told from two segments)."""
    sent = environ.get("REQUEST_URI") or environ.get("RAW_URI")
    if sent:
        path = sent.split("?", 1)[0] if sent.startswith("/") else urlsplit(sent).path
        return "/".join(quote(unquote(part), safe="") for part in path.split("/")) or "/"
    # PEP 3333: PATH_INFO holds the URL's bytes as latin-1 characters
    path = environ.get("PATH_INFO", "/").encode("latin-1").decode("utf-8", "replace")
    return quote(path, safe="/")


def _foreign(environ: dict, request: Request) -> str | None:
    """Why ``request`` comes from another site's page, where that is refused; None otherwise.

    The browser says where a request comes from: ``Sec-Fetch-Site`` (every current browser), and
    ``Origin`` or ``Referer`` where it sends them. Another site's (``cross-site``, and ``same-site``:
    another port of this host is one) is refused unless it is a plain navigation to a page that
    only reads (a link to a run); to an address that runs work (``WORK``, with a statement), any sign
    of another origin is refused. A request that names no origin (curl, a script, a bookmark) is
    answered: only a browser, on another site's behalf, is guarded against here."""
    site = environ.get("HTTP_SEC_FETCH_SITE", "").strip().lower()
    mode = environ.get("HTTP_SEC_FETCH_MODE", "").strip().lower()
    works = WORK.fullmatch(request.path) is not None and (
        request.path.endswith("example.json") or request.arg("q") is not None or request.arg("text") is not None
    )
    if site in ("cross-site", "same-site") and (works or mode not in ("", "navigate")):
        return f"Sec-Fetch-Site: {site}" + (f", Sec-Fetch-Mode: {mode}" if mode else "")
    if works:
        host = environ.get("HTTP_HOST", "").strip().lower()
        for key, name in (("HTTP_ORIGIN", "Origin"), ("HTTP_REFERER", "Referer")):
            value = environ.get(key, "").strip()
            if value and (not host or urlsplit(value).netloc.lower() != host):
                return f"{name}: {value[:200]}"
    return None


def _query(request: Request) -> str:
    from urllib.parse import urlencode

    return urlencode([(k, v) for k, values in request.query.items() for v in values])


def _file_name(path: str) -> str:
    """``/runs/3/sql.csv`` → ``run-3-sql``: a download's name, in safe characters only."""
    stem = path.strip("/").removesuffix(".csv").removeprefix("runs/")
    return "run-" + (re.sub(r"[^A-Za-z0-9_-]+", "-", stem).strip("-") or "result")


def make_app(db: str, **options: Any) -> WebApp:
    return WebApp(db, **options)
