"""The library's errors and notices in the terms of the Python API: a parameter is a keyword
argument (``seq_len=0``, ``ci=True``), a suggested command the call that does the same
(``headatlas.connect(db).runs()``), rendered from the error's fields (service/errors.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import PurePath
from typing import Any, TypeVar

from headatlas.service.errors import NO_VALUE, HeadatlasError, Param, Phrase, Placeholder

F = TypeVar("F", bound=Callable[..., Any])


class PythonTerms:
    """A parameter as a keyword argument: ``name=value`` with the value as a Python literal
    (``select='top:7'``, ``layer=5``, ``ci=True``), a placeholder as it is (``attribution_windows=N``)
    and a parameter named without a value as ``name=...``."""

    def param(self, param: Param) -> str:
        value = param.value
        if value is NO_VALUE:
            return f"{param.name}=..."
        if isinstance(value, Placeholder):
            return f"{param.name}={value}"
        if isinstance(value, PurePath):
            value = str(value)
        return f"{param.name}={value!r}"

    def phrase(self, phrase: Phrase) -> str:
        return phrase.python if phrase.python is not None else phrase.cli


PYTHON = PythonTerms()


def in_python_terms(fn: F) -> F:
    """Raise the library's errors from ``fn`` with their messages in Python terms, from ``fn``
    itself: the frames inside the library that found the bad value are dropped (the message names
    the argument and its fix; a caller's traceback ends at the call it made), and so is an
    implicit chain (``During handling …``), which adds nothing to such a message. An explicit cause
    (``raise … from exc``) stays. Any other exception keeps its whole traceback: that is a bug."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HeadatlasError as exc:
            exc.args = (exc.render(PYTHON),)
            if exc.__cause__ is None:
                exc.__suppress_context__ = True
            error = exc.with_traceback(None)
            del exc
            raise error  # noqa: B904  (its own cause, or none, as set above)

    return wrapper  # type: ignore[return-value]
