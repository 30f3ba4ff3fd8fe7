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

    def __init__(self, address: tuple[str, int], handler=WSGIRequestHandler, *, workers: int = WORKERS):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        # before the base class binds: a port in use closes the server inside __init__
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="headatlas-web")
        super().__init__(address, handler)

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

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class QuietHandler(WSGIRequestHandler):
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


class _Silent(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


def url_of(server: PooledServer) -> str:
    host, port = server.server_address[:2]
    name = host.decode() if isinstance(host, bytes) else str(host)
    shown = f"[{name}]" if ":" in name else name
    return f"http://{shown}:{port}/"
