"""The HTTP server of ``headatlas serve``: the standard library's WSGI server, each request handled
by one of a fixed pool of threads (a slow page, an example window being computed, does not hold up
the others; the pool bounds how many run at once).

Bound to 127.0.0.1 unless told otherwise: the app has no accounts, and whoever reaches the port reads
every run.
"""

from __future__ import annotations

import ipaddress
import socket
import socketserver
import sys
from concurrent.futures import ThreadPoolExecutor
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from headatlas.service.errors import ParameterError

WORKERS = 8


class PooledServer(WSGIServer):
    """A WSGI server whose requests run on a pool of ``WORKERS`` threads."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler=None, *, workers: int = WORKERS):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        # before the base class binds: a port in use closes the server inside __init__
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="headatlas-web")
        super().__init__(address, handler or RawPathHandler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind asks DNS for this host's full name (seconds where no DNS answers)
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port
        self.setup_environ()

    def process_request(self, request, client_address) -> None:
        self.pool.submit(self._handle, request, client_address)

    def _handle(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - one broken connection is logged, the server goes on
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    def set_app(self, application) -> None:
        host = self.server_address[0]
        if is_loopback(host.decode() if isinstance(host, bytes) else str(host)):
            application = LoopbackHosts(application, self.server_address[1])
        super().set_app(application)

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class LoopbackHosts:
    """The app behind a check of each request's ``Host``: on a loopback address only requests
    addressed to ``localhost``, ``127.0.0.1`` or ``[::1]`` on ``port`` are answered, others get
    421 and a line saying why. A page from elsewhere cannot read the runs by pointing a name of its
    own at 127.0.0.1 (DNS rebinding): the browser sends that name as the Host."""

    NAMES = ("localhost", "127.0.0.1", "[::1]")

    def __init__(self, app, port: int) -> None:
        self.app, self.port = app, port
        self.allowed = {f"{name}:{port}" for name in self.NAMES} | (set(self.NAMES) if port == 80 else set())

    def __call__(self, environ: dict, start_response):
        host = environ.get("HTTP_HOST", "").strip().lower()
        if host in self.allowed:
            return self.app(environ, start_response)
        body = (
            f"421 Misdirected Request: Host {host or '(none)'!r} is not this server. headatlas serve listens on "
            f"loopback and answers only requests addressed to localhost, 127.0.0.1 or [::1] on port {self.port} "
            f"(so that no other site can read the runs through a name of its own); open "
            f"http://127.0.0.1:{self.port}/, or pass --host to listen elsewhere.\n"
        ).encode()
        start_response(
            "421 Misdirected Request",
            [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
        )
        return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]


class RawPathHandler(WSGIRequestHandler):
    """wsgiref's handler, with the request's path as sent (``REQUEST_URI``): PATH_INFO has %2F undone,
    and a run named ``a/b`` is one segment only in the path as sent."""

    def get_environ(self) -> dict:
        environ = super().get_environ()
        environ["REQUEST_URI"] = self.path
        return environ


class QuietHandler(RawPathHandler):
    """One line per request on stderr: method, address, status (what wsgiref logs, shorter)."""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        sys.stderr.write(f"{self.command} {self.path} → {args[1] if len(args) > 1 else ''}\n")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(app, host: str, port: int, *, quiet: bool = False) -> PooledServer:
    """A server for ``app`` listening on ``host``:``port`` (0: any free port)."""
    try:
        server = PooledServer((host, port), QuietHandler if not quiet else _Silent)
    except OSError as exc:
        if exc.errno in (98, 48, 10048):  # in use (Linux, macOS, Windows)
            raise ParameterError(
                f"--port {port}: in use on {host}; pass another port, or --port 0 for any free one"
            ) from None
        raise ParameterError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    server.set_app(app)
    return server


class _Silent(RawPathHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


def url_of(server: PooledServer) -> str:
    host, port = server.server_address[:2]
    name = host.decode() if isinstance(host, bytes) else str(host)
    shown = f"[{name}]" if ":" in name else name
    return f"http://{shown}:{port}/"
