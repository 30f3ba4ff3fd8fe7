"""The docs stay honest: every command has help text and appears in the README."""

from __future__ import annotations

from pathlib import Path

import typer.main

from cli.main import app
from service.config import Settings

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def _commands(group, prefix=()):
    for name, command in getattr(group, "commands", {}).items():
        path = (*prefix, name)
        if hasattr(command, "commands"):
            yield from _commands(command, path)
        else:
            yield path, command


def test_every_command_has_help_and_is_in_the_readme():
    root = typer.main.get_command(app)
    found = list(_commands(root))
    assert len(found) >= 10
    for path, command in found:
        name = "headatlas " + " ".join(path)
        assert (command.help or "").strip(), f"{name} has no help text"
        assert name in README, f"{name} is not in README.md"


def test_every_setting_is_documented():
    for variable, _default, meaning in Settings.help():
        assert meaning.strip()
        assert variable in README, f"{variable} is not in README.md"
