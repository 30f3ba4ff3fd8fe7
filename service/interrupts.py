"""Ctrl-C, as the user pressed it.

Python raises the KeyboardInterrupt of a Ctrl-C in whatever the main thread runs at that moment.
Where that is a destructor (``__del__``: the regex module frees its compiled sets as syntok is
imported), a weakref or a garbage collector callback, the interpreter prints "Exception ignored
in ..." and drops it: `analyze` on a 50 MB corpus then went on for an hour as if nothing had been
pressed, and printed a traceback. Within ``sigint_seen()`` a SIGINT is noted as well as raised,
the interpreter's report of an interrupt it dropped is left unprinted, and ``stop_if_pressed()``,
called before each batch goes through the model, raises the interrupt again where it was lost.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# one entry per sigint_seen() in force on the main thread, innermost last: the SIGINTs it noted
_watching: list[list[int]] = []


@contextmanager
def sigint_seen() -> Iterator[Callable[[], bool]]:
    """Whether a real SIGINT arrived meanwhile (``pressed()``): a KeyboardInterrupt a plugin
    raises itself is its fault, one from Ctrl-C is the user's. The handler in place still acts on
    the signal. Off the main thread no handler can be set: every KeyboardInterrupt is the caller's
    own, and ``pressed()`` is False."""
    seen: list[int] = []
    before = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if before is None:  # off the main thread, or a handler not set from Python: left as it is
        yield lambda: False
        return

    def noted(signum: int, frame: Any) -> None:
        seen.append(signum)
        if callable(before):
            before(signum, frame)
        elif before != signal.SIG_IGN:
            raise KeyboardInterrupt

    def unraisable(unraisable: Any) -> None:
        if seen and isinstance(unraisable.exc_value, KeyboardInterrupt):
            return  # the interrupt is not lost: stop_if_pressed() raises it (no traceback printed)
        hook(unraisable)

    hook = sys.unraisablehook
    signal.signal(signal.SIGINT, noted)
    sys.unraisablehook = unraisable
    _watching.append(seen)
    try:
        yield lambda: bool(seen)
    finally:
        del _watching[next(i for i, w in enumerate(_watching) if w is seen)]  # by identity: [] == []
        sys.unraisablehook = hook
        signal.signal(signal.SIGINT, before)


def stop_if_pressed() -> None:
    """Raise KeyboardInterrupt where a Ctrl-C was pressed within a ``sigint_seen()`` and the
    interrupt it raised was lost (once per press). Called where work may begin: a batch's forward
    pass. Not while a KeyboardInterrupt is being handled (clean-up after a Ctrl-C that arrived)."""
    if not any(_watching) or threading.current_thread() is not threading.main_thread():
        return  # (a press noted before an inner sigint_seen() began is in an outer one's list alone)
    if isinstance(sys.exc_info()[1], KeyboardInterrupt):
        return
    for seen in _watching:
        seen.clear()  # said: a later press is a new one
    raise KeyboardInterrupt
