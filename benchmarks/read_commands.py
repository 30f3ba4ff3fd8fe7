"""What the reading commands cost in CPU on a finished run with effects, in this process.

    python benchmarks/read_commands.py [--repeats 9]

Analyses the shipped excerpt's first three documents with ``random:gpt2`` (``--seq-len 32
--sentences punct``, every kind of effect on 5 windows, as ``tests/test_effect_runs.py`` does), its
results stored at its end, then runs each reading command ``--repeats`` times in this process
(typer's runner, as the tests do) and prints the median and range of each one's process CPU
(``time.process_time``): ``query layers`` (without and with ``--ci``), ``query heads``, ``query
roles``, then ``effects RUN --format json`` asking for the windows the run holds already (nothing
left to measure: the run's effects read and shown), then ``query roles`` again (whether the stored
results stayed current). A first call of each, not
counted, imports what it needs; the CLI's command tree is built once, as the console script
builds it once per process (typer's runner would build it at every call). Run it in two checkouts to compare two versions of the code: each
makes its own run (a version reads only the results it stored itself).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMANDS = {
    "query layers": ["query", "layers"],
    "query layers --ci": ["query", "layers", "--ci"],
    "query heads": ["query", "heads"],
    "query roles": ["query", "roles"],
    "effects RUN": ["effects", "fx", "--effects", "zero,mean,gradient", "--windows", "5", "--format", "json"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    import typer.testing
    from typer.testing import CliRunner

    from headatlas.cli.main import app

    built = typer.testing._get_command(app)  # the command tree built once, as a console script does
    typer.testing._get_command = lambda _app: built

    folder = Path(tempfile.mkdtemp())
    from headatlas.service.engine.corpus import demo_corpus_path

    excerpt = demo_corpus_path().read_text(encoding="utf-8")
    corpus = folder / "three.txt"
    corpus.write_text("\n\n".join([d.strip() for d in excerpt.split("\n\n") if d.strip()][:3]) + "\n", encoding="utf-8")
    db = str(folder / "fx.duckdb")
    flags = ["--model", "random:gpt2", "--seq-len", "32", "--sentences", "punct", "--name", "fx", "-q"]
    effects = ["--effects", "zero,mean,gradient", "--effect-windows", "5", "--effect-reference", "4"]
    done = CliRunner().invoke(app, ["analyze", str(corpus), *flags, *effects, "--replicates", "window", "--db", db])
    assert done.exit_code == 0, done.output

    def run(name: str) -> float:
        start = time.process_time()
        result = CliRunner().invoke(app, [*COMMANDS[name], "--db", db])
        spent = time.process_time() - start
        assert result.exit_code == 0, (name, result.output)
        return spent

    reads = [name for name in COMMANDS if name != "effects RUN"]
    times: dict[str, list[float]] = {}
    for phase, names in (("", reads), ("", ["effects RUN"]), (" (after effects RUN)", ["query roles"])):
        for name in names:
            run(name)  # not counted: imports, caches (effects RUN's first records its windows in the run's row)
        for _ in range(args.repeats):
            for name in names:
                times.setdefault(name + phase, []).append(run(name))
    print(f"CPU seconds of each command, median (range) of {args.repeats}, in this process:")
    for name, spent in times.items():
        print(f"  {name:32s} {statistics.median(spent):.3f} ({min(spent):.3f}-{max(spent):.3f})")


if __name__ == "__main__":
    main()
