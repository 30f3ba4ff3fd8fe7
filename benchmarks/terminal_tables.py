"""The terminal captures of the docs: what a command prints in a 100-column terminal, from a real run.

    python benchmarks/terminal_tables.py [--db build/terminal-tables.duckdb] [--check]

``make terminal-tables`` runs it. It analyses the shipped excerpt with the default model into a
fresh database (run name ``demo``, with one random-weights control) and adds two schedules, then, for every block of a page that follows a marker

    <!-- terminal: query heads --top 5 -->

runs that command on the database, in-process, at 100 columns without colour, and writes its
output (stdout, then any stderr notes) into the ```text block under the marker, after a first
line ``$ headatlas query heads --top 5`` (a marker's command may end in ``| head -n N``: the first N
lines of its output). ``--check``: rewrite nothing, exit 1 when a block
differs. tests/test_cli_walkthrough.py checks that every captured line fits 100 characters.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGES = [ROOT / "docs" / "usage.md"]
WIDTH = "100"
BLOCK = re.compile(r"(<!-- terminal: (?P<command>.+?) -->\n```text\n)(?P<body>.*?)(```)", re.DOTALL)


def invoke(args: list[str]) -> tuple[int, str, str]:
    from typer.testing import CliRunner

    from headatlas.cli.main import app

    result = CliRunner().invoke(app, args, env={"COLUMNS": WIDTH, "NO_COLOR": "1", "TERM": "dumb"})
    return result.exit_code, result.stdout, result.stderr


def capture(command: str, db: Path) -> str:
    """``command``'s output; ``COMMAND | head -n N``: its first N lines of stdout (then stderr)."""
    args, _, head = command.partition(" | head -n ")
    code, out, err = invoke([*shlex.split(args), "--db", str(db)])
    if code != 0:
        raise SystemExit(f"headatlas {command} failed ({code}): {err.strip()}")
    if head:
        out = "".join(out.splitlines(keepends=True)[: int(head)])
    # stderr is not a terminal here, so its notes come whole: wrapped between words, as a
    # 100-column terminal shows them
    err = "".join(
        textwrap.fill(line, int(WIDTH), break_long_words=False, break_on_hyphens=False) + "\n"
        for line in err.splitlines()
    )
    return f"$ headatlas {command}\n{out}{err}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, default=ROOT / "build" / "terminal-tables.duckdb")
    parser.add_argument("--check", action="store_true", help="exit 1 when a captured block differs")
    args = parser.parse_args(argv)
    for variable in [v for v in os.environ if v.startswith("HEADATLAS_")]:
        del os.environ[variable]  # the built-in defaults, whoever runs it

    from headatlas.service.engine.corpus import demo_corpus_path

    args.db.parent.mkdir(parents=True, exist_ok=True)
    args.db.unlink(missing_ok=True)
    corpus = str(demo_corpus_path())
    for setup in (
        # the run and its random-weights control (compare's floor)
        ["analyze", corpus, "--name", "demo", "--control", "1", "--quiet"],
        # schedules for `schedule list` (its next fire is the day this runs)
        ["schedule", "add", "nightly", "--corpus", corpus, "--cron", "0 3 * * *"],
        ["schedule", "add", "new-files", "--corpus", corpus, "--every", "6h", "--only-new"],
    ):
        code, _, err = invoke([*setup, "--db", str(args.db)])
        if code != 0:
            raise SystemExit(f"{' '.join(setup[:2])} failed: {err.strip()}")
    stale = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        new = BLOCK.sub(lambda m: m.group(1) + capture(m.group("command"), args.db) + m.group(4), text)
        if new != text:
            stale.append(page)
            if not args.check:
                page.write_text(new, encoding="utf-8")
    for page in stale:
        print(f"{page.relative_to(ROOT)}: {'stale' if args.check else 'rewritten'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
