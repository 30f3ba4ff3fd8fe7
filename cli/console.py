"""The terminal every command writes to: the two consoles (stdout, stderr), the width tables and
text fit, and lines of text beside a table (titles, notes), wrapped or whole."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.text import Text

# Piped output is not wrapped at 80 columns: tables stay one row per line.
# markup=False: run, schedule and file names are data; a name such as "a[/x]" must print as
# written, not be read as a style tag (which raises MarkupError). Styled text is built as Text.
stdout = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 250, markup=False)
stderr = Console(stderr=True, markup=False)

# Tables fit a terminal's width, or $COLUMNS; each command's default columns are chosen to fit
# this many characters (the width tables fit when $COLUMNS says nothing else).
FIT_WIDTH = 100


def fit_width() -> int:
    """The width tables fit: the terminal's, else $COLUMNS, else FIT_WIDTH."""
    if stdout.is_terminal:
        return stdout.size.width
    try:
        return max(20, int(os.environ.get("COLUMNS", "")))
    except ValueError:
        return FIT_WIDTH


def wraps_text() -> bool:
    """Whether output fits ``fit_width()`` (tables leave columns out and wrap text, titles and
    notes wrap): on a terminal or with $COLUMNS set. Piped without it, every line stays whole
    (one note, one row: one line to grep), and tables show their default columns."""
    return stdout.is_terminal or bool(os.environ.get("COLUMNS", "").strip())


@contextmanager
def console_width(width: int) -> Iterator[None]:
    before = stdout._width  # None: the terminal's, or rich's default
    stdout.width = width
    try:
        yield
    finally:
        stdout._width = before


def print_trimmed(renderable, *, soft_wrap: bool = False) -> None:
    """Print without the spaces rich pads lines with, unless the output is a terminal (where they
    do not show, and cutting them could cut a style's codes): files and pipes get clean lines."""
    if stdout.is_terminal:
        stdout.print(renderable, highlight=False, soft_wrap=soft_wrap)
        return
    with stdout.capture() as captured:
        stdout.print(renderable, highlight=False, soft_wrap=soft_wrap)
    stdout.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def print_wrapped(text: str, *, style: str = "") -> None:
    """A line of text beside a table (a title, a summary), wrapped at the width tables fit where
    text wraps (``wraps_text``), else left whole."""
    if not wraps_text():
        print_trimmed(Text(text, style=style), soft_wrap=True)
        return
    with console_width(fit_width()):
        print_trimmed(Text(text, style=style))


def print_note(text: str) -> None:
    """A dim line under a table, wrapped at the width tables fit (``wraps_text``)."""
    print_wrapped(text, style="dim")
