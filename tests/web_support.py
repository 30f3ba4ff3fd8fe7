"""The web app under test: an in-process client, a real server on a loopback port, headless Chromium.

``Client`` calls the WSGI application directly (no socket, no thread): what a route answers.
``serving`` runs the real HTTP server (``service.web.server``) on 127.0.0.1 and a free port in a
thread, for the browser. ``chromium`` starts Debian's Chromium through its chromedriver with
selenium, headless, in a fresh profile, or says why it cannot (then the browser tests skip).
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlencode
from wsgiref.util import setup_testing_defaults

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8")

    def json(self):
        return json.loads(self.body)


class Client:
    """GET and HEAD on a WSGI application, in this process."""

    def __init__(self, app) -> None:
        self.app = app

    def get(
        self, path: str, query: dict | list | None = None, *, method: str = "GET", host: str | None = None
    ) -> Answer:
        path, _, raw = path.partition("?")
        environ: dict = {
            "REQUEST_METHOD": method,
            # the path as sent (the server's handler passes it on), and as the server decodes it
            "REQUEST_URI": quote(path, safe="/%"),
            # decoded as a server decodes it (wsgiref: %XX undone, the bytes as latin-1 characters, PEP 3333)
            "PATH_INFO": unquote(quote(path, safe="/%"), "latin-1"),
            "QUERY_STRING": raw or (urlencode(query, doseq=True) if query else ""),
            "wsgi.input": io.BytesIO(),
        }
        if host is not None:
            environ["HTTP_HOST"] = host
        setup_testing_defaults(environ)
        said: dict = {}

        def start_response(status, headers, exc_info=None):
            said["status"], said["headers"] = int(status.split()[0]), dict(headers)

        body = b"".join(self.app(environ, start_response))
        return Answer(said["status"], said["headers"], body)


@contextmanager
def serving(app) -> Iterator[str]:
    """The app behind the real server on 127.0.0.1 and a free port; yields its address."""
    from headatlas.service.web.server import bind, url_of

    server = bind(app, "127.0.0.1", 0, quiet=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield url_of(server).rstrip("/")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def chromium_missing() -> str | None:
    """Why a real browser cannot be driven here, or None."""
    if shutil.which("chromium") is None:
        return "Debian `chromium` is not installed (`apt-get install -y chromium chromium-driver`; .ci/run installs it)"
    if shutil.which("chromedriver") is None:
        return "Debian `chromium-driver` is not installed (`apt-get install -y chromium-driver`; .ci/run installs it)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return None


@contextmanager
def chromium(downloads: Path | None = None, *, width: int = 1400, height: int = 1000):
    """Headless Chromium (Debian's, through its chromedriver: nothing downloaded), a fresh profile;
    ``downloads``: where files it downloads go."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="headatlas-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    if downloads is not None:
        options.add_experimental_option(
            "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
        )
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        if downloads is not None:
            driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
