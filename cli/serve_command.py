"""`headatlas serve`: the stored runs in a browser, read-only (service/web).

Registered on the main app by ``register(app)``. The command checks the database, binds the port,
prints the address and serves until Ctrl-C; the pages' modules load on their first request.
"""

from __future__ import annotations

import typer

from headatlas.cli import options
from headatlas.cli.console import stderr, stdout


def register(app: typer.Typer) -> None:
    app.command()(serve)


@options.analysis_options(
    "device", help={"device": "Where example windows are computed with the run's model (auto, cpu, cuda, mps)."}
)
def serve(
    *,
    db: str = options.Db,
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Address to listen on. Anything but loopback (127.0.0.1, ::1, localhost) lets every machine that reaches "
        "this one read every run: there are no accounts.",
    ),
    port: int = typer.Option(8150, "--port", "-p", min=0, max=65535, help="Port to listen on (0: any free port)."),
    at: int | None = options.At,
    analysis: options.AnalysisOptions,
) -> None:
    """Browse the stored runs in a web browser: the runs, a run's layers, head atlas, roles and heads,
    each head's evidence and an example window, two runs compared, SQL. Read-only; every page's data
    is JSON at its address plus .json. Ctrl-C stops it."""
    from headatlas.service.web.server import bind, is_loopback, url_of

    # the port first (the standard library alone): the address is printed at once, and a browser
    # opening it waits in the socket's queue while the library loads and the database is checked
    server = bind(_starting, host, port)
    try:
        stdout.print(f"headatlas serve: {url_of(server)}", markup=False, highlight=False)
        stdout.file.flush()
        if not is_loopback(host):
            stderr.print(
                f"warning: listening on {host}: anyone who can reach this machine on port {server.server_address[1]} "
                "can read every run of the database (there are no accounts); pass --host 127.0.0.1 to keep it to "
                "this machine",
                markup=False,
                highlight=False,
            )
        from headatlas.service.storage.store import Store
        from headatlas.service.web.app import WebApp

        store = Store(db, at=at)
        with store.checked_read():  # a missing database, a stale schema or a bad --at: said now, once
            pass
        app = WebApp(db, at=at, device=analysis.device)
        server.set_app(app)
        app.warm()  # the latest runs' pages read ahead, in the background
        snapshot = f", snapshot {at}" if at is not None else ""
        stderr.print(f"reading {store.backend.label}{snapshot}, read-only; Ctrl-C stops", markup=False, highlight=False)
        server.serve_forever()
    except KeyboardInterrupt:
        stderr.print("stopped", markup=False)
    finally:
        server.server_close()


def _starting(environ, start_response):  # pragma: no cover - never called: no request is read before the app is set
    start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
    return [b"starting"]
