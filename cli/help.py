"""Help that reads as plain text: value names instead of Python types, sentences kept whole.

Typer shows a type beside every option (``--ci <bool>``, ``--run <str>``) and keeps a docstring's
single line breaks in the command list, so a sentence breaks where the source line did. Before
a command line is parsed (``Commands.main``), ``plain_help`` walks the command tree once: a flag
shows no value, an option the kind of value it takes (TEXT, INTEGER, NUMBER, PATH, or its
choices ``table|csv|json``), an argument its name in capitals, and every help text has its
paragraphs joined into single lines (the terminal wraps them).
"""

from __future__ import annotations

import inspect

from typer.core import TyperArgument, TyperOption

# typer's type labels (``<int range>`` …) and the value names shown instead
VALUE_NAMES = {
    "str": "TEXT",
    "int": "INTEGER",
    "int range": "INTEGER",
    "float": "NUMBER",
    "float range": "NUMBER",
    "list[str]": "TEXT",
    "list[int]": "INTEGER",
    "path": "PATH",
    "bool": "",
}


class PlainArgument(TyperArgument):
    """An argument shown by its name in capitals, in the usage line as in its panel."""

    def display_type_rich(self, ctx) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        name = name if self.required else f"[{name}]"
        return f"{name}..." if self.nargs != 1 else name


class PlainOption(TyperOption):
    """An option shown without its range beside its value name (``INTEGER [x>=1]``): a wider
    column for every option's description; a value out of range is refused naming the range."""

    def _get_number_range_help_str(self) -> str:
        return ""


def value_name(param) -> str:
    """What ``--help`` shows after an option: nothing for a flag, else the kind of value."""
    if getattr(param, "is_flag", False):
        return ""
    label = param.display_type(None).strip("<>")
    return VALUE_NAMES.get(label, label)


def plain_text(text: str | None) -> str | None:
    """Paragraphs joined into single lines: the terminal, not the source, decides the breaks."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def _flag_help_option(command) -> None:
    """``--help``/``-h`` is made per command when first asked for (it needs the context): show
    it as the flag it is."""
    made = command.get_help_option

    def get_help_option(ctx):
        option = made(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = get_help_option


def plain_help(command, seen: set[int] | None = None) -> None:
    """Rewrite the help of ``command`` and every command under it, in place (once each)."""
    seen = set() if seen is None else seen
    if id(command) in seen:
        return
    seen.add(id(command))
    command.help = plain_text(command.help)
    _flag_help_option(command)
    for param in command.params:
        if isinstance(param, TyperArgument):
            if not isinstance(param, PlainArgument):
                param.__class__ = PlainArgument
            if param.metavar is None:
                param.metavar = (param.name or "value").upper()
        elif param.metavar is None and hasattr(param, "display_type"):
            param.metavar = value_name(param)
        if type(param) is TyperOption:
            param.__class__ = PlainOption
        if getattr(param, "help", None):
            param.help = plain_text(param.help)
    for sub in getattr(command, "commands", {}).values():
        plain_help(sub, seen)
