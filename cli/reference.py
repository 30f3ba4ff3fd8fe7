"""The CLI reference, docs/cli.md, generated from every command's ``--help``; the metric list,
docs/metrics.md, from the metric declarations (``service.metrics``, as ``headatlas metrics``); the
settings table of docs/configuration.md, from the settings' declarations (``service.config``, as
``headatlas config``).

    python -m headatlas.cli.reference          # rewrite docs/cli.md, docs/metrics.md, the settings table
    python -m headatlas.cli.reference --check  # exit 1 when one is stale (run by the tests)

Generated in a fixed terminal width and without HEADATLAS_* variables, so that the defaults shown
are the built-in ones, whoever runs it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
METRICS_OUT = OUT.with_name("metrics.md")
CONFIG_OUT = OUT.with_name("configuration.md")
TABLE_START, TABLE_END = "<!-- settings table: generated, see cli/reference.py -->", "<!-- end of settings table -->"
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


def render_metrics() -> str:
    from headatlas.service.metrics import METRICS

    lines = [
        "# Metrics",
        "",
        "Generated from the metric declarations (`service/metrics.py`) by `python -m headatlas.cli.reference`",
        "(a test fails when this page is stale); `headatlas metrics` prints the same list. Every column is in",
        "the views `head_metrics` and `layer_metrics` (and their `*_reps` rows for intervals); how to add one:",
        "[Adding a metric](architecture.md#adding-a-metric).",
        "",
        "An installed plugin's metrics follow these in `headatlas metrics` (with their origin and sums) and in",
        "the views after `headatlas db upgrade`: columns over these sums, their own per-head sums (stored by",
        'name in `named_head_sums`, quoted in SQL: `"punct_pairs.both_punct"`) and their own earlier columns,',
        "shown by `query heads` (`--sort`, `--columns`, `--ci`), the Python API and the web page alike:",
        "[Plugin sums and columns](architecture.md#plugin-sums-and-columns).",
        "",
        "| column | SPEC | definition | SQL over the summed totals |",
        "|---|---|---|---|",
    ]
    for metric in METRICS:
        for c in metric.columns:
            sql = c.sql.replace("|", "\\|")
            lines.append(f"| `{c.name}` | {metric.spec} | {c.definition} | `{sql}` |")
    lines += ["", "Sums (additive over windows, kept per replicate group):", ""]
    lines += ["| sum | per | type | metric |", "|---|---|---|---|"]
    for metric in METRICS:
        for s in metric.sums:
            lines.append(f"| `{s.name}` | {s.scope.value} (`{s.scope.table}`) | {s.kind.__name__} | {metric.name} |")
    return "\n".join(lines) + "\n"


def render_configuration(page: str) -> str:
    """docs/configuration.md with its settings table made again from the declarations: each
    variable's default, allowed values and meaning."""
    from headatlas.service.config import Settings, allowed

    lines = [TABLE_START, "| variable | default | allowed | meaning |", "|---|---|---|---|"]
    for var, default, meaning in Settings.help():
        name = var[len("HEADATLAS_") :].lower()
        shown = f"`{default}`" if default else "—"
        lines.append(f"| `{var}` | {shown} | {allowed(name).text} | {meaning} |")
    lines.append(TABLE_END)
    head, rest = page.split(TABLE_START, 1)
    return head + "\n".join(lines) + rest.split(TABLE_END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pages = {OUT: render(), METRICS_OUT: render_metrics()}
    pages[CONFIG_OUT] = render_configuration(CONFIG_OUT.read_text(encoding="utf-8"))
    if "--check" in argv:
        for path, text in pages.items():
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                print(
                    f"{path} is stale: run `python -m headatlas.cli.reference` and commit the result", file=sys.stderr
                )
                return 1
        return 0
    for path, text in pages.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    for variable in [v for v in os.environ if v.startswith("HEADATLAS_")]:
        del os.environ[variable]
    sys.exit(main())
