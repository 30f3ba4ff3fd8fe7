"""`make test` relies on pytest-xdist's --dist loadgroup to run the tests of one shared setup (the
session's queue cluster, SmolLM2's converted weights, a module's own fixture) in one worker: made
once, not once per worker. pytest 9.2 with pytest-xdist 3.8 silently stopped grouping (xdist renames
a grouped test through an attribute pytest no longer reads), which made every such fixture twice.
This runs the installed pytest and pytest-xdist on a tiny suite grouped by the suite's own rule
(tests/suite_groups.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

GROUPS = Path(__file__).resolve().parent / "suite_groups.py"

CONFTEST = f"""
import importlib.util

import pytest

spec = importlib.util.spec_from_file_location("suite_groups", {str(GROUPS)!r})
suite_groups = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_groups)


@pytest.fixture(scope="session")
def smollm2():
    return 1


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    suite_groups.assign(items)
"""

NOTE = """
import os
import time
from pathlib import Path


def note(name):
    time.sleep(0.2)
    Path(os.environ["WHERE"], name).write_text(os.environ.get("PYTEST_XDIST_WORKER", "none"))
"""

SESSION = """
from note import note

def test_a1(smollm2): note("a1")
def test_a2(): note("a2")
def test_a3(): note("a3")
def test_a4(smollm2): note("a4")
def test_a5(): note("a5")
def test_a6(smollm2): note("a6")
"""

MODULE = """
import os
from pathlib import Path

import pytest
from note import note


@pytest.fixture(scope="module")
def made():
    with open(Path(os.environ["WHERE"]).parent / "made", "a") as log:
        log.write("made\\n")


def test_b1(made): note("b1")
def test_b2(made): note("b2")
def test_b3(made): note("b3")
def test_b4(made): note("b4")
"""


def test_tests_of_one_group_run_in_one_worker(tmp_path):
    suite, where = tmp_path / "suite", tmp_path / "where"
    suite.mkdir()
    where.mkdir()
    for name, text in [("conftest", CONFTEST), ("note", NOTE), ("test_session", SESSION), ("test_module", MODULE)]:
        (suite / f"{name}.py").write_text(text)
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
    assert len(workers) == 10 and set(workers.values()) <= {"gw0", "gw1"}, workers
    for group in (("a1", "a4", "a6"), ("b1", "b2", "b3", "b4")):
        ran = {workers[name] for name in group}
        assert len(ran) == 1, f"the tests of one group ran in workers {sorted(ran)}; {workers}"
    # the module's fixture, made once: in the one worker that ran its tests
    assert (tmp_path / "made").read_text() == "made\n"
