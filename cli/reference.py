"""The CLI reference, docs/cli.md, generated from every command's ``--help``.

    python -m headatlas.cli.reference          # rewrite docs/cli.md
    python -m headatlas.cli.reference --check  # exit 1 when docs/cli.md is stale (run by the tests)

Generated in a fixed terminal width and without HEADATLAS_* variables, so that the defaults shown
are the built-in ones, whoever runs it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
WIDTH = "100"

HEADER = """# CLI reference

Generated from `headatlas … --help` by `python -m headatlas.cli.reference` (a test fails when this page is
stale). Layers and heads are 0-based everywhere. Every `HEADATLAS_*` variable is listed by
`headatlas config`.
"""


def command_paths(group, prefix=()):
    """(path, command) of every leaf command, in the order they are registered."""
    for name, command in getattr(group, "commands", {}).items():
        path = (*prefix, name)
        if hasattr(command, "commands"):
            yield path, command
            yield from command_paths(command, path)
        else:
            yield path, command


def render() -> str:
    import typer.main
    from typer.testing import CliRunner

    from headatlas.cli.main import app

    runner = CliRunner()
    env = {"TERMINAL_WIDTH": WIDTH, "COLUMNS": WIDTH, "NO_COLOR": "1"}
    parts = [HEADER]
    for path, _command in [((), None), *command_paths(typer.main.get_command(app))]:
        result = runner.invoke(app, [*path, "--help"], prog_name="headatlas", env=env)
        if result.exit_code != 0:
            raise SystemExit(f"headatlas {' '.join(path)} --help failed: {result.output}")
        text = "\n".join(line.rstrip() for line in result.output.strip("\n").splitlines())
        title = "headatlas" + "".join(f" {p}" for p in path)
        parts.append(f"## `{title}`\n\n```text\n{text}\n```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is stale: run `python -m headatlas.cli.reference` and commit the result", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    for variable in [v for v in os.environ if v.startswith("HEADATLAS_")]:
        del os.environ[variable]
    sys.exit(main())
