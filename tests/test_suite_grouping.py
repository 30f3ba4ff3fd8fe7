"""`make test` relies on pytest-xdist's --dist loadgroup to run the tests of one shared fixture
(the session's queue cluster, SmolLM2's converted weights) in one worker: made once, not once per
worker. pytest 9.2 with pytest-xdist 3.8 silently stopped grouping (xdist renames a grouped test
through an attribute pytest no longer reads), which made every such fixture twice. This runs the
installed pytest and pytest-xdist on a tiny suite grouped as tests/conftest.py groups ours."""

from __future__ import annotations

import subprocess
import sys

CONFTEST = """
import pytest

@pytest.fixture(scope="session")
def shared():
    return 1

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "shared" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("shared"))
"""

TESTS = """
import os
import time
from pathlib import Path

def _note(name):
    time.sleep(0.2)
    Path(os.environ["WHERE"], name).write_text(os.environ.get("PYTEST_XDIST_WORKER", "none"))

def test_a1(shared): _note("a1")
def test_a2(): _note("a2")
def test_a3(): _note("a3")
def test_a4(shared): _note("a4")
def test_a5(): _note("a5")
def test_a6(shared): _note("a6")
"""


def test_tests_of_one_group_run_in_one_worker(tmp_path):
    suite, where = tmp_path / "suite", tmp_path / "where"
    suite.mkdir()
    where.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_grouped.py").write_text(TESTS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", str(suite)],
        cwd=suite,
        env={"WHERE": str(where), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    workers = {p.name: p.read_text() for p in where.iterdir()}
    assert len(workers) == 6 and set(workers.values()) <= {"gw0", "gw1"}, workers
    grouped = {workers[name] for name in ("a1", "a4", "a6")}
    assert len(grouped) == 1, f"the tests of one group ran in workers {sorted(grouped)}; {workers}"
