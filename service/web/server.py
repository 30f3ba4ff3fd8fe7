"""The HTTP server of ``headatlas serve``: the standard library's WSGI server, each connection on a
thread of its own (at most ``CONNECTIONS`` at once), at most ``WORKERS`` of them running the app at
once (a slow page, an example window being computed, does not hold up the others; the bound keeps
how many run at once, and the memory they take, fixed).

A connection is read with a time limit: one silent for ``READ_TIMEOUT_S`` seconds is closed, and its
request line and headers must arrive within ``HEAD_DEADLINE_S`` (a client trickling a byte at a time
holds a connection no longer). An idle connection so holds a connection's thread, never a worker, and
never for long; past ``CONNECTIONS`` a new one is answered 503 at once. A request line over
``MAX_LINE`` bytes is answered 414.

Bound to 127.0.0.1 unless told otherwise: the app has no accounts, and whoever reaches the port reads
every run.
"""

from __future__ import annotations

import ipaddress
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

from headatlas.service.errors import ParameterError

WORKERS = 8  # requests the app handles at once
CONNECTIONS = 64  # connections held at once (each on a thread: reading, waiting for a worker, writing)
READ_TIMEOUT_S = 15.0  # a connection silent this long (reading or writing) is closed
HEAD_DEADLINE_S = 30.0  # the request line and headers arrive within this, however slowly they trickle
WORKER_WAIT_S = 30.0  # a request waits this long for a worker, then is answered 503
MAX_LINE = 65536  # bytes of a request line (wsgiref's own bound), over it: 414


class PooledServer(WSGIServer):
    """A WSGI server: a thread per connection (``connections`` at most), ``workers`` of them in the
    app at once; ``read_timeout_s`` and ``head_deadline_s`` bound how long a connection is read
    (None: the module's ``READ_TIMEOUT_S`` and ``HEAD_DEADLINE_S`` as they are when it is made)."""

    daemon_threads = True
    request_queue_size = 128  # connections the kernel holds until accepted (a burst of them is accepted at once)

    def __init__(
        self,
        address: tuple[str, int],
        handler=None,
        *,
        workers: int | None = None,
        connections: int | None = None,
        read_timeout_s: float | None = None,
        head_deadline_s: float | None = None,
    ):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.workers = WORKERS if workers is None else workers
        self.connections = CONNECTIONS if connections is None else connections
        self.read_timeout_s = READ_TIMEOUT_S if read_timeout_s is None else read_timeout_s
        self.head_deadline_s = HEAD_DEADLINE_S if head_deadline_s is None else head_deadline_s
        self.worker_slots = threading.BoundedSemaphore(self.workers)
        self._slots = threading.BoundedSemaphore(self.connections)
        self._reading: dict[socket.socket, float] = {}  # connections reading a request head: their deadline
        self._cut: set[socket.socket] = set()
        self._reading_lock = threading.Lock()
        # before the base class binds: a port in use closes the server inside __init__
        self.pool = ThreadPoolExecutor(self.connections, thread_name_prefix="headatlas-web")
        super().__init__(address, handler or RawPathHandler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind asks DNS for this host's full name (seconds where no DNS answers)
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port
        self.setup_environ()

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse(request, self.connections)  # in the accepting thread: a few bytes, never waited on
            self.shutdown_request(request)
            return
        try:
            self.pool.submit(self._handle, request, client_address)
        except RuntimeError:  # the pool is shut down: the server is closing
            self._slots.release()
            self.shutdown_request(request)

    def _handle(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except (TimeoutError, ConnectionError):
            pass  # a client gone silent or away: nothing to answer
        except Exception:  # noqa: BLE001 - one broken connection is logged, the server goes on
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    # --- the deadline of a request's head (checked by serve_forever's loop) ---------------------------
    def reading(self, connection: socket.socket) -> None:
        with self._reading_lock:
            self._reading[connection] = time.monotonic() + self.head_deadline_s

    def read(self, connection: socket.socket) -> bool:
        """The head of ``connection``'s request is read; whether its deadline cut it short."""
        with self._reading_lock:
            self._reading.pop(connection, None)
            if connection in self._cut:
                self._cut.discard(connection)
                return True
            return False

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._reading_lock:
            late = [c for c, deadline in self._reading.items() if deadline <= now]
            for connection in late:
                del self._reading[connection]
                self._cut.add(connection)
        for connection in late:
            try:
                connection.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once
            except OSError:
                pass

    def set_app(self, application) -> None:
        application = Workers(application, self.worker_slots, self.workers)
        host = self.server_address[0]
        if is_loopback(host.decode() if isinstance(host, bytes) else str(host)):
            application = LoopbackHosts(application, self.server_address[1])
        super().set_app(application)

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _refuse(request: socket.socket, connections: int) -> None:
    body = f"503 Service Unavailable: {connections} connections are open already; try again in a moment\n".encode()
    head = (
        "HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        request.settimeout(0.2)
        request.sendall(head + body)
    except OSError:
        pass


class Workers:
    """The app behind a bound on how many requests run it at once (``slots``): a request waits for
    one up to ``WORKER_WAIT_S`` seconds, then is answered 503."""

    def __init__(self, app, slots: threading.BoundedSemaphore, workers: int) -> None:
        self.app, self.slots, self.workers = app, slots, workers

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        if not self.slots.acquire(timeout=WORKER_WAIT_S):
            body = (
                f"503 Service Unavailable: the server's {self.workers} workers were all busy for {WORKER_WAIT_S:g} s; "
                "try again in a moment\n"
            ).encode()
            start_response(
                "503 Service Unavailable",
                [
                    ("Content-Type", "text/plain; charset=utf-8"),
                    ("Content-Length", str(len(body))),
                    ("Retry-After", "5"),
                ],
            )
            return [body]
        try:
            return list(self.app(environ, start_response))  # the whole answer, then the slot is free
        finally:
            self.slots.release()


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
    and a run named ``a/b`` is one segment only in the path as sent. Its connection is read with the
    server's time limits; a request line over ``MAX_LINE`` bytes is answered 414."""

    server: PooledServer

    def setup(self) -> None:
        self.path = self.command = ""  # what a log line names before the request line is read
        super().setup()
        self.connection.settimeout(getattr(self.server, "read_timeout_s", None))  # each read and write

    def handle(self) -> None:
        watched = isinstance(self.server, PooledServer)
        if watched:
            self.server.reading(self.connection)
        try:
            self.raw_requestline = self.rfile.readline(MAX_LINE + 1)
            if len(self.raw_requestline) > MAX_LINE:
                self._too_long()
                return
            if not self.raw_requestline or not self.parse_request():  # closed, or an error was sent
                return
        except TimeoutError:
            self.close_connection = True
            return  # silent past the time limit: closed without a word
        finally:
            cut = watched and self.server.read(self.connection)
        if cut:
            return  # its head came too slowly: its socket is shut already
        application = self.server.get_app()
        if application is None:  # bind() sets one before the first request is read
            return
        handler = _Handler(self.rfile, cast("IO[bytes]", self.wfile), self.get_stderr(), self.get_environ())
        handler.request_handler = self  # type: ignore[attr-defined]  # wsgiref: its log line
        handler.run(application)

    def _too_long(self) -> None:
        self.requestline, self.request_version, self.command, self.close_connection = "", "HTTP/1.0", "", True
        body = (
            f"414 URI Too Long: the request line is over {MAX_LINE} bytes; pass a shorter address (a long SQL "
            "statement: shorten it)\n"
        ).encode()
        self.send_response_only(414)
        for name, value in (
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
        ):
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        self.log_request(414, len(body))
        # read (a bounded part of) what is left of the line, so that closing does not reset the
        # connection before the client has read the answer
        try:
            self.connection.settimeout(1.0)
            for _ in range(16):
                if self.rfile.readline(MAX_LINE).endswith(b"\n"):
                    break
        except OSError:
            pass

    def get_environ(self) -> dict:
        environ = super().get_environ()
        environ["REQUEST_URI"] = self.path
        return environ


class _Handler(ServerHandler):
    """wsgiref's, for which a client that stops reading (the write's time limit) is a client gone."""

    def handle_error(self) -> None:
        if isinstance(sys.exc_info()[1], TimeoutError):
            return  # nothing can reach it: no traceback, no error page
        super().handle_error()


class QuietHandler(RawPathHandler):
    """One line per request on stderr: method, address, status (what wsgiref logs, shorter)."""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        path = self.path if len(self.path) <= 200 else f"{self.path[:200]}… ({len(self.path)} characters)"
        sys.stderr.write(f"{self.command or '-'} {path or '-'} → {args[1] if len(args) > 1 else ''}\n")

    def log_error(self, format: str, *args) -> None:  # noqa: A002
        pass  # an error sent is logged by log_request, with its status: one line


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

    def log_error(self, format: str, *args) -> None:  # noqa: A002
        pass


def url_of(server: PooledServer) -> str:
    host, port = server.server_address[:2]
    name = host.decode() if isinstance(host, bytes) else str(host)
    shown = f"[{name}]" if ":" in name else name
    return f"http://{shown}:{port}/"
