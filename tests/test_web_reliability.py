"""`headatlas serve` under load and attack, on the real server (a loopback port, its own threads, real
sockets) over one stored run whose name, tags, alias, corpus file name and corpus text are markup:
the page cache bounded in bytes, a slow SQL statement holding up no page, idle and trickling
connections, an overlong request line, requests another site's page makes, the SQL answer's byte
cap, stored markup rendered as text, paths outside the app, the Host check and a burst of requests."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import pytest
from web_support import Client, serving

from tests.figure_checks import analyse

NAME = '"><img src=x onerror=alert(1)>'
TAG = "<script>alert(2)</script>"
ALIAS = "<b onmouseover=alert(3)>"
MARKUP = '<script>alert(4)</script> "><img src=x onerror=alert(5)> <svg onload=alert(6)>'
SLOW = "SELECT count(*) + {k} AS n FROM range(100000000000)"


@pytest.fixture(scope="module")
def stored(tmp_path_factory, tiny_model, demo_corpus):
    """One run of the tiny model over a corpus whose every sentence carries markup, in a file whose
    name is markup; named, tagged and aliased with markup."""
    from headatlas.service.storage import run_labels
    from headatlas.service.storage.store import Store

    folder = tmp_path_factory.mktemp("webrel")
    text = demo_corpus.read_text(encoding="utf-8").split("\n\n")[0].strip()
    sentences = [f"{MARKUP} {s.strip()}" for s in text.split(". ")[:12]]
    corpus = folder / "<img src=x onerror=alert(7)>.txt"
    corpus.write_text(". ".join(sentences) + "\n", encoding="utf-8")
    db = folder / "web.duckdb"
    run = analyse(corpus, db, tiny_model, name=NAME, seq_len=64)
    store = Store(db)
    store.tag_run(run.run_id, [TAG], [])
    with store.write() as conn:
        run_labels.add_alias(conn, run.run_id, ALIAS)
    return db, store.get_run(run.run_id)


@pytest.fixture()
def app(stored):
    from headatlas.service.web.app import WebApp

    return WebApp(str(stored[0]))


def get(url: str, headers: dict | None = None, *, timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """Status, headers and body of a GET (an error status is an answer too)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 - our loopback server
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def raw(base: str, data: bytes, *, timeout: float = 10.0) -> bytes:
    """What the server answers to ``data`` sent as is on a socket of its own."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


class Markup(HTMLParser):
    """The elements and attributes a page's HTML makes (what a browser would build)."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))


def assert_text_only(page: str, where: str) -> None:
    """No element or attribute of the stored markup: the app's own script only, no handler, no image."""
    for tag, attrs in Markup(page).tags:
        assert tag not in ("img", "iframe", "object", "embed", "b"), (where, tag, attrs)
        assert tag != "script" or attrs == {"src": "/static/app.js", "defer": None}, (where, attrs)
        assert tag != "svg" or not any(a.startswith("on") for a in attrs), (where, attrs)
        assert not any(name.startswith("on") for name in attrs), (where, tag, attrs)
        assert not any(str(v).strip().lower().startswith("javascript:") for v in attrs.values()), (where, attrs)


# --- stored markup -----------------------------------------------------------------------------------


def test_names_tags_aliases_corpus_text_and_anchors_are_text_on_every_page(stored, app):
    from headatlas.service.web.html import e

    _, run = stored
    client = Client(app)
    r = run.run_id
    shown = {
        "/runs": (NAME, TAG, ALIAS),
        f"/runs?tag={TAG}": (NAME, TAG),
        f"/runs/{r}": (NAME, TAG, ALIAS, run.corpus),
        f"/runs/{r}/sql?q=SELECT+preview+FROM+documents": ("<script>alert(4)</script>",),
        f"/runs/{r}/sql?q=SELECT+source+FROM+documents": (run.corpus,),
    }
    for path, texts in shown.items():
        answer = client.get(path)
        assert answer.status == 200, path
        assert_text_only(answer.text, path)
        for text in texts:
            assert e(text) in answer.text, (path, text)
    # the anchors: every head's, as its JSON lists them, shown escaped on its page; some hold markup
    anchors: list[str] = []
    for layer in range(run.n_layers):
        for head in range(run.n_heads):
            path = f"/runs/{r}/heads/{layer}/{head}"
            listed = client.get(path + ".json").json()["top_anchors"]
            page = client.get(path)
            assert page.status == 200, path
            assert_text_only(page.text, path)
            for anchor in listed:
                assert e(anchor) in page.text, (path, anchor)
            anchors += listed
    assert any(set(a) & set('<>"') for a in anchors), anchors  # the test saw markup in anchors
    # the example window's tokens and text travel as JSON (the page's script sets them as text)
    example = client.get(f"/runs/{r}/heads/0/0/example.json")
    assert example.status == 200 and example.headers["Content-Type"] == "application/json"
    assert any("<" in t or ">" in t for t in example.json()["tokens"])


# --- paths, hosts ------------------------------------------------------------------------------------


def test_no_path_outside_the_app_is_served_over_the_socket(app):
    secret = Path("pyproject.toml").read_text(encoding="utf-8")[:40]
    with serving(app) as base:
        port = base.rsplit(":", 1)[1]
        for path in (
            "/static/../../etc/passwd",
            "/static/../pyproject.toml",
            "/static/%2e%2e/%2e%2e/etc/passwd",
            "/static/%2E%2E%2F%2E%2E%2Fetc%2Fpasswd",
            "/static/..%2f..%2fpyproject.toml",
            "/static/%252e%252e/pyproject.toml",
            "/static/..\\..\\pyproject.toml",
            "/static/%5c..%5c..%5cpyproject.toml",
            "/static/....//....//etc/passwd",
            "/%2e%2e/%2e%2e/etc/passwd",
            "/static/app.js%00.py",
            "/static//etc/passwd",
            "/runs/..%2f..%2f..%2fetc%2fpasswd",
        ):
            answer = raw(base, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
            status = int(answer.split(b" ", 2)[1])
            assert status in (400, 404), (path, answer[:200])
            assert secret.encode() not in answer and b"root:" not in answer, path


def test_on_a_loopback_port_another_host_name_is_refused_over_the_socket(app):
    with serving(app) as base:
        port = base.rsplit(":", 1)[1]
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}", f"10.0.0.1:{port}"):
            answer = raw(base, f"GET /runs.json HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            assert answer.startswith(b"HTTP/1.0 421"), (host, answer[:100])
        assert raw(base, f"GET /runs.json HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n".encode()).startswith(
            b"HTTP/1.0 200"
        )


# --- another site's page -----------------------------------------------------------------------------


def test_work_another_sites_page_asks_for_is_refused(stored, app):
    r = stored[1].run_id
    with serving(app) as base:
        sql = f"{base}/runs/{r}/sql?q=SELECT+42+AS+answer"
        own = base.removeprefix("http://")
        for headers in (
            {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"},
            {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors"},
            {"Origin": "http://evil.example"},
            {"Origin": "null"},
            {"Referer": "http://evil.example/page.html"},
            {"Referer": f"http://{own.split(':')[0]}:1/other-app"},
        ):
            for url in (
                sql,
                sql.replace("/sql?", "/sql.csv?"),
                f"{base}/runs/{r}/heads/0/0/example.json",
                f"{base}/runs/{r}/try?text=a+text",  # a text of one's own, on the try-it page and a head's
                f"{base}/runs/{r}/heads/0/0?text=a+text",
            ):
                status, _, body = get(url, headers)
                assert status == 403, (url, headers, status)
                assert b"came from another site" in body, (url, headers)
        # the refusal links the same address: a click on it is this app's own request
        _, _, page = get(sql, {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})
        assert b'id="open-here" href="/runs/' in page and b"q=SELECT+42+AS+answer" in page
        # another site's page loading a page as an image, a script, a fetch: refused; linking to it: answered
        assert get(f"{base}/runs/{r}", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"})[0] == 403
        assert get(f"{base}/runs.json", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"})[0] == 403
        assert get(f"{base}/runs/{r}", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})[0] == 200
        # this app's pages, an address typed, curl: answered
        for headers in (
            {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "navigate"},
            {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors", "Origin": f"http://{own}"},
            {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate"},
            {},
        ):
            status, _, body = get(sql, headers)
            assert status == 200 and b"42" in body, (headers, status)


# --- the SQL page's bounds ----------------------------------------------------------------------------


def test_an_answer_over_the_byte_cap_is_refused_in_one_line_and_not_kept(stored, app, monkeypatch):
    from headatlas.service.web import sql_page

    monkeypatch.setattr(sql_page, "SQL_MAX_BYTES", 2**20, raising=False)
    client = Client(app)
    r = stored[1].run_id
    big = "SELECT repeat('x', 10000) || k AS v FROM range(300) t(k)"  # 3 MB
    for ext in ("", ".json", ".csv"):
        answer = client.get(f"/runs/{r}/sql{ext}", {"q": big})
        assert answer.status == 400, ext
        said = answer.json()["error"] if ext else answer.text
        assert "passed 1 MiB" in said and "add LIMIT" in said, ext
        assert len(answer.body) < 100_000, ext
    assert app.memo.bytes < 2**20
    fits = client.get(f"/runs/{r}/sql.json", {"q": big + " LIMIT 50"})
    assert fits.status == 200 and len(fits.json()) == 50


def test_the_page_cache_is_bounded_in_bytes(stored, app):
    from headatlas.service.web.reads import Memo, approx_bytes

    app.memo = Memo(max_bytes=8 * 2**20)
    client = Client(app)
    r = stored[1].run_id
    statements = [f"SELECT repeat('x', 10000) || k AS v FROM range({150 + i}) t(k)" for i in range(6)]  # 1.5 MB each
    for statement in statements:
        assert client.get(f"/runs/{r}/sql.json", {"q": statement}).status == 200
    kept = [v for v, _ in app.memo._items.values() if hasattr(v, "rows")]
    measured = sum(len(value) for answer in kept for row in answer.rows for value in row)
    assert 0 < len(kept) < len(statements) and measured <= 8 * 2**20, (len(kept), measured)
    assert app.memo.bytes <= 8 * 2**20
    # an answer over a quarter of the bound is not kept at all
    huge = "SELECT repeat('x', 10000) || k AS v FROM range(250) t(k)"
    assert client.get(f"/runs/{r}/sql.json", {"q": huge}).status == 200
    assert not any(len(getattr(v, "rows", ())) == 250 for v, _ in app.memo._items.values())
    # the estimate is within a factor of two of a measured answer, and costs no walk over every row
    rows = [(f"{'y' * 1000}{k}", k, float(k)) for k in range(100_000)]
    assert 100_000 * 1000 < approx_bytes(rows) < 2 * 100_000 * (1000 + 200)
    started = time.perf_counter()
    approx_bytes([rows] * 1000)
    assert time.perf_counter() - started < 1.0


def test_a_slow_statement_holds_up_no_page_and_others_are_told_busy(stored, app, monkeypatch):
    """Ten statements that would run to the time limit: two run, the rest are answered 503 at once;
    pages (one read before, one not) are answered while they run."""
    monkeypatch.setenv("HEADATLAS_SQL_TIMEOUT_S", "10")
    monkeypatch.setenv("HEADATLAS_SQL_THREADS", "1")  # each runs its 10 s on one core, not on every core
    r = stored[1].run_id
    with serving(app) as base:
        assert get(f"{base}/runs")[0] == 200  # kept: the next /runs reads nothing
        answers: list[tuple[float, int, bytes]] = []

        def slow(k: int) -> None:
            status, _, body = get(f"{base}/runs/{r}/sql.json?q=" + urllib.request.quote(SLOW.format(k=k)), timeout=60)
            answers.append((time.monotonic(), status, body))

        pool = ThreadPoolExecutor(10)
        began = time.monotonic()
        for k in range(10):
            pool.submit(slow, k)
        time.sleep(2)  # two statements run (to their 10 s limit); the others are told busy
        cached = get(f"{base}/runs", timeout=8)
        fresh = get(f"{base}/runs/{r}/heads/1/3", timeout=8)
        answered = time.monotonic()
        pool.shutdown(wait=True)
        busy = [a for a in answers if a[1] == 503]
        assert cached[0] == 200 and fresh[0] == 200
        finished = sorted(t for t, status, _ in answers if status != 503)
        # answered while the two statements ran (they run to their 10 s limit)
        assert len(finished) == 2 and answered < finished[0], (answered - began, [t - began for t in finished])
        assert len(busy) == 8 and all(b"(at most 2 at once); try again" in body for _, _, body in busy)
        assert all(json.loads(body)["status"] == 400 for t, s, body in answers if s != 503)  # the time limit


# --- connections -------------------------------------------------------------------------------------


def test_idle_and_trickling_connections_hold_up_no_request(app, monkeypatch):
    from headatlas.service.web import server

    monkeypatch.setattr(server, "READ_TIMEOUT_S", 2.0, raising=False)
    monkeypatch.setattr(server, "HEAD_DEADLINE_S", 3.0, raising=False)
    with serving(app) as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        idle = [socket.create_connection((host, int(port))) for _ in range(12)]
        trickle = socket.create_connection((host, int(port)))
        began = time.monotonic()
        status, _, _ = get(f"{base}/runs.json", timeout=1.5)
        assert status == 200
        # the idle ones are closed after READ_TIMEOUT_S; the trickling one at HEAD_DEADLINE_S, though
        # it sends a byte every half second (each read within the time limit)
        closed = threading.Event()

        def dribble() -> None:
            try:
                for byte in b"GET /runs.json HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                    trickle.sendall(bytes([byte]))
                    time.sleep(0.5)
            except OSError:
                closed.set()

        worker = threading.Thread(target=dribble, daemon=True)
        worker.start()
        for sock in idle:
            sock.settimeout(10)
            assert sock.recv(100) == b""  # closed by the server, nothing said
            sock.close()
        assert time.monotonic() - began < 9
        worker.join(12)
        assert closed.is_set() and time.monotonic() - began < 12
        trickle.close()


def test_past_the_connection_bound_a_connection_is_answered_503_at_once(app, monkeypatch):
    from headatlas.service.web import server

    monkeypatch.setattr(server, "CONNECTIONS", 4, raising=False)
    monkeypatch.setattr(server, "READ_TIMEOUT_S", 2.0, raising=False)
    with serving(app) as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        held = [socket.create_connection((host, int(port))) for _ in range(4)]
        time.sleep(0.2)
        status, headers, body = get(f"{base}/runs.json", timeout=1.5)
        assert status == 503 and b"4 connections are open already" in body and headers["Retry-After"] == "1"
        for sock in held:
            sock.settimeout(10)
            assert sock.recv(10) == b""
            sock.close()
        time.sleep(0.2)
        assert get(f"{base}/runs.json", timeout=5)[0] == 200


def test_a_request_line_over_64_kb_is_answered_414_in_one_log_line(stored, capfd):
    from headatlas.service.web.app import WebApp
    from headatlas.service.web.server import bind, url_of

    server = bind(WebApp(str(stored[0])), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        base = url_of(server).rstrip("/")
        port = base.rsplit(":", 1)[1]
        line = f"GET /runs/1/sql?q={'x' * 70_000} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        answer = raw(base, line)
        assert answer.startswith(b"HTTP/1.0 414"), answer[:200]
        assert b"the request line is over 65536 bytes" in answer
        assert get(f"{base}/runs.json")[0] == 200
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    logged = capfd.readouterr().err.strip().splitlines()
    assert len(logged) == 2 and "414" in logged[0] and "200" in logged[1], logged
    assert "Traceback" not in "".join(logged) and len(logged[0]) < 300


def test_a_burst_of_200_requests_20_at_once_is_answered_and_leaves_the_server_as_it_was(stored, app):
    r = stored[1].run_id
    paths = [
        "/runs",
        "/runs.json",
        f"/runs/{r}",
        f"/runs/{r}.json",
        f"/runs/{r}/heads/0/1",
        "/static/app.js",
        "/static/style.css",
        "/no/such/page",
        f"/runs/{r}/sql.json?q=SELECT+1",
        "/progress.json",
    ]
    with serving(app) as base:
        for path in paths:  # each read once: the burst is of the server, not of first reads
            get(base + path)
        threads_before, rss_before = threading.active_count(), _rss()
        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda i: get(base + paths[i % len(paths)], timeout=60)[0], range(200)))
        assert len(answers) == 200 and all(s < 500 for s in answers), sorted(set(answers))
        assert answers.count(404) == 20
        time.sleep(0.5)
        # the connections' threads stay (reused), at most one per connection the burst held at once
        assert threading.active_count() - threads_before <= 20 + 1
        assert _rss() - rss_before < 200 * 2**20


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_example_windows_asked_together_hold_two_workers_at_most(stored, app):
    """One window is computed, one more waits; a third asked meanwhile is answered 503 at once, and a page
    that reads the database is answered (the waiting windows hold no connection)."""
    r = stored[1].run_id
    path = f"/runs/{r}/heads/0/0/example.json"
    client = Client(app)
    with ThreadPoolExecutor(4) as pool:
        app.examples._lock.acquire()  # a window being computed: every other waits for it
        try:
            waiting = [pool.submit(client.get, path) for _ in range(2)]
            for _ in range(100):
                if getattr(app.examples, "_asked", 0) == 2:
                    break
                time.sleep(0.05)
            third = pool.submit(client.get, path).result(timeout=10)
            assert third.status == 503 and "another waits for its turn" in third.json()["error"]
            assert third.headers["Retry-After"] == "3"
            assert pool.submit(client.get, f"/runs/{r}/heads/1/2").result(timeout=10).status == 200
        finally:
            app.examples._lock.release()
        assert [w.result(timeout=60).status for w in waiting] == [200, 200]
