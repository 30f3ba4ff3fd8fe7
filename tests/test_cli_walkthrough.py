"""README.md, followed word for word: its commands run top to bottom in a fresh folder, in-process
(typer's CliRunner), on the real default model; a command that fails, or a line this test cannot
run, fails the test — so the README cannot drift from the tool.

What runs: every line of the README's ```bash blocks and every ```python block, in order. A few
lines are set-up this test stands in for, each said here:

- ``make demo`` / ``make test``: the virtual environment and the test suite themselves (this test
  is part of it); ``source .venv/bin/activate``: putting ``headatlas`` on PATH; ``.venv/bin/pip
  install -e '.[pandas]'``: the test extra holds pandas.
- ``cp service/data/wiki_excerpt.txt corpus.txt``: copies the excerpt's first document only (12
  windows), so that every analysis takes seconds.
- ``--model smollm2``: ``random:llama``, a small Llama-family decoder (the same adapter and probe),
  not SmolLM2's minutes-long first conversion; tests/test_adapters.py loads SmolLM2 itself.
- The "At scale" block (a writer, workers and a beat on Redis): tests/test_queue_*.py run it
  against servers of their own.

And the docs' captured terminal tables (docs/usage.md, ``make terminal-tables``) fit 100 columns.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from headatlas.cli.main import app
from tests.conftest import headatlas_cmd

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SET_UP = ("make", "source", ".venv/bin/pip")  # done by the environment this test runs in
NOT_HERE = "At scale"  # the distributed section: Redis and Celery processes
MODELS = {"smollm2": "random:llama"}


def steps(text: str) -> list[tuple[str, str, str]]:
    """(section, language, code) of every code line of a bash block and every python block, in order."""
    out = []
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title = section.splitlines()[0]
        for language, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.DOTALL):
            if language == "bash":
                out += [(title, "bash", line) for line in body.splitlines() if line.strip()]
            elif language == "python":
                out.append((title, "python", body))
    return out


def test_steps_cover_every_command_block():
    found = steps(README.read_text(encoding="utf-8"))
    sections = {title for title, _, _ in found}
    assert {"Two commands", "First commands", "Compare runs, the random floor, and the head atlas"} <= sections
    assert sum(1 for _, language, _ in found if language == "python") >= 1
    assert sum(1 for _, _, line in found if line.startswith("headatlas ")) >= 15


def invoke(args: list[str], input: str | None = None):
    args = [MODELS.get(a, a) if i and args[i - 1] in ("--model", "-m") else a for i, a in enumerate(args)]
    return CliRunner().invoke(app, args, input=input, env={"COLUMNS": "100", "NO_COLOR": "1"})


def copy_corpus(source: Path, target: Path) -> None:
    target.write_text(source.read_text(encoding="utf-8").split("\n\n")[0].strip() + "\n", encoding="utf-8")


def run_line(line: str, folder: Path) -> str | None:
    """Run one README line in ``folder``; return its output, or None for set-up done elsewhere."""
    words = shlex.split(line, comments=True)
    if not words or words[0] in SET_UP:
        return None
    if words[0] == "cp":
        copy_corpus(ROOT / words[1], folder / words[2])
        return ""
    stdin = None
    if words[0] == "echo" and "|" in words:
        stdin, words = " ".join(words[1 : words.index("|")]), words[words.index("|") + 1 :]
    assert words[0] == "headatlas", f"README line this walkthrough cannot run: {line!r}"
    if words[1:2] == ["serve"]:
        return serve_once(words[1:], folder)
    result = invoke(words[1:], input=stdin)
    assert result.exit_code == 0, f"{line!r} failed ({result.exit_code}):\n{result.stdout}\n{result.stderr}"
    assert "error:" not in result.stderr, (line, result.stderr)
    if not {"--format", "-f"} & set(words):  # tables and text, not CSV or JSON
        for out in result.stdout.splitlines():
            assert len(out) <= 100, f"{line!r}: a line wider than 100 columns: {out!r}"
    return result.stdout + result.stderr


def serve_once(args: list[str], folder: Path) -> str:
    """``headatlas serve`` runs until stopped: start the command, read the runs page it serves
    (on a free port, not the README's, which another program may hold), then stop it."""
    process = subprocess.Popen(
        [*headatlas_cmd(), *args, "--port", "0"],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "100"},
    )
    try:
        line = process.stdout.readline()
        address = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert address, f"headatlas serve printed {line!r}"
        with urllib.request.urlopen(f"http://127.0.0.1:{address.group(1)}/runs.json", timeout=120) as answer:
            names = [run["name"] for run in json.loads(answer.read())]
        assert "mine" in names, names
        return line
    finally:
        process.terminate()
        process.wait(30)


def test_the_readme_runs_top_to_bottom(tmp_path, monkeypatch):
    for variable in ("HEADATLAS_DB", "HEADATLAS_MODEL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(tmp_path)
    said = {}
    for section, language, code in steps(README.read_text(encoding="utf-8")):
        if section.startswith(NOT_HERE):
            continue
        if language == "python":
            exec(compile(code, f"README.md ({section})", "exec"), {"__name__": "readme"})
            continue
        out = run_line(code, tmp_path)
        if out is not None:
            said[code] = out
    # what the walkthrough relies on: a name asked for an identical analysis names that run too
    wiki = next(out for line, out in said.items() if "--name wiki" in line)
    assert "'wiki' now names it too" in wiki
    assert (tmp_path / "mine.html").is_file() and (tmp_path / "atlas.png").is_file()
    layers = next(out for line, out in said.items() if line.startswith("headatlas query layers"))
    assert "run 1 (mine): layers" in layers and "\n5 " in layers  # six layers, 0-based


def test_captured_terminal_tables_fit_100_columns():
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- terminal: (.+?) -->\n```text\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) >= 2
    for command, body in blocks:
        assert body.startswith(f"$ headatlas {command}\n"), command
        assert all(len(line) <= 100 for line in body.splitlines()), command
