"""The library's errors in the terms of the Python API: keyword arguments, not the CLI's flags."""

from __future__ import annotations

import functools
import inspect as _inspect
import re
from collections.abc import Callable
from typing import Any, TypeVar

from headatlas.service.analysis_options import BY_NAME
from headatlas.service.errors import HeadatlasError

F = TypeVar("F", bound=Callable[..., Any])


# CLI flags whose keyword argument has another name
_ARGUMENT_OF_FLAG = {"timeout": "timeout_s", "method": "methods"}
# words that follow a flag in prose, never as its value ("pass --db in a writable folder")
_PROSE = frozenset(
    "a an and alone are as at by for from had in is it needs not now of on only or takes that the to was "
    "which with".split()
)
_FLAG = re.compile(r"--([a-z][a-z0-9-]*)(\s+(?:'[^']*'|\"[^\"]*\"|\S+?)(?=[:;,.)`]*(?:\s|$)))?")
_COMMANDS = (
    (re.compile(r"`headatlas runs`"), "`headatlas.connect(db).runs()`"),
    (re.compile(r"(?:run )?`headatlas analyze CORPUS[^`]*`"), "call `headatlas.analyze(corpus, db=...)`"),
)


@functools.cache
def _python_arguments() -> dict[str, bool]:
    """Every keyword argument of the public functions and methods: name -> whether it is a flag
    (a bool), so that ``--ci`` reads ``ci=True``."""
    from headatlas.service.api.analysis import analyze
    from headatlas.service.api.inspection import inspect
    from headatlas.service.api.views import Atlas, RunView, connect

    out = {name: option.type is bool for name, option in BY_NAME.items()}
    callables = [analyze, connect, inspect, *(m for cls in (Atlas, RunView) for m in vars(cls).values())]
    for fn in callables:
        if callable(fn):
            for p in _inspect.signature(fn).parameters.values():
                if p.name not in ("self", "options"):
                    out.setdefault(p.name, isinstance(p.default, bool))
    return out


def python_terms(message: str) -> str:
    """A message of the library, in the terms of its Python API: ``--seq-len 0: …`` becomes
    ``seq_len=0: …``, ``--ci`` ``ci=True``, and a suggested ``headatlas runs`` / ``headatlas
    analyze`` command the call that does the same. Other commands (``headatlas db upgrade``) and
    flags that are no argument here (``pip install --no-deps``) stay as they are."""
    for pattern, call in _COMMANDS:
        message = pattern.sub(call, message)
    arguments = _python_arguments()

    def keyword(match: re.Match) -> str:
        flag, value = match.group(1), (match.group(2) or "")
        name = _ARGUMENT_OF_FLAG.get(flag, flag.replace("-", "_"))
        if name not in arguments:
            return match.group(0)
        word = value.strip()
        if not word or word in _PROSE:
            return (f"{name}=True" if arguments[name] else f"{name}=") + value
        if word[0] in "'\"" or re.fullmatch(r"-?\d+(\.\d+)?|[A-Z][A-Z0-9_]*|\{.*\}", word):
            return f"{name}={word}"
        return f"{name}={word!r}"

    return _FLAG.sub(keyword, message)


def _in_python_terms(fn: F) -> F:
    """Raise the library's errors from ``fn`` with their messages in Python terms."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HeadatlasError as exc:
            exc.args = (python_terms(str(exc)),)
            raise

    return wrapper  # type: ignore[return-value]
