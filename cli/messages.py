"""What the command says on stderr: notes, warnings, the one error line, the progress bar, and the
commands they quote spelled as ``headatlas`` is typed here."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.text import Text

from headatlas.cli.console import stderr

if TYPE_CHECKING:  # rich.progress is imported by the commands that draw a bar
    from rich.progress import Progress


def note(text: str) -> None:
    """A ``note: …`` line on stderr, its quoted commands spelled as they are typed here
    (``said``: wrapped to a terminal, whole elsewhere)."""
    said(runnable(f"note: {text}"))


def said(text: str) -> None:
    """A note or warning on stderr: wrapped between words at the terminal's width when stderr is
    a terminal; whole (one line, to grep) when it is a file or a pipe."""
    stderr.print(text, markup=False, highlight=False, soft_wrap=not stderr.is_terminal)


def command_name() -> str:
    """How headatlas is typed here: ``headatlas`` when that is on PATH (and is this program), else
    the path this process was started by, e.g. ``.venv/bin/headatlas`` after ``make demo`` in a
    shell where the virtual environment is not activated."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is None or script.name != "headatlas" or not script.is_file():
        return "headatlas"  # the console script was not how this process started (tests, python -m)
    found = shutil.which("headatlas")
    try:
        if found and os.path.samefile(found, script):
            return "headatlas"
    except OSError:
        pass
    path = os.path.relpath(script.absolute())
    if path.startswith(".."):
        path = str(script.absolute())
    elif os.sep not in path:
        path = os.path.join(".", path)
    return shlex.quote(path)


def runnable(text: str) -> str:
    """``text`` with every quoted command (`headatlas …`) spelled as it is typed here."""
    name = command_name()
    return text if name == "headatlas" else text.replace("`headatlas ", f"`{name} ")


def error(message: str) -> None:
    """The CLI's one error line: messages that span lines (a driver's) are joined; the commands
    it quotes are spelled as they are typed here (``runnable``)."""
    line = runnable(" ".join(part.strip() for part in str(message).splitlines() if part.strip()))
    stderr.print(Text.assemble(("error:", "bold red"), " ", line), highlight=False, soft_wrap=True)


def progress_bar(what: str, count: str) -> Progress:
    """A progress bar on stderr, as analyze and submit --wait show it: ``what``, the bar, its
    percentage, ``count`` (a column over the task's fields), windows/s (the ``rate`` field),
    elapsed time and ETA."""
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(what),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn(count),
        TextColumn("{task.fields[rate]:.1f} windows/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=stderr,
    )
