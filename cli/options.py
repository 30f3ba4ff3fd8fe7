"""Options shared by several commands, each declared once.

Settings come in through Typer's own ``envvar=``: ``--help`` shows ``[env var: HEADATLAS_DB]`` and
nothing is read from the environment until a command runs, so a bad value is a one-line usage
error, not a traceback at import. The analysis options come from their declaration
(service/analysis_options.py) through ``analysis_options``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import typer

from headatlas.cli.formats import Format
from headatlas.service.analysis_options import BY_NAME, OPTIONS, PARAM_NAMES, Declared, build_params
from headatlas.service.config import Settings
from headatlas.service.params import AnalysisParams


def setting(name: str, *decls: str, help: str, **kwargs) -> Any:  # noqa: A002 - typer's name
    """An option whose default is a Settings field, overridden by its HEADATLAS_* variable. Typed
    ``Any`` as ``typer.Option`` is: it stands as the default of a parameter of the value's type."""
    from headatlas.service.config import check_setting

    flag = next((d for d in decls if d.startswith("--")), None)

    def check(value):  # the range declared with the setting, whether from the option or its variable
        return value if value is None else check_setting(name, value, flag=flag)

    return typer.Option(
        Settings.default(name), *decls, envvar=f"HEADATLAS_{name.upper()}", help=help, callback=check, **kwargs
    )


Db = setting(
    "db",
    "--db",
    help="Results database: a DuckDB file, or a lake (ducklake:postgres:dbname=… host=…, ducklake:FILE.ducklake).",
)
Broker = setting("broker_url", "--broker", help="Redis URL of the queue.")
At = typer.Option(
    None,
    "--at",
    min=0,
    metavar="SNAPSHOT",
    help="Read the database as of this snapshot (a lake: every commit is one; `headatlas runs` shows each run's "
    "last), so that numbers taken later are the same.",
)
Run = typer.Option(
    None, "--run", "-r", help="Run id, name or alias (default: the latest finished run, controls aside)."
)
Fmt = typer.Option(Format.table, "--format", "-f", help="Output format.")
Columns = typer.Option(
    None,
    "--columns",
    metavar="NAME,…",
    help="Show these columns, comma-separated, in any format (with --ci, each with its interval).",
)
Wide = typer.Option(False, "--wide", help="Show every column in the table, however wide.")


def check_run_name(name: str | None) -> str | None:
    """A run name is printable text that cannot be read as a run id."""
    from headatlas.service.storage.run_labels import check_name

    return None if name is None else check_name(name)


Name = typer.Option(
    None,
    "--name",
    help="Run name (default: corpus name + key). A run with the same corpus, model and parameters stored under "
    "another name is reused, and this name becomes its alias.",
    callback=check_run_name,
)
Ci = typer.Option(
    False,
    "--ci",
    help="Add 95% intervals (<metric>_lo, <metric>_hi; delete-one-group jackknife with the t quantile, by the run's replicate groups, named in interval_by; SPEC §5d).",
)
Loglevel = typer.Option("info", "--loglevel", "-l", help="Log level (debug, info, warning).")
WriterWait = typer.Option(20.0, "--writer-wait", help="Seconds to wait for the writer to create the run.")


_DECLARED = object()

# --help shows the declared options in panels of their own, each a table sized to its options: one
# list of 30 left a 26-character column for the descriptions at 100 columns
PANELS = {
    "Model": ("model", "device", "dtype", "batch_size"),
    "Windows and statistics": (
        "seq_len",
        "windowing",
        "max_windows",
        "sentences",
        "select",
        "gate",
        "include_special",
        "vectors",
        "short_range",
        "csm_bin",
        "examples",
        "replicates",
    ),
    "Extra measures": ("attribution", "mixing", "effects", "effect_reference", "probe", "measures"),
    "How much of them": ("attribution_windows", "effect_windows", "effect_spread", "probe_length", "probe_sequences"),
    "Corpus files": ("text_field", "encoding"),
}
PANEL_OF = {name: panel for panel, names in PANELS.items() for name in names}


def declared_option(option: Declared, *, help: str | None = None, default: Any = _DECLARED) -> Any:  # noqa: A002
    """The Typer option of one declared analysis option; another ``default`` (e.g. None: "unchanged")
    drops the environment variable, which would otherwise stand in for a value not given."""
    decls = [f"{option.flag}/--no-{option.flag[2:]}" if option.type is bool else option.flag, *option.aliases]
    if option.short:
        decls.append(option.short)
    text = help or option.help
    if option.spec:
        text = f"{text} (SPEC {option.spec})"
    envvar = option.envvar if default is _DECLARED else None
    if default is _DECLARED:
        default = list(option.default) if option.type == list[str] else option.default
    return typer.Option(
        default, *decls, envvar=envvar, help=text, min=option.min, rich_help_panel=PANEL_OF.get(option.name)
    )


@dataclass(frozen=True)
class AnalysisOptions:
    """The declared analysis options a command was given, by name, as typed (``values``): the
    library's requests validate them (service/operations/requests.py); ``params`` and the other
    properties read them for a command that needs no request."""

    values: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def params(self) -> AnalysisParams:
        """The validated analysis parameters."""
        return build_params(**{name: v for name, v in self.values.items() if name in PARAM_NAMES})

    def _given(self, name: str) -> Any:
        return self.values.get(name, BY_NAME[name].default)

    @property
    def model(self) -> str:
        return self._given("model")

    @property
    def device(self) -> str:
        return self._given("device")

    @property
    def batch_size(self) -> str:
        return self._given("batch_size")

    @property
    def text_field(self) -> str:
        return self._given("text_field")

    @property
    def encoding(self) -> str:
        return self._given("encoding")

    @property
    def probe_spec(self):
        """The synthetic probe asked for (``ProbeSpec``), or None without ``--probe``."""
        from headatlas.service.operations.requests import probe_of

        return probe_of(self.values)


def check_named_some(values: dict[str, Any]) -> None:
    """``--effects ''`` or ``--mixing ,`` asks for a list and names nothing in it: refused in one
    line listing the kinds (it was read as none, and the run went on without what was asked)."""
    from headatlas.service.errors import Param, ParameterError
    from headatlas.service.params import EFFECT_KINDS, MIXING

    for name, kinds in (("effects", EFFECT_KINDS), ("mixing", MIXING)):
        given = values.get(name)
        if not given:  # not given: the declared default, none
            continue
        parts = [given] if isinstance(given, str) else [str(part) for part in given]
        if not any(kind.strip() for part in parts for kind in part.split(",")):
            raise ParameterError(
                Param(name, ",".join(parts), quoted=True), f": name at least one of {', '.join(kinds)}"
            )


def analysis_options(*names: str, exclude: tuple[str, ...] = (), help: dict[str, str] | None = None) -> Callable:  # noqa: A002
    """Give a command the declared analysis options and pass it one ``analysis: AnalysisOptions``.

    ``names``: the options to offer (default: all of them, in declaration order, less
    ``exclude``); an option not offered takes its declared default. The command's signature is
    rewritten so that Typer, ``--help`` and the CLI reference see every option; the options take
    the place of the ``analysis`` parameter.
    """
    chosen = [o for o in OPTIONS if (o.name in names if names else o.name not in exclude)]
    unknown = set(names) - set(BY_NAME)
    if unknown:
        raise ValueError(f"not a declared analysis option: {sorted(unknown)}")
    texts = help or {}

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        declared = [
            inspect.Parameter(
                o.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=declared_option(o, help=texts.get(o.name)),
                annotation=o.type,
            )
            for o in chosen
        ]
        params = []
        for p in signature.parameters.values():
            if p.name == "analysis":
                params.extend(declared)
            else:
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(command)
        def run(**kwargs):
            values = {o.name: kwargs.pop(o.name) for o in chosen}
            check_named_some(values)
            return command(analysis=AnalysisOptions(values), **kwargs)

        del run.__wrapped__  # Typer reads the rewritten signature, not the command's
        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # read by inspect, unknown to wraps' type
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate
