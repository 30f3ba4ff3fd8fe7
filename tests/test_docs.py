"""The docs stay honest: every command has help text and a generated reference entry, the
reference is current, the README stays a front door and its links resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import typer.main

from headatlas.cli.main import app
from headatlas.cli.reference import command_paths
from headatlas.service.config import Settings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CLI_REFERENCE = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")


def test_every_command_has_help_and_a_reference_entry():
    found = [(p, c) for p, c in command_paths(typer.main.get_command(app)) if not hasattr(c, "commands")]
    assert len(found) >= 10
    for path, command in found:
        name = "headatlas " + " ".join(path)
        assert (command.help or "").strip(), f"{name} has no help text"
        assert f"## `{name}`" in CLI_REFERENCE, f"{name} is not in docs/cli.md: run `python -m headatlas.cli.reference`"


def test_cli_reference_is_current():
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEADATLAS_")}
    done = subprocess.run(
        [sys.executable, "-m", "headatlas.cli.reference", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_readme_is_a_front_door():
    assert len(README.splitlines()) <= 200
    for command in ("make demo", "make test", "headatlas query heads", "headatlas sql"):
        assert command in README, command


def test_every_local_link_resolves():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def test_every_setting_is_documented():
    config = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for variable, _default, meaning in Settings.help():
        assert meaning.strip()
        assert variable in config, f"{variable} is not in docs/configuration.md"


def test_reliability_timings_are_current():
    """docs/reliability.md's table of the queue's timings is generated from their declarations
    (workers/policy.py): a timing added or changed there and not in the docs fails here."""
    from headatlas.workers import policy

    doc = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    assert policy.BEGIN in doc and policy.END in doc
    assert policy.with_timings(doc) == doc, "docs/reliability.md is stale: run `python -m headatlas.workers.policy`"
