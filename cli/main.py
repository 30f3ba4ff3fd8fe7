"""The `headatlas` command line: every command module registered on the one group (cli/app.py),
and the process's entry point. Thin: parse options, open the store, call the library, render."""

from __future__ import annotations

import logging
import os
import sys

from headatlas.cli import (
    analysis_commands,
    comparison_commands,
    db_commands,
    effects_command,
    query_commands,
    queue_commands,
    run_commands,
    schedule_commands,
    series_commands,
    serve_command,
    sql_commands,
    visual,
)
from headatlas.cli.app import INTERRUPTED, Interrupted, app, cli_terms
from headatlas.cli.messages import error
from headatlas.service.config import Settings
from headatlas.service.errors import HeadatlasError

__all__ = ["app", "main"]

# in the order `--help` lists them
analysis_commands.register(app)  # analyze, demo, models
query_commands.register(app)  # query heads|distances|boundaries|layers|mixing|discrepancy
comparison_commands.register(app, query_commands.query_app)  # compare, query roles
sql_commands.register(app)  # sql, metrics
db_commands.register(app)  # db …, config
app.add_typer(run_commands.runs_app, name="runs")  # list, rename, delete, tag
visual.register(app)  # inspect, plot …, report, export
effects_command.register(app)  # effects, prune
queue_commands.register(app)  # submit, worker, writer, status, retry
schedule_commands.register(app, query_commands.query_app)  # schedule …, beat, query trend
series_commands.register(app, query_commands.query_app, visual.plot_app)  # train-toy, query phases, plot trend
serve_command.register(app)  # serve: the runs in a browser


class _NoInterruptTracebacks(logging.Filter):
    """Ctrl-C can land while a library closes a connection; SQLAlchemy then logs the interrupt
    with a traceback. The user asked to stop: the one-line resume hint is the whole answer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


def main() -> None:
    for handler in [logging.lastResort, *logging.getLogger().handlers]:
        if handler is not None:
            handler.addFilter(_NoInterruptTracebacks())
    os.environ.setdefault("HF_HUB_OFFLINE", "1") if _default_model_only() else None
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        app()
    except Interrupted:
        _leave_now(130)
    except HeadatlasError as exc:  # raised outside a command (Commands.invoke maps those inside)
        error(exc.render(cli_terms()))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        error(INTERRUPTED)
        _leave_now(130)


def _leave_now(code: int) -> None:
    """Exit without the interpreter's teardown of torch and its threads, which took 2–4 s on a
    loaded machine after Ctrl-C; by now every finished result is stored and every file closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _default_model_only() -> bool:
    model = os.environ.get("HEADATLAS_MODEL", Settings.default("model"))
    return "--model" not in sys.argv and "-m" not in sys.argv and model == "default"


if __name__ == "__main__":
    main()
