"""The `headatlas` command group and the one place where a user's mistake becomes one line on
stderr: the Typer app, its global options (``--version``, ``--data-path``) and the error mapping."""

from __future__ import annotations

import functools
import os

import typer
from typer.core import TyperGroup

try:  # typer vendors its own click from 0.25 on; its usage errors are that click's
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer on the public click
    from click.exceptions import UsageError  # type: ignore[assignment]  # the same class, in click itself

from headatlas.cli.console import stdout
from headatlas.cli.messages import error
from headatlas.service.errors import FlagTerms, HeadatlasError

INTERRUPTED = "interrupted; re-run the same command to resume"


class Commands(TyperGroup):
    """The one place where a user's mistake becomes one line on stderr and exit code 2.

    Domain errors (service.errors) and click's usage errors print ``error: …``; Ctrl-C prints the
    resume hint and exits 130. Everything else is a bug and keeps its traceback.
    """

    # options whose value may be left out (typer has no such option): the value they then take
    OPTIONAL_VALUES = {"--control": "1"}

    def parse_args(self, ctx, args):
        args = list(args)
        _take_data_path(args)
        for i in reversed(range(len(args))):
            if args[i] in self.OPTIONAL_VALUES and (i + 1 == len(args) or not args[i + 1].isdigit()):
                args.insert(i + 1, self.OPTIONAL_VALUES[args[i]])
        return super().parse_args(ctx, args)

    def main(self, *args, **kwargs):
        from headatlas.cli.help import plain_help

        plain_help(self)  # value names instead of types, help sentences unbroken
        return super().main(*args, **kwargs)

    def invoke(self, ctx):
        from headatlas.service.interrupts import sigint_seen

        with sigint_seen() as pressed:
            try:
                return super().invoke(ctx)
            except HeadatlasError as exc:
                error(exc.render(cli_terms()))
                raise SystemExit(exc.exit_code) from None
            except UsageError as exc:
                if not exc.format_message():  # "no arguments: show the help" is not a mistake
                    raise
                where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
                error(f"{exc.format_message()} (see `{where} --help`)")
                raise SystemExit(exc.exit_code) from None
            except KeyboardInterrupt:
                error(INTERRUPTED)
                raise Interrupted(130) from None
            except Exception:
                # Ctrl-C does not always arrive as a KeyboardInterrupt: an import it lands in fails
                # with an ImportError (Cython's module init turns it into one), and work it broke
                # in another thread raises that thread's error. After a Ctrl-C it is the interrupt.
                if pressed():
                    error(INTERRUPTED)
                    raise Interrupted(130) from None
                raise


class CliTerms(FlagTerms):
    """A parameter as the command line spells it: the flag of the option of that name (the
    effects' ``kinds`` is ``--effects``), read from the commands; every option name has one flag."""

    def __init__(self, flags: dict[str, str]) -> None:
        self.flags = flags

    def flag(self, name: str) -> str:
        return self.flags.get(name) or super().flag(name)


@functools.cache
def cli_terms() -> CliTerms:
    """The terms of this command line, read once from its commands (all registered by now)."""
    import typer.main

    flags: dict[str, str] = {}

    def read(command) -> None:
        for param in command.params:
            long = [o for o in param.opts if o.startswith("--")]
            if long and param.name:
                flags.setdefault(param.name, long[0])
        for sub in getattr(command, "commands", {}).values():
            read(sub)

    read(typer.main.get_command(app))
    return CliTerms(flags)


class Interrupted(SystemExit):
    """Ctrl-C, said and handled: what was finished is stored and every file is closed."""


def _take_data_path(args: list[str]) -> None:
    """``--data-path DIR`` anywhere on the command line (before or after the command, as users
    write ``--db``): it names where the lakes this command opens keep their files, so it becomes
    HEADATLAS_DATA_PATH for the command and its children."""
    for i, arg in enumerate(args):
        if arg == "--":
            return
        if arg == "--data-path" and i + 1 < len(args):
            os.environ["HEADATLAS_DATA_PATH"] = args[i + 1]
            del args[i : i + 2]
            return
        if arg.startswith("--data-path="):
            os.environ["HEADATLAS_DATA_PATH"] = arg.split("=", 1)[1]
            del args[i]
            return


app = typer.Typer(
    cls=Commands,
    help="headatlas: what the attention heads of a transformer do, at corpus scale, stored and queryable.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion: bash, zsh, fish, PowerShell
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from headatlas import __version__

        stdout.print(f"headatlas {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
    data_path: str | None = typer.Option(
        None,
        "--data-path",
        envvar="HEADATLAS_DATA_PATH",
        help="Where a lake (--db ducklake:…) keeps its Parquet files: a folder or a shared mount, as this machine "
        "sees it; needed when a lake is created (it is recorded there), and on hosts that mount it elsewhere. "
        "Taken anywhere on the command line.",
    ),
) -> None:
    """headatlas: what the attention heads of a transformer do, at corpus scale, stored and queryable."""
    if data_path:
        os.environ["HEADATLAS_DATA_PATH"] = data_path  # every lake this command (and its children) opens
